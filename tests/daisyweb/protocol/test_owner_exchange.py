"""The owner exchange in the step machine (``protocol.owner_exchange``): several
StepMachines on test_sync's in-process bus, each run checked against the replay oracle
of the owner exchange (``training.replay.replay_owned``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from daisyweb.protocol import wire
from daisyweb.protocol.codec import F32, INT4, Codec
from daisyweb.protocol.owner_exchange import hand_over
from daisyweb.protocol.owners import part_bounds
from daisyweb.training.replay import replay_owned
from tests.daisyweb.protocol.test_sync import ADAM, Bus, grad_for, initial_params

SIZE = 1500  # six parts of 256 values: every part of a 3- to 6-peer roster holds some


def _grad(peer: str, step: int) -> np.ndarray:
    return grad_for(peer, step, SIZE)


def _bus(peers: list[str], steps: int, seed: int = 0, codec: Codec = F32,
         drop: Callable[[str, str, wire.Message], bool] | None = None, **kw) -> Bus:
    return Bus(peers, steps, seed=seed, grad=kw.pop("grad", _grad), codec=codec, drop=drop,
               size=SIZE, exchange="owner", **kw)


def _oracle(bus: Bus, peer: str, codec: Codec = F32) -> list[str]:
    """The weight hash after every step ``peer`` committed, as one process computes it."""
    by_step = {c.step: c for c in bus.commits[peer]}  # the latest commit of a step wins
    steps = []
    for s in sorted(by_step):
        c = by_step[s]
        payloads = {p: codec.encode(bus.sent_grads[(p, s)]) for p in c.roster}
        steps.append((c.roster, c.owners, payloads, c.shares))
    return replay_owned(initial_params(SIZE), ADAM, steps, codec)


def _traffic(bus: Bus) -> list[str]:
    """Every message type put on the bus from now on, in order."""
    seen: list[str] = []
    handle = bus.handle

    def recording(peer: str, actions: list) -> None:
        seen.extend(type(a.message).__name__ for a in actions if hasattr(a, "message"))
        handle(peer, actions)

    bus.handle = recording  # type: ignore[method-assign]
    return seen


def _check_end(bus: Bus, peers: list[str], steps: int, codec: Codec = F32) -> None:
    """Every peer finished, and its weights at every boundary are the oracle's."""
    assert not bus.stopped, bus.stopped
    assert set(bus.finished) == set(peers)
    oracle = _oracle(bus, peers[0], codec)
    assert len(oracle) == steps
    for p in peers:
        assert [c.weight_hash for c in _latest(bus, p)] == oracle
        assert bus.replicas[p].weight_hash() == oracle[-1]


def _latest(bus: Bus, peer: str) -> list:
    """``peer``'s commits, the latest of each step (a rollback's replaces the first)."""
    by_step = {c.step: c for c in bus.commits[peer]}
    return [by_step[s] for s in sorted(by_step)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [3, 6])
def test_a_group_on_the_owner_exchange_equals_the_replay_oracle(n: int, seed: int) -> None:
    peers = [chr(ord("a") + i) for i in range(n)]
    bus = _bus(peers, 4, seed)
    sent = _traffic(bus)
    bus.start()
    bus.run()
    _check_end(bus, peers, 4)
    assert all(c.owners == tuple(peers) for c in bus.commits["a"])
    assert "Contribution" not in sent and {"OwnedPart", "MeanPart"} <= set(sent)


def test_int4_means_are_the_owners_bytes_with_their_error_feedback() -> None:
    peers = ["a", "b", "c", "d"]
    bus = _bus(peers, 5, 1, codec=INT4)
    bus.start()
    bus.run()
    _check_end(bus, peers, 5, INT4)
    # the oracle differs from one that applies the exact means (the second quantization)
    exact = replay_owned(initial_params(SIZE), ADAM, [
        (c.roster, c.owners, {p: F32.encode(INT4.decode(INT4.encode(
            bus.sent_grads[(p, c.step)]), SIZE)) for p in c.roster}, c.shares)
        for c in _latest(bus, "a")], F32)
    assert exact[-1] != _oracle(bus, "a", INT4)[-1]


