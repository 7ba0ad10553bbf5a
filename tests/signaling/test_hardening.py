"""Issue 14 against a real server on 127.0.0.1: what a peer holding only a room code, or
sending hostile numbers, strings and connections, can no longer do.

Each test names the finding it guards; each failed on the code before its guard.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging

import aiohttp
import pytest

from signaling import protocol, server
from signaling.server import REGISTRY, create_app
from tests.signaling.local_server import Server

STATUS = {"type": "status", "step": 1, "loss": 2.0, "hash": "ab", "peers": 1}


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


async def closed(ws, timeout: float = 2.0) -> aiohttp.WSMessage:
    """Read until the close frame and return it."""
    return (await until_closed(ws, timeout))[1]


async def until_closed(ws, timeout: float = 2.0) -> tuple[list[dict], aiohttp.WSMessage]:
    """Every message up to the close frame, and the close frame."""
    seen = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), timeout)
        if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            return seen, msg
        seen.append(msg.json())


async def settle(cond, tries: int = 50) -> None:
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.02)


async def room_with_guest(srv: Server, code: str) -> tuple:
    h = await srv.ws(room=code, name="host")
    wh = await recv(h, "welcome")
    await recv(h, "host_key")
    g = await srv.ws(room=code, name="guest")
    wg = await recv(g, "welcome")
    return h, wh, g, wg


# --- finding 1: a private room is not readable without approval ----------------------


async def test_waiting_peer_learns_nothing_of_the_room(srv: Server) -> None:
    h, wh, g, wg = await room_with_guest(srv, "knock-knock")
    assert wg == {"type": "welcome", "id": wg["id"], "group": None, "host": None,
                  "state": "waiting"}
    assert wh["id"] not in json.dumps(wg)
    await h.close()
    await g.close()


async def test_denied_peer_cannot_read_the_room_with_a_member_id(srv: Server) -> None:
    h, wh, g, wg = await room_with_guest(srv, "no-peeking")
    await h.send_json(STATUS)
    await h.send_json({"type": "deny", "id": wg["id"]})
    await recv(g, "denied")
    # even holding the host's id (the old welcome gave it away) the room stays shut
    for query in ({"peer": wh["id"]}, {"member": wh["id"]}, {"peer": wg["id"]}):
        code, body = await srv.get("/api/rooms/no-peeking", **query)
        assert code == 404 and "host" not in str(body)
    # the host's own member key opens it, and only while it is a member
    code, info = await srv.get("/api/rooms/no-peeking", member=wh["member_key"])
    assert code == 200 and info["members"] == [{"id": wh["id"], "name": "host"}]
    await h.close()
    await settle(lambda: not srv.reg.groups)
    assert (await srv.get("/api/rooms/no-peeking", member=wh["member_key"]))[0] == 404


async def test_member_keys_come_with_admission_and_end_with_it(srv: Server) -> None:
    h, wh, g, wg = await room_with_guest(srv, "key-ring")
    assert "member_key" not in wg  # a waiting peer has none
    await h.send_json({"type": "approve", "id": wg["id"]})
    approved = await recv(g, "approved")
    gkey = approved["member_key"]
    assert len(gkey) >= 32 and gkey != wh["member_key"] and approved["group"] == wh["group"]
    assert protocol.parse_server(approved) == protocol.Approved(wh["group"], gkey)
    code, info = await srv.get(f"/api/groups/{wh['group']}", member=gkey)
    assert code == 200 and info["can_decide"] is False and len(info["members"]) == 2
    await g.close()  # a member that leaves takes its key with it
    await settle(lambda: len(srv.reg.groups[wh["group"]].members) == 1)
    assert (await srv.get("/api/rooms/key-ring", member=gkey))[0] == 404
    assert (await srv.get("/api/rooms/key-ring", member=wh["member_key"]))[0] == 200
    await h.close()


# --- finding 3: numbers from the network are range-checked --------------------------


@pytest.mark.parametrize("field, value", [
    ("loss", 10 ** 400), ("tokens_per_s", 10 ** 400), ("step", 10 ** 4000),
    ("peers", 10 ** 30), ("loss", -(10 ** 400)), ("step", -1),
])
async def test_huge_numbers_refused_cleanly_and_not_stored(
        srv: Server, field: str, value: int, caplog: pytest.LogCaptureFixture) -> None:
    a = await srv.ws(name="a")
    wa = await recv(a, "welcome")
    await a.send_str(json.dumps(STATUS | {field: value}))
    err = await recv(a, "error")
    assert err["code"] == "bad_field" and repr(field) in err["message"]
    assert len(err["message"]) < 120  # the message names the rule, never the value
    # nothing stored, nothing shown, and the socket is still good for a valid report
    _, groups = await srv.get("/api/groups")
    assert groups["groups"][0]["status"] is None
    assert srv.reg.groups[wa["group"]].reports == {}
    await a.send_str(json.dumps(STATUS | {"step": 5}))
    await settle(lambda: wa["id"] in srv.reg.groups[wa["group"]].reports)
    assert srv.reg.groups[wa["group"]].reports[wa["id"]]["step"] == 5
    assert "Traceback" not in caplog.text and "OverflowError" not in caplog.text
    await a.close()


@pytest.mark.parametrize("fields", [
    {"step": protocol.MAX_STEP + 1}, {"step": 1.0}, {"step": True},
    {"peers": protocol.MAX_PEERS + 1}, {"peers": -1},
    {"loss": protocol.MAX_LOSS * 2}, {"loss": float("nan")}, {"loss": float("-inf")},
    {"tokens_per_s": protocol.MAX_TOKENS_PER_S * 2}, {"tokens_per_s": 10 ** 400},
])
def test_status_numbers_out_of_range_refused(fields: dict) -> None:
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.decode(json.dumps(STATUS | fields))
    assert e.value.code == "bad_field"


def test_status_numbers_at_their_bounds_accepted() -> None:
    msg = protocol.decode(json.dumps(STATUS | {
        "step": protocol.MAX_STEP, "peers": protocol.MAX_PEERS, "loss": -protocol.MAX_LOSS,
        "tokens_per_s": protocol.MAX_TOKENS_PER_S}))
    assert msg["step"] == protocol.MAX_STEP and msg["loss"] == -protocol.MAX_LOSS
    assert protocol.decode(json.dumps(STATUS | {"loss": 10 ** 3}))["loss"] == 1000.0


def test_step_bound_is_the_run_configs() -> None:
    from daisyweb import rules

    assert protocol.MAX_STEP == rules.MAX_STEP  # every step a run can reach is reportable


# --- issue 13's dashboard fields ------------------------------------------------------


def test_round_fields_decoded() -> None:
    fields = {"mode": "rounds H=32 int8", "round": 7, "comm_share": 0.25,
              "heldout_loss": 5.5}
    msg = protocol.decode(json.dumps(STATUS | fields))
    assert {k: msg[k] for k in fields} == fields
    assert isinstance(msg["comm_share"], float) and isinstance(msg["round"], int)
    for edge in ({"comm_share": 0}, {"comm_share": 1}, {"round": 0}, {"heldout_loss": 0},
                 {"mode": "m" * protocol.MAX_MODE_CHARS}):
        assert protocol.decode(json.dumps(STATUS | edge))
    assert protocol.decode(json.dumps(STATUS | {"comm_share": 1}))["comm_share"] == 1.0
    for t in ("aiortc", "libwebrtc"):  # issue 17: which WebRTC implementation
        assert protocol.decode(json.dumps(STATUS | {"transport": t}))["transport"] == t


@pytest.mark.parametrize("extra", [
    {"mode": "m" * (protocol.MAX_MODE_CHARS + 1)}, {"mode": 3}, {"mode": "rounds\x1b[2J"},
    {"mode": "lockstep\nf32"}, {"mode": "rounds\u202eH=32"},
    {"round": -1}, {"round": 1.5}, {"round": protocol.MAX_STEP + 1}, {"round": False},
    {"comm_share": 1.01}, {"comm_share": -0.1}, {"comm_share": float("nan")},
    {"comm_share": "0.5"}, {"comm_share": 10 ** 400},
    {"heldout_loss": -0.5}, {"heldout_loss": float("inf")},
    {"heldout_loss": protocol.MAX_LOSS * 2}, {"heldout_loss": None},
    {"heldout_step": -1}, {"heldout_step": 10 ** 400}, {"heldout_step": "32"},
    {"transport": "auto"}, {"transport": "quic"}, {"transport": 1}, {"transport": "aiortc\n"},
])
def test_round_fields_refused_when_bad(extra: dict) -> None:
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.decode(json.dumps(STATUS | extra))
    assert e.value.code == "bad_field" and repr(next(iter(extra))) in e.value.message


async def test_round_fields_stored_shown_and_kept_until_replaced(srv: Server) -> None:
    a = await srv.ws(name="a")
    wa = await recv(a, "welcome")
    me = wa["id"]
    await a.send_json(STATUS | {"step": 32, "mode": "rounds H=32 int8", "round": 1,
                                "comm_share": 0.125, "heldout_loss": 5.75})
    await a.send_json(STATUS | {"step": 64, "round": 2, "comm_share": 0.5})
    await a.send_json(STATUS | {"step": 64, "state": "done"})  # the final report
    await settle(lambda: srv.reg.groups[wa["group"]].reports.get(me, {}).get("state"))
    _, info = await srv.get(f"/api/groups/{wa['group']}")
    r = info["reports"][me]
    # the held-out loss of step 32 stays (with its step) until the next evaluation,
    # and the last round's fields outlive the final report that omits them
    assert (r["mode"], r["round"], r["comm_share"]) == ("rounds H=32 int8", 2, 0.5)
    assert (r["heldout_loss"], r["heldout_step"]) == (5.75, 32)
    await a.send_json(STATUS | {"step": 96, "heldout_loss": 5.25})
    await settle(lambda: srv.reg.groups[wa["group"]].reports[me]["step"] == 96)
    _, info = await srv.get(f"/api/groups/{wa['group']}")
    assert (info["reports"][me]["heldout_loss"], info["reports"][me]["heldout_step"]) == (
        5.25, 96)
    # a peer resending its last held-out loss says which step it belongs to
    await a.send_json(STATUS | {"step": 128, "heldout_loss": 5.25, "heldout_step": 96})
    await settle(lambda: srv.reg.groups[wa["group"]].reports[me]["step"] == 128)
    _, info = await srv.get(f"/api/groups/{wa['group']}")
    assert info["reports"][me]["heldout_step"] == 96
    await a.send_json(STATUS | {"comm_share": 2})  # refused: nothing of it kept
    assert (await recv(a, "error"))["code"] == "bad_field"
    assert srv.reg.groups[wa["group"]].reports[me]["comm_share"] == 0.5
    await a.close()


# --- finding 4: room codes and ids match in full -----------------------------------------


@pytest.mark.parametrize("code", ["abcd\n", "abcd\r\n", "\nabcd", "ab cd", "abcd\x00"])
async def test_room_code_with_a_newline_is_refused(srv: Server, code: str) -> None:
    assert not protocol.valid_room(code)
    h = await srv.ws(room="abcd")
    await recv(h, "welcome")
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        await srv.ws(room=code)
    assert e.value.status == 400
    assert len(srv.reg.groups) == 1  # no second room beside "abcd"
    assert (await srv.get("/api/rooms/abcd%0A"))[0] == 404
    await h.close()


def test_peer_cli_refuses_the_same_codes(capsys: pytest.CaptureFixture) -> None:
    from daisyweb.cli import peer

    with pytest.raises(SystemExit) as e:
        peer.parse_args(["--server", "http://127.0.0.1:8787", "--room", "abcd\n"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert protocol.ROOM_RULE in err and err.count("\n") == 1  # one line, code escaped
    assert peer.parse_args(["--server", "http://127.0.0.1:8787", "--room", "abcd"]).room


@pytest.mark.parametrize("pid", ["ab\n", "ab12\n", "AB12", "ab 12", "a" * 33])
def test_peer_ids_match_in_full(pid: str) -> None:
    assert not protocol.valid_peer_id(pid)
    for msg in ({"type": "signal", "to": pid, "kind": "offer", "data": {}},
                {"type": "approve", "id": pid}):
        with pytest.raises(protocol.ProtocolError) as e:
            protocol.decode(json.dumps(msg))
        assert e.value.code == "bad_field"


# --- finding 11: keyed group ids, connections per address, rooms that close ----------


async def test_group_id_is_keyed_with_a_secret_of_this_server(srv: Server) -> None:
    a = await srv.ws()
    gid = (await recv(a, "welcome"))["group"]
    unkeyed = hashlib.blake2b(b"addr:127.0.0.1", digest_size=6).hexdigest()
    assert gid != unkeyed  # the old id, found by hashing candidate addresses
    b = await srv.ws()
    assert (await recv(b, "welcome"))["group"] == gid  # stable within one server
    other = await Server().start()
    try:
        c = await other.ws()
        assert (await recv(c, "welcome"))["group"] != gid  # another start, another key
        await c.close()
    finally:
        await other.stop()
    await a.close()
    await b.close()


async def test_connections_per_address_are_capped() -> None:
    s = await Server(max_per_address=3, trust_proxy=True).start()
    try:
        socks = [await s.ws(name=f"c{i}") for i in range(3)]
        for ws in socks:
            await recv(ws, "welcome")
        over = await s.ws(name="over")
        err = await recv(over, "error")
        assert err["code"] == "too_many_connections" and "at most 3" in err["message"]
        close = await closed(over)
        assert close.data == 1008 and "too many connections" in close.extra
        assert len(s.reg.peers) == 3  # the refused one never joined a group
        # another address is not affected, and a freed slot can be used again
        other = await s.ws(headers={"X-Forwarded-For": "10.9.8.7"})
        assert (await recv(other, "welcome"))["state"] == "member"
        await socks[0].close()
        await settle(lambda: s.reg.connections["127.0.0.1"] == 2)
        again = await s.ws(name="again")
        assert (await recv(again, "welcome"))["state"] == "member"
        for ws in (*socks[1:], other, again):
            await ws.close()
        await settle(lambda: not s.reg.connections)
        assert not s.reg.connections and not s.reg.capped
    finally:
        await s.stop()


def test_default_cap_admits_a_lab_behind_one_address() -> None:
    assert server.MAX_PER_ADDRESS >= 16


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "32"])
def test_bad_cap_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_per_address"):
        create_app(max_per_address=bad)


def test_cap_flag(capsys: pytest.CaptureFixture) -> None:
    from signaling.cli import build_app, main, parse_args

    assert parse_args([]).max_per_address == server.MAX_PER_ADDRESS
    app = build_app(parse_args(["--max-per-address", "5", "--data", "builtin"]))
    assert app[REGISTRY].max_per_address == 5
    with pytest.raises(SystemExit) as e:
        main(["--max-per-address", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "daisyweb-signal: error: --max-per-address must be at least 1, got 0")


async def test_waiting_peer_never_inherits_the_room(srv: Server) -> None:
    h, wh, g, wg = await room_with_guest(srv, "squat-me")
    await h.close()
    seen, close = await until_closed(g)
    # told why, then closed: never "approved", "host_key" or a roster
    assert seen == [{"type": "error", "code": "room_closed", "message": server.ROOM_CLOSED}]
    assert close.data == 1008 and close.extra == server.ROOM_CLOSED
    await settle(lambda: not srv.reg.peers)
    assert not srv.reg.groups and not srv.reg.peers


# --- names and other peer strings: cleaned and bounded wherever shown -----------------


HOSTILE = "\x1b[2J\x1b]0;pwned\x07ali\x00ce\x7f\x9b31m\u202e\r\nadmit bob? [y/N] "


def test_clean_text() -> None:
    assert protocol.clean_text(HOSTILE, 64) == "aliceadmit bob? [y/N]"
    assert protocol.clean_text("\x1b[31mred\x1b[0m", 64) == "red"
    assert protocol.clean_text("x" * 100, 64) == "x" * 64
    assert protocol.clean_text("Zoë 李 🙂", 64) == "Zoë 李 🙂"
    assert protocol.clean_name("\x1b[2J\x00") == "peer" and protocol.clean_name(None) == "peer"
    introducers = {0x1b, 0x9b, 0x90, 0x98, 0x9d, 0x9e, 0x9f}  # ESC, CSI, DCS, OSC...
    for ch in map(chr, [*range(0x20), *range(0x7f, 0xa0), 0x200e, 0x2028, 0x2066]):
        assert protocol.clean_text(f"a{ch}", 8) == "a", hex(ord(ch))
        if ord(ch) not in introducers:  # those also take what follows (their sequence)
            assert protocol.clean_text(f"a{ch}b", 8) == "ab", hex(ord(ch))


async def test_names_are_cleaned_and_bounded_in_messages_api_and_log(
        srv: Server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="daisyweb.signal")
    h = await srv.ws(room="names-room", name="host")
    wh = await recv(h, "welcome")
    key = (await recv(h, "host_key"))["key"]
    g = await srv.ws(room="names-room", name=HOSTILE + "y" * 100)
    wg = await recv(g, "welcome")
    waiting = await recv(h, "waiting")
    while not waiting["peers"]:
        waiting = await recv(h, "waiting")
    name = waiting["peers"][0]["name"]
    assert name.startswith("aliceadmit bob? [y/N]") and len(name) == protocol.MAX_NAME_CHARS
    assert protocol.is_clean(name)
    _, info = await srv.get("/api/rooms/names-room", key=key)
    assert info["waiting_peers"] == [{"id": wg["id"], "name": name}]
    await h.send_json({"type": "approve", "id": wg["id"]})
    peers = await recv(h, "peers")
    while len(peers["peers"]) < 2:
        peers = await recv(h, "peers")
    assert peers["peers"][1]["name"] == name
    logged = [r.getMessage() for r in caplog.records if wg["id"] in r.getMessage()]
    assert logged and all(protocol.is_clean(line) for line in logged)
    assert all(len(line) < 200 for line in logged)
    _, info = await srv.get("/api/rooms/names-room", member=wh["member_key"])
    assert all(protocol.is_clean(m["name"]) for m in info["members"])
    await h.close()
    await g.close()


@pytest.mark.parametrize("extra", [
    {"hash": "ab\x1b[2J"}, {"hash": "ab\n"}, {"probe": "\x1b]0;x\x07"}, {"probe": "ok\x00"},
])
async def test_status_strings_with_control_characters_refused(
        srv: Server, extra: dict) -> None:
    a = await srv.ws()
    wa = await recv(a, "welcome")
    await a.send_str(json.dumps(STATUS | extra))
    assert (await recv(a, "error"))["code"] == "bad_field"
    assert srv.reg.groups[wa["group"]].reports == {}
    await a.close()


async def raw_upgrade(url: str, forwarded: bytes) -> tuple[asyncio.StreamWriter, bytes]:
    """A WebSocket upgrade with raw header bytes (clients refuse to send such headers)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                 b"X-Forwarded-For: " + forwarded + b"\r\n\r\n")
    await writer.drain()
    return writer, await asyncio.wait_for(reader.read(200), 2)


