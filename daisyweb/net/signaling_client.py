"""The WebSocket client to the signaling server (``docs/protocol.md``).

:class:`SignalingClient` joins a group and waits until it is admitted, keeps the
member list, relays WebRTC offers and answers, and sends status reports (coalesced to
at most one per ``STATUS_MIN_INTERVAL``). On the host of a private room it also answers
waiting peers: through the ``approve`` callback, or the dashboard's decision when that
comes first. Every message is built and parsed by :mod:`signaling.protocol`.

How the host admits is the room's, not this peer's: on becoming host the client states
its own mode (``approve`` None is ``auto``, a callback ``ask``) in a ``policy`` message
and applies the mode the server answers with, which is the room's first host's. So a
peer that inherits an ``auto`` room admits everyone even with a callback, and one that
inherits an ``ask`` room without a callback admits nobody by itself: its dashboard link
decides (``decision`` messages), as for any host without a terminal.

It knows nothing of links: the mesh hears of member changes and relayed signals
through the two callbacks it passes in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidStatus,
    InvalidURI,
    WebSocketException,
)
from websockets.protocol import State

from daisyweb.net.events import JoinDenied, JoinTimeout, MeshError
from daisyweb.net.tasks import TaskSet, cancel, reap
from signaling import protocol

__all__ = ["SignalingClient", "ws_url", "STATUS_MIN_INTERVAL"]

log = logging.getLogger("daisyweb.net.mesh")

# The server allows 50 messages/s per connection and closes it after 20 errors, so
# status reports (the only frequent client message) are coalesced to at most 10/s.
STATUS_MIN_INTERVAL = 0.1
# What the server may send in one message (peer lists are its largest): 4 MiB, aiohttp's
# client default, far above any list a room holds.
MAX_RECEIVE_BYTES = 4 * 1024 * 1024

Approve = Callable[[str, str], Awaitable[bool]]
# (previous member ids, whether members or host changed); the new ones are on the client
MembersChanged = Callable[[tuple[str, ...], bool], None]
# (sender, kind, data) of a relayed offer/answer/candidate
SignalReceived = Callable[[str, str, dict[str, Any]], Awaitable[None]]


def ws_url(server: str) -> str:
    """Accept http(s):// or ws(s)://, with or without the /ws path."""
    parts = urlsplit(server if "://" in server else "http://" + server)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"signaling server URL must be http(s) or ws(s), got {server!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/ws"):
        path += "/ws"
    return urlunsplit((scheme, parts.netloc, path, "", ""))


