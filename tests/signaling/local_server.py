"""A real ``daisyweb-signal`` app on a free 127.0.0.1 port, with a client session: the
server the signaling tests talk to (started and stopped by each test); and
:func:`serving`, any aiohttp app on a free 127.0.0.1 port for one block. Both serve with
``signaling.guard.Runner``, as ``daisyweb-signal`` does: the app's connection caps hold."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from signaling import server
from signaling.guard import Runner
from signaling.server import REGISTRY, create_app


async def _listen(runner: web.AppRunner) -> str:
    """Start ``runner`` (set up) on a free 127.0.0.1 port: its base URL."""
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` served on a free 127.0.0.1 port while the block runs: its base URL."""
    runner = Runner(app)
    await runner.setup()
    try:
        yield await _listen(runner)
    finally:
        await runner.cleanup()


class Server:
    def __init__(self, **kw: object) -> None:
        self.app = create_app(**kw)
        self.runner = Runner(self.app)

    async def start(self) -> Server:
        await self.runner.setup()
        self.url = await _listen(self.runner)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def stop(self) -> None:
        await self.session.close()
        await self.runner.cleanup()

    async def ws(self, headers: dict | None = None, **query: str):
        return await self.session.ws_connect(self.url + "/ws", params=query, headers=headers)

    async def get(self, path: str, **params: str) -> tuple[int, object]:
        """Status and body (JSON decoded when it is JSON) of a GET."""
        async with self.session.get(self.url + path, params=params) as r:
            body = await r.json() if r.content_type == "application/json" else await r.text()
            return r.status, body

    @property
    def reg(self) -> server.Registry:
        return self.app[REGISTRY]
