"""Replay oracle: what a single process computes from the same gradients and rosters.

Every replica in a group must end bit-identical to this: start from the initial
parameters and a fresh DaisyAdam, and for each committed step average exactly the
roster's gradients in roster order (``average_in_roster_order``), each first bounded as
the members bound it (``protocol.influence``), and take one step.
Tests feed it the per-peer gradients the peers actually used and compare its hash with
every peer's final weight hash. :func:`replay_rounds` is the same oracle for runs in
rounds (``--sync-every H``), fed the decoded round deltas and the rounds' lengths.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash
from daisyweb.protocol.averaging import (
    average_in_roster_order,
    check_gradient,
    weighted_average_in_roster_order,
)
from daisyweb.protocol.codec import Codec
from daisyweb.protocol.influence import clip_factors, squared_norm
from daisyweb.protocol.owners import (
    MeanEncoder,
    assemble_mean,
    part_bounds,
    part_payload,
    reduce_part,
)
from daisyweb.training.rounds import outer_step, shared_hash

__all__ = ["OwnedMeans", "replay", "replay_hashes", "replay_owned", "replay_owned_rounds",
           "replay_rounds", "round_anchors"]

# (roster, contributions by member) or, for capacity-weighted batches,
# (roster, contributions, sequences per roster member)
StepSpec = (tuple[Sequence[str], Mapping[str, np.ndarray]]
            | tuple[Sequence[str], Mapping[str, np.ndarray], Sequence[int]])


def _combine(spec: StepSpec, size: int, what: str) -> np.ndarray:
    """The spec's contributions combined as the group did: plain or weighted by shares."""
    roster, grads = spec[0], spec[1]
    shares = spec[2] if len(spec) > 2 else ()  # type: ignore[misc]
    missing = [p for p in roster if p not in grads]
    if missing:
        raise ValueError(f"replay {what}: no contribution from {', '.join(missing)}")
    ordered = [check_gradient(grads[p], size, f"{what} {p}") for p in roster]
    # Bounded influence, as every member applies it (``protocol.influence``).
    factors = clip_factors([squared_norm([(slice(0, size), g)]) for g in ordered])
    ordered = [g if f is None else np.multiply(g, f, dtype=np.float32)
               for g, f in zip(ordered, factors, strict=True)]
    if shares:
        return weighted_average_in_roster_order(ordered, list(shares))
    return average_in_roster_order(ordered)


def replay_hashes(
    initial_params: np.ndarray,
    adam_config: AdamConfig,
    steps: Sequence[StepSpec],
    optimizer_state: dict[str, Any] | None = None,
) -> list[str]:
    """Weight hash after every step (``[0]`` is after the first step)."""
    params = np.array(initial_params, dtype=np.float32, copy=True)
    opt = DaisyAdam(adam_config, params.size, optimizer_state)
    out: list[str] = []
    for i, spec in enumerate(steps):
        opt.step(params, _combine(spec, params.size, f"step {i}"))
        out.append(weight_hash(params, opt))
    return out


def replay(
    initial_params: np.ndarray,
    adam_config: AdamConfig,
    steps: Sequence[StepSpec],
    optimizer_state: dict[str, Any] | None = None,
) -> str:
    """Final weight hash of the replayed run (the initial hash if ``steps`` is empty)."""
    if not steps:
        params = np.array(initial_params, dtype=np.float32, copy=True)
        opt = DaisyAdam(adam_config, params.size, optimizer_state)
        return weight_hash(params, opt)
    return replay_hashes(initial_params, adam_config, steps, optimizer_state)[-1]


class OwnedMeans:
    """The owner exchange's mean of each step as the group computes it
    (``protocol.owner_exchange``): every part of the members' payloads reduced in roster
    order by its owner, encoded with that owner's error feedback (one encoder per owner,
    carried from step to step), and the parts' bytes decoded."""

    def __init__(self, codec: Codec, size: int) -> None:
        self.codec = codec
        self.size = size
        self.encoders: dict[str, MeanEncoder] = {}

    def __call__(self, roster: Sequence[str], owners: Sequence[str],
                 payloads: Mapping[str, bytes], shares: Sequence[int] = ()) -> np.ndarray:
        bounds = part_bounds(self.size, len(owners))
        sent = []
        for owner, where in zip(owners, bounds, strict=True):
            parts = [part_payload(self.codec, payloads[p], self.size, where) for p in roster]
            mean, _ = reduce_part(self.codec, parts, where.stop - where.start, shares, True,
                                  roster)
            encoder = self.encoders.setdefault(owner, MeanEncoder(self.codec, self.size))
            sent.append(encoder.encode(where, mean))
        return assemble_mean(self.codec, sent, bounds, self.size)


