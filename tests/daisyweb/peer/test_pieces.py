"""A joiner's snapshot in pieces (``daisyweb.peer.pieces``): the layout, the holders'
side, and the joiner's download with every way a holder or the leader can fail it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from daisyweb.data import default_tokenizer
from daisyweb.model import ModelConfig, param_count
from daisyweb.peer.exchange import make_trainer
from daisyweb.peer.pieces import (
    MIN_PIECE_FLOATS,
    PIECES_PER_ARRAY,
    STALL_S,
    Download,
    Layout,
    PieceError,
    PieceServer,
    PlanStale,
    piece_bytes,
    plan_for,
)
from daisyweb.protocol import wire
from daisyweb.training.config import RunConfig
from daisyweb.training.state import TrainState

TOKENIZER = (default_tokenizer().vocab_size, default_tokenizer().file_hash)
HOLDERS = ("L", "A", "B")


def _state(sync_every: int, seed: int = 3, steps: int = 3) -> TrainState:
    model = ModelConfig(vocab=TOKENIZER[0], width=16, layers=1, heads=2, seq=16)
    run = RunConfig(model=model, batch=2, steps=8, lr=0.01, seed=3, sync_every=sync_every,
                    codec="f32" if sync_every == 1 else "int8")
    state = TrainState.fresh(run)
    rng = np.random.default_rng(seed)
    for _ in range(steps):  # moments of some steps, different per seed
        state.apply(rng.standard_normal(state.size).astype(np.float32))
    return state


def _plan(state: TrainState, holders: tuple[str, ...] = HOLDERS) -> wire.SnapshotPlan:
    trainer = make_trainer(state)
    return plan_for(state, trainer.step, trainer.weight_hash(), holders, TOKENIZER)


def _download(state: TrainState, plan: wire.SnapshotPlan,
              connected: tuple[str, ...] = HOLDERS) -> Download:
    return Download("L", state.run, plan, TOKENIZER, set(connected), 0.0)


def _serve_all(download: Download, holders: dict[str, TrainState],
               servers: dict[str, PieceServer] | None = None, now: float = 0.0) -> None:
    """Every request answered by its holder, until nothing more is asked."""
    servers = servers if servers is not None else {p: PieceServer() for p in holders}
    pending = download.requests()
    while pending:
        peer, request = pending.pop(0)
        state = holders[peer]
        piece = servers[peer].serve("J", request, state, make_trainer(state).step)
        pending.extend(download.received(peer, piece, now))


def test_layout_covers_every_array_once_and_is_bounded() -> None:
    for size in (1, MIN_PIECE_FLOATS - 1, MIN_PIECE_FLOATS, 69_104, 1_300_000, 10**8 + 7):
        layout = Layout(size, lockstep=True)
        assert layout.per_array <= PIECES_PER_ARRAY
        for array in range(3):
            spans = [layout.where(array * layout.per_array + k)[1:]
                     for k in range(layout.per_array)]
            assert spans[0][0] == 0 and spans[-1][1] == size
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert all(stop > start for start, stop in spans)
        assert Layout(size, lockstep=False).count == layout.per_array  # the anchor alone
    with pytest.raises(IndexError):
        Layout(10, lockstep=True).where(3)


@pytest.mark.parametrize("sync_every", [1, 2])
def test_pieces_from_three_holders_make_the_groups_state(sync_every: int) -> None:
    leader = _state(sync_every)
    plan = _plan(leader)
    # every holder has the shared state; in rounds each has its own inner moments
    holders = {"L": leader, "A": _state(sync_every, seed=3 if sync_every == 1 else 4),
               "B": _state(sync_every, seed=3 if sync_every == 1 else 5)}
    if sync_every > 1:
        for p in ("A", "B"):
            holders[p].params = leader.params.copy()
            assert make_trainer(holders[p]).weight_hash() == plan.weight_hash
    d = _download(leader, plan)
    _serve_all(d, holders)
    if sync_every == 1:  # the weights and both moments: 15 pieces, 5 from each
        assert d.served_by == {"L": 5, "A": 5, "B": 5} and d.bytes == 12 * leader.size
    else:  # the anchor alone: 5 pieces
        assert d.served_by == {"L": 2, "A": 2, "B": 1} and d.bytes == 4 * leader.size
    assert d.done
    state = d.state()
    assert make_trainer(state).weight_hash() == plan.weight_hash
    np.testing.assert_array_equal(state.params, leader.params)
    assert state.optimizer.step_count == leader.optimizer.step_count
    assert state.optimizer.beta1_power == leader.optimizer.beta1_power
    layout = d.layout
    for k in range(layout.count):  # each piece is its holder's own
        assert piece_bytes(state, layout, k) == piece_bytes(holders[HOLDERS[k % 3]], layout, k)
    if sync_every > 1:  # a fresh inner optimizer at the group's step count
        assert not state.optimizer.m.any() and not state.optimizer.v.any()
    else:
        np.testing.assert_array_equal(state.optimizer.v, leader.optimizer.v)


def test_a_holder_that_flips_a_byte_is_replaced_by_the_leader() -> None:
    leader = _state(1)
    plan = _plan(leader)
    d = _download(leader, plan)
    pending = d.requests()
    again = []
    for peer, request in pending:
        piece = PieceServer().serve("J", request, leader, plan.step)
        if peer == "A":
            data = bytearray(piece.payload)
            data[9] ^= 1
            piece = wire.Piece(piece.step, piece.piece, bytes(data))
        again.extend(d.received(peer, piece, 0.0))
    assert {p for p, _ in again} == {"L"}
    assert sorted(r.piece for _, r in again) == [k for k in range(15) if k % 3 == 1]
    for peer, request in again:
        d.received(peer, PieceServer().serve("J", request, leader, plan.step), 0.0)
    assert d.done and d.served_by == {"L": 10, "B": 5}
    assert d.state().weight_hash() == leader.weight_hash()


def test_the_leaders_bad_piece_fails_and_its_refusal_means_the_plan_went_stale() -> None:
    leader = _state(1)
    plan = _plan(leader)
    d = _download(leader, plan)
    d.requests()
    with pytest.raises(PlanStale):
        d.received("L", wire.Piece(plan.step, 0, b""), 0.0)
    d = _download(leader, plan)
    d.requests()
    short = piece_bytes(leader, d.layout, 3)[:-4]
    with pytest.raises(PieceError, match="has .* bytes") as e:
        d.received("L", wire.Piece(plan.step, 3, short), 0.0)
    assert not isinstance(e.value, PlanStale)


def test_a_holder_down_stalled_or_not_connected_is_replaced_by_the_leader() -> None:
    leader = _state(1)
    plan = _plan(leader)
    d = _download(leader, plan, connected=("L", "A"))  # B has no link to us
    first = d.requests()
    assert {p for p, _ in first} == {"L", "A"}
    assert sum(p == "L" for p, _ in first) == 10
    assert d.peer_down("A", 1.0) and d.peer_down("A", 1.0) == []  # asked once
    assert d.holders["A"].owed == set()
    # a holder that sends nothing while it owes pieces
    d = _download(leader, plan)
    d.requests()
    piece = PieceServer().serve("J", wire.PieceRequest(plan.step, 1), leader, plan.step)
    d.received("A", piece, STALL_S - 1)  # A sent something: its clock restarts
    moved = d.tick(STALL_S + 0.5)  # B sent nothing since 0: its five go to the leader
    assert {p for p, _ in moved} == {"L"}
    assert sorted(r.piece for _, r in moved) == [2, 5, 8, 11, 14]
    moved = d.tick(2 * STALL_S)
    assert {p for p, _ in moved} == {"L"} and len(moved) == 4  # A's other four
    assert d.tick(10 * STALL_S) == []  # the leader is never replaced


def test_pieces_not_asked_or_of_another_boundary_are_ignored() -> None:
    leader = _state(1)
    plan = _plan(leader)
    d = _download(leader, plan)
    d.requests()
    good = PieceServer().serve("J", wire.PieceRequest(plan.step, 1), leader, plan.step)
    assert d.received("B", good, 0.0) == [] and 1 in d.missing  # asked of A, not B
    assert d.received("Z", good, 0.0) == [] and 1 in d.missing
    stale = dataclasses.replace(good, step=plan.step + 1)
    assert d.received("A", stale, 0.0) == [] and 1 in d.missing
    d.received("A", good, 0.0)
    assert 1 not in d.missing and d.received("A", good, 0.0) == []  # once


@pytest.mark.parametrize("what", ["tokenizer", "digests", "holders", "step", "hash"])
def test_a_wrong_plan_is_refused(what: str) -> None:
    leader = _state(1)
    plan = _plan(leader)
    if what == "tokenizer":
        plan = dataclasses.replace(plan, tokenizer_hash="00" * 32)
    elif what == "digests":
        plan = dataclasses.replace(plan, digests=plan.digests[:-1])
    elif what == "holders":
        plan = dataclasses.replace(plan, holders=("A", "B"))
    elif what == "step":
        plan = dataclasses.replace(plan, inner_step=leader.run.steps + 1)
    else:
        plan = dataclasses.replace(plan, weight_hash="00" * 32)
        d = _download(leader, plan)
        _serve_all(d, {p: leader for p in HOLDERS})
        with pytest.raises(PieceError, match="weight hash or step"):
            d.state()
        return
    with pytest.raises(PieceError):
        _download(leader, plan)


def test_a_member_serves_each_piece_once_per_asker_and_only_of_its_boundary() -> None:
    state = _state(1)
    server = PieceServer()
    ask = wire.PieceRequest(state.step, 2)
    assert server.serve("J", ask, state, state.step).payload
    assert server.serve("J", ask, state, state.step).payload == b""  # asked again
    assert server.serve("K", ask, state, state.step).payload  # another joiner
    assert server.serve("J", ask, state, state.step + 1).payload == b""  # moved on
    assert server.serve("J", wire.PieceRequest(state.step, 15), state,
                        state.step).payload == b""  # no such piece
    assert server.serve("J", ask, None, state.step).payload == b""  # no state yet
    # a new boundary forgets who was served at the old one
    later = wire.PieceRequest(state.step + 1, 2)
    assert server.serve("J", later, state, state.step + 1).payload
    assert param_count(state.run.model) == state.size
