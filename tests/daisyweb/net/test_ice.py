import asyncio
import logging

import aioice.ice
import pytest
from aiortc import RTCPeerConnection

from daisyweb.net import ice
from daisyweb.net import transport_aiortc as ice_aiortc


@pytest.fixture
def restricted():
    ice_aiortc.restrict_host_candidates(["127.0.0.1"])
    yield
    ice_aiortc.unrestrict()


def test_restrict_idempotent_and_env(monkeypatch):
    try:
        ice_aiortc.restrict_host_candidates(["127.0.0.1"])
        ice_aiortc.restrict_host_candidates(["127.0.0.1"])
        assert aioice.ice.get_host_addresses(True, True) == ["127.0.0.1"]
        monkeypatch.setenv(ice.ENV_VAR, "127.0.0.1, ::1")
        assert ice_aiortc.restrict_host_candidates() == ["127.0.0.1", "::1"]
        assert aioice.ice.get_host_addresses(True, False) == ["127.0.0.1"]
        monkeypatch.delenv(ice.ENV_VAR)
        with pytest.raises(ValueError):
            ice_aiortc.restrict_host_candidates()
        with pytest.raises(ValueError):
            ice_aiortc.restrict_host_candidates(["not-an-ip"])
    finally:
        ice_aiortc.unrestrict()
    assert aioice.ice.get_host_addresses is ice_aiortc._original


async def test_offer_has_only_loopback_candidates(restricted):
    pc = RTCPeerConnection(ice_aiortc.rtc_configuration())
    try:
        pc.createDataChannel("x")
        await pc.setLocalDescription(await pc.createOffer())
        lines = [ln for ln in pc.localDescription.sdp.splitlines() if ln.startswith("a=candidate")]
        assert lines
        for ln in lines:
            assert ln.split()[4] == "127.0.0.1", ln
            assert " typ host" in ln
    finally:
        await pc.close()


def test_the_suite_runs_with_ice_restricted_to_loopback() -> None:
    # tests/conftest.py sets it for every test and every peer subprocess.
    import os

    assert os.environ.get("DAISYWEB_ICE_HOSTS") == "127.0.0.1"


SDP = "\r\n".join([
    "v=0",
    "a=candidate:1 1 udp 2122194687 127.0.0.1 48613 typ host generation 0",
    "a=candidate:2 1 udp 2122267903 ::1 37377 typ host generation 0",
    "a=candidate:3 1 udp 2122194687 192.0.2.7 40000 typ host generation 0",
    "a=candidate:4 1 udp 2122194687 0a1b2c3d-aaaa.local 40001 typ host generation 0",
    "a=candidate:5 1 udp 1686052607 198.51.100.9 5000 typ srflx raddr 192.0.2.7 rport 40000",
    "a=candidate:6 1 udp 1686052607 198.51.100.9 5001 typ srflx raddr 127.0.0.1 rport 48613",
    "a=candidate:7 1 udp 41885439 203.0.113.5 6000 typ relay raddr 198.51.100.9 rport 5000",
    "a=candidate:8 1 tcp 1518214911 127.0.0.1 9 typ host tcptype active generation 0",
    "a=end-of-candidates",
    "",
])


def test_filter_candidates_keeps_only_ice_host_addresses_and_never_mdns() -> None:
    kept = ice.filter_candidates(SDP, ("127.0.0.1",))
    assert [f for f in ice.sdp_candidates(kept)] == [
        ("127.0.0.1", "host"), ("198.51.100.9", "srflx"), ("203.0.113.5", "relay"),
        ("127.0.0.1", "host")]
    # the non-candidate lines and the line ending are untouched
    assert kept.startswith("v=0\r\n") and kept.endswith("a=end-of-candidates\r\n")
    # without --ice-host only mDNS names go
    anyhost = ice.sdp_candidates(ice.filter_candidates(SDP, None))
    assert len(anyhost) == 7 and not any(a.endswith(".local") for a, _ in anyhost)
    assert ice.filter_candidates(SDP.replace("\r\n", "\n"), ("127.0.0.1",)) == kept.replace(
        "\r\n", "\n")


def test_ice_server_urls_are_checked() -> None:
    assert ice.parse_server_url("turn:127.0.0.1:3478", turn=True)
    assert ice.parse_server_url("turn:relay.example.org?transport=tcp", turn=True)
    assert ice.parse_server_url("stun:stun.example.org:19302", turn=False)
    for url, turn in (("stun:x:1", True), ("turn:x:1", False), ("turn:x:99999", True),
                      ("http://x", True), ("stun:x?transport=udp", False), ("turn:", True)):
        with pytest.raises(ValueError):
            ice.parse_server_url(url, turn=turn)