class SignalingClient:
    """One signaling connection: admission, members, approval, relay and status."""

    def __init__(
        self,
        server: str,
        *,
        room: str | None,
        name: str,
        approve: Approve | None,
        join_timeout: float,
        on_members: MembersChanged,
        on_signal: SignalReceived,
    ) -> None:
        self.server = server
        self.url = ws_url(server)
        self.room = room
        self.name = name
        self.approve = approve
        self.join_timeout = join_timeout
        self._on_members = on_members
        self._on_signal = on_signal

        self.self_id = ""
        self.group: str | None = None
        self.host: str | None = None
        self.members: tuple[str, ...] = ()
        self.host_key: str | None = None
        self.member_key: str | None = None  # our own (read-only) dashboard view of the room
        # The room's approval mode as the server last told this host (None: not told yet).
        self.room_approve: str | None = None
        self.up = False  # the socket is open and being read

        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._admitted: asyncio.Future[None] | None = None
        self._waiting: dict[str, str] = {}
        self._deciding: dict[str, asyncio.Task[None]] = {}
        self._decided: set[str] = set()
        self._on_dashboard: set[str] = set()  # waiting peers only the dashboard may admit
        self._status_last = 0.0
        self._status_pending: dict[str, Any] | None = None
        self._status_task: asyncio.Task[None] | None = None
        self._tasks = TaskSet()
        self._cancelled: list[asyncio.Future[Any]] = []
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def join(self) -> None:
        """Connect and wait until admitted. The caller closes the client on failure."""
        params = {"name": self.name}
        if self.room is not None:
            params["room"] = self.room
        loop = asyncio.get_running_loop()
        self._admitted = loop.create_future()
        deadline = loop.time() + self.join_timeout
        try:
            self._ws = await asyncio.wait_for(self._connect(params), self.join_timeout)
        except asyncio.TimeoutError:
            raise JoinTimeout(
                f"could not reach the signaling server {self.server} "
                f"within {self.join_timeout:g} s"
            ) from None
        except InvalidStatus as e:
            res = e.response  # the server's reason is its body (aiohttp's text=...)
            why = res.body.decode("utf-8", "replace").strip()[:200] or res.reason_phrase
            raise MeshError(
                f"signaling server refused the connection: {res.status_code} {why}"
            ) from e
        except (InvalidHandshake, InvalidURI, OSError) as e:
            raise MeshError(f"cannot connect to signaling server {self.server}: {e}") from e
        self.up = True
        self._reader = asyncio.create_task(self._read())
        try:
            await asyncio.wait_for(
                asyncio.shield(self._admitted), max(0.0, deadline - loop.time())
            )
        except asyncio.TimeoutError:
            raise JoinTimeout(
                f"not admitted to {self._where()} within {self.join_timeout:g} s "
                "(the host has not approved this peer)"
            ) from None

    async def _connect(self, params: dict[str, str]) -> ClientConnection:
        # The websockets client, not aiohttp's: a peer then never imports aiohttp on the
        # built-in corpus (~9 MB resident, docs/limits.md section 1). No proxy from the
        # environment, no compression, no client pings (the server pings; a dead socket is
        # seen by the links' own heartbeats).
        return await connect(
            f"{self.url}?{urlencode(params)}", proxy=None, compression=None,
            open_timeout=None, ping_interval=None, max_size=MAX_RECEIVE_BYTES,
        )

    def _open(self) -> bool:
        return self._ws is not None and self._ws.state is State.OPEN

    def stop(self) -> None:
        """Cancel every task of this client at once (no awaiting); ``close`` finishes."""
        self._closed = True
        tasks = [self._reader, self._status_task, *self._deciding.values(), *self._tasks]
        self._cancelled += cancel(tasks)

    async def close(self) -> None:
        """Stop, close the socket, and wait for the tasks."""
        self.stop()
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()
        cancelled, self._cancelled = self._cancelled, []
        await reap(cancelled)

    # ------------------------------------------------------------------ sending

    async def send_signal(self, to: str, kind: str, data: dict[str, Any]) -> None:
        """Relay an offer/answer to member ``to``. MeshError if it cannot be sent."""
        await self._send(protocol.signal(to, kind, data))

    async def report_status(self, fields: dict[str, Any]) -> None:
        """Send a status report now, or coalesce it into one sent shortly (latest wins)."""
        if not self._open():
            raise MeshError("not connected to the signaling server")
        now = time.monotonic()
        if self._status_task is None and now - self._status_last >= STATUS_MIN_INTERVAL:
            self._status_last = now
            await self._send(protocol.status(fields))
            return
        self._status_pending = fields
        if self._status_task is None:
            delay = STATUS_MIN_INTERVAL - (now - self._status_last)
            self._status_task = asyncio.create_task(self._flush_status(delay))

    def host_link(self) -> str | None:
        """The host's dashboard approval link, once the server sent a host key."""
        if self.host_key is None:
            return None
        return self._room_link("key", self.host_key)

    def member_link(self) -> str | None:
        """This member's own view of a private room's dashboard (no Accept/Deny)."""
        if self.member_key is None:
            return None
        return self._room_link("member", self.member_key)

    def _room_link(self, name: str, secret: str) -> str | None:
        if self.room is None:
            return None
        parts = urlsplit(self.url)
        scheme = "https" if parts.scheme == "wss" else "http"
        return f"{scheme}://{parts.netloc}/?room={self.room}&{name}={secret}"

    async def _send(self, msg: dict[str, Any]) -> None:
        ws = self._ws
        if ws is None or not self._open():
            raise MeshError("not connected to the signaling server")
        try:
            await ws.send(json.dumps(msg))
        except (ConnectionError, RuntimeError, WebSocketException) as e:
            raise MeshError(f"signaling send failed: {e}") from e

    async def _flush_status(self, delay: float) -> None:
        try:
            await asyncio.sleep(max(0.0, delay))
            fields, self._status_pending = self._status_pending, None
            self._status_last = time.monotonic()
            if fields is not None:
                await self._send(protocol.status(fields))
        except MeshError as e:
            log.warning("status report dropped: %s", e)
        finally:
            self._status_task = None

    # ------------------------------------------------------------------ receiving

    def _where(self) -> str:
        return f"room {self.room!r}" if self.room else "the group"

    def _admit(self, exc: BaseException | None = None) -> None:
        fut = self._admitted
        if fut is not None and not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
                fut.exception()  # mark retrieved: join() may already have timed out

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for raw in self._ws:
                if not isinstance(raw, str):  # the protocol is JSON text only
                    break
                try:
                    msg = json.loads(raw)
                except ValueError:
                    log.warning("signaling sent non-JSON: %.80r", raw)
                    continue
                if not isinstance(msg, dict):
                    log.warning("signaling sent a non-object: %.80r", msg)
                    continue
                try:
                    await self._handle(msg)
                except (KeyError, TypeError, ValueError, MeshError) as e:
                    # One bad or unanswerable message must not stop the reader
                    # (protocol.ProtocolError is a ValueError).
                    log.warning("%r message from signaling failed: %s", msg.get("type"), e)
        except asyncio.CancelledError:
            raise
        except ConnectionClosed:
            pass  # said below, with its code
        except Exception as e:  # a broken socket must not kill the mesh's links
            log.warning("signaling connection error: %s", e)
        finally:
            self.up = False
            code = self._ws.close_code if self._ws is not None else None
            self._admit(MeshError(f"signaling connection closed before admission (code {code})"))
            if not self._closed:
                log.warning("signaling connection closed (code %s); links stay up", code)

    async def _handle(self, raw: dict[str, Any]) -> None:
        msg = protocol.parse_server(raw)
        if isinstance(msg, protocol.Welcome):
            self.self_id = msg.id
            self.group = msg.group
            self.host = msg.host
            self.member_key = msg.member_key or self.member_key
            if msg.member:
                self._admit()  # members come in the ``peers`` broadcast that follows
            else:
                log.info("waiting for the host to approve %s", self.self_id)
        elif isinstance(msg, protocol.Approved):
            self.member_key = msg.member_key or self.member_key
            self._admit()
        elif isinstance(msg, protocol.Denied):
            self._admit(JoinDenied(f"the host of {self._where()} denied this peer"))
        elif isinstance(msg, protocol.PeerList):
            self._on_peers(msg)
        elif isinstance(msg, protocol.Waiting):
            self._on_waiting(msg)
        elif isinstance(msg, protocol.Decision):
            await self._on_decision(msg.id, msg.approve)
        elif isinstance(msg, protocol.HostKey):
            self.host_key = msg.key  # sent exactly when this peer becomes host
            if self.room_approve is None:
                await self._propose_policy()
        elif isinstance(msg, protocol.Policy):
            self._on_policy(msg.approve)
        elif isinstance(msg, protocol.Relayed):
            await self._on_signal(msg.sender, msg.kind, msg.data)
        elif isinstance(msg, protocol.Refused):
            log.warning("signaling error %s: %s", msg.code, msg.message)
        else:
            log.debug("ignoring signaling message type %r", msg.type)

    def _on_peers(self, msg: protocol.PeerList) -> None:
        members = tuple(pid for pid, _ in msg.peers)
        changed = (members, msg.host) != (self.members, self.host)
        old = self.members
        self.members, self.host = members, msg.host
        self._on_members(old, changed)

    # ------------------------------------------------------------------ host approval

    @property
    def own_approve(self) -> str:
        """This peer's own mode: ``auto`` without a callback, else ``ask``."""
        return "auto" if self.approve is None else "ask"

    @property
    def approve_mode(self) -> str:
        """How this peer admits while it hosts: the room's mode once the server said it,
        its own until then (a first host's own mode is the room's)."""
        return self.room_approve or self.own_approve

    async def _propose_policy(self) -> None:
        try:
            await self._send(protocol.policy(self.own_approve))
        except MeshError as e:
            log.warning("could not send the room's approval mode: %s", e)

    def _on_policy(self, mode: str) -> None:
        if mode == self.room_approve:
            return
        self.room_approve = mode
        if mode != self.own_approve:
            log.warning("this room admits with --approve %s (its first host's choice), "
                        "not this peer's --approve %s", mode, self.own_approve)
        self._review_waiting()  # peers already waiting are decided by the room's mode

    def _on_waiting(self, msg: protocol.Waiting) -> None:
        self._waiting = dict(msg.peers)
        for pid, task in list(self._deciding.items()):
            if pid not in self._waiting:  # left, or decided elsewhere
                task.cancel()
                del self._deciding[pid]
        self._decided &= set(self._waiting)
        self._on_dashboard &= set(self._waiting)
        self._review_waiting()

    def _review_waiting(self) -> None:
        for pid, name in self._waiting.items():
            if pid in self._decided:
                continue
            if self.approve_mode == "auto":
                task = self._deciding.pop(pid, None)
                if task is not None:  # the room admits everyone: no prompt to wait for
                    task.cancel()
                self._decided.add(pid)
                self._tasks.spawn(self._send(protocol.decision(pid, True)))
            elif pid in self._deciding or pid in self._on_dashboard:
                continue
            elif self.approve is None:
                # An ask room inherited by a peer with no prompt: it never admits by
                # itself; the host's dashboard link decides (_on_decision).
                self._on_dashboard.add(pid)
                log.warning("%s (%s) is waiting: this room asks; accept or deny on "
                            "this host's dashboard link", pid, name)
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
            await self._send(protocol.decision(pid, ok))
        except MeshError as e:
            log.warning("could not send decision for %s: %s", pid, e)