async def test_forwarded_address_is_cleaned_before_use(
        caplog: pytest.LogCaptureFixture) -> None:
    s = await Server(max_per_address=1, trust_proxy=True).start()
    caplog.set_level(logging.INFO, logger="daisyweb.signal")
    # bidi override and soft hyphen (UTF-8), then 500 digits: what reaches the log
    hostile = "10.0.0.1\u202e\u00ad".encode() + b"9" * 500
    writers = []
    try:
        for _ in range(2):  # the second is over the cap: logged, cleaned and bounded
            writer, head = await raw_upgrade(s.url, hostile)
            writers.append(writer)
            assert head.startswith(b"HTTP/1.1 101")
        await settle(lambda: any("refusing" in r.getMessage() for r in caplog.records))
        (line,) = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
        assert protocol.is_clean(line) and len(line) < 160 and "10.0.0.1999" in line
        assert list(s.reg.connections) == ["10.0.0.1" + "9" * 56]
    finally:
        for w in writers:
            w.close()
        await s.stop()


def test_server_names_from_parse_server_are_clean() -> None:
    peers = protocol.parse_server({"type": "waiting", "peers": [{"id": "0a", "name": HOSTILE}]})
    assert peers == protocol.Waiting((("0a", "aliceadmit bob? [y/N]"),))


def test_dashboard_script_never_parses_peer_strings_as_html() -> None:
    script = (server.find_static_dir() / "dashboard.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write",
                 "eval(", "new Function"):
        assert sink not in script, sink
    assert "textContent" in script
