"""Capacity-weighted batches: the leader's share of each member in the next step's (or
round's) sequences, from the speeds the members report.

The group's batch stays what it is without weighting, ``batch`` sequences per member;
only who computes them changes. Each member's share is proportional to its measured
speed (sequences per second of compute, ``wire.StepHashes.speed``), so every member
needs about the same time and nobody waits long for a slow one. Speeds are what members
report, bounded by what the leader sees (:func:`bounded_speeds`). A member without a
measurement yet (the first step, a joiner) counts at the mean speed of the others; with
no measurement at all, or speeds within ``DEADBAND`` of each other, every member takes
``batch`` (then the average is the plain one, bit for bit). Each member takes at least
one sequence and at most ``MAX_FACTOR`` times ``batch``, the equal share (its memory is
sized for about ``batch``, and no member's weight in the average may be bought). The
previous step's shares stay while no member's new share differs from its old one by
more than a quarter (at least one sequence): noise does not move them,
and a member's head start of the next round (``--overlap``, drawn with its last share)
stays usable. Pure: the followers never recompute it, they take the shares the roster
carries, so the contributions are always weighted by exactly the counts used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["DEADBAND", "MAX_FACTOR", "OBSERVED_SLACK", "bounded_speeds", "capacity_shares"]

DEADBAND = 1.15  # fastest / slowest below this: equal shares (measurement noise)
MAX_FACTOR = 2
OBSERVED_SLACK = 2.0


def bounded_speeds(reported: Mapping[str, float],
                   observed: Mapping[str, float]) -> dict[str, float]:
    """What the leader believes of each member's speed: its report, but never more than
    ``OBSERVED_SLACK`` times what the leader saw (sequences over the time from naming the
    roster to the contribution's arrival), scaled by how the group's reports and
    observations compare (the lower median of report / observation: what the leader
    sees includes the network, idle waits and head starts, alike for every member). A
    member cannot buy the batch by lying; an honest one loses nothing within the slack."""
    seen = [p for p, v in reported.items() if v > 0.0 and observed.get(p, 0.0) > 0.0]
    if not seen:
        return dict(reported)
    ratios = sorted(reported[p] / observed[p] for p in seen)
    typical = ratios[(len(ratios) - 1) // 2]
    return {p: min(v, OBSERVED_SLACK * typical * observed[p]) if p in seen else v
            for p, v in reported.items()}


def capacity_shares(members: Sequence[str], speeds: Mapping[str, float], batch: int,
                    previous: Sequence[int] = ()) -> tuple[int, ...]:
    """Sequences per member (roster order) summing to ``batch * len(members)``;
    ``previous``: the last step's shares of the same members, kept unless one moved
    by more than a quarter."""
    new = _proportional(members, speeds, batch)
    if len(previous) == len(new) and sum(previous) == sum(new) and all(
            abs(n - p) <= max(1, p // 4) for n, p in zip(new, previous, strict=True)):
        return tuple(previous)
    return new


def _proportional(members: Sequence[str], speeds: Mapping[str, float],
                  batch: int) -> tuple[int, ...]:
    n = len(members)
    if n == 0:
        return ()
    total = batch * n
    known = [speeds[m] for m in members if speeds.get(m, 0.0) > 0.0]
    if not known or n == 1:
        return (batch,) * n
    mean = sum(known) / len(known)
    s = [speeds[m] if speeds.get(m, 0.0) > 0.0 else mean for m in members]
    if max(s) < DEADBAND * min(s):
        return (batch,) * n
    hi = max(1, min(MAX_FACTOR * batch, total - (n - 1)))
    ideal = [total * x / sum(s) for x in s]
    shares = [min(max(int(v), 1), hi) for v in ideal]
    # Whole sequences: one at a time to whoever is furthest below its ideal (ties: the
    # faster, then roster order), or back from whoever is furthest above it (ties: the
    # slower), within [1, hi]; so a faster member never gets fewer than a slower one.
    rest = total - sum(shares)
    while rest > 0:
        room = [i for i in range(n) if shares[i] < hi]
        if not room:
            break
        i = min(room, key=lambda j: (shares[j] - ideal[j], -s[j], j))
        shares[i] += 1
        rest -= 1
    while rest < 0:
        room = [i for i in range(n) if shares[i] > 1]
        if not room:
            break
        i = max(room, key=lambda j: (shares[j] - ideal[j], -s[j], -j))
        shares[i] -= 1
        rest += 1
    return tuple(shares)
