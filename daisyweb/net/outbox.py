"""Per-peer ordered outboxes: each peer's messages leave from its own queue and task.

A slow peer never blocks the caller. The first message on a newly connected link goes
ahead of anything held for it (the peer's Hello); a peer whose link is not up yet gets
a few messages held (bounded: repair covers anything beyond); :meth:`Outboxes.drain`
lets queued messages leave before the mesh closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from daisyweb.protocol import wire

__all__ = ["DRAIN_S", "LINGER_S", "PENDING_PER_PEER", "Outboxes"]

DRAIN_S = 5.0
LINGER_S = 0.3
PENDING_PER_PEER = 16  # messages held for a peer whose channel is not up yet

Send = Callable[[str, wire.Message], Awaitable[None]]


class Outboxes:
    """The connected peers (in connection order) and one ordered queue for each."""

    def __init__(self, send: Send, on_error: Callable[[str], None]) -> None:
        self._send = send
        self._on_error = on_error  # one line for a failed send (the link's heartbeat decides)
        self.connected: list[str] = []
        self._boxes: dict[str, asyncio.Queue[wire.Message]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}

    def up(self, peer: str, first: wire.Message) -> None:
        """The link to ``peer`` is open: ``first`` leaves ahead of anything held."""
        if peer not in self.connected:
            self.connected.append(peer)
        box = self._boxes.setdefault(peer, asyncio.Queue())
        if peer not in self._senders:
            held = [box.get_nowait() for _ in range(box.qsize())]
            for _ in held:
                box.task_done()
            box.put_nowait(first)
            for m in held:
                box.put_nowait(m)
            self._senders[peer] = asyncio.create_task(self._sender(peer, box))

    def down(self, peer: str) -> None:
        """The link to ``peer`` is gone: what was queued for it is dropped."""
        if peer in self.connected:
            self.connected.remove(peer)
        self._boxes.pop(peer, None)
        task = self._senders.pop(peer, None)
        if task is not None:
            task.cancel()

    def put(self, to: tuple[str, ...] | None, msg: wire.Message) -> None:
        """Queue ``msg`` for ``to`` (None: every connected peer)."""
        for p in self.connected if to is None else to:
            box = self._boxes.get(p)
            if box is None:
                # A roster member whose channel to us is not up yet: hold a few
                # messages for it (bounded); repair covers anything beyond.
                box = self._boxes[p] = asyncio.Queue()
            if p not in self._senders and box.qsize() >= PENDING_PER_PEER:
                box.get_nowait()
                box.task_done()
            box.put_nowait(msg)

    async def _sender(self, peer: str, box: asyncio.Queue[wire.Message]) -> None:
        while True:
            msg = await box.get()
            try:
                await self._send(peer, msg)
            except Exception as exc:  # a dead channel: the heartbeat will report it
                self._on_error(f"send to {peer} failed: {type(exc).__name__}: {exc}")
            finally:
                box.task_done()

    async def drain(self, timeout: float = DRAIN_S) -> None:
        """Let queued messages (a Halt, the last hashes) leave before the mesh closes."""
        boxes = [b for p, b in self._boxes.items() if p in self._senders]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(b.join() for b in boxes)), timeout)
        # The channel still holds what send() handed it; give it a moment to go out.
        await asyncio.sleep(LINGER_S)

    def tasks(self) -> list[asyncio.Task[None]]:
        """The sender tasks (one per connected peer), for the owner to cancel at the end."""
        return list(self._senders.values())
