"""The aiortc transport: aiortc's peer connections, aioice limited to named addresses.

aioice gathers host candidates by calling the module-level function
``aioice.ice.get_host_addresses(use_ipv4, use_ipv6)`` from
``Connection.gather_candidates`` (it enumerates every adapter and drops
127.0.0.1 / ::1). :func:`restrict_host_candidates` replaces that one function,
process-wide, with one returning exactly the named addresses (loopback allowed).
It is idempotent: calling it again only changes the list. :func:`unrestrict`
puts the original back.

:func:`rtc_configuration` builds an ``RTCConfiguration`` with an explicit (by
default empty) ``iceServers`` list, so aiortc never falls back to its default
public STUN server.

:func:`enlarge_socket_buffers` raises the receive buffer aioice gives each UDP socket
(its ``turn.UDP_SOCKET_BUFFER_SIZE``, 256 KiB, used for host and TURN sockets alike) to
hold aiortc's whole SCTP window (1 MiB of data in flight). With 256 KiB a peer whose
one core is busy computing drops datagrams at its own socket, and each loss costs an
SCTP retransmission (``RcvbufErrors`` in ``/proc/net/snmp``).

:func:`tolerate_missed_consent_checks` raises how many consent checks in a row aioice may
miss before it closes a connection (its ``ice.CONSENT_FAILURES``, 6). aioice sends one
check every ~5 s and gives each a single 0.5 s try, so a peer whose event loop is starved
(a 32-peer start on two cores, a leader streaming snapshots) misses six in a row and its
links to live peers close ("Consent to send expired"). Every authenticated frame already
proves the peer consents, and the mesh's heartbeats, which fit the measured round trips
and stalls, drop a peer that is really gone within 30 s.

:func:`patient_retransmissions` raises the least time aiortc's SCTP waits for an
acknowledgement before it retransmits (``rtcsctptransport.SCTP_RTO_MIN``, 1 s, RFC
9260's value) to :data:`RETRANSMIT_AFTER_S`. A Python peer of a big group on a busy CPU
processes what it receives seconds late, so its acknowledgements come late; at 1 s its
senders timed out hundreds of times a minute, each time resending all data in flight
with their window cut to one packet, which loaded every peer more (a 32-peer start: 920
timeouts, links silent for 7 s). Losses a later packet reveals are still resent at once
(fast retransmit); only a loss at the tail of a burst waits the longer time.

:func:`quiet_sends_after_close` keeps aiortc's own loose ends off the user's screen: its
SCTP association retransmits from tasks nobody awaits, and one that fires after its
connection closed fails with ``ConnectionError``, which asyncio would print as "Task
exception was never retrieved" with the task's repr (a link that timed out connecting
does it). Those go to the debug log; every other unhandled error is reported as before.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Iterable
from typing import Any

import aioice.ice
import aioice.turn
from aiortc import (
    RTCConfiguration,
    RTCIceServer,
    RTCIceTransportPolicy,
    RTCPeerConnection,
    RTCSessionDescription,
    rtcsctptransport,
)

from daisyweb.net.ice import ENV_VAR, IceServer, IceSettings, hosts_from_env

__all__ = ["CONSENT_CHECKS_MISSED", "RETRANSMIT_AFTER_S", "SOCKET_BUFFER_BYTES", "TRANSPORT",
           "enlarge_socket_buffers", "patient_retransmissions", "quiet_sends_after_close",
           "restrict_host_candidates",
           "rtc_configuration",
           "tolerate_missed_consent_checks", "unrestrict"]

log = logging.getLogger(__name__)

_original = aioice.ice.get_host_addresses
_allowed: list[str] | None = None

# aiortc advertises a 1 MiB receive window and the kernel charges each ~1.2 KB datagram
# about twice its size: 4 MiB holds a full window (Linux caps it at net.core.rmem_max).
SOCKET_BUFFER_BYTES = 4 << 20

# Consent checks missed in a row before aioice closes a connection: about 2 minutes.
CONSENT_CHECKS_MISSED = 24

# The least SCTP retransmission timeout: RFC 9260's initial one (its minimum is 1 s).
RETRANSMIT_AFTER_S = 3.0


def _restricted_get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    allowed = _allowed or []
    out = []
    for a in allowed:
        v = ipaddress.ip_address(a).version
        if (v == 4 and use_ipv4) or (v == 6 and use_ipv6):
            out.append(a)
    return out


def restrict_host_candidates(addresses: Iterable[str] | None = None) -> list[str]:
    """Limit ICE host candidates to ``addresses`` (or ``$DAISYWEB_ICE_HOSTS``).

    Raises ValueError on an invalid address or when no list is given either way.
    Returns the installed list.
    """
    global _allowed
    addrs = list(addresses) if addresses is not None else hosts_from_env()
    if not addrs:
        raise ValueError(f"no ICE host addresses given (argument or ${ENV_VAR})")
    norm = [str(ipaddress.ip_address(a)) for a in addrs]
    _allowed = norm
    aioice.ice.get_host_addresses = _restricted_get_host_addresses
    return list(norm)


def unrestrict() -> None:
    """Restore aioice's own host address discovery."""
    global _allowed
    _allowed = None
    aioice.ice.get_host_addresses = _original


