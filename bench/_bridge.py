"""Real links for group benchmarks: each peer in a network namespace of its own, joined to
the others by a veth pair through a bridge in a hub namespace, its upload shaped with
``tc tbf``.

Every address lives inside namespaces made here (10.77.0.0/24, no route anywhere else),
so nothing a benchmark sends can leave them; :func:`bridge` deletes them all on the way
out. The hub holds the bridge and the signaling server (10.77.0.1); peer ``i`` is
10.77.0.(i+2) on its ``veth0``. Needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Bridge", "bridge", "unavailable"]

SUBNET = "10.77.0"


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2)"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@dataclass
class Bridge:
    hub: str  # the hub namespace's name
    peers: list[str]  # each peer's namespace
    rate_mbit: float | None
    subnet: str = SUBNET  # the first three octets of every address made
    device: str = "veth0"  # what each peer sends on

    @property
    def hub_address(self) -> str:
        return f"{self.subnet}.1"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 2}"

    def run_in(self, i: int) -> list[str]:
        """The command prefix that runs a program in peer ``i``'s namespace."""
        return ["ip", "netns", "exec", self.peers[i]]

    def run_in_hub(self) -> list[str]:
        return ["ip", "netns", "exec", self.hub]

    def tx_bytes(self, i: int) -> int:
        """Bytes peer ``i``'s interface sent (IP packets: every header included)."""
        out = subprocess.run(
            [*self.run_in(i), "cat", f"/sys/class/net/{self.device}/statistics/tx_bytes"],
            check=True, capture_output=True, text=True, timeout=10)
        return int(out.stdout)

    def rx_bytes(self, i: int) -> int:
        out = subprocess.run(
            [*self.run_in(i), "cat", f"/sys/class/net/{self.device}/statistics/rx_bytes"],
            check=True, capture_output=True, text=True, timeout=10)
        return int(out.stdout)


@contextlib.contextmanager
def bridge(n: int, rate_mbit: float | None, tag: str = "dw") -> Iterator[Bridge]:
    """``n`` peer namespaces on one bridge, each upload shaped to ``rate_mbit`` Mbit/s
    (None: unshaped)."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"cannot make network namespaces: {why}")
    if not 1 <= n <= 250:
        raise ValueError(f"1..250 peers, got {n}")
    base = f"{tag}{os.getpid()}"
    b = Bridge(f"{base}hub", [f"{base}p{i}" for i in range(n)], rate_mbit)
    made: list[str] = []
    try:
        _ip("netns", "add", b.hub)
        made.append(b.hub)
        _ip("link", "set", "lo", "up", ns=b.hub)
        _ip("link", "add", "br0", "type", "bridge", ns=b.hub)
        _ip("addr", "add", f"{b.hub_address}/24", "dev", "br0", ns=b.hub)
        _ip("link", "set", "br0", "up", ns=b.hub)
        for i, ns in enumerate(b.peers):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "set", "lo", "up", ns=ns)
            # the pair is made in the hub and one end moved: no interface of this host
            _ip("link", "add", f"h{i}", "type", "veth", "peer", "name", "veth0",
                "netns", ns, ns=b.hub)
            _ip("link", "set", f"h{i}", "master", "br0", "up", ns=b.hub)
            _ip("addr", "add", f"{b.address(i)}/24", "dev", "veth0", ns=ns)
            _ip("link", "set", "veth0", "up", ns=ns)
            if rate_mbit is not None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev",
                                "veth0", "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                                "burst", "64kb", "latency", "200ms"],
                               check=True, capture_output=True, timeout=30)
        yield b
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
