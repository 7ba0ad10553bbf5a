"""Who is in the group (protocol.membership): participants, joiners, exclusions, successor."""

from __future__ import annotations

from daisyweb.protocol.membership import Membership, successor


def test_successor_rule() -> None:
    alive = {"b", "d"}.__contains__
    assert successor(("a", "b", "c", "d"), "a", alive) == "b"
    assert successor(("a", "b", "c", "d"), "c", alive) == "d"
    assert successor(("d", "a", "b"), "b", alive) == "d"
    assert successor(("a",), "a", alive) is None


def test_participants_in_join_order_self_included_once() -> None:
    m = Membership("b", ["a", "b", "c"])
    assert m.participants == ["a", "b", "c"]
    assert Membership("z", ["a"]).participants == ["a", "z"]
    m.learn(["a", "d"])
    assert m.participants == ["a", "b", "c", "d"]
    assert m.others() == ("a", "c", "d") and m.others(["x"]) == ("a", "c", "d", "x")


def test_down_and_excluded_peers_are_not_alive() -> None:
    m = Membership("a", ["a", "b", "c"])
    m.went_down("b")
    m.exclude("c")
    assert not m.alive("b") and not m.alive("c") and m.live_participants() == ["a"]
    m.came_up("b", 1.0)  # back as a joiner, not a participant
    assert m.alive("b") and m.pending == {"b": 1.0} and "b" not in m.participants


def test_joiners_are_offered_a_snapshot_once_then_admitted_or_expired() -> None:
    m = Membership("a", ["a"])
    m.came_up("j", 0.0)
    m.came_up("k", 0.0)
    assert m.offer_snapshots(3, 1.0) == ["j", "k"] and m.offer_snapshots(3, 2.0) == []
    assert m.offered_at(3) == ["j", "k"] and m.pending == {"j": 1.0, "k": 1.0}
    m.admit(["j"])
    assert m.participants == ["a", "j"] and "j" not in m.pending and "j" not in m.offered
    assert m.expire_joiners(5.0, 10.0) == []
    assert m.expire_joiners(11.0, 10.0) == ["k"]
    assert "k" in m.excluded and not m.pending and not m.offered
