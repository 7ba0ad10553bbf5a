"""Bounded influence, measured: what the clip costs an honest group, and what one member
shifting its round delta can do with and without it.

A group of ``--peers`` members at the demo default (rounds of 16, int4, the demo model)
is simulated with the product's own trainers, codec, norms, clip and roster-order
average (``bench.rounds_sim``); the last member is the attacker of issue 37: it adds
``--shift`` to every value of its round delta in rounds ``--from`` .. ``--from + 8``.
Four runs, one after another in this process: honest without and with the clip, attacked
without and with it. Reported: the held-out loss at the end (``daisyweb-eval``'s fixed
batches) and how many contributions were clipped.

    python -m bench.influence [--steps 300] [--peers 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench._results import machine, write_section
from bench.rounds_sim import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--shift", type=float, default=0.7)
    ap.add_argument("--from", dest="first", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    rounds = range(a.first, a.first + 9)

    def shift(r: int, delta: np.ndarray) -> np.ndarray:
        return delta + np.float32(a.shift) if r in rounds else delta

    rows = []
    for label, clip, attack in (("honest, no clip", False, None), ("honest, clip", True, None),
                                ("attacked, no clip", False, shift),
                                ("attacked, clip", True, shift)):
        t0 = time.perf_counter()
        res = simulate(a.peers, a.steps, 16, "int4", eval_every=a.steps, clip=clip,
                       attack=attack)
        rows.append((label, res.final, res.clipped, time.perf_counter() - t0))
        print(f"{label:20s} held-out {res.final:.4f}  clipped {res.clipped}  "
              f"({rows[-1][3]:.0f} s)", flush=True)
    base = rows[0][1]
    lines = [
        f"`python -m bench.influence --steps {a.steps} --peers {a.peers}` on {machine()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}. {a.peers} members in rounds of 16 (int4, the "
        f"demo model), simulated in one process with the product's trainers, codec, "
        f"norms, clip and average; the attacker adds {a.shift} to every value of its round "
        f"delta in rounds {rounds.start}-{rounds.stop - 1}. Held-out loss after "
        f"{a.steps} inner steps (`daisyweb-eval`'s fixed batches).",
        "",
        "| run | held-out loss | vs honest without clip | contributions clipped | s |",
        "|---|---|---|---|---|",
    ]
    for label, loss, clipped, secs in rows:
        lines.append(f"| {label} | {loss:.4f} | {loss - base:+.4f} | {clipped} | {secs:.0f} |")
    table = "\n".join(lines)
    print(table)
    if not a.no_write:
        write_section("influence", "## Bounded influence (bench.influence)\n\n" + table)


if __name__ == "__main__":
    main()
