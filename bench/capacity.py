"""Capacity-weighted batches: a fast and a slow peer, with and without weighting.

    python -m bench.capacity            # the full run (about 6 minutes on 2 cores)
    python -m bench.capacity --quick    # smoke run, nothing written

Two ``daisyweb-peer`` processes pinned to cores 0 and 1 (``taskset``), one BLAS thread
each, the default model and mode, over aiortc on 127.0.0.1. The follower is made F times
slower with the test switch ``DAISYWEB_TEST_SLOW_FACTOR`` (each contribution takes F times
its compute time, as on a machine F times slower). For ``--capacity off`` and ``on``:
the group's tokens/s over the steady rounds (the first, unmeasured, is dropped), the
shares the leader set, and the seconds per round the fast peer waited for the slow one
(its exchange time minus the slow one's).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench._group import ENV, peer_command, records, run_pinned, signaling_server
from bench._results import machine, write_section
from daisyweb.rules import DEFAULTS

SEQ = int(DEFAULTS["seq"])


def pair(steps: int, capacity: str, factor: float, tmp: Path) -> dict:
    """One run of the fast leader and the slowed follower; the leader's steady rounds."""
    tag = f"{capacity}-{factor:g}"
    lead_m, slow_m = tmp / f"{tag}.jsonl", tmp / f"{tag}-slow.jsonl"
    with signaling_server(tmp) as url:
        base = peer_command(url, f"cap-{tag}".replace(".", "-"), "tests.fault_peer")
        lead = base + ["--start", "--wait-peers", "2", "--steps", str(steps),
                       "--capacity", capacity, "--metrics", str(lead_m)]
        slow_env = dict(ENV, DAISYWEB_TEST_SLOW_FACTOR=f"{factor:g}")
        run_pinned([(lead, ENV), (base + ["--metrics", str(slow_m)], slow_env)], tmp, tag)
    lead_r = [r for r in records(lead_m) if "round" in r]
    slow_r = {r["round"]: r for r in records(slow_m) if "round" in r}
    steady = lead_r[1:]
    wall = sum(r["wall_s"] for r in steady)
    inner = steady[-1]["step"] - lead_r[0]["step"]
    tokens = inner * int(DEFAULTS["batch"]) * 2 * SEQ  # the group's batch is unchanged
    waits = [r["exchange_s"] - slow_r[r["round"]]["exchange_s"] for r in steady
             if r["round"] in slow_r]
    me = lead_r[0]["roster"][0]
    shares = [r.get("shares") for r in steady]
    fast_share = [s[r["roster"].index(me)] if s else int(DEFAULTS["batch"])
                  for s, r in zip(shares, steady, strict=True)]
    return {"tokens_per_s": tokens / wall, "round_s": wall / len(steady),
            "wait_s": sum(waits) / max(len(waits), 1),
            "fast_share": sum(fast_share) / len(fast_share),
            "shares": sorted({tuple(s) for s in shares if s})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps = 64 if args.quick else 160
    factors = (3.0,) if args.quick else (2.0, 3.0)
    rows = ["| slow peer | capacity | group tokens/s | s per round | fast peer waits, s per "
            "round | fast peer's sequences per step (of 16) |",
            "|---|---|---:|---:|---:|---:|"]
    ratios = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for factor in factors:
            got = {}
            for capacity in ("off", "on"):
                r = got[capacity] = pair(steps, capacity, factor, tmp)
                rows.append(f"| {factor:g}x slower | {capacity} | {r['tokens_per_s']:,.0f} | "
                            f"{r['round_s']:.2f} | {r['wait_s']:.2f} | {r['fast_share']:.1f} |")
                print(rows[-1], flush=True)
            ratios.append((factor, got["on"]["tokens_per_s"] / got["off"]["tokens_per_s"]))
    body = "\n".join([
        "## Capacity-weighted batches (`python -m bench.capacity`)",
        "",
        f"Machine: {machine()}; load average before the run {load[0]:.2f}. Two peers "
        "pinned to cores 0 and 1, one BLAS thread each, default model and mode "
        f"({steps} steps: rounds of 32, int8, overlap 4); the follower slowed F times "
        "by `DAISYWEB_TEST_SLOW_FACTOR` (a sleep, so it does not load its core). The "
        "first round (no speed measured yet, equal shares) is left out.",
        "",
        *rows,
        "",
        "Group tokens/s with capacity on over off: "
        + ", ".join(f"{r:.2f}x with a {f:g}x slower peer" for f, r in ratios) + ".",
    ])
    print(body)
    if not args.quick:
        write_section("capacity", body)


if __name__ == "__main__":
    main()
