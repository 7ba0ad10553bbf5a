"""A joiner's start handshake (``daisyweb.peer.handshake``): it follows the leader the
group names, never whoever sends a config and snapshot first (issue 14, finding 10)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from daisyweb.model import ModelConfig
from daisyweb.net import PeerDown, PeerUp, Received
from daisyweb.peer.exchange import make_trainer
from daisyweb.peer.handshake import (
    agreed_leader,
    await_snapshot,
    tokenizer_info,
    wait_for_peers,
)
from daisyweb.peer.items import MeshItem
from daisyweb.peer.options import PeerError
from daisyweb.peer.pieces import PieceServer, plan_for
from daisyweb.protocol import wire
from daisyweb.training.config import RunConfig
from daisyweb.training.state import TrainState

_, TOKINFO = tokenizer_info()


def test_agreed_leader_is_the_majoritys_and_names_itself() -> None:
    members = ("L", "F", "A", "J")
    assert agreed_leader({"L": "L", "F": "L", "A": "A"}, members, "J") == "L"
    assert agreed_leader({"L": "L", "A": "A"}, ("L", "A", "J"), "J") is None  # a tie
    # A has not said: L is named by a majority of the others all the same (a member that
    # cannot speak, paused or rejoining, holds nobody back), but one voice is not enough
    assert agreed_leader({"L": "L", "F": "L"}, members, "J") == "L"
    assert agreed_leader({"L": "L"}, members, "J") is None
    assert agreed_leader({"L": "L", "F": "F"}, members, "J") is None
    assert agreed_leader({"L": "", "F": "", "A": ""}, members, "J") is None  # nobody leads
    assert agreed_leader({"L": "L", "F": "", "A": ""}, members, "J") == "L"
    # a majority naming a peer that does not name itself (or is not a member) is no leader
    assert agreed_leader({"L": "F", "F": "A", "A": "F"}, members, "J") is None
    assert agreed_leader({"L": "X", "F": "X", "A": "X"}, members, "J") is None
    assert agreed_leader({"L": "L"}, ("L", "J"), "J") == "L"  # the usual pair
    assert agreed_leader({}, ("J",), "J") is None


def _run_and_plan(seed: int, holders: tuple[str, ...], fresh: bool = False
                  ) -> tuple[wire.Config, wire.SnapshotPlan, TrainState]:
    model = ModelConfig(vocab=TOKINFO.vocab_size, width=16, layers=1, heads=2, seq=16)
    run = RunConfig(model=model, batch=2, steps=8, lr=0.01, seed=seed, sync_every=1,
                    codec="f32")
    state = TrainState.fresh(run)
    if not fresh:  # past the first boundary, which a joiner makes from the seed itself
        state.apply(np.full(state.size, 0.5, np.float32))
    plan = plan_for(state, state.step, _hash(state), holders,
                    (TOKINFO.vocab_size, TOKINFO.file_hash))
    return run.to_wire(), plan, state


def _hash(state: TrainState) -> str:
    """The group's hash of ``state`` (in rounds: the shared part)."""
    return make_trainer(state).weight_hash()


def _say(queue: asyncio.Queue, peer: str, *msgs: wire.Message) -> None:
    for m in msgs:
        queue.put_nowait(MeshItem(Received(peer, m)))


def _holders(queue: asyncio.Queue, states: dict[str, TrainState]):
    """A ``send`` whose piece requests every peer in ``states`` answers from its state."""
    servers = {p: PieceServer() for p in states}

    def send(to: tuple[str, ...], msg: wire.Message) -> None:
        for p in to:
            if isinstance(msg, wire.PieceRequest) and p in states:
                _say(queue, p, servers[p].serve("J", msg, states[p], states[p].step))
    return send


async def _join(queue: asyncio.Queue, members: tuple[str, ...], states: dict[str, TrainState],
                timeout: float = 5.0):
    return await await_snapshot(queue, lambda _p: None, lambda _p: None,
                                wire.PROTOCOL_VERSION, TOKINFO, timeout, "J",
                                lambda: members, send=_holders(queue, states),
                                connected=lambda: members)


async def test_a_pretender_that_speaks_first_is_not_followed() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    fake_cfg, fake_plan, fake = _run_and_plan(666, ("A",))
    real_cfg, real_plan, real = _run_and_plan(3, ("L", "F"))
    v = wire.PROTOCOL_VERSION
    # the pretender A reaches the joiner first, naming itself, with a valid run
    _say(queue, "A", wire.Hello("A", v), wire.Following("A"), fake_cfg, fake_plan)
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"))
    _say(queue, "F", wire.Hello("F", v), wire.Following("L"))
    _say(queue, "L", real_cfg, real_plan)
    start = await _join(queue, ("L", "F", "A", "J"), {"L": real, "F": real, "A": fake})
    assert start.leader == "L" and start.weight_hash == _hash(real)
    assert _hash(start.state) == _hash(real)


