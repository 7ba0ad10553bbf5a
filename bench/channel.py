"""The data channel over a link with latency and loss, aiortc vs libwebrtc.

    python -m bench.channel            # writes the "channel" section of TEST_RESULTS.md
    python -m bench.channel --quick    # one small condition, nothing written

Two peers, each in a network namespace of its own, joined through the user-space switch
of ``bench._switch`` (one-way delay, random loss per packet and direction; the signaling
server sits behind the switch too). For each condition and transport: the round trip
of a small message through ``Mesh.send`` (median of 20 in turn), and the goodput of
``--count`` contributions of ``--size`` bytes sent back to back (first send to the
receiver's acknowledgement of the last), the bytes a member sends in a round. Needs
root (namespaces, TAP devices); nothing leaves the namespaces made here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import _switch
from bench._group import ENV, ROOT, free_port
from bench._results import machine, write_section

ROOM = "bench-channel"
CONDITIONS = ((0.0, 0.0), (25.0, 0.0), (25.0, 0.01))  # (one-way ms, loss per direction)
TRANSPORTS = ("aiortc", "libwebrtc")
PINGS = 20


async def _end(role: str, server: str, hosts: list[str], transport: str, size: int,
               count: int) -> None:
    from daisyweb.net.mesh import Mesh, PeerUp, Received
    from daisyweb.protocol import wire

    # Both peers' addresses: a candidate of an address not listed is not used.
    m = Mesh(server, room=ROOM, name=role, ice_hosts=hosts, transport=transport)
    await m.start()
    try:
        if role == "recv":
            got = 0
            while True:
                e = await asyncio.wait_for(m.next_event(), 600)
                if not isinstance(e, Received):
                    continue
                if isinstance(e.message, wire.Halt) and e.message.reason == "ping":
                    await m.send(e.peer, e.message)  # echoed
                elif isinstance(e.message, wire.Contribution):
                    got += 1
                    if got == count:
                        await m.send(e.peer, wire.Halt(0, "ack"))
                elif isinstance(e.message, wire.Halt) and e.message.reason == "done":
                    return
        peer = (await _until(m, lambda e: isinstance(e, PeerUp), 120)).peer
        rtts = []
        for i in range(PINGS):
            t0 = time.perf_counter()
            await m.send(peer, wire.Halt(i, "ping"))
            await _until(m, lambda e, i=i: _halt(e, step=i), 120)
            rtts.append(time.perf_counter() - t0)
        payload = os.urandom(size - size % 4)
        t0 = time.perf_counter()
        for i in range(count):
            await m.send(peer, wire.Contribution(i, m.self_id, payload))
        await _until(m, lambda e: _halt(e, reason="ack"), 600)
        seconds = time.perf_counter() - t0
        await m.send(peer, wire.Halt(0, "done"))
        await asyncio.sleep(1.0)
        print(json.dumps({"rtt_ms": 1000 * statistics.median(rtts),
                          "mb_s": count * len(payload) / seconds / 1e6}), flush=True)
    finally:
        await m.close()


async def _until(m: Any, wanted: Callable[[Any], bool], timeout: float) -> Any:
    """The mesh's next event that is ``wanted`` (the others are dropped)."""
    while not wanted(e := await asyncio.wait_for(m.next_event(), timeout)):
        pass
    return e


def _halt(e: Any, step: int | None = None, reason: str | None = None) -> bool:
    """Whether ``e`` received a Halt of that step or reason (the bench's small message)."""
    from daisyweb.net.mesh import Received
    from daisyweb.protocol import wire

    return (isinstance(e, Received) and isinstance(e.message, wire.Halt)
            and (step is None or e.message.step == step)
            and (reason is None or e.message.reason == reason))


def measure(delay_ms: float, loss: float, transport: str, size: int,
            count: int) -> dict[str, float] | str:
    """One condition on one transport: the sender's numbers, or why it failed."""
    with _switch.switched(2, delay_ms, loss) as s:
        port = free_port()
        server = subprocess.Popen(
            [*s.run_in_hub(), sys.executable, "-m", "signaling.cli", "--host",
             s.hub_address, "--port", str(port), "--data", "builtin"],
            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"http://{s.hub_address}:{port}"
        # libwebrtc gathers every interface of its namespace: here the switch's TAP alone,
        # whose addresses exist in no other namespace.
        env = dict(ENV, DAISYWEB_LOOPBACK_ONLY="0")
        ends = []
        try:
            time.sleep(2.0)
            for i, role in enumerate(("recv", "send")):
                cmd = [*s.run_in(i), sys.executable, "-m", "bench.channel", "--end", role,
                       "--server", url, "--host", s.address(i), "--host", s.address(1 - i),
                       "--transport", transport,
                       "--size", str(size), "--count", str(count)]
                ends.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True))
            out, err = ends[1].communicate(timeout=900)
            ends[0].wait(timeout=60)
            for line in out.splitlines():
                if line.startswith("{"):
                    return json.loads(line)
            return (err.strip().splitlines() or ["no result"])[-1][:200]
        except subprocess.TimeoutExpired:
            return "timed out"
        finally:
            for p in (*ends, server):
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)


def run(size: int, count: int, conditions: tuple[tuple[float, float], ...],
        transports: tuple[str, ...]) -> list[str]:
    rows = ["| one-way delay | loss per direction | transport | small message round trip, "
            "median ms | goodput MB/s |", "|---:|---:|---|---:|---:|"]
    for delay_ms, loss in conditions:
        for t in transports:
            r = measure(delay_ms, loss, t, size, count)
            if isinstance(r, str):
                rows.append(f"| {delay_ms:g} ms | {loss:.0%} | {t} | failed: {r} | |")
            else:
                rows.append(f"| {delay_ms:g} ms | {loss:.0%} | {t} | {r['rtt_ms']:.1f} | "
                            f"{r['mb_s']:.2f} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small condition; writes nothing")
    ap.add_argument("--size", type=int, default=745_776, help="bytes of one contribution "
                    "(default: the demo's int4 round payload)")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--end", choices=("send", "recv"), help=argparse.SUPPRESS)
    ap.add_argument("--server", help=argparse.SUPPRESS)
    ap.add_argument("--host", action="append", help=argparse.SUPPRESS)
    ap.add_argument("--transport", default="aiortc", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.end:
        asyncio.run(_end(a.end, a.server, a.host, a.transport, a.size, a.count))
        return
    if a.quick:
        print("\n".join(run(100_000, 2, ((10.0, 0.01),), TRANSPORTS)))
        return
    rows = run(a.size, a.count, CONDITIONS, TRANSPORTS)
    section = [
        "## Data channel under latency and loss",
        "",
        f"`python -m bench.channel` -- {machine()}. Two peers, each in its own network "
        "namespace, joined through a user-space switch (`bench._switch`: TAP devices, a "
        "fixed one-way delay and random loss per packet and direction; the signaling "
        "server behind it too), unshaped. Round trip: a small message through `Mesh.send` "
        f"and back, median of {PINGS} in turn. Goodput: {a.count} contributions of "
        f"{a.size:,} bytes back to back, first send to the acknowledgement of the last.",
        "",
        *rows,
    ]
    write_section("channel", "\n".join(section))
    print("\n".join(section))


if __name__ == "__main__":
    main()
