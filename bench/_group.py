"""What the group benchmarks share: a signaling server on 127.0.0.1 and pinned peers.

Peers run over aiortc, the transport every install has: libwebrtc runs only inside a
loopback-only network namespace (``bench._netns``; bench.mesh, bench.group and
bench.memory compare the two there), and ``DAISYWEB_LOOPBACK_ONLY`` makes a libwebrtc
peer started here refuse instead of gathering this machine's other addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# PYTHONPATH: peers started from a scratch directory still find ``tests.fault_peer``.
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1",
           DAISYWEB_TRANSPORT="aiortc", DAISYWEB_LOOPBACK_ONLY="1",
           PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def records(path: Path) -> list[dict]:
    """A metrics file's JSON lines."""
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@contextlib.contextmanager
def signaling_server(cwd: Path, log: Path | None = None) -> Iterator[str]:
    """A ``daisyweb-signal`` on a free 127.0.0.1 port with the built-in corpus; its URL.
    ``log``: where its output goes (who joined and left, when), else nowhere."""
    port = free_port()
    out = log.open("ab") if log is not None else subprocess.DEVNULL
    server = subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "--host", "127.0.0.1", "--port", str(port),
         "--data", "builtin"], cwd=cwd, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("signaling server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)
        if log is not None:
            out.close()  # type: ignore[union-attr]


def peer_command(server: str, room: str, module: str = "daisyweb.cli.peer") -> list[str]:
    """``daisyweb-peer`` joining ``room`` on loopback, admitting everyone with the code;
    ``module="tests.fault_peer"``: with the test switches of its environment."""
    return [sys.executable, "-m", module, "--server", server, "--room", room,
            "--ice-host", "127.0.0.1", "--approve", "auto", "--join-timeout", "60"]


def run_pinned(peers: Sequence[tuple[list[str], dict[str, str]]], cwd: Path,
               tag: str, during: Callable[[list[subprocess.Popen[bytes]]], None] | None = None
               ) -> None:
    """Run each (command, env) pinned to core i; the first (the leader, the room's host)
    gets a second's head start. ``during(processes)``, if given, runs once all are
    started, before waiting for them (a benchmark measuring them while they train).
    SystemExit naming the run if any peer fails."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for core, (cmd, env) in enumerate(peers):
            procs.append(subprocess.Popen(["taskset", "-c", str(core), *cmd], cwd=cwd,
                                          env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE))
            if core == 0:
                time.sleep(1.0)  # the room's first peer is its host
        if during is not None:
            during(procs)
        for p in procs:
            _, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise SystemExit(f"{tag}: a peer failed:\n{err.decode()[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
