"""Who is in the group, as one peer's step machine sees it.

:class:`Membership` owns the per-peer bookkeeping of ``daisyweb.protocol.sync``: the
participants in join order (who the leader puts in the next roster; followers learn it
from rosters so they pick the same successor), the peers the mesh lost, the joiners
waiting for a snapshot and the boundary each was offered, and the excluded peers (never
listened to again). :func:`successor` is the leader-loss rule every survivor applies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["Membership", "successor"]


def successor(roster: Sequence[str], old_leader: str, alive: Callable[[str], bool]) -> str | None:
    """Next live peer after ``old_leader`` in ``roster`` order (cyclic), or None."""
    members = list(roster)
    start = members.index(old_leader) + 1 if old_leader in members else 0
    for i in range(len(members)):
        p = members[(start + i) % len(members)]
        if p != old_leader and alive(p):
            return p
    return None


class Membership:
    """Participants, lost peers, joiners and excluded peers of one machine's group."""

    def __init__(self, self_id: str, members: Iterable[str] = ()) -> None:
        self.self_id = self_id
        self.participants: list[str] = list(dict.fromkeys([*members, self_id]))
        self.down: set[str] = set()
        self.pending: dict[str, float] = {}  # joiner -> time announced (or offered)
        self.offered: dict[str, int] = {}  # joiner -> boundary its snapshot is for
        self.excluded: set[str] = set()

    # ------------------------------------------------------------------ queries
    def alive(self, peer: str) -> bool:
        return peer not in self.down and peer not in self.excluded

    def live_participants(self) -> list[str]:
        return [p for p in self.participants if self.alive(p)]

    def others(self, members: Sequence[str] = ()) -> tuple[str, ...]:
        """Whom a roster of ``members`` goes to: every live participant, member of
        ``members`` and joiner offered a snapshot, but this peer, in order. A joiner
        the roster leaves out (it did not confirm its snapshot in time) learns so, and
        asks again."""
        peers = dict.fromkeys([*self.participants, *members, *self.offered])
        return tuple(p for p in peers if p != self.self_id and self.alive(p))

    def offered_at(self, boundary: int) -> list[str]:
        """Joiners whose snapshot is of ``boundary``, in the order they were offered one."""
        return [p for p, b in self.offered.items() if b == boundary]

    # ------------------------------------------------------------------ changes
    def learn(self, members: Iterable[str]) -> None:
        """Append the members of a roster not known yet (followers learn the order so)."""
        for p in members:
            if p not in self.participants:
                self.participants.append(p)

    def leave(self, peer: str) -> None:
        """``peer`` is no longer in the next roster."""
        if peer in self.participants:
            self.participants.remove(peer)

    def forget_joiner(self, peer: str) -> None:
        self.pending.pop(peer, None)
        self.offered.pop(peer, None)

    def went_down(self, peer: str) -> None:
        self.down.add(peer)
        self.forget_joiner(peer)
        self.leave(peer)

    def came_up(self, peer: str, now: float) -> None:
        """An admitted peer connected and waits for a snapshot (leader)."""
        self.down.discard(peer)
        self.pending.setdefault(peer, now)

    def exclude(self, peer: str) -> None:
        self.excluded.add(peer)
        self.leave(peer)

    def offer_snapshots(self, boundary: int, now: float) -> list[str]:
        """Live joiners not offered a snapshot yet, now offered one of ``boundary``."""
        fresh = [p for p in self.pending if p not in self.offered and self.alive(p)]
        for p in fresh:
            self.offered[p] = boundary
            self.pending[p] = now
        return fresh

    def admit(self, joiners: Iterable[str]) -> None:
        """Joiners whose snapshot was confirmed become participants (unless excluded)."""
        for p in joiners:
            self.forget_joiner(p)
            if p not in self.excluded and p not in self.participants:
                self.participants.append(p)

    def expire_joiners(self, now: float, timeout: float) -> list[str]:
        """Joiners that did not confirm their snapshot within ``timeout``: excluded."""
        expired = [p for p, t0 in self.pending.items()
                   if p in self.offered and now - t0 >= timeout]
        for p in expired:
            self.pending.pop(p)
            self.offered.pop(p)
            self.excluded.add(p)
        return expired
