"""bench._switch: links with latency and loss between namespaces, and bench.channel's
measurement over them."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench import _bridge, _switch, channel

pytestmark = pytest.mark.skipif(_bridge.unavailable() is not None,
                                reason="needs root and iproute2")

ECHO = """
import socket, sys, time
role, addr, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
if role == "server":
    s.bind((addr, 9000)); s.settimeout(3)
    try:
        while True:
            d, a = s.recvfrom(64); s.sendto(d, a)
    except socket.timeout:
        pass
else:
    s.settimeout(0.1); got = []
    for i in range(n):
        t = time.monotonic(); s.sendto(b"%d" % i, (addr, 9000))
        try:
            while s.recv(64) != b"%d" % i:
                pass
            got.append(time.monotonic() - t)
        except socket.timeout:
            pass
    got.sort()
    print(len(got), got[len(got) // 2] if got else 0.0)
"""


def _echo(s: _switch.Switched, n: int) -> tuple[int, float]:
    server = subprocess.Popen([*s.run_in(1), sys.executable, "-c", ECHO, "server",
                               s.address(1), "0"])
    try:
        time.sleep(0.3)
        out = subprocess.run([*s.run_in(0), sys.executable, "-c", ECHO, "client",
                              s.address(1), str(n)], capture_output=True, text=True,
                             check=True, timeout=60).stdout.split()
        return int(out[0]), float(out[1])
    finally:
        server.kill()
        server.wait()


def test_the_switch_delays_each_direction_and_loses_packets() -> None:
    with _switch.switched(2, 15.0, 0.0, tag="t") as s:
        routes = subprocess.run([*s.run_in(0), "ip", "-4", "route"], capture_output=True,
                                text=True, check=True).stdout.strip().splitlines()
        assert routes == [f"{_switch.SUBNET}.0/24 dev tap0 proto kernel scope link src "
                          f"{s.address(0)}"]  # no default route: nothing leaves
        got, rtt = _echo(s, 20)
        assert got == 20 and 0.030 <= rtt < 0.200  # 15 ms each way
    with _switch.switched(2, 0.0, 0.3, tag="t") as s:
        got, rtt = _echo(s, 60)
        # each round trip survives two draws of 30% loss: about half come back
        assert 12 <= got <= 48 and rtt < 0.030
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=True).stdout
    assert s.hub not in names and not any(ns in names for ns in s.peers)  # all deleted


def test_a_data_channel_crosses_a_slow_lossy_link_on_aiortc() -> None:
    r = channel.measure(10.0, 0.01, "aiortc", 100_000, 2)
    assert isinstance(r, dict), r
    assert r["rtt_ms"] >= 20.0 and r["mb_s"] > 0
