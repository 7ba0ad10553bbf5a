"""Mesh tests: real signaling server on 127.0.0.1 (ephemeral port), real aiortc.

``$DAISYWEB_TEST_MESH_TRANSPORTS`` (comma-separated, cycled over the meshes a test makes;
default ``aiortc``) runs the same tests on libwebrtc or on a mix of both: only inside a
loopback-only network namespace (``tests/daisyweb/net/test_libwebrtc.py`` does that).

They go through the Mesh interface; where a test needs to reach behind it (a raw
channel, the signaling client's state) it names the private attribute it uses.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import aioice.ice
import pytest
from aiohttp import web
from websockets.protocol import State

from daisyweb.net import ice, signaling_client
from daisyweb.net import link as linkmod
from daisyweb.net.link import BeatDelay
from daisyweb.net.mesh import (
    BadMessage,
    JoinDenied,
    JoinTimeout,
    Members,
    Mesh,
    MeshError,
    PeerDown,
    PeerUp,
    Received,
    StallMeter,
    link_timeout,
)
from daisyweb.protocol import framing, wire
from signaling import protocol
from signaling.server import REGISTRY, create_app
from tests.signaling.local_server import serving

# aiortc's SCTP waits at least 1 s (its minimum RTO) to resend a lost packet, and a
# loaded loop does drop loopback UDP during big transfers: timeouts stay above that.
HB = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.5}
# Only tiny messages cross these links, so a tight timeout is safe and keeps tests short.
FAST_HB = {"heartbeat_interval": 0.1, "heartbeat_timeout": 0.8}


class Server:
    async def start(self) -> Server:
        self.app = create_app()
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.meshes: list[Mesh] = []
        self.transports = itertools.cycle(
            os.environ.get("DAISYWEB_TEST_MESH_TRANSPORTS", "aiortc").split(","))
        return self

    def mesh(self, **kw) -> Mesh:
        kw.setdefault("ice_hosts", ["127.0.0.1"])
        kw.setdefault("transport", next(self.transports))
        for k, v in HB.items():
            kw.setdefault(k, v)
        m = Mesh(self.url, **kw)
        self.meshes.append(m)
        return m

    async def stop(self) -> None:
        await asyncio.gather(*(m.close() for m in self.meshes))
        await self.runner.cleanup()


@pytest.fixture
async def srv():
    s = await Server().start()
    yield s
    await s.stop()


async def until(m: Mesh, pred, timeout: float = 5.0, seen: list | None = None):
    """Read events until pred(event); returns it (others go to ``seen``)."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no matching event within {timeout} s; saw {seen}")
        e = await asyncio.wait_for(m.next_event(), left)
        if pred(e):
            return e
        if seen is not None:
            seen.append(e)


async def first_down(m: Mesh, within: float) -> PeerDown | None:
    """The first PeerDown ``m`` reports within ``within`` seconds, or None."""
    try:
        return await until(m, lambda e: isinstance(e, PeerDown), timeout=within)
    except (AssertionError, asyncio.TimeoutError):
        return None


def up(peer: str):
    return lambda e: isinstance(e, PeerUp) and e.peer == peer


def received(peer: str | None = None):
    return lambda e: isinstance(e, Received) and (peer is None or e.peer == peer)


async def connected_pair(srv: Server, **kw) -> tuple[Mesh, Mesh]:
    a, b = srv.mesh(name="a", **kw), srv.mesh(name="b", **kw)
    await a.start()
    await b.start()
    await until(a, up(b.self_id))
    await until(b, up(a.self_id))
    return a, b


def candidates(m: Mesh, peer: str) -> list[str]:
    """The candidate lines of the description ``m`` signals to ``peer``."""
    sdp = m._links[peer]._local_description()["sdp"]
    return [ln for ln in sdp.splitlines() if ln.startswith("a=candidate")]


def grad(sender: str, n_bytes: int, step: int = 1, seed: int = 0) -> wire.Contribution:
    return wire.Contribution(step=step, sender=sender, payload=os.urandom(n_bytes - n_bytes % 4))


# ----------------------------------------------------------------------------


