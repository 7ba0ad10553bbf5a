from daisyweb.protocol.ledger import StepLedger


def _ledger(steps: range) -> StepLedger:
    ledger = StepLedger()
    for s in steps:
        st = ledger.open(s)
        st.roster = ("a", "b")
        st.grads = {"a": b"ga%d" % s, "b": b"gb%d" % s}
    return ledger


def test_the_leader_keeps_gradients_a_repair_can_ask_for_and_no_older_ones() -> None:
    """A repair asks for the asker's boundary, never behind the last committed step: the
    leader keeps that step's, the one before and the one in flight; rosters stay longer."""
    ledger = _ledger(range(0, 12))
    for s in range(0, 11):
        ledger.committed[s] = ("a", "b")
    ledger.forget_before(10, history=8, keep_grads=True)
    kept = {k for k, st in ledger.steps.items() if st.grads}
    assert kept == {9, 10, 11}
    assert set(ledger.steps) == set(range(3, 12))  # the steps' rosters: 8 back
    assert set(ledger.committed) == set(range(2, 11))


def test_a_follower_keeps_the_committed_step_for_a_rollback_and_the_current_one() -> None:
    ledger = _ledger(range(0, 12))
    ledger.forget_before(10, history=8, keep_grads=False)
    assert {k for k, st in ledger.steps.items() if st.grads} == {10, 11}
