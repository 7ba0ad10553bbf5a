"""Peer mesh: one data channel to every member of a signaling group.

:class:`Mesh` is the whole interface the rest of the peer uses (it has no aiortc in
it): ``start``, ``next_event``, ``connected``, ``send``, ``report_status``,
``host_link``, ``close``, ``self_id``, and ``async with``. What the application sees
is a stream of :data:`~daisyweb.net.events.MeshEvent`.

The pieces behind it, one module each:

* :mod:`daisyweb.net.events`: the events, the errors, and the byte-bounded event queue.
* :mod:`daisyweb.net.signaling_client`: join and admission, members, host approval,
  relay of offers and answers, status reports (through :mod:`signaling.protocol`).
* :mod:`daisyweb.net.link`: one ``RTCPeerConnection`` and its channel: framing,
  backpressure, reassembly, receive bounds, misbehaving peers, liveness.
* :mod:`daisyweb.net.ice`: which ICE candidates are gathered and signaled, ICE servers.
* :mod:`daisyweb.net.transport`: which WebRTC implementation (aiortc or libwebrtc).

This module decides who connects to whom. The lower peer id (string compare) always
offers, so two peers never offer to each other (no glare); when a link dies while both
are still members, the offerer dials again with backoff and the answerer replaces its
old connection with the newest offer. A heartbeat goes on every link every
``heartbeat_interval``; a link not heard from within its timeout is dropped. The timeout
fits what is measured (:func:`link_timeout`): ``heartbeat_timeout``, longer for a peer
whose round trips are slow (its event loop is busy), plus however long our own event
loop stalled lately (:class:`StallMeter`): while we were blocked (sending snapshots to
many joiners on a starved CPU), the peers' messages waited for us, not the other way.

Fault injection: :attr:`Mesh.drop_outgoing` is the one hook (tests set it from code,
never from the wire).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from daisyweb.net import ice
from daisyweb.net.events import (
    BadMessage,
    EventQueue,
    JoinDenied,
    JoinTimeout,
    Members,
    MeshError,
    MeshEvent,
    PeerDown,
    PeerUp,
    Received,
)
from daisyweb.net.link import Link, Traffic
from daisyweb.net.signaling_client import Approve, SignalingClient
from daisyweb.net.tasks import TaskSet, cancel, reap
from daisyweb.net.transport import Transport, choose
from daisyweb.protocol import wire

# The events and errors are re-exported for callers that import this module; new code
# imports them from the package, ``daisyweb.net``.
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
    "StallMeter",
    "link_timeout",
]

log = logging.getLogger("daisyweb.net.mesh")

CONNECT_TIMEOUT = 15.0
RECONNECT_BACKOFF = (0.2, 5.0)
RTT_FACTOR = 4.0  # a link may be silent this many of its round trips...
MAX_STRETCH = 6.0  # ...but never longer than this many base timeouts (a dead peer goes)


def link_timeout(base: float, rtt: float | None, stall: float, late: float = 0.0) -> float:
    """How long a link may stay silent before it is dropped: ``base``, or ``RTT_FACTOR``
    of its last round trip if that is longer (capped at ``MAX_STRETCH x base``), plus
    ``stall``, the longest our own event loop was blocked lately, plus ``late``, how
    late beats reached us lately (``link.BeatDelay``: frames queued behind data or in
    our own backlog; capped at ``MAX_STRETCH x base``, so a dead peer still goes)."""
    slow = min(RTT_FACTOR * rtt, MAX_STRETCH * base) if rtt is not None else 0.0
    return max(base, slow) + stall + min(max(0.0, late), MAX_STRETCH * base)


class StallMeter:
    """How late a periodic task woke up, over a sliding window: the longest recent stall
    of the event loop it runs on."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._samples: deque[tuple[float, float]] = deque()  # (when, how late)
        self.longest = 0.0  # the longest stall of the run (the end record reports it)

    def record(self, now: float, late: float) -> None:
        self._samples.append((now, max(0.0, late)))
        self.longest = max(self.longest, late)
        while self._samples and now - self._samples[0][0] > self.window:
            self._samples.popleft()

    def recent(self) -> float:
        return max((late for _, late in self._samples), default=0.0)

