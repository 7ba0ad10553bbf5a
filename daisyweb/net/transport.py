"""Which WebRTC implementation carries the data channels: aiortc or libwebrtc.

Both speak the same ICE, DTLS and SCTP (every browser's too), so peers of either kind sit
in one group. A :class:`Transport` is the little ``net.link`` needs from one: a peer
connection for some :class:`~daisyweb.net.ice.IceSettings` and a session description
object; everything else (data channels, ``bufferedAmount``, events, ``close``) is the
aiortc API, which ``webrtc.aiortc`` (the ``wrtc`` package, Chrome's libwebrtc) mirrors.

One module per implementation, imported only when chosen, so a libwebrtc peer never
loads aiortc and an aiortc peer never loads libwebrtc:

* ``transport_aiortc``: aiortc and aioice, pure Python (the dependency, the fallback).
* ``transport_libwebrtc``: ``wrtc`` (``pip install 'daisyweb[fast]'``), about ten times
  the throughput (``TEST_RESULTS.md``, bench:mesh).

:func:`choose` resolves ``--transport auto|aiortc|libwebrtc``: ``auto`` is libwebrtc when
``webrtc`` imports, else aiortc.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from daisyweb.net import nomedia
from daisyweb.net.events import MeshError
from daisyweb.net.ice import IceSettings

__all__ = ["NAMES", "Transport", "TransportError", "choose", "libwebrtc_available"]

NAMES = ("auto", "aiortc", "libwebrtc")


class TransportError(MeshError):
    """The transport asked for cannot be used here (one line for the user)."""


class Transport(Protocol):
    """What a link needs from a WebRTC implementation."""

    name: str  # "aiortc" or "libwebrtc": shown in logs, metrics and the dashboard

    def prepare(self, settings: IceSettings) -> None:
        """Process-wide set-up before the first connection (candidate restriction), called
        on the running event loop."""

    def peer_connection(self, settings: IceSettings) -> Any:
        """A new RTCPeerConnection (aiortc API) configured by ``settings``."""

    def description(self, sdp: str, kind: str) -> Any:
        """An RTCSessionDescription of this implementation."""


def libwebrtc_available() -> bool:
    """Whether ``wrtc`` (module ``webrtc``) imports on this machine."""
    try:
        importlib.import_module("webrtc")
    except Exception:  # ImportError, or a wheel whose native library fails to load
        return False
    return True


def choose(name: str = "auto") -> Transport:
    """The transport for ``--transport name``; TransportError if it cannot load."""
    if name not in NAMES:
        raise TransportError(f"unknown transport {name!r} (one of {', '.join(NAMES)})")
    # Before anything imports aiortc or webrtc.aiortc: they would load PyAV for media.
    nomedia.install()
    if name == "auto":
        name = "libwebrtc" if libwebrtc_available() else "aiortc"
    if name == "libwebrtc":
        try:
            from daisyweb.net import transport_libwebrtc
        except ImportError as e:
            raise TransportError(
                f"--transport libwebrtc needs the wrtc package "
                f"(pip install 'daisyweb[fast]'): {e}") from None
        transport_libwebrtc.check_loopback_only()
        return transport_libwebrtc.TRANSPORT
    from daisyweb.net import transport_aiortc

    return transport_aiortc.TRANSPORT