async def test_two_peers_exchange_small_and_multi_mb(srv):
    a, b = await connected_pair(srv)
    assert a._signaling.members == b._signaling.members == (a.self_id, b.self_id)
    assert a.connected() == [b.self_id] and b.connected() == [a.self_id]
    # Only loopback host candidates in the SDP both sides used.
    for m, other in ((a, b), (b, a)):
        lines = candidates(m, other.self_id)
        assert lines
        for ln in lines:
            assert ln.split()[4] == "127.0.0.1" and " typ host" in ln, ln

    hello = wire.Hello(peer_id=a.self_id)
    await a.send(b.self_id, hello)
    e = await until(b, received(a.self_id))
    assert e.message == hello

    big = grad(b.self_id, 3 * 2**20 + 12345)  # many frames, ragged last one
    assert len(framing.frame(wire.encode(big), 1)) > 60
    await b.send(a.self_id, big)
    e = await until(a, received(b.self_id))
    assert e.message.payload == big.payload  # bit-exact after reassembly


async def test_only_ice_host_candidates_are_ever_signaled(srv, monkeypatch):
    # Every offer and answer that leaves a peer, whatever its transport gathered.
    sent: list[tuple[str, str]] = []
    real = signaling_client.SignalingClient.send_signal

    async def record(self, to, kind, data):
        sent.append((kind, data["sdp"]))
        await real(self, to, kind, data)

    monkeypatch.setattr(signaling_client.SignalingClient, "send_signal", record)
    a, b = await connected_pair(srv)
    await a.send(b.self_id, wire.Hello(peer_id=a.self_id))
    await until(b, received(a.self_id))
    assert sorted(kind for kind, _ in sent) == ["answer", "offer"]
    for _, sdp in sent:
        found = ice.sdp_candidates(sdp)
        assert found and {addr for addr, _ in found} == {"127.0.0.1"}, found
        assert ".local" not in sdp
    for m, other in ((a, b), (b, a)):
        raw = ice.sdp_candidates(m._links[other.self_id].pc.localDescription.sdp)
        if m.transport.name == "libwebrtc" and Path("/proc/net/if_inet6").read_text():
            # libwebrtc gathered ::1 too (a namespace's lo has it): the filter dropped it
            assert "::1" in {addr for addr, _ in raw}, raw
        elif m.transport.name == "aiortc":
            assert {addr for addr, _ in raw} == {"127.0.0.1"}  # aioice gathers no other


async def test_send_order_and_errors(srv):
    a, b = await connected_pair(srv)
    msgs = [grad("s", 4 + i * 70_000, step=i) for i in range(6)]  # 1 to 7 frames
    await asyncio.gather(*(a.send(b.self_id, m) for m in msgs))
    got = [(await until(b, received())).message for _ in msgs]
    assert got == msgs  # per-link lock: delivered in send() order, frames not interleaved
    with pytest.raises(MeshError, match="not connected"):
        await a.send("ffffffff", msgs[0])
    small = srv.mesh(name="small", max_message_bytes=1000)  # not started: sizes are
    # checked before any link lookup
    with pytest.raises(MeshError, match="over max_message_bytes"):
        await small.send("nobody", grad("x", 2000))


async def test_three_peers_full_mesh(srv):
    ms = [srv.mesh(name=f"p{i}") for i in range(3)]
    for m in ms:
        await m.start()
    for m in ms:
        want = {o.self_id for o in ms if o is not m}
        while want:  # PeerUps come in any order
            want.discard((await until(m, lambda e: isinstance(e, PeerUp), timeout=8)).peer)
    ids = {m.self_id for m in ms}
    for m in ms:
        assert set(m.connected()) == ids - {m.self_id}
        assert set(m._signaling.members) == ids
    # Exactly one pc per pair: the lower id dialled, the higher answered.
    for m in ms:
        assert set(m._dialers) == {o for o in ids if o > m.self_id}
    g = grad(ms[0].self_id, 2 * 2**20)
    await asyncio.gather(*(ms[0].send(p, g) for p in ms[0].connected()))  # concurrent sends
    for m in ms[1:]:
        e = await until(m, received(ms[0].self_id))
        assert e.message == g
    # A send to a peer that is not connected fails alone: the others still get theirs.
    h = wire.Hello(peer_id=ms[1].self_id)
    results = await asyncio.gather(
        ms[1].send(ms[2].self_id, h), ms[1].send("deadbeef", h), return_exceptions=True
    )
    assert results[0] is None
    assert isinstance(results[1], MeshError) and "deadbeef is not connected" in str(results[1])
    assert (await until(ms[2], received(ms[1].self_id))).message == h


