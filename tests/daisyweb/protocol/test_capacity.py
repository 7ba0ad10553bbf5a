"""Capacity-weighted batches: the leader's shares, the weighted roster-order average (the
exact full-batch mean), and step machines that carry shares in their rosters."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash
from daisyweb.protocol import wire
from daisyweb.protocol.averaging import (
    GradientError,
    average_in_roster_order,
    weighted_average_in_roster_order,
)
from daisyweb.protocol.capacity import DEADBAND, MAX_FACTOR, capacity_shares
from daisyweb.protocol.pace import Bounds
from daisyweb.protocol.sync import Commit, Compute, Send, StepMachine
from daisyweb.training.replay import replay_hashes

# ------------------------------------------------------------------- the shares


def test_no_speeds_or_close_speeds_keep_equal_shares() -> None:
    m = ("a", "b", "c")
    assert capacity_shares(m, {}, 8) == (8, 8, 8)
    assert capacity_shares(m, {"a": 100.0, "b": 110.0, "c": 100.0}, 8) == (8, 8, 8)
    assert capacity_shares(("a",), {"a": 5.0}, 8) == (8,)
    assert capacity_shares((), {}, 8) == ()


def test_shares_follow_speed() -> None:
    assert capacity_shares(("a", "b"), {"a": 100.0, "b": 300.0}, 8) == (4, 12)
    # a member not measured yet counts at the others' mean
    assert capacity_shares(("a", "b", "c"), {"a": 100.0, "b": 300.0}, 8) == (4, 12, 8)
    # at least one sequence each, at most MAX_FACTOR x batch
    assert capacity_shares(("a", "b"), {"a": 1.0, "b": 1e6}, 8) == (1, 15)
    many = tuple("abcdefgh")
    speeds = {p: 1.0 for p in many} | {"a": 1e6}
    shares = capacity_shares(many, speeds, 2)
    assert shares[0] == MAX_FACTOR * 2 and sum(shares) == 16 and min(shares) >= 1


@settings(max_examples=200, deadline=None)
@given(speeds=st.lists(st.one_of(st.just(0.0), st.floats(0.01, 1e6)), min_size=1,
                       max_size=12),
       batch=st.integers(1, 32))
def test_shares_always_sum_to_the_group_batch(speeds: list[float], batch: int) -> None:
    members = tuple(f"p{i}" for i in range(len(speeds)))
    shares = capacity_shares(members, dict(zip(members, speeds, strict=True)), batch)
    assert len(shares) == len(members) and sum(shares) == batch * len(members)
    assert all(1 <= n <= max(1, MAX_FACTOR * batch) for n in shares)
    known = [s for s in speeds if s > 0]
    if known and max(known) >= DEADBAND * min(known) * 1.01 and len(set(shares)) > 1:
        # faster never gets fewer sequences than slower
        pairs = [(speeds[i], shares[i]) for i in range(len(speeds)) if speeds[i] > 0]
        for (s1, n1) in pairs:
            for (s2, n2) in pairs:
                if s1 > s2:
                    assert n1 >= n2


# ------------------------------------------------------------ the weighted average


def _member_means(rng: np.random.Generator, shares: list[int], size: int):
    """Per-sequence gradients, and each member's mean over its sequences."""
    per_seq = [rng.standard_normal((n, size)).astype(np.float32) for n in shares]
    means = [np.mean(x.astype(np.float64), axis=0).astype(np.float32) for x in per_seq]
    return per_seq, means


def test_weighted_average_is_the_full_batch_mean() -> None:
    rng = np.random.default_rng(5)
    shares = [3, 13, 8]
    per_seq, means = _member_means(rng, shares, 257)
    got = weighted_average_in_roster_order(means, shares)
    full = np.mean(np.concatenate(per_seq).astype(np.float64), axis=0)
    assert got.dtype == np.float32
    assert np.max(np.abs(got - full)) < 1e-6
    # the plain mean of the member means is not it (it over-weights the 3-sequence member)
    assert np.max(np.abs(average_in_roster_order(means) - full)) > 1e-3
    # fixed order, elementwise float32: the same bits every time
    again = weighted_average_in_roster_order([m.copy() for m in means], shares)
    assert again.tobytes() == got.tobytes()
    # by hand, in roster order
    want = means[0] * np.float32(3)
    want = want + means[1] * np.float32(13)
    want = want + means[2] * np.float32(8)
    want = want * np.float32(1 / 24)
    assert got.tobytes() == want.astype(np.float32).tobytes()


