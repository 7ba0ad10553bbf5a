import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from signaling import protocol
from signaling.server import REGISTRY, create_app


class Server:
    def __init__(self, **kw):
        self.app = create_app(**kw)
        self.runner = web.AppRunner(self.app)

    async def start(self):
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # limit=0: each WebSocket holds a connection; default pool caps at 100
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def stop(self):
        await self.session.close()
        await self.runner.cleanup()

    async def ws(self, headers=None, **query):
        return await self.session.ws_connect(self.url + "/ws", params=query, headers=headers)

    @property
    def reg(self):
        return self.app[REGISTRY]


@pytest.fixture
async def srv():
    s = await Server().start()
    yield s
    await s.stop()


async def recv(ws, kind, timeout=2.0):
    while True:
        msg = await asyncio.wait_for(ws.receive_json(), timeout)
        if msg["type"] == kind:
            return msg


async def no_message(ws, kind, timeout=0.2):
    try:
        while True:
            msg = await asyncio.wait_for(ws.receive_json(), timeout)
            assert msg["type"] != kind, msg
    except (asyncio.TimeoutError, TypeError):
        pass


def test_decoder():
    ok = protocol.decode(json.dumps({"type": "signal", "to": "ab12", "kind": "offer", "data": {}}))
    assert ok["to"] == "ab12"
    for bad, code in [
        ("{", "bad_json"),
        ("[]", "bad_message"),
        ('{"type":"nope"}', "unknown_type"),
        ('{"type":"signal","to":"ab","kind":"x","data":{}}', "bad_field"),
        ('{"type":"signal","to":"ab","kind":"offer","data":3}', "bad_field"),
        ('{"type":"status","step":"1","loss":1,"hash":"a","peers":1}', "bad_field"),
        ('{"type":"status","step":1,"loss":1,"hash":"' + "a" * 17 + '","peers":1}', "bad_field"),
        ('{"type":"approve"}', "missing_field"),
        ("x" * (protocol.MAX_MESSAGE_BYTES + 1), "too_large"),
    ]:
        with pytest.raises(protocol.ProtocolError) as e:
            protocol.decode(bad)
        assert e.value.code == code


async def test_grouping_and_signal(srv):
    a = await srv.ws(name="a")
    wa = await recv(a, "welcome")
    b = await srv.ws(name="b")
    wb = await recv(b, "welcome")
    assert wa["group"] == wb["group"] and wa["state"] == "member"
    assert "127.0.0.1" not in json.dumps(wb)
    peers = await recv(a, "peers")
    while len(peers["peers"]) < 2:
        peers = await recv(a, "peers")
    await a.send_json({"type": "signal", "to": wb["id"], "kind": "offer", "data": {"sdp": "x"}})
    got = await recv(b, "signal")
    assert got == {"type": "signal", "from": wa["id"], "kind": "offer", "data": {"sdp": "x"}}
    async with srv.session.get(srv.url + "/api/groups") as r:
        groups = (await r.json())["groups"]
    assert groups[0]["id"] == wa["group"] and groups[0]["members"] == 2
    await a.send_json({"type": "status", "step": 3, "loss": 1.5, "hash": "abcd", "peers": 2})
    await asyncio.sleep(0.1)
    async with srv.session.get(srv.url + f"/api/groups/{wa['group']}") as r:
        info = await r.json()
    assert info["status"]["step"] == 3 and len(info["members"]) == 2
    await a.close()
    await b.close()


async def test_bad_room_code(srv):
    for room in ["abc", "a" * 65, "bad room", "x/yz1"]:
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await srv.ws(room=room)
        assert e.value.status == 400


async def test_room_approval_denial_and_waiting_isolation(srv):
    h = await srv.ws(room="room-1", name="host")
    wh = await recv(h, "welcome")
    assert wh["state"] == "member" and wh["host"] == wh["id"]
    w = await srv.ws(room="room-1", name="guest")
    ww = await recv(w, "welcome")
    assert ww["state"] == "waiting"
    waiting = await recv(h, "waiting")
    while not waiting["peers"]:
        waiting = await recv(h, "waiting")
    assert waiting["peers"] == [{"id": ww["id"], "name": "guest"}]
    # waiting peer cannot signal and is not visible
    await w.send_json({"type": "signal", "to": wh["id"], "kind": "offer", "data": {}})
    err = await recv(w, "error")
    assert err["code"] == "not_approved"
    await no_message(h, "signal")
    async with srv.session.get(srv.url + f"/api/groups/{wh['group']}") as r:
        assert r.status == 404  # private without a member id
    async with srv.session.get(srv.url + f"/api/groups/{wh['group']}?peer={wh['id']}") as r:
        assert r.status == 404  # an id is no credential
    url = srv.url + f"/api/groups/{wh['group']}?member={wh['member_key']}"
    async with srv.session.get(url) as r:
        info = await r.json()
    assert [m["id"] for m in info["members"]] == [wh["id"]] and info["waiting"] == 1
    # non-host cannot approve
    await h.send_json({"type": "approve", "id": ww["id"]})
    await recv(w, "approved")
    peers = await recv(w, "peers")
    assert {p["id"] for p in peers["peers"]} == {wh["id"], ww["id"]}
    await w.send_json({"type": "approve", "id": ww["id"]})
    assert (await recv(w, "error"))["code"] == "not_host"
    d = await srv.ws(room="room-1", name="bad")
    wd = await recv(d, "welcome")
    await h.send_json({"type": "deny", "id": wd["id"]})
    await recv(d, "denied")
    m = await d.receive()
    assert m.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    for ws in (h, w):
        await ws.close()


