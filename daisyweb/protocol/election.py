"""Who leads the group, in which term, and whether a majority stands behind it.

One peer follows one leader in one *term*. The first leader (``--start``) leads term 0:
every member took its snapshot from it. A peer that loses its leader declares the
successor (``membership.successor`` over the last roster) for the next term and tells
everyone (``wire.Following(leader, term)``). A peer declares one leader per term and its
terms only grow, so the declarations of one term name at most one leader that a strict
majority stands behind.

The *electorate* is the roster that produced the boundary a peer is at (the last
committed roster). A successor leads only once a strict majority of the electorate has
declared it for its term (:meth:`Leadership.elected`); a follower takes rosters only
from the leader it follows, in that leader's term. So a minority -- a peer woken from a
pause that finds every link dead, or the smaller side of a partition -- never names a
roster: it is *cut off* (:func:`reaches_majority` fails, or no leader is confirmed in
time) and rejoins the group as a joiner, taking the group's state.

Members that picked successors from different views of who is alive can split the vote;
an election without a majority after ``RUNOFF_S`` runs off, every member declaring the
leader most of them declared, for the next term.

A roster of the same term from a second leader is evidence of two leaders of one run:
the step machine halts naming both. Terms are carried in ``Roster.term``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from daisyweb.protocol import wire

__all__ = ["RUNOFF_S", "Leadership", "reachable", "reaches_majority", "strict_majority"]

RUNOFF_S = 3.0
"""An election with no majority behind one leader this long after a peer declared runs
off (:meth:`Leadership.runoff`): a normal one is confirmed within a round trip or two."""


def strict_majority(count: int, total: int) -> bool:
    """More than half of ``total``."""
    return 2 * count > total


def reachable(electorate: Sequence[str], self_id: str, down: Collection[str]) -> int:
    """Members of ``electorate`` this peer reaches: itself and those it has links to."""
    return sum(1 for p in electorate if p == self_id or p not in down)


def reaches_majority(electorate: Sequence[str], self_id: str, down: Collection[str]) -> bool:
    """Whether this peer, with the members it still has links to, is a strict majority of
    ``electorate`` (a peer outside the electorate, a joiner, counts itself only)."""
    return strict_majority(reachable(electorate, self_id, down), len(electorate))


@dataclass
class Leadership:
    """One peer's leader, term, declarations seen, and whether its leader is confirmed:
    a successor by a majority's declarations, a follower's leader by its first roster
    of the term."""

    self_id: str
    leader: str
    term: int = 0
    # Term 0's leader started the run; every member took its snapshot from it.
    confirmed: bool = True
    since: float = 0.0  # when this peer began to follow ``leader`` in ``term``
    leaderless_since: float = 0.0  # when the election now running began
    declared: dict[str, tuple[str, int]] = field(default_factory=dict)  # peer -> (leader, term)

    @property
    def leading(self) -> bool:
        """This peer leads, confirmed (a successor waiting for its majority does not)."""
        return self.leader == self.self_id and self.confirmed

    @property
    def candidate(self) -> bool:
        """This peer is the declared successor, its majority not yet seen."""
        return self.leader == self.self_id and not self.confirmed

    def follow(self, leader: str, term: int, now: float) -> wire.Following:
        """Follow ``leader`` in ``term`` (never an earlier term); the declaration to send."""
        if term < self.term:
            raise ValueError(f"term {term} is before term {self.term}")
        if self.confirmed:
            self.leaderless_since = now  # an election begins (a runoff continues it)
        self.leader, self.term = leader, term
        self.confirmed = False
        self.since = now
        self.declared[self.self_id] = (leader, term)
        return wire.Following(leader, term)

    def record(self, peer: str, leader: str, term: int) -> None:
        """``peer`` declared ``leader`` for ``term`` (its earlier terms are superseded)."""
        if not leader:
            self.declared.pop(peer, None)  # it rejoins: it follows nobody
            return
        before = self.declared.get(peer)
        if before is None or term >= before[1]:
            self.declared[peer] = (leader, term)

    def votes(self, leader: str, term: int, electorate: Sequence[str]) -> int:
        """Members of ``electorate`` that declared ``leader`` for ``term``."""
        return sum(1 for p in electorate if self.declared.get(p) == (leader, term))

    def runoff(self, electorate: Sequence[str]) -> tuple[str, int] | None:
        """Whom to declare when no majority stood behind one leader in time: a later
        term's leader that some member already declared, else, if the members of
        ``electorate`` split our term's vote (they picked successors from different views
        of who is alive), the leader most of them declared, the first in ``electorate``'s
        order on a tie, for the next term; None if our term's vote is not split. Every
        member that saw the same declarations picks the same leader."""
        top = max((t for p, (_, t) in self.declared.items() if p in electorate),
                  default=self.term)
        counts = Counter(leader for p, (leader, t) in self.declared.items()
                         if p in electorate and t == top)
        if top == self.term and len(counts) < 2:
            return None  # not split: one leader declared, its majority or roster to come
        most = max(counts.values())
        order = {p: i for i, p in enumerate(electorate)}
        leader = min((c for c, n in counts.items() if n == most),
                     key=lambda c: order.get(c, len(order)))
        return leader, (top if top > self.term else self.term + 1)

    def elected(self, electorate: Sequence[str]) -> tuple[str, int] | None:
        """The (leader, term) of at least our term that a strict majority of ``electorate``
        declared, if any (at most one per term: each peer declares one leader a term)."""
        counts = Counter(self.declared[p] for p in electorate
                         if p in self.declared and self.declared[p][1] >= self.term)
        for choice, n in sorted(counts.items(), key=lambda kv: -kv[0][1]):
            if strict_majority(n, len(electorate)):
                return choice
        return None
