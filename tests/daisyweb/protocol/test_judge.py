"""The leader's sync guard (protocol.judge) on its own: rulings in order, halt last."""

from __future__ import annotations

from daisyweb.protocol.judge import Exclude, HaltRun, judge

W, W2, P, P2 = "11" * 8, "22" * 8, "aa" * 8, "bb" * 8


def test_agreement_rules_nothing() -> None:
    have = {p: (W, P) for p in "abc"}
    assert judge(4, "a", have, ["a", "b", "c"], [], set()) == []


def test_weights_minority_or_no_majority_halt() -> None:
    have = {"a": (W, P), "b": (W, P), "c": (W2, P)}
    assert judge(4, "a", have, ["a", "b", "c"], [], set()) == [
        HaltRun("weights diverged at step 4: c differ from the majority")]
    [ruling] = judge(4, "a", {"a": (W, P), "b": (W2, P)}, ["a", "b"], [], set())
    assert isinstance(ruling, HaltRun) and "no majority" in ruling.reason


def test_joiner_with_another_snapshot_is_excluded_and_not_judged_on_probes() -> None:
    have = {"a": (W, P), "b": (W, P), "j": (W2, P2)}
    assert judge(2, "a", have, ["a", "b"], ["j"], set()) == [
        Exclude("j", "j: snapshot weight hash does not match at step 2")]


def test_probe_minority_is_excluded_the_leader_in_it_halts() -> None:
    have = {"a": (W, P), "b": (W, P), "c": (W, P2)}
    assert judge(1, "a", have, ["a", "b", "c"], [], set()) == [
        Exclude("c", "c: kernel probe hash differs from the majority")]
    assert judge(1, "c", have, ["a", "b", "c"], [], set()) == [
        HaltRun("leader c's kernel probe differs from the majority")]
    [ruling] = judge(1, "a", {"a": (W, P), "b": (W, P2)}, ["a", "b"], [], set())
    assert isinstance(ruling, HaltRun) and "no majority" in ruling.reason
