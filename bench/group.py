"""Per-step (or per-round) communication and compute time of a training group on
loopback, per WebRTC transport.

Runs ``daisyweb-demo --peers N --transport T`` (a signaling server and N peer processes
on 127.0.0.1, default model) inside a loopback-only network namespace (``bench/_netns.py``,
the same for both transports) and reads the leader's ``--metrics`` records.

    python -m bench.group            # N = 2, 3; aiortc and libwebrtc; lockstep and rounds
    python -m bench.group --quick    # N = 2, lockstep, 3 steps, nothing written
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench._netns import run_isolated
from bench._results import machine, write_section
from daisyweb.model import ModelConfig, param_count
from daisyweb.rules import DEFAULTS

BATCH, SEQ = 8, 64
TRANSPORTS = ("aiortc", "libwebrtc")
H = int(DEFAULTS["sync_every"])
# (label, demo flags, steps): lockstep f32 is where the link matters most; the second row
# is the demo's default mode, labelled from the defaults so the label follows them
MODES = (("lockstep f32", ["--sync-every", "1", "--codec", "f32"], 8),
         (f"rounds H={H} {DEFAULTS['codec']} (default)", [], 6 * H))


def run_group(peers: int, steps: int, transport: str, flags: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        proc = run_isolated(
            [sys.executable, "-m", "daisyweb.cli.demo", "--peers", str(peers),
             "--steps", str(steps), "--port", "0", "--metrics", str(metrics),
             "--transport", transport, *flags], timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"demo with {peers} {transport} peers failed:\n"
                             f"{proc.stdout[-2000:]}")
        return [r for r in map(json.loads, metrics.read_text().splitlines()) if "comm_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sizes = (2,) if args.quick else (2, 3)
    modes = ((MODES[0][0], MODES[0][1], 3),) if args.quick else MODES
    params = param_count(ModelConfig(vocab=2048))
    load = os.getloadavg()
    rows = ["| mode | transport | peers | commit wall s (median) | comm s | compute s | "
            "group tokens/s | payload bytes sent per peer per commit |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for label, flags, steps in modes:
        for n in sizes:
            for transport in TRANSPORTS:  # side by side, interleaved
                recs = run_group(n, steps, transport, flags)[1:]  # the first: warm-up
                wall = statistics.median(r["wall_s"] for r in recs)
                comm = statistics.median(r["comm_s"] for r in recs)
                compute = statistics.median(r["compute_s"] for r in recs)
                inner = recs[-1]["sync_every"]
                sent = (recs[-1]["bytes_sent"] - recs[0]["bytes_sent"]) / max(1, len(recs) - 1)
                rows.append(f"| {label} | {transport} | {n} | {wall:.2f} | {comm:.2f} | "
                            f"{compute:.2f} | {n * BATCH * SEQ * inner / wall:,.0f} | "
                            f"{sent / 1e6:.2f} MB |")
                print(rows[-1], flush=True)
    md = "\n".join([
        "## Training group on loopback: where a commit's time goes, per transport",
        "",
        f"Command: `python -m bench.group{' --quick' if args.quick else ''}`. "
        f"Machine: {machine()}; load average {load[0]:.1f} at the start. All peers share "
        "this machine's 2 cores (the demo gives each one BLAS thread), each group in its "
        "own loopback-only network namespace.",
        "",
        f"`daisyweb-demo --peers N --transport T` at the default model ({params:,} "
        f"parameters, batch {BATCH} x seq {SEQ} per peer), medians over the leader's "
        f"commits after the first (a commit is a step in lockstep, a round of {H} steps "
        "otherwise). `comm_s`: from the local contribution being ready to the roster's "
        "all present; `compute_s`: forward + backward + Adam (+ hashes). Bytes: this "
        "peer's own encoded contributions (one payload, sent to each other member).",
        "",
        *rows,
        "",
        "In lockstep f32 every peer sends its full float32 gradient to every other member "
        "each step: the link's rate decides the step time, and libwebrtc's C++ SCTP "
        "moves it several times faster than aiortc's pure-Python one (bench:mesh). In "
        "the default rounds mode the exchange is small and rare, so the transport matters "
        "little; with N processes on 2 cores compute is shared too.",
    ])
    print(md)
    if not args.quick:
        write_section("group", md)


if __name__ == "__main__":
    main()