def enlarge_socket_buffers() -> None:
    """Every UDP socket aioice opens from now on asks for :data:`SOCKET_BUFFER_BYTES` of
    receive buffer (process-wide, idempotent; aioice reads the value at each bind)."""
    aioice.turn.UDP_SOCKET_BUFFER_SIZE = max(aioice.turn.UDP_SOCKET_BUFFER_SIZE,
                                             SOCKET_BUFFER_BYTES)


def tolerate_missed_consent_checks() -> None:
    """aioice closes a connection only after :data:`CONSENT_CHECKS_MISSED` consent
    checks in a row went unanswered (process-wide, idempotent; aioice reads the value at
    each check)."""
    aioice.ice.CONSENT_FAILURES = max(aioice.ice.CONSENT_FAILURES, CONSENT_CHECKS_MISSED)


def patient_retransmissions() -> None:
    """aiortc's SCTP waits at least :data:`RETRANSMIT_AFTER_S` for an acknowledgement
    before it retransmits (process-wide, idempotent; read at each RTO update)."""
    rtcsctptransport.SCTP_RTO_MIN = max(rtcsctptransport.SCTP_RTO_MIN, RETRANSMIT_AFTER_S)


def _from_aiortc_after_close(context: dict[str, Any]) -> bool:
    task = context.get("future")
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    return (isinstance(context.get("exception"), ConnectionError)
            and getattr(coro, "__qualname__", "").startswith("RTCSctpTransport."))


def quiet_sends_after_close(loop: asyncio.AbstractEventLoop) -> None:
    """On ``loop``, an aiortc SCTP task that failed because its connection closed is
    logged at debug level; any other context goes to the handler installed before
    (idempotent)."""
    previous = loop.get_exception_handler()
    if getattr(previous, "quiets_aiortc", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if _from_aiortc_after_close(context):
            log.debug("aiortc: %s", context.get("exception"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.quiets_aiortc = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)


def _server(s: IceServer) -> RTCIceServer:
    return RTCIceServer(s.url, username=s.username, credential=s.credential)


def rtc_configuration(ice_servers: Iterable[str | IceServer] = (), *,
                      relay_only: bool = False) -> RTCConfiguration:
    """RTCConfiguration with explicit ICE servers (default none: no STUN traffic)."""
    servers = [_server(s if isinstance(s, IceServer) else IceServer(s)) for s in ice_servers]
    policy = RTCIceTransportPolicy.RELAY if relay_only else RTCIceTransportPolicy.ALL
    return RTCConfiguration(iceServers=servers, iceTransportPolicy=policy)


class AiortcTransport:
    name = "aiortc"

    def prepare(self, settings: IceSettings) -> None:
        enlarge_socket_buffers()
        tolerate_missed_consent_checks()
        patient_retransmissions()
        quiet_sends_after_close(asyncio.get_running_loop())
        if settings.hosts:
            restrict_host_candidates(settings.hosts)

    def peer_connection(self, settings: IceSettings) -> Any:
        return RTCPeerConnection(rtc_configuration(settings.servers,
                                                   relay_only=settings.relay_only))

    def description(self, sdp: str, kind: str) -> Any:
        return RTCSessionDescription(sdp=sdp, type=kind)


TRANSPORT = AiortcTransport()

