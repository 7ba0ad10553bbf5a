"""Background tasks of the network objects: spawned, logged on failure, cancelled on close."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterable, Iterator
from typing import Any

__all__ = ["TaskSet", "cancel", "reap"]

log = logging.getLogger("daisyweb.net.mesh")


class TaskSet:
    """Fire-and-forget tasks kept referenced until done; a failure is logged, not lost."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def __iter__(self) -> Iterator[asyncio.Future[Any]]:
        return iter(list(self._tasks))

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("mesh task failed: %r", task.exception())


def cancel(tasks: Iterable[asyncio.Future[Any] | None]) -> list[asyncio.Future[Any]]:
    """Cancel the unfinished ones (never the calling task); return all but it, for reap."""
    me = asyncio.current_task()
    out = [t for t in tasks if t is not None and t is not me]
    for t in out:
        if not t.done():
            t.cancel()
    return out


async def reap(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Wait for cancelled tasks to finish, ignoring how they ended."""
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t
