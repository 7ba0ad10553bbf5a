"""The leader's sync guard at a boundary: do the weight and kernel-probe hashes agree?

Pure: :func:`judge` reads the hashes and returns its rulings in order; the step machine
(``daisyweb.protocol.sync``) carries them out. Weights must agree exactly among the
members (any difference halts the run, naming the minority when there is a strict
majority). A joiner whose snapshot hash differs is excluded. Kernel probes are decided
by majority over everyone judged: a minority peer is excluded, the leader in the
minority halts the run, and no majority halts it too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Exclude", "HaltRun", "Ruling", "judge"]


@dataclass(frozen=True)
class Exclude:
    """Take ``peer`` out of the group for ``reason``."""

    peer: str
    reason: str


@dataclass(frozen=True)
class HaltRun:
    """Stop every peer for ``reason`` (always the last ruling)."""

    reason: str


Ruling = Exclude | HaltRun


def judge(
    b: int,
    leader: str,
    have: Mapping[str, tuple[str, str]],
    expected: Sequence[str],
    joiners: Sequence[str],
    excluded: Container[str],
    unit: str = "step",
) -> list[Ruling]:
    """Rulings at boundary ``b``: ``have`` maps peer -> (weight hash, probe hash) for the
    leader, every live participant (``expected``) and every joiner."""
    rulings: list[Ruling] = []
    own_w = have[leader][0]
    # Weights: members must agree exactly. Name the minority when there is a
    # strict majority, otherwise everyone's hash.
    weights = Counter(have[p][0] for p in expected)
    if len(weights) > 1:
        top, n = weights.most_common(1)[0]
        if n * 2 > len(expected):
            bad = [p for p in expected if have[p][0] != top]
            reason = f"weights diverged at {unit} {b}: {', '.join(bad)} differ from the majority"
        else:
            listing = ", ".join(f"{p}={have[p][0][:12]}" for p in expected)
            reason = f"weights diverged at {unit} {b} with no majority: {listing}"
        return [HaltRun(reason)]
    bad_snapshot = [p for p in joiners if have[p][0] != own_w]
    rulings += [Exclude(p, f"{p}: snapshot weight hash does not match at {unit} {b}")
                for p in bad_snapshot]
    # Probes: the majority over everyone judged at this boundary wins.
    judged = [*expected, *(p for p in joiners if p not in excluded and p not in bad_snapshot)]
    probes = Counter(have[p][1] for p in judged)
    top, n = probes.most_common(1)[0]
    if n * 2 <= len(judged) and len(probes) > 1:
        listing = ", ".join(f"{p}={have[p][1][:12]}" for p in judged)
        return [*rulings, HaltRun(f"kernel probes disagree with no majority: {listing}")]
    for p in judged:
        if have[p][1] != top:
            if p == leader:
                return [*rulings, HaltRun(f"leader {p}'s kernel probe differs from the majority")]
            rulings.append(Exclude(p, f"{p}: kernel probe hash differs from the majority"))
    return rulings
