"""The steps one step machine keeps: in flight, committed, and the rosters it was sent.

:class:`InFlight` is everything known about one step not yet forgotten (roster, the raw
contribution payloads by sender, repair timers). :class:`StepLedger` holds them with the
rosters each committed step used and the rosters seen per (sender, step), and forgets
what no repair or rollback can need once a step commits. A leader's payloads of older
committed steps, kept only to repair a member that fell behind, may go to an
:class:`Archive` (the peer's: a file) instead of staying in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from daisyweb.protocol import wire
from daisyweb.protocol.pace import NOT_NAMED, Pace

__all__ = ["Archive", "InFlight", "StepLedger", "HOT_STEPS"]

HOT_STEPS = 2
"""Committed steps whose payloads a leader keeps in memory, the newest first: the last
commit (which a rollback sums again) and the one before (what a member one boundary
behind asks to have repaired). Older ones go to the ledger's :class:`Archive`."""


class Archive(Protocol):
    """Where a leader's payloads of older committed steps are kept for repair."""

    def keep(self, step: int, payloads: dict[str, bytes]) -> Mapping[str, bytes]:
        """``payloads`` kept elsewhere: a mapping that gives each payload back, or gives
        nothing (``get`` returns None) for one it can no longer give intact."""
        ...


@dataclass
class InFlight:
    """Everything known about one step in flight."""

    roster: tuple[str, ...] | None = None
    shares: tuple[int, ...] = ()  # sequences per roster member (empty: equal batches)
    pace: Pace = NOT_NAMED  # the round's length and the next one's head start (``protocol.pace``)
    payloads: dict[str, bytes] = field(default_factory=dict)  # sender -> bytes as received
    unchecked: set[str] = field(default_factory=set)  # arrived before the roster
    own_sent_at: float | None = None
    named_at: float | None = None  # when this peer took the roster (the leader: named it)
    arrived: dict[str, float] = field(default_factory=dict)  # sender -> first direct arrival
    requested: dict[str, float] = field(default_factory=dict)
    computing: bool = False
    # The owner exchange (``protocol.owners``; empty ``owners``: all-to-all). ``payloads``
    # then holds this member's own whole contribution only (kept to resend its parts).
    owners: tuple[str, ...] = ()  # who reduces each part, in part order
    parts: dict[int, dict[str, bytes]] = field(default_factory=dict)  # part we reduce ->
    # sender -> its bytes of it
    early: dict[tuple[str, int, int], bytes] = field(default_factory=dict)  # (sender,
    # parts, part) -> bytes, unchecked: a part sent before the roster (or the amendment,
    # or the new cut) that makes it ours reached us
    means: dict[tuple[int, str], tuple[str, tuple[float, ...], bytes]] = field(
        default_factory=dict)  # (part, owner) -> (cut digest it was reduced over, the
    # parts' squared norms, bytes): the latest of each, checked or not
    checked: set[tuple[int, str, str]] = field(default_factory=set)  # (part, owner, cut
    # digest) whose mean passed this member's bound
    reduced: dict[int, str] = field(default_factory=dict)  # part -> roster hash of the
    # mean of it we sent
    asked_means: dict[int, float] = field(default_factory=dict)  # part -> when asked
    handed: dict[int, float] = field(default_factory=dict)  # part -> when an amendment
    # handed it to its current owner

    def mean_of(self, part: int, roster_hash: str) -> bytes | None:
        """The mean of ``part`` from its owner, reduced over the roster of ``roster_hash``
        and within bounds (``owner_exchange``)."""
        if not 0 <= part < len(self.owners):
            return None
        owner = self.owners[part]
        got = self.means.get((part, owner))
        if got is None or got[0] != roster_hash or (part, owner, roster_hash) not in self.checked:
            return None
        return got[2]

    def reduces(self, self_id: str) -> list[int]:
        """The parts ``self_id`` reduces at this step."""
        return [j for j, o in enumerate(self.owners) if o == self_id]


