"""In-process simulation of a group: the product's own trainers, codecs and averaging.

N members, each with its own batches (the peer-keyed sampler a real peer uses), step
through rounds exactly as the protocol does -- contribute, encode (with error feedback),
decode the same bytes, average in roster order, apply -- without any network. It is
what ``bench.scaling`` uses to compare modes at equal tokens; the real-process part of
that benchmark checks the same numbers against real peers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from daisyweb.data import BatchSampler, builtin_tokens, default_tokenizer
from daisyweb.model import ModelConfig
from daisyweb.protocol.averaging import average_parts_in_roster_order
from daisyweb.protocol.codec import Codec, codec_by_name
from daisyweb.protocol.influence import clip_factors, squared_norm
from daisyweb.protocol.owners import (
    MeanEncoder,
    assemble_mean,
    part_bounds,
    part_payload,
    reduce_part,
)
from daisyweb.training.config import DEFAULTS, RunConfig
from daisyweb.training.evaluate import heldout_batches, heldout_loss
from daisyweb.training.rounds import LockstepTrainer, RoundTrainer, grid_lengths
from daisyweb.training.state import TrainState


@dataclass
class SimResult:
    peers: int
    sync_every: int
    codec: str
    outer_lr: float
    steps: int  # inner steps per peer
    curve: list[tuple[int, float]] = field(default_factory=list)  # (inner step, held-out)
    bytes_per_peer: int = 0  # payload bytes each peer sent to each other member
    exchange: str = "all"  # "all": all-to-all; "owner": each part reduced by its owner
    sent_by_first: int = 0  # payload bytes the first peer sent in all, to everyone
    compute_s: float = 0.0
    clipped: int = 0  # contributions the bounded-influence clip scaled down

    @property
    def final(self) -> float:
        return self.curve[-1][1]


def heldout_eval(run: RunConfig) -> Callable[[np.ndarray], float]:
    """``daisyweb-eval``'s held-out loss (its default fixed batches) of a parameter vector."""
    fixed = heldout_batches(run.model.seq)
    return lambda params: heldout_loss(run.model, params, fixed)


