"""Issue 37, item 8, against real sockets on 127.0.0.1: clients that hold connections or
never read cannot take the server's descriptors, and a flood cannot fill its log.

The caps are lowered through ``create_app``'s parameters (a handful of sockets instead
of thousands), and clients come from several loopback addresses (127.0.0.2, ...: all of
127/8 is this machine). The tests that need a low descriptor limit run
``daisyweb-signal`` in a subprocess under that limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from signaling import guard
from signaling.guard import GUARD, LogLimiter, connection_limit
from signaling.server import create_app
from tests.signaling.local_server import Server

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ helpers
async def connect(url: str, source: str = "127.0.0.1", rcvbuf: int | None = None
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw TCP connection to the server of ``url`` from ``source``; ``rcvbuf``: a tiny
    receive buffer, for a client that reads nothing."""
    port = int(url.rsplit(":", 1)[1])
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


async def refused(reader: asyncio.StreamReader) -> bool:
    """True when the server answers 503 and closes (or resets) without a request."""
    try:
        data = await asyncio.wait_for(reader.read(), 2)
    except ConnectionResetError:
        return True
    return data.startswith(b"HTTP/1.1 503 ") and b"too many connections" in data


async def healthz(url: str, source: str = "127.0.0.1") -> int:
    """The status of GET /healthz on a new connection from ``source`` (0: reset: a 503
    the server closed at once may be lost when the request was sent before)."""
    reader, writer = await connect(url, source)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 2)
    except ConnectionResetError:
        return 0
    finally:
        writer.close()
    return 503 if data.startswith(b"HTTP/1.1 503") else int(data.split(b" ", 2)[1])


async def until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@contextlib.asynccontextmanager
async def server(**kw: object) -> AsyncIterator[Server]:
    srv = await Server(**kw).start()
    try:
        yield srv
    finally:
        await srv.stop()


def closing(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]) -> None:
    for _, w in conns:
        w.close()


# ------------------------------------------------------------------ caps
async def test_connections_of_any_kind_are_capped_per_address() -> None:
    async with server(max_connections=50, max_connections_per_address=4) as srv:
        g = srv.app[GUARD]
        # two that send nothing, two that ask for /data and never read the answer
        held = [await connect(srv.url, "127.0.0.2") for _ in range(4)]
        for _, w in held[2:]:
            w.write(b"GET /data HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await until(lambda: g.addresses["127.0.0.2"] == 4, 2)
        over = await connect(srv.url, "127.0.0.2")
        assert await refused(over[0])
        assert g.addresses["127.0.0.2"] == 4 and g.refused == 1
        # another address is served, HTTP and WebSocket alike
        assert await healthz(srv.url, "127.0.0.3") == 200
        ws = await srv.ws(name="other")
        assert (await ws.receive_json())["type"] == "welcome"
        # a freed slot is taken again
        closing(held[:1])
        assert await until(lambda: g.addresses["127.0.0.2"] == 3, 2)
        assert await healthz(srv.url, "127.0.0.2") == 200
        closing(held[1:])
        await ws.close()
        assert await until(lambda: not g.conns and not g.addresses, 2)


async def test_connections_are_capped_in_all() -> None:
    async with server(max_connections=6, max_connections_per_address=4) as srv:
        g = srv.app[GUARD]
        held = [await connect(srv.url, "127.0.0.2") for _ in range(4)]
        held += [await connect(srv.url, "127.0.0.3") for _ in range(2)]
        assert await until(lambda: len(g.conns) == 6, 2)
        assert await healthz(srv.url, "127.0.0.4") in (0, 503)  # 503, or reset under it
        closing(held[:1])
        assert await until(lambda: len(g.conns) == 5, 2)
        assert await healthz(srv.url, "127.0.0.4") == 200
        closing(held[1:])


async def test_a_connection_without_a_request_is_closed_when_idle() -> None:
    async with server(idle_timeout=0.5) as srv:
        reader, writer = await connect(srv.url, "127.0.0.2")
        t0 = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 3) == b""
        assert time.monotonic() - t0 < 2
        writer.close()