async def test_a_tie_is_refused_naming_who_said_what() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    cfg, plan, state = _run_and_plan(3, ("A", "L"))
    v = wire.PROTOCOL_VERSION
    _say(queue, "A", wire.Hello("A", v), wire.Following("A"), cfg, plan)
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"), cfg, plan)
    with pytest.raises(PeerError) as e:
        await _join(queue, ("L", "A", "J"), {"L": state, "A": state}, timeout=0.5)
    assert e.value.code == 3
    assert "A follows A" in str(e.value) and "L follows L" in str(e.value)


async def test_the_leader_alone_with_a_joiner_is_followed_and_a_dead_claim_is_forgotten() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    cfg, plan, state = _run_and_plan(3, ("L",))
    v = wire.PROTOCOL_VERSION
    members = ["L", "A", "J"]
    _say(queue, "A", wire.Hello("A", v), wire.Following("A"), cfg, plan)
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"))
    queue.put_nowait(MeshItem(PeerDown("A", "closed")))
    _say(queue, "L", cfg, plan)

    async def join() -> object:
        return await await_snapshot(queue, lambda _p: None, lambda p: members.remove(p),
                                    v, TOKINFO, 5.0, "J", lambda: tuple(members),
                                    send=_holders(queue, {"L": state}),
                                    connected=lambda: tuple(members))

    start = await join()
    assert start.leader == "L" and start.weight_hash == _hash(state)


async def test_a_holder_lost_mid_download_is_replaced_by_the_leader() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    cfg, plan, state = _run_and_plan(3, ("L", "F"))
    v = wire.PROTOCOL_VERSION
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"))
    _say(queue, "F", wire.Hello("F", v), wire.Following("L"), cfg)
    _say(queue, "L", cfg, plan)
    leader_only = _holders(queue, {"L": state})

    def send(to: tuple[str, ...], msg: wire.Message) -> None:
        if to == ("F",):  # F never answers: its link goes down instead
            queue.put_nowait(MeshItem(PeerDown("F", "closed")))
        leader_only(to, msg)

    start = await await_snapshot(queue, lambda _p: None, lambda _p: None, v, TOKINFO, 5.0,
                                 "J", lambda: ("L", "F", "J"), send=send,
                                 connected=lambda: ("L", "F"))
    assert _hash(start.state) == _hash(state)


async def test_a_stale_plan_is_asked_for_again_and_the_next_one_followed() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    cfg, plan, state = _run_and_plan(3, ("L",))
    v = wire.PROTOCOL_VERSION
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"), cfg, plan)
    asked: list[wire.Message] = []
    answer = _holders(queue, {"L": state})

    def send(to: tuple[str, ...], msg: wire.Message) -> None:
        asked.append(msg)
        if isinstance(msg, wire.PieceRequest) and not any(
                isinstance(m, wire.Following) for m in asked):
            _say(queue, "L", wire.Piece(msg.step, msg.piece, b""))  # the group went on
        elif isinstance(msg, wire.Following):
            _say(queue, "L", cfg, dataclasses.replace(plan))  # a new plan (a new object)
        else:
            answer(to, msg)

    start = await await_snapshot(queue, lambda _p: None, lambda _p: None, v, TOKINFO, 5.0,
                                 "J", lambda: ("L", "J"), send=send,
                                 connected=lambda: ("L",))
    assert wire.Following("") in asked
    assert _hash(start.state) == _hash(state)


async def test_the_first_boundary_is_made_from_the_seed_without_a_piece() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    cfg, plan, state = _run_and_plan(3, ("L",), fresh=True)
    v = wire.PROTOCOL_VERSION
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"), cfg, plan)
    sent: list[wire.Message] = []
    start = await await_snapshot(queue, lambda _p: None, lambda _p: None, v, TOKINFO, 5.0,
                                 "J", lambda: ("L", "J"),
                                 send=lambda _to, msg: sent.append(msg),
                                 connected=lambda: ("L",))
    assert sent == [] and _hash(start.state) == _hash(state)
    # a leader resumed at step 0 from other weights: the pieces are downloaded
    cfg, plan, other = _run_and_plan(3, ("L",), fresh=True)
    other.params += np.float32(1.0)
    plan = dataclasses.replace(plan, weight_hash=_hash(other),
                               digests=plan_for(other, 0, _hash(other), ("L",),
                                                (TOKINFO.vocab_size,
                                                 TOKINFO.file_hash)).digests)
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"), cfg, plan)
    start = await _join(queue, ("L", "J"), {"L": other})
    assert _hash(start.state) == _hash(other) != _hash(state)


async def test_a_leader_that_announces_a_wrong_hash_is_refused() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    cfg, plan, state = _run_and_plan(3, ("L",))
    v = wire.PROTOCOL_VERSION
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"), cfg,
         dataclasses.replace(plan, weight_hash="00" * 32))
    with pytest.raises(PeerError) as e:
        await _join(queue, ("L", "J"), {"L": state})
    assert e.value.code == 1
    assert str(e.value).startswith("refused the snapshot from L: its weight hash or step")