async def test_closed_peer_reported_down_quickly(srv):
    a, b = await connected_pair(srv, **FAST_HB)
    t0 = time.monotonic()
    await b.close()
    e = await until(a, lambda e: isinstance(e, PeerDown), timeout=FAST_HB["heartbeat_timeout"] + 1)
    assert e.peer == b.self_id and e.reason in ("channel closed", "left signaling")
    assert time.monotonic() - t0 < FAST_HB["heartbeat_timeout"] + 1
    assert a.connected() == []
    await b.close()  # idempotent
    with pytest.raises(MeshError, match="closed"):
        await b.next_event()


async def test_a_stalled_event_loop_does_not_drop_its_links(srv):
    """Our own loop blocked past the timeout (a snapshot sent to many joiners on a starved
    CPU): the peers' beats waited for us, so the links stay up; a peer that is silent for
    real still goes (the test above)."""
    a, b = await connected_pair(srv, **FAST_HB)
    time.sleep(FAST_HB["heartbeat_timeout"] + 0.7)  # noqa: ASYNC251 -- the stall itself
    await asyncio.sleep(0.3)  # the heartbeat tick that wakes late measures the stall
    measured = a.stalls.recent()  # read now: the meter's window forgets it in 1.6 s
    assert measured > FAST_HB["heartbeat_timeout"]
    assert await first_down(a, within=1.5) is None
    assert a.connected() == [b.self_id]
    assert a.stalls.longest >= measured  # what the end record reports


async def test_missed_ice_consent_checks_do_not_close_a_live_link(srv, monkeypatch):
    """aioice gives each consent check one 0.5 s try, so a starved peer misses several in
    a row; in a 32-peer start that closed links between live peers ("Consent to send
    expired"). Here neither side answers a consent check while heartbeats flow: the link
    outlives six missed checks (aioice's own limit) by far."""
    monkeypatch.setattr(aioice.ice, "CONSENT_INTERVAL", 0.02)  # a check every ~0.5 s
    a, b = await connected_pair(srv, **HB)
    answered = aioice.ice.Connection.request_received
    deaf = {"on": True}

    def request_received(conn, message, addr, protocol) -> None:
        if not (deaf["on"] and conn._query_consent_task is not None):  # connected
            answered(conn, message, addr, protocol)

    monkeypatch.setattr(aioice.ice.Connection, "request_received", request_received)
    # ~6 s: twelve checks missed, aioice's own limit of six would close at ~3 s
    down = await first_down(a, within=6.0)
    deaf["on"] = False
    assert down is None, down
    assert a.connected() == [b.self_id] and b.connected() == [a.self_id]


async def test_beats_that_queued_on_the_way_stretch_the_links_timeout(srv):
    """A starved leader of 32 peers processed its frames seconds after they came and
    dropped live members ("silent 6.7 s, allowed 6.0 s"): how late beats reach us
    (beyond the fastest lately) is allowed on top of the timeout."""
    a, b = await connected_pair(srv, **FAST_HB)
    await asyncio.sleep(0.5)  # beats on time: the baseline
    link = a._links[b.self_id]
    # Beats sent 1.5 s before they are processed, as from behind a backlog.
    link._heartbeat(wire.Heartbeat(t=time.time() - 1.5))
    assert link.late == pytest.approx(1.5, abs=0.3)
    b.drop_outgoing = lambda peer, msg: True  # then b goes silent, answers included
    # silent 1.6 s: twice the timeout, within timeout + what beats were late
    assert await first_down(a, within=1.6) is None
    e = await until(a, lambda e: isinstance(e, PeerDown), timeout=3.0)  # a dead one goes
    assert e.peer == b.self_id and "heartbeat timeout" in e.reason


