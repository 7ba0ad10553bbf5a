"""Kernel benchmark: exact int8 GEMM vs numpy float32/int32 matmul, lut, int8_matmul, audit.

    python -m bench.kernels           # full run, writes the "kernels" section of TEST_RESULTS.md
    python -m bench.kernels --quick   # smoke run: small shapes, few repeats, nothing written

Timing: every method of a shape runs in the same interleaved rounds (so load from other
processes hits all of them alike) and the best round is reported; GFLOP/s = 2mkn / time.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np

import kernels
from bench._results import machine, write_section
from kernels import audit, dispatch

SHAPES = [(256, 256, 256), (512, 512, 512), (1024, 768, 768), (2048, 768, 3072)]
QUICK_SHAPES = [(256, 256, 256), (512, 512, 512)]
#: skip a slow baseline (int32 matmul, lut) when one run would take longer than this
SLOW_LIMIT_S = 20.0


def _once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _round(fn: Callable[[], object], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def best_times(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    # warm-up (gates, buffers, BLAS threads); then enough calls per round to fill ~10 ms
    reps = {name: max(1, int(0.01 / max(_once(fn), _once(fn), 1e-6))) for name, fn in fns.items()}
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], _round(fn, reps[name]))
    return best


def audit_cost(a: np.ndarray, b: np.ndarray, acc: np.ndarray, reps: int) -> float:
    """Best-of time of one live audit (the default budget) of this GEMM's result."""
    audit.check(a, b, acc)
    return min(_once(lambda: audit.check(a, b, acc)) for _ in range(reps))


def run_shape(m: int, k: int, n: int, rounds: int, slow_rate: dict[str, float]) -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    a, _ = kernels.quantize_rows(x)
    b, _ = kernels.quantize_cols(w)
    flops = 2.0 * m * k * n
    fns: dict[str, Callable[[], object]] = {
        "f32": lambda: np.matmul(x, w),
        "gemm": lambda: kernels.gemm_int8(a, b),
        "mm": lambda: kernels.int8_matmul(x, w),
    }
    t = best_times(fns, rounds)
    row: dict = {"shape": f"{m}x{k}x{n}", "backend": kernels.active_backend()}
    row.update({key: flops / t[key] / 1e9 for key in t})
    audit.configure(enabled=False)
    try:
        t_noaudit = best_times({"gemm": lambda: kernels.gemm_int8(a, b)}, rounds)["gemm"]
    finally:
        audit.configure(enabled=True)
    acc = kernels.gemm_int8(a, b)
    cost = audit_cost(a, b, acc, 200)
    row["audit_us"] = cost * 1e6
    row["audit_pct"] = 100.0 * cost / t_noaudit
    # slow baselines: run once if the rate measured on a smaller shape predicts it is quick
    a32, b32 = a.astype(np.int32), b.astype(np.int32)
    slow = {"i32": lambda: np.matmul(a32, b32), "lut": lambda: _lut(a, b)}
    for key, fn in slow.items():
        rate = slow_rate.get(key)
        if rate is not None and flops / rate > SLOW_LIMIT_S:
            row[key] = None
            continue
        dt = _once(fn)
        slow_rate[key] = flops / dt
        row[key] = flops / dt / 1e9
    return row


def _lut(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with kernels.use_backend("lut"):
        return kernels.gemm_int8(a, b)


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "skipped" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    head = ("| shape m x k x n | backend | gemm_int8 GFLOP/s | numpy f32 GFLOP/s | gemm / f32 | "
            "int8_matmul GFLOP/s | int8_matmul / f32 | numpy int32 GFLOP/s | lut GFLOP/s | "
            "audit us / GEMM | audit % of GEMM |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['backend']} | {r['gemm']:.1f} | {r['f32']:.1f} | "
            f"{r['gemm'] / r['f32']:.2f}x | {r['mm']:.1f} | {r['mm'] / r['f32']:.2f}x | "
            f"{_fmt(r['i32'], '.2f')} | {_fmt(r['lut'], '.2f')} | {r['audit_us']:.1f} | "
            f"{r['audit_pct']:.2f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, few rounds, no write")
    args = p.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rounds = 3 if args.quick else 30
    dispatch.reset()
    load = os.getloadavg()[0]  # the machine is shared: say how busy it was
    slow_rate: dict[str, float] = {}
    rows = [run_shape(m, k, n, rounds, slow_rate) for m, k, n in shapes]
    md = table(rows)
    verdict = {True: "passed", False: "demoted", None: "not gated (never needed; lazy)"}
    gate = ", ".join(f"{name} {verdict[ok]}" for name, ok in kernels.gate_verdicts())
    cmd = "python -m bench.kernels" + (" --quick" if args.quick else "")
    body = "\n".join([
        "## Kernels: exact int8 GEMM vs numpy matmul",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine()}; 1-min load average at start {load:.1f}  ",
        f"Gates: {gate}; probe hash {kernels.probe_hash()[:16]}...",
        "",
        md,
        "",
        f"Best of {rounds} interleaved rounds per method (each round repeats the call to "
        "fill ~10 ms); GFLOP/s = 2mkn / time. "
        "`gemm_int8` runs on the active backend with the live audit on (its default); "
        "`int8_matmul` is quantize rows + quantize cols + GEMM + epilogue, end to end. "
        "numpy int32 matmul and `lut` run once; they are skipped (\"skipped\") where the "
        f"rate measured on the previous shape predicts more than {SLOW_LIMIT_S:.0f} s. "
        "Audit: one default-budget live audit "
        f"({audit.DEFAULT_BUDGET} cells, stratified) timed on its own, best of 200, as a "
        "share of the un-audited GEMM time. Bars: gemm_int8 >= 0.8x and int8_matmul >= "
        "0.5x of float32 matmul at 512^3 and above; audit < 1%.",
    ])
    print(body)
    if not args.quick:
        write_section("kernels", body)


if __name__ == "__main__":
    main()
