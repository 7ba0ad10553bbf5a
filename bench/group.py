"""Per-step communication and compute time of a training group on loopback.

Runs ``daisyweb-demo --peers N`` (a signaling server and N peer processes on 127.0.0.1,
default model) for a few steps and reads the leader's ``--metrics`` records.

    python -m bench.group            # N = 2, 3, 4; 8 steps each
    python -m bench.group --quick    # N = 2; 3 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._results import machine, write_section
from daisyweb.model import ModelConfig, param_count

BATCH, SEQ = 8, 64


def run_group(peers: int, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "daisyweb.cli.demo", "--peers", str(peers),
             "--steps", str(steps), "--port", "0", "--metrics", str(metrics)],
            capture_output=True, text=True, timeout=900, cwd=tmp)
        if proc.returncode != 0:
            raise SystemExit(f"demo with {peers} peers failed:\n{proc.stdout[-2000:]}")
        return [r for r in map(json.loads, metrics.read_text().splitlines()) if "comm_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sizes, steps = ((2,), 3) if args.quick else ((2, 3, 4), 8)
    params = param_count(ModelConfig(vocab=2048))
    rows = ["| peers | step wall s (median) | comm s | compute s | group tokens/s | "
            "gradient bytes sent per peer per step |", "|---:|---:|---:|---:|---:|---:|"]
    for n in sizes:
        recs = run_group(n, steps)[1:]  # step 1 includes connection warm-up
        wall = statistics.median(r["wall_s"] for r in recs)
        comm = statistics.median(r["comm_s"] for r in recs)
        compute = statistics.median(r["compute_s"] for r in recs)
        sent = 4 * params * (n - 1)
        rows.append(f"| {n} | {wall:.2f} | {comm:.2f} | {compute:.2f} | "
                    f"{n * BATCH * SEQ / wall:,.0f} | {sent / 1e6:.1f} MB |")
        print(rows[-1], flush=True)
    md = "\n".join([
        "## Training group on loopback: where a step's time goes",
        "",
        f"Command: `python -m bench.group{' --quick' if args.quick else ''}`. "
        f"Machine: {machine()}. All peers share this machine's 2 cores.",
        "",
        f"`daisyweb-demo --peers N` at the default model ({params:,} parameters, batch "
        f"{BATCH} x seq {SEQ} per peer), medians over steps 2-{steps} of the leader's "
        "metrics. `comm_s`: time from the local gradient being ready to the roster's "
        "gradients all present; `compute_s`: forward + backward + Adam + hashes.",
        "",
        *rows,
        "",
        "Every step each peer sends its full float32 gradient to every other member over "
        "an aiortc data channel (11-26 MB/s between two idle processes here, "
        "depending on load: see the mesh section), so the bytes each peer sends grow "
        "with N-1. aiortc's SCTP and DTLS run in Python on the CPU, so here, with N "
        "processes on 2 cores, both communication "
        "and compute slow down as N grows; a single process (bench:step) is faster than "
        "any loopback group. On separate machines compute runs in parallel and the data "
        "channel's throughput is the limit.",
    ])
    print(md)
    if not args.quick:
        write_section("group", md)


if __name__ == "__main__":
    main()
