"""A round's deadline (``daisyweb.protocol.deadline``) and the leader enforcing it: a
member that withholds its contribution costs the group one deadline per round, then
is dropped; an honest group never trips it."""

from __future__ import annotations

from daisyweb.protocol import wire
from daisyweb.protocol.deadline import FIRST_S, FLOOR_S, MAX_MISSES, Deadline
from tests.daisyweb.protocol.test_election import ElectionBus, _settle


def test_the_deadline_follows_the_groups_round_times() -> None:
    d = Deadline()
    assert d.seconds() == FIRST_S  # nothing measured yet: the first rounds warm up
    for t in (2.0, 2.2, 1.8):
        d.record(t)
    assert d.seconds() == 3 * 2.0  # three medians
    for t in (2.0, 9.0, 2.1, 1.9, 2.0):
        d.record(t)
    assert d.seconds() == max(FLOOR_S, 3 * 2.0, 2.0 + 6 * 0.1)
    d2 = Deadline()
    for _ in range(5):
        d2.record(0.1)
    assert d2.seconds() == FLOOR_S  # a fast group keeps a floor for a hiccup


def test_misses_count_in_a_row() -> None:
    d = Deadline()
    assert not d.missed("c")
    d.made_it("c")
    assert not d.missed("c")
    assert d.missed("c") is (MAX_MISSES == 2)


def test_a_withholding_member_is_left_out_after_the_deadline_and_the_group_goes_on() -> None:
    bus = ElectionBus(["a", "b", "c", "d"], steps=8)
    bus.start()
    _settle(bus, 4)  # four rounds measured (in no time: the deadline is the floor)
    bus.hold_compute.discard("a")
    bus.hold_compute.discard("b")
    bus.hold_compute.discard("d")  # c heartbeats, answers nothing, sends nothing
    bus.run()
    assert bus.replicas["a"].step == 4  # the group waits for c...
    bus.advance(FLOOR_S - 0.5)
    assert bus.replicas["a"].step == 4
    bus.advance(1.0)  # ...one deadline, no more
    assert bus.replicas["a"].step > 4
    assert any(e.peer == "c" and "missed the deadline" in e.reason for e in bus.excluded)
    assert "c" in bus.cut_offs  # it sees the group go on without it: it rejoins
    # (here it never comes back: the leader stops waiting for its snapshot's hashes)
    bus.advance(bus.machines["a"].join_timeout + 1.0)
    assert set(bus.finished) == {"a", "b", "d"} and not bus.stopped
    assert len({bus.replicas[p].weight_hash() for p in "abd"}) == 1


def test_a_member_that_missed_the_deadline_is_not_waited_for_at_the_next_boundary() -> None:
    # c falls silent without its links dropping (a pause shorter than the heartbeat
    # timeout, or a peer starved of CPU): after one deadline the group names the next
    # roster without waiting for c's hashes, and offers c a snapshot once it asks back.
    bus = ElectionBus(["a", "b", "c", "d"], steps=8)
    bus.start()
    _settle(bus, 4)
    for q in "abd":
        bus.cut.add(frozenset(("c", q)))  # nothing from c arrives, nothing reaches it
    bus.hold_compute.difference_update("abd")
    bus.run()
    bus.hold_compute.update("abd")  # round 4 is in; the next contributions wait
    bus.advance(FLOOR_S + 0.5)
    a = bus.machines["a"]
    assert bus.replicas["a"].step == 5, "the group waited for c's hashes"
    assert a.roster(5) == ("a", "b", "d")
    assert a.members.alive("c") and not any("in a row" in e.reason for e in bus.excluded)
    bus.cut.clear()
    bus.handle("a", a.message("c", wire.Following("", 0), bus.now))
    assert list(a.members.pending) == ["c"]  # a joiner from now on
    bus.hold_compute.clear()
    bus.run()
    assert {s.peer for s in bus.snapshots} == {"c"}
