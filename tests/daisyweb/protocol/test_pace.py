"""Round lengths from the members' exchanges (``protocol.pace``): the leader's choice, what
members accept, and a run that ends on its optimizer steps, not a round count."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from daisyweb.protocol import wire
from daisyweb.protocol.deadline import FLOOR_S, MEDIAN_FACTOR, MIN_SAMPLES, Deadline
from daisyweb.protocol.pace import Bounds, Pace
from daisyweb.protocol.sync import Commit, Compute, Finish, Send, StepMachine, Stopped

SIZE = 5
PROBE = "aa" * 16


@pytest.mark.parametrize(("need", "started", "remaining", "pace"), [
    (0, 0, 100, Pace(16, 0)),  # nothing measured: the shortest round
    (3, 2, 100, Pace(16, 3)),  # a fast link: the shortest round covers it
    (27, 16, 100, Pace(27, 27)),  # the exchange takes 27 steps: a round as long
    (90, 16, 100, Pace(64, 64)),  # at most the longest round
    (3, 40, 100, Pace(40, 3)),  # never shorter than the head start members took
    (27, 16, 20, Pace(20, 27)),  # the run's last steps
])
def test_the_shortest_round_within_bounds_that_covers_the_slowest_exchange(
        need: int, started: int, remaining: int, pace: Pace) -> None:
    assert Bounds(16, 64, 64).choose(need, started, remaining) == pace


def test_a_head_start_is_at_most_the_overlap_and_the_steps_left() -> None:
    b = Bounds(16, 64, 32)
    assert [b.head_start(a, 100) for a in (0, 5, 32, 50)] == [0, 5, 32, 32]
    assert b.head_start(50, 7) == 7 and b.head_start(50, 0) == 0
    assert b.length(0, 100) == 16 and b.length(40, 100) == 40 and b.length(40, 9) == 9


def test_bounds_refuse_an_empty_range() -> None:
    with pytest.raises(ValueError, match="bad round bounds"):
        Bounds(16, 8, 0)


class PacedReplica:
    """A replica of rounds whose inner steps advance by the length it was asked to
    compute (the trainer's, ``RoundTrainer``); the weights by the mean."""

    def __init__(self) -> None:
        self.params = np.zeros(SIZE, dtype=np.float32)
        self.rounds = 0
        self.inner = 0
        self.computing = 0  # the length of the round in flight (from its Compute)

    @property
    def step(self) -> int:
        return self.rounds

    @property
    def inner_steps(self) -> int:
        return self.inner

    @property
    def size(self) -> int:
        return SIZE

    def apply(self, average: np.ndarray, *, owned: bool = False) -> None:
        self.params = self.params - average
        self.rounds += 1
        self.inner += self.computing

    def weight_hash(self) -> str:
        return (f"{self.rounds:08x}{self.inner:08x}" + self.params.tobytes().hex())[:64]


class Pair:
    """A leader and a follower whose exchanges need the steps the test sets."""

    def __init__(self, total: int) -> None:
        bounds = Bounds(2, 8, 8)
        self.reps = {p: PacedReplica() for p in "ab"}
        self.machines = {
            "a": StepMachine("a", self.reps["a"], total, lambda: PROBE, leader="a",
                             members=["a", "b"], bounds=bounds, unit="round"),
            "b": StepMachine("b", self.reps["b"], total, lambda: PROBE, leader="a",
                             bounds=bounds, unit="round"),
        }
        self.commits: dict[str, list[Commit]] = {"a": [], "b": []}
        self.computes: list[tuple[str, Compute]] = []
        self.ended: dict[str, object] = {}
        self.queue: list[tuple[str, str, bytes]] = []

    def handle(self, peer: str, actions: list) -> None:
        for x in actions:
            if isinstance(x, Send):
                for q in (x.to if x.to is not None else [p for p in "ab" if p != peer]):
                    self.queue.append((peer, q, wire.encode(x.message)))
            elif isinstance(x, Compute):
                self.computes.append((peer, x))
            elif isinstance(x, Commit):
                self.commits[peer].append(x)
            elif isinstance(x, (Finish, Stopped)):
                self.ended[peer] = x

    def run(self, needs: Callable[[str, int], int]) -> None:
        """Deliver everything; each member computes its round (its replica told the
        length the Compute named), its exchange of round ``r`` taking ``needs(peer, r)``
        steps (published with its next hashes)."""
        for _ in range(10000):
            if self.queue:
                src, dst, data = self.queue.pop(0)
                self.handle(dst, self.machines[dst].message(src, wire.decode(data), 0.0))
            elif self.computes:
                peer, c = self.computes.pop(0)
                m = self.machines[peer]
                self.reps[peer].computing = c.length
                m.ahead = needs(peer, c.step)
                vector = np.full(SIZE, 0.5, dtype=np.float32)
                self.handle(peer, m.local_contribution(c.step, 1.0, vector, 0.0))
            else:
                return
        raise AssertionError("did not settle")


def test_the_leader_lengthens_rounds_for_a_slow_exchange_and_ends_on_the_runs_steps() -> None:
    pair = Pair(total=20)
    for p, m in pair.machines.items():
        pair.handle(p, m.start(0.0))
    # b's exchange of round 0 takes 6 steps, every other exchange 1
    pair.run(lambda peer, r: 6 if (peer, r) == ("b", 0) else 1)
    for p in "ab":
        got = [(c.length, c.need) for c in pair.commits[p]]
        # 2 (nothing measured), 6 (b's need), 6 (b ran 6 ahead into it, though its need
        # fell to 1), then the shortest, 2, and the run's last steps
        assert got == [(2, 0), (6, 6), (6, 1), (2, 1), (2, 1), (2, 1)], got
        assert pair.reps[p].inner_steps == 20 and pair.reps[p].rounds == 6
        assert isinstance(pair.ended[p], Finish)
    assert pair.reps["a"].weight_hash() == pair.reps["b"].weight_hash()


def test_the_last_round_is_what_the_run_has_left() -> None:
    pair = Pair(total=9)
    for p, m in pair.machines.items():
        pair.handle(p, m.start(0.0))
    pair.run(lambda peer, r: 8)
    assert [c.length for c in pair.commits["b"]] == [2, 7]
    assert pair.reps["b"].inner_steps == 9 and isinstance(pair.ended["b"], Finish)


@pytest.mark.parametrize(("length", "ok"), [(1, False), (2, True), (8, True), (9, False),
                                             (20, True)])
def test_a_follower_refuses_a_round_length_outside_the_runs_bounds(length: int,
                                                                   ok: bool) -> None:
    """Rounds of 2 to 8 steps: a roster naming 1 or 9 halts the follower (and the group,
    told); one naming all the run has left (20) is the run's last round."""
    rep = PacedReplica()
    b = StepMachine("b", rep, 20, lambda: PROBE, leader="a", bounds=Bounds(2, 8, 8),
                    unit="round")
    b.start(0.0)
    out = b.message("a", wire.Roster(0, ("a", "b"), (), 0, (), 0, length), 0.0)
    computes = [x for x in out if isinstance(x, Compute)]
    stops = [x for x in out if isinstance(x, Stopped)]
    if ok:
        assert [c.length for c in computes] == [length] and not stops
    else:
        assert not computes and "outside the run's 2..8" in stops[0].reason


def test_the_deadline_counts_each_round_by_its_steps() -> None:
    d = Deadline()
    for _ in range(MIN_SAMPLES):
        d.record(12.0, 6)  # rounds of 6 steps in 12 s: 2 s a step
    assert d.seconds(16) == 16 * MEDIAN_FACTOR * 2.0
    assert d.seconds(1) == max(FLOOR_S, MEDIAN_FACTOR * 2.0)
