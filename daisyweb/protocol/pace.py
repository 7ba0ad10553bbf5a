"""How long a round is and how far ahead of it members start: the leader's choice.

Each member measures how many of its own inner steps its last exchanges took, from its
contribution ready to the round committed, a quarter more (``training.overlap``), and
publishes that need with its hashes (``wire.StepHashes.ahead``). The leader's roster of
round ``b`` names two numbers from the largest need of its members (:class:`Pace`):

- ``ahead``: how many steps of round ``b + 1`` every member takes while round ``b``'s
  bytes cross (a head start, at most the run's ``overlap``);
- ``length``: round ``b``'s inner steps, the shortest within the run's bounds
  (``--sync-every`` to ``--sync-max``) that covers the need: with a head start of the
  whole round, an exchange shorter than a round's compute costs no time, a longer one
  makes every member wait. Shorter rounds train better per token (``bench.scaling``) and
  longer ones carry the same bytes over more tokens, so the group syncs as often as its
  slowest link allows.

Members took round ``b``'s head start before its roster was named, as far as round
``b - 1``'s roster said: round ``b`` is never shorter than that (nor than the run's
remaining steps allow). What the leader names changes only how members spend their
time: every member applies the same length, so the shared state (whose hash counts the
inner steps) stays identical, and a length a member did not apply shows as a fork.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Bounds", "LOCKSTEP", "NOT_NAMED", "Pace"]


@dataclass(frozen=True)
class Pace:
    """What a roster names besides its members: round ``length`` (0: not named, the
    run's shortest round) and the head start of the next round (``ahead``)."""

    length: int = 0
    ahead: int = 0


@dataclass(frozen=True)
class Bounds:
    """A run's round lengths (``shortest`` to ``longest`` inner steps; 1 and 1 in
    lockstep) and its ``overlap``, the most steps a head start may take."""

    shortest: int = 1
    longest: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.shortest <= self.longest or self.overlap < 0:
            raise ValueError(f"bad round bounds {self.shortest}..{self.longest}, "
                             f"overlap {self.overlap}")

    def head_start(self, ahead: int, remaining: int) -> int:
        """Steps of a round members take ahead when the roster before it names ``ahead``
        and ``remaining`` inner steps of the run are left for it."""
        return max(0, min(ahead, self.overlap, remaining))

    def length(self, named: int, remaining: int) -> int:
        """The inner steps of a round whose roster names ``named`` (0: the shortest),
        ``remaining`` left in the run."""
        return max(0, min(named or self.shortest, remaining))

    def choose(self, need: int, started: int, remaining: int) -> Pace:
        """The pace of a round: ``need`` is the most steps any member's exchange took,
        ``started`` the head start members took of this round (the last roster's
        ``ahead``, as :meth:`head_start` bounds it), ``remaining`` the run's steps left."""
        need = max(need, 0)
        length = max(min(max(need, self.shortest), self.longest), started)
        return Pace(max(0, min(length, remaining)), min(need, self.longest))


LOCKSTEP = Bounds()
NOT_NAMED = Pace()  # a roster that names no length (lockstep) and no head start