def test_the_default_cap_is_below_the_descriptor_limit() -> None:
    assert connection_limit(1024) == 768
    assert connection_limit(100_000) == 75_000
    # 64 kept for files, the Hub, the listener; 128 for one batch of accepts
    assert connection_limit(512) == 320
    assert connection_limit(200) == 8
    assert connection_limit(10) == 1
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert create_app()[GUARD].max_total == connection_limit() < soft


@pytest.mark.parametrize("kw", [{"max_connections": 0}, {"max_connections_per_address": 0},
                                {"max_connections": 2.5}, {"write_timeout": 0},
                                {"idle_timeout": -1}])
def test_bad_limits_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        create_app(**kw)


def test_the_cli_passes_the_caps(capsys: pytest.CaptureFixture) -> None:
    from signaling.cli import build_app, main, parse_args

    app = build_app(parse_args(["--data", "builtin", "--max-connections", "9",
                                "--max-connections-per-address", "3"]))
    assert (app[GUARD].max_total, app[GUARD].max_per_address) == (9, 3)
    assert build_app(parse_args(["--data", "builtin"]))[GUARD].max_total == connection_limit()
    with pytest.raises(SystemExit):
        main(["--max-connections", "0"])
    assert "--max-connections must be at least 1" in capsys.readouterr().err


# ------------------------------------------------------------------ write timeouts
async def test_a_response_not_read_is_aborted_after_the_write_timeout(tmp_path: Path) -> None:
    """A body in the transport (aiohttp's drain) and a file sent by sendfile (no bytes in
    the transport): both connections are aborted once the timeout passes."""
    srv = Server(write_timeout=1.0)
    big = b"x" * (16 << 20)

    async def respond(request: web.Request) -> web.Response:
        return web.Response(body=big)

    srv.app.router.add_get("/big", respond)
    (tmp_path / "big.bin").write_bytes(big)
    srv.app.router.add_static("/files/", tmp_path)
    await srv.start()
    try:
        g = srv.app[GUARD]
        for path in ("/big", "/files/big.bin"):
            reader, writer = await connect(srv.url, "127.0.0.2", rcvbuf=4096)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert await until(lambda: len(g.conns) == 1, 2)
            t0 = time.monotonic()
            assert await until(lambda: not g.conns, 5), path
            assert 0.8 < time.monotonic() - t0 < 4, path
            writer.close()
        assert await healthz(srv.url) == 200
    finally:
        await srv.stop()