def test_beat_delay_is_the_lateness_beyond_the_fastest_lately() -> None:
    d = BeatDelay(window=10.0)
    assert d.record(0.0, 100.2) == 0.0  # the clocks' offset (100 s here) is no delay
    assert d.record(1.0, 100.1) == 0.0
    assert d.record(2.0, 103.1) == pytest.approx(3.0)  # queued 3 s
    assert d.record(20.0, 50.0) == 0.0  # a clock step: the window forgets the old ones
    assert d.record(21.0, 50.5) == pytest.approx(0.5)
    assert link_timeout(5.0, None, 0.0, 2.0) == 7.0
    assert link_timeout(5.0, None, 1.0, 600.0) == 36.0  # capped: a dead peer still goes


def test_link_timeout_fits_round_trips_and_our_own_stalls() -> None:
    assert link_timeout(5.0, None, 0.0) == 5.0
    assert link_timeout(5.0, 0.01, 0.0) == 5.0  # a fast link: the base
    assert link_timeout(5.0, 2.0, 0.0) == 8.0  # a busy peer answers late: 4 round trips
    assert link_timeout(5.0, 60.0, 0.0) == 30.0  # but a dead one still goes
    assert link_timeout(5.0, None, 3.0) == 8.0  # we were blocked 3 s ourselves
    meter = StallMeter(window=10.0)
    meter.record(0.0, 4.0)
    meter.record(1.0, -0.5)  # early is not late
    assert meter.recent() == 4.0
    meter.record(11.0, 0.1)  # the 4 s stall left the window
    assert meter.recent() == 0.1 and meter.longest == 4.0


async def test_heartbeat_timeout_and_liveness_from_data(srv):
    a, b = await connected_pair(srv, **FAST_HB)
    # a stops heartbeating to b but streams data for longer than the timeout: any frame
    # counts as liveness, so b must not declare a dead.
    a.drop_outgoing = lambda peer, msg: isinstance(msg, wire.Heartbeat)
    end = time.monotonic() + 2 * FAST_HB["heartbeat_timeout"]
    n = 0
    while time.monotonic() < end:
        await a.send(b.self_id, wire.Halt(step=n, reason="tick"))
        n += 1
        await asyncio.sleep(0.05)
    seen: list = []
    for _ in range(n):
        await until(b, received(a.self_id), seen=seen)
    assert not [e for e in seen if isinstance(e, PeerDown)], seen
    # Now silence: b must notice within heartbeat_timeout + 1 s.
    t0 = time.monotonic()
    e = await until(b, lambda e: isinstance(e, PeerDown), timeout=FAST_HB["heartbeat_timeout"] + 1)
    assert e.peer == a.self_id and e.reason.startswith("heartbeat timeout: silent ")
    assert time.monotonic() - t0 < FAST_HB["heartbeat_timeout"] + 1
    # Heal the fault: the lower id dials again and the link comes back (no glare).
    a.drop_outgoing = None
    await until(a, up(b.self_id), timeout=8)
    await until(b, up(a.self_id), timeout=8)
    await a.send(b.self_id, wire.Hello(peer_id=a.self_id))
    assert (await until(b, received(a.self_id))).message.peer_id == a.self_id


async def test_drop_outgoing_one_message_to_one_peer(srv):
    a, b = await connected_pair(srv)
    dropped: list = []

    def drop(peer, msg):
        if isinstance(msg, wire.Contribution) and msg.step == 2 and peer == b.self_id:
            dropped.append(msg)
            return True
        return False

    a.drop_outgoing = drop
    for step in (1, 2, 3):
        await a.send(b.self_id, wire.Contribution(step=step, sender=a.self_id, payload=b"\0" * 8))
    steps = [(await until(b, received())).message.step for _ in range(2)]
    assert steps == [1, 3] and len(dropped) == 1


