"""Training-step benchmark: numpy model (int8 forward GEMMs) + DaisyAdam vs PyTorch CPU float32.

    python -m bench.step           # full run, writes the "step" section of TEST_RESULTS.md
    python -m bench.step --quick   # smoke run: default config, few rounds, nothing written

A step is ``loss_and_grad`` (forward through ``kernels.int8_matmul``, float32 backward,
the gradient into a reused buffer as a training loop does) plus one ``DaisyAdam`` update,
against the same architecture, initial weights and batch in PyTorch float32 (autograd +
``torch.optim.AdamW``, same hyperparameters).

Fairness: each side runs in its own worker process, started with its BLAS / OpenMP
threads set (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``torch.set_num_threads``),
at 1 thread (a group peer pinned to one core) and at 2 (one machine alone). The parent
alternates segments of ``reps`` steps between the two workers, so load from other
processes hits both alike, and waits ``SETTLE_S`` after each segment: BLAS worker threads
spin for a while after a call and would otherwise take a core from the other side. Two
checks show it worked: the idle worker's CPU time during the other's segments (should
be ~0), and the PyTorch median of a solo run (no numpy worker alive) next to its
interleaved median (should be equal within noise).

A per-phase table (numpy side, from a separate instrumented run of the same worker)
says where the step's time goes. Peak RSS is measured in a separate child process
(``--rss-child``) that runs 20 training steps at the default config without torch.
"""

from __future__ import annotations

import argparse
import json
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

from bench._results import machine, write_section
from daisyweb.model import ModelConfig, init_params, loss_and_grad, param_count, param_layout
from daisyweb.optim import AdamConfig, DaisyAdam

LR = 3e-3
RSS_STEPS = 20
THREADS = (1, 2)
SETTLE_S = 0.3  # > OpenBLAS's default thread spin (2**28 cycles, ~0.1 s here)
PHASE_STEPS = 10


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    cfg: ModelConfig
    batch: int = 8


DEFAULT = Case("default", "default", ModelConfig(vocab=2048, width=128, layers=4, heads=4,
                                                 seq=64))
WIDE = Case("wide", "width 256 / 6 layers", ModelConfig(vocab=2048, width=256, layers=6,
                                                        heads=8, seq=64))
CASES = {c.key: c for c in (DEFAULT, WIDE)}


def _batch(case: Case, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, case.cfg.vocab, size=(case.batch, case.cfg.seq + 1))


def numpy_step(case: Case) -> Callable[[], float]:
    """One training step of the numpy model (gradient into a reused buffer); the loss."""
    params = init_params(case.cfg, 0)
    opt = DaisyAdam(AdamConfig(lr=LR), params.size)
    batch = _batch(case)
    grad = np.empty_like(params)

    def step() -> float:
        loss, _ = loss_and_grad(case.cfg, params, batch, out=grad)
        opt.step(params, grad)
        return loss

    return step


def torch_step(case: Case, threads: int) -> Callable[[], float]:
    """The same model, initial weights and batch in PyTorch CPU float32."""
    import torch

    from bench.torch_gpt import torch_loss

    torch.set_num_threads(threads)
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


# ----------------------------------------------------------------------------- phases

def phase_times(step: Callable[[], float], steps: int) -> dict[str, float]:
    """Mean seconds per step in each phase of the numpy step, by wrapping the functions
    that make up each phase: quantize (``quantize_values`` as called by
    ``int8_matmul``), forward int8 GEMMs (the dispatcher's ``_run``: backend GEMM +
    audit), backward (``model._backward_rows`` and ``_weight_grads``), optimizer
    (``DaisyAdam.step``); "other" is the rest (dequantize epilogue, LayerNorm,
    attention, GELU, loss, checks). Meant for one core: on two, phases overlap."""
    import daisyweb.model as model_mod
    import kernels.dispatch as dispatch

    acc: dict[str, float] = {}
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)
        acc.setdefault(label, 0.0)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t0

        patched.append((owner, name, orig))
        setattr(owner, name, timed)

    wrap(dispatch, "quantize_values", "quantize")
    wrap(dispatch, "_run", "forward int8 GEMMs")
    wrap(model_mod, "_backward_rows", "backward")
    wrap(model_mod, "_weight_grads", "backward")
    wrap(DaisyAdam, "step", "optimizer")
    try:
        step()
        for k in acc:
            acc[k] = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - t0
    finally:
        for owner, name, orig in reversed(patched):
            setattr(owner, name, orig)
    out = {k: v / steps for k, v in acc.items()}
    out["other"] = total / steps - sum(out.values())
    out["total"] = total / steps
    return out