def simulate(peers: int, steps: int, sync_every: int = 1, codec: str = "f32",
             outer_lr: float = 1.0, eval_every: int = 50, batch: int = 8,
             lr: float = float(DEFAULTS["lr"]), seed: int = 0, overlap: int = 0,
             clip: bool = True,
             attack: Callable[[int, np.ndarray], np.ndarray] | None = None,
             exchange: str = "all", rejoin: tuple[int, str] | None = None) -> SimResult:
    """``clip``: bound each contribution as the members do (``protocol.influence``);
    ``attack(round, delta)``: what the last peer sends instead of its delta;
    ``exchange``: ``"all"`` (every member averages every contribution) or ``"owner"``
    (``protocol.owners``: each part's mean reduced by its owner, clipped per part, and
    encoded once more with the owner's error feedback); ``rejoin=(round, moments)``: the
    last peer comes back as a joiner at that round (no head start, no error feedback
    carried) with its inner moments ``"leader"`` (the first peer's, as a whole snapshot
    gives) or ``"zero"`` (a fresh inner optimizer at the group's step count)."""
    if exchange not in ("all", "owner"):
        raise ValueError(f"exchange must be 'all' or 'owner', got {exchange!r}")
    tok = default_tokenizer()
    train = np.asarray(builtin_tokens())  # the training part: the held-out 5% is not in it
    run = RunConfig(model=ModelConfig(vocab=tok.vocab_size), batch=batch, steps=steps,
                    lr=lr, seed=seed)
    evaluate = heldout_eval(run)
    names = [f"peer{i}" for i in range(peers)]
    samplers = {p: BatchSampler(train, batch=batch, seq=run.model.seq, seed=seed, peer=p)
                for p in names}
    trainers = {}
    for p in names:
        state = TrainState.fresh(run)
        trainers[p] = (LockstepTrainer(state) if sync_every == 1
                       else RoundTrainer(state, sync_every, outer_lr))
    encoders = {p: codec_by_name(codec).encoder(trainers[p].size) for p in names}
    decoder = codec_by_name(codec)
    res = SimResult(peers, sync_every, codec, outer_lr, steps, exchange=exchange)
    mean_encoders = {p: MeanEncoder(decoder, trainers[p].size) for p in names}
    lead = trainers[names[0]]
    res.curve.append((0, evaluate(lead.state.params)))
    lengths = grid_lengths(-(-steps // sync_every), steps, sync_every)
    rounds = len(lengths)
    next_eval = eval_every
    t0 = time.perf_counter()
    previous: dict[str, object] = {}
    for r in range(rounds):
        if rejoin is not None and r == rejoin[0]:
            _rejoin(trainers[names[-1]], trainers[names[0]], rejoin[1])
            previous.pop(names[-1], None)
            encoders[names[-1]] = codec_by_name(codec).encoder(lead.size)
        payloads = []
        for p in names:
            batch = lambda s, p=p: samplers[p].sample(s + 1)  # noqa: E731
            trainer = trainers[p]
            head = None
            if overlap and p in previous and isinstance(trainer, RoundTrainer):
                # As a peer does while round r-1's exchange is in flight (same maths;
                # here the anchor is already known, which the head start does not use).
                head = trainer.head_start(r, batch, previous[p], min(overlap, lengths[r]))
            c = (trainer.contribute(r, batch, lengths[r], head)
                 if isinstance(trainer, RoundTrainer) else trainer.contribute(r, batch))
            previous[p] = c
            trainer.stage(c)
            vector = c.vector
            if attack is not None and p == names[-1]:
                vector = attack(r, vector)
            payloads.append(encoders[p].encode(vector))
        res.bytes_per_peer += len(payloads[0])
        size = lead.size
        if exchange == "owner":
            mean = _owner_mean(decoder, payloads, size, names, mean_encoders, clip, res)
        else:
            res.sent_by_first += len(payloads[0]) * (peers - 1)
            factors: tuple[np.float32 | None, ...] = ()
            if clip:
                factors = clip_factors([squared_norm(decoder.decode_parts(b, size))
                                        for b in payloads])
                res.clipped += sum(f is not None for f in factors)
            mean = average_parts_in_roster_order(
                [decoder.decode_parts(b, size) for b in payloads], size, (), factors)
        for p in names:
            trainers[p].apply(mean)
        hashes = {trainers[p].weight_hash() for p in names}
        if len(hashes) != 1:
            raise AssertionError(f"replicas diverged at round {r}")
        done = lead.inner_steps
        if done >= next_eval or r == rounds - 1:
            res.curve.append((done, evaluate(lead.state.params)))
            next_eval = (done // eval_every + 1) * eval_every
    res.compute_s = time.perf_counter() - t0
    return res


def _rejoin(joiner: LockstepTrainer | RoundTrainer, leader: LockstepTrainer | RoundTrainer,
            moments: str) -> None:
    """The joiner's inner moments as a joiner starts them: the leader's or zero."""
    opt = joiner.state.optimizer
    state = opt.state_dict()
    if moments == "leader":
        state["m"], state["v"] = leader.state.optimizer.m.copy(), leader.state.optimizer.v.copy()
    elif moments == "zero":
        state["m"], state["v"] = np.zeros_like(opt.m), np.zeros_like(opt.v)
    else:
        raise ValueError(f"moments must be 'leader' or 'zero', got {moments!r}")
    opt.load_state_dict(state)


def _owner_mean(codec: Codec, payloads: list[bytes], size: int, names: list[str],
                encoders: dict[str, MeanEncoder], clip: bool, res: SimResult) -> np.ndarray:
    """The mean every member assembles from the owners' bytes (``protocol.owners``)."""
    bounds = part_bounds(size, len(names))
    sent = []
    for j, where in enumerate(bounds):
        parts = [part_payload(codec, b, size, where) for b in payloads]
        mean, clipped = reduce_part(codec, parts, where.stop - where.start, (), clip)
        res.clipped += len(clipped)
        sent.append(encoders[names[j]].encode(where, mean))
        if j != 0:
            res.sent_by_first += len(parts[0])  # the first peer's part to owner j
    res.sent_by_first += len(sent[0]) * (len(names) - 1)  # its mean part to everyone
    return assemble_mean(codec, sent, bounds, size)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=1)
    ap.add_argument("--codec", default="f32")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=float(DEFAULTS["lr"]))
    ap.add_argument("--overlap", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--exchange", choices=("all", "owner"), default="all")
    a = ap.parse_args()
    r = simulate(a.peers, a.steps, a.sync_every, a.codec, a.outer_lr, lr=a.lr,
                 overlap=a.overlap, seed=a.seed, eval_every=a.eval_every,
                 exchange=a.exchange)
    print(json.dumps({"peers": r.peers, "H": r.sync_every, "codec": r.codec,
                      "outer_lr": r.outer_lr, "lr": a.lr, "steps": r.steps,
                      "overlap": a.overlap, "seed": a.seed,
                      "exchange": r.exchange, "curve": r.curve, "bytes": r.bytes_per_peer,
                      "sent_by_first": r.sent_by_first,
                      "s": round(r.compute_s, 1)}))
