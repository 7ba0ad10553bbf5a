"""One peer link: an ``RTCPeerConnection`` with one reliable, ordered data channel.

The connection comes from the mesh's :class:`~daisyweb.net.transport.Transport` (aiortc
or libwebrtc, same API); every session description this link signals or takes is
filtered to the ``--ice-host`` addresses first (``ice.filter_candidates``).

A :class:`Link` negotiates (offer, answer), opens its channel, and carries whole
:mod:`daisyweb.protocol.wire` messages as :mod:`daisyweb.protocol.framing` frames of at
most 48 KiB. It puts what happens on it (``PeerUp``, ``Received``, ``BadMessage``,
``PeerDown``) on the mesh's :class:`~daisyweb.net.events.EventQueue`; which peers get a
link, and when one is redialled, is the mesh's business.

Sending waits on the channel's ``bufferedAmount`` (``bufferedamountlow``) so at most
``SEND_HIGH_WATER`` bytes sit in aiortc's queue, and one message at a time goes out
per link, so messages arrive in ``send`` order. Heartbeats skip that lock: one small
frame is never stuck behind a big message.

aiortc delivers received data through a synchronous callback that cannot be paused,
so the receive side is bounded by bytes instead: reassembly holds at most
``max_message_bytes`` per in-flight message and ``max_reassembly_bytes`` in all (a peer
that would go over is dropped: ``protocol.budget``), and the event queue at most its
``max_bytes`` of received-but-unread messages; a peer that would push past that is
dropped (``PeerDown``) rather than letting memory grow. So is a peer that sends more
than ``MAX_BAD_MESSAGES`` broken messages. Any frame received counts as liveness, so a
long transfer never looks like a dead peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from daisyweb.net.events import (
    BadMessage,
    EventQueue,
    MeshError,
    PeerDown,
    PeerUp,
    Received,
)
from daisyweb.net.ice import IceSettings, filter_candidates
from daisyweb.net.transport import Transport
from daisyweb.protocol import framing, wire

__all__ = ["BeatDelay", "CHANNEL_LABEL", "Link", "MAX_BAD_MESSAGES", "SEND_HIGH_WATER",
           "SEND_LOW_WATER", "Traffic"]

log = logging.getLogger("daisyweb.net.mesh")

# Backpressure marks on a channel's bufferedAmount. High enough to keep aiortc's SCTP
# sender busy between wake-ups, low enough that a heartbeat queued behind it still
# leaves within a fraction of a second at the ~6-10 MB/s aiortc manages.
SEND_HIGH_WATER = 1 << 20
SEND_LOW_WATER = 256 << 10
CHANNEL_LABEL = "daisyweb"
# A link refusing more than this many distinct messages is a misbehaving peer: drop it.
MAX_BAD_MESSAGES = 20
# A heartbeat answer older than this is no round-trip time (the peer would be dead).
MAX_RTT_S = 60.0


class BeatDelay:
    """How much later than the fastest of the last ``window`` seconds a peer's beats
    reach us: the time they queued on the way, behind the peer's data or in our own
    backlog of frames not processed yet. A beat's age (our wall clock when we process
    it, minus the ``t`` it was sent with) also holds the offset between the two clocks,
    which the windowed minimum takes out; a wall-clock step ages out with the window."""

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self._ages: deque[tuple[float, float]] = deque()  # (when, age)

    def record(self, now: float, age: float) -> float:
        """Add a beat of ``age`` processed at ``now`` (monotonic); return its delay."""
        self._ages.append((now, age))
        while now - self._ages[0][0] > self.window:
            self._ages.popleft()
        return age - min(a for _, a in self._ages)


@dataclass
class Traffic:
    """Bytes of the frames a peer's links sent and received (data and heartbeats; not the
    SCTP, DTLS and ICE bytes around them): what the exchange costs a peer on the wire."""

    sent: int = 0
    received: int = 0


class Link:
    """The connection to one peer, from negotiation until it is dropped (once)."""

    def __init__(
        self,
        peer: str,
        session: int,
        *,
        transport: Transport,
        settings: IceSettings,
        events: EventQueue,
        max_message_bytes: int,
        max_reassembly_bytes: int,
        msg_ids: Iterator[int],
        on_drop: Callable[[Link], None],
        traffic: Traffic | None = None,
    ) -> None:
        self.peer = peer
        self.session = session  # which offer this link belongs to (stale answers are ignored)
        self._transport = transport
        self._hosts = settings.hosts
        self.pc = transport.peer_connection(settings)
        self.channel: Any = None  # the transport's RTCDataChannel
        self.up = False
        self.dead = False
        self.opened = asyncio.Event()
        self.died = asyncio.Event()
        self._events = events
        self._max_message_bytes = max_message_bytes
        self._msg_ids = msg_ids  # shared by the mesh's links: ids never repeat
        self.traffic = traffic if traffic is not None else Traffic()  # the mesh's, shared
        self._on_drop = on_drop
        self._reassembler = framing.Reassembler(max_total=max_message_bytes,
                                                max_buffered=max_reassembly_bytes)
        self._last_rx = time.monotonic()
        self._send_lock = asyncio.Lock()
        self._drained = asyncio.Event()
        self._bad = 0
        self.rtt: float | None = None  # seconds, from the last answered heartbeat
        self.delay = BeatDelay()
        self.late = 0.0  # how much later than its fastest lately the last beat came
        # The mesh's fault hook (peer, message) -> True to drop: tests silence a peer.
        self.drop_heartbeat: Callable[[str, wire.Message], bool] | None = None
        # msg_ids already reported bad: the rest of that message's frames are refused
        # too, but one broken message is one BadMessage, not one per frame.
        self._refused: deque[int] = deque(maxlen=256)
        self.pc.on("connectionstatechange", self._state_changed)
        self.pc.on("datachannel", self._channel_offered)

    @property
    def usable(self) -> bool:
        """The channel is open and the link not dropped."""
        return self.up and not self.dead

    # ------------------------------------------------------------------ negotiation

    async def offer(self) -> dict[str, Any]:
        """Offerer side: create the channel; return the offer to signal."""
        self._attach(self.pc.createDataChannel(CHANNEL_LABEL, ordered=True))
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self._local_description()

    async def answer(self, offer: dict[str, Any]) -> dict[str, Any]:
        """Answerer side: take the peer's offer; return the answer to signal."""
        await self.pc.setRemoteDescription(self._remote(offer, "offer"))
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        return self._local_description()

    async def accept(self, answer: dict[str, Any]) -> None:
        """Offerer side: take the peer's answer (ignored unless an offer is pending)."""
        if self.pc.signalingState != "have-local-offer":
            return
        await self.pc.setRemoteDescription(self._remote(answer, "answer"))

    def _remote(self, data: dict[str, Any], kind: str) -> Any:
        # Only candidates on --ice-host addresses are probed, whatever the peer sent.
        return self._transport.description(filter_candidates(str(data["sdp"]), self._hosts),
                                           kind)

    def _local_description(self) -> dict[str, Any]:
        desc = self.pc.localDescription
        # Only --ice-host candidates (and never mDNS ones) leave this machine.
        return {"sdp": filter_candidates(desc.sdp, self._hosts), "type": desc.type,
                "session": self.session}

    def _state_changed(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self.drop(f"connection {self.pc.connectionState}")

    def _channel_offered(self, channel: Any) -> None:
        if self.channel is None and channel.label == CHANNEL_LABEL:
            self._attach(channel)
        else:
            log.warning("unexpected data channel %r from %s", channel.label, self.peer)

    def _attach(self, channel: Any) -> None:
        self.channel = channel
        channel.bufferedAmountLowThreshold = SEND_LOW_WATER
        channel.on("bufferedamountlow", self._drained.set)
        channel.on("open", self._opened)
        channel.on("close", lambda: self.drop("channel closed"))
        channel.on("message", self._on_frame)
        if channel.readyState == "open":
            self._opened()

    def _opened(self) -> None:
        if self.up or self.dead:
            return
        self.up = True
        self._last_rx = time.monotonic()
        self.opened.set()
        self._events.put(PeerUp(self.peer))

    def set_limits(self, max_message_bytes: int, max_reassembly_bytes: int) -> None:
        """The run's bounds: largest message, bytes held in reassembly."""
        self._max_message_bytes = max_message_bytes
        self._reassembler.set_limits(max_message_bytes, max_reassembly_bytes)

    # ------------------------------------------------------------------ end of life

    def drop(self, reason: str) -> None:
        """Forget this link for good (idempotent); PeerDown if it had been up."""
        if self.dead:
            return
        self._die()
        self._on_drop(self)
        if self.up:
            log.info("link to %s down: %s", self.peer, reason)
            self._events.put(PeerDown(self.peer, reason))

    def abandon(self) -> None:
        """Mark dead without a PeerDown: the mesh is closing (then it calls ``close``)."""
        self._die()

    async def close(self) -> None:
        """Close the connection (after ``drop`` or ``abandon``)."""
        await self.pc.close()

    def _die(self) -> None:
        self.dead = True
        self._drained.set()  # wake blocked senders; they see ``dead`` and fail
        self.died.set()

    def check_liveness(self, now: float, timeout: float) -> bool:
        """Whether the link is usable and heard from within ``timeout``; else drop it."""
        if not self.usable:
            return False
        silent = now - self._last_rx
        if silent > timeout:
            self.drop(f"heartbeat timeout: silent {silent:.1f} s, allowed {timeout:.1f} s")
            return False
        return True

    # ------------------------------------------------------------------ sending

    async def send(self, data: bytes | tuple[bytes | memoryview, ...]) -> None:
        """Send one encoded message, or its parts (``wire.encode_parts``); waits while
        the channel buffer is full."""
        frames = framing.iter_frames(data, next(self._msg_ids))  # made as they go out
        async with self._send_lock:  # one message at a time: frames never interleave
            channel = self.channel
            assert channel is not None
            for f in frames:
                while channel.bufferedAmount > SEND_HIGH_WATER and not self.dead:
                    self._drained.clear()
                    await self._drained.wait()
                if self.dead:
                    raise MeshError(f"peer {self.peer} disconnected during send")
                try:
                    channel.send(f)
                except Exception as e:  # InvalidStateError when the channel just closed
                    raise MeshError(f"send to {self.peer} failed: {e}") from e
                self.traffic.sent += len(f)

    def send_heartbeat(self, data: bytes) -> None:
        """One encoded heartbeat, now: bypasses the send lock and backpressure.

        A single small frame, queued behind at most SEND_HIGH_WATER bytes, so it is
        never starved by a big transfer.
        """
        with contextlib.suppress(Exception):  # a closing channel: the drop follows
            assert self.channel is not None
            frame = framing.frame(data, next(self._msg_ids))[0]
            self.channel.send(frame)
            self.traffic.sent += len(frame)

    # ------------------------------------------------------------------ receiving

    def _on_frame(self, data: bytes | str) -> None:
        if self.dead:
            return
        self._last_rx = time.monotonic()  # any frame is liveness
        self.traffic.received += len(data)
        if not isinstance(data, bytes):
            self._report_bad("text message on the data channel (frames are binary)")
            return
        try:
            whole = self._reassembler.feed(data)
        except framing.BudgetExceeded as e:
            # More in reassembly than any honest peer of this run sends at once.
            self.drop(f"reassembly budget exceeded: {e}")
            return
        except wire.WireError as e:
            msg_id = framing.frame_id(data)
            if msg_id is not None and msg_id in self._refused:
                return  # the rest of a message already reported
            if msg_id is not None:
                self._refused.append(msg_id)
            self._report_bad(f"bad frame: {e}")
            return
        if whole is None:
            return
        try:
            message = wire.decode(whole, max_len=self._max_message_bytes)
        except wire.WireError as e:
            self._report_bad(f"bad message: {e}")
            return
        if isinstance(message, wire.Heartbeat):
            self._heartbeat(message)
            return
        size = len(whole)
        if not self._events.fits(size):
            # The application is not reading; dropping this peer keeps memory bounded.
            log.warning("receive backlog over %d bytes; dropping %s", self._events.max_bytes,
                        self.peer)
            self.drop("receive backlog full")
            return
        self._events.put(Received(self.peer, message), size)

    def _heartbeat(self, beat: wire.Heartbeat) -> None:
        """Answer a beat at once; an answer to ours gives the round-trip time. Either
        tells how late the peer's frames reach us (:class:`BeatDelay`)."""
        self.late = self.delay.record(time.monotonic(), time.time() - beat.t)
        if beat.echo == 0.0:
            answer = wire.Heartbeat(t=time.time(), echo=beat.t)
            if self.drop_heartbeat is None or not self.drop_heartbeat(self.peer, answer):
                self.send_heartbeat(wire.encode(answer))
            return
        rtt = time.time() - beat.echo
        if 0.0 <= rtt <= MAX_RTT_S:  # a wall-clock step (or a forged echo) is no sample
            self.rtt = rtt

    def _report_bad(self, error: str) -> None:
        self._bad += 1
        log.info("from %s: %s", self.peer, error)
        self._events.put(BadMessage(self.peer, error))
        if self._bad > MAX_BAD_MESSAGES:
            self.drop(f"too many bad messages ({self._bad})")