def test_auto_runs_all_to_all_below_the_switch_and_owners_from_it() -> None:
    from daisyweb.protocol.owner_exchange import OWNER_FROM
    small = [chr(ord("a") + i) for i in range(OWNER_FROM - 1)]
    big = [chr(ord("a") + i) for i in range(OWNER_FROM)]
    for peers, owned in ((small, False), (big, True)):
        bus = Bus(peers, 2, grad=_grad, size=SIZE, exchange="auto")
        bus.start()
        bus.run()
        assert set(bus.finished) == set(peers)
        assert all(bool(c.owners) is owned for c in bus.commits["a"])


def _drop_once(pred: Callable[[str, str, wire.Message], bool]
               ) -> Callable[[str, str, wire.Message], bool]:
    done: list[bool] = []

    def drop(src: str, dst: str, msg: wire.Message) -> bool:
        if not done and pred(src, dst, msg):
            done.append(True)
            return True
        return False

    return drop


def test_a_lost_part_is_sent_again_when_its_owner_asks() -> None:
    peers = ["a", "b", "c", "d"]
    drop = _drop_once(lambda s, d, m: isinstance(m, wire.OwnedPart) and (s, d) == ("b", "c"))
    bus = _bus(peers, 3, drop=drop)
    sent = _traffic(bus)
    bus.start()
    bus.run()
    assert not bus.finished  # c waits for b's part
    bus.advance(1.5)
    assert "PartRequest" in sent
    _check_end(bus, peers, 3)


def test_a_lost_mean_is_relayed_by_the_leader() -> None:
    peers = ["a", "b", "c", "d"]
    drop = _drop_once(lambda s, d, m: isinstance(m, wire.MeanPart) and (s, d) == ("c", "b"))
    bus = _bus(peers, 3, drop=drop)
    sent = _traffic(bus)
    bus.start()
    bus.run()
    assert not bus.finished
    bus.advance(1.5)
    assert "MeanRequest" in sent
    _check_end(bus, peers, 3)


def test_a_mean_is_relayed_by_the_leader_only() -> None:
    bus = _bus(["a", "b", "c", "d"], 2)
    bus.hold_compute = {"d"}  # no owner can reduce yet
    bus.start()
    bus.run()
    st = bus.machines["b"].ledger.get(0)
    assert st is not None and st.owners == ("a", "b", "c", "d")
    rh = wire.cut_digest(st.roster, st.shares, len(st.owners))
    where = part_bounds(SIZE, 4)[3]
    nine = np.full(where.stop - where.start, 9.0, np.float32)
    forged = wire.MeanPart(0, "d", 3, rh, (float(np.square(nine).sum()),) * 4,
                           F32.encode(nine))
    bus.machines["b"].message("c", forged)  # c relays d's mean: not c's to relay
    assert (3, "d") not in st.means
    bus.machines["b"].message("a", forged)  # the leader relays it: taken
    assert st.mean_of(3, rh) == forged.payload


def test_a_mean_from_a_member_that_does_not_own_the_part_is_not_applied() -> None:
    peers = ["a", "b", "c"]
    bus = _bus(peers, 1)
    bus.hold_compute = {"c"}
    bus.start()
    bus.run()
    m = bus.machines["b"]
    st = m.ledger.get(0)
    rh = wire.cut_digest(st.roster, st.shares, len(st.owners))
    where = part_bounds(SIZE, 3)[2]  # c owns part 2; a forges it
    m.message("a", wire.MeanPart(0, "a", 2, rh, (0.0,) * 3,
                                 F32.encode(np.zeros(where.stop - where.start, np.float32))))
    assert st.mean_of(2, rh) is None
    bus.hold_compute.clear()
    bus.run()
    _check_end(bus, peers, 1)


def test_an_owner_that_applied_its_own_mean_undecoded_would_fork() -> None:
    """Every member, the owner included, applies the decoded bytes: with int4 the
    owner's exact mean differs from them, and the group stays identical."""
    peers = ["a", "b", "c", "d"]
    bus = _bus(peers, 3, 2, codec=INT4)
    bus.start()
    bus.run()
    _check_end(bus, peers, 3, INT4)
    owner = bus.machines["b"].owned
    assert owner.encoder.feedback.residual.any()  # its bytes are not its exact mean


