"""What keeps clients from taking the signaling server's descriptors or flooding its log.

* :class:`ConnectionGuard` counts every TCP connection the server holds (HTTP, WebSocket,
  idle keep-alive) by client address and in all. A connection over ``max_per_address``
  or ``max_total`` is answered ``503`` and closed at once, so the server never runs out
  of descriptors: ``max_total`` defaults to :func:`connection_limit`, at most three
  quarters of ``RLIMIT_NOFILE``, the rest left for files, the Hub reader, the listening
  socket and the connections asyncio accepts before the guard can refuse them.
  With ``--trust-proxy`` every connection comes from the proxy, so only the total is
  capped here (the WebSocket cap per forwarded address still holds).
* It also aborts a connection whose unsent bytes have not drained for ``write_timeout``
  seconds (a client that does not read); :func:`write_deadline` does the same for an HTTP
  response not written in that time (a static file goes out by ``sendfile``, which holds
  no bytes in the transport to watch). aiohttp's ``keepalive_timeout`` (the app's
  ``idle_timeout``) closes a connection that sends no request.
* :class:`LogLimiter` lets at most ``burst`` warnings or errors of one kind (logger, level,
  first line) through per ``period`` seconds; the first one after a quiet period says how
  many were dropped. asyncio logs every failed ``accept()`` with its traceback, up to a
  backlog's worth per loop turn when descriptors run out.
* :class:`Runner` is aiohttp's ``AppRunner`` with the app's guard on its server, and
  :func:`run_app` serves an app with it (``daisyweb-signal``); the app carries its own
  limits (``signaling.server.create_app``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

log = logging.getLogger("daisyweb.signal")

# Connections one client address may hold at once: a lab behind one NAT runs a WebSocket
# per peer (at most 32 by default) plus /data fetches and a few dashboards.
MAX_CONNECTIONS_PER_ADDRESS = 128
# Seconds a client may leave bytes unread before its connection is aborted.
WRITE_TIMEOUT = 30.0
# Seconds a connection may sit without a request (aiohttp's keep-alive timeout).
IDLE_TIMEOUT = 15.0
# Descriptors a server needs besides its clients' (files, the Hub, logs, the listener).
_RESERVED_DESCRIPTORS = 64
# asyncio accepts up to the listen backlog (aiohttp's 128) connections in one loop turn,
# before the guard sees any of them: they need descriptors over the cap.
_ACCEPT_BATCH = 128
_UNLIMITED_DESCRIPTORS = 1 << 16  # what an unlimited RLIMIT_NOFILE is taken for
# The loggers a flood can make the server write to.
LIMITED_LOGGERS = ("asyncio", "aiohttp.server", "aiohttp.web", "aiohttp.websocket",
                   "aiohttp.internal", "daisyweb.signal", "daisyweb.fineweb")
_REFUSAL = "too many connections; try again later\n"


def connection_limit(soft: int | None = None) -> int:
    """How many connections the server may hold: 3/4 of its descriptor limit (``soft``,
    default this process's RLIMIT_NOFILE), and below it by 64 plus one accept batch, so
    the connections asyncio accepts before the guard refuses them still get a
    descriptor; at least 1."""
    if soft is None:
        try:
            import resource
        except ImportError:  # not a Unix: no limit to read
            return 512
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = _UNLIMITED_DESCRIPTORS
    return max(1, min(soft * 3 // 4, soft - _RESERVED_DESCRIPTORS - _ACCEPT_BATCH))


@dataclass
class _Conn:
    transport: asyncio.Transport
    address: str | None  # None: not counted per address (behind a trusted proxy)
    unsent: int = 0  # unsent bytes at the last sweep
    stuck_since: float | None = None  # since when they have not drained


class ConnectionGuard:
    """Connection caps and write timeouts for one aiohttp server (see module doc)."""

    def __init__(self, max_total: int, max_per_address: int, write_timeout: float,
                 per_address: bool = True) -> None:
        self.max_total = max_total
        self.max_per_address = max_per_address
        self.write_timeout = write_timeout
        self.per_address = per_address
        self.conns: dict[object, _Conn] = {}  # handler -> its connection
        self.addresses: Counter[str] = Counter()
        self.refused = 0
        self.aborted = 0
        self.capped: set[str] = set()  # addresses (and "*" for the total) logged as full
        self._sweeper: asyncio.Task[None] | None = None

    # -------------------------------------------------------------- counting
    def admit(self, handler: object, transport: asyncio.Transport) -> bool:
        """Count a new connection, or answer 503, close it and return False."""
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if self.per_address and peer else None
        full = None
        if len(self.conns) >= self.max_total:
            full = "*"
        elif address is not None and self.addresses[address] >= self.max_per_address:
            full = address
        if full is not None:
            self.refused += 1
            if full not in self.capped:  # once per flood, not once per connection
                self.capped.add(full)
                if full == "*":
                    log.warning("refusing connections: %d open, the most this server "
                                "takes (--max-connections)", len(self.conns))
                else:
                    log.warning("refusing connections from %s: over %d at once "
                                "(--max-connections-per-address)", full,
                                self.max_per_address)
            body = _REFUSAL.encode()
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
                            b"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                            % (len(body), body))
            # A few bytes: they fit the socket, so the close is immediate. It waits one
            # loop turn: aiohttp starts the connection's task after this call, and the
            # task must find its connection open.
            asyncio.get_running_loop().call_soon(transport.close)
            return False
        self.conns[handler] = _Conn(transport, address)
        if address is not None:
            self.addresses[address] += 1
        return True

    def release(self, handler: object) -> None:
        conn = self.conns.pop(handler, None)
        if conn is None:
            return
        if conn.address is not None:
            self.addresses[conn.address] -= 1
            if self.addresses[conn.address] <= 0:
                del self.addresses[conn.address]
            if self.addresses[conn.address] < self.max_per_address:
                self.capped.discard(conn.address)
        if len(self.conns) < self.max_total:
            self.capped.discard("*")

    def attach(self, server: web.Server) -> None:
        """Count ``server``'s connections: aiohttp tells its server of each one."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self.admit(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
            self.release(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    # -------------------------------------------------------------- write timeouts
    def sweep(self, now: float) -> None:
        """Abort every connection whose unsent bytes have not drained for the timeout."""
        for conn in list(self.conns.values()):
            unsent = conn.transport.get_write_buffer_size()
            if unsent == 0 or unsent < conn.unsent:
                conn.stuck_since = None  # drained, or draining
            elif conn.stuck_since is None:
                conn.stuck_since = now
            elif now - conn.stuck_since >= self.write_timeout:
                self.aborted += 1
                log.info("aborted a connection from %s: %d bytes unread for %.0f s",
                         conn.address or "a client", unsent, now - conn.stuck_since)
                conn.transport.abort()
            conn.unsent = unsent

    async def _sweep_forever(self) -> None:
        period = min(1.0, self.write_timeout / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep(time.monotonic())

    async def start(self, app: web.Application) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def stop(self, app: web.Application) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None


def write_deadline(timeout: float) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Middleware: a response the handler returned is written within ``timeout`` seconds
    or its connection is aborted (a WebSocket, written by its handler, is the guard's)."""

    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        resp = await handler(request)
        if resp.prepared:
            return resp
        try:
            async with asyncio.timeout(timeout):
                await resp.prepare(request)
                await resp.write_eof()
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            log.info("aborted a response to %s: not read in %.0f s", request.remote, timeout)
        except ConnectionError:
            pass  # the client left; aiohttp's own write of the end is a no-op then
        return resp

    return middleware


class LogLimiter(logging.Filter):
    """At most ``burst`` warnings and errors of one kind per ``period`` seconds."""

    MAX_KINDS = 1024

    def __init__(self, burst: int = 10, period: float = 60.0) -> None:
        super().__init__()
        self.burst = burst
        self.period = period
        self.kinds: dict[tuple[str, int, str], list[float]] = {}  # [start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:100])
        now = time.monotonic()
        seen = self.kinds.get(kind)
        if seen is None or now - seen[0] >= self.period:
            if len(self.kinds) >= self.MAX_KINDS:
                self.kinds.clear()  # kinds come from the code's messages: rare
            self.kinds[kind] = [now, 1, 0]
            if seen is not None and seen[2]:
                record.msg = (f"{record.msg} ({seen[2]:.0f} more like this in the "
                              f"{self.period:g} s before were not logged)")
            return True
        if seen[1] < self.burst:
            seen[1] += 1
            return True
        seen[2] += 1
        return False

    async def install(self, app: web.Application) -> None:
        for name in LIMITED_LOGGERS:
            logging.getLogger(name).addFilter(self)

    async def remove(self, app: web.Application) -> None:
        for name in LIMITED_LOGGERS:
            logging.getLogger(name).removeFilter(self)


GUARD: web.AppKey[ConnectionGuard] = web.AppKey("connection_guard", ConnectionGuard)


class Runner(web.AppRunner):
    """aiohttp's AppRunner whose server counts connections with the app's guard."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        guard = self.app.get(GUARD)
        if guard is not None:
            guard.attach(server)
        return server


def run_app(app: web.Application, host: str, port: int) -> None:
    """Serve ``app`` with :class:`Runner` until SIGINT or SIGTERM, as ``web.run_app``
    does; an ``OSError`` if the port cannot be bound."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def serve() -> None:
        runner = Runner(app, handle_signals=True)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            print(f"======== Running on http://{host}:{port} ========\n"
                  "(Press CTRL+C to quit)", flush=True)
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    main = loop.create_task(serve())
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        main.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
