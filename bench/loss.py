"""Loss curve of one-peer training at the default config on the built-in corpus.

Runs the same loop as ``daisyweb-demo --peers 1`` (``daisyweb.training.loop.train_local``) and
records the training loss every step plus a held-out loss (a fixed set of batches from
the last 5% of the corpus, never trained on) at a few points.

    python -m bench.loss            # 300 steps at defaults
    python -m bench.loss --quick    # 30 steps, smoke run
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from bench._results import machine, write_section
from daisyweb.checkpoints.checkpoint import TokenizerInfo
from daisyweb.data import BatchSampler, builtin_tokens, default_tokenizer
from daisyweb.model import ModelConfig
from daisyweb.training.config import RunConfig
from daisyweb.training.evaluate import heldout_batches, heldout_loss
from daisyweb.training.loop import StepRecord, train_local
from daisyweb.training.state import TrainState


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    steps = 30 if args.quick else args.steps

    tok = default_tokenizer()
    run = RunConfig(model=ModelConfig(vocab=tok.vocab_size), steps=steps)
    # builtin_tokens() is the training part; the held-out 5% is daisyweb-eval's batches.
    train = BatchSampler(np.asarray(builtin_tokens()), batch=run.batch, seq=run.model.seq,
                         seed=run.seed, peer="bench")
    held_batches = heldout_batches(run.model.seq)

    state = TrainState.fresh(run)
    records: list[StepRecord] = []
    evals: dict[int, float] = {}
    marks = sorted({0, *(int(steps * f) for f in (0.25, 0.5, 0.75)), steps})

    def held_loss() -> float:
        return heldout_loss(run.model, state.params, held_batches)

    evals[0] = held_loss()

    def on_step(rec: StepRecord) -> None:
        records.append(rec)
        if rec.step in marks:
            evals[rec.step] = held_loss()

    t0 = time.perf_counter()
    train_local(state, train.sample, tokenizer=TokenizerInfo(tok.vocab_size, tok.file_hash),
                on_step=on_step)
    wall = time.perf_counter() - t0

    def window(end: int) -> float:
        chunk = [r.loss for r in records[max(0, end - 10):end]]
        return float(np.mean(chunk))

    rows = ["| step | train loss (mean of last 10 steps) | held-out loss |", "|---:|---:|---:|"]
    for m in marks:
        train_cell = f"{records[0].loss:.3f} (first step)" if m == 0 else f"{window(m):.3f}"
        rows.append(f"| {m} | {train_cell} | {evals[m]:.3f} |")
    tps = sum(r.step and 1 for r in records) * run.batch * run.model.seq / wall
    md = "\n".join([
        "## Loss curve: one peer, default config, built-in corpus",
        "",
        f"Command: `python -m bench.loss{' --quick' if args.quick else ''}`. "
        f"Machine: {machine()}.",
        "",
        f"Model vocab {run.model.vocab}, width {run.model.width}, {run.model.layers} layers, "
        f"{run.model.heads} heads, seq {run.model.seq}; batch {run.batch}, lr {run.lr}, "
        f"seed {run.seed}; {steps} steps in {wall:.1f} s ({tps:,.0f} tokens/s including "
        f"held-out evaluation). ln(vocab) = {math.log(run.model.vocab):.3f}. Held-out: "
        "daisyweb-eval's fixed batches of the last 5% of the corpus, never trained on.",
        "",
        *rows,
        "",
        f"Final weight hash: `{state.weight_hash()[:16]}`.",
    ])
    print(md)
    if not args.quick:
        write_section("loss", md)


if __name__ == "__main__":
    main()
