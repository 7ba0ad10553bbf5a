"""Dashboard API: status extras, bounded history, host keys and browser decisions.

Real aiohttp server on 127.0.0.1 and real WebSocket clients; every refusal has a test.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from signaling import protocol, server
from signaling.server import REGISTRY, create_app


class Server:
    def __init__(self, **kw: object) -> None:
        self.app = create_app(**kw)
        self.runner = web.AppRunner(self.app)

    async def start(self) -> Server:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.session = aiohttp.ClientSession()
        return self

    async def stop(self) -> None:
        await self.session.close()
        await self.runner.cleanup()

    async def ws(self, **query: str) -> aiohttp.ClientWebSocketResponse:
        return await self.session.ws_connect(self.url + "/ws", params=query)

    async def get(self, path: str, **params: str) -> tuple[int, object]:
        async with self.session.get(self.url + path, params=params) as r:
            body = await r.json() if r.content_type == "application/json" else await r.text()
            return r.status, body

    @property
    def reg(self) -> server.Registry:
        return self.app[REGISTRY]

    async def decide(self, code: str, body: object) -> int:
        async with self.session.post(self.url + f"/api/rooms/{code}/decide", json=body) as r:
            return r.status


@pytest.fixture
async def srv():
    s = await Server().start()
    yield s
    await s.stop()


async def recv(ws: aiohttp.ClientWebSocketResponse, kind: str, timeout: float = 2.0) -> dict:
    while True:
        msg = await asyncio.wait_for(ws.receive_json(), timeout)
        if msg["type"] == kind:
            return msg


async def none_of(ws: aiohttp.ClientWebSocketResponse, kind: str, timeout: float = 0.2) -> None:
    try:
        while True:
            msg = await asyncio.wait_for(ws.receive_json(), timeout)
            assert msg["type"] != kind, msg
    except (asyncio.TimeoutError, TypeError):
        pass


def status(**extra: object) -> str:
    return json.dumps({"type": "status", "step": 1, "loss": 2.0, "hash": "ab", "peers": 1} | extra)


async def room_with_guest(srv: Server, code: str) -> tuple:
    """A host, its host key, and one waiting guest."""
    h = await srv.ws(room=code, name="host")
    wh = await recv(h, "welcome")
    key = (await recv(h, "host_key"))["key"]
    g = await srv.ws(room=code, name="guest")
    wg = await recv(g, "welcome")
    assert wg["state"] == "waiting"
    return h, wh, key, g, wg


# --- status message validation -------------------------------------------------------


def test_status_extras_decoded() -> None:
    msg = protocol.decode(status(tokens_per_s=1234, probe="ok", state="training"))
    assert msg["tokens_per_s"] == 1234.0 and isinstance(msg["tokens_per_s"], float)
    assert msg["probe"] == "ok" and msg["state"] == "training"
    for state in protocol.RUN_STATES:
        assert protocol.decode(status(state=state))["state"] == state
    assert protocol.decode(status(probe="p" * 16))["probe"] == "p" * 16
    assert protocol.decode(status(tokens_per_s=0))["tokens_per_s"] == 0.0
    # optional: absent fields stay absent, the old required fields still suffice
    assert set(protocol.decode(status())) == {"type", "step", "loss", "hash", "peers"}


@pytest.mark.parametrize(
    "extra",
    [
        {"tokens_per_s": -1},
        {"tokens_per_s": "fast"},
        {"tokens_per_s": True},
        {"tokens_per_s": math.nan},
        {"tokens_per_s": math.inf},
        {"probe": 1},
        {"probe": "p" * 17},
        {"state": "running"},
        {"state": 3},
    ],
)
def test_status_extras_refused(extra: dict) -> None:
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.decode(status(**extra))
    assert e.value.code == "bad_field"


def test_status_required_fields_kept() -> None:
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.decode(json.dumps({"type": "status", "step": 1, "hash": "a", "peers": 1}))
    assert e.value.code == "missing_field"


async def test_bad_status_over_ws_is_refused_and_not_stored(srv: Server) -> None:
    a = await srv.ws()
    wa = await recv(a, "welcome")
    await a.send_str(status(state="exploding"))
    assert (await recv(a, "error"))["code"] == "bad_field"
    code, info = await srv.get(f"/api/groups/{wa['group']}")
    assert code == 200 and info["reports"] == {} and info["history"] == {}
    await a.close()


# --- reports and history -------------------------------------------------------------


async def test_reports_and_bounded_history(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "HISTORY_POINTS", 5)
    a, b = await srv.ws(name="a"), await srv.ws(name="b")
    wa, wb = await recv(a, "welcome"), await recv(b, "welcome")
    for step in range(8):
        await a.send_str(
            status(step=step, loss=10.0 - step, tokens_per_s=100 + step, state="training")
        )
    await b.send_str(status(step=7, loss=3.5, hash="ff", probe="bad"))
    gid = wa["group"]
    for _ in range(50):
        _, info = await srv.get(f"/api/groups/{gid}")
        if len(info["history"].get(wa["id"], [])) == 5 and wb["id"] in info["reports"]:
            break
        await asyncio.sleep(0.02)
    # only the last 5 points survive, oldest first
    assert info["history"][wa["id"]] == [[s, 10.0 - s] for s in range(3, 8)]
    ra = info["reports"][wa["id"]]
    assert ra["step"] == 7 and ra["tokens_per_s"] == 107.0 and ra["state"] == "training"
    assert info["reports"][wb["id"]]["probe"] == "bad"
    assert info["reports"][wb["id"]]["hash"] == "ff"
    assert info["now"] >= ra["t"]
    # a peer that leaves takes its history with it
    await b.close()
    for _ in range(50):
        _, info = await srv.get(f"/api/groups/{gid}")
        if wb["id"] not in info["reports"]:
            break
        await asyncio.sleep(0.02)
    assert wb["id"] not in info["reports"] and wb["id"] not in info["history"]
    assert wb["id"] not in srv.reg.groups[gid].history
    await a.close()


# --- host keys -----------------------------------------------------------------------


async def test_public_group_gets_no_host_key(srv: Server) -> None:
    a = await srv.ws()
    await recv(a, "welcome")
    await none_of(a, "host_key")
    await a.close()


async def test_host_key_rotates_on_handover_and_old_key_refused(srv: Server) -> None:
    h, wh, key1, g, wg = await room_with_guest(srv, "hand-key")
    await h.send_json({"type": "approve", "id": wg["id"]})
    await recv(g, "approved")
    await none_of(g, "host_key")  # a member that is not host never sees the key
    third = await srv.ws(room="hand-key", name="third")
    w3 = await recv(third, "welcome")
    await h.close()  # hosting passes to the guest, with a fresh key
    key2 = (await recv(g, "host_key"))["key"]
    assert key2 != key1 and len(key2) >= 32
    assert await srv.decide("hand-key", {"key": key1, "id": w3["id"], "approve": True}) == 403
    assert (await srv.get("/api/rooms/hand-key", key=key1))[0] == 404
    assert await srv.decide("hand-key", {"key": key2, "id": w3["id"], "approve": True}) == 200
    assert await recv(g, "decision") == {"type": "decision", "id": w3["id"], "approve": True}
    await g.close()
    await third.close()


# --- decisions -----------------------------------------------------------------------


async def test_decide_forwards_to_host_who_then_approves(srv: Server) -> None:
    h, wh, key, g, wg = await room_with_guest(srv, "lab-42")
    assert await srv.decide("lab-42", {"key": key, "id": wg["id"], "approve": True}) == 200
    dec = await recv(h, "decision")
    assert dec == {"type": "decision", "id": wg["id"], "approve": True}
    # the decision is only forwarded: the guest is still waiting until the host acts
    assert wg["id"] in srv.reg.groups[wh["group"]].waiting
    await none_of(g, "approved")
    await h.send_json({"type": "approve" if dec["approve"] else "deny", "id": dec["id"]})
    await recv(g, "approved")
    await h.close()
    await g.close()


async def test_a_decision_reaches_the_host_once_and_a_new_host_may_be_asked(
        srv: Server) -> None:
    """A replayed decide request (or a second click, or the other answer) is refused with
    409 and not forwarded; a host that leaves without acting hands the waiting peer to
    the next host, whose new key may decide it, once."""
    h, wh, key1, g, wg = await room_with_guest(srv, "once-only")
    await h.send_json({"type": "approve", "id": wg["id"]})
    await recv(g, "approved")
    third = await srv.ws(room="once-only", name="third")
    w3 = await recv(third, "welcome")
    body = {"key": key1, "id": w3["id"], "approve": True}
    assert await srv.decide("once-only", body) == 200
    assert await recv(h, "decision") == {"type": "decision", "id": w3["id"], "approve": True}
    assert await srv.decide("once-only", body) == 409
    assert await srv.decide("once-only", {**body, "approve": False}) == 409
    await none_of(h, "decision")
    await h.close()  # it never acted: the guest hosts now, with a new key
    key2 = (await recv(g, "host_key"))["key"]
    assert await srv.decide("once-only", {**body, "key": key2, "approve": False}) == 200
    assert await recv(g, "decision") == {"type": "decision", "id": w3["id"], "approve": False}
    assert await srv.decide("once-only", {**body, "key": key2}) == 409
    await none_of(g, "decision")
    await g.send_json({"type": "deny", "id": w3["id"]})
    await recv(third, "denied")
    # nothing is kept of a peer that no longer waits
    fourth = await srv.ws(room="once-only", name="fourth")
    w4 = await recv(fourth, "welcome")
    assert await srv.decide("once-only", {"key": key2, "id": w4["id"], "approve": True}) == 200
    assert srv.reg.groups[wh["group"]].decided == {w4["id"]}
    await g.close()
    await third.close()
    await fourth.close()


@pytest.mark.parametrize(
    "body",
    [
        {"id": "PEER", "approve": True},  # missing key
        {"key": "WRONG", "id": "PEER", "approve": True},
        {"key": "", "id": "PEER", "approve": True},
        {"key": None, "id": "PEER", "approve": True},
        {"key": "ключ", "id": "PEER", "approve": True},  # non-ASCII: no 500
        {"key": "KEY-PREFIX", "id": "PEER", "approve": True},  # a prefix of the real key
    ],
)
async def test_decide_without_valid_key_is_403(srv: Server, body: dict) -> None:
    h, wh, key, g, wg = await room_with_guest(srv, "lab-43")
    body = {k: (v.replace("PEER", wg["id"]) if isinstance(v, str) else v) for k, v in body.items()}
    if body.get("key") == "KEY-PREFIX":
        body["key"] = key[:-1]
    assert await srv.decide("lab-43", body) == 403
    await none_of(h, "decision")
    await h.close()
    await g.close()


async def test_decide_key_of_another_room_refused(srv: Server) -> None:
    h1, _, key1, g1, wg1 = await room_with_guest(srv, "room-a")
    h2, _, _key2, g2, _ = await room_with_guest(srv, "room-b")
    assert await srv.decide("room-b", {"key": key1, "id": wg1["id"], "approve": True}) == 403
    assert await srv.decide("no-such-room", {"key": key1, "id": wg1["id"], "approve": True}) == 403
    await none_of(h2, "decision")
    for ws in (h1, g1, h2, g2):
        await ws.close()


async def test_decide_bad_requests(srv: Server) -> None:
    h, wh, key, g, wg = await room_with_guest(srv, "lab-44")
    url = srv.url + "/api/rooms/lab-44/decide"
    async with srv.session.post(url, data="not json") as r:
        assert r.status == 400
    async with srv.session.post(url, json=[key]) as r:
        assert r.status == 400
    assert await srv.decide("lab-44", {"key": key, "id": wg["id"], "approve": "yes"}) == 400
    assert await srv.decide("lab-44", {"key": key, "id": "../x", "approve": True}) == 400
    # a member (not waiting) or an unknown id is not a decision to make
    assert await srv.decide("lab-44", {"key": key, "id": wh["id"], "approve": True}) == 404
    assert await srv.decide("lab-44", {"key": key, "id": "abcdef01", "approve": True}) == 404
    await none_of(h, "decision")
    await h.close()
    await g.close()


# --- who may see a private room ------------------------------------------------------


async def test_room_view_needs_key_or_member_id(srv: Server) -> None:
    h, wh, key, g, wg = await room_with_guest(srv, "see-me")
    # strangers, wrong keys and the waiting guest itself learn nothing
    assert (await srv.get("/api/rooms/see-me"))[0] == 404
    assert (await srv.get("/api/rooms/see-me", key="nope"))[0] == 404
    assert (await srv.get("/api/rooms/see-me", peer=wg["id"]))[0] == 404
    assert (await srv.get("/api/rooms/see-me", peer=wh["id"]))[0] == 404  # ids open nothing
    assert (await srv.get(f"/api/groups/{wh['group']}", key="nope"))[0] == 404
    assert (await srv.get(f"/api/groups/{wh['group']}", member="nope"))[0] == 404
    code, groups = await srv.get("/api/groups")
    assert wh["group"] not in json.dumps(groups)
    # a member sees the room and the waiting count, not who is waiting
    code, info = await srv.get("/api/rooms/see-me", member=wh["member_key"])
    assert code == 200 and info["waiting"] == 1 and info["can_decide"] is False
    assert "waiting_peers" not in info and "guest" not in json.dumps(info)
    # the key holder also sees the waiting peers' names
    code, info = await srv.get("/api/rooms/see-me", key=key)
    assert code == 200 and info["can_decide"] is True
    assert info["waiting_peers"] == [{"id": wg["id"], "name": "guest"}]
    assert (await srv.get(f"/api/groups/{wh['group']}", key=key))[1]["can_decide"] is True
    assert (await srv.get("/api/rooms/bad code!"))[0] == 404
    await h.close()
    await g.close()


async def test_index_headers_and_assets(srv: Server) -> None:
    async with srv.session.get(srv.url + "/") as r:
        assert r.status == 200 and "daisyweb" in await r.text()
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        assert r.headers["Referrer-Policy"] == "no-referrer"
    for asset in ("dashboard.js", "dashboard.css"):
        async with srv.session.get(srv.url + "/static/" + asset) as r:
            assert r.status == 200
    assert (server.find_static_dir() / "index.html").is_file()


def test_static_dir_prefers_packaged_copy(tmp_path: Path) -> None:
    pkg = tmp_path / "signaling"
    (tmp_path / "static").mkdir()
    (tmp_path / "static" / "index.html").write_text("tree")
    pkg.mkdir()
    assert server.find_static_dir(pkg) == tmp_path / "static"  # source tree / editable
    (pkg / "static").mkdir()
    (pkg / "static" / "index.html").write_text("wheel")
    assert server.find_static_dir(pkg) == pkg / "static"  # installed from a wheel


async def test_index_without_static_dir_still_answers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(server, "STATIC_DIR", tmp_path / "missing")
    s = await Server().start()
    try:
        code, text = await s.get("/")
        assert code == 200 and "signaling server is up" in text
    finally:
        await s.stop()


# --- the key is never logged ---------------------------------------------------------


def test_mask_secrets_hides_every_spelling_of_the_secret_parameters() -> None:
    cases = {
        "GET /api/rooms/lab?key=S3CRET&poll=200 HTTP/1.1":
            "GET /api/rooms/lab?key=<hidden>&poll=200 HTTP/1.1",
        "GET /api/rooms/lab?poll=1&member=M3MBER HTTP/1.1":
            "GET /api/rooms/lab?poll=1&member=<hidden> HTTP/1.1",
        "GET /api/rooms/lab?k%65y=S3CRET HTTP/1.1": "GET /api/rooms/lab?k%65y=<hidden> HTTP/1.1",
        "GET /x?KEY=S3CRET;member=M HTTP/1.1": "GET /x?KEY=<hidden>;member=<hidden> HTTP/1.1",
        "http://host:8787/?room=lab&key=S3CRET": "http://host:8787/?room=lab&key=<hidden>",
        "GET /x?monkey=1&keys=2 HTTP/1.1": "GET /x?monkey=1&keys=2 HTTP/1.1",
    }
    for line, shown in cases.items():
        assert server.mask_secrets(line) == shown


async def test_access_log_records_carry_no_secret(srv: Server,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    h, wh, key, g, wg = await room_with_guest(srv, "log-room")
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        assert (await srv.get("/api/rooms/log-room", key=key))[0] == 200
        await asyncio.sleep(0.1)
    lines = [r for r in caplog.records if r.name == "aiohttp.access"]
    assert lines and "key=<hidden>" in lines[0].getMessage()
    for r in lines:  # the message and every field a structured handler could print
        assert key not in r.getMessage() and key not in repr(vars(r))
    await h.close()
    await g.close()


async def test_the_servers_log_never_shows_a_key(tmp_path: Path) -> None:
    """``daisyweb-signal`` as run: the dashboard's polls with the host key, a member's
    key, the key under an encoded name (which the server accepts), a Referer holding
    the link, and a decision; its stderr shows none of the secrets."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "--host", "127.0.0.1", "--port", str(port),
         "--data", "builtin"], cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                assert proc.poll() is None
                try:
                    async with session.get(url + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
            h = await session.ws_connect(url + "/ws?room=log-room&name=host")
            member = (await recv(h, "welcome"))["member_key"]
            key = (await recv(h, "host_key"))["key"]
            g = await session.ws_connect(url + "/ws?room=log-room&name=guest")
            gid = (await recv(g, "welcome"))["id"]
            base = url + "/api/rooms/log-room"
            link = f"{url}/?room=log-room&key={key}"
            for query in (f"?key={key}&poll=200", f"?k%65y={key}", f"?member={member}"):
                # encoded: sent as written (yarl would make k%65y plain key)
                async with session.get(URL(base + query, encoded=True),
                                       headers={"Referer": link}) as r:
                    assert r.status == 200, query
            async with session.post(base + "/decide",
                                    json={"key": key, "id": gid, "approve": True}) as r:
                assert r.status == 200
            await h.close()
            await g.close()
    finally:
        proc.terminate()
        err = (await asyncio.to_thread(proc.communicate, timeout=30))[1].decode()
    assert err.count("aiohttp.access") >= 5, err
    assert key not in err and member not in err, err
    assert "?key=<hidden>&poll=200" in err and "?k%65y=<hidden>" in err
    assert "?member=<hidden>" in err and "&key=<hidden>" in err  # the Referer