async def test_prepare_gives_udp_sockets_a_receive_buffer_for_a_whole_sctp_window(
        monkeypatch) -> None:
    # aioice's own 256 KiB overflows while a one-core peer computes (RcvbufErrors).
    import socket
    from pathlib import Path

    import aioice.turn

    rmem_max = int(Path("/proc/sys/net/core/rmem_max").read_text())
    if rmem_max <= aioice.turn.UDP_SOCKET_BUFFER_SIZE:
        pytest.skip(f"net.core.rmem_max is {rmem_max}: no larger buffer can be granted")
    monkeypatch.setattr(aioice.turn, "UDP_SOCKET_BUFFER_SIZE", 256 * 1024)  # aioice's
    ice_aiortc.TRANSPORT.prepare(ice.IceSettings(hosts=("127.0.0.1",)))
    pc = ice_aiortc.TRANSPORT.peer_connection(ice.IceSettings(hosts=("127.0.0.1",)))
    try:
        pc.createDataChannel("x")
        await pc.setLocalDescription(await pc.createOffer())
        # aioice keeps the gathered sockets on its connection (no public accessor)
        connection = pc.sctp.transport.transport.iceGatherer._connection
        sockets = [p.transport.get_extra_info("socket") for p in connection._protocols]
        assert sockets
        granted = min(ice_aiortc.SOCKET_BUFFER_BYTES, rmem_max) * 2  # Linux doubles it
        for sock in sockets:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= granted
    finally:
        await pc.close()
        ice_aiortc.unrestrict()


async def test_aiortc_sends_after_close_stay_off_the_screen(caplog) -> None:
    """aiortc retransmits SCTP chunks from tasks nobody awaits; one that runs after its
    connection closed fails with ConnectionError, which asyncio would report as "Task
    exception was never retrieved" (users saw it when a link timed out connecting). Any
    other unretrieved error is still reported."""
    import gc

    from aiortc.rtcsctptransport import InitChunk

    caplog.set_level(logging.DEBUG, logger=ice_aiortc.__name__)
    ice_aiortc.TRANSPORT.prepare(ice.IceSettings(hosts=("127.0.0.1",)))
    settings = ice.IceSettings(hosts=("127.0.0.1",))
    pc, other = (ice_aiortc.TRANSPORT.peer_connection(settings) for _ in range(2))
    try:
        opened = asyncio.Event()
        pc.createDataChannel("x").on("open", opened.set)
        await pc.setLocalDescription(await pc.createOffer())
        await other.setRemoteDescription(pc.localDescription)
        await other.setLocalDescription(await other.createAnswer())
        await pc.setRemoteDescription(other.localDescription)
        await asyncio.wait_for(opened.wait(), 10)
        await pc.close()

        async def ours() -> None:
            raise ConnectionError("ours")

        # a retransmission that fires after the close, and one error of our own
        tasks = [asyncio.ensure_future(pc.sctp._send_chunk(InitChunk())),
                 asyncio.ensure_future(ours())]
        await asyncio.wait(tasks)  # done, their exceptions never retrieved
        del tasks
        gc.collect()  # asyncio reports an unretrieved exception when the task goes
        reported = [r.getMessage() for r in caplog.records
                    if "exception was never retrieved" in r.getMessage()]
        assert len(reported) == 1 and "ours" in caplog.text, caplog.text
        assert "aiortc: Cannot send encrypted data" in caplog.text  # aiortc's, at debug
    finally:
        await pc.close()
        await other.close()
        ice_aiortc.unrestrict()


async def test_sctp_waits_long_enough_for_a_busy_peers_acknowledgement() -> None:
    """At aiortc's 1 s least retransmission timeout, peers of a 32-peer start that
    processed what they received seconds late made their senders resend everything in
    flight hundreds of times a minute; connections made after prepare() wait longer."""
    settings = ice.IceSettings(hosts=("127.0.0.1",))
    ice_aiortc.TRANSPORT.prepare(settings)
    pc, other = (ice_aiortc.TRANSPORT.peer_connection(settings) for _ in range(2))
    try:
        opened, got = asyncio.Event(), asyncio.Event()
        channel = pc.createDataChannel("x")
        channel.on("open", opened.set)
        other.on("datachannel", lambda ch: ch.on("message", lambda m: got.set()))
        await pc.setLocalDescription(await pc.createOffer())
        await other.setRemoteDescription(pc.localDescription)
        await other.setLocalDescription(await other.createAnswer())
        await pc.setRemoteDescription(other.localDescription)
        await asyncio.wait_for(opened.wait(), 10)
        channel.send(b"x" * 100_000)  # acknowledged in milliseconds on loopback
        await asyncio.wait_for(got.wait(), 10)
        await asyncio.sleep(0.2)
        # aiortc keeps the timeout on its SCTP transport (no public accessor)
        assert pc.sctp._rto >= ice_aiortc.RETRANSMIT_AFTER_S
    finally:
        await pc.close()
        await other.close()
        ice_aiortc.unrestrict()
