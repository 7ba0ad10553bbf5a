"""A joiner's start handshake (``daisyweb.peer.handshake``): it follows the leader the
group names, never whoever sends a config and snapshot first (issue 14, finding 10)."""

from __future__ import annotations

import asyncio

import pytest

from daisyweb.checkpoints.checkpoint import checkpoint_to_bytes
from daisyweb.model import ModelConfig
from daisyweb.net import PeerDown, Received
from daisyweb.peer.handshake import agreed_leader, await_snapshot, tokenizer_info
from daisyweb.peer.items import MeshItem
from daisyweb.peer.options import PeerError
from daisyweb.protocol import wire
from daisyweb.training.config import RunConfig
from daisyweb.training.state import TrainState

_, TOKINFO = tokenizer_info()


def test_agreed_leader_is_the_majoritys_and_names_itself() -> None:
    members = ("L", "F", "A", "J")
    assert agreed_leader({"L": "L", "F": "L", "A": "A"}, members, "J") == "L"
    assert agreed_leader({"L": "L", "A": "A"}, ("L", "A", "J"), "J") is None  # a tie
    assert agreed_leader({"L": "L", "F": "L"}, members, "J") is None  # A has not said
    assert agreed_leader({"L": "", "F": "", "A": ""}, members, "J") is None  # nobody leads
    assert agreed_leader({"L": "L", "F": "", "A": ""}, members, "J") == "L"
    # a majority naming a peer that does not name itself (or is not a member) is no leader
    assert agreed_leader({"L": "F", "F": "A", "A": "F"}, members, "J") is None
    assert agreed_leader({"L": "X", "F": "X", "A": "X"}, members, "J") is None
    assert agreed_leader({"L": "L"}, ("L", "J"), "J") == "L"  # the usual pair
    assert agreed_leader({}, ("J",), "J") is None


def _run_and_snapshot(seed: int) -> tuple[wire.Config, wire.Snapshot, str]:
    model = ModelConfig(vocab=TOKINFO.vocab_size, width=16, layers=1, heads=2, seq=16)
    run = RunConfig(model=model, batch=2, steps=8, lr=0.01, seed=seed)
    state = TrainState.fresh(run)
    payload = checkpoint_to_bytes(state.checkpoint(TOKINFO))
    return run.to_wire(), wire.Snapshot(0, state.weight_hash(), payload), state.weight_hash()


def _say(queue: asyncio.Queue, peer: str, *msgs: wire.Message) -> None:
    for m in msgs:
        queue.put_nowait(MeshItem(Received(peer, m)))


async def _join(queue: asyncio.Queue, members: tuple[str, ...], timeout: float = 5.0):
    return await await_snapshot(queue, lambda _p: None, lambda _p: None,
                                wire.PROTOCOL_VERSION, TOKINFO, timeout, "J",
                                lambda: members)


async def test_a_pretender_that_speaks_first_is_not_followed() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    fake_cfg, fake_snap, _ = _run_and_snapshot(seed=666)
    real_cfg, real_snap, real_hash = _run_and_snapshot(seed=3)
    v = wire.PROTOCOL_VERSION
    # the pretender A reaches the joiner first, naming itself, with a valid run
    _say(queue, "A", wire.Hello("A", v), wire.Following("A"), fake_cfg, fake_snap)
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"))
    _say(queue, "F", wire.Hello("F", v), wire.Following("L"))
    _say(queue, "L", real_cfg, real_snap)
    start = await _join(queue, ("L", "F", "A", "J"))
    assert start.leader == "L" and start.weight_hash == real_hash


async def test_a_tie_is_refused_naming_who_said_what() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    cfg, snap, _ = _run_and_snapshot(seed=3)
    v = wire.PROTOCOL_VERSION
    _say(queue, "A", wire.Hello("A", v), wire.Following("A"), cfg, snap)
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"), cfg, snap)
    with pytest.raises(PeerError) as e:
        await _join(queue, ("L", "A", "J"), timeout=0.5)
    assert e.value.code == 3
    assert "A follows A" in str(e.value) and "L follows L" in str(e.value)


async def test_the_leader_alone_with_a_joiner_is_followed_and_a_dead_claim_is_forgotten() -> None:
    queue: asyncio.Queue = asyncio.Queue()
    cfg, snap, h = _run_and_snapshot(seed=3)
    v = wire.PROTOCOL_VERSION
    members = ["L", "A", "J"]
    _say(queue, "A", wire.Hello("A", v), wire.Following("A"), cfg, snap)
    _say(queue, "L", wire.Hello("L", v), wire.Following("L"))
    queue.put_nowait(MeshItem(PeerDown("A", "closed")))
    _say(queue, "L", cfg, snap)

    async def join() -> object:
        return await await_snapshot(queue, lambda _p: None, lambda p: members.remove(p),
                                    v, TOKINFO, 5.0, "J", lambda: tuple(members))

    start = await join()
    assert start.leader == "L" and start.weight_hash == h