# ----------------------------------------------------------------------------- workers

def worker(side: str, case_key: str, threads: int) -> None:
    """A worker process: build one side's step, then serve ``run N`` / ``phases N`` /
    ``quit`` lines on stdin with one JSON line each on stdout."""
    case = CASES[case_key]
    info: dict[str, Any] = {"side": side}
    if side == "numpy":
        import kernels
        from daisyweb import parallel

        step = numpy_step(case)
        info["backend"] = kernels.active_backend()
        info["blas_core"] = parallel.blas_core()
        if "torch" in sys.modules:
            raise SystemExit("the numpy worker must not import torch")
    else:
        import torch

        step = torch_step(case, threads)
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    info["first_loss"] = step()
    step()  # warm-up: gate, buffers, thread pools
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "run":
            reps = int(arg)
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            print(json.dumps({"s": (time.perf_counter() - t0) / reps}), flush=True)
        elif cmd == "phases":
            print(json.dumps(phase_times(step, int(arg))), flush=True)
        else:
            return


def _cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Worker:
    def __init__(self, side: str, case: Case, threads: int) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(threads)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.step", "--worker", side, case.key, str(threads)],
            cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench worker exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, cmd: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def cpu(self) -> float:
        return _cpu_seconds(self.proc.pid)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _stats(ts: list[float], tokens: int) -> dict[str, float]:
    best, med = min(ts), statistics.median(ts)
    return {"best": best, "median": med, "tps_best": tokens / best, "tps_median": tokens / med}


def measure(case: Case, threads: int, rounds: int, reps: int) -> dict[str, Any]:
    """Interleaved rounds numpy / torch in two workers, then a solo torch run."""
    tokens = case.batch * case.cfg.seq
    np_w, th_w = Worker("numpy", case, threads), Worker("torch", case, threads)
    times: dict[str, list[float]] = {"numpy": [], "torch": []}
    idle: list[float] = []  # CPU seconds the idle worker used during the other's segments
    try:
        time.sleep(SETTLE_S)
        for _ in range(rounds):
            for run_w, idle_w, name in ((np_w, th_w, "numpy"), (th_w, np_w, "torch")):
                c0 = idle_w.cpu()
                times[name].append(run_w.ask(f"run {reps}")["s"])
                idle.append(idle_w.cpu() - c0)
                time.sleep(SETTLE_S)
        phases = np_w.ask(f"phases {PHASE_STEPS}") if threads == 1 else None
        info = {"numpy": np_w.info, "torch": th_w.info}
    finally:
        np_w.close()
        th_w.close()
    solo_w = Worker("torch", case, threads)  # nothing else of ours alive
    solo: list[float] = []
    try:
        time.sleep(SETTLE_S)
        for _ in range(rounds):
            solo.append(solo_w.ask(f"run {reps}")["s"])
    finally:
        solo_w.close()
    return {"case": case, "threads": threads, "info": info, "phases": phases,
            "numpy": _stats(times["numpy"], tokens), "torch": _stats(times["torch"], tokens),
            "torch_solo": _stats(solo, tokens), "idle_cpu_max": max(idle),
            "idle_cpu_mean": statistics.mean(idle)}


# ----------------------------------------------------------------------------- RSS

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
    before the parent builds any model (the parent is then far smaller than the child);
    VmHWM, which exec resets, is printed as a cross-check.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "bench.step", "--rss-child"], cwd=root,
                       capture_output=True, text=True, check=True, timeout=600)
    maxrss, hwm = r.stdout.strip().splitlines()[-1].split()
    return int(maxrss) / 1024.0, int(hwm) / 1024.0


# ----------------------------------------------------------------------------- report

def _name(case: Case) -> str:
    c = case.cfg
    return f"{case.label} (w{c.width} L{c.layers} H{c.heads} V{c.vocab})"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| threads | config | params | daisyweb step ms (best / median) | daisyweb tokens/s "
        "| torch fp32 step ms (best / median) | torch tokens/s | **ratio median** (best) "
        "| torch solo median ms (interleaved / solo) | idle side's CPU per segment, max |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        case: Case = r["case"]
        npr, thr, solo = r["numpy"], r["torch"], r["torch_solo"]
        lines.append(
            f"| {r['threads']} | {_name(case)} | {param_count(case.cfg):,} "
            f"| {npr['best'] * 1e3:.1f} / {npr['median'] * 1e3:.1f} | {npr['tps_median']:,.0f} "
            f"| {thr['best'] * 1e3:.1f} / {thr['median'] * 1e3:.1f} | {thr['tps_median']:,.0f} "
            f"| **{npr['tps_median'] / thr['tps_median']:.2f}x** "
            f"({npr['tps_best'] / thr['tps_best']:.2f}x) "
            f"| {solo['median'] * 1e3:.1f} ({thr['median'] / solo['median']:.2f}) "
            f"| {r['idle_cpu_max'] * 1e3:.0f} ms |")
    return "\n".join(lines)