def test_equal_shares_are_the_plain_average_bit_for_bit() -> None:
    rng = np.random.default_rng(6)
    grads = [rng.standard_normal(99).astype(np.float32) for _ in range(3)]
    plain = average_in_roster_order(grads)
    assert weighted_average_in_roster_order(grads, [8, 8, 8]).tobytes() == plain.tobytes()


@pytest.mark.parametrize("shares", [[1, 2], [1, 0, 2], [1, -1, 2], [1, True, 2]])
def test_bad_shares_refused(shares: list) -> None:
    grads = [np.zeros(4, dtype=np.float32)] * 3
    with pytest.raises(GradientError):
        weighted_average_in_roster_order(grads, shares)


# --------------------------------------------------------------- step machines

SIZE = 23
ADAM = AdamConfig(lr=1e-2)


class Replica:
    def __init__(self) -> None:
        self.params = np.linspace(-1, 1, SIZE, dtype=np.float32)
        self.opt = DaisyAdam(ADAM, SIZE)

    @property
    def step(self) -> int:
        return self.opt.step_count

    @property
    def inner_steps(self) -> int:  # lockstep: one optimizer step a step
        return self.opt.step_count

    @property
    def size(self) -> int:
        return SIZE

    def apply(self, average: np.ndarray, *, owned: bool = False) -> None:
        self.opt.step(self.params, average)

    def weight_hash(self) -> str:
        return weight_hash(self.params, self.opt)

    def backup(self) -> object:
        return self.params.copy(), self.opt.state_dict()

    def restore(self, token: object) -> None:
        params, state = token  # type: ignore[misc]
        self.params = params.copy()
        self.opt.load_state_dict(state)


