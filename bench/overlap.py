"""What running ahead costs: held-out loss at equal tokens against the head start's length.

    python -m bench.overlap           # writes the "overlap" section of TEST_RESULTS.md

``bench.rounds_sim`` at the demo default (two peers, rounds of 16, int4, 300 steps, the
product's own trainers, error feedback) with every member running the first K steps of
each round ahead of the group's update (``--overlap K``; K = 16: the whole round, the
update applied a round late), one process per run, two at a time, pinned to a core each.
A member picks K from its link (``daisyweb.training.overlap``): this table is what each
step ahead costs, which is why it picks no more than its exchange needs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from bench._group import ROOT
from bench._results import machine, write_section


def _one(k: int, seed: int, steps: int, h: int, codec: str, core: int) -> float:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(
        ["taskset", "-c", str(core), sys.executable, "-m", "bench.rounds_sim",
         "--sync-every", str(h), "--codec", codec, "--overlap", str(k), "--seed", str(seed),
         "--steps", str(steps), "--eval-every", str(steps)],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)["curve"][-1][1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="0,1,2,4,8,16")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--codec", default="int4")
    a = ap.parse_args()
    ks = [int(x) for x in a.ks.split(",")]
    jobs = [(k, s) for s in range(a.seeds) for k in ks]
    cores = os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=min(2, cores)) as pool:
        futures = [pool.submit(_one, k, s, a.steps, a.sync_every, a.codec, i % min(2, cores))
                   for i, (k, s) in enumerate(jobs)]
        finals: dict[int, list[float]] = {k: [] for k in ks}
        for (k, s), f in zip(jobs, futures, strict=True):
            finals[k].append(f.result())
            print(f"K={k} seed {s}: {finals[k][-1]:.4f}", flush=True)
    base = statistics.mean(finals[ks[0]])
    rows = [f"| steps ahead K | final held-out (mean) | against K={ks[0]} | per seed |",
            "|---:|---:|---:|---|"]
    for k in ks:
        mean = statistics.mean(finals[k])
        rows.append(f"| {k}{' (whole round)' if k == a.sync_every else ''} | {mean:.4f} | "
                    f"{mean - base:+.4f} | " + ", ".join(f"{x:.4f}" for x in finals[k]) + " |")
    section = [
        "## Running ahead of the group's update: held-out loss against K (bench.overlap)",
        "",
        f"`python -m bench.overlap --ks {a.ks} --seeds {a.seeds} --steps {a.steps} "
        f"--sync-every {a.sync_every} --codec {a.codec}` -- {machine()}. `bench.rounds_sim`:"
        f" two peers, rounds of {a.sync_every}, {a.codec}, {a.steps} steps, seeds "
        f"0-{a.seeds - 1}; every round's first K steps taken from the member's own weights "
        "before the group's update is known, then moved onto it. Same tokens in every row.",
        "",
        *rows,
    ]
    write_section("overlap", "\n".join(section))
    print("\n".join(section))


if __name__ == "__main__":
    main()
