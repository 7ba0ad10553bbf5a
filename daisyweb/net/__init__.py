"""The network: the peer mesh behind a small interface, its typed events and errors.

The rest of the peer uses only what is exported here. Inside the package:

* ``events``: ``PeerUp``, ``PeerDown``, ``Received``, ``BadMessage``, ``Members``
  (the :data:`MeshEvent` union), the errors, and the byte-bounded event queue.
* ``mesh``: :class:`Mesh`, who connects to whom, heartbeats, the one fault hook.
* ``signaling_client``: the WebSocket client to the signaling server.
* ``link``: one ``RTCPeerConnection`` + data channel: framing, backpressure, bounds.
* ``ice``: which ICE candidates are gathered and signaled, ICE servers (pure Python).
* ``transport``: aiortc or libwebrtc, one module each (``transport_aiortc``,
  ``transport_libwebrtc``), imported only when chosen.
* ``tasks``: background task bookkeeping.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daisyweb.net.events import (
        BadMessage,
        JoinDenied,
        JoinTimeout,
        Members,
        MeshError,
        MeshEvent,
        PeerDown,
        PeerUp,
        Received,
    )
    from daisyweb.net.mesh import Mesh

__all__ = ["BadMessage", "JoinDenied", "JoinTimeout", "Mesh", "MeshError", "MeshEvent",
           "Members", "PeerDown", "PeerUp", "Received"]


def __getattr__(name: str) -> Any:
    # Lazy: ``daisyweb.net.ice`` (pure Python) is imported by the command line's flag
    # checks, which must not pay for aiohttp and a WebRTC library.
    if name == "Mesh":
        return importlib.import_module("daisyweb.net.mesh").Mesh
    if name in __all__:
        return getattr(importlib.import_module("daisyweb.net.events"), name)
    raise AttributeError(f"module 'daisyweb.net' has no attribute {name!r}")