async def test_host_handover(srv):
    h = await srv.ws(room="hand-over")
    wh = await recv(h, "welcome")
    ids = []
    socks = []
    for i in range(2):
        s = await srv.ws(room="hand-over", name=f"g{i}")
        ids.append((await recv(s, "welcome"))["id"])
        socks.append(s)
        await h.send_json({"type": "approve", "id": ids[-1]})
        await recv(s, "approved")
    await h.close()
    while True:
        p = await recv(socks[1], "peers")
        if wh["id"] not in {x["id"] for x in p["peers"]}:
            break
    assert p["host"] == ids[0]
    for s in socks:
        await s.close()


async def test_cross_group_refused():
    s1 = await Server(trust_proxy=True).start()
    try:
        a = await s1.ws(headers={"X-Forwarded-For": "10.0.0.1"})
        b = await s1.ws(headers={"X-Forwarded-For": "10.0.0.2"})
        wa, wb = await recv(a, "welcome"), await recv(b, "welcome")
        assert wa["group"] != wb["group"]
        await a.send_json({"type": "signal", "to": wb["id"], "kind": "offer", "data": {}})
        assert (await recv(a, "error"))["code"] == "unknown_peer"
        await no_message(b, "signal")
        await a.close()
        await b.close()
    finally:
        await s1.stop()


async def test_spoofed_forwarded_for_ignored(srv):
    a = await srv.ws(headers={"X-Forwarded-For": "10.0.0.1"})
    b = await srv.ws(headers={"X-Forwarded-For": "10.0.0.2"})
    assert (await recv(a, "welcome"))["group"] == (await recv(b, "welcome"))["group"]
    await a.close()
    await b.close()


async def test_malformed_and_oversize(srv):
    a = await srv.ws()
    await recv(a, "welcome")
    await a.send_str("{not json")
    assert (await recv(a, "error"))["code"] == "bad_json"
    await a.send_str(
        json.dumps({"type": "signal", "to": "ab", "kind": "offer", "data": "x" * 70000})
    )
    assert (await recv(a, "error"))["code"] == "too_large"
    await a.send_json({"type": "whatever"})
    assert (await recv(a, "error"))["code"] == "unknown_type"
    await a.send_json({"type": "status", "step": 1, "loss": "x", "hash": "a", "peers": 1})
    assert (await recv(a, "error"))["code"] == "bad_field"
    # still alive; then keep misbehaving until closed
    for _ in range(protocol.MAX_ERRORS + 2):
        if a.closed:
            break
        await a.send_str("junk")
    closed = False
    for _ in range(40):
        m = await asyncio.wait_for(a.receive(), 2)
        if m.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            closed = True
            break
    assert closed
    await asyncio.sleep(0.05)
    assert not srv.reg.peers


async def _drain(ws):
    async for _ in ws:
        pass


async def test_dead_peer_removed():
    s = await Server(heartbeat=0.2).start()
    try:
        good = await s.ws()
        gid = (await recv(good, "welcome"))["id"]
        drain = asyncio.ensure_future(_drain(good))  # reading answers pings
        # a client that never answers pings
        dead = await s.session.ws_connect(s.url + "/ws", autoping=False)
        await recv(dead, "welcome")
        assert len(s.reg.peers) == 2
        for _ in range(50):
            await asyncio.sleep(0.1)
            if len(s.reg.peers) == 1:
                break
        assert list(s.reg.peers) == [gid]
        drain.cancel()
        await good.close()
        await dead.close()
    finally:
        await s.stop()


async def test_healthz_and_index(srv):
    async with srv.session.get(srv.url + "/healthz") as r:
        assert (await r.json())["ok"] is True
    async with srv.session.get(srv.url + "/") as r:
        assert r.status == 200 and "daisyweb" in await r.text()


async def test_load_200_clients():
    srv = await Server(trust_proxy=True).start()
    try:
        await _load(srv)
    finally:
        await srv.stop()


async def _load(srv):
    # 200 clients in 20 groups of 10 (distinct forwarded addresses)
    socks = await asyncio.gather(
        *[
            srv.ws(name=f"c{i}", headers={"X-Forwarded-For": f"10.0.0.{i // 10}"})
            for i in range(200)
        ]
    )
    welcomes = await asyncio.gather(*[recv(s, "welcome", 10) for s in socks])
    assert len({w["id"] for w in welcomes}) == 200
    assert len({w["group"] for w in welcomes}) == 20
    for i in range(0, 200, 2):
        await socks[i].send_json(
            {"type": "signal", "to": welcomes[i + 1]["id"], "kind": "candidate", "data": {"c": i}}
        )
    got = await asyncio.gather(*[recv(socks[i], "signal", 10) for i in range(1, 200, 2)])
    assert [g["data"]["c"] for g in got] == list(range(0, 200, 2))
    await asyncio.gather(*[s.close() for s in socks])
    for _ in range(50):
        if not srv.reg.peers and not srv.reg.groups:
            break
        await asyncio.sleep(0.05)
    assert not srv.reg.peers and not srv.reg.groups


async def test_data_builtin(srv):
    async with srv.session.get(srv.url + "/data") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        assert r.headers["X-Daisyweb-Source"] == "builtin"
        assert len(await r.text()) > 100
