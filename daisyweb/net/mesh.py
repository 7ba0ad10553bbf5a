"""Peer mesh: one aiortc data channel to every member of a signaling group.

A :class:`Mesh` joins a group on the signaling server (``docs/protocol.md``), waits
until it is admitted, then keeps one ``RTCPeerConnection`` with one reliable, ordered
data channel open to every other member. The lower peer id (string compare) always
offers, so two peers never offer to each other (no glare); when a link dies while both
are still members, the offerer dials again with backoff and the answerer replaces its
old connection with the newest offer.

Everything sent is a :mod:`daisyweb.protocol.wire` message, encoded and cut into frames of at
most 48 KiB; the receiver has one :class:`wire.Reassembler` per link. Heartbeats go on
every channel every ``heartbeat_interval``; any frame received counts as liveness, so a
long transfer never looks like a dead peer, and heartbeats skip the per-link send lock,
so they are never stuck behind a big message.

What the application sees is a stream of :data:`MeshEvent` from :meth:`Mesh.next_event`.

Memory bounds. Sending waits on the channel's ``bufferedAmount`` (``bufferedamountlow``)
so at most ``SEND_HIGH_WATER`` bytes per link sit in aiortc's queue. aiortc delivers
received data through a synchronous callback that cannot be paused, so the receive side
is bounded by bytes instead: reassembly holds at most ``max_message_bytes`` per
in-flight message, and received-but-unread messages at most ``max_pending_bytes`` in
total; a peer that would push past that is disconnected (``PeerDown``) rather than
letting memory grow.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription

from daisyweb.net import ice
from daisyweb.protocol import framing, wire

__all__ = [
    "PeerUp",
    "PeerDown",
    "Received",
    "BadMessage",
    "Members",
    "MeshEvent",
    "JoinTimeout",
    "JoinDenied",
    "MeshError",
    "Mesh",
    "SEND_HIGH_WATER",
    "SEND_LOW_WATER",
]

log = logging.getLogger("daisyweb.net.mesh")

# Backpressure marks on a channel's bufferedAmount. High enough to keep aiortc's SCTP
# sender busy between wake-ups, low enough that a heartbeat queued behind it still
# leaves within a fraction of a second at the ~6-10 MB/s aiortc manages.
SEND_HIGH_WATER = 1 << 20
SEND_LOW_WATER = 256 << 10
CHANNEL_LABEL = "daisyweb"
# A link refusing more than this many distinct messages is a misbehaving peer: drop it.
MAX_BAD_MESSAGES = 20
CONNECT_TIMEOUT = 15.0
RECONNECT_BACKOFF = (0.2, 5.0)
# The server allows 50 messages/s per connection and closes it after 20 errors, so
# status reports (the only frequent client message) are coalesced to at most 10/s.
STATUS_MIN_INTERVAL = 0.1



# ----------------------------------------------------------------------------
# Events and errors


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


class BroadcastError(MeshError):
    """Some peers of a broadcast failed; ``failed`` maps peer id -> error."""

    def __init__(self, failed: dict[str, BaseException]) -> None:
        self.failed = failed
        detail = "; ".join(f"{p}: {e}" for p, e in sorted(failed.items()))
        super().__init__(f"broadcast failed for {len(failed)} peer(s): {detail}")


# ----------------------------------------------------------------------------
# One link (pc + channel) to one peer


class _Link:
    __slots__ = (
        "peer",
        "pc",
        "channel",
        "session",
        "reassembler",
        "up",
        "dead",
        "last_rx",
        "send_lock",
        "drained",
        "opened",
        "died",
        "bad",
        "refused",
        "frames_rx",
    )

    def __init__(self, peer: str, pc: RTCPeerConnection, session: int, max_total: int) -> None:
        self.peer = peer
        self.pc = pc
        self.channel: RTCDataChannel | None = None
        self.session = session  # which offer this link belongs to (stale answers are ignored)
        self.reassembler = framing.Reassembler(max_total=max_total)
        self.up = False
        self.dead = False
        self.last_rx = time.monotonic()
        self.send_lock = asyncio.Lock()
        self.drained = asyncio.Event()
        self.opened = asyncio.Event()
        self.died = asyncio.Event()
        self.bad = 0
        # msg_ids already reported bad: the rest of that message's frames are refused
        # too, but one broken message is one BadMessage, not one per frame.
        self.refused: deque[int] = deque(maxlen=256)
        self.frames_rx = 0


def _ws_url(server: str) -> str:
    """Accept http(s):// or ws(s)://, with or without the /ws path."""
    parts = urlsplit(server if "://" in server else "http://" + server)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"signaling server URL must be http(s) or ws(s), got {server!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/ws"):
        path += "/ws"
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def _message_size(message: wire.Message) -> int:
    payload = getattr(message, "payload", b"")
    return len(payload) + 256