@pytest.mark.parametrize("codec", [F32, INT4], ids=["f32", "int4"])
def test_an_owner_killed_mid_step_hands_its_part_to_its_successor(codec: Codec) -> None:
    peers = ["a", "b", "c", "d"]
    # c's means of step 1 never leave it: it dies having reduced its part
    bus = _bus(peers, 3, codec=codec,
               drop=lambda s, d, m: isinstance(m, wire.MeanPart) and s == "c"
               and m.step == 1)
    bus.start()
    bus.run()
    assert not bus.finished
    bus.kill("c")  # the leader hands c's part to d at once: no repair timer runs
    bus.run()
    live = ["a", "b", "d"]
    assert not bus.stopped, bus.stopped
    assert set(bus.finished) == set(live)
    step1 = {c.step: c for c in bus.commits["a"]}[1]
    assert step1.roster == ("a", "b", "d") and step1.owners == ("a", "b", "d", "d")
    assert len({bus.replicas[p].weight_hash() for p in live}) == 1
    assert {bus.replicas[p].weight_hash() for p in live} == {_oracle(bus, "a", codec)[-1]}


@pytest.mark.parametrize("codec", [F32, INT4], ids=["f32", "int4"])
def test_a_contributor_killed_mid_step_is_amended_away(codec: Codec) -> None:
    peers = ["a", "b", "c", "d"]
    # d's part of step 1 reaches a and b, never c; then d dies
    bus = _bus(peers, 3, codec=codec,
               drop=lambda s, d, m: isinstance(m, wire.OwnedPart) and s == "d"
               and d == "c" and m.step == 1)
    bus.start()
    bus.run()
    bus.kill("d")
    bus.advance(1.5)
    bus.advance(1.5)
    live = ["a", "b", "c"]
    assert not bus.stopped, bus.stopped
    assert set(bus.finished) == set(live)
    step1 = {c.step: c for c in bus.commits["a"]}[1]
    assert step1.roster == ("a", "b", "c") and step1.owners == ("a", "b", "c", "a")
    assert {bus.replicas[p].weight_hash() for p in live} == {_oracle(bus, "a", codec)[-1]}


@pytest.mark.parametrize("codec", [F32, INT4], ids=["f32", "int4"])
def test_a_member_that_committed_rolls_back_when_the_roster_is_amended(codec: Codec) -> None:
    peers = ["a", "b", "c", "d"]
    # d's mean of step 1 reaches b only; d dies: b committed, the leader amends d away
    bus = _bus(peers, 3, codec=codec,
               drop=lambda s, d, m: isinstance(m, wire.MeanPart) and s == "d"
               and d != "b" and m.step == 1)
    bus.start()
    bus.run()
    assert any(c.step == 1 for c in bus.commits["b"])
    bus.kill("d")
    bus.advance(1.5)
    bus.advance(1.5)
    live = ["a", "b", "c"]
    assert not bus.stopped, bus.stopped
    assert any(c.rollback and c.step == 1 for c in bus.commits["b"])
    assert set(bus.finished) == set(live)
    assert {bus.replicas[p].weight_hash() for p in live} == {_oracle(bus, "b", codec)[-1]}


@pytest.mark.parametrize("codec", [F32, INT4], ids=["f32", "int4"])
def test_the_leader_killed_mid_step_its_successor_finishes(codec: Codec) -> None:
    peers = ["a", "b", "c", "d"]
    bus = _bus(peers, 3, codec=codec,
               drop=lambda s, d, m: isinstance(m, wire.MeanPart) and s == "a"
               and m.step == 1)
    bus.start()
    bus.run()
    bus.kill("a")
    for _ in range(4):
        bus.advance(1.5)
    live = ["b", "c", "d"]
    assert not bus.stopped, bus.stopped
    assert set(bus.finished) == set(live)
    assert {bus.replicas[p].weight_hash() for p in live} == {_oracle(bus, "b", codec)[-1]}


