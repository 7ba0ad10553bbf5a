"""A round's deadline (``daisyweb.protocol.deadline``) and the leader enforcing it: a
member that withholds its contribution costs the group one deadline per round, then
is dropped; an honest group never trips it."""

from __future__ import annotations

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