# ----------------------------------------------------------------------------


class Mesh:
    """A full mesh of data channels to the members of one signaling group."""

    # Test-only fault hook, set by code (never from the wire): called with (peer, message)
    # before each send, heartbeats included; True drops that message silently.
    fault_drop: Callable[[str, object], bool] | None = None

    def __init__(
        self,
        server: str,
        *,
        room: str | None = None,
        name: str = "peer",
        approve: Callable[[str, str], Awaitable[bool]] | None = None,
        ice_hosts: Sequence[str] | None = None,
        stun: Sequence[str] = (),
        join_timeout: float = 60.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        max_message_bytes: int = 256 * 2**20,
        max_pending_bytes: int | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        if heartbeat_interval <= 0 or heartbeat_timeout <= heartbeat_interval:
            raise ValueError("need 0 < heartbeat_interval < heartbeat_timeout")
        if max_message_bytes < 1:
            raise ValueError("max_message_bytes must be >= 1")
        self.server = server
        self._ws_url = _ws_url(server)
        self.room = room
        self.name = name
        self.approve = approve
        self.ice_hosts = list(ice_hosts) if ice_hosts is not None else None
        self.stun = tuple(stun)
        self.join_timeout = join_timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self.max_pending_bytes = (
            max_pending_bytes if max_pending_bytes is not None else 2 * max_message_bytes
        )
        self.connect_timeout = connect_timeout

        self.self_id: str = ""
        self.host: str | None = None
        self.members: tuple[str, ...] = ()
        self.names: dict[str, str] = {}
        self.group: str | None = None
        self.host_key: str | None = None
        self.fault_drop = None

        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._links: dict[str, _Link] = {}
        self._dialers: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._admitted: asyncio.Future[None] | None = None
        self._msg_ids = itertools.count(1)
        self._sessions = itertools.count(1)
        self._events: deque[tuple[MeshEvent, int]] = deque()
        self._event_ready = asyncio.Event()
        self._pending_bytes = 0
        self._waiting: dict[str, str] = {}
        self._deciding: dict[str, asyncio.Task[None]] = {}
        self._decided: set[str] = set()
        self._status_last = 0.0
        self._status_pending: dict[str, Any] | None = None
        self._status_task: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False
        self.signaling_up = False

    # ------------------------------------------------------------------ public

    async def start(self) -> None:
        """Join the group and wait until admitted; links then come up in the background."""
        if self._started:
            raise MeshError("start() called twice")
        self._started = True
        # The one place candidate restriction lives (process-wide in aioice).
        hosts = self.ice_hosts if self.ice_hosts is not None else ice.hosts_from_env()
        if hosts:
            ice.restrict_host_candidates(hosts)
        params = {"name": self.name}
        if self.room is not None:
            params["room"] = self.room
        loop = asyncio.get_running_loop()
        self._admitted = loop.create_future()
        deadline = loop.time() + self.join_timeout
        self._session = aiohttp.ClientSession()
        try:
            try:
                self._ws = await asyncio.wait_for(
                    self._session.ws_connect(self._ws_url, params=params, heartbeat=None),
                    self.join_timeout,
                )
            except asyncio.TimeoutError:
                raise JoinTimeout(
                    f"could not reach the signaling server {self.server} "
                    f"within {self.join_timeout:g} s"
                ) from None
            except aiohttp.WSServerHandshakeError as e:
                raise MeshError(f"signaling server refused the connection: {e.status} {e}") from e
            except (aiohttp.ClientError, OSError) as e:
                raise MeshError(f"cannot connect to signaling server {self.server}: {e}") from e
            self.signaling_up = True
            self._reader = asyncio.create_task(self._read_signaling())
            try:
                await asyncio.wait_for(
                    asyncio.shield(self._admitted), max(0.0, deadline - loop.time())
                )
            except asyncio.TimeoutError:
                where = f"room {self.room!r}" if self.room else "the group"
                raise JoinTimeout(
                    f"not admitted to {where} within {self.join_timeout:g} s "
                    "(the host has not approved this peer)"
                ) from None
        except BaseException:
            await self.close()
            raise
        self._heartbeat = asyncio.create_task(self._heartbeat_loop())

    async def next_event(self) -> MeshEvent:
        """The next event, in arrival order; waits for one. MeshError once closed."""
        while not self._events:
            if self._closed:
                raise MeshError("mesh closed")
            self._event_ready.clear()
            await self._event_ready.wait()
        event, size = self._events.popleft()
        self._pending_bytes -= size
        return event

    def connected(self) -> list[str]:
        """Peers whose channel is open, in member order."""
        order = {m: i for i, m in enumerate(self.members)}
        up = [p for p, link in self._links.items() if link.up and not link.dead]
        return sorted(up, key=lambda p: (order.get(p, len(order)), p))

    async def send(self, peer: str, message: wire.Message) -> None:
        """Send one message to ``peer`` (waits while its channel buffer is full)."""
        frames = self._frames(message)
        await self._send_frames(peer, message, frames)

    async def broadcast(self, message: wire.Message, peers: Iterable[str] | None = None) -> None:
        """Send to every connected peer (or to ``peers``) concurrently; encoded once.

        All sends run to completion; if any failed, BroadcastError (a MeshError) names them.
        """
        targets = list(peers) if peers is not None else self.connected()
        frames = self._frames(message)
        results = await asyncio.gather(
            *(self._send_frames(p, message, frames) for p in targets), return_exceptions=True
        )
        pairs = zip(targets, results, strict=True)
        failed = {p: r for p, r in pairs if isinstance(r, BaseException)}
        for r in failed.values():
            if not isinstance(r, MeshError):
                raise r
        if failed:
            raise BroadcastError(failed)

    async def report_status(self, **fields: Any) -> None:
        """Send ``{"type": "status", **fields}`` to the signaling server (the dashboard).

        Reports closer together than STATUS_MIN_INTERVAL are coalesced (the latest wins),
        so a fast training loop cannot trip the server's rate limit.
        """
        if self._ws is None or self._ws.closed:
            raise MeshError("not connected to the signaling server")
        now = time.monotonic()
        if self._status_task is None and now - self._status_last >= STATUS_MIN_INTERVAL:
            self._status_last = now
            await self._ws_send({"type": "status", **fields})
            return
        self._status_pending = fields
        if self._status_task is None:
            delay = STATUS_MIN_INTERVAL - (now - self._status_last)
            self._status_task = asyncio.create_task(self._flush_status(delay))

    def host_link(self) -> str | None:
        """The host's dashboard approval link, once the server sent a host key."""
        if self.host_key is None or self.room is None:
            return None
        parts = urlsplit(self._ws_url)
        scheme = "https" if parts.scheme == "wss" else "http"
        return f"{scheme}://{parts.netloc}/?room={self.room}&key={self.host_key}"

    async def close(self) -> None:
        """Close every connection and the signaling socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._event_ready.set()
        me = asyncio.current_task()
        tasks = [self._reader, self._heartbeat, self._status_task, *self._dialers.values()]
        tasks += [*self._deciding.values(), *self._tasks]
        for t in tasks:
            if t is not None and t is not me and not t.done():
                t.cancel()
        links = list(self._links.values())
        self._links.clear()
        for link in links:
            link.dead = True
            link.drained.set()
            link.died.set()
        await asyncio.gather(*(link.pc.close() for link in links), return_exceptions=True)
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        if self._session is not None:
            await self._session.close()
        for t in tasks:
            if t is not None and t is not me:
                with contextlib.suppress(BaseException):
                    await t

    async def __aenter__(self) -> Mesh:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ events

    def _emit(self, event: MeshEvent, size: int = 0) -> None:
        self._events.append((event, size))
        self._pending_bytes += size
        self._event_ready.set()

    # ------------------------------------------------------------------ signaling

    async def _ws_send(self, msg: dict[str, Any]) -> None:
        ws = self._ws
        if ws is None or ws.closed:
            raise MeshError("not connected to the signaling server")
        try:
            await ws.send_json(msg)
        except (ConnectionError, RuntimeError, aiohttp.ClientError) as e:
            raise MeshError(f"signaling send failed: {e}") from e

    async def _flush_status(self, delay: float) -> None:
        try:
            await asyncio.sleep(max(0.0, delay))
            fields, self._status_pending = self._status_pending, None
            self._status_last = time.monotonic()
            if fields is not None:
                await self._ws_send({"type": "status", **fields})
        except MeshError as e:
            log.warning("status report dropped: %s", e)
        finally:
            self._status_task = None

    def _admit(self, exc: BaseException | None = None) -> None:
        fut = self._admitted
        if fut is not None and not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
                fut.exception()  # mark retrieved: start() may already have timed out

    async def _read_signaling(self) -> None:
        assert self._ws is not None
        try:
            async for raw in self._ws:
                if raw.type != aiohttp.WSMsgType.TEXT:
                    break
                try:
                    msg = raw.json()
                except ValueError:
                    log.warning("signaling sent non-JSON: %.80r", raw.data)
                    continue
                if not isinstance(msg, dict):
                    log.warning("signaling sent a non-object: %.80r", msg)
                    continue
                try:
                    await self._on_signaling(msg)
                except (KeyError, TypeError, ValueError, MeshError) as e:
                    # One bad or unanswerable message must not stop the reader.
                    log.warning("%r message from signaling failed: %s", msg.get("type"), e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken socket must not kill the mesh's links
            log.warning("signaling connection error: %s", e)
        finally:
            self.signaling_up = False
            code = self._ws.close_code if self._ws is not None else None
            self._admit(MeshError(f"signaling connection closed before admission (code {code})"))
            if not self._closed:
                log.warning("signaling connection closed (code %s); links stay up", code)

    async def _on_signaling(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "welcome":
            self.self_id = str(msg["id"])
            self.group = msg.get("group")
            self.host = msg.get("host")
            if msg.get("state") == "member":
                # Members come in the ``peers`` broadcast that follows.
                self._admit()
            else:
                log.info("waiting for the host to approve %s", self.self_id)
        elif kind == "approved":
            self._admit()
        elif kind == "denied":
            where = f"room {self.room!r}" if self.room else "the group"
            self._admit(JoinDenied(f"the host of {where} denied this peer"))
        elif kind == "peers":
            self._on_peers(msg)
        elif kind == "waiting":
            self._on_waiting(msg)
        elif kind == "decision":
            await self._on_decision(str(msg["id"]), bool(msg["approve"]))
        elif kind == "host_key":
            self.host_key = str(msg["key"])
        elif kind == "signal":
            await self._on_signal(str(msg["from"]), str(msg["kind"]), msg["data"])
        elif kind == "error":
            log.warning("signaling error %s: %s", msg.get("code"), msg.get("message"))
        else:
            log.debug("ignoring signaling message type %r", kind)

    def _on_peers(self, msg: dict[str, Any]) -> None:
        peers = msg["peers"]
        members = tuple(str(p["id"]) for p in peers)
        self.names = {str(p["id"]): str(p.get("name", "")) for p in peers}
        host = msg.get("host")
        changed = (members, host) != (self.members, self.host)
        old = set(self.members)
        self.members, self.host = members, host
        if changed:
            self._emit(Members(members, host))
        now = set(members)
        for peer in old - now:
            task = self._dialers.pop(peer, None)
            if task is not None:
                task.cancel()
            link = self._links.get(peer)
            if link is not None:
                self._drop(link, "left signaling")
        for peer in members:
            # Fixed rule: the lower id offers, so exactly one side dials.
            if peer != self.self_id and self.self_id < peer and peer not in self._dialers:
                self._dialers[peer] = asyncio.create_task(self._dial(peer))

    # --- host approval

    def _on_waiting(self, msg: dict[str, Any]) -> None:
        self._waiting = {str(p["id"]): str(p.get("name", "")) for p in msg["peers"]}
        for pid, task in list(self._deciding.items()):
            if pid not in self._waiting:  # left, or decided elsewhere
                task.cancel()
                del self._deciding[pid]
        self._decided &= set(self._waiting)
        for pid, name in self._waiting.items():
            if pid in self._decided or pid in self._deciding:
                continue
            if self.approve is None:
                self._decided.add(pid)
                self._spawn(self._ws_send({"type": "approve", "id": pid}))
            else:
                self._deciding[pid] = asyncio.create_task(self._ask(pid, name))

    async def _ask(self, pid: str, name: str) -> None:
        assert self.approve is not None
        try:
            ok = bool(await self.approve(pid, name))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("approve callback failed for %s (%s): %s; denying", pid, name, e)
            ok = False
        self._deciding.pop(pid, None)
        await self._decide(pid, ok)

    async def _on_decision(self, pid: str, ok: bool) -> None:
        task = self._deciding.pop(pid, None)
        if task is not None:
            task.cancel()  # the dashboard answered first
        await self._decide(pid, ok)

    async def _decide(self, pid: str, ok: bool) -> None:
        # Only for peers still waiting and undecided: a second approve/deny for the same
        # id is a server error, and the server drops clients after 20 errors.
        if pid not in self._waiting or pid in self._decided:
            log.info("decision for %s ignored: not waiting", pid)
            return
        self._decided.add(pid)
        try:
            await self._ws_send({"type": "approve" if ok else "deny", "id": pid})
        except MeshError as e:
            log.warning("could not send decision for %s: %s", pid, e)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("mesh task failed: %r", task.exception())

    # ------------------------------------------------------------------ WebRTC

    def _new_link(self, peer: str, session: int) -> _Link:
        pc = RTCPeerConnection(ice.rtc_configuration(self.stun))
        link = _Link(peer, pc, session, self.max_message_bytes)

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState in ("failed", "closed"):
                self._drop(link, f"connection {pc.connectionState}")

        @pc.on("datachannel")
        def _channel(channel: RTCDataChannel) -> None:
            if link.channel is None and channel.label == CHANNEL_LABEL:
                self._attach(link, channel)
            else:
                log.warning("unexpected data channel %r from %s", channel.label, peer)

        return link

    def _attach(self, link: _Link, channel: RTCDataChannel) -> None:
        link.channel = channel
        channel.bufferedAmountLowThreshold = SEND_LOW_WATER
        channel.on("bufferedamountlow", link.drained.set)
        channel.on("open", lambda: self._opened(link))
        channel.on("close", lambda: self._drop(link, "channel closed"))
        channel.on("message", lambda data: self._on_frame(link, data))
        if channel.readyState == "open":
            self._opened(link)

    def _opened(self, link: _Link) -> None:
        if link.up or link.dead or self._links.get(link.peer) is not link:
            return
        link.up = True
        link.last_rx = time.monotonic()
        link.opened.set()
        self._emit(PeerUp(link.peer))

    def _drop(self, link: _Link, reason: str) -> None:
        """Forget a link for good (idempotent); PeerDown if it had been up."""
        if link.dead:
            return
        link.dead = True
        link.drained.set()  # wake blocked senders; they see ``dead`` and fail
        link.died.set()
        if self._links.get(link.peer) is link:
            del self._links[link.peer]
        if link.up:
            log.info("link to %s down: %s", link.peer, reason)
            self._emit(PeerDown(link.peer, reason))
        if not self._closed:
            self._spawn(link.pc.close())

    async def _dial(self, peer: str) -> None:
        """Offerer side: keep one link to ``peer`` while it is a member."""
        backoff = RECONNECT_BACKOFF[0]
        while not self._closed and peer in self.members:
            link = self._new_link(peer, next(self._sessions))
            old = self._links.get(peer)
            if old is not None:
                self._drop(old, "replaced")
            self._links[peer] = link
            try:
                self._attach(link, link.pc.createDataChannel(CHANNEL_LABEL, ordered=True))
                await link.pc.setLocalDescription(await link.pc.createOffer())
                desc = link.pc.localDescription
                await self._ws_send(
                    {
                        "type": "signal",
                        "to": peer,
                        "kind": "offer",
                        "data": {"sdp": desc.sdp, "type": desc.type, "session": link.session},
                    }
                )
                await asyncio.wait_for(link.opened.wait(), self.connect_timeout)
            except asyncio.TimeoutError:
                log.info("no channel to %s within %g s; retrying", peer, self.connect_timeout)
                self._drop(link, "connect timeout")
            except MeshError as e:
                log.warning("cannot signal %s: %s", peer, e)
                self._drop(link, "signaling failed")
            except Exception as e:  # aiortc refusing an offer: retry, never kill the dialer
                log.warning("offer to %s failed: %r", peer, e)
                self._drop(link, "offer failed")
            else:
                backoff = RECONNECT_BACKOFF[0]
                await link.died.wait()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_BACKOFF[1])

    async def _on_signal(self, peer: str, kind: str, data: dict[str, Any]) -> None:
        if kind == "offer":
            if not peer < self.self_id:
                log.warning("ignoring offer from %s: the lower id offers", peer)
                return
            await self._answer(peer, data)
        elif kind == "answer":
            link = self._links.get(peer)
            if link is None or link.session != data.get("session"):
                log.debug("ignoring stale answer from %s", peer)
                return
            if link.pc.signalingState != "have-local-offer":
                return
            try:
                await link.pc.setRemoteDescription(
                    RTCSessionDescription(sdp=str(data["sdp"]), type="answer")
                )
            except Exception as e:  # a broken answer fails this attempt only
                log.warning("bad answer from %s: %s", peer, e)
                self._drop(link, "bad answer")
        else:
            log.debug("ignoring %s signal from %s (non-trickle)", kind, peer)

    async def _answer(self, peer: str, data: dict[str, Any]) -> None:
        """Answerer side: the newest offer from ``peer`` replaces any older link."""
        old = self._links.get(peer)
        if old is not None:
            self._drop(old, "replaced by a new offer")
        link = self._new_link(peer, int(data.get("session", 0)))
        self._links[peer] = link
        try:
            await link.pc.setRemoteDescription(
                RTCSessionDescription(sdp=str(data["sdp"]), type="offer")
            )
            await link.pc.setLocalDescription(await link.pc.createAnswer())
        except Exception as e:
            log.warning("bad offer from %s: %s", peer, e)
            self._drop(link, "bad offer")
            return
        if link.dead:
            return
        desc = link.pc.localDescription
        await self._ws_send(
            {
                "type": "signal",
                "to": peer,
                "kind": "answer",
                "data": {"sdp": desc.sdp, "type": desc.type, "session": link.session},
            }
        )
        self._spawn(self._expire(link))

    async def _expire(self, link: _Link) -> None:
        try:
            await asyncio.wait_for(link.opened.wait(), self.connect_timeout)
        except asyncio.TimeoutError:
            self._drop(link, "connect timeout")

    # ------------------------------------------------------------------ data

    def _frames(self, message: wire.Message) -> list[bytes]:
        data = wire.encode(message)
        if len(data) > self.max_message_bytes:
            raise MeshError(
                f"{message.type} message is {len(data)} bytes, over max_message_bytes "
                f"{self.max_message_bytes}"
            )
        return framing.frame(data, next(self._msg_ids))

    async def _send_frames(self, peer: str, message: wire.Message, frames: list[bytes]) -> None:
        link = self._links.get(peer)
        if link is None or not link.up or link.dead:
            raise MeshError(f"peer {peer} is not connected")
        hook = self.fault_drop
        if hook is not None and hook(peer, message):
            return
        # One message at a time per link: messages arrive in send() order.
        async with link.send_lock:
            channel = link.channel
            assert channel is not None
            for f in frames:
                while channel.bufferedAmount > SEND_HIGH_WATER and not link.dead:
                    link.drained.clear()
                    await link.drained.wait()
                if link.dead:
                    raise MeshError(f"peer {peer} disconnected during send")
                try:
                    channel.send(f)
                except Exception as e:  # InvalidStateError when the channel just closed
                    raise MeshError(f"send to {peer} failed: {e}") from e

    def _on_frame(self, link: _Link, data: bytes | str) -> None:
        if link.dead:
            return
        link.last_rx = time.monotonic()  # any frame is liveness
        link.frames_rx += 1
        if not isinstance(data, bytes):
            self._bad(link, "text message on the data channel (frames are binary)")
            return
        try:
            whole = link.reassembler.feed(data)
        except wire.WireError as e:
            msg_id = framing.frame_id(data)
            if msg_id is not None and msg_id in link.refused:
                return  # the rest of a message already reported
            if msg_id is not None:
                link.refused.append(msg_id)
            self._bad(link, f"bad frame: {e}")
            return
        if whole is None:
            return
        try:
            message = wire.decode(whole, max_len=self.max_message_bytes)
        except wire.WireError as e:
            self._bad(link, f"bad message: {e}")
            return
        if isinstance(message, wire.Heartbeat):
            return
        size = len(whole)
        if self._pending_bytes + size > self.max_pending_bytes:
            # The application is not reading; dropping this peer keeps memory bounded.
            log.warning("receive backlog over %d bytes; dropping %s", self.max_pending_bytes,
                        link.peer)
            self._drop(link, "receive backlog full")
            return
        self._emit(Received(link.peer, message), size)

    def _bad(self, link: _Link, error: str) -> None:
        link.bad += 1
        log.info("from %s: %s", link.peer, error)
        self._emit(BadMessage(link.peer, error))
        if link.bad > MAX_BAD_MESSAGES:
            self._drop(link, f"too many bad messages ({link.bad})")

    async def _heartbeat_loop(self) -> None:
        while not self._closed:
            now = time.monotonic()
            beat = wire.Heartbeat(t=time.time())
            data = wire.encode(beat)
            for link in list(self._links.values()):
                if not link.up or link.dead:
                    continue
                if now - link.last_rx > self.heartbeat_timeout:
                    self._drop(link, "heartbeat timeout")
                    continue
                hook = self.fault_drop
                if hook is not None and hook(link.peer, beat):
                    continue
                # Bypasses send_lock and backpressure: one small frame, queued behind at
                # most SEND_HIGH_WATER bytes, so it is never starved by a big transfer.
                with contextlib.suppress(Exception):  # a closing channel: the drop follows
                    assert link.channel is not None
                    link.channel.send(framing.frame(data, next(self._msg_ids))[0])
            await asyncio.sleep(self.heartbeat_interval)