async def test_a_websocket_that_does_not_read_is_aborted_and_its_sender_goes_on() -> None:
    """Member B stops reading; member A relays 6 MB of signals to it. B is aborted after
    the timeout (A's relay waits on B's socket until then), and A's next message is
    served: B's departure reaches A."""
    async with server(write_timeout=1.0) as srv:
        g = srv.app[GUARD]
        reader, writer = await connect(srv.url, "127.0.0.1", rcvbuf=4096)
        writer.write(b"GET /ws?name=b HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     b"Sec-WebSocket-Version: 13\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
        assert await until(lambda: len(srv.reg.peers) == 1, 2)
        b_id = next(iter(srv.reg.peers))
        a = await srv.ws(name="a")
        assert (await a.receive_json())["type"] == "welcome"
        blob = "y" * 60_000
        for i in range(100):  # within the rate limit's burst
            await a.send_json({"type": "signal", "to": b_id, "kind": "candidate",
                               "data": {"c": blob, "i": i}})
        t0 = time.monotonic()
        assert await until(lambda: b_id not in srv.reg.peers, 6)
        assert time.monotonic() - t0 < 5
        assert g.aborted >= 1
        while True:  # A hears that B left
            msg = await asyncio.wait_for(a.receive_json(), 3)
            if msg["type"] == "peers" and [p["name"] for p in msg["peers"]] == ["a"]:
                break
        await a.close()
        writer.close()


# ------------------------------------------------------------------ under a descriptor limit
def _signal(port: int, nofile: int, *extra: str) -> subprocess.Popen:
    """``daisyweb-signal`` on ``port`` with RLIMIT_NOFILE lowered to ``nofile``."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

    return subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "--host", "127.0.0.1", "--port", str(port),
         "--data", "builtin", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _started(url: str, proc: subprocess.Popen) -> None:
    for _ in range(300):
        assert proc.poll() is None, proc.stderr.read().decode()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            if await healthz(url) == 200:
                return
        await asyncio.sleep(0.1)
    raise AssertionError("daisyweb-signal did not start")


async def _flood(url: str, sources: list[str], each: int
                 ) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """``each`` connections from every source, each asking for /data and never reading."""
    conns = []
    for source in sources:
        for _ in range(each):
            r, w = await connect(url, source)
            w.write(b"GET /data HTTP/1.1\r\nHost: x\r\n\r\n")
            conns.append((r, w))
    await asyncio.sleep(1.0)
    return conns


async def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    proc.terminate()
    out, err = await asyncio.to_thread(proc.communicate, timeout=30)
    return out.decode(errors="replace"), err.decode(errors="replace")


async def test_a_flood_under_a_low_descriptor_limit_never_runs_the_server_out() -> None:
    """RLIMIT_NOFILE 512: the default caps are 320 in all and 128 per address. 300
    /data clients from one address that never read leave /healthz and joins from
    another address working; 400 from four addresses (100 each) fill the 320 and the
    rest are refused at once; accept() never fails and the log stays short."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _signal(port, 512)
    try:
        await _started(url, proc)
        flood = await _flood(url, ["127.0.0.2"], 300)
        t0 = time.monotonic()
        assert await healthz(url) == 200
        async with aiohttp.ClientSession() as s, s.ws_connect(url + "/ws?room=roomy") as ws:
            assert (await ws.receive_json())["type"] == "welcome"
        assert time.monotonic() - t0 < 2
        answered = [await refused(r) for r, _ in flood[128:]]
        assert all(answered), answered.count(False)
        closing(flood)
        await asyncio.sleep(0.5)

        flood = await _flood(url, [f"127.0.0.{i}" for i in range(3, 7)], 100)
        assert await healthz(url, "127.0.0.7") in (0, 503)  # full: said at once
        closing(flood)
        await asyncio.sleep(0.5)
        assert await healthz(url, "127.0.0.7") == 200
    finally:
        out, err = await _stop(proc)
    assert "out of system resource" not in err and "Too many open files" not in err, err[-2000:]
    logged = [line for line in err.splitlines() if " aiohttp.access " not in line]
    assert len("\n".join(logged)) < 5_000, logged[:20]
    assert "refusing connections from 127.0.0.2" in err
    assert "refusing connections: 320 open" in err


async def test_errors_a_flood_makes_are_logged_a_few_times_only() -> None:
    """The caps set above what 128 descriptors allow (as a server would be without
    them): asyncio fails accept() and logs it with a traceback, many times a second;
    the log shows at most ten of them a minute."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _signal(port, 128, "--max-connections", "100000",
                   "--max-connections-per-address", "100000")
    try:
        await _started(url, proc)
        flood = await _flood(url, ["127.0.0.2"], 200)
        await asyncio.sleep(2.0)
        closing(flood)
        await asyncio.sleep(0.5)
    finally:
        out, err = await _stop(proc)
    accept_errors = err.count("socket.accept() out of system resource")
    assert 1 <= accept_errors <= 10, (accept_errors, len(err))
    assert len(err) < 60_000, len(err)


def test_the_limiter_says_how_many_it_dropped(caplog: pytest.LogCaptureFixture) -> None:
    lim = LogLimiter(burst=3, period=0.2)
    logger = logging.getLogger("daisyweb.signal.test_limiter")
    logger.addFilter(lim)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            for i in range(50):
                logger.error("accept failed %d", i)
                logger.info("joined %d", i)  # below warnings: never dropped
            time.sleep(0.25)
            logger.error("accept failed %d", 50)
    finally:
        logger.removeFilter(lim)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors[:3] == ["accept failed 0", "accept failed 1", "accept failed 2"]
    assert errors[3] == "accept failed 50 (47 more like this in the 0.2 s before were not logged)"
    assert len(errors) == 4
    assert sum(r.levelno == logging.INFO for r in caplog.records) == 50


def test_the_app_installs_its_limiter_only_while_it_runs() -> None:
    async def run() -> None:
        async with server():
            assert any(isinstance(f, LogLimiter) for f in logging.getLogger("asyncio").filters)
        assert not any(isinstance(f, LogLimiter) for f in logging.getLogger("asyncio").filters)

    asyncio.run(run())
    assert guard.LIMITED_LOGGERS[0] == "asyncio"