async def test_backpressure_bounds_channel_buffer(srv):
    a, b = await connected_pair(srv)
    ch = a._links[b.self_id].channel
    peak = 0
    real_send = ch.send

    def send(data):
        nonlocal peak
        real_send(data)
        peak = max(peak, ch.bufferedAmount)

    ch.send = send
    g = grad(a.self_id, 4 * 2**20)
    await a.send(b.self_id, g)
    assert (await until(b, received())).message == g
    # Without waiting on bufferedAmount all 4 MB would have been queued at once.
    assert 0 < peak <= linkmod.SEND_HIGH_WATER + framing.MAX_FRAME


async def test_bad_frames_reported_link_survives(srv):
    a, b = await connected_pair(srv)
    ch = a._links[b.self_id].channel
    ch.send(b"garbage, not a frame at all: no magic")
    ch.send("text")
    ch.send(framing.frame(b"\xc1 not msgpack", 999)[0])  # a valid frame, undecodable message
    # A multi-frame message with one corrupted frame: one BadMessage, not one per frame.
    frames = framing.frame(wire.encode(grad(a.self_id, 500_000)), 1000)
    frames[2] = frames[2][:-1]
    for f in frames:
        ch.send(f)
    errors = [(await until(b, lambda e: isinstance(e, BadMessage))).error for _ in range(4)]
    assert "magic" in errors[0]
    assert "text" in errors[1]
    assert "not a msgpack" in errors[2]
    assert "frame 2" in errors[3]
    # The link is still up and carries good messages.
    await a.send(b.self_id, wire.Hello(peer_id=a.self_id))
    seen: list = []
    await until(b, received(a.self_id), seen=seen)
    assert seen == [] and b.connected() == [a.self_id]


async def test_misbehaving_peer_dropped(srv):
    a, b = await connected_pair(srv)
    ch = a._links[b.self_id].channel
    for _ in range(linkmod.MAX_BAD_MESSAGES + 1):
        ch.send(b"junk" * 10)
    seen: list = []
    e = await until(b, lambda e: isinstance(e, PeerDown), seen=seen)
    assert e.reason.startswith("too many bad messages")
    assert sum(isinstance(x, BadMessage) for x in seen) == linkmod.MAX_BAD_MESSAGES + 1


async def test_oversize_message_refused_by_receiver(srv):
    a = srv.mesh(name="a")
    b = srv.mesh(name="b", max_message_bytes=100_000)
    await a.start()
    await b.start()
    await until(a, up(b.self_id))  # both ends open (libwebrtc's open one after the other)
    await until(b, up(a.self_id))
    await a.send(b.self_id, grad(a.self_id, 200_000))
    e = await until(b, lambda e: isinstance(e, (BadMessage, Received)))
    assert isinstance(e, BadMessage) and "over limit" in e.error
    assert b.connected() == [a.self_id]


async def test_receive_backlog_bounded(srv):
    a = srv.mesh(name="a")
    b = srv.mesh(name="b", max_pending_bytes=1_000_000)
    await a.start()
    await b.start()
    await until(a, up(b.self_id))
    await until(b, up(a.self_id))
    for step in range(4):  # b's application reads nothing meanwhile
        await a.send(b.self_id, grad(a.self_id, 400_000, step=step))
    for _ in range(200):  # reading events would drain the backlog: only peek
        if any(isinstance(e, PeerDown) for e, _ in b._events._items):
            break
        await asyncio.sleep(0.025)
    seen: list = []
    e = await until(b, lambda e: isinstance(e, PeerDown), seen=seen)
    assert e.reason == "receive backlog full"
    assert [x.message.step for x in seen if isinstance(x, Received)] == [0, 1]


async def test_offer_from_higher_id_ignored(srv):
    a, b = await connected_pair(srv)
    lo, hi = sorted((a, b), key=lambda m: m.self_id)
    link = lo._links[hi.self_id]
    # Were it not ignored, the answerer path would first replace the live link.
    offer = {"sdp": "v=0", "type": "offer"}
    await hi._signaling._send(protocol.signal(lo.self_id, "offer", offer))
    await hi.send(lo.self_id, wire.Hello(peer_id=hi.self_id))
    seen: list = []
    await until(lo, received(hi.self_id), seen=seen)
    assert lo._links[hi.self_id] is link and not seen  # same pc, no PeerDown