PHASES = ("forward int8 GEMMs", "quantize", "backward", "optimizer", "other")


def phase_table(results: list[dict[str, Any]]) -> str:
    lines = ["| threads | config | " + " | ".join(PHASES) + " | step |",
             "|---:|---|" + "---:|" * (len(PHASES) + 1)]
    for r in results:
        ph = r["phases"]
        if ph is None:
            continue
        cells = " | ".join(f"{ph[k] * 1e3:.1f} ({ph[k] / ph['total']:.0%})" for k in PHASES)
        lines.append(f"| {r['threads']} | {r['case'].label} | {cells} "
                     f"| {ph['total'] * 1e3:.1f} |")
    return "\n".join(lines)


def _load() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few rounds, nothing written")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", nargs=3, metavar=("SIDE", "CASE", "THREADS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        rss_child()
        return
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return
    rounds, reps = (2, 1) if args.quick else (9, 3)
    cases = [DEFAULT] if args.quick else [DEFAULT, WIDE]
    load_before = _load()
    rss, hwm = measure_rss()
    results = []
    for threads in THREADS:
        for case in cases:
            results.append(measure(case, threads, rounds, reps))
            print(f"measured {case.label} at {threads} thread(s)", file=sys.stderr)
    info = results[0]["info"]
    cmd = "python -m bench.step" + (" --quick" if args.quick else "")
    first = info
    worst = min(r["numpy"]["tps_median"] / r["torch"]["tps_median"] for r in results)
    md = "\n".join([
        "## Training step: numpy int8 model + DaisyAdam vs PyTorch CPU float32",
        "",
        f"Command: `{cmd}` (from the repository root). Machine: {machine()}; load average "
        f"{load_before} before, {_load()} after (shared machine).",
        "",
        f"A step = forward (every linear layer through `kernels.int8_matmul`, backend "
        f"`{info['numpy']['backend']}`, OpenBLAS kernels `{info['numpy']['blas_core']}`: "
        f"see `daisyweb.blascore`), float32 backward into a reused gradient buffer, "
        f"DaisyAdam; PyTorch {info['torch']['torch']} runs the same model, initial weights "
        f"and batch in float32 with autograd and `torch.optim.AdamW`. Each side runs in its "
        f"own worker process with OPENBLAS_NUM_THREADS = OMP_NUM_THREADS = "
        f"`torch.set_num_threads` = the row's threads (daisyweb then uses that many cores: "
        f"two halves of the batch on two threads, BLAS at one thread per call); "
        f"{rounds} interleaved rounds of {reps} steps each after 2 warm-up steps, "
        f"{SETTLE_S} s pause after each segment "
        f"so neither side's spinning BLAS threads run into the other's. Checks: the idle "
        f"worker's CPU time during the other's segments (last column; ~0 means no "
        f"spinning), and PyTorch's median in a solo run with no numpy worker alive next "
        f"to its interleaved median (ratio ~1.00 means the interleaving did not slow it).",
        "",
        table(results),
        "",
        f"Slowest ratio (median): **{worst:.2f}x** (bar: >= 1.0x at every row).",
        "",
        f"Where the daisyweb step goes at one thread ({PHASE_STEPS} instrumented steps in "
        f"the numpy worker after the timed rounds; ms per step and share; on two cores "
        f"the phases overlap, see `daisyweb.parallel`):",
        "",
        phase_table(results),
        "",
        f"First-step loss at defaults: numpy int8 {first['numpy']['first_loss']:.4f}, torch "
        f"float32 {first['torch']['first_loss']:.4f} (ln 2048 = {math.log(2048):.4f}).",
        "",
        f"Peak RSS of a separate training process at defaults ({RSS_STEPS} steps, torch not "
        f"imported, `resource.getrusage(RUSAGE_SELF).ru_maxrss`): **{rss:.1f} MiB** "
        f"(bar: <= 107 MB, the figure before issue 16); the child's own VmHWM: "
        f"{hwm:.1f} MiB.",
    ])
    print(md)
    if not args.quick:
        write_section("step", md)


if __name__ == "__main__":
    main()
