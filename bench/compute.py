"""``python -m bench.compute``: the int8 forward against plain float32 GEMMs (``--compute``).

One peer alone (a lockstep run of one: the same DaisyAdam steps a group takes), the
default model, batch and learning rate, the built-in corpus with the same batches for
both (sampler seeded with one name), 600 steps. The two runs go side by side, each in a
process of its own pinned to its own core with one BLAS thread; held-out loss (each
through the forward it trained with) at 150, 300 and 600 steps, and the training
seconds per step without the evaluations. The table goes to TEST_RESULTS.md ("compute").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from bench._group import ROOT
from bench._results import machine, write_section

CHECKPOINTS = (150, 300, 600)


def one(compute: str, steps: int) -> dict:
    """Train one peer in this process; its held-out curve and seconds per step."""
    from daisyweb.data import BatchSampler, builtin_tokens, default_tokenizer
    from daisyweb.training.config import run_config
    from daisyweb.training.evaluate import heldout_batches, heldout_loss
    from daisyweb.training.state import TrainState

    tok = default_tokenizer()
    run = run_config(tok.vocab_size, steps=steps, sync_every=1, codec="f32",
                     compute=compute)
    state = TrainState.fresh(run)
    sampler = BatchSampler(builtin_tokens(), batch=run.batch, seq=run.model.seq,
                           seed=run.seed, peer="bench-compute")
    data = heldout_batches(run.model.seq)
    curve, train_s = {}, 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        _, grad = state.gradient(sampler.sample(step + 1))
        state.apply(grad)
        train_s += time.perf_counter() - t0
        if step + 1 in CHECKPOINTS:
            curve[step + 1] = heldout_loss(run.model, state.params, data, run.quantized)
    return {"compute": compute, "curve": curve, "step_s": train_s / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--one", choices=("int8", "float"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.steps)))
        return
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")

    def run(compute: str, core: int) -> dict:
        out = subprocess.run(["taskset", "-c", str(core), sys.executable, "-m",
                              "bench.compute", "--one", compute, "--steps", str(a.steps)],
                             cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        return json.loads(out.stdout)

    t0 = time.time()
    with ThreadPoolExecutor(2) as pool:
        int8, flt = pool.map(run, ("int8", "float"), (0, 1))
    rows = ["| compute | " + " | ".join(f"held-out at {s}" for s in CHECKPOINTS if s <= a.steps)
            + " | ms a step (training only) |",
            "|---|" + "---:|" * (len([s for s in CHECKPOINTS if s <= a.steps]) + 1)]
    for r in (int8, flt):
        rows.append(f"| {r['compute']} | " + " | ".join(
            f"{r['curve'][str(s)]:.4f}" for s in CHECKPOINTS if s <= a.steps)
            + f" | {1000 * r['step_s']:.1f} |")
    section = [
        "## The int8 forward against plain float32 GEMMs (bench.compute)",
        "",
        f"`python -m bench.compute --steps {a.steps}` -- {machine()}; "
        f"{time.time() - t0:.0f} s. One peer, default model, batch and lr, the same "
        "batches of the built-in corpus for both, side by side in two processes pinned to "
        "cores 0 and 1 (one BLAS thread each); held-out through each run's own forward.",
        "",
        *rows,
        "",
        f"float over int8: {flt['step_s'] / int8['step_s']:.2f}x the time a step.",
    ]
    write_section("compute", "\n".join(section))
    print("\n".join(section))


if __name__ == "__main__":
    main()
