"""Rounds of local steps: members stay identical at boundaries, equal to the replay oracle."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from daisyweb.data import BatchSampler
from daisyweb.model import ModelConfig, loss_and_grad
from daisyweb.optim import DaisyAdam
from daisyweb.protocol.averaging import average_in_roster_order
from daisyweb.training.config import RunConfig
from daisyweb.training.replay import replay_hashes, replay_rounds
from daisyweb.training.rounds import (
    LockstepTrainer,
    RoundTrainer,
    grid_lengths,
    outer_step,
    rounds_before,
)
from daisyweb.training.state import TrainState

MODEL = ModelConfig(vocab=64, width=16, layers=1, heads=2, seq=8)
TOKENS = np.arange(4000, dtype=np.int64) * 7 % 64


def _run(steps: int, sync_every: int) -> RunConfig:
    return RunConfig(model=MODEL, batch=2, steps=steps, lr=1e-2, seed=1,
                     sync_every=sync_every, codec="f32")


def _batches(peer: str):
    s = BatchSampler(TOKENS, batch=2, seq=MODEL.seq, seed=1, peer=peer)
    return lambda i: s.sample(i + 1)


def _n(t: RoundTrainer | LockstepTrainer) -> int:
    """The next round's length in a run of rounds of ``sync_every`` (the last cut short):
    what a leader that never lengthens a round names."""
    return min(t.sync_every, t.state.run.steps - t.state.step)


def _group_round(trainers: dict, r: int) -> dict[str, np.ndarray]:
    contributions = {}
    for p, t in trainers.items():
        c = t.contribute(r, _batches(p), _n(t))
        t.stage(c)
        contributions[p] = c.vector
    mean = average_in_roster_order([contributions[p] for p in trainers])
    for t in trainers.values():
        t.apply(mean)
    return contributions


def test_grid_lengths_cover_the_run() -> None:
    assert grid_lengths(3, 10, 4) == [4, 4, 2]
    assert grid_lengths(3, 8, 4) == [4, 4, 0]
    assert grid_lengths(3, 13, 4, start_step=6) == [4, 3, 0]


def test_outer_step_is_elementwise_float32() -> None:
    a = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    d = np.array([0.5, -1.0, 0.25], dtype=np.float32)
    assert outer_step(a, d, 1.0).tolist() == [0.5, 3.0, 2.75]
    half = outer_step(a, d, 0.5)
    assert half.dtype == np.float32 and half.tolist() == [0.75, 2.5, 2.875]


def test_members_are_identical_at_every_boundary_and_match_replay() -> None:
    run = _run(10, 4)
    trainers = {p: RoundTrainer(TrainState.fresh(run), 4) for p in ("a", "b", "c")}
    start = trainers["a"].state.params.copy()
    log = []
    hashes = []
    for r in range(3):
        log.append((("a", "b", "c"), _group_round(trainers, r)))
        seen = {t.weight_hash() for t in trainers.values()}
        assert len(seen) == 1
        hashes.append(seen.pop())
    assert trainers["a"].inner_steps == 10 and trainers["a"].step == 3
    # the inner moments are local: members differ there by design
    assert not np.array_equal(trainers["a"].state.optimizer.m, trainers["b"].state.optimizer.m)
    assert replay_rounds(start, log, lengths=[4, 4, 2]) == hashes


def test_replay_detects_a_changed_contribution() -> None:
    run = _run(8, 4)
    trainers = {p: RoundTrainer(TrainState.fresh(run), 4) for p in ("a", "b")}
    start = trainers["a"].state.params.copy()
    log = [(("a", "b"), _group_round(trainers, r)) for r in range(2)]
    good = replay_rounds(start, log, lengths=[4, 4])
    assert good[-1] == trainers["b"].weight_hash()
    bent = dict(log[1][1])
    bent["b"] = bent["b"].copy()
    bent["b"][0] += np.float32(1e-3)
    assert replay_rounds(start, [log[0], (("a", "b"), bent)],
                         lengths=[4, 4])[-1] != good[-1]
    assert replay_rounds(start, log, lengths=[4, 3])[-1] != good[-1]  # another length


def test_contribute_touches_no_shared_state() -> None:
    t = RoundTrainer(TrainState.fresh(_run(8, 4)), 4)
    before = t.weight_hash(), t.state.optimizer.state_dict()["m"].copy()
    t.contribute(0, _batches("a"), _n(t))
    assert t.weight_hash() == before[0]
    assert np.array_equal(t.state.optimizer.m, before[1])


def test_apply_without_the_own_contribution_is_refused() -> None:
    t = RoundTrainer(TrainState.fresh(_run(8, 4)), 4)
    with pytest.raises(ValueError, match="without this member's inner state"):
        t.apply(np.zeros(t.size, dtype=np.float32))
    assert t.step == 0


@pytest.mark.parametrize("outer_lr", [1.0, 0.7])
def test_an_owned_mean_becomes_the_new_anchor_with_the_same_bits(outer_lr: float) -> None:
    """``apply(mean, owned=True)`` (the step machine's fresh mean) takes the outer step in
    the mean's own buffer: the same anchor bits as a new array, one vector less at a
    commit. Without ``owned`` the caller's mean is left as it was."""
    ref, own = (RoundTrainer(TrainState.fresh(_run(8, 4)), 4, outer_lr) for _ in range(2))
    for t in (ref, own):
        contribution = t.contribute(0, _batches("a"), _n(t))
        t.stage(contribution)
    mean = contribution.vector
    kept = mean.copy()
    ref.apply(mean)
    assert mean.tobytes() == kept.tobytes() and not np.shares_memory(ref.state.params, mean)
    own.apply(mean, owned=True)
    assert own.state.params is mean
    assert own.weight_hash() == ref.weight_hash()
    assert own.state.params.tobytes() == outer_step(
        TrainState.fresh(_run(8, 4)).params, kept, outer_lr).tobytes()


def test_backup_restore_rolls_back_a_committed_round() -> None:
    t = RoundTrainer(TrainState.fresh(_run(8, 4)), 4)
    c = t.contribute(0, _batches("a"), _n(t))
    t.stage(c)
    token = t.backup()
    h0 = t.weight_hash()
    t.apply(c.vector)
    assert t.step == 1 and t.weight_hash() != h0
    t.restore(token)
    assert t.step == 0 and t.weight_hash() == h0
    t.apply(c.vector)  # the staged inner state is still there for the recommit
    assert t.step == 1


def test_a_rollback_after_the_next_round_is_staged_restores_and_recommits_exactly() -> None:
    """Backups share the anchor instead of copying it and keep no moments: a rollback must
    still give back the exact shared state before the commit, and the recommit the exact
    shared state after it. The moments it adopts are the newest staged round's (this
    member's own, never hashed: see ``stage``), with the recommitted round's counts."""
    t = RoundTrainer(TrainState.fresh(_run(12, 4)), 4)
    c0 = t.contribute(0, _batches("a"), _n(t))
    t.stage(c0)
    t.apply(c0.vector)
    c1 = t.contribute(1, _batches("a"), _n(t))
    t.stage(c1)
    token = t.backup()
    before = (t.state.params.copy(), t.state.step, t.weight_hash())
    t.apply(c1.vector)
    after = (t.state.params.copy(), t.state.optimizer.m.copy(), t.weight_hash())
    c2 = t.contribute(2, _batches("a"), _n(t))  # the next round, computed and staged meanwhile
    t.stage(c2)
    t.restore(token)  # round 1's roster was amended
    assert t.step == 1 and t.state.step == before[1] and t.weight_hash() == before[2]
    assert np.array_equal(t.state.params, before[0])
    t.apply(c1.vector)
    assert t.weight_hash() == after[2]
    assert np.array_equal(t.state.params, after[0])
    assert np.array_equal(after[1], c1.inner["m"])  # the first commit adopted round 1's
    assert t.state.optimizer.m is c2.inner["m"] and t.state.optimizer.v is c2.inner["v"]
    assert t.state.optimizer.step_count == c1.inner["step"]


def test_a_commit_lets_go_of_the_inner_state_staged_for_the_round_before() -> None:
    """Round 0's moments are not needed once round 1 commits (a rollback only recommits
    round 1): the trainer must not hold them for the whole of round 2."""
    t = RoundTrainer(TrainState.fresh(_run(12, 4)), 4)
    c0 = t.contribute(0, _batches("a"), _n(t))
    t.stage(c0)
    t.apply(c0.vector)
    c1 = t.contribute(1, _batches("a"), _n(t))
    t.stage(c1)
    assert sorted(t._staged) == [0, 1]  # round 0's stays until round 1 commits
    t.apply(c1.vector)
    assert sorted(t._staged) == [1]
    assert t.state.optimizer.m is c1.inner["m"]  # adopted, not copied


def test_staging_the_round_in_flight_lets_go_of_the_committed_moments() -> None:
    """From the moment round 1 is staged, round 0's moments (8P bytes) are held by
    nothing: the optimizer and a rollback's recommit take round 1's, with their own
    step counts kept."""
    t = RoundTrainer(TrainState.fresh(_run(12, 4)), 4)
    c0 = t.contribute(0, _batches("a"), _n(t))
    t.stage(c0)
    t.apply(c0.vector)
    old_m, old_v = weakref.ref(c0.inner["m"]), weakref.ref(c0.inner["v"])
    steps = t.state.step
    c1 = t.contribute(1, _batches("a"), _n(t))
    del c0
    t.stage(c1)
    gc.collect()
    assert old_m() is None and old_v() is None
    assert t.state.optimizer.m is c1.inner["m"] and t.state.step == steps
    assert t._staged[0]["m"] is c1.inner["m"] and t._staged[0]["step"] == steps


def test_rounds_before_counts_rounds_of_sync_every_and_a_short_last_one() -> None:
    assert [rounds_before(s, 4) for s in (0, 4, 8, 10)] == [0, 1, 2, 3]
    assert rounds_before(5, 2) == 3


def _continued(trainer: RoundTrainer, steps: int) -> RoundTrainer:
    """The trainer's state continued to ``steps`` (what --resume --steps starts from)."""
    st = trainer.state
    run = RunConfig(model=MODEL, batch=2, steps=steps, lr=1e-2, seed=1, sync_every=4,
                    codec="f32")
    return RoundTrainer(TrainState(run, st.params.copy(), _copy_adam(st)), 4)


def _copy_adam(state: TrainState):
    from daisyweb.optim import DaisyAdam

    opt = DaisyAdam(state.optimizer.config, state.size)
    opt.load_state_dict(state.optimizer.state_dict())
    return opt


def test_a_continued_run_starts_its_rounds_where_the_last_one_ended() -> None:
    # A 6-step run of H = 4 ends after a short round (steps 4..5); continued to 13, its
    # rounds start at step 6 and take the lengths named: 4, then the 3 left.
    run = _run(6, 4)
    first = {p: RoundTrainer(TrainState.fresh(run), 4) for p in ("a", "b")}
    for r in range(2):
        _group_round(first, r)
    assert first["a"].inner_steps == 6 and first["a"].step == 2
    more = {p: _continued(t, 13) for p, t in first.items()}
    start = more["a"].state.params.copy()
    assert more["a"].step == 2  # rounds_before: as if every round had been H
    seen: list[int] = []
    c = more["a"].contribute(2, lambda i: (seen.append(i), _batches("a")(i))[1], 4)
    assert seen == [6, 7, 8, 9]  # the batches of the inner steps it takes
    assert np.array_equal(more["a"].state.params, start)  # contribute copies
    log = [(("a", "b"), _group_round(more, 2))]
    assert {t.inner_steps for t in more.values()} == {10}
    # a member that joins at the next boundary takes the group's round count
    late = RoundTrainer(TrainState(more["a"].state.run, more["a"].state.params.copy(),
                                   _copy_adam(more["a"].state)), 4, rounds_done=3)
    assert late.weight_hash() == more["a"].weight_hash()
    trio = {**more, "c": late}
    log.append((("a", "b", "c"), _group_round(trio, 3)))
    hashes = {t.weight_hash() for t in trio.values()}
    assert len(hashes) == 1 and {t.inner_steps for t in trio.values()} == {13}
    assert {t.step for t in trio.values()} == {4}
    assert replay_rounds(start, log, lengths=[4, 3], first_round=2,
                         first_step=6)[-1] == hashes.pop()
    assert c.vector.shape == start.shape


def test_rounds_of_the_lengths_the_leader_names_stay_identical_and_replay() -> None:
    """Rounds of 2, 5, 3 and 2 steps (``protocol.pace`` lengthens and shortens them):
    members identical at every boundary, the oracle fed the lengths gives the same
    hashes, and a member that took another length than the group's forks."""
    run = _run(12, 2)
    trainers = {p: RoundTrainer(TrainState.fresh(run), 2) for p in "ab"}
    odd = RoundTrainer(TrainState.fresh(run), 2)
    start = trainers["a"].state.params.copy()
    lengths = [2, 5, 3, 2]
    log, hashes = [], []
    for r, n in enumerate(lengths):
        got = {}
        for p, t in trainers.items():
            c = t.contribute(r, _batches(p), n)
            t.stage(c)
            got[p] = c.vector
        c = odd.contribute(r, _batches("a"), n + (r == 1))
        odd.stage(c)
        mean = average_in_roster_order([got[p] for p in trainers])
        for t in (*trainers.values(), odd):
            t.apply(mean)
        assert len({t.weight_hash() for t in trainers.values()}) == 1
        hashes.append(trainers["a"].weight_hash())
        log.append((("a", "b"), got))
        assert (odd.weight_hash() == hashes[-1]) == (r == 0)
    assert trainers["a"].inner_steps == 12 and trainers["a"].step == 4
    assert replay_rounds(start, log, lengths=lengths) == hashes
    with pytest.raises(ValueError, match="no length for round 3"):
        replay_rounds(start, log, lengths=lengths[:3])


def test_rounds_need_sync_every_of_two_or_more() -> None:
    with pytest.raises(ValueError, match="sync_every >= 2"):
        RoundTrainer(TrainState.fresh(_run(12, 4)), 1)


def test_lockstep_trainer_is_the_plain_step() -> None:
    run = _run(3, 1)
    t = LockstepTrainer(TrainState.fresh(run))
    start = t.state.params.copy()
    grads = []
    for i in range(3):
        c = t.contribute(i, _batches("a"), _n(t))
        grads.append((("a",), {"a": c.vector}))
        t.apply(average_in_roster_order([c.vector]))
    assert replay_hashes(start, run.adam(), grads)[-1] == t.weight_hash()



# ------------------------------------------------------------------ head starts (--overlap)
def _reference_round(run: RunConfig, anchor: np.ndarray, inner: dict, base: np.ndarray,
                     r: int, k: int, peer: str) -> tuple[np.ndarray, dict]:
    """Round ``r`` written out by hand: k steps from ``base``, their progress moved onto
    ``anchor`` (``anchor - (base - w)``, float32), the rest of the round from there."""
    batch = _batches(peer)
    opt = DaisyAdam(run.adam(), anchor.size)
    opt.load_state_dict(inner)
    w = base.copy()
    first = r * run.sync_every
    n = min(run.sync_every, run.steps - first)
    for j in range(n):
        if j == k:
            w = anchor - (base - w)
        opt.step(w, loss_and_grad(run.model, w, batch(first + j))[1])
    if k == n:  # the whole round ran ahead: its progress goes onto the anchor at its end
        w = anchor - (base - w)
    return anchor - w, opt.state_dict()


@pytest.mark.parametrize("k", [1, 3, 4])  # 4: the whole round
def test_a_head_start_is_k_steps_from_the_own_weights_moved_onto_the_anchor(k: int) -> None:
    run = _run(12, 4)
    trainers = {p: RoundTrainer(TrainState.fresh(run), 4) for p in "ab"}
    previous = {}
    for p, t in trainers.items():
        previous[p] = t.contribute(0, _batches(p), _n(t))
        t.stage(previous[p])
    # The head start of round 1 runs before round 0 commits (the anchor is not known).
    heads = {p: t.head_start(1, _batches(p), previous[p], k) for p, t in trainers.items()}
    mean = average_in_roster_order([previous[p].vector for p in trainers])
    for t in trainers.values():
        t.apply(mean)
    for p, t in trainers.items():
        head = heads[p]
        assert head is not None and head.index == 1 and head.steps == k
        c = t.contribute(1, _batches(p), _n(t), head)
        # Its arrays were taken over, not copied; a second use is refused.
        assert head.progress is None and head.inner is None
        with pytest.raises(ValueError, match="already used"):
            t.contribute(1, _batches(p), _n(t), head)
        delta, inner = _reference_round(run, t.state.params, previous[p].inner,
                                        previous[p].local, 1, k, p)
        assert np.array_equal(c.vector, delta)
        assert np.array_equal(c.inner["m"], inner["m"]) and np.array_equal(c.inner["v"], inner["v"])
        assert c.inner["step"] == inner["step"] == 8
        # Without the head start the round is a different (and the plain) computation.
        plain = t.contribute(1, _batches(p), _n(t))
        assert not np.array_equal(plain.vector, c.vector)


def test_a_head_start_of_another_round_is_not_used() -> None:
    run = _run(12, 4)
    t = RoundTrainer(TrainState.fresh(run), 4)
    c0 = t.contribute(0, _batches("a"), _n(t))
    t.stage(c0)
    head = t.head_start(1, _batches("a"), c0, 2)
    t.apply(c0.vector)
    c1 = t.contribute(1, _batches("a"), _n(t), head)
    t.stage(c1)
    t.apply(c1.vector)
    stale = t.contribute(2, _batches("a"), _n(t), head)  # round 1's head start, offered for 2
    assert np.array_equal(stale.vector, t.contribute(2, _batches("a"), _n(t)).vector)


def test_a_head_start_starts_where_the_last_contribution_ended() -> None:
    run = _run(9, 4)
    t = RoundTrainer(TrainState.fresh(run), 4)
    c0 = t.contribute(0, _batches("a"), 3)  # a round of 3
    seen: list[int] = []
    head = t.head_start(1, lambda i: (seen.append(i), _batches("a")(i))[1], c0, 2)
    assert head is not None and head.steps == 2 and seen == [3, 4]
    assert t.head_start(2, _batches("a"), c0, 2) is None  # c0 is not round 1's
    assert t.head_start(1, _batches("a"), c0, 0) is None  # no overlap asked


def test_a_head_start_longer_than_the_round_is_not_used() -> None:
    """A roster naming a round shorter than the head start its members took (which
    ``protocol.pace`` never does) gets the round computed whole from the anchor."""
    run = _run(12, 2)
    t = RoundTrainer(TrainState.fresh(run), 2)
    c0 = t.contribute(0, _batches("a"), 2)
    t.stage(c0)
    head = t.head_start(1, _batches("a"), c0, 3)
    t.apply(c0.vector)
    c1 = t.contribute(1, _batches("a"), 2, head)
    assert c1.head_steps == 0 and c1.steps == 2 and c1.inner["step"] == 4
    assert np.array_equal(c1.vector, t.contribute(1, _batches("a"), 2).vector)


@pytest.mark.parametrize("k", [2, 4])  # 4: whole rounds, each applied a round later
def test_head_starts_keep_members_identical_and_equal_to_replay(k: int) -> None:
    """A group in which every member head-starts every round: identical at every boundary,
    and the replay oracle of the decoded contributions gives the same hashes."""
    run = _run(12, 4)
    trainers = {p: RoundTrainer(TrainState.fresh(run), 4) for p in "abc"}
    start = trainers["a"].state.params.copy()
    previous: dict = {}
    rounds, hashes = [], []
    for r in range(3):
        contributions = {}
        for p, t in trainers.items():
            head = t.head_start(r, _batches(p), previous[p], k) if p in previous else None
            c = t.contribute(r, _batches(p), _n(t), head)
            t.stage(c)
            previous[p] = contributions[p] = c
        mean = average_in_roster_order([contributions[p].vector for p in trainers])
        for t in trainers.values():
            t.apply(mean)
        assert len({t.weight_hash() for t in trainers.values()}) == 1
        hashes.append(trainers["a"].weight_hash())
        rounds.append((list(trainers), {p: c.vector for p, c in contributions.items()}))
    assert replay_rounds(start, rounds, lengths=[4, 4, 4]) == hashes
