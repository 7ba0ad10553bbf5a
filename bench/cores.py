"""Where a pinned group peer's core goes: per-thread CPU, per transport, and the cost of
each round's codec and hash work.

Two ``daisyweb-peer`` processes in the default mode, pinned to cores 0 and 1 with one
BLAS thread each (as ``bench.scaling`` runs them), inside a loopback-only network
namespace (``bench/_netns.py``, the same for both transports). Over a window in the
middle of the run, each thread's CPU time is read from ``/proc/PID/task/TID/stat``: the
training thread (the one computing steps), the event loop (the main thread: the
transport's Python side, framing, and each round's encode, decodes, average and hash)
and any other (libwebrtc's own network thread). One peer alone
(``daisyweb-demo --peers 1``) is measured the same way, before and after the group,
and the group's step time (a round's wall time over its steps, after the first round)
is set against one peer's (its steps' compute time, ``bench.scaling``'s baseline).

Then the per-round work on vectors of the demo default's size, each operation timed
alone in a process of its own pinned to one core (median of 30).

    python -m bench.cores               # both transports, 400 steps; writes TEST_RESULTS.md
    python -m bench.cores --quick       # 96 steps, nothing written
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench._group import ENV, peer_command, records, run_pinned, signaling_server
from bench._netns import run_isolated
from bench._results import machine, write_section
from daisyweb.rules import DEFAULTS

TRANSPORTS = ("aiortc", "libwebrtc")
H = int(DEFAULTS["sync_every"])


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of each thread of ``pid``: tid -> (name, seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between the listing and the read
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def shares(pid: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
           seconds: float) -> dict[str, float]:
    """Each thread's share of one core over the window: the busiest thread is the
    training thread; the main thread, if it is not that one, runs the event loop (one
    peer alone trains in its main thread and has no event loop); the rest by name."""
    used = {tid: after[tid][1] - before.get(tid, (name, 0.0))[1]
            for tid, (name, _) in after.items()}
    training = max(used, key=lambda tid: used[tid])
    out = {"training": used[training] / seconds,
           "event loop": used.get(pid, 0.0) / seconds if training != pid else 0.0}
    for tid, s in used.items():
        if tid not in (training, pid) and s > 0.0:
            name = after[tid][0]
            out[name] = out.get(name, 0.0) + s / seconds
    return out


def _wait_step(metrics: Path, step: int, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a peer ended before the measuring window")
        if metrics.exists() and any(r.get("step", 0) >= step for r in records(metrics)):
            return
        time.sleep(0.2)
    raise SystemExit(f"the group did not reach step {step}")


def _window(pid: int, seconds: float) -> dict[str, float]:
    before, t0 = thread_cpu(pid), time.monotonic()
    time.sleep(seconds)
    return shares(pid, before, thread_cpu(pid), time.monotonic() - t0)


def one_peer(env: dict[str, str], steps: int, window: float, tmp: Path, tag: str
             ) -> tuple[dict[str, float], float]:
    """One peer alone on core 0: its thread shares and its mean step compute time."""
    metrics = tmp / f"{tag}.jsonl"
    solo = subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-m", "daisyweb.cli.demo", "--peers", "1",
         "--steps", str(steps), "--metrics", str(metrics)],
        cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_step(metrics, steps // 3, [solo], 600)
    alone = _window(solo.pid, window)
    if solo.wait(timeout=900) != 0:
        raise SystemExit(f"one peer alone failed:\n{solo.stderr.read().decode()[-2000:]}")
    recs = [r for r in records(metrics) if "compute_s" in r]
    return alone, sum(r["compute_s"] for r in recs) / len(recs)


def inner(transport: str, steps: int, tmp: Path) -> dict:
    """One transport (inside the namespace): one peer alone, the group (the follower's
    thread shares, the leader's step time), one peer alone again. This machine's speed
    drifts by several percent over minutes, so one peer's step time is the mean of the
    runs before and after the group's."""
    env = dict(ENV, DAISYWEB_TRANSPORT=transport)
    window = max(2.0, steps * 0.05 / 3)  # about a third of the run
    alone, before = one_peer(env, steps, window, tmp, "solo-before")
    lead_metrics = tmp / f"{transport}-lead.jsonl"
    follower: dict[str, float] = {}

    def measure(procs: list[subprocess.Popen[bytes]]) -> None:
        _wait_step(lead_metrics, min(2 * H, steps // 3), procs, 600)
        follower.update(_window(procs[1].pid, window))

    with signaling_server(tmp) as url:
        base = peer_command(url, f"cores-{transport}")
        lead = base + ["--start", "--wait-peers", "2", "--steps", str(steps),
                       "--metrics", str(lead_metrics)]
        run_pinned([(lead, env), (base, env)], tmp, transport, during=measure)
    rounds = [r for r in records(lead_metrics) if "round" in r][1:]  # the first warms up
    group_step = sum(r["wall_s"] for r in rounds) / (rounds[-1]["step"] - rounds[0]["step"]
                                                     + H)
    _, after = one_peer(env, steps, window, tmp, "solo-after")
    return {"follower": follower, "alone": alone, "group_step": group_step,
            "solo_step": (before + after) / 2, "solo_steps": [before, after]}


def scenario(transport: str, steps: int) -> dict:
    r = run_isolated([sys.executable, "-m", "bench.cores", "--inner", transport, str(steps)],
                     env={"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                     timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{transport} failed:\n{r.stdout[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def round_ops() -> dict[str, float]:
    """Median milliseconds of each per-round operation on vectors of the demo default's
    size (in this process: the caller runs it alone, pinned)."""
    import numpy as np

    from daisyweb.model import ModelConfig, param_count
    from daisyweb.protocol.averaging import average_parts_in_roster_order
    from daisyweb.protocol.codec import (
        ErrorFeedback,
        check_payload,
        codec_by_name,
        decode_parts,
    )
    from daisyweb.training.rounds import shared_hash

    size = param_count(ModelConfig(vocab=2048))
    rng = np.random.default_rng(0)
    delta = (rng.standard_normal(size) * 1e-3).astype(np.float32)
    anchor = rng.standard_normal(size).astype(np.float32)

    def median_ms(fn: Callable[[], object], n: int = 30) -> float:
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    out: dict[str, float] = {}
    for name in ("int4", "int8", "f32"):
        codec = codec_by_name(name)
        payload = codec.encode(delta)
        feedback = ErrorFeedback(size)
        out[f"{name}: encode with error feedback"] = median_ms(
            lambda c=codec, f=feedback: f.encode_decoded(c, delta))
        out[f"{name}: check on arrival"] = median_ms(
            lambda c=codec, p=payload: check_payload(c, p, size))
        out[f"{name}: decode"] = median_ms(lambda c=codec, p=payload: c.decode(p, size))
        # What a commit does (sync._try_commit): each payload decoded part by part as
        # the roster-order average adds it.
        out[f"{name}: average of 2 payloads, decoded part by part"] = median_ms(
            lambda c=codec, p=payload: average_parts_in_roster_order(
                [decode_parts(c, p, size), decode_parts(c, p, size)], size))
    out["shared-state hash (blake2b-256 of the anchor)"] = median_ms(
        lambda: shared_hash(anchor, 1, H))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", nargs=2, metavar=("TRANSPORT", "STEPS"))
    ap.add_argument("--ops", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--quick", action="store_true", help="96 steps, print only")
    args = ap.parse_args()
    if args.inner:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(inner(args.inner[0], int(args.inner[1]), Path(tmp))))
        return
    if args.ops:
        print(json.dumps(round_ops()))
        return
    steps = 96 if args.quick else args.steps
    load = os.getloadavg()
    rows = ["| transport | run | training thread | event loop | other threads | "
            "step ms | group step / one peer's |", "|---|---|---:|---:|---|---:|---:|"]
    for transport in TRANSPORTS:
        r = scenario(transport, steps)
        for run, cpu, step in (("two peers: the follower", r["follower"], r["group_step"]),
                               ("one peer alone", r["alone"], r["solo_step"])):
            other = ", ".join(f"{k} {v:.1%}" for k, v in cpu.items()
                              if k not in ("training", "event loop") and v >= 0.0005) or "-"
            group = run.startswith("two")
            ratio = f"{r['group_step'] / r['solo_step']:.3f}x" if group else (
                "runs before / after the group: " + " / ".join(
                    f"{x * 1e3:.1f}" for x in r["solo_steps"]) + " ms")
            loop = f"{cpu['event loop']:.1%}" if group else "- (trains in its main thread)"
            rows.append(f"| {transport} | {run} | {cpu['training']:.1%} | {loop} | {other} | "
                        f"{step * 1e3:.1f} | {ratio} |")
            print(rows[-1], flush=True)
    ops = json.loads(subprocess.run(
        ["taskset", "-c", "1", sys.executable, "-m", "bench.cores", "--ops"],
        env=dict(ENV), check=True, capture_output=True, text=True).stdout)
    op_rows = ["| operation | ms (median of 30) |", "|---|---:|"]
    op_rows += [f"| {k} | {v:.2f} |" for k, v in ops.items()]
    print("\n".join(op_rows))
    if args.quick:
        return
    md = "\n".join([
        "## Where a pinned group peer's core goes (bench.cores)",
        "",
        f"Command: `python -m bench.cores --steps {steps}`. Machine: {machine()}; load "
        f"average {load[0]:.1f} at the start.",
        "",
        f"Two `daisyweb-peer` processes in the default mode (rounds of {H}, "
        f"{DEFAULTS['codec']}, a head start of up to {DEFAULTS['overlap']} steps, as the link "
        "needs), pinned to cores 0 "
        "and 1 with one BLAS thread each, in a loopback-only network namespace per "
        "transport; each thread's share of its core from /proc over a window of a third "
        "of the run, after the first two rounds (the follower's; the leader's is the "
        "same work). One peer alone (`daisyweb-demo --peers 1`, core 0) the same way. "
        "Step ms: the group's round wall time over its steps after the first round; one "
        "peer's, its steps' compute time (bench.scaling's baseline), the mean of a run "
        "before and one after the group's (this machine's speed drifts by several "
        "percent over minutes: compare the thread shares, not small step-time ratios).",
        "",
        *rows,
        "",
        "Each round's own work on vectors of the demo default's size (1,325,824 values), "
        "one process pinned to core 1, nothing else running:",
        "",
        *op_rows,
    ])
    write_section("cores", md)


if __name__ == "__main__":
    main()
