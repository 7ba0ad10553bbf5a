"""Leadership by majority (``daisyweb.protocol.election`` in the step machine): a paused
or partitioned peer never leads a second group, a minority never commits, and two
leaders of one term halt naming both. On the in-process bus of ``test_sync``: links are
cut by dropping every message between two sides and telling each side the other is down.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from daisyweb.protocol import wire
from daisyweb.protocol.election import (
    RUNOFF_S,
    Leadership,
    reaches_majority,
    strict_majority,
)
from daisyweb.protocol.sync import CutOff, Leading, Phase, Send, StepMachine
from daisyweb.training.replay import replay
from tests.daisyweb.protocol.test_sync import ADAM, GOOD_PROBE, Bus, FakeReplica, initial_params


class ElectionBus(Bus):
    """The test bus, recording cut-offs and leadership, with links that can be cut."""

    def __init__(self, peers: list[str], steps: int, seed: int = 0) -> None:
        self.cut: set[frozenset[str]] = set()
        super().__init__(peers, steps, seed=seed,
                         drop=lambda src, dst, _m: frozenset((src, dst)) in self.cut)
        self.cut_offs: dict[str, CutOff] = {}
        self.leading: dict[str, list[Leading]] = {p: [] for p in peers}

    def handle(self, peer: str, actions: list) -> None:
        super().handle(peer, actions)
        for a in actions:
            if isinstance(a, CutOff):
                self.cut_offs[peer] = a
            elif isinstance(a, Leading):
                self.leading[peer].append(a)

    def split(self, side: Iterable[str], other: Iterable[str]) -> None:
        """Cut every link between ``side`` and ``other``; each end sees the other go."""
        side, other = list(side), list(other)
        for p in side:
            for q in other:
                self.cut.add(frozenset((p, q)))
                for k in ((p, q), (q, p)):
                    self.queues.pop(k, None)
        for p in side:
            for q in other:
                self.handle(p, self.machines[p].peer_down(q, self.now))
                self.handle(q, self.machines[q].peer_down(p, self.now))

    def pause(self, peer: str) -> None:
        """SIGSTOP long enough to be dropped: the others lose it, then it wakes to find
        every link gone (its heartbeats stopped too)."""
        others = [q for q in self.machines if q != peer and q not in self.dead]
        for q in others:
            self.cut.add(frozenset((peer, q)))
            for k in ((peer, q), (q, peer)):
                self.queues.pop(k, None)
        for q in others:
            self.handle(q, self.machines[q].peer_down(peer, self.now))
        self.run()  # the group goes on while it sleeps
        for q in others:  # it wakes: every link timed out at once
            self.handle(peer, self.machines[peer].peer_down(q, self.now))


def _hashes(bus: Bus, peers: Iterable[str]) -> set[str]:
    return {bus.replicas[p].weight_hash() for p in peers}


def _upto(bus: Bus, peer: str, step: int) -> None:
    """Run until ``peer`` is at boundary ``step``, mid-run (messages still in flight)."""
    while bus.replicas[peer].step < step:
        assert bus.step_once()


def _settle(bus: Bus, step: int) -> None:
    """Every member at boundary ``step`` with its roster named and nothing in flight:
    no contribution is computed until the test lets them (``hold_compute``)."""
    _upto(bus, "a", step)
    bus.hold_compute.update(bus.machines)
    bus.run()
    assert {r.step for r in bus.replicas.values()} == {step}


def _release(bus: Bus) -> None:
    bus.hold_compute.clear()
    bus.run()


def test_majority_helpers() -> None:
    assert strict_majority(3, 4) and not strict_majority(2, 4) and strict_majority(1, 1)
    assert reaches_majority(("a", "b", "c"), "a", {"c"})
    assert not reaches_majority(("a", "b", "c"), "a", {"b", "c"})
    assert not reaches_majority(("a", "b", "c", "d"), "a", {"c", "d"})  # a half is not
    lead = Leadership("a", "a")
    with pytest.raises(ValueError, match="before term"):
        lead.term = 2
        lead.follow("b", 1, 0.0)


def test_leadership_takes_one_declaration_per_peer_and_only_newer_terms() -> None:
    lead = Leadership("a", "x", term=1)
    electorate = ("a", "b", "c", "d", "e")
    lead.record("b", "c", 2)
    lead.record("b", "d", 1)  # an older term does not replace a newer declaration
    assert lead.declared["b"] == ("c", 2)
    lead.record("d", "c", 2)
    assert lead.elected(electorate) is None  # 2 of 5
    lead.record("e", "c", 2)
    assert lead.elected(electorate) == ("c", 2)
    lead.record("e", "", 0)  # e rejoins: it declares nobody
    assert lead.elected(electorate) is None


@pytest.mark.parametrize("seed", range(3))
def test_a_paused_follower_is_cut_off_and_the_group_finishes_alone(seed: int) -> None:
    bus = ElectionBus(["a", "b", "c", "d"], steps=6, seed=seed)
    bus.start()
    _upto(bus, "a", 2)
    bus.pause("d")
    bus.advance(2.0)  # repairs: d's last contribution may have reached the leader only
    assert "d" in bus.cut_offs and "reachable" in bus.cut_offs["d"].reason
    assert bus.machines["d"].phase is Phase.CUT_OFF and not bus.machines["d"].is_leader
    assert not bus.leading["d"]  # it never led a second group
    assert set(bus.finished) == {"a", "b", "c"} and not bus.stopped
    assert len(_hashes(bus, "abc")) == 1
    assert _hashes(bus, "a") == {replay(initial_params(), ADAM, bus.oracle_steps("a"))}
    # d's state is one the group had: a committed boundary of the same run
    d_step = bus.replicas["d"].step
    assert bus.commits["d"][-1].weight_hash == bus.commits["a"][d_step - 1].weight_hash


@pytest.mark.parametrize("seed", range(3))
def test_a_paused_leader_is_replaced_by_a_majority_and_cut_off_on_waking(seed: int) -> None:
    bus = ElectionBus(["a", "b", "c", "d"], steps=6, seed=seed)
    bus.start()
    _upto(bus, "b", 2)
    bus.pause("a")
    bus.advance(2.0)
    assert [(x.term, x.votes, x.electorate) for x in bus.leading["b"]] == [(1, 3, 4)]
    assert all(bus.machines[p].leader == "b" and bus.machines[p].term == 1 for p in "bcd")
    assert "a" in bus.cut_offs and not bus.machines["a"].is_leader
    assert set(bus.finished) == {"b", "c", "d"} and not bus.stopped
    assert len(_hashes(bus, "bcd")) == 1
    assert _hashes(bus, "b") == {replay(initial_params(), ADAM, bus.oracle_steps("b"))}


def test_a_split_vote_runs_off_to_one_leader() -> None:
    # c and e saw b go and come back late: when the leader dies they pick c, while b and
    # d pick b. Two votes each of five: no majority. The runoff names the leader most
    # declared (b and c tie: b, first in the roster) for term 2, and the group goes on.
    bus = ElectionBus(["a", "b", "c", "d", "e"], steps=8)
    bus.start()
    _settle(bus, 3)
    for p in "ce":
        bus.machines[p].members.down.add("b")
    bus.kill("a")
    bus.run()
    declared = {p: bus.machines[p].leadership.declared.get(p) for p in "bcde"}
    assert declared == {"b": ("b", 1), "c": ("c", 1), "d": ("b", 1), "e": ("c", 1)}
    for p in "ce":
        bus.handle(p, bus.machines[p].peer_up("b", bus.now))  # the link is back
    _release(bus)
    assert bus.replicas["b"].step == 3  # nobody leads yet
    bus.advance(RUNOFF_S + 0.5)
    assert not bus.cut_offs and not bus.stopped
    assert all(bus.machines[p].leader == "b" and bus.machines[p].term == 2 for p in "bcde")
    assert set(bus.finished) == {"b", "c", "d", "e"}
    assert len(_hashes(bus, "bcde")) == 1


def test_a_runoff_joins_a_later_terms_declaration() -> None:
    lead = Leadership("c", "a")
    lead.follow("c", 1, 0.0)
    for peer, leader, term in [("b", "b", 1), ("d", "b", 2), ("e", "c", 1)]:
        lead.record(peer, leader, term)
    assert lead.runoff(("a", "b", "c", "d", "e")) == ("b", 2)  # d ran off first: join it
    assert lead.runoff(("a", "b", "c", "e")) == ("c", 2)  # a split: c has two votes
    assert lead.runoff(("a", "c", "e")) is None  # one leader declared: no split, wait


def test_two_against_two_commits_nothing_and_both_halves_say_so() -> None:
    bus = ElectionBus(["a", "b", "c", "d"], steps=6)
    bus.start()
    _settle(bus, 2)
    before = {p: bus.replicas[p].step for p in "abcd"}
    bus.split("ab", "cd")
    _release(bus)
    bus.advance(30.0)
    assert set(bus.cut_offs) == {"a", "b", "c", "d"}, bus.cut_offs
    assert not bus.finished and not any(bus.leading.values())
    assert {p: bus.replicas[p].step for p in "abcd"} == before  # nobody committed


def test_three_against_two_the_three_go_on_and_the_two_stop() -> None:
    bus = ElectionBus(["a", "b", "c", "d", "e"], steps=6)
    bus.start()
    _upto(bus, "a", 2)
    bus.split("abc", "de")
    bus.run()
    bus.advance(30.0)
    assert set(bus.cut_offs) == {"d", "e"}
    assert set(bus.finished) == {"a", "b", "c"} and not bus.stopped
    assert len(_hashes(bus, "abc")) == 1
    # the minority with the leader's successor in it: same, whichever side leads
    bus = ElectionBus(["a", "b", "c", "d", "e"], steps=6)
    bus.start()
    _upto(bus, "a", 2)
    bus.split("ab", "cde")
    bus.run()
    bus.advance(30.0)
    assert set(bus.cut_offs) == {"a", "b"}
    assert len(bus.leading["c"]) == 1  # term 1 or 2: c may have declared b first
    assert set(bus.finished) == {"c", "d", "e"} and not bus.stopped
    assert len(_hashes(bus, "cde")) == 1


def test_a_successor_without_a_majority_in_time_is_cut_off() -> None:
    bus = ElectionBus(["a", "b", "c", "d"], steps=6)
    bus.start()
    _settle(bus, 1)
    b = bus.machines["b"]
    bus.cut.update(frozenset(("b", q)) for q in "cd")  # c's and d's declarations never come
    bus.handle("b", b.peer_down("a", bus.now))
    assert b.leadership.candidate and not b.is_leader
    bus.advance(b.election_timeout - 0.5)
    assert not b.done
    bus.advance(1.0)
    assert "no majority" in bus.cut_offs["b"].reason and not bus.leading["b"]


def test_two_leaders_of_one_term_halt_naming_both() -> None:
    bus = ElectionBus(["a", "b", "c"], steps=6)
    bus.start()
    _settle(bus, 1)
    c = bus.machines["c"]
    out = c.message("b", wire.Roster(c.boundary, ("b", "c"), (), 0), bus.now)
    bus.handle("c", out)
    assert "two leaders of term 0: b and a" in bus.stopped["c"].reason


def test_a_stale_leader_learns_the_new_term_and_steps_down() -> None:
    bus = ElectionBus(["a", "b", "c"], steps=6)
    bus.start()
    _settle(bus, 1)
    a, b, c = (bus.machines[p] for p in "abc")
    bus.cut.update({frozenset("ab"), frozenset("ac")})  # b and c lose a; a sees nothing
    bus.handle("b", b.peer_down("a", bus.now))
    bus.handle("c", c.peer_down("a", bus.now))
    bus.run()
    assert (c.leader, c.term) == ("b", 1) and b.is_leader  # b and c: 2 of 3
    # a's roster of term 0 is stale for c, which tells a who leads now
    out = c.message("a", wire.Roster(c.boundary, ("a", "b", "c"), (), 0), bus.now)
    assert [a.message for a in out if isinstance(a, Send)] == [wire.Following("b", 1)]
    bus.handle("a", a.message("b", wire.Following("b", 1), bus.now))
    bus.handle("a", a.message("c", wire.Following("b", 1), bus.now))
    assert "b leads term 1" in bus.cut_offs["a"].reason and not a.is_leader


def test_a_roster_beyond_our_boundary_or_without_us_means_rejoin() -> None:
    bus = ElectionBus(["a", "b", "c"], steps=6)
    bus.start()
    _settle(bus, 1)
    c = bus.machines["c"]
    b = c.boundary
    bus.handle("c", c.message("a", wire.Roster(b + 2, ("a", "b", "c")), bus.now))
    assert f"the group is at step {b + 2}" in bus.cut_offs["c"].reason
    m = bus.machines["b"]
    bus.handle("b", m.message("a", wire.Roster(m.boundary, ("a", "c")), bus.now))
    assert "went on without b" in bus.cut_offs["b"].reason


def test_a_member_that_rejoins_is_amended_away_and_offered_a_snapshot() -> None:
    bus = ElectionBus(["a", "b", "c"], steps=6)
    bus.start()
    _settle(bus, 2)
    bus.hold_compute.discard("a")
    bus.hold_compute.discard("b")  # c's contribution of this step never comes
    bus.run()
    a = bus.machines["a"]
    bus.handle("a", a.message("c", wire.Following("", 0), bus.now))
    bus.run()
    assert "c" not in a.members.participants
    assert [s.peer for s in bus.snapshots] == ["c"]  # a joiner from now on
    assert bus.commits["a"][-1].roster == ("a", "b")


def test_a_minority_leader_never_names_a_roster() -> None:
    bus = ElectionBus(["a", "b", "c"], steps=6)
    bus.start()
    _settle(bus, 2)
    a = bus.machines["a"]
    step = a.boundary
    bus.split("a", "bc")
    _release(bus)
    sent = [x for x in bus.queues.values() if x]
    assert "a" in bus.cut_offs and a.replica.step == step
    assert not sent or all(wire.decode(m).type != "roster" for q in sent for m in q)


def test_a_member_that_leaves_on_purpose_no_longer_counts_toward_the_majority() -> None:
    # Two peers: the follower is interrupted and says so; the leader goes on alone. Had
    # it only lost the link, one of two would be no majority and the leader would stop.
    bus = ElectionBus(["a", "b"], steps=6)
    bus.start()
    _settle(bus, 2)
    a = bus.machines["a"]
    bus.handle("a", a.message("b", wire.Following("", 0), bus.now))
    bus.kill("b")
    _release(bus)
    assert "a" not in bus.cut_offs and bus.finished.get("a") is not None
    assert a.electorate() == ("a",)
    # without the word, the same loss cuts the leader off
    bus = ElectionBus(["a", "b"], steps=6)
    bus.start()
    _settle(bus, 2)
    bus.kill("b")
    _release(bus)
    assert "no majority" in bus.cut_offs["a"].reason


def _ghost_joiner() -> tuple[ElectionBus, StepMachine]:
    """Three members at boundary 3; the leader ``a`` offered "ghost" a snapshot of it,
    which it never confirms (the join timeout far off)."""
    bus = ElectionBus(["a", "b", "c"], steps=8)
    a = bus.machines["a"]
    a.join_timeout = 60.0
    bus.start()
    _settle(bus, 2)
    bus.handle("a", a.peer_up("ghost", bus.now))
    _release(bus)
    return bus, a


def test_the_group_waits_for_a_joiners_snapshot_no_longer_than_a_snapshot_takes() -> None:
    from daisyweb.protocol.leading import SNAPSHOT_WAIT_FLOOR_S

    bus, _ = _ghost_joiner()
    assert bus.replicas["a"].step == 3 and [s.peer for s in bus.snapshots] == ["ghost"]
    bus.advance(SNAPSHOT_WAIT_FLOOR_S - 1.0)
    assert bus.replicas["a"].step == 3  # the roster waits for the joiner...
    bus.advance(2.0)
    assert set(bus.finished) == {"a", "b", "c"}  # ...a snapshot's time, not join_timeout
    assert not any(e.peer == "ghost" for e in bus.excluded)


def test_a_joiner_whose_snapshot_went_stale_is_offered_a_new_one() -> None:
    bus, a = _ghost_joiner()
    bus.hold_compute.update("abc")
    bus.advance(11.0)  # the group goes on without it: roster 3 named, computes held
    assert bus.replicas["a"].step == 3 and "ghost" not in (a.roster(3) or ())
    # the joiner finds the group gone on and asks again, as a rejoining peer does
    bus.handle("a", a.message("ghost", wire.Following("", 0), bus.now))
    _release(bus)
    assert [s.step for s in bus.snapshots if s.peer == "ghost"] == [3, 4]


def test_a_joiners_hello_that_crossed_its_snapshot_brings_no_second_one() -> None:
    """Every joiner says it follows nobody when its link comes up; a leader that offered
    it a snapshot meanwhile (32 joiners at once: all of them) must not send another."""
    bus, a = _ghost_joiner()
    assert a.roster(3) is None  # the group still waits for the joiner at boundary 3
    bus.handle("a", a.message("ghost", wire.Following("", 0), bus.now))
    bus.advance(1.0)
    assert [s.step for s in bus.snapshots if s.peer == "ghost"] == [3]


def test_a_peer_that_stood_still_is_cut_off_before_it_acts() -> None:
    """A leader woken from a pause holds, in its own view, a round whose deadline passed
    long ago: amending it and committing would fork the group. It is cut off first."""
    bus = ElectionBus(["a", "b", "c"], steps=6)
    bus.start()
    _settle(bus, 2)
    a = bus.machines["a"]
    before = bus.replicas["a"].step
    out = a.stood_still(12.0)
    bus.handle("a", out)
    assert "stood still 12.0 s" in bus.cut_offs["a"].reason and a.done
    assert any(isinstance(x, Send) and x.message == wire.Following("", 0) for x in out)
    bus.advance(30.0)  # nothing it held is acted on any more
    assert bus.replicas["a"].step == before and not bus.commits["a"][before:]


def test_a_member_the_group_went_on_without_is_cut_off() -> None:
    # d hears everything but the leader's rosters (a follower the leader no longer names
    # rosters to): it waits at its boundary while the group leaves it out at the deadline
    # and goes on. Hashes from a majority two boundaries past its own tell it.
    from daisyweb.protocol.deadline import FLOOR_S
    from daisyweb.protocol.leading import SNAPSHOT_WAIT_FLOOR_S

    bus = ElectionBus(["a", "b", "c", "d"], steps=10)
    bus.start()
    _settle(bus, 4)
    cut = bus.drop
    assert cut is not None
    bus.drop = lambda src, dst, m: cut(src, dst, m) or (
        (src, dst) == ("a", "d") and isinstance(m, wire.Roster))
    _release(bus)
    bus.advance(FLOOR_S + 0.5)
    assert "went on without" in bus.cut_offs["d"].reason
    assert bus.machines["d"].phase is Phase.CUT_OFF
    assert [s.peer for s in bus.snapshots] == ["d"]  # it asked to come back
    bus.advance(SNAPSHOT_WAIT_FLOOR_S + 1.0)  # (here it never takes the snapshot)
    assert set(bus.finished) == {"a", "b", "c"} and not bus.stopped


def test_a_joiner_late_to_confirm_is_sent_the_roster_that_leaves_it_out() -> None:
    from daisyweb.protocol.leading import SNAPSHOT_WAIT_FLOOR_S

    bus, a = _ghost_joiner()
    bus.advance(SNAPSHOT_WAIT_FLOOR_S + 1.0)  # the group stops waiting for "ghost"
    to_ghost = [wire.decode(m) for m in bus.queues.get(("a", "ghost"), ())]
    rosters = [m for m in to_ghost if isinstance(m, wire.Roster)]
    assert rosters and all("ghost" not in r.members for r in rosters)


def test_a_joiner_whose_leader_went_on_two_boundaries_is_cut_off() -> None:
    # A joiner never named in a roster knows one member: the leader. Its hashes two
    # boundaries past the joiner's are enough (a majority of one).
    j = StepMachine("j", FakeReplica(), 8, lambda: GOOD_PROBE, leader="a")
    j.start(0.0)
    h = wire.StepHashes(1, "a", "ab" * 32, "cd" * 32, wire.NO_ROSTER)
    assert not j.message("a", h, 0.0) and not j.done
    out = j.message("a", wire.StepHashes(2, "a", "ab" * 32, "cd" * 32, wire.NO_ROSTER), 0.0)
    assert any(isinstance(x, CutOff) and "went on without" in x.reason for x in out)


def test_snapshots_offered_at_once_are_waited_for_as_many_times_longer() -> None:
    # Three joiners at one boundary share the leader's uplink: the group waits up to
    # three snapshots' time for them (a 24-peer start sends 23 at once).
    from daisyweb.protocol.leading import SNAPSHOT_WAIT_FLOOR_S

    bus = ElectionBus(["a", "b", "c"], steps=8)
    a = bus.machines["a"]
    a.join_timeout = 120.0
    bus.start()
    _settle(bus, 2)
    for g in ("g1", "g2", "g3"):
        bus.handle("a", a.peer_up(g, bus.now))
    _release(bus)
    assert bus.replicas["a"].step == 3 and len(bus.snapshots) == 3
    bus.advance(3 * SNAPSHOT_WAIT_FLOOR_S - 1.0)
    assert bus.replicas["a"].step == 3  # still waiting for the three
    bus.advance(2.0)
    assert set(bus.finished) == {"a", "b", "c"}
