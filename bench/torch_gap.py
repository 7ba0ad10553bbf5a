"""``python -m bench.torch_gap``: daisyweb's training against PyTorch float32 autograd.

Four runs of one peer from the same initial weights over the same batches (the default
model, batch and learning rate, the built-in corpus, a sampler seeded with one name),
each in a process of its own pinned to a core with one BLAS thread, two at a time:

- ``int8``: daisyweb's gradient through the int8 forward, stepped by DaisyAdam (a peer);
- ``float``: daisyweb's gradient through plain float32 GEMMs (``--compute float``);
- ``torch``: PyTorch autograd of the same architecture (``bench.torch_gpt``), DaisyAdam;
- ``torch AdamW``: the same gradients stepped by ``torch.optim.AdamW`` with DaisyAdam's
  settings (lr, betas 0.9/0.95, eps 1e-8, no weight decay), and with torch's default
  weight decay (0.01).

Held-out loss at 150, 300 and 600 steps (through each run's own forward: int8 for
``int8``, float32 for the rest), and per tensor, at the initial weights and at the float
run's weights after 300 steps, the cosine and norm ratio of daisyweb's float and int8
gradients against autograd's on that step's batch. TEST_RESULTS.md, "torch-gap".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench._group import ROOT
from bench._results import machine, write_section

CHECKPOINTS = (150, 300, 600)
KINDS = ("int8", "float", "torch", "torch-adamw", "torch-adamw-wd")
LABELS = {"int8": "daisyweb int8 forward, DaisyAdam",
          "float": "daisyweb float32 GEMMs, DaisyAdam",
          "torch": "PyTorch autograd, DaisyAdam",
          "torch-adamw": "PyTorch autograd, torch AdamW (no weight decay)",
          "torch-adamw-wd": "PyTorch autograd, torch AdamW (weight decay 0.01, torch's default)"}
COMPARE_AT = (0, 300)  # float run steps at which the gradients are compared per tensor


def _torch_grad(cfg, params: np.ndarray, batch: np.ndarray) -> tuple[float, np.ndarray]:
    import torch

    from bench.torch_gpt import torch_loss
    from daisyweb.model import param_layout

    flat = torch.tensor(params, dtype=torch.float32, requires_grad=True)
    p, off = {}, 0
    for name, shape in param_layout(cfg):
        n = math.prod(shape)
        p[name] = flat[off:off + n].view(shape)
        off += n
    loss = torch_loss(cfg, p, torch.tensor(batch[:, :-1], dtype=torch.long),
                      torch.tensor(batch[:, 1:], dtype=torch.long))
    loss.backward()
    return float(loss.item()), flat.grad.numpy().copy()


def _per_tensor(cfg, a: np.ndarray, b: np.ndarray) -> dict[str, tuple[float, float]]:
    """Per parameter kind (every layer's of one name together): cosine of ``a`` and
    ``b``, and the norm of ``a`` over the norm of ``b``."""
    from daisyweb.model import views

    va, vb = views(cfg, a), views(cfg, b)
    groups: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for name in va:
        kind = name.split(".", 1)[1] if name.startswith("h") and name[1].isdigit() else name
        ga, gb = groups.setdefault(kind, ([], []))
        ga.append(va[name].ravel().astype(np.float64))
        gb.append(vb[name].ravel().astype(np.float64))
    out = {}
    for kind, (xs, ys) in groups.items():
        x, y = np.concatenate(xs), np.concatenate(ys)
        nx, ny = float(np.linalg.norm(x)), float(np.linalg.norm(y))
        out[kind] = (float(x @ y) / (nx * ny) if nx and ny else 1.0, nx / ny if ny else 1.0)
    return out


def one(kind: str, steps: int, seed: int = 0) -> dict:
    """Train one run in this process: its held-out curve (and, for ``float``, the
    per-tensor gradient comparisons)."""
    import torch

    from daisyweb.data import BatchSampler, builtin_tokens, default_tokenizer
    from daisyweb.model import loss_and_grad
    from daisyweb.training.config import run_config
    from daisyweb.training.evaluate import heldout_batches, heldout_loss
    from daisyweb.training.state import TrainState

    torch.set_num_threads(1)
    tok = default_tokenizer()
    run = run_config(tok.vocab_size, steps=steps, sync_every=1, codec="f32", seed=seed,
                     compute="int8" if kind == "int8" else "float")
    state = TrainState.fresh(run)
    cfg = run.model
    sampler = BatchSampler(builtin_tokens(), batch=run.batch, seq=cfg.seq, seed=run.seed,
                           peer="bench-torch-gap")
    data = heldout_batches(cfg.seq)
    adamw = None
    if kind.startswith("torch-adamw"):
        flat = torch.tensor(state.params, dtype=torch.float32, requires_grad=True)
        adam = run.adam()
        adamw = torch.optim.AdamW([flat], lr=adam.lr, betas=(adam.beta1, adam.beta2),
                                  eps=adam.eps,
                                  weight_decay=0.01 if kind.endswith("-wd") else 0.0)
    curve, compared = {}, {}
    for step in range(steps):
        batch = sampler.sample(step + 1)
        if kind == "float" and step in COMPARE_AT:
            _, g_float = loss_and_grad(cfg, state.params, batch, quantized=False)
            _, g_int8 = loss_and_grad(cfg, state.params, batch, quantized=True)
            _, g_torch = _torch_grad(cfg, state.params, batch)
            compared[step] = {"float": _per_tensor(cfg, g_float, g_torch),
                              "int8": _per_tensor(cfg, g_int8, g_torch)}
        if kind.startswith("torch"):
            _, grad = _torch_grad(cfg, state.params, batch)
        else:
            _, grad = state.gradient(batch)
        if adamw is not None:
            adamw.zero_grad()
            adamw.param_groups[0]["params"][0].grad = torch.from_numpy(grad)
            adamw.step()
            state.params = adamw.param_groups[0]["params"][0].detach().numpy().copy()
        else:
            state.apply(grad)
        if step + 1 in CHECKPOINTS:
            curve[step + 1] = heldout_loss(cfg, state.params, data, run.quantized)
    return {"kind": kind, "curve": curve, "compared": compared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help="the run's seed: initial weights "
                    "and batches (default 0)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.steps, a.seed)))
        return
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")

    def run(kind: str, core: int) -> dict:
        out = subprocess.run(["taskset", "-c", str(core), sys.executable, "-m",
                              "bench.torch_gap", "--one", kind, "--steps", str(a.steps),
                              "--seed", str(a.seed)],
                             cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        return json.loads(out.stdout)

    t0 = time.time()
    with ThreadPoolExecutor(2) as pool:
        results = {r["kind"]: r for r in pool.map(run, KINDS, [i % 2 for i in
                                                               range(len(KINDS))])}
    shown = [s for s in CHECKPOINTS if s <= a.steps]
    rows = ["| run | " + " | ".join(f"held-out at {s}" for s in shown) + " |",
            "|---|" + "---:|" * len(shown)]
    for kind in KINDS:
        curve = results[kind]["curve"]
        rows.append(f"| {LABELS[kind]} | " + " | ".join(f"{curve[str(s)]:.4f}"
                                                         for s in shown) + " |")
    compared = results["float"]["compared"]
    grad_rows = ["| tensor | " + " | ".join(
        f"{w} vs autograd at step {s}: cosine, norm ratio" for s in compared
        for w in ("float", "int8")) + " |", "|---|" + "---:|" * (2 * len(compared))]
    for tensor in next(iter(compared.values()))["float"]:
        cells = []
        for s in compared:
            for w in ("float", "int8"):
                cos, ratio = compared[s][w][tensor]
                cells.append(f"{cos:.6f}, {ratio:.4f}")
        grad_rows.append(f"| {tensor} | " + " | ".join(cells) + " |")
    section = [
        "## daisyweb against PyTorch autograd (bench.torch_gap)",
        "",
        f"`python -m bench.torch_gap --steps {a.steps} --seed {a.seed}` -- {machine()}; "
        f"{time.time() - t0:.0f} s. One peer, default model, batch and lr, the same initial "
        "weights and batches of the built-in corpus for every run, two processes at a "
        "time pinned to cores 0 and 1 (one BLAS and one torch thread each); held-out "
        "through each run's own forward (int8 for the int8 run, float32 for the rest).",
        "",
        *rows,
        "",
        "Per parameter kind (every layer's together), on the float run's batch at that "
        "step: daisyweb's float and int8 gradients against autograd's.",
        "",
        *grad_rows,
    ]
    text = "\n".join(section)
    if not a.no_write:
        write_section("torch-gap", text)
    print(text)


if __name__ == "__main__":
    main()
