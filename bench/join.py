"""What a joiner's inner moments are worth: held-out loss when a member comes back as a
joiner mid-run with the leader's moments (a whole snapshot) or none (the anchor alone).

    python -m bench.join            # writes the "join" section of TEST_RESULTS.md

``bench.rounds_sim`` at the demo default (two peers, rounds of 16, int4, overlap 2, 300
steps): at ``--round`` the second peer restarts as a joiner does (no head start, no error
feedback carried) from the group's anchor with its inner moments taken from the first
peer or set to zero; the same run without a rejoin for reference. Same seeds, same tokens.
"""

from __future__ import annotations

import argparse
import statistics

from bench._results import machine, write_section
from bench.rounds_sim import simulate

VARIANTS = (("never left", None), ("leader's moments (12P bytes)", "leader"),
            ("zero moments (4P bytes)", "zero"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--round", type=int, default=6, help="the rejoin's round (default 6: "
                    "after 96 of 300 steps)")
    a = ap.parse_args()
    finals: dict[str, list[float]] = {label: [] for label, _ in VARIANTS}
    mids: dict[str, list[float]] = {label: [] for label, _ in VARIANTS}
    for seed in range(a.seeds):
        for label, moments in VARIANTS:
            res = simulate(2, a.steps, 16, "int4", overlap=2, seed=seed,
                           eval_every=16, rejoin=None if moments is None
                           else (a.round, moments))
            after = [loss for step, loss in res.curve if step > 16 * a.round]
            finals[label].append(res.final)
            mids[label].append(after[0])
            print(f"seed {seed} {label}: first eval after the rejoin {after[0]:.4f}, "
                  f"final {res.final:.4f}", flush=True)
    rows = ["| joiner's inner moments | held-out one round after the rejoin (mean) | "
            "final held-out (mean) | per seed |", "|---|---:|---:|---|"]
    for label, _ in VARIANTS:
        rows.append(f"| {label} | {statistics.mean(mids[label]):.4f} | "
                    f"{statistics.mean(finals[label]):.4f} | "
                    + ", ".join(f"{x:.4f}" for x in finals[label]) + " |")
    section = [
        "## A joiner's inner moments (bench.join)",
        "",
        f"`python -m bench.join --seeds {a.seeds} --steps {a.steps} --round {a.round}` -- "
        f"{machine()}. `bench.rounds_sim` at the demo default (2 peers, rounds of 16, int4, "
        f"overlap 2, {a.steps} steps, seeds 0-{a.seeds - 1}); at round {a.round} (after "
        f"{16 * a.round} steps) the second peer restarts as a joiner (no head start, no "
        "error feedback carried) from the group's anchor, its inner moments the first "
        "peer's or zero. Held-out loss of the group's anchor, same tokens in every row.",
        "",
        *rows,
    ]
    write_section("join", "\n".join(section))
    print("\n".join(section))


if __name__ == "__main__":
    main()