def test_capacity_shares_weight_each_part_as_all_to_all_weights_the_whole() -> None:
    peers = ["a", "b", "c", "d"]
    bus = _bus(peers, 3, 3)
    for m in bus.machines.values():
        m.capacity = True
        m.batch = 4
    bus.start()
    bus.run()
    _check_end(bus, peers, 3)


def test_a_new_cut_of_a_step_sends_the_contribution_again() -> None:
    """A new leader that never saw the step's roster cuts it anew (or runs it
    all-to-all): what was sent under the old cut is void, and goes out again."""
    for owners in (("a", "b", "c"), ()):
        bus = _bus(["a", "b", "c", "d"], 2)
        bus.hold_compute = {"d"}
        bus.start()
        bus.run()
        m = bus.machines["b"]
        out = m.message("a", wire.Roster(0, ("a", "b", "c"), (), 0, owners))
        sent = [a.message for a in out if hasattr(a, "message")]
        assert not m.done
        if owners:
            assert {(x.part, x.parts) for x in sent if isinstance(x, wire.OwnedPart)} == {
                (0, 3), (2, 3)}
        else:
            assert [x.sender for x in sent if isinstance(x, wire.Contribution)] == ["b"]


def test_a_bad_part_on_the_wire_is_refused_naming_its_sender() -> None:
    bus = _bus(["a", "b", "c"], 2)
    bus.hold_compute = {"a", "b", "c"}
    bus.start()
    bus.run()
    nan = F32.encode(np.full(256, np.nan, np.float32))  # b owns 256..512
    bus.handle("b", bus.machines["b"].message("c", wire.OwnedPart(0, "c", 1, 3, nan)))
    assert "part 1 from c" in bus.stopped["b"].reason, bus.stopped
    bus2 = _bus(["a", "b", "c"], 2)
    bus2.hold_compute = {"a", "b", "c"}
    bus2.start()
    bus2.run()
    short = F32.encode(np.zeros(255, np.float32))
    bus2.handle("b", bus2.machines["b"].message("c", wire.OwnedPart(0, "c", 1, 3, short)))
    assert "part 1 from c" in bus2.stopped["b"].reason, bus2.stopped


def test_hand_over_gives_a_lost_owners_parts_to_the_next_live_owner() -> None:
    assert hand_over(("a", "b", "c", "d"), "b", ("a", "c", "d")) == ("a", "c", "c", "d")
    assert hand_over(("a", "b", "c", "d"), "d", ("a", "b", "c")) == ("a", "b", "c", "a")
    assert hand_over(("a", "c", "c", "d"), "c", ("a", "d")) == ("a", "d", "d", "d")


