"""The ``StepHashes`` one step machine has seen, and the checks every peer runs on them.

:class:`HashBook` holds (weight hash, probe hash, roster hash) per peer per boundary, the
latest message winning, and the machine's own; only boundaries ``b - 1 .. b + 1`` around
the machine's own are kept. :class:`HashDuties` is the mixin of
``daisyweb.protocol.sync.StepMachine`` that publishes its hashes at each boundary, records
the others' and stops on a fork (a member of the last roster whose weights differ), so a
fork stops everyone even if the leader's ``Halt`` is lost. The leader's own guard over
all of them is ``daisyweb.protocol.judge``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from daisyweb.protocol import wire
from daisyweb.protocol.actions import Action, Replica, Send
from daisyweb.protocol.ledger import StepLedger
from daisyweb.protocol.membership import Membership

__all__ = ["HashBook", "HashDuties"]

Hashes = tuple[str, str]  # (weight hash, probe hash)


class HashBook:
    def __init__(self) -> None:
        # boundary -> peer -> (weight hash, probe hash, roster hash), latest message wins
        self.seen: dict[int, dict[str, tuple[str, str, str]]] = {}
        self.own: dict[int, Hashes] = {}
        # boundary -> peer -> sequences per second it reported (capacity-weighted batches)
        self.speeds: dict[int, dict[str, float]] = {}
        # boundary -> peer -> digests of the contributions it averaged, in roster order
        self.digests: dict[int, dict[str, tuple[str, ...]]] = {}

    def record(self, b: int, peer: str, weight: str, probe: str, roster_hash: str,
               speed: float = 0.0, digests: tuple[str, ...] = ()) -> None:
        self.seen.setdefault(b, {})[peer] = (weight, probe, roster_hash)
        self.digests.setdefault(b, {})[peer] = digests
        if speed > 0.0:
            self.speeds.setdefault(b, {})[peer] = speed

    def publish_own(self, b: int, self_id: str, hashes: Hashes, roster_hash: str) -> None:
        """Our hashes at boundary ``b``; older boundaries than ``b - 1`` are forgotten."""
        self.own[b] = hashes
        self.seen.setdefault(b, {})[self_id] = (*hashes, roster_hash)
        for old in [k for k in self.own if k < b - 1]:
            del self.own[old]
        for old in [k for k in self.seen if k < b - 1]:
            del self.seen[old]
        for old in [k for k in self.speeds if k < b - 1]:
            del self.speeds[old]
        for old in [k for k in self.digests if k < b - 1]:
            del self.digests[old]

    def equivocators(self, b: int, roster: tuple[str, ...], a: str, c: str) -> list[str]:
        """Members of ``roster`` whose contributions ``a`` and ``c`` averaged differ, by
        the digests both published at ``b`` (empty if either gave none for it)."""
        da = self.digests.get(b, {}).get(a, ())
        dc = self.digests.get(b, {}).get(c, ())
        if len(da) != len(roster) or len(dc) != len(roster):
            return []
        return [p for p, x, y in zip(roster, da, dc, strict=True) if x != y]

    def peers_at(self, b: int) -> list[str]:
        return list(self.seen.get(b, {}))

    def comparable(self, b: int, roster_hash: str,
                   snapshot_of: Callable[[str], int | None]) -> dict[str, Hashes]:
        """Hashes at ``b`` made with the roster whose digest is ``roster_hash``.

        A hash made with another roster of the same step (an amendment raced it) is
        stale; its sender republishes after recommitting. Joiners publish NO_ROSTER and
        count when ``snapshot_of(peer)`` (the boundary they were offered) is ``b``.
        """
        return {
            p: (w, pr)
            for p, (w, pr, rh) in self.seen.get(b, {}).items()
            if rh == roster_hash or (rh == wire.NO_ROSTER and snapshot_of(p) == b)
        }


class HashDuties:
    """Hash publishing and fork checks of ``StepMachine`` (see the module docstring)."""

    self_id: str
    replica: Replica
    probe: Callable[[], str]
    members: Membership
    _hashes: HashBook
    _ledger: StepLedger
    speed: float  # sequences per second of our last contribution (0: none yet)
    unit: str  # step or round, in the lines we write
    _averaged: dict[int, tuple[str, ...]]  # boundary -> digests of what we averaged

    if TYPE_CHECKING:  # provided by StepMachine
        boundary: int
        _stop: Callable[[list[Action], int, str, bool], None]
        _finish: Callable[[list[Action], int], None]

    def _publish_hashes(self, out: list[Action]) -> None:
        b = self.boundary
        rh = self._ledger.digest_before(b)
        hashes = (self.replica.weight_hash(), self.probe())
        self._hashes.publish_own(b, self.self_id, hashes, rh)
        speed = min(max(self.speed, 0.0), wire.MAX_SPEED)
        if speed > 0.0:
            self._hashes.speeds.setdefault(b, {})[self.self_id] = speed
        digests = self._averaged.get(b, ())
        self._hashes.digests.setdefault(b, {})[self.self_id] = digests
        out.append(Send(None, wire.StepHashes(b, self.self_id, *hashes, rh, speed, digests)))
        for peer in self._hashes.peers_at(b):
            self._check_fork(out, b, peer)

    def _valid_hashes(self, b: int) -> dict[str, tuple[str, str]]:
        """Hashes at ``b`` comparable with ours: made with the roster we applied."""
        mine = self._ledger.digest_before(b)
        return self._hashes.comparable(b, mine, self.members.offered.get)

    def _on_hashes(self, out: list[Action], peer: str, msg: wire.StepHashes) -> None:
        if msg.sender != peer:
            return  # hashes are never relayed
        b = msg.step
        if b < self.boundary - 1 or b > self.boundary + 1:
            return
        self._hashes.record(b, peer, msg.weight_hash, msg.probe_hash, msg.roster_hash,
                            msg.speed, msg.digests)
        self._check_fork(out, b, peer)

    def _check_fork(self, out: list[Action], b: int, peer: str) -> None:
        # Each peer judges the members of the step that produced boundary b itself, so
        # a fork stops everyone even if the leader's Halt is lost; joiners and excluded
        # peers are the leader's call.
        own = self._hashes.own.get(b)
        if own is None or peer == self.self_id or b != self.boundary:
            return
        if peer not in self._ledger.committed.get(b - 1, ()):
            return
        theirs = self._valid_hashes(b).get(peer)
        if theirs is not None and theirs[0] != own[0]:
            self._stop(out, b, self._fork_reason(b, peer, theirs[0], own[0]), broadcast=True)

    def _fork_reason(self, b: int, peer: str, theirs: str, own: str) -> str:
        """Why our weights and ``peer``'s differ at ``b``: a member that sent us two
        different contributions is named; otherwise the two hashes."""
        return self._equivocation(b, peer) or (
            f"weight hash mismatch at {self.unit} {b}: {peer} has {theirs[:16]}, "
            f"{self.self_id} has {own[:16]}")

    def _equivocation(self, b: int, peer: str) -> str | None:
        """The members whose contributions to ``b`` we and ``peer`` averaged differ (by
        the digests both published), named: they sent two members different bytes."""
        roster = self._ledger.committed.get(b - 1, ())
        liars = self._hashes.equivocators(b, roster, self.self_id, peer)
        if not liars:
            return None
        return (f"{', '.join(liars)} sent different contributions of {self.unit} {b - 1} "
                f"to {self.self_id} and {peer} (equivocation): weights differ at "
                f"{self.unit} {b}")

    def _maybe_finish(self, out: list[Action], b: int) -> None:
        have = self._valid_hashes(b)
        prev = self._ledger.committed.get(b - 1, ())
        if all(p in have or not self.members.alive(p) for p in prev):
            self._finish(out, b)