class StepLedger:
    def __init__(self, archive: Archive | None = None) -> None:
        self.archive = archive
        self.archived: dict[int, Mapping[str, bytes]] = {}  # step -> its payloads, archived
        self.steps: dict[int, InFlight] = {}
        self.committed: dict[int, tuple[str, ...]] = {}  # step -> roster used
        self.committed_shares: dict[int, tuple[int, ...]] = {}  # step -> its shares
        self.committed_owners: dict[int, tuple[str, ...]] = {}  # step -> its parts' owners
        # (from, step) -> (members, shares, term, owners)
        self.rosters_seen: dict[tuple[str, int], tuple[tuple[str, ...], tuple[int, ...], int,
                                                       tuple[str, ...]]] = {}

    def commit(self, step: int, roster: tuple[str, ...], shares: tuple[int, ...],
               owners: tuple[str, ...] = ()) -> None:
        """``step`` was committed with ``roster`` (and its ``shares`` and ``owners``)."""
        self.committed[step] = roster
        self.committed_shares[step] = shares
        self.committed_owners[step] = owners

    def uncommit(self, step: int) -> None:
        """``step``'s commit is undone (a rollback): its roster and the next step's record
        go; its own record stays, to be committed again."""
        self.committed.pop(step, None)
        self.committed_shares.pop(step, None)
        self.committed_owners.pop(step, None)
        self.steps.pop(step + 1, None)

    def committed_roster(self, step: int) -> tuple[str, ...]:
        """The roster ``step`` was committed with (empty if not committed or forgotten)."""
        return self.committed.get(step, ())

    def saw_roster(self, sender: str, step: int, members: tuple[str, ...],
                   shares: tuple[int, ...], term: int, owners: tuple[str, ...] = ()) -> None:
        """``sender`` named ``members`` for ``step`` in ``term`` (a leader we may follow
        later: its roster is taken then)."""
        self.rosters_seen[(sender, step)] = (members, shares, term, owners)

    def get(self, step: int) -> InFlight | None:
        return self.steps.get(step)

    def open(self, step: int) -> InFlight:
        """The record of ``step``, created empty if there is none yet."""
        return self.steps.setdefault(step, InFlight())

    def payload(self, step: int, sender: str) -> bytes | None:
        """``sender``'s payload of ``step`` if still kept (in memory or archived)."""
        s = self.steps.get(step)
        if s is not None and sender in s.payloads:
            return s.payloads[sender]
        archived = self.archived.get(step)
        return archived.get(sender) if archived is not None else None

    def roster(self, step: int) -> tuple[str, ...] | None:
        """The roster of ``step``: in flight, or the one it was committed with."""
        s = self.steps.get(step)
        return s.roster if s else self.committed.get(step)

    def digest_before(self, b: int) -> str:
        """``wire.roster_digest`` of the roster that produced boundary ``b``."""
        return wire.roster_digest(self.committed.get(b - 1),
                                  self.committed_shares.get(b - 1, ()),
                                  self.committed_owners.get(b - 1, ()))

    def forget_before(self, step: int, history: int, keep_payloads: bool) -> None:
        """After committing ``step``: keep ``history`` steps of rosters and payloads
        (``keep_payloads``: the leader resends them) and the rest only for a rollback."""
        for old in [k for k in self.committed if k < step - history]:
            del self.committed[old]
            self.committed_shares.pop(old, None)
            self.committed_owners.pop(old, None)
        for old in [k for k in self.steps if k < step - history + 1]:
            del self.steps[old]
        for old in [k for k in self.archived if k < step - history + 1]:
            del self.archived[old]
        for key in [k for k in self.rosters_seen if k[1] < step]:
            del self.rosters_seen[key]
        for k, s in self.steps.items():
            if k < step:  # the owner exchange's parts and means: no repair reads them
                s.parts, s.early, s.means, s.checked = {}, {}, {}, set()
        if not keep_payloads:
            # Followers never resend; keep only the step for a possible rollback.
            for k, s in self.steps.items():
                if k < step:
                    s.payloads = {}
        elif self.archive is not None:
            # Only a member that fell behind asks for these: out of memory they go.
            for k, s in self.steps.items():
                if k <= step - HOT_STEPS and s.payloads:
                    self.archived[k] = self.archive.keep(k, s.payloads)
                    s.payloads = {}