async def test_leave_and_rejoin(srv):
    a, b = await connected_pair(srv)
    old = b.self_id
    await b.close()
    await until(a, lambda e: isinstance(e, Members) and old not in e.members)
    c = srv.mesh(name="b-again")
    await c.start()
    await until(a, up(c.self_id), timeout=8)
    await until(c, up(a.self_id), timeout=8)
    await c.send(a.self_id, wire.Hello(peer_id=c.self_id))
    assert (await until(a, received(c.self_id))).message.peer_id == c.self_id
    assert a.connected() == [c.self_id]


async def test_room_approval_callback(srv):
    asked: list = []

    async def approve(pid: str, name: str) -> bool:
        asked.append((pid, name))
        return name == "friend"

    host = srv.mesh(name="host", room="lab-42", approve=approve)
    await host.start()
    assert host._signaling.host == host.self_id
    friend = srv.mesh(name="friend", room="lab-42", join_timeout=5)
    await friend.start()
    await until(host, up(friend.self_id))
    stranger = srv.mesh(name="stranger", room="lab-42", join_timeout=5)
    with pytest.raises(JoinDenied, match="denied"):
        await stranger.start()
    assert [n for _, n in asked] == ["friend", "stranger"]
    assert host._signaling.members == (host.self_id, friend.self_id)


