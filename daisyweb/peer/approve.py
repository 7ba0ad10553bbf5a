"""The host's approval prompt: who may join this peer's room (``--approve ask|auto``)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

from daisyweb.peer.options import log

__all__ = ["Ask", "approve_callback"]

Ask = Callable[..., Awaitable[bool]]


def approve_callback(approve: str, host_link: Callable[[], str | None]) -> Ask | None:
    """None for ``auto`` (the mesh admits everyone with the code); else a prompt.

    Either is only this peer's proposal: a peer that inherits hosting applies the room's
    mode (its first host's), which the signaling client learns from the server.

    The prompt asks on the terminal; with no terminal, the dashboard (``host_link``)
    decides, and the mesh cancels the wait when its decision arrives.
    """
    if approve == "auto":
        return None

    async def ask(*who: object) -> bool:
        label = " ".join(str(w) for w in who if w)
        prompt = f"daisyweb-peer: admit {label or 'a waiting peer'}? [y/N] "
        if not sys.stdin or not sys.stdin.isatty():
            if host_link() is None:
                log(f"refusing {label}: --approve ask needs a terminal or the dashboard")
                return False
            # No terminal: the dashboard decides; the mesh cancels this wait when
            # the decision arrives.
            log(f"{label} is waiting: accept or deny on the dashboard")
            await asyncio.Event().wait()
        answer = await asyncio.get_running_loop().run_in_executor(None, input, prompt)
        return answer.strip().lower() in ("y", "yes")

    return ask
