"""The network: the peer mesh behind a small interface, its typed events and errors.

The rest of the peer uses only what is exported here. Inside the package:

* ``events``: ``PeerUp``, ``PeerDown``, ``Received``, ``BadMessage``, ``Members``
  (the :data:`MeshEvent` union), the errors, and the byte-bounded event queue.
* ``mesh``: :class:`Mesh`, who connects to whom, heartbeats, the one fault hook.
* ``signaling_client``: the WebSocket client to the signaling server.
* ``link``: one ``RTCPeerConnection`` + data channel: framing, backpressure, bounds.
* ``ice``: which ICE candidates are gathered; ``tasks``: background task bookkeeping.
"""

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
