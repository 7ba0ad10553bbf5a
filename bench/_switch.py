"""Links with latency and loss for benchmarks: a user-space Ethernet switch between
network namespaces (this kernel has no ``netem``).

:func:`switched` makes a hub namespace and one namespace per peer, like
``bench._bridge.bridge``, but joins them through TAP devices whose other end is this
module's switch process instead of a kernel bridge. The switch reads every frame a
namespace sends, drops it with probability ``loss``, and delivers it to its destination
port (learned from source addresses; broadcasts go to every other port) ``delay_ms``
later, so a round trip between two peers takes ``2 * delay_ms`` more than on a bridge
and each direction loses ``loss`` of its packets. A peer's upload can be shaped as on the
bridge (``tc tbf`` on its TAP device). TAP devices hand the switch whole Ethernet frames
of at most the MTU (the kernel segments large sends first), so nothing needs offloads
turned off.

Every address lives inside the namespaces made here (10.78.0.0/24, no route anywhere
else); the hub (10.78.0.1, for the signaling server) is a port like the peers. Run as
root; ``python -m bench._switch`` is the switch process itself (started and stopped by
:func:`switched`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from bench._bridge import Bridge

__all__ = ["Switched", "switched"]

SUBNET = "10.78.0"
_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000


@dataclass
class Switched(Bridge):
    """What :func:`switched` made: a :class:`bench._bridge.Bridge` whose links the switch
    delays and drops packets on."""

    delay_ms: float = 0.0
    loss: float = 0.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


def serve(taps: list[str], delay_s: float, loss: float, seed: int,
          ready: int | None = None) -> None:
    """The switch: forward frames among ``taps`` (made here, in this namespace) with a
    fixed delay and random loss until SIGTERM. Writes one byte to ``ready`` once every
    device exists (then they may be moved to other namespaces)."""
    fds = [_open_tap(t) for t in taps]
    if ready is not None:
        os.write(ready, b"1")
        os.close(ready)
    stop = False

    def on_term(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    rng = random.Random(seed)
    where: dict[bytes, int] = {}  # MAC -> fd of the port it was last seen on
    due: collections.deque[tuple[float, int, bytes]] = collections.deque()
    while not stop:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, fd, frame = due.popleft()
            with contextlib.suppress(OSError):  # a device gone or full: the frame is lost
                os.write(fd, frame)
        wait = max(0.0, due[0][0] - now) if due else 0.5
        try:
            readable, _, _ = select.select(fds, [], [], wait)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in readable:
            for _ in range(64):  # a burst at a time, then the others' turn
                try:
                    frame = os.read(fd, 65536)
                except (BlockingIOError, OSError):
                    break
                if len(frame) < 14:
                    continue
                where[frame[6:12]] = fd
                if loss and rng.random() < loss:
                    continue
                dst = where.get(frame[0:6]) if not frame[0] & 1 else None
                for out in ([dst] if dst is not None else [f for f in fds if f != fd]):
                    due.append((now + delay_s, out, frame))


@contextlib.contextmanager
def switched(n: int, delay_ms: float, loss: float, rate_mbit: float | None = None,
             tag: str = "dx") -> Iterator[Switched]:
    """``n`` peer namespaces and a hub joined by the switch: each frame is delayed
    ``delay_ms`` and lost with probability ``loss``; each peer's upload shaped to
    ``rate_mbit`` Mbit/s (None: unshaped)."""
    if os.geteuid() != 0:
        raise RuntimeError("cannot make network namespaces: needs root")
    if not 1 <= n <= 250 or not 0.0 <= loss < 1.0 or delay_ms < 0:
        raise ValueError("1..250 peers, 0 <= loss < 1, delay >= 0")
    base = f"{tag}{os.getpid()}"
    s = Switched(f"{base}hub", [f"{base}p{i}" for i in range(n)], rate_mbit, SUBNET, "tap0",
                 delay_ms, loss)
    made: list[str] = []
    switch: subprocess.Popen[bytes] | None = None
    try:
        _ip("netns", "add", s.hub)
        made.append(s.hub)
        _ip("-n", s.hub, "link", "set", "lo", "up")
        taps = [f"{base}t{i}"[-15:] for i in range(n + 1)]  # the last one is the hub's
        r, w = os.pipe()
        switch = subprocess.Popen(
            ["ip", "netns", "exec", s.hub, sys.executable, "-m", "bench._switch",
             "--delay-ms", str(delay_ms), "--loss", str(loss), "--ready-fd", str(w),
             *taps], pass_fds=(w,))
        os.close(w)
        if os.read(r, 1) != b"1":
            raise RuntimeError("the switch did not start")
        os.close(r)
        for i, ns in enumerate(s.peers):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", s.hub, "link", "set", taps[i], "netns", ns)
            _ip("-n", ns, "link", "set", taps[i], "name", s.device)
            _ip("-n", ns, "addr", "add", f"{s.address(i)}/24", "dev", s.device)
            _ip("-n", ns, "link", "set", s.device, "up")
            if rate_mbit is not None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev",
                                s.device, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                                "burst", "64kb", "latency", "200ms"],
                               check=True, capture_output=True, timeout=30)
        _ip("-n", s.hub, "addr", "add", f"{s.hub_address}/24", "dev", taps[n])
        _ip("-n", s.hub, "link", "set", taps[n], "up")
        yield s
    finally:
        if switch is not None:
            switch.terminate()
            try:
                switch.wait(10)
            except subprocess.TimeoutExpired:
                switch.kill()
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description="the user-space switch of bench._switch")
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--loss", type=float, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ready-fd", type=int)
    ap.add_argument("taps", nargs="+")
    a = ap.parse_args()
    serve(a.taps, a.delay_ms / 1000, a.loss, a.seed, a.ready_fd)


if __name__ == "__main__":
    main()