# ------------------------------------------------------------- --resume --steps
def _finished_checkpoint(tmp_path, steps: int = 3):
    """A finished 3-step lockstep run's checkpoint (trained alone, for speed)."""

    from daisyweb.checkpoints.checkpoint import save_checkpoint
    from daisyweb.protocol.averaging import average_in_roster_order

    model = ModelConfig(vocab=TOKINFO.vocab_size, width=16, layers=1, heads=2, seq=16)
    run = RunConfig(model=model, batch=2, steps=steps, lr=0.01, seed=3, sync_every=1,
                    codec="f32")
    state = TrainState.fresh(run)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = rng.integers(0, TOKINFO.vocab_size, (2, 17))
        state.apply(average_in_roster_order([state.gradient(batch)[1]]))
    path = tmp_path / "done.pt"
    save_checkpoint(path, state.checkpoint(TOKINFO))
    return path, state


def _resume(path, **kw):
    from daisyweb.peer.handshake import leader_state
    from daisyweb.peer.options import PeerOptions

    return leader_state(PeerOptions(server="http://127.0.0.1:9", start=True,
                                    resume=str(path), **kw), TOKINFO)


def test_resume_with_a_larger_steps_trains_on_from_the_checkpoint(tmp_path) -> None:
    path, done = _finished_checkpoint(tmp_path)
    state = _resume(path, steps=7, save=str(tmp_path / "more.pt"))
    assert state.step == 3 and state.run.steps == 7
    assert state.weight_hash() == done.weight_hash()  # weights and optimizer state as saved
    assert state.run == RunConfig(**{**done.run.__dict__, "steps": 7})
    # flags equal to the file's are fine: only contradictions are refused
    again = _resume(path, steps=7, model={"width": 16, "seq": 16}, lr=0.01, seed=3,
                    codec="f32", sync_every=1)
    assert again.weight_hash() == done.weight_hash()


@pytest.mark.parametrize(("kw", "says"), [
    ({}, "already at step 3 of 3 (--steps N above 3 trains on)"),
    ({"steps": 3}, "--steps 3 is not beyond the checkpoint's step 3"),
    ({"steps": 2}, "--steps 2 is not beyond the checkpoint's step 3"),
    ({"steps": 9, "model": {"width": 32}}, "contradicts --width 32 (the file has 16)"),
    ({"steps": 9, "model": {"layers": 2, "seq": 8}},
     "contradicts --layers 2 (the file has 1), --seq 8 (the file has 16)"),
    ({"steps": 9, "seed": 4}, "--seed 4 (the file has 3)"),
    ({"steps": 9, "lr": 0.02}, "--lr 0.02 (the file has 0.01)"),
    ({"steps": 9, "batch": 4}, "--batch 4 (the file has 2)"),
    ({"steps": 9, "sync_every": 2}, "--sync-every 2 (the file has 1)"),
    ({"steps": 9, "codec": "int8"}, "--codec int8 (the file has f32)"),
])
def test_resume_refuses_what_contradicts_the_checkpoint(tmp_path, kw, says) -> None:
    path, _ = _finished_checkpoint(tmp_path)
    with pytest.raises(PeerError) as exc:
        _resume(path, **kw)
    assert exc.value.code == 2 and says in str(exc.value)
    assert str(exc.value).startswith(f"--resume {path}: ")
    assert "\n" not in str(exc.value)


async def test_a_link_that_came_back_while_the_leader_waited_is_not_dropped_later() -> None:
    """The leader waits for --wait-peers; a follower's first link closes and its second
    comes up meanwhile. The drop must not be replayed once the machine starts: the peer
    would count as down while connected, and never be offered its snapshot."""

    async def wait(events: list, peers: int) -> tuple[list[str], list]:
        queue: asyncio.Queue = asyncio.Queue()
        for ev in events:
            queue.put_nowait(MeshItem(ev))
        return await wait_for_peers(queue, lambda p: None, set(), peers, 5.0)

    def hello(p: str) -> Received:
        return Received(p, wire.Hello(p, 1))

    ups, held = await wait([PeerUp("a"), PeerDown("a", "channel closed"), PeerUp("b"),
                            PeerUp("a"), hello("b"), hello("a")], 3)
    assert sorted(ups) == ["a", "b"]
    assert not [h for h in held if isinstance(h.event, PeerDown)], held
    # a drop after the peer's last up is a real one: it stays
    ups, held = await wait([PeerUp("c"), PeerDown("c", "heartbeat timeout"), PeerUp("d"),
                            hello("d")], 2)
    assert ups == ["d"]
    assert [h.event.peer for h in held if isinstance(h.event, PeerDown)] == ["c"]
