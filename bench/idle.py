"""``python -m bench.idle``: what an idle link costs a peer, per transport, up to 32 peers.

For each transport and group size N, in a loopback-only network namespace of its own
(``bench._netns``: libwebrtc gathers every interface, so both transports run there, alike):
a signaling server and N ``daisyweb-peer`` processes in one room whose leader waits for
one peer more than will come. Every peer links to every other (N - 1 links each) and the
group stays idle: heartbeats, ICE consent checks and SCTP keep-alives are all that moves.
After the links have settled, each peer's CPU time over a fixed window (``/proc/PID/stat``)
and its resident memory (VmRSS) are read; the table gives the median peer's CPU share of
one core, that per link, and its memory.

    python -m bench.idle                       # 2, 8, 16, 32 peers, both transports
    python -m bench.idle --sizes 4 --window 10 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench._group import ENV, ROOT, signaling_server
from bench._netns import run_isolated
from bench._results import machine, write_section

TRANSPORTS = ("aiortc", "libwebrtc")
CLK_TCK = 100


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(transport: str, n: int, settle: float, window: float, out: Path) -> dict:
    """Inside the namespace: one idle group of ``n``; its per-peer CPU and memory."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(ENV, DAISYWEB_TRANSPORT=transport)
    procs: list[subprocess.Popen[bytes]] = []
    with signaling_server(out) as server:
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "daisyweb.cli.peer", "--server", server,
                       "--room", f"idle{n}", "--name", f"p{i:02d}", "--ice-host", "127.0.0.1",
                       "--approve", "auto", "--join-timeout", str(int(settle + window + 120)),
                       "--transport", transport]
                if i == 0:
                    cmd += ["--start", "--wait-peers", str(n + 1)]
                with open(out / f"p{i:02d}.log", "wb") as log:
                    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                                  stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL))
                if i == 0:
                    time.sleep(1.0)
            time.sleep(settle)
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            if dead:
                log = (out / f"p{dead[0]:02d}.log").read_text(errors="replace")[-1500:]
                raise SystemExit(f"{transport} x{n}: p{dead[0]:02d} ended while idle:\n{log}")
            c0 = [_cpu(p.pid) for p in procs]
            time.sleep(window)
            c1 = [_cpu(p.pid) for p in procs]
            rss = [_rss(p.pid) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    share = [(b - a) / window for a, b in zip(c0, c1, strict=True)]
    return {"transport": transport, "n": n, "cpu_share": statistics.median(share),
            "cpu_max": max(share), "rss": statistics.median(rss), "rss_max": max(rss)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__)
    ap.add_argument("--sizes", default="2,8,16,32")
    ap.add_argument("--transports", default=",".join(TRANSPORTS))
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-idle"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("TRANSPORT", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        transport, n = args.child[0], int(args.child[1])
        settle = 15.0 + 2.0 * n  # links of a 32-peer start take about a minute to settle
        got = child(transport, n, settle, args.window, args.out / f"{transport}{n}")
        print("RESULT " + json.dumps(got), flush=True)
        return
    rows = []
    t0 = time.time()
    for transport in args.transports.split(","):
        for n in (int(x) for x in args.sizes.split(",")):
            r = run_isolated([sys.executable, "-m", "bench.idle", "--child", transport, str(n),
                              "--window", str(args.window), "--out", str(args.out)],
                             env={"PYTHONPATH": str(ROOT)}, timeout=900)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            if r.returncode != 0 or not line:
                why = next((ln.removeprefix("daisyweb-peer: ") for ln in r.stdout.splitlines()
                            if "closed" in ln or "ended while idle" in ln), "no result")
                print(f"{transport} x{n} failed:\n{r.stdout[-3000:]}", flush=True)
                rows.append({"transport": transport, "n": n, "failed": why[:200]})
                continue
            rows.append(json.loads(line[-1][len("RESULT "):]))
            row = rows[-1]
            print(f"{transport:9s} {n:3d} peers: CPU {row['cpu_share']:.1%} of a core "
                  f"(max {row['cpu_max']:.1%}), RSS {row['rss'] / 1e6:.0f} MB", flush=True)
    lines = [
        "## Idle links (bench.idle, issue 39)", "",
        f"On {machine()}, {time.strftime('%Y-%m-%d')}. Command: `python -m bench.idle "
        f"--sizes {args.sizes} --window {args.window:g}` ({time.time() - t0:.0f} s). Each "
        "group in a loopback-only namespace of its own; the peers linked to each other and "
        "idle (the leader waits for a peer that never comes), measured over the window after "
        "15 s + 2 s per peer of settling. All peers share this machine's 2 cores.", "",
        "| transport | peers | links per peer | CPU, median peer (share of a core) | "
        "per link | busiest peer | RSS, median peer | busiest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['transport']} | {r['n']} | {r['n'] - 1} | failed: "
                         f"{r['failed']} | | | | |")
            continue
        links = max(r["n"] - 1, 1)
        lines.append(f"| {r['transport']} | {r['n']} | {r['n'] - 1} | {r['cpu_share']:.1%} | "
                     f"{r['cpu_share'] / links:.2%} | {r['cpu_max']:.1%} | "
                     f"{r['rss'] / 1e6:.0f} MB | {r['rss_max'] / 1e6:.0f} MB |")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("idle", text)


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    main()