def _grad(peer: str, step: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(hash((peer, step, n)) % (1 << 32))
    return rng.standard_normal(SIZE).astype(np.float32)


def _run(speeds: dict[str, float], capacity: bool, steps: int = 3):
    """Machines on a FIFO bus; each computes with the share its Compute names."""
    peers = list(speeds)
    reps = {p: Replica() for p in peers}
    ms = {p: StepMachine(p, reps[p], steps, lambda: "aa" * 16, leader=peers[0],
                         members=peers if p == peers[0] else (), capacity=capacity
                         if p == peers[0] else False, batch=4) for p in peers}
    for p, m in ms.items():
        m.speed = speeds[p]
    queue: deque = deque()
    computes: list[tuple[str, Compute]] = []
    commits: dict[str, list[Commit]] = {p: [] for p in peers}
    sent: dict[tuple[str, int], np.ndarray] = {}

    def handle(p: str, actions: list) -> None:
        for a in actions:
            if isinstance(a, Send):
                for q in a.to if a.to is not None else [x for x in peers if x != p]:
                    queue.append((p, q, wire.encode(a.message)))
            elif isinstance(a, Compute):
                computes.append((p, a))
            elif isinstance(a, Commit):
                commits[p].append(a)

    for p, m in ms.items():
        handle(p, m.start(0.0))
    for _ in range(10000):
        if queue:
            src, dst, data = queue.popleft()
            handle(dst, ms[dst].message(src, wire.decode(data), 0.0))
        elif computes:
            p, c = computes.pop(0)
            g = _grad(p, c.step, c.sequences)
            sent[(p, c.step)] = g
            handle(p, ms[p].local_contribution(c.step, 1.0, g, 0.0))
        else:
            break
    return reps, commits, sent, computes


def test_a_group_with_shares_stays_identical_and_matches_the_replay() -> None:
    reps, commits, sent, _ = _run({"a": 300.0, "b": 100.0}, capacity=True)
    assert [c.shares for c in commits["a"]] == [(6, 2)] * 3  # a is three times faster
    assert [c.shares for c in commits["b"]] == [(6, 2)] * 3
    assert reps["a"].weight_hash() == reps["b"].weight_hash()
    spec = [(c.roster, {q: sent[(q, c.step)] for q in c.roster}, c.shares)
            for c in commits["a"]]
    start = Replica()
    assert replay_hashes(start.params, ADAM, spec)[-1] == reps["a"].weight_hash()
    # the oracle with equal weights gives another state: the shares were used
    plain = [(r, g) for r, g, _ in spec]
    assert replay_hashes(start.params, ADAM, plain)[-1] != reps["a"].weight_hash()


def test_capacity_off_keeps_equal_shares_and_the_plain_protocol() -> None:
    reps, commits, sent, _ = _run({"a": 300.0, "b": 100.0}, capacity=False)
    assert all(c.shares == () for c in commits["a"])
    spec = [(c.roster, {q: sent[(q, c.step)] for q in c.roster}) for c in commits["a"]]
    assert replay_hashes(Replica().params, ADAM, spec)[-1] == reps["b"].weight_hash()


def test_computes_name_each_members_share() -> None:
    peers = {"a": 100.0, "b": 300.0}
    reps = {p: Replica() for p in peers}
    a = StepMachine("a", reps["a"], 2, lambda: "aa" * 16, leader="a", members=["a", "b"],
                    capacity=True, batch=4)
    a.speed = 100.0  # measured on its last contribution, published with its hashes
    a.start(0.0)
    b_hashes = wire.StepHashes(0, "b", reps["b"].weight_hash(), "aa" * 16, "00", 300.0)
    actions = a.message("b", b_hashes, 0.0)
    (roster,) = [x.message for x in actions if isinstance(x, Send)
                 and isinstance(x.message, wire.Roster)]
    assert roster.shares == (2, 6)
    (compute,) = [x for x in actions if isinstance(x, Compute)]
    assert compute.sequences == 2


@pytest.mark.parametrize(("own", "theirs", "named"), [(5, 3, 5), (5, 9, 9), (0, 0, 0)])
def test_the_roster_runs_ahead_as_far_as_its_slowest_exchange_needs(
        own: int, theirs: int, named: int) -> None:
    """``wire.Roster.ahead``: one head start for the group, the most any member's last
    exchange needed (each publishes its need with its hashes), in every member's
    Compute."""
    reps = {p: Replica() for p in "ab"}
    bounds = Bounds(2, 16, 16)  # rounds of 2 to 16 steps (the replica's are 1: it stops
    # after 2 of them, and names rounds of 2, all that is left)
    a = StepMachine("a", reps["a"], 2, lambda: "aa" * 16, leader="a", members=["a", "b"],
                    bounds=bounds)
    a.ahead = own
    published = [x.message for x in a.start(0.0) if isinstance(x, Send)
                 and isinstance(x.message, wire.StepHashes)]
    assert [h.ahead for h in published] == [own]
    b_hashes = wire.StepHashes(0, "b", reps["b"].weight_hash(), "aa" * 16, "00", 0.0,
                               (), theirs)
    actions = a.message("b", wire.decode(wire.encode(b_hashes)), 0.0)
    (roster,) = [x.message for x in actions if isinstance(x, Send)
                 and isinstance(x.message, wire.Roster)]
    assert roster.ahead == named
    assert [x.ahead for x in actions if isinstance(x, Compute)] == [named]
    b = StepMachine("b", reps["b"], 2, lambda: "aa" * 16, leader="a", bounds=bounds)
    b.start(0.0)
    out = b.message("a", wire.decode(wire.encode(roster)), 0.0)
    assert [(x.ahead, x.length) for x in out if isinstance(x, Compute)] == [(named, 2)]


def _follower_that_committed_step_0() -> tuple[StepMachine, Replica, list]:
    """b committed step 0 of roster (a, b, c) with shares (2, 4, 6)."""
    from daisyweb.protocol.codec import F32
    from daisyweb.protocol.sync import Stopped

    rep = Replica()
    b = StepMachine("b", rep, 3, lambda: "aa" * 16, leader="a")
    b.start(0.0)
    out = b.message("a", wire.Roster(0, ("a", "b", "c"), (2, 4, 6)), 0.0)
    assert [x.sequences for x in out if isinstance(x, Compute)] == [4]
    out = b.local_contribution(0, 1.0, _grad("b", 0, 4), 0.0)
    for p in ("a", "c"):
        out += b.message(p, wire.Contribution(0, p, F32.encode(_grad(p, 0, 0))), 0.0)
    (commit,) = [x for x in out if isinstance(x, Commit)]
    assert commit.shares == (2, 4, 6) and not [x for x in out if isinstance(x, Stopped)]
    return b, rep, [F32.decode(F32.encode(_grad(p, 0, n)), SIZE) for p, n in
                    (("a", 0), ("b", 4), ("c", 0))]


def test_an_amendment_keeps_the_shares_and_recommits_weighted() -> None:
    b, rep, grads = _follower_that_committed_step_0()
    out = b.message("a", wire.Roster(0, ("a", "b"), (2, 4)), 0.0)  # c is gone
    (commit,) = [x for x in out if isinstance(x, Commit)]
    assert commit.rollback and commit.roster == ("a", "b") and commit.shares == (2, 4)
    want = Replica()
    want.apply(weighted_average_in_roster_order(grads[:2], [2, 4]))
    assert rep.weight_hash() == want.weight_hash()


def test_an_amendment_that_changes_a_share_halts() -> None:
    from daisyweb.protocol.sync import Stopped

    b, rep, _ = _follower_that_committed_step_0()
    before = rep.weight_hash()
    out = b.message("a", wire.Roster(0, ("a", "b"), (3, 4)), 0.0)  # a's 2 became 3
    (stop,) = [x for x in out if isinstance(x, Stopped)]
    assert "changes shares" in stop.reason and rep.weight_hash() == before


def test_a_new_leader_amends_with_the_shares_first_named() -> None:
    from daisyweb.protocol.leading import _kept_shares
    from daisyweb.protocol.ledger import InFlight

    st = InFlight(roster=("a", "b", "c"), shares=(2, 4, 6))
    assert _kept_shares(st, ("a", "c")) == (2, 6)
    assert _kept_shares(InFlight(roster=("a", "b")), ("a",)) == ()


def test_shares_stay_while_speeds_move_a_little() -> None:
    m = ("a", "b")
    first = capacity_shares(m, {"a": 100.0, "b": 300.0}, 8)
    assert first == (4, 12)
    # the ideal moves to (5, 11): within a quarter of each, the shares stay
    assert capacity_shares(m, {"a": 130.0, "b": 290.0}, 8, first) == (4, 12)
    # a bigger move is followed
    assert capacity_shares(m, {"a": 300.0, "b": 300.0}, 8, first) == (8, 8)
    assert capacity_shares(m, {"a": 300.0, "b": 100.0}, 8, first) == (12, 4)
    # previous shares of another group size are not kept
    assert capacity_shares(("a", "b", "c"), {}, 8, first) == (8, 8, 8)


def test_a_report_is_believed_up_to_twice_what_the_leader_saw() -> None:
    from daisyweb.protocol.capacity import OBSERVED_SLACK, bounded_speeds

    # a's report is 1.25 times what the leader saw: so is the group's (the lower median)
    assert bounded_speeds({"a": 100.0, "b": 1e12}, {"a": 80.0, "b": 50.0}) == {
        "a": 100.0, "b": OBSERVED_SLACK * 1.25 * 50.0}
    # what the leader sees includes idle waits: only the ratio to the others' counts
    assert bounded_speeds({"a": 1600.0, "b": 400.0, "c": 1e12},
                          {"a": 40.0, "b": 35.0, "c": 38.0}) == {
        "a": 1600.0, "b": 400.0, "c": OBSERVED_SLACK * 40.0 * 38.0}
    assert bounded_speeds({"a": 100.0}, {}) == {"a": 100.0}  # nothing seen yet: the report


def test_a_lied_speed_does_not_buy_the_batch() -> None:
    """c reports 1e12 sequences/s but computes at 8 a second like the others: before the
    leader has seen anything, c gets twice the equal share (the cap); once the leader saw
    how long c's contribution took, c is believed twice what it showed, no more."""
    from daisyweb.protocol.codec import F32

    peers = ("a", "b", "c")
    reps = {p: Replica() for p in peers}
    a = StepMachine("a", reps["a"], 3, lambda: "aa" * 16, leader="a", members=list(peers),
                    capacity=True, batch=8)
    a.speed = 8.0
    a.start(0.0)
    out: list = []
    for p, speed in (("b", 8.0), ("c", 1e12)):
        out += a.message(p, wire.StepHashes(0, p, reps[p].weight_hash(), "aa" * 16, "00",
                                            speed), 0.0)
    (first,) = [x.message for x in out if isinstance(x, Send)
                and isinstance(x.message, wire.Roster)]
    assert first.shares == (4, 4, MAX_FACTOR * 8)  # the cap: twice the equal share
    # each contribution arrives when its sequences at 8 a second are done
    done = {p: n / 8.0 for p, n in zip(peers, first.shares, strict=True)}
    out = a.local_contribution(0, 1.0, _grad("a", 0, 4), done["a"])
    for p in ("b", "c"):
        out += a.message(p, wire.Contribution(0, p, F32.encode(_grad(p, 0, first.shares[1]))),
                         done[p])
    (commit,) = [x for x in out if isinstance(x, Commit)]
    for p, speed in (("b", 8.0), ("c", 1e12)):
        out += a.message(p, wire.StepHashes(1, p, reps["a"].weight_hash(), "aa" * 16,
                                            wire.roster_digest(commit.roster, commit.shares),
                                            speed), 2.0)
    (roster,) = [x.message for x in out if isinstance(x, Send)
                 and isinstance(x.message, wire.Roster) and x.message.step == 1]
    # believed: a 8, b 8, c 2 x 8 = 16 -> 6, 6, 12 of 24
    assert roster.shares == (6, 6, 12)
