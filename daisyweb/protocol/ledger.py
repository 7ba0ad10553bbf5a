"""The steps one step machine keeps: in flight, committed, and the rosters it was sent.

:class:`InFlight` is everything known about one step not yet forgotten (roster, the raw
gradient payloads by sender, repair timers). :class:`StepLedger` holds them with the
rosters each committed step used and the rosters seen per (sender, step), and forgets
what no repair or rollback can need once a step commits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daisyweb.protocol import wire

__all__ = ["InFlight", "StepLedger"]


@dataclass
class InFlight:
    """Everything known about one step in flight."""

    roster: tuple[str, ...] | None = None
    shares: tuple[int, ...] = ()  # sequences per roster member (empty: equal batches)
    grads: dict[str, bytes] = field(default_factory=dict)  # sender -> payload as received
    unchecked: set[str] = field(default_factory=set)  # arrived before the roster
    own_sent_at: float | None = None
    requested: dict[str, float] = field(default_factory=dict)
    computing: bool = False


class StepLedger:
    def __init__(self) -> None:
        self.steps: dict[int, InFlight] = {}
        self.committed: dict[int, tuple[str, ...]] = {}  # step -> roster used
        self.committed_shares: dict[int, tuple[int, ...]] = {}  # step -> its shares
        # (from, step) -> (members, shares)
        self.rosters_seen: dict[tuple[str, int], tuple[tuple[str, ...], tuple[int, ...]]] = {}

    def get(self, step: int) -> InFlight | None:
        return self.steps.get(step)

    def open(self, step: int) -> InFlight:
        """The record of ``step``, created empty if there is none yet."""
        return self.steps.setdefault(step, InFlight())

    def roster(self, step: int) -> tuple[str, ...] | None:
        """The roster of ``step``: in flight, or the one it was committed with."""
        s = self.steps.get(step)
        return s.roster if s else self.committed.get(step)

    def digest_before(self, b: int) -> str:
        """``wire.roster_digest`` of the roster that produced boundary ``b``."""
        return wire.roster_digest(self.committed.get(b - 1),
                                  self.committed_shares.get(b - 1, ()))

    def forget_before(self, step: int, history: int, keep_grads: bool) -> None:
        """After committing ``step``: keep ``history`` steps of rosters and gradients
        (``keep_grads``: the leader resends them) and the rest only for a rollback."""
        for old in [k for k in self.committed if k < step - history]:
            del self.committed[old]
            self.committed_shares.pop(old, None)
        for old in [k for k in self.steps if k < step - history + 1]:
            del self.steps[old]
        for key in [k for k in self.rosters_seen if k[1] < step]:
            del self.rosters_seen[key]
        if not keep_grads:
            # Followers never resend; keep only the step for a possible rollback.
            for k, s in self.steps.items():
                if k < step:
                    s.grads = {}
