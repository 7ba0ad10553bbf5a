"""What the application sees of the mesh: typed events, errors, and the event queue.

Events are frozen dataclasses delivered in arrival order by ``Mesh.next_event``;
:class:`EventQueue` holds them and counts the bytes of received-but-unread messages,
so a link can refuse to push the backlog past ``max_bytes`` (see ``daisyweb.net.link``).
Errors are :class:`MeshError` and its subclasses; match them by type.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from daisyweb.protocol import wire

__all__ = [
    "PeerUp",
    "PeerDown",
    "Received",
    "BadMessage",
    "Members",
    "MeshEvent",
    "MeshError",
    "JoinTimeout",
    "JoinDenied",
    "EventQueue",
]


@dataclass(frozen=True)
class PeerUp:
    """The data channel to ``peer`` is open."""

    peer: str


@dataclass(frozen=True)
class PeerDown:
    """The link to ``peer`` is gone (only after a PeerUp for it)."""

    peer: str
    reason: str


@dataclass(frozen=True)
class Received:
    """One whole, decoded message from ``peer`` (heartbeats are never delivered)."""

    peer: str
    message: wire.Message


@dataclass(frozen=True)
class BadMessage:
    """A frame or message from ``peer`` the wire decoder refused; the link stays up."""

    peer: str
    error: str


@dataclass(frozen=True)
class Members:
    """Signaling's approved member list changed (ids in server order)."""

    members: tuple[str, ...]
    host: str | None


MeshEvent = PeerUp | PeerDown | Received | BadMessage | Members


class MeshError(Exception):
    """A mesh operation failed (peer not connected, signaling unreachable, closed)."""


class JoinTimeout(MeshError):
    """Not admitted to the group within ``join_timeout``."""


class JoinDenied(MeshError):
    """The host refused us (or the server would not let us in)."""


class EventQueue:
    """Events in arrival order, with the bytes of unread messages counted.

    ``put`` never blocks (aiortc delivers data through a callback that cannot wait);
    the producer asks :meth:`fits` first and sheds load itself when the answer is no.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: deque[tuple[MeshEvent, int]] = deque()
        self._ready = asyncio.Event()
        self._bytes = 0
        self._closed = False

    def fits(self, size: int) -> bool:
        """Whether ``size`` more unread bytes stay within ``max_bytes``."""
        return self._bytes + size <= self.max_bytes

    def put(self, event: MeshEvent, size: int = 0) -> None:
        """Append an event; ``size`` is the bytes it holds until it is read."""
        self._items.append((event, size))
        self._bytes += size
        self._ready.set()

    async def get(self) -> MeshEvent:
        """The next event; waits for one. MeshError once closed and empty."""
        while not self._items:
            if self._closed:
                raise MeshError("mesh closed")
            self._ready.clear()
            await self._ready.wait()
        event, size = self._items.popleft()
        self._bytes -= size
        return event

    def close(self) -> None:
        """Wake every reader; events already queued are still delivered."""
        self._closed = True
        self._ready.set()