# (peer, message) -> True to drop that outgoing message silently.
DropOutgoing = Callable[[str, wire.Message], bool]


class Mesh:
    """A full mesh of data channels to the members of one signaling group."""

    # The fault-injection hook: called with (peer, message) before each send,
    # heartbeats included; True drops that message silently. Set by code only.
    drop_outgoing: DropOutgoing | None

    def __init__(
        self,
        server: str,
        *,
        room: str | None = None,
        name: str = "peer",
        approve: Approve | None = None,
        ice_hosts: Sequence[str] | None = None,
        stun: Sequence[str] = (),
        turn: Sequence[ice.IceServer] = (),
        relay_only: bool = False,
        transport: str | Transport = "aiortc",
        join_timeout: float = 60.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 5.0,
        max_message_bytes: int = 256 * 2**20,
        max_pending_bytes: int | None = None,
        max_reassembly_bytes: int | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        if heartbeat_interval <= 0 or heartbeat_timeout <= heartbeat_interval:
            raise ValueError("need 0 < heartbeat_interval < heartbeat_timeout")
        if max_message_bytes < 1:
            raise ValueError("max_message_bytes must be >= 1")
        self._signaling = SignalingClient(
            server,
            room=room,
            name=name,
            approve=approve,
            join_timeout=join_timeout,
            on_members=self._on_members,
            on_signal=self._on_signal,
        )
        hosts = list(ice_hosts) if ice_hosts is not None else ice.hosts_from_env()
        servers = (*(ice.IceServer(u) for u in stun), *turn)
        self._ice = ice.IceSettings(ice.normalize_hosts(hosts), tuple(servers), relay_only)
        # TransportError (wrtc missing) surfaces here, before anything connects.
        self.transport = choose(transport) if isinstance(transport, str) else transport
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_timeout = heartbeat_timeout
        self.stalls = StallMeter(2 * heartbeat_timeout)  # our loop's lateness, measured
        self.beats_late = StallMeter(2 * heartbeat_timeout)  # beats' queueing, measured
        self._max_message_bytes = max_message_bytes
        # Until the run is known (limit_messages), one message of the cap at a time per
        # link, and one more starting: 2 x 256 MiB, not the reassembler's default 64 x.
        self._max_reassembly_bytes = (max_reassembly_bytes if max_reassembly_bytes is not None
                                      else 2 * max_message_bytes)
        self._connect_timeout = connect_timeout
        self.drop_outgoing = None

        self._events = EventQueue(
            max_pending_bytes if max_pending_bytes is not None else 2 * max_message_bytes
        )
        self._links: dict[str, Link] = {}
        self._dialers: dict[str, asyncio.Task[None]] = {}
        self._tasks = TaskSet()
        self._heartbeat: asyncio.Task[None] | None = None
        self._msg_ids = itertools.count(1)
        self.traffic = Traffic()  # every link's frames, this run
        self._sessions = itertools.count(1)
        self._started = False
        self._closed = False

    @property
    def self_id(self) -> str:
        """Our peer id, assigned by the signaling server ("" before ``start``)."""
        return self._signaling.self_id

    @property
    def signaling_up(self) -> bool:
        """Whether our signaling socket is open: once the server dropped us (we did not
        answer its pings, paused), no new link can be signaled and we are no member."""
        return self._signaling.up

    @property
    def members(self) -> tuple[str, ...]:
        """The signaling server's approved members of our group (ids in server order)."""
        return self._signaling.members

    # ------------------------------------------------------------------ interface

    async def start(self) -> None:
        """Join the group and wait until admitted; links then come up in the background."""
        if self._started:
            raise MeshError("start() called twice")
        self._started = True
        # The one place process-wide ICE set-up lives (aioice's addresses, libwebrtc's
        # loopback switch); each link filters what it signals to the same hosts.
        self.transport.prepare(self._ice)
        try:
            await self._signaling.join()
        except BaseException:
            await self.close()
            raise
        self._heartbeat = asyncio.create_task(self._heartbeat_loop())

    async def next_event(self) -> MeshEvent:
        """The next event, in arrival order; waits for one. MeshError once closed."""
        return await self._events.get()

    def connected(self) -> list[str]:
        """Peers whose channel is open, in member order."""
        order = {m: i for i, m in enumerate(self._signaling.members)}
        up = [p for p, link in self._links.items() if link.usable]
        return sorted(up, key=lambda p: (order.get(p, len(order)), p))

    async def send(self, peer: str, message: wire.Message) -> None:
        """Send one message to ``peer`` (waits while its channel buffer is full)."""
        # A snapshot's payload is framed from its own buffer, not copied into the message.
        data = wire.encode_parts(message)
        size = sum(len(part) for part in data)
        if size > self._max_message_bytes:
            raise MeshError(
                f"{message.type} message is {size} bytes, over max_message_bytes "
                f"{self._max_message_bytes}"
            )
        link = self._links.get(peer)
        if link is None or not link.usable:
            raise MeshError(f"peer {peer} is not connected")
        if self._dropped(peer, message):
            return
        await link.send(data)

    def limit_messages(self, max_message_bytes: int, max_reassembly_bytes: int) -> None:
        """Bound every link, now and later, by this run's largest legal message and its
        reassembly budget (``protocol.budget``); never above the mesh's own cap."""
        self._max_message_bytes = min(max_message_bytes, self._max_message_bytes)
        self._max_reassembly_bytes = max_reassembly_bytes
        for link in self._links.values():
            link.set_limits(self._max_message_bytes, max_reassembly_bytes)

    async def report_status(self, **fields: Any) -> None:
        """Send ``{"type": "status", **fields}`` to the signaling server (the dashboard).

        Reports closer together than STATUS_MIN_INTERVAL are coalesced (the latest wins),
        so a fast training loop cannot trip the server's rate limit.
        """
        await self._signaling.report_status(fields)

    def link_rtts(self) -> dict[str, float | None]:
        """Each usable link's round-trip time in seconds (None until a heartbeat was
        answered), by peer id: the dashboard's link matrix."""
        return {p: link.rtt for p, link in self._links.items() if link.usable}

    def host_link(self) -> str | None:
        """The host's dashboard approval link, once the server sent a host key."""
        return self._signaling.host_link()

    def member_link(self) -> str | None:
        """This member's dashboard view of a private room, once admitted."""
        return self._signaling.member_link()

    async def close(self) -> None:
        """Close every connection and the signaling socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._events.close()
        tasks = cancel([self._heartbeat, *self._dialers.values(), *self._tasks])
        self._signaling.stop()
        links = list(self._links.values())
        self._links.clear()
        for link in links:
            link.abandon()
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
        await self._signaling.close()
        await reap(tasks)

    async def __aenter__(self) -> Mesh:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ who dials whom

    def _on_members(self, old: tuple[str, ...], changed: bool) -> None:
        members, host = self._signaling.members, self._signaling.host
        if changed:
            self._events.put(Members(members, host))
        for peer in set(old) - set(members):
            task = self._dialers.pop(peer, None)
            if task is not None:
                task.cancel()
            link = self._links.get(peer)
            if link is not None:
                link.drop("left signaling")
        me = self.self_id
        for peer in members:
            # Fixed rule: the lower id offers, so exactly one side dials.
            if peer != me and me < peer and peer not in self._dialers:
                self._dialers[peer] = asyncio.create_task(self._dial(peer))

    def _new_link(self, peer: str, session: int, replacing: str) -> Link:
        """A new link to ``peer``; an older one is dropped with reason ``replacing``."""
        link = Link(
            peer,
            session,
            transport=self.transport,
            settings=self._ice,
            events=self._events,
            max_message_bytes=self._max_message_bytes,
            max_reassembly_bytes=self._max_reassembly_bytes,
            msg_ids=self._msg_ids,
            on_drop=self._forget,
            traffic=self.traffic,
        )
        link.drop_heartbeat = self._dropped  # its heartbeat answers obey the fault hook too
        old = self._links.get(peer)
        if old is not None:
            old.drop(replacing)
        self._links[peer] = link
        return link

    def _forget(self, link: Link) -> None:
        """A link was dropped: it is no longer ``peer``'s link; close its connection."""
        if self._links.get(link.peer) is link:
            del self._links[link.peer]
        if not self._closed:
            self._tasks.spawn(link.close())

    async def _dial(self, peer: str) -> None:
        """Offerer side: keep one link to ``peer`` while it is a member."""
        backoff = RECONNECT_BACKOFF[0]
        while not self._closed and peer in self._signaling.members:
            link = self._new_link(peer, next(self._sessions), "replaced")
            try:
                offer = await link.offer()
                await self._signaling.send_signal(peer, "offer", offer)
                await asyncio.wait_for(link.opened.wait(), self._connect_timeout)
            except asyncio.TimeoutError:
                log.info("no channel to %s within %g s; retrying", peer, self._connect_timeout)
                link.drop("connect timeout")
            except MeshError as e:
                log.warning("cannot signal %s: %s", peer, e)
                link.drop("signaling failed")
            except Exception as e:  # aiortc refusing an offer: retry, never kill the dialer
                log.warning("offer to %s failed: %r", peer, e)
                link.drop("offer failed")
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
            try:
                await link.accept(data)
            except Exception as e:  # a broken answer fails this attempt only
                log.warning("bad answer from %s: %s", peer, e)
                link.drop("bad answer")
        else:
            log.debug("ignoring %s signal from %s (non-trickle)", kind, peer)

    async def _answer(self, peer: str, offer: dict[str, Any]) -> None:
        """Answerer side: the newest offer from ``peer`` replaces any older link."""
        link = self._new_link(peer, int(offer.get("session", 0)), "replaced by a new offer")
        try:
            answer = await link.answer(offer)
        except Exception as e:
            log.warning("bad offer from %s: %s", peer, e)
            link.drop("bad offer")
            return
        if link.dead:
            return
        await self._signaling.send_signal(peer, "answer", answer)
        self._tasks.spawn(self._expire(link))

    async def _expire(self, link: Link) -> None:
        try:
            await asyncio.wait_for(link.opened.wait(), self._connect_timeout)
        except asyncio.TimeoutError:
            link.drop("connect timeout")

    # ------------------------------------------------------------------ liveness

    def _dropped(self, peer: str, message: wire.Message) -> bool:
        hook = self.drop_outgoing
        return hook is not None and hook(peer, message)

    async def _heartbeat_loop(self) -> None:
        due = time.monotonic()
        while not self._closed:
            now = time.monotonic()
            self.stalls.record(now, now - due)
            stall = self.stalls.recent()
            # A backlog of frames we have not processed delays every link's beats alike
            # (a starved leader of 32 peers heard nothing for 7 s from live members).
            self.beats_late.record(now, max((link.late for link in self._links.values()
                                             if link.usable), default=0.0))
            late = self.beats_late.recent()
            beat = wire.Heartbeat(t=time.time())
            data = wire.encode(beat)
            for link in list(self._links.values()):
                timeout = link_timeout(self._heartbeat_timeout, link.rtt, stall, late)
                if link.check_liveness(now, timeout) and not self._dropped(link.peer, beat):
                    link.send_heartbeat(data)
            due = now + self._heartbeat_interval
            await asyncio.sleep(self._heartbeat_interval)
