"""Training-step benchmark: numpy model (int8 forward GEMMs) + DaisyAdam vs PyTorch CPU float32.

    python -m bench.step           # full run, writes the "step" section of TEST_RESULTS.md
    python -m bench.step --quick   # smoke run: few rounds, nothing written

A step is ``loss_and_grad`` (forward through ``kernels.int8_matmul``, float32 backward)
plus one ``DaisyAdam`` update, against the same architecture, initial weights and batch in
PyTorch float32 (autograd + ``torch.optim.AdamW``, same hyperparameters). Both run in the
same interleaved rounds, so load from other processes hits them alike; the table reports
the best round and the median round. tokens/s = batch * seq / seconds per step.

Peak RSS is measured in a separate child process (``--rss-child``) that runs 20 training
steps at the default config without importing torch, via ``resource.getrusage``.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import kernels
from bench._results import machine, write_section
from daisyweb.model import ModelConfig, init_params, loss_and_grad, param_count, param_layout
from daisyweb.optim import AdamConfig, DaisyAdam

TORCH_THREADS = 2
LR = 3e-3
RSS_STEPS = 20


@dataclass(frozen=True)
class Case:
    label: str
    cfg: ModelConfig
    batch: int = 8


DEFAULT = Case("default", ModelConfig(vocab=2048, width=128, layers=4, heads=4, seq=64))
WIDE = Case("width 256 / 6 layers", ModelConfig(vocab=2048, width=256, layers=6, heads=8,
                                                seq=64))


def _batch(case: Case, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, case.cfg.vocab, size=(case.batch, case.cfg.seq + 1))


def numpy_step(case: Case) -> Callable[[], float]:
    """One training step of the numpy model; returns the loss."""
    params = init_params(case.cfg, 0)
    opt = DaisyAdam(AdamConfig(lr=LR), params.size)
    batch = _batch(case)

    def step() -> float:
        loss, grad = loss_and_grad(case.cfg, params, batch)
        opt.step(params, grad)
        return loss

    return step


def torch_step(case: Case) -> Callable[[], float]:
    """The same model, initial weights and batch in PyTorch CPU float32."""
    import torch

    from bench.torch_gpt import torch_loss

    torch.set_num_threads(TORCH_THREADS)
    cfg = case.cfg
    flat = init_params(cfg, 0)
    tensors: dict[str, torch.Tensor] = {}
    off = 0
    for name, shape in param_layout(cfg):
        n = math.prod(shape)
        tensors[name] = torch.tensor(flat[off:off + n].reshape(shape), requires_grad=True)
        off += n
    opt = torch.optim.AdamW(list(tensors.values()), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    batch = torch.tensor(_batch(case), dtype=torch.long)
    inp, tgt = batch[:, :-1], batch[:, 1:].reshape(-1)

    def step() -> float:
        loss = torch_loss(cfg, tensors, inp, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.item())

    return step


def _timed(fn: Callable[[], Any], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def measure(case: Case, rounds: int, reps: int) -> dict[str, Any]:
    np_fn = numpy_step(case)
    th_fn = torch_step(case)
    first = {"numpy": np_fn(), "torch": th_fn()}  # also warm-up (gate, buffers, threads)
    np_fn()
    th_fn()
    times: dict[str, list[float]] = {"numpy": [], "torch": []}
    for _ in range(rounds):
        times["numpy"].append(_timed(np_fn, reps))
        times["torch"].append(_timed(th_fn, reps))
    tokens = case.batch * case.cfg.seq
    out: dict[str, Any] = {"case": case, "first_loss": first}
    for name, ts in times.items():
        out[name] = {"best": min(ts), "median": statistics.median(ts),
                     "tps_best": tokens / min(ts), "tps_median": tokens / statistics.median(ts)}
    return out


def rss_child() -> None:
    """20 training steps at the default config; print peak RSS in KiB. Never imports torch."""
    step = numpy_step(DEFAULT)
    for _ in range(RSS_STEPS):
        step()
    if "torch" in sys.modules:
        raise SystemExit("the RSS child must not import torch")
    hwm = "0"
    if os.path.exists("/proc/self/status"):  # Linux: this process image's own peak
        with open("/proc/self/status", encoding="ascii") as f:
            hwm = next((ln.split()[1] for ln in f if ln.startswith("VmHWM:")), "0")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, hwm)  # both KiB on Linux


def measure_rss() -> tuple[float, float]:
    """Peak RSS (MiB) of a separate training process at defaults: (ru_maxrss, VmHWM).

    Linux carries ru_maxrss across fork+exec from the parent's memory image, so this runs
    before the parent imports torch or builds any model (the parent is then far smaller
    than the child); VmHWM, which exec resets, is printed as a cross-check.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "bench.step", "--rss-child"], cwd=root,
                       capture_output=True, text=True, check=True, timeout=600)
    maxrss, hwm = r.stdout.strip().splitlines()[-1].split()
    return int(maxrss) / 1024.0, int(hwm) / 1024.0


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| config | params | batch x seq | numpy int8 step ms (best / median) "
        "| numpy tokens/s | torch fp32 step ms (best / median) | torch tokens/s "
        "| ratio best (median) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        case: Case = r["case"]
        c = case.cfg
        npr, thr = r["numpy"], r["torch"]
        lines.append(
            f"| {case.label} (w{c.width} L{c.layers} H{c.heads} V{c.vocab}) "
            f"| {param_count(c):,} | {case.batch} x {c.seq} "
            f"| {npr['best'] * 1e3:.1f} / {npr['median'] * 1e3:.1f} | {npr['tps_best']:,.0f} "
            f"| {thr['best'] * 1e3:.1f} / {thr['median'] * 1e3:.1f} | {thr['tps_best']:,.0f} "
            f"| {npr['tps_best'] / thr['tps_best']:.2f}x "
            f"({npr['tps_median'] / thr['tps_median']:.2f}x) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few rounds, nothing written")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        rss_child()
        return
    rounds, reps = (2, 1) if args.quick else (7, 3)
    cases = [DEFAULT] if args.quick else [DEFAULT, WIDE]
    if "torch" in sys.modules:
        raise SystemExit("measure the RSS child before torch is imported")
    rss, hwm = measure_rss()
    results = []
    for case in cases:
        results.append(measure(case, rounds, reps))
        print(f"measured {case.label}", file=sys.stderr)
    import torch  # already imported by torch_step; only for the version string

    blas_threads = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    cmd = "python -m bench.step" + (" --quick" if args.quick else "")
    first = results[0]["first_loss"]
    md = "\n".join([
        "## Training step: numpy int8 model + DaisyAdam vs PyTorch CPU float32",
        "",
        f"Command: `{cmd}` (from the repository root). Machine: {machine()}.",
        "",
        f"A step = forward (every linear layer through `kernels.int8_matmul`, backend "
        f"`{kernels.active_backend()}`), float32 backward, DaisyAdam; PyTorch {torch.__version__}"
        f" runs the same model, initial weights and batch in float32 with autograd and "
        f"`torch.optim.AdamW`, `torch.set_num_threads({TORCH_THREADS})`; numpy's BLAS uses "
        f"its default threads (OPENBLAS_NUM_THREADS={blas_threads})."
        f" {rounds} interleaved rounds of {reps} steps each after 2 warm-up steps; the "
        f"machine is shared with other jobs, so the best round is the cleaner number.",
        "",
        table(results),
        "",
        f"First-step loss at defaults: numpy int8 {first['numpy']:.4f}, torch float32 "
        f"{first['torch']:.4f} (ln 2048 = {math.log(2048):.4f}).",
        "",
        f"Peak RSS of a separate training process at defaults ({RSS_STEPS} steps, torch not "
        f"imported, `resource.getrusage(RUSAGE_SELF).ru_maxrss`): **{rss:.1f} MiB** "
        f"(bar: < 400 MB); the child's own VmHWM: {hwm:.1f} MiB.",
    ])
    print(md)
    if not args.quick:
        write_section("step", md)


if __name__ == "__main__":
    main()
