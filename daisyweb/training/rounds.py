"""Rounds of local steps (``--sync-every H``): what a member contributes and how it is applied.

Lockstep (H = 1) exchanges a gradient every step and every member takes the same
DaisyAdam step on the roster's average (:class:`LockstepTrainer`, DaisyChain-Web's scheme,
bit for bit). Over links of a few MB/s that costs far more than the step,
so with H > 1 (:class:`RoundTrainer`) a round is:

1. every member starts from the same shared weights, the *anchor* ``a``;
2. it takes the round's local DaisyAdam steps on its own batches, as many as the
   leader's roster names (``--sync-every`` H, longer when a slow link needs it:
   ``protocol.pace``); its inner Adam moments stay local: they never cross the wire and
   are not part of the shared hash;
3. it contributes its round delta ``d_i = a - w_i`` (elementwise float32);
4. every member decodes the roster's contributions from the same bytes, averages them in
   roster order (``average_in_roster_order``) and applies the outer step
   ``a' = a - f32(outer_lr) * mean(d)`` (for ``outer_lr == 1`` a single subtraction),
   then resets its local weights to ``a'``.

All replicas are bit-identical at every round boundary: the anchor and the round count
are what :meth:`RoundTrainer.weight_hash` covers. Inner moments differ between members
by design (each saw its own batches); a checkpoint holds the saving peer's moments, and a
joiner starts its inner state from the snapshot's (the leader's) moments.

The outer step is plain averaging with learning rate 1 and no momentum by default: on
this project's runs of a few hundred steps it reaches a given held-out loss soonest
(``python -m bench.scaling``; numbers in ``docs/limits.md``). ``outer_lr`` stays a run
setting for longer runs, where DiLoCo's larger outer steps may pay off.

Overlap (``--overlap K``): a member that has sent round ``r``'s delta does not wait for
round ``r``'s anchor to start round ``r + 1``: :meth:`RoundTrainer.head_start` takes its
first K steps from the member's own end-of-round weights ``w`` (and inner moments). When
the anchor ``a'`` arrives, :meth:`RoundTrainer.contribute` goes on from
``a' - (w - w_K)`` -- the head start's progress moved onto the anchor -- for the rest of
the round, and the delta is measured from ``a'`` as in any round. Only what a member computes
changes; the shared state still comes from the decoded bytes alone.

With ``K = H`` the whole round runs ahead: round ``r + 1`` is computed while round ``r``'s
bytes cross, its delta is its own progress, and round ``r``'s mean is applied at round
``r + 1``'s end, one round late (the member's own progress stands in for the group's
meanwhile, as in DiLoCo with eager updates). The link then has a whole round of compute
to carry a contribution; what the delay costs is measured by ``python -m bench.overlap``.

Threads: :meth:`contribute` runs in a worker thread while the event loop may roll the
replica back (an amended roster), so it works on copies and touches no shared state;
the new inner state is handed over with :meth:`stage` and adopted only when the round
commits (:meth:`apply`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from daisyweb.optim import DaisyAdam, le_f32_bytes
from daisyweb.protocol.averaging import check_gradient
from daisyweb.training.state import TrainState

__all__ = [
    "Contribution",
    "HeadStart",
    "LockstepTrainer",
    "RoundTrainer",
    "grid_lengths",
    "rounds_before",
    "outer_step",
    "shared_hash",
]

_SHARED_MAGIC = b"daisyweb-round-state-v1\x00"

BatchFn = Callable[[int], np.ndarray]  # inner step index (0-based) -> [batch, seq+1] tokens


@dataclass(frozen=True)
class Contribution:
    """What one member computed for one step or round.

    ``vector`` is what goes on the wire (a gradient or a round delta); ``inner`` is the
    member's new local optimizer state (rounds only) to :meth:`RoundTrainer.stage`.
    """

    index: int
    loss: float
    vector: np.ndarray
    inner: dict[str, Any] | None = None
    local: np.ndarray | None = None  # rounds: the member's weights at the round's end
    head_steps: int = 0  # rounds: steps taken as a head start (``--overlap``)
    steps: int = 1  # the inner steps it took (a round's length)


@dataclass
class HeadStart:
    """The first ``steps`` inner steps of round ``index``, taken while the previous
    round's exchange is still in flight (``--overlap``).

    They start from this member's own weights at the end of the previous round
    (``base``), since the new anchor is not known yet. When it is, the round goes on
    from ``anchor - progress``, ``progress = base - w_k`` (``w_k`` the weights after
    the head start): the head start's progress moved onto the anchor.

    Used once: :meth:`RoundTrainer.contribute` takes its arrays over (``progress``
    becomes the round's local weights, ``inner`` its optimizer state), so a head start
    costs no copy of them.
    """

    index: int
    steps: int
    loss_sum: float
    progress: np.ndarray | None
    inner: dict[str, Any] | None

    def take(self) -> tuple[np.ndarray, dict[str, Any]]:
        """The progress and inner state, handed over once."""
        if self.progress is None or self.inner is None:
            raise ValueError(f"the head start of round {self.index} was already used")
        taken = self.progress, self.inner
        self.progress = self.inner = None
        return taken


def grid_lengths(rounds: int, total_steps: int, sync_every: int,
                 start_step: int = 0) -> list[int]:
    """The lengths of ``rounds`` rounds of ``sync_every`` steps from ``start_step``, the
    last ones cut at ``total_steps``: what a run whose leader never lengthens a round
    trains (``protocol.pace``)."""
    out = []
    step = start_step
    for _ in range(rounds):
        n = max(0, min(sync_every, total_steps - step))
        out.append(n)
        step += n
    return out


def rounds_before(step: int, sync_every: int) -> int:
    """The round count a state at inner step ``step`` starts from when nothing says how
    many rounds it took (a checkpoint: ``--resume``): as if every round had been
    ``sync_every`` steps, a short last one counted. Only the group must agree on it (a
    joiner takes the count from its snapshot's plan)."""
    return -(-step // sync_every)


def outer_step(anchor: np.ndarray, mean_delta: np.ndarray, outer_lr: float,
               out: np.ndarray | None = None) -> np.ndarray:
    """``anchor - f32(outer_lr) * mean_delta``, elementwise in that order, as a new float32
    array or into ``out`` (which may be ``mean_delta`` itself: each element is read
    before it is written)."""
    if outer_lr == 1.0:
        return np.subtract(anchor, mean_delta, out=out, dtype=np.float32)
    scaled = np.multiply(mean_delta, np.float32(outer_lr), out=out, dtype=np.float32)
    return np.subtract(anchor, scaled, out=scaled, dtype=np.float32)


def shared_hash(anchor: np.ndarray, rounds_done: int, inner_steps: int) -> str:
    """blake2b-256 over what every member of a round group must share bit for bit."""
    h = hashlib.blake2b(digest_size=32)
    h.update(_SHARED_MAGIC)
    h.update(struct.pack("<QQQ", anchor.size, rounds_done, inner_steps))
    h.update(le_f32_bytes(anchor))
    return h.hexdigest()


class LockstepTrainer:
    """H = 1: contribute the step's gradient; every member takes the same Adam step.

    A :class:`daisyweb.protocol.sync.Replica` (``step`` counts committed steps).
    """

    sync_every = 1

    def __init__(self, state: TrainState) -> None:
        self.state = state

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def size(self) -> int:
        return self.state.size

    @property
    def inner_steps(self) -> int:
        """Optimizer steps taken so far (what progress and checkpoints count)."""
        return self.state.step

    def contribute(self, index: int, batch: BatchFn, steps: int = 1) -> Contribution:
        loss, grad = self.state.gradient(batch(index))
        return Contribution(index, loss, grad)

    def stage(self, contribution: Contribution) -> None:
        """Nothing to keep: a gradient leaves the local state untouched."""

    def apply(self, average: np.ndarray, *, owned: bool = False) -> None:
        """One optimizer step with the averaged gradient (read, never kept: ``owned`` is
        the same)."""
        self.state.apply(average)

    def weight_hash(self) -> str:
        return self.state.weight_hash()

    def backup(self) -> Any:
        return self.state.backup()

    def restore(self, token: Any) -> None:
        self.state.restore(token)


class RoundTrainer:
    """H > 1: rounds of local DaisyAdam steps, then one outer step on the averaged delta.

    A :class:`daisyweb.protocol.sync.Replica` whose ``step`` counts committed rounds.
    ``state.params`` is the anchor at every boundary; ``state.optimizer`` holds this
    member's inner moments, and its step count the inner steps committed: a round's
    first inner step (which batches it draws) is where the one before it ended, and its
    length is the roster's (``protocol.pace``).
    """

    def __init__(self, state: TrainState, sync_every: int, outer_lr: float = 1.0,
                 rounds_done: int | None = None) -> None:
        if sync_every < 2:
            raise ValueError(f"rounds need sync_every >= 2, got {sync_every}")
        self.state = state
        self.sync_every = sync_every
        self.outer_lr = float(outer_lr)
        self.rounds_done = (rounds_before(state.step, sync_every) if rounds_done is None
                            else rounds_done)
        self._staged: dict[int, dict[str, Any]] = {}

    @property
    def step(self) -> int:
        return self.rounds_done

    @property
    def size(self) -> int:
        return self.state.size

    @property
    def inner_steps(self) -> int:
        return self.state.step

    def contribute(self, index: int, batch: BatchFn, steps: int,
                   head: HeadStart | None = None) -> Contribution:
        """Round ``index`` of ``steps`` inner steps from the current anchor, on copies
        (see module docstring).

        With a ``head`` start of this round, its steps are not taken again: the round
        goes on from the anchor moved by the head start's progress, with its moments
        (the head start's arrays are taken over: :meth:`HeadStart.take`). A head start
        longer than the round (a roster that broke ``protocol.pace``'s rule) is not used.
        """
        state = self.state
        anchor = state.params
        config = state.optimizer.config
        first = state.step
        if head is not None and head.index == index and head.steps <= steps:
            progress, inner = head.take()
            # anchor - progress, into the progress buffer: the same float32 subtraction
            local = np.subtract(anchor, progress, out=progress)
            optimizer = DaisyAdam(config, state.size, inner, copy=False)
            del progress, inner
            done, total_loss = head.steps, head.loss_sum
        else:
            local = anchor.copy()
            # One copy of the committed moments (never changed in place: see apply).
            optimizer = DaisyAdam(config, state.size, state.optimizer.state_dict(copy=False))
            done, total_loss = 0, 0.0
        total_loss += self._local_steps(local, optimizer, first, range(done, steps), batch)
        delta = np.subtract(anchor, local, dtype=np.float32)
        # The local optimizer is done: its arrays become the contribution's inner state.
        return Contribution(index, total_loss / max(steps, 1), delta,
                            optimizer.state_dict(copy=False), local, done, steps)

    def head_start(self, index: int, batch: BatchFn, previous: Contribution,
                   steps: int) -> HeadStart | None:
        """The first ``steps`` inner steps of round ``index`` from ``previous`` (this
        member's contribution to round ``index - 1``): its end weights and inner moments;
        the round starts where ``previous`` ended. None when there is nothing to start.
        The caller bounds ``steps`` by what the round may hold (``Bounds.head_start``)."""
        if steps <= 0 or previous.index != index - 1 or previous.local is None \
                or previous.inner is None:
            return None
        local = previous.local.copy()
        # a copy of the moments: the staged state stays intact
        optimizer = DaisyAdam(self.state.optimizer.config, self.state.size, previous.inner)
        first = optimizer.step_count
        loss_sum = self._local_steps(local, optimizer, first, range(steps), batch)
        # base - w_k into the weights' own buffer (they are not needed any more)
        progress = np.subtract(previous.local, local, out=local)
        return HeadStart(index, steps, loss_sum, progress, optimizer.state_dict(copy=False))

    def _local_steps(self, local: np.ndarray, optimizer: DaisyAdam, first: int,
                     steps: range, batch: BatchFn) -> float:
        """Inner steps ``steps`` of a round that starts at inner step ``first``, on
        ``local`` in place; the loss sum."""
        state = self.state
        task = state.run.task_impl
        total = 0.0
        grad = np.empty_like(local)  # one gradient buffer for these steps
        for j in steps:
            loss, _ = task.loss_and_grad(local, batch(first + j), out=grad)
            optimizer.step(local, check_gradient(grad, state.size, "local gradient"))
            total += float(loss)
        return total

    def stage(self, contribution: Contribution) -> None:
        """Keep this member's inner state of a round until the round commits.

        Until a commit, two are kept: the newest round's, and the one before it, which a
        rollback of the last commit applies again (:meth:`restore`, then :meth:`apply`);
        :meth:`apply` drops the ones before the round it commits.

        The round in flight's moments also take the committed round's place in the
        optimizer at once (its step counts stay), and in what a rollback recommits: the
        committed moments are read again only by that rare rollback and by a snapshot,
        and moments are this member's alone (never hashed, never averaged), so holding
        both through every boundary, 8P bytes (10.6 MB at the demo default) while the
        head start copies them once more, would buy nothing.
        """
        inner = contribution.inner
        if inner is None:
            raise ValueError("a round contribution carries its inner state")
        r = contribution.index
        self._staged[r] = inner
        for old in [k for k in self._staged if k < r - 1]:
            del self._staged[old]
        if r == self.rounds_done:  # the round in flight, on the last committed anchor
            opt = self.state.optimizer
            opt.load_state_dict({**opt.state_dict(copy=False), "m": inner["m"],
                                 "v": inner["v"]}, copy=False)
            if r - 1 in self._staged:
                self._staged[r - 1] = {**self._staged[r - 1], "m": inner["m"],
                                       "v": inner["v"]}

    def apply(self, average: np.ndarray, *, owned: bool = False) -> None:
        """Outer step with the roster's mean delta; adopt this member's inner state.

        The staged arrays are adopted as they are, not copied: in rounds nothing changes
        the anchor or the committed moments in place (rounds compute on copies; the outer
        step makes a new anchor), so the staged state, the optimizer and a backup share
        them. With ``owned`` the new anchor is computed in the mean's own buffer (the same
        bits; one vector less at a commit), else in a new one.
        """
        r = self.rounds_done
        inner = self._staged.get(r)
        if inner is None:
            raise ValueError(f"round {r} committed without this member's inner state")
        mean = check_gradient(average, self.size, "mean round delta")
        new_anchor = outer_step(self.state.params, mean, self.outer_lr,
                                out=mean if owned else None)
        self.state.optimizer.load_state_dict(inner, copy=False)
        self.state.params = new_anchor
        self.rounds_done = r + 1
        # The round before is never applied again (a rollback only recommits this one):
        # its moments, 8P bytes, would otherwise stay until the next round is staged.
        for old in [k for k in self._staged if k < r]:
            del self._staged[old]

    def weight_hash(self) -> str:
        return shared_hash(self.state.params, self.rounds_done, self.state.step)

    def backup(self) -> Any:
        """The anchor and the round and inner step counts before a commit, the anchor
        shared, not copied (it is never changed in place, see :meth:`apply`, only
        replaced).

        The inner moments are not kept: they are this member's alone (never hashed nor
        sent), and a rollback always recommits the round at once (``sync._rollback``),
        which adopts the round's staged moments again, as :meth:`stage` keeps them for.
        Keeping the moments from before the commit would hold 8P bytes (10.6 MB at the
        demo default) for the whole next round.
        """
        opt = self.state.optimizer
        return (self.state.params, self.rounds_done,
                (opt.step_count, opt.beta1_power, opt.beta2_power))

    def restore(self, token: Any) -> None:
        """Back to the anchor and counts of :meth:`backup` (so the shared hash is the one
        from before the commit); the moments stay until the recommit replaces them."""
        params, rounds, (step, p1, p2) = token
        opt = self.state.optimizer
        inner = opt.state_dict(copy=False)
        inner.update(step=step, beta1_power=p1, beta2_power=p2)
        opt.load_state_dict(inner, copy=False)
        self.state.params = params
        self.rounds_done = rounds