def _inflating(bus: Bus, owner: str, step: int, to: set[str] | None = None) -> None:
    """``owner`` sends a mean of ``step`` 50 times too big (to ``to`` only, if given)."""
    real = bus.handle

    def handle(peer: str, actions: list) -> None:
        out = []
        for a in actions:
            msg = getattr(a, "message", None)
            if peer == owner and isinstance(msg, wire.MeanPart) and msg.step == step:
                big = F32.encode(F32.decode(msg.payload, len(msg.payload) // 4) * 50)
                bad = wire.MeanPart(msg.step, msg.owner, msg.part, msg.roster_hash,
                                    msg.norms, big)
                if to is None:
                    out.append(type(a)(a.to, bad))
                    continue
                out.append(type(a)(tuple(q for q in a.to if q in to), bad))
                a = type(a)(tuple(q for q in a.to if q not in to), msg)
            out.append(a)
        real(peer, out)

    bus.handle = handle  # type: ignore[method-assign]


def test_an_owner_whose_mean_is_out_of_bounds_is_excluded_and_its_part_handed_over() -> None:
    peers = ["a", "b", "c", "d"]
    bus = _bus(peers, 3)
    _inflating(bus, "c", 1)
    bus.start()
    bus.run()
    live = ["a", "b", "d"]
    assert not bus.stopped.get("a") and not bus.stopped.get("b"), bus.stopped
    assert set(bus.finished) == set(live), (bus.finished, bus.stopped)
    assert any(e.peer == "c" and "refused" in e.reason for e in bus.excluded), bus.excluded
    step1 = {c.step: c for c in bus.commits["a"]}[1]
    assert step1.roster == ("a", "b", "d") and step1.owners == ("a", "b", "d", "d")
    _check_end(bus, live, 3)


def test_an_owner_that_inflates_one_members_copy_is_outvoted_by_the_leaders() -> None:
    peers = ["a", "b", "c", "d"]
    bus = _bus(peers, 3)
    _inflating(bus, "c", 1, to={"b"})  # the leader and d get the honest bytes
    sent = _traffic(bus)
    bus.start()
    bus.run()
    assert "MeanRequest" in sent  # b refused its copy and asked the leader for its own
    _check_end(bus, peers, 3)


def test_only_the_silent_member_misses_the_deadline_not_the_owners_waiting_on_it() -> None:
    """Owners that cannot reduce because one member's part never comes are not late: the
    deadline leaves out that member only (its part of the leader's is missing too)."""
    peers = ["a", "b", "c", "d"]
    bus = _bus(peers, 8, repair_after=100.0)
    bus.start()
    while len(bus.commits["a"]) < 4:  # rounds measured: the deadline is FLOOR_S now
        assert bus.step_once()
    bus.hold_compute = {"d"}  # from now on d computes nothing (paused)
    bus.run()
    while "d" not in {e.peer for e in bus.excluded} and bus.now < 200:
        bus.advance(1.0)
    assert {e.peer for e in bus.excluded} == {"d"}, bus.excluded
    assert "missed the deadline" in next(e.reason for e in bus.excluded if e.peer == "d")
    bus.run()
    for _ in range(40):  # (d, cut off, asks to rejoin: its snapshot is waited for, 10 s)
        bus.advance(1.0)
    assert set(bus.finished) == {"a", "b", "c"}, (bus.finished, bus.stopped)
    assert {bus.replicas[p].weight_hash() for p in "abc"} == {_oracle(bus, "a")[-1]}


def test_an_owner_that_withholds_its_mean_is_left_out_after_twice_the_deadline() -> None:
    peers = ["a", "b", "c", "d"]
    bus = _bus(peers, 8, repair_after=100.0,
               drop=lambda s, d, m: isinstance(m, wire.MeanPart) and s == "c" and m.step >= 3)
    bus.start()
    bus.run()
    assert len(bus.commits["a"]) == 3  # round 3 waits for c's mean
    start = bus.now
    while "c" not in {e.peer for e in bus.excluded} and bus.now < 400:
        bus.advance(1.0)
    left = [e for e in bus.excluded if e.peer == "c"]
    assert left and "sent no mean of part 2" in left[0].reason, bus.excluded
    assert bus.now - start >= 2 * 3.0  # not before twice the deadline
    assert {e.peer for e in bus.excluded} == {"c"}
    for _ in range(40):
        bus.advance(1.0)
    assert set(bus.finished) == {"a", "b", "d"}, (bus.finished, bus.stopped)
    assert {bus.replicas[p].weight_hash() for p in "abd"} == {_oracle(bus, "a")[-1]}


def test_the_heir_of_a_part_has_its_own_time_to_reduce_it() -> None:
    """c withholds its mean; its part goes to d, which then misses b's part of it: d is
    left out only twice the deadline after it was handed the part, not at once."""
    peers = ["a", "b", "c", "d"]
    drop = lambda s, d, m: (isinstance(m, wire.MeanPart) and s == "c" and m.step >= 3) or (  # noqa: E731
        isinstance(m, wire.OwnedPart) and (s, d, m.part) == ("b", "d", 2))
    bus = _bus(peers, 8, repair_after=100.0, drop=drop)
    bus.start()
    bus.run()
    while "c" not in {e.peer for e in bus.excluded} and bus.now < 400:
        bus.advance(1.0)
    handed = bus.now
    while "d" not in {e.peer for e in bus.excluded} and bus.now < handed + 60:
        bus.advance(1.0)
    assert "sent no mean of part 2" in bus.excluded[-1].reason, bus.excluded
    assert bus.now - handed >= 2 * 3.0