async def test_join_timeout(srv):
    gate = asyncio.Event()

    async def never(pid: str, name: str) -> bool:
        await gate.wait()
        return True

    host = srv.mesh(name="host", room="slow-room", approve=never)
    await host.start()
    late = srv.mesh(name="late", room="slow-room", join_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(JoinTimeout, match="not admitted"):
        await late.start()
    assert time.monotonic() - t0 < 2
    assert late._signaling._ws.state is State.CLOSED  # gave up: nothing left running


async def test_dashboard_decision_and_host_key(srv):
    gate = asyncio.Event()

    async def never(pid: str, name: str) -> bool:
        await gate.wait()
        return False  # would deny, but the dashboard decides first

    host = srv.mesh(name="host", room="dash-room", approve=never)
    await host.start()
    for _ in range(50):
        if host._signaling.host_key:
            break
        await asyncio.sleep(0.02)
    key = host._signaling.host_key
    assert key and host.host_link() == f"{srv.url}/?room=dash-room&key={key}"
    joiner = srv.mesh(name="joiner", room="dash-room", join_timeout=5)
    join = asyncio.create_task(joiner.start())
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            if host._signaling._waiting:
                break
            await asyncio.sleep(0.02)
        (pid,) = host._signaling._waiting
        r = await s.post(
            f"{srv.url}/api/rooms/dash-room/decide",
            json={"key": key, "id": pid, "approve": True},
        )
        assert r.status == 200
    await asyncio.wait_for(join, 5)
    assert joiner.self_id == pid and pid in host._signaling.members
    gate.set()  # the cancelled callback must not send a second (deny) decision
    await asyncio.sleep(0.1)
    assert host._signaling.members == (host.self_id, pid)
    # The admitted joiner's own dashboard link opens the room; its bare id does not.
    link = joiner.member_link()
    assert link is not None and link.startswith(f"{srv.url}/?room=dash-room&member=")
    member_key = link.rsplit("=", 1)[1]
    async with aiohttp.ClientSession() as s:
        r = await s.get(f"{srv.url}/api/rooms/dash-room?member={member_key}")
        assert r.status == 200 and pid in [m["id"] for m in (await r.json())["members"]]
        r = await s.get(f"{srv.url}/api/rooms/dash-room?peer={pid}")
        assert r.status == 404


async def test_report_status_reaches_server_and_is_coalesced(srv):
    m = srv.mesh(name="solo")
    await m.start()
    for step in range(60):  # faster than the server's 50 msg/s limit
        await m.report_status(step=step, loss=1.0 / (step + 1), hash="ab", peers=0)
    await asyncio.sleep(signaling_client.STATUS_MIN_INTERVAL * 3)
    group = srv.app[REGISTRY].groups[m._signaling.group]
    assert group.reports[m.self_id]["step"] == 59  # the latest always arrives
    assert len(group.history[m.self_id]) < 10
    assert srv.app[REGISTRY].peers[m.self_id][0].errors == 0  # never rate limited


async def test_unknown_signaling_type_ignored(srv):
    m = srv.mesh(name="solo")
    await m.start()
    await m._signaling._handle({"type": "from-the-future", "x": 1})
    assert m._signaling.up and m._signaling.members == (m.self_id,)


async def test_unreachable_server():
    m = Mesh("http://127.0.0.1:9", ice_hosts=["127.0.0.1"], join_timeout=3)
    with pytest.raises(MeshError, match="cannot connect"):
        await m.start()


async def test_a_refused_handshake_says_what_the_server_said():
    # A server (or a proxy in front of it) that answers the upgrade with an error page:
    # the peer's one line carries its status and its reason.
    async def refuse(_: web.Request) -> web.Response:
        raise web.HTTPForbidden(text="closed for maintenance")

    app = web.Application()
    app.router.add_get("/ws", refuse)
    async with serving(app) as url:
        m = Mesh(url, ice_hosts=["127.0.0.1"], join_timeout=3)
        with pytest.raises(MeshError, match="refused the connection: 403 closed for maint"):
            await m.start()
        await m.close()


def test_a_peer_does_not_load_aiohttp():
    # aiohttp is ~9 MB resident once imported (docs/limits.md section 1); a peer on the
    # built-in corpus connects with the websockets client and never needs it.
    code = ("import sys, daisyweb.cli.peer, daisyweb.peer.run, daisyweb.net.mesh; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


async def test_reassembly_over_budget_loses_that_link_only(srv):
    # b holds at most 300 kB of messages being reassembled; a starts two messages of
    # 200 kB each (first frames only, as a hostile or broken peer would) and is dropped,
    # while b's link to c carries on.
    a = srv.mesh(name="a")
    b = srv.mesh(name="b", max_reassembly_bytes=300_000)
    c = srv.mesh(name="c")
    for m in (a, b, c):
        await m.start()
    for m, others in ((a, (b,)), (b, (a, c)), (c, (b,))):
        want = {o.self_id for o in others}
        while want:  # PeerUps come in any order: collect them, drop none
            want.discard((await until(m, lambda e: isinstance(e, PeerUp), timeout=8)).peer)
    ch = a._links[b.self_id].channel
    first = [framing.frame(wire.encode(grad(a.self_id, 200_000, step=i)), 500 + i)[0]
             for i in range(2)]
    for f in first:
        ch.send(f)
    seen: list = []
    e = await until(b, lambda e: isinstance(e, PeerDown), seen=seen)
    assert e.peer == a.self_id and e.reason.startswith("reassembly budget exceeded: ")
    assert "over the budget of 300,000" in e.reason
    assert not any(isinstance(x, BadMessage) for x in seen)  # one drop, no error stream
    g = grad(c.self_id, 250_000)  # under the budget: still fine on the other link
    await c.send(b.self_id, g)
    assert (await until(b, received(c.self_id))).message == g
    assert c.self_id in b.connected() and a.self_id not in b.connected()


async def test_limit_messages_bounds_every_link(srv):
    a, b = await connected_pair(srv)
    b.limit_messages(100_000, 250_000)
    link = b._links[a.self_id]
    assert (link._max_message_bytes, link._reassembler.max_total,
            link._reassembler.max_buffered) == (100_000, 100_000, 250_000)
    await a.send(b.self_id, grad(a.self_id, 150_000))  # over the run's largest message
    e = await until(b, lambda e: isinstance(e, (BadMessage, Received)))
    assert isinstance(e, BadMessage) and "over limit 100000" in e.error
    b.limit_messages(10**12, 250_000)  # never above the mesh's own cap
    assert b._max_message_bytes == 100_000


# ------------------------------------------------------------- round-trip times
# From answered heartbeats (wire.Heartbeat.echo): what the dashboard's link matrix shows.


async def _rtt_of(m, peer: str, timeout: float = 5.0) -> float:
    end = time.monotonic() + timeout
    while (rtt := m.link_rtts().get(peer)) is None:
        assert time.monotonic() < end, m.link_rtts()
        await asyncio.sleep(0.05)
    return rtt


async def test_both_ends_of_a_link_measure_its_round_trip(srv) -> None:
    a, b = await connected_pair(srv, **FAST_HB)
    ra, rb = await _rtt_of(a, b.self_id), await _rtt_of(b, a.self_id)
    # loopback: well under a heartbeat interval, never negative
    assert 0.0 <= ra < 0.5 and 0.0 <= rb < 0.5, (ra, rb)
    assert set(a.link_rtts()) == {b.self_id}


async def test_a_silenced_peer_answers_no_heartbeat(srv) -> None:
    a, b = await connected_pair(srv, **FAST_HB)
    await _rtt_of(b, a.self_id)
    # a drops every heartbeat it would send, answers included: b sees no fresh RTT
    a.drop_outgoing = lambda peer, msg: isinstance(msg, wire.Heartbeat)
    await asyncio.sleep(0.3)
    link = b._links[a.self_id]
    link.rtt = None
    await asyncio.sleep(0.35)  # several of b's beats went unanswered (timeout is 0.8 s)
    assert link.rtt is None


async def test_an_idle_link_carries_a_beat_and_an_answer_each_way_and_nothing_else(srv):
    """What an idle link costs is bounded by the heartbeat interval: per interval one
    beat and one answer each way (one frame each), whatever else the mesh does."""
    interval = 0.2
    a, b = await connected_pair(srv, heartbeat_interval=interval, heartbeat_timeout=2.0)
    await asyncio.sleep(2 * interval)  # the first beats are out
    beat = len(framing.frame(wire.encode(wire.Heartbeat(time.time(), time.time())), 1)[0])
    sent0, received0 = a.traffic.sent, a.traffic.received
    window = 10 * interval
    await asyncio.sleep(window)
    sent, received = a.traffic.sent - sent0, a.traffic.received - received0
    most = (window / interval + 2) * 2 * beat  # our beats and answers, a beat's lateness
    assert beat < sent <= most and beat < received <= most, (sent, received, most)
    await a.close()
    await b.close()


def test_answers_out_of_range_are_no_sample() -> None:
    link = linkmod.Link.__new__(linkmod.Link)  # only the heartbeat bookkeeping, no connection
    link.rtt, link.drop_heartbeat, link.peer = None, None, "p"
    link.delay, link.late = BeatDelay(), 0.0
    link._heartbeat(wire.Heartbeat(t=1.0, echo=time.time() - 0.02))
    sample = link.rtt
    assert sample is not None and 0.0 <= sample < 1.0
    link._heartbeat(wire.Heartbeat(t=1.0, echo=time.time() + 100))  # from the future
    link._heartbeat(wire.Heartbeat(t=1.0, echo=time.time() - 2 * linkmod.MAX_RTT_S))  # too old
    assert link.rtt == sample


async def test_relay_only_links_carry_data_through_a_real_turn_server(srv, tmp_path,
                                                                      monkeypatch):
    from tests.turn import coturn

    sent: list[str] = []
    real = signaling_client.SignalingClient.send_signal

    async def record(self, to, kind, data):
        sent.append(data["sdp"])
        await real(self, to, kind, data)

    monkeypatch.setattr(signaling_client.SignalingClient, "send_signal", record)
    with coturn(tmp_path) as turn:
        servers = [ice.IceServer(turn.url, turn.user, turn.password)]
        a, b = await connected_pair(srv, turn=servers, relay_only=True)
        g = grad(a.self_id, 2 * 2**20)
        await a.send(b.self_id, g)
        assert (await until(b, received(a.self_id), timeout=15)).message == g
        # Only relayed candidates (the server's 127.0.0.1 relay ports) were offered.
        for sdp in sent:
            found = ice.sdp_candidates(sdp)
            assert found and set(found) == {("127.0.0.1", "relay")}, found
        await a.close()
        await b.close()
        deadline = time.monotonic() + 10
        while turn.relayed_bytes() < 2 * 2**20 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the server logs a session's bytes when it ends
        assert turn.relayed_bytes() >= 2 * 2**20, turn.log.read_text()[-3000:]
