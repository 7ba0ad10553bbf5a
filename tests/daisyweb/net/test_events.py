"""Tests for daisyweb.net.events: the byte-bounded event queue."""

from __future__ import annotations

import asyncio

import pytest

from daisyweb.net.events import EventQueue, MeshError, PeerDown, PeerUp


async def test_order_bytes_and_close():
    q = EventQueue(max_bytes=100)
    assert q.fits(100) and not q.fits(101)
    q.put(PeerUp("a"), 60)
    assert q.fits(40) and not q.fits(41)
    q.put(PeerDown("a", "gone"))
    assert await q.get() == PeerUp("a")
    assert q.fits(100)  # reading frees its bytes
    q.close()
    assert await q.get() == PeerDown("a", "gone")  # queued events still come out
    with pytest.raises(MeshError, match="closed"):
        await q.get()


async def test_get_waits_and_close_wakes():
    q = EventQueue(max_bytes=10)
    waiter = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.put(PeerUp("b"))
    assert await asyncio.wait_for(waiter, 1) == PeerUp("b")
    waiter = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.close()
    with pytest.raises(MeshError):
        await asyncio.wait_for(waiter, 1)
