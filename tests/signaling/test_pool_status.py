"""The pool fields of a status report (issue 15): machine, kernel backend, batch share,
own speed, ETA, step budget and link round-trip times. Every number is range-checked and
every string clean before the server stores it; a real server on 127.0.0.1 keeps them,
keeps the machine through a final report that leaves it out, and keeps one held-out
point per evaluated step."""

from __future__ import annotations

import asyncio
import json

import pytest

from signaling import protocol, server
from signaling.server import REGISTRY
from tests.signaling.local_server import Server

STATUS = {"type": "status", "step": 1, "loss": 2.0, "hash": "ab", "peers": 1}
POOL = {"machine": "0123456789abcdef",
        "cpu": "Intel(R) Core(TM)2 Duo CPU E8400 @ 3.00GHz", "cores": 2, "ram_mb": 3953,
        "backend": "blas64", "share": 0.375, "peer_tokens_per_s": 812.5, "eta_s": 61.0,
        "total_steps": 300, "links": {"0a": 0.85, "1f": None}}


def _decode(**extra: object) -> dict:
    return protocol.decode(json.dumps(STATUS | extra))


def test_pool_fields_decoded() -> None:
    msg = _decode(**POOL)
    assert {k: msg[k] for k in POOL} == POOL
    assert isinstance(msg["share"], float) and isinstance(msg["cores"], int)
    for edge in ({"share": 0}, {"share": 1}, {"cores": protocol.MAX_CORES},
                 {"ram_mb": protocol.MAX_RAM_MB}, {"eta_s": 0}, {"eta_s": protocol.MAX_ETA_S},
                 {"links": {}}, {"links": {"ab": 0}, "total_steps": 0},
                 {"links": {"ab": protocol.MAX_RTT_MS}},
                 {"links": {f"{i:x}": 1.0 for i in range(protocol.MAX_LINKS)}},
                 {"cpu": "c" * protocol.MAX_CPU_CHARS},
                 {"backend": "b" * protocol.MAX_BACKEND_CHARS}):
        assert _decode(**edge)
    assert _decode(links={"ab": 3})["links"] == {"ab": 3.0}
    # absent fields stay absent
    assert not set(_decode()) & set(POOL)


@pytest.mark.parametrize("extra", [
    {"machine": "0123456789ABCDEF"}, {"machine": "0123456789abcde"},
    {"machine": "0123456789abcdef0"}, {"machine": "0123456789abcdeg"}, {"machine": 7},
    {"machine": "0123456789abcde\n"},
    {"cpu": 7}, {"cpu": "c" * (protocol.MAX_CPU_CHARS + 1)}, {"cpu": "Xeon\x1b[2J"},
    {"cpu": "Xeon\u202eCPU"}, {"cpu": "two\nlines"},
    {"cores": 0}, {"cores": -2}, {"cores": 2.0}, {"cores": True},
    {"cores": protocol.MAX_CORES + 1}, {"cores": "2"},
    {"ram_mb": 0}, {"ram_mb": 10 ** 400}, {"ram_mb": 1.5}, {"ram_mb": None},
    {"backend": "b" * (protocol.MAX_BACKEND_CHARS + 1)}, {"backend": ["blas"]},
    {"backend": "blas\x00"},
    {"share": -0.01}, {"share": 1.5}, {"share": float("nan")}, {"share": "0.5"},
    {"share": False},
    {"peer_tokens_per_s": -1}, {"peer_tokens_per_s": float("inf")},
    {"peer_tokens_per_s": protocol.MAX_TOKENS_PER_S * 2},
    {"eta_s": -1}, {"eta_s": protocol.MAX_ETA_S * 2}, {"eta_s": float("nan")},
    {"total_steps": -1}, {"total_steps": protocol.MAX_STEP + 1}, {"total_steps": 3.0},
    {"links": []}, {"links": "0a:1"}, {"links": None},
    {"links": {"not-an-id": 1.0}}, {"links": {"AB": 1.0}}, {"links": {"a" * 33: 1.0}},
    {"links": {"0a": -1}}, {"links": {"0a": protocol.MAX_RTT_MS + 1}},
    {"links": {"0a": float("nan")}}, {"links": {"0a": True}}, {"links": {"0a": "1"}},
    {"links": {"0a": [1]}}, {"links": {"0a": 10 ** 400}},
    {"links": {f"{i:x}": 1.0 for i in range(protocol.MAX_LINKS + 1)}},
])
def test_pool_fields_refused_when_bad(extra: dict) -> None:
    with pytest.raises(protocol.ProtocolError) as e:
        _decode(**extra)
    assert e.value.code == "bad_field" and repr(next(iter(extra))) in e.value.message


@pytest.fixture
async def srv():
    s = await Server().start()
    yield s
    await s.stop()


async def _settle(cond) -> None:
    for _ in range(100):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the server never got there")


async def test_pool_fields_stored_and_kept_through_the_final_report(srv: Server) -> None:
    ws = await srv.session.ws_connect(srv.url + "/ws", params={"name": "a"})
    welcome = await ws.receive_json()
    me, gid = welcome["id"], welcome["group"]
    group = srv.app[REGISTRY].groups[gid]
    await ws.send_json(STATUS | POOL | {"step": 32, "heldout_loss": 5.5})
    await ws.send_json(STATUS | POOL | {"step": 64, "heldout_loss": 5.5, "heldout_step": 32})
    await ws.send_json(STATUS | {"step": 64, "state": "done"})  # machine and links left out
    await _settle(lambda: group.reports.get(me, {}).get("state") == "done")
    _, info = await srv.get(f"/api/groups/{gid}")
    r = info["reports"][me]
    sticky = {k: v for k, v in POOL.items() if k != "links"}
    assert {k: r[k] for k in sticky} == sticky
    assert "links" not in r  # links are only what the newest report says
    # the held-out curve: one point per evaluated step, however often it was resent
    assert info["heldout_history"] == {me: [[32, 5.5]]}
    await ws.send_json(STATUS | {"step": 96, "heldout_loss": 5.25})
    await _settle(lambda: group.reports[me]["step"] == 96)
    assert (await srv.get(f"/api/groups/{gid}"))[1]["heldout_history"][me] == [[32, 5.5],
                                                                            [96, 5.25]]
    # a refused report changes nothing
    await ws.send_json(STATUS | {"step": 97, "links": {"0a": -5}})
    while (err := await ws.receive_json())["type"] != "error":
        pass
    assert err["code"] == "bad_field"
    assert group.reports[me]["step"] == 96
    await ws.close()
    await _settle(lambda: me not in group.heldout)


def test_heldout_history_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "HELDOUT_POINTS", 3)
    g = server.Group("g", private=False)
    for step in range(1, 6):
        g.record("0a", {"step": step, "loss": 1.0, "heldout_loss": 1.0 / step})
    assert list(g.heldout["0a"]) == [(3, 1 / 3), (4, 0.25), (5, 0.2)]
