"""Waiting peers are never stranded when a host leaves; the room's approval mode passes
to the next host; rate limit set through create_app."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from daisyweb.net.events import JoinTimeout
from daisyweb.net.signaling_client import Approve, SignalingClient
from signaling.server import RATE_BURST, REGISTRY, create_app
from tests.signaling.local_server import Server


@pytest.fixture
async def srv():
    s = await Server().start()
    yield s
    await s.stop()


async def recv(ws, kind: str, timeout: float = 2.0) -> dict:
    while True:
        msg = await asyncio.wait_for(ws.receive_json(), timeout)
        if msg["type"] == kind:
            return msg


async def silent(ws, kinds: set[str], timeout: float = 0.3) -> None:
    try:
        while True:
            msg = await asyncio.wait_for(ws.receive_json(), timeout)
            assert msg["type"] not in kinds, msg
    except (asyncio.TimeoutError, TypeError):
        pass


async def test_new_host_gets_the_waiting_list(srv):
    host = await srv.ws(room="hand-over", name="h")
    await recv(host, "welcome")
    second = await srv.ws(room="hand-over", name="m")
    w2 = await recv(second, "welcome")
    await host.send_json({"type": "approve", "id": w2["id"]})
    await recv(second, "approved")
    knock = await srv.ws(room="hand-over", name="k")
    wk = await recv(knock, "welcome")
    assert wk["state"] == "waiting"
    await host.close()
    peers = await recv(second, "peers")
    while peers["host"] != w2["id"]:  # rosters sent before the host left
        peers = await recv(second, "peers")
    assert [p["id"] for p in peers["peers"]] == [w2["id"]]  # the waiting peer stays unseen
    waiting = await recv(second, "waiting")
    assert waiting["peers"] == [{"id": wk["id"], "name": "k"}]
    await second.send_json({"type": "approve", "id": wk["id"]})
    await recv(knock, "approved")
    await second.close()
    await knock.close()


# ---------------------------------------------------------------- the room's policy


async def test_the_first_hosts_policy_passes_to_the_next_host(srv):
    host = await srv.ws(room="keep-auto", name="h")
    await recv(host, "welcome")
    await host.send_json({"type": "policy", "approve": "auto"})
    assert (await recv(host, "policy"))["approve"] == "auto"
    second = await srv.ws(room="keep-auto", name="m")
    w2 = await recv(second, "welcome")
    await host.send_json({"type": "approve", "id": w2["id"]})
    await recv(second, "approved")
    # a member that does not host has no say in the room's policy
    await second.send_json({"type": "policy", "approve": "ask"})
    err = await recv(second, "error")
    assert err["code"] == "not_host"
    await host.close()

    # the new host hears the room's mode before it hears that it hosts
    order = []
    while "peers" not in order or order[-1] != "peers":
        msg = await asyncio.wait_for(second.receive_json(), 2.0)
        order.append(msg["type"])
        if msg["type"] == "policy":
            assert msg["approve"] == "auto"
        if msg["type"] == "peers" and msg["host"] != w2["id"]:
            order.pop()  # a roster sent before the host left
    assert order.index("policy") < order.index("host_key") < order.index("peers")
    # its own flag neither loosens nor tightens the room: the answer is the room's mode
    await second.send_json({"type": "policy", "approve": "ask"})
    assert (await recv(second, "policy"))["approve"] == "auto"
    assert srv.reg.room("keep-auto").approve == "auto"
    await second.close()


async def test_policy_only_from_the_host_of_a_private_room(srv):
    host = await srv.ws(room="who-sets", name="h")
    await recv(host, "welcome")
    await host.send_json({"type": "policy", "approve": "maybe"})
    assert (await recv(host, "error"))["code"] == "bad_field"
    knock = await srv.ws(room="who-sets", name="k")
    await recv(knock, "welcome")
    await knock.send_json({"type": "policy", "approve": "auto"})  # invisible, powerless
    assert (await recv(knock, "error"))["code"] == "not_approved"
    public = await srv.ws(name="p")
    await recv(public, "welcome")
    await public.send_json({"type": "policy", "approve": "auto"})  # no host, no policy
    assert (await recv(public, "error"))["code"] == "not_host"
    assert srv.reg.room("who-sets").approve is None
    await host.send_json({"type": "policy", "approve": "ask"})
    assert (await recv(host, "policy"))["approve"] == "ask"
    for ws in (host, knock, public):
        await ws.close()


def _client(srv: Server, room: str, name: str, approve: Approve | None,
            join_timeout: float = 5.0) -> SignalingClient:
    async def on_signal(peer: str, kind: str, data: dict[str, Any]) -> None:
        pass

    return SignalingClient(srv.url, room=room, name=name, approve=approve,
                           join_timeout=join_timeout, on_members=lambda old, changed: None,
                           on_signal=on_signal)


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_an_auto_room_keeps_admitting_under_a_host_that_would_ask(srv):
    asked: list[str] = []

    async def ask(pid: str, name: str) -> bool:
        asked.append(name)
        return False  # this peer's own flag would turn everyone away

    first = _client(srv, "auto-room", "first", None)  # --approve auto
    second = _client(srv, "auto-room", "second", ask)  # --approve ask
    clients = [first, second]
    try:
        await first.join()
        await until(lambda: first.room_approve == "auto")
        await second.join()  # the first host admits it by itself
        await first.close()  # killed: hosting passes to the second
        await until(lambda: second.host == second.self_id and second.host_key is not None)
        assert second.room_approve == "auto" and second.approve_mode == "auto"
        third = _client(srv, "auto-room", "third", None)
        clients.append(third)
        await third.join()  # admitted without asking anyone (JoinDenied if asked)
        await until(lambda: third.self_id in second.members)
        assert asked == []
    finally:
        for c in clients:
            await c.close()


async def test_an_ask_room_keeps_asking_under_a_host_that_would_admit(srv):
    gate = asyncio.Event()

    async def ask(pid: str, name: str) -> bool:
        if name == "second":
            return True
        await gate.wait()  # everyone else: the first host has not answered yet
        return True

    first = _client(srv, "ask-room", "first", ask)  # --approve ask
    second = _client(srv, "ask-room", "second", None)  # --approve auto
    early = _client(srv, "ask-room", "early", None)  # knocks while the first hosts
    early_join: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    clients = [first, second, early]
    try:
        await first.join()
        await until(lambda: first.room_approve == "ask")
        await second.join()
        early_join = asyncio.create_task(early.join())
        await until(lambda: len(first._waiting) == 1)
        await first.close()  # hosting (and the waiting list) passes to the second
        await until(lambda: second.host == second.self_id and second.host_key is not None)
        assert second.room_approve == "ask" and second.approve_mode == "ask"
        late = _client(srv, "ask-room", "late", None, join_timeout=1.0)
        clients.append(late)
        with pytest.raises(JoinTimeout, match="not approved"):
            await late.join()  # asked for, never admitted by a host with no prompt
        assert not early_join.done() and len(second.members) == 1
        assert set(second._waiting) == {early.self_id, late.self_id}
        # the room's dashboard still decides: the new host's link admits the early knock
        async with srv.session.post(
                f"{srv.url}/api/rooms/ask-room/decide",
                json={"key": second.host_key, "id": early.self_id, "approve": True}) as r:
            assert r.status == 200
        await asyncio.wait_for(early_join, 5)
        await until(lambda: early.self_id in second.members)
        assert late.self_id not in second.members
    finally:
        early_join.cancel()
        for c in clients:
            await c.close()


async def closed_with_reason(ws) -> tuple[dict, aiohttp.WSMessage]:
    """The error a dropped client is sent, then its close frame (with code and reason)."""
    err = await recv(ws, "error")
    while True:
        msg = await asyncio.wait_for(ws.receive(), 2.0)
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            return err, msg
        assert msg.type == aiohttp.WSMsgType.TEXT and msg.json()["type"] != "approved", msg


async def test_last_member_leaving_closes_the_room_for_waiting_peers(srv):
    host = await srv.ws(room="strand-me", name="h")
    await recv(host, "welcome")
    await host.send_json({"type": "status", "step": 7, "loss": 2.5, "hash": "ab", "peers": 1})
    first = await srv.ws(room="strand-me", name="first")
    later = await srv.ws(room="strand-me", name="later")
    assert (await recv(first, "welcome"))["state"] == (await recv(later, "welcome"))["state"]
    await recv(host, "waiting")
    await host.close()

    # nobody is left who may admit them: both are sent away with the reason, neither
    # becomes host (a waiting peer taking over could admit anyone under the code)
    for ws in (first, later):
        err, close = await closed_with_reason(ws)
        assert err["code"] == "room_closed" and "has left" in err["message"]
        assert close.type == aiohttp.WSMsgType.CLOSE and close.data == 1008
        assert "room is closed" in close.extra
    reg = srv.app[REGISTRY]
    for _ in range(50):
        if not reg.peers:
            break
        await asyncio.sleep(0.02)
    assert reg.groups == {} and reg.peers == {}

    # the next knock opens a new room: its first peer hosts it and sees nothing of the old
    again = await srv.ws(room="strand-me", name="again")
    w = await recv(again, "welcome")
    assert w["state"] == "member" and w["host"] == w["id"]
    key = (await recv(again, "host_key"))["key"]
    async with srv.session.get(f"{srv.url}/api/rooms/strand-me", params={"key": key}) as r:
        info = await r.json()
    assert info["status"] is None and info["reports"] == {} and info["history"] == {}
    await again.close()


async def test_no_waiting_peer_means_the_room_goes_away(srv):
    host = await srv.ws(room="lonely", name="h")
    w = await recv(host, "welcome")
    await host.close()
    for _ in range(50):
        if w["group"] not in srv.app[REGISTRY].groups:
            break
        await asyncio.sleep(0.02)
    assert srv.app[REGISTRY].groups == {}


async def _burst(srv: Server, n: int, idle: float = 0.0) -> int:
    """Send n status messages at once; count the rate_limited errors that come back.

    An accepted status gets no reply, so replies are read until the socket goes quiet.
    """
    ws = await srv.ws(name="r")
    await recv(ws, "welcome")
    await asyncio.sleep(idle)
    for i in range(n):
        await ws.send_json({"type": "status", "step": i, "loss": 1.0, "hash": "a", "peers": 1})
    limited = 0
    try:
        while True:
            msg = await asyncio.wait_for(ws.receive_json(), 0.5)
            if msg["type"] == "error":
                assert msg["code"] == "rate_limited", msg
                limited += 1
    except asyncio.TimeoutError:
        pass
    await ws.close()
    return limited


async def test_rate_limit_is_configurable():
    tight = await Server(rate_per_s=0.5, rate_burst=3).start()
    try:
        assert await _burst(tight, 6) == 3  # burst 3: the first 3 pass, the rest refused
    finally:
        await tight.stop()


async def test_idle_refill_stops_at_the_burst():
    s = await Server(rate_per_s=5, rate_burst=3).start()
    try:
        # 1 s idle would refill 5 tokens; the bucket holds 3, so 6 at once still overflow
        assert await _burst(s, 6, idle=1.0) >= 2
    finally:
        await s.stop()


async def test_default_rate_limit_allows_the_same_burst(srv):
    assert RATE_BURST >= 10
    assert await _burst(srv, 6) == 0


@pytest.mark.parametrize("kw", [{"rate_per_s": 0}, {"rate_burst": 0.5}, {"rate_per_s": -1}])
def test_bad_rate_refused(kw):
    with pytest.raises(ValueError):
        create_app(**kw)
