"""The libwebrtc transport: Chrome's engine through ``wrtc``'s aiortc-compatible API.

``webrtc.aiortc`` mirrors aiortc's classes over libwebrtc (ICE, DTLS and SCTP in C++),
so ``net.link`` drives it exactly like aiortc. What differs, and how it is handled:

* libwebrtc gathers every interface's address and has no switch to name them, and it
  skips loopback unless ``webrtc.loopback.allow_loopback()`` ran before the first
  connection. So :meth:`prepare` allows loopback only when ``--ice-host`` names a
  loopback address, and ``--ice-host`` is enforced on what is signaled
  (``ice.filter_candidates`` in ``net.link``): no other address is announced to a peer
  or taken from one. Tests and benchmarks run libwebrtc peers only inside a network
  namespace that holds nothing but loopback.
* ``$DAISYWEB_LOOPBACK_ONLY=1`` (set by the test suite and the benchmarks) makes
  :meth:`prepare` refuse to run unless this network namespace has no interface but
  ``lo``: a libwebrtc peer started by a test outside ``unshare --net`` stops before it
  gathers anything.
* ``webrtc.aiortc.RTCConfiguration`` has no ``iceTransportPolicy``; a relay-only
  connection gets it through the native ``set_configuration`` before any candidate is
  gathered.
"""

from __future__ import annotations

import os
from typing import Any

import webrtc
import webrtc.loopback
from webrtc.aiortc import (
    RTCConfiguration,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)

from daisyweb.net.ice import IceServer, IceSettings, non_loopback_interfaces
from daisyweb.net.transport import TransportError

__all__ = ["LOOPBACK_ONLY_VAR", "TRANSPORT", "non_loopback_interfaces"]

LOOPBACK_ONLY_VAR = "DAISYWEB_LOOPBACK_ONLY"


def check_loopback_only() -> None:
    """TransportError unless ``$DAISYWEB_LOOPBACK_ONLY`` is unset or this namespace is
    loopback-only."""
    if os.environ.get(LOOPBACK_ONLY_VAR) != "1":
        return
    others = non_loopback_interfaces()
    if others:
        raise TransportError(
            f"libwebrtc refused: ${LOOPBACK_ONLY_VAR}=1 but this network namespace has "
            f"{', '.join(others)} besides lo (run it under unshare --net)")


def _servers(settings: IceSettings) -> list[RTCIceServer]:
    return [RTCIceServer(s.url, username=s.username, credential=s.credential)
            for s in settings.servers]


def _native_servers(servers: tuple[IceServer, ...]) -> list[webrtc.RTCIceServer]:
    return [webrtc.RTCIceServer(urls=s.url, username=s.username, credential=s.credential)
            for s in servers]


class LibwebrtcTransport:
    name = "libwebrtc"

    def __init__(self) -> None:
        self._loopback = False

    def prepare(self, settings: IceSettings) -> None:
        check_loopback_only()
        if settings.loopback and not self._loopback:
            # Must precede the first connection of the process (InvalidStateError after).
            webrtc.loopback.allow_loopback()
            self._loopback = True

    def peer_connection(self, settings: IceSettings) -> Any:
        check_loopback_only()  # also for a connection made without prepare()
        pc = RTCPeerConnection(RTCConfiguration(iceServers=_servers(settings)))
        if settings.relay_only:
            pc._native.set_configuration(webrtc.RTCConfiguration(
                ice_servers=_native_servers(settings.servers), ice_transport_policy="relay"))
        return pc

    def description(self, sdp: str, kind: str) -> Any:
        return RTCSessionDescription(sdp=sdp, type=kind)


TRANSPORT = LibwebrtcTransport()