# (roster, parts' owners, payload bytes by member, shares)
OwnedSpec = tuple[Sequence[str], Sequence[str], Mapping[str, bytes], Sequence[int]]


def replay_owned(
    initial_params: np.ndarray,
    adam_config: AdamConfig,
    steps: Sequence[OwnedSpec],
    codec: Codec,
    optimizer_state: dict[str, Any] | None = None,
) -> list[str]:
    """:func:`replay_hashes` for the owner exchange: each step's mean as
    :class:`OwnedMeans` computes it from the members' payloads (a step without owners
    is all-to-all's)."""
    params = np.array(initial_params, dtype=np.float32, copy=True)
    opt = DaisyAdam(adam_config, params.size, optimizer_state)
    means = OwnedMeans(codec, params.size)
    out: list[str] = []
    for i, (roster, owners, payloads, shares) in enumerate(steps):
        if owners:
            mean = means(roster, owners, payloads, shares)
        else:
            decoded = {p: codec.decode(payloads[p], params.size) for p in roster}
            mean = _combine((roster, decoded, shares), params.size, f"step {i}")
        opt.step(params, mean)
        out.append(weight_hash(params, opt))
    return out


def replay_rounds(
    initial_params: np.ndarray,
    rounds: Sequence[StepSpec],
    *,
    lengths: Sequence[int],
    outer_lr: float = 1.0,
    first_round: int = 0,
    first_step: int = 0,
) -> list[str]:
    """Shared-state hash after every round of a run in rounds.

    ``rounds[i]`` holds the roster of round ``first_round + i`` and each member's decoded
    contribution (its round delta as every member decoded it from the wire);
    ``lengths[i]`` its inner steps (as the leader named them, ``protocol.pace``;
    ``rounds.grid_lengths`` for rounds of one length), the run standing at inner step
    ``first_step`` before the first. Inner moments are local to each member and do not
    enter the shared state, so the round deltas alone determine it.
    """
    return [shared_hash(anchor, r, inner) for r, inner, anchor in round_anchors(
        initial_params, rounds, lengths=lengths, outer_lr=outer_lr,
        first_round=first_round, first_step=first_step)]


def round_anchors(
    initial_params: np.ndarray,
    rounds: Iterable[StepSpec],
    *,
    lengths: Sequence[int],
    outer_lr: float = 1.0,
    first_round: int = 0,
    first_step: int = 0,
) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(rounds done, inner steps done, shared weights)`` after every round of
    :func:`replay_rounds` (a new array each time), ``rounds`` read one at a time: what a
    benchmark evaluates offline at each boundary instead of stopping the run to."""
    size = np.asarray(initial_params).size
    means = (_combine(spec, size, f"round {first_round + i}") for i, spec in enumerate(rounds))
    return _anchors(initial_params, means, lengths, outer_lr, first_round, first_step)


def replay_owned_rounds(
    initial_params: np.ndarray,
    rounds: Sequence[OwnedSpec],
    codec: Codec,
    *,
    lengths: Sequence[int],
    outer_lr: float = 1.0,
    first_round: int = 0,
    first_step: int = 0,
) -> list[str]:
    """:func:`replay_rounds` for rounds of the owner exchange (``rounds[i]``: the roster,
    the parts' owners, each member's payload bytes and the shares; a round without
    owners is all-to-all's)."""
    size = np.asarray(initial_params).size
    owned = OwnedMeans(codec, size)

    def mean(i: int, spec: OwnedSpec) -> np.ndarray:
        roster, owners, payloads, shares = spec
        if owners:
            return owned(roster, owners, payloads, shares)
        decoded = {p: codec.decode(payloads[p], size) for p in roster}
        return _combine((roster, decoded, shares), size, f"round {first_round + i}")

    means = (mean(i, spec) for i, spec in enumerate(rounds))
    return [shared_hash(anchor, r, inner) for r, inner, anchor in _anchors(
        initial_params, means, lengths, outer_lr, first_round, first_step)]


def _anchors(initial_params: np.ndarray, means: Iterable[np.ndarray], lengths: Sequence[int],
             outer_lr: float, first_round: int, first_step: int,
             ) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(rounds done, inner steps done, shared weights)`` after each round's mean."""
    anchor = np.array(initial_params, dtype=np.float32, copy=True)
    inner = first_step
    for i, mean in enumerate(means):
        if i >= len(lengths):
            raise ValueError(f"replay: no length for round {first_round + i}")
        anchor = outer_step(anchor, mean, outer_lr)
        inner += lengths[i]
        yield first_round + i + 1, inner, anchor
