"""A real TURN server for the relay tests: Debian's coturn on 127.0.0.1 only.

:func:`coturn` starts ``turnserver`` with one long-term user, listening and relaying on
127.0.0.1 (``--allow-loopback-peers``: its peers are on this machine too), no TLS, no
database, its log on stdout; the test reads the log for the bytes it relayed and stops
it. ``scripts/install-system.sh`` installs coturn (CI runs it first).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Turn", "coturn"]

USER, PASSWORD = "daisy", "relay-secret"


@dataclass
class Turn:
    url: str
    user: str
    password: str
    log: Path

    def flags(self) -> list[str]:
        """The daisyweb-peer flags that force a peer through this server."""
        return ["--turn", self.url, "--turn-user", self.user, "--turn-credential",
                self.password, "--relay"]

    def relayed_bytes(self) -> int:
        """Bytes the server received from its clients (the peers), over all sessions.

        coturn logs a session's ``usage`` now and then and when it ends, each line
        counting what came since the last one (``peer usage`` lines count the relayed
        side again and are left out)."""
        text = self.log.read_text(errors="replace")
        return sum(int(n) for n in re.findall(r": usage: [^\n]*?\brb=(\d+)", text))


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def coturn(tmp: Path) -> Iterator[Turn]:
    exe = shutil.which("turnserver")
    if exe is None:
        raise RuntimeError("coturn is missing: run bash scripts/install-system.sh "
                           "(apt-get install coturn)")
    port = _free_udp_port()
    log = tmp / "coturn.log"  # written by the server itself (its stdout is buffered)
    lo = 49152 + (port % 64) * 200  # relay ports: a range of its own per server
    log.touch()
    with open(tmp / "coturn.out", "w") as out:
        proc = subprocess.Popen(
            [exe, "-n", "--listening-ip", "127.0.0.1", "--relay-ip", "127.0.0.1",
             "--listening-port", str(port), "--min-port", str(lo), "--max-port",
             str(lo + 199), "--lt-cred-mech", "--user", f"{USER}:{PASSWORD}",
             "--realm", "daisyweb", "--allow-loopback-peers", "--no-tls", "--no-dtls",
             "--no-cli", "--log-file", str(log), "--simple-log", "--verbose",
             "--userdb", str(tmp / "turndb"), "--pidfile", str(tmp / "turn.pid")],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while "Total General servers" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"coturn did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield Turn(f"turn:127.0.0.1:{port}", USER, PASSWORD, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
