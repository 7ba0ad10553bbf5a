"""The ``StepHashes`` one step machine has seen, and the checks every peer runs on them.

:class:`HashBook` holds (weight hash, probe hash, roster hash) per peer per boundary, the
latest message winning, and the machine's own; only boundaries ``b - 1 .. b + 1`` around
the machine's own are kept. :class:`HashCheck`, the step machine's collaborator, owns the
book: it makes the message the machine publishes at each boundary, records the others'
and gives the reason to stop on a fork (a member of the last roster whose weights
differ), which every peer checks itself, so a fork stops everyone even if the leader's
``Halt`` is lost. The leader's own guard over all of them is ``daisyweb.protocol.judge``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daisyweb import rules
from daisyweb.protocol import wire

__all__ = ["HashBook", "HashCheck"]

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
        # boundary -> peer -> steps ahead its last exchange needed (``StepHashes.ahead``)
        self.ahead: dict[int, dict[str, int]] = {}

    def record(self, b: int, peer: str, weight: str, probe: str, roster_hash: str,
               speed: float = 0.0, digests: tuple[str, ...] = (), ahead: int = 0) -> None:
        self.seen.setdefault(b, {})[peer] = (weight, probe, roster_hash)
        self.digests.setdefault(b, {})[peer] = digests
        if speed > 0.0:
            self.speeds.setdefault(b, {})[peer] = speed
        self.ahead.setdefault(b, {})[peer] = ahead

    def publish_own(self, b: int, self_id: str, hashes: Hashes, roster_hash: str) -> None:
        """Our hashes at boundary ``b``; older boundaries than ``b - 1`` are forgotten."""
        self.own[b] = hashes
        self.seen.setdefault(b, {})[self_id] = (*hashes, roster_hash)
        by_boundary: tuple[dict[int, Any], ...] = (self.own, self.seen, self.speeds,
                                                   self.ahead, self.digests)
        for book in by_boundary:
            for old in [k for k in book if k < b - 1]:
                del book[old]

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


class HashCheck:
    """This peer's hashes and the checks on everyone's: what it publishes at a boundary
    (its weights, its kernel probe, the roster that produced them, its speed and the
    digests of what it averaged), the others' it recorded, and the reason to stop when a
    member's weights differ. The step machine asks; it acts on the answers."""

    def __init__(self, self_id: str, unit: str) -> None:
        self.self_id = self_id
        self.unit = unit  # step or round, in the reasons we write
        self.book = HashBook()
        self.averaged: dict[int, tuple[str, ...]] = {}  # boundary -> digests we averaged

    def averaged_at(self, b: int, digests: tuple[str, ...]) -> None:
        """The digests of the contributions whose sum produced boundary ``b``, in roster
        order (published with our hashes: they name an equivocating member)."""
        self.averaged = {b: digests}

    def publish(self, b: int, hashes: Hashes, roster_hash: str,
                speed: float, ahead: int = 0) -> wire.StepHashes:
        """Our hashes at boundary ``b``, recorded; the message that tells everyone."""
        self.book.publish_own(b, self.self_id, hashes, roster_hash)
        speed = min(max(speed, 0.0), wire.MAX_SPEED)
        if speed > 0.0:
            self.book.speeds.setdefault(b, {})[self.self_id] = speed
        ahead = min(max(ahead, 0), rules.MAX_SYNC_EVERY)
        self.book.ahead.setdefault(b, {})[self.self_id] = ahead
        digests = self.averaged.get(b, ())
        self.book.digests.setdefault(b, {})[self.self_id] = digests
        return wire.StepHashes(b, self.self_id, *hashes, roster_hash, speed, digests, ahead)

    def own(self, b: int) -> Hashes:
        return self.book.own[b]

    def record(self, msg: wire.StepHashes) -> None:
        self.book.record(msg.step, msg.sender, msg.weight_hash, msg.probe_hash,
                         msg.roster_hash, msg.speed, msg.digests, msg.ahead)

    def fork(self, b: int, peer: str, roster: tuple[str, ...],
             theirs: Hashes | None, owners: tuple[str, ...] = ()) -> str | None:
        """Why to stop at our boundary ``b``: ``peer``, a member of ``roster`` (the one
        that produced ``b``), has other weights than ours (``theirs``: its hashes made
        with the same roster, if any). None if nothing is wrong or nothing is known yet;
        joiners and excluded peers are the leader's call. ``owners``: the parts' owners
        of the owner exchange, whose means the digests are of."""
        own = self.book.own.get(b)
        if own is None or peer == self.self_id or peer not in roster:
            return None
        if theirs is None or theirs[0] == own[0]:
            return None
        return self.equivocation(b, peer, owners or roster, bool(owners)) or (
            f"weight hash mismatch at {self.unit} {b}: {peer} has {theirs[0][:16]}, "
            f"{self.self_id} has {own[0][:16]}")

    def equivocation(self, b: int, peer: str, roster: tuple[str, ...],
                     means: bool = False) -> str | None:
        """The members of ``roster`` (the one that produced ``b``) whose contributions we
        and ``peer`` averaged differ (by the digests both published), named: they sent
        two members different bytes. With ``means`` the digests are of the means of the
        parts of the owner exchange and ``roster`` names each part's owner."""
        liars = list(dict.fromkeys(self.book.equivocators(b, roster, self.self_id, peer)))
        if not liars:
            return None
        what = "means of parts" if means else "contributions"
        return (f"{', '.join(liars)} sent different {what} of {self.unit} {b - 1} "
                f"to {self.self_id} and {peer} (equivocation): weights differ at "
                f"{self.unit} {b}")
