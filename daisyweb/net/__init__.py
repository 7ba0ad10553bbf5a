"""The network: ICE settings, the signaling client, links and the peer mesh.

The rest of the peer uses only what is exported here: the :class:`Mesh` interface, its
typed events and its errors.
"""

from daisyweb.net.mesh import (
    BadMessage,
    JoinDenied,
    JoinTimeout,
    Members,
    Mesh,
    MeshError,
    MeshEvent,
    PeerDown,
    PeerUp,
    Received,
)

__all__ = ["BadMessage", "JoinDenied", "JoinTimeout", "Mesh", "MeshError", "MeshEvent",
           "Members", "PeerDown", "PeerUp", "Received"]
