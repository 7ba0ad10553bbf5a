"""Peak resident memory of group peers, per transport, at the demo default.

Each scenario runs in its own loopback-only network namespace (``bench/_netns.py``; the
same for both transports, so the comparison is fair): a signaling server and N
``daisyweb-peer`` processes with BLAS at one thread each, as ``daisyweb-demo`` starts
them; after a third of the steps a joiner arrives (so the leader sends a snapshot
mid-run). Every peer writes ``peak_rss_bytes`` (VmHWM) in its end record.

    python -m bench.memory                 # 2 and 3 peers, both transports, 300 steps
    python -m bench.memory --steps 64 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._netns import run_isolated
from bench._results import machine, write_section
from daisyweb.rules import DEFAULTS

TRANSPORTS = ("aiortc", "libwebrtc")
MB = 1e6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_steps(metrics: Path, step: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists():
            steps = [json.loads(x).get("step", 0) for x in metrics.read_text().splitlines()]
            if steps and max(steps) >= step:
                return
        time.sleep(0.2)
    raise SystemExit(f"the leader did not reach step {step}")


def inner(transport: str, peers: int, steps: int, tmp: Path) -> dict:
    """One scenario (inside the namespace): returns peak RSS by role."""
    port = _free_port()
    server = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    sig = subprocess.Popen([sys.executable, "-m", "signaling.cli", "--host", "127.0.0.1",
                            "--port", str(port), "--data", "builtin"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs: list[tuple[str, subprocess.Popen, Path]] = []

    def spawn(role: str, *extra: str) -> subprocess.Popen:
        metrics = tmp / f"{role}.jsonl"
        log = open(tmp / f"{role}.log", "w")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(
            [sys.executable, "-m", "daisyweb.cli.peer", "--server", server, "--room",
             "membench", "--ice-host", "127.0.0.1", "--approve", "auto", "--transport",
             transport, "--metrics", str(metrics), *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((role, p, metrics))
        return p

    try:
        time.sleep(1.0)
        lead = spawn("leader", "--start", "--steps", str(steps), "--wait-peers", str(peers))
        time.sleep(1.0)
        for i in range(1, peers):
            spawn(f"follower{i}")
        _wait_steps(tmp / "leader.jsonl", steps // 3, lead, 600)
        spawn("joiner")
        for role, p, _ in procs:
            if p.wait(timeout=900) != 0:
                raise SystemExit(f"{role} failed:\n{(tmp / f'{role}.log').read_text()[-2000:]}")
        out = {}
        for role, _, metrics in procs:
            recs = [json.loads(x) for x in metrics.read_text().splitlines()]
            out[role] = recs[-1]["peak_rss_bytes"]
        return out
    finally:
        for _, p, _ in procs:
            if p.poll() is None:
                p.kill()
        sig.terminate()
        sig.wait(timeout=10)


def scenario(transport: str, peers: int, steps: int) -> dict:
    r = run_isolated([sys.executable, "-m", "bench.memory", "--inner", transport,
                      str(peers), str(steps)], timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{transport} x {peers} failed:\n{r.stdout[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", nargs=3, metavar=("TRANSPORT", "PEERS", "STEPS"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="print only, do not record")
    args = ap.parse_args()
    if args.inner:
        with tempfile.TemporaryDirectory() as tmp:
            t, n, s = args.inner
            print(json.dumps(inner(t, int(n), int(s), Path(tmp))))
        return
    load = os.getloadavg()
    rows = ["| transport | peers (+ a joiner) | leader | follower(s) | joiner |",
            "|---|---:|---:|---:|---:|"]
    for transport in TRANSPORTS:
        for n in (2, 3):
            peaks = scenario(transport, n, args.steps)
            followers = [v for k, v in peaks.items() if k.startswith("follower")]
            rows.append(f"| {transport} | {n} | {peaks['leader'] / MB:.0f} MB | "
                        + " / ".join(f"{f / MB:.0f}" for f in followers) + " MB | "
                        f"{peaks['joiner'] / MB:.0f} MB |")
            print(rows[-1], flush=True)
    md = "\n".join([
        "## Peak resident memory of group peers",
        "",
        f"Command: `python -m bench.memory --steps {args.steps}`. Machine: {machine()}; "
        f"load average {load[0]:.1f} at the start.",
        "",
        f"VmHWM of each peer process over a whole run of {args.steps} steps at the demo "
        f"default (1,325,824 parameters, rounds of {DEFAULTS['sync_every']} steps, "
        f"{DEFAULTS['codec']}), BLAS at one thread, "
        "each scenario in its own loopback-only network namespace; a joiner arrives "
        "after a third of the steps, so the leader's figure includes sending it a "
        "snapshot and the joiner's includes receiving one.",
        "",
        *rows,
    ])
    print(md)
    if not args.quick:
        write_section("memory", md)


if __name__ == "__main__":
    main()
