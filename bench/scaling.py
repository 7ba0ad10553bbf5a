"""A group against one machine: real pinned processes, equal-token losses, a projection.

    python -m bench.scaling            # the full run (about 20 minutes on 2 cores)
    python -m bench.scaling --quick    # smoke run, nothing written

1. **Real processes on 127.0.0.1.** One peer alone (``daisyweb-demo --peers 1``) pinned to
   core 0, against two ``daisyweb-peer`` processes pinned to cores 0 and 1 (``taskset``),
   one BLAS thread each, same per-peer batch, a signaling server on loopback. For each
   exchange mode: the group's tokens/s over one peer's, communication share, payload
   bytes sent per peer per 1,000 trained tokens. Then the default mode trains past one
   peer's 300-step held-out loss; every boundary's shared weights are rebuilt afterwards
   from the contributions the peers decoded and evaluated on the held-out split
   (``daisyweb.training.evaluate``): the wall-time ratio to the first one at or below it.
2. **Held-out loss at equal tokens** for every mode, from ``bench.rounds_sim`` (the
   product's own trainers, codecs and averaging in one process, no network).
3. **A projection** for 2-16 separate machines on 5/25/100 MB/s links, computed from the
   measured compute time per step and bytes per exchange. Labelled as a projection.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from bench._group import ENV, peer_command, records, run_pinned, signaling_server
from bench._results import machine, write_section
from bench.rounds_sim import SimResult, simulate
from daisyweb.checkpoints.checkpoint import load_checkpoint
from daisyweb.model import init_params
from daisyweb.rules import DEFAULTS
from daisyweb.training.config import RunConfig
from daisyweb.training.evaluate import DEFAULT_BATCHES, heldout_batches, heldout_loss
from daisyweb.training.replay import round_anchors
from daisyweb.training.rounds import shared_hash

ROOT = Path(__file__).resolve().parent.parent
STEP_TOKENS = int(DEFAULTS["batch"]) * int(DEFAULTS["seq"])  # one peer's tokens per step
DEFAULT_H, DEFAULT_OVERLAP = int(DEFAULTS["sync_every"]), int(DEFAULTS["overlap"])
DEFAULT_LABEL = (f"rounds H={DEFAULT_H} {DEFAULTS['codec']} overlap up to {DEFAULT_OVERLAP} "
                 "(default)")
MODES = [  # (label, sync_every, codec, overlap)
    ("lockstep f32", 1, "f32", 0),
    ("lockstep int8", 1, "int8", 0),
    ("rounds H=8 f32", 8, "f32", 0),
    ("rounds H=8 int8", 8, "int8", 0),
    ("rounds H=32 f32", 32, "f32", 0),
    ("rounds H=32 int8, no overlap", 32, "int8", 0),
    ("rounds H=32 int8 overlap 4", 32, "int8", 4),
    ("rounds H=16 int8 overlap 2", 16, "int8", 2),
    (DEFAULT_LABEL, DEFAULT_H, str(DEFAULTS["codec"]), DEFAULT_OVERLAP),
]


def one_peer(steps: int, tmp: Path, tag: str = "solo", seed: int = 0) -> dict:
    """One peer alone on core 0: training seconds (sum of step times) and its checkpoint."""
    # A fresh metrics file per run: the demo appends to an existing one.
    metrics, ckpt = tmp / f"{tag}.jsonl", tmp / f"{tag}.pt"
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "daisyweb.cli.demo", "--peers", "1",
           "--steps", str(steps), "--seed", str(seed), "--metrics", str(metrics),
           "--save", str(ckpt)]
    subprocess.run(cmd, cwd=tmp, env=ENV, check=True, capture_output=True, timeout=1800)
    recs = [r for r in records(metrics) if "compute_s" in r]
    secs = sum(r["compute_s"] for r in recs)
    return {"train_s": secs, "tokens_per_s": len(recs) * STEP_TOKENS / secs, "ckpt": ckpt}


def two_peers(steps: int, sync_every: int, codec: str, tmp: Path, tag: str,
              extra: tuple[str, ...] = (), overlap: int = 0,
              env: dict[str, str] | None = None) -> dict:
    """Two peers pinned to cores 0 and 1 over aiortc on loopback; the leader's records."""
    env = env or ENV
    metrics, ckpt = tmp / f"{tag}.jsonl", tmp / f"{tag}.pt"
    follower_metrics = tmp / f"{tag}-follower.jsonl"
    with signaling_server(tmp) as url:
        base = peer_command(url, f"scale-{tag}", "tests.fault_peer")
        lead = base + ["--start", "--wait-peers", "2", "--steps", str(steps),
                       "--sync-every", str(sync_every), "--codec", codec,
                       "--overlap", str(overlap), "--sync-max", str(sync_every),
                       "--metrics", str(metrics), "--save", str(ckpt), *extra]
        run_pinned([(lead, env), (base + ["--metrics", str(follower_metrics)], env)], tmp, tag)
    recs = [r for r in records(metrics) if "round" in r]
    # The first exchange includes the links' warm-up; it is dropped from the rates.
    steady = recs[1:]
    wall = sum(r["wall_s"] for r in steady)
    steps = recs[-1]["step"] - recs[0]["step"]
    return {
        "train_s": sum(r["wall_s"] for r in recs),
        "tokens_per_s": steps * STEP_TOKENS * 2 / wall,
        "comm_share": sum(r["comm_s"] for r in steady) / wall,
        "bytes_per_exchange": recs[-1]["bytes_sent"] / recs[-1]["round"],
        "compute_per_step": sum(r["compute_s"] for r in steady) / steps,
        "ckpt": ckpt,
        "records": recs,
        **_exchange_split(steady, [r for r in records(follower_metrics) if "round" in r][1:]),
    }


def throughput(label: str, h: int, codec: str, overlap: int, min_steps: int, exchanges: int,
               trials: int, tmp: Path, solo_tps: float) -> dict:
    """One mode's row: ``trials`` two-peer runs of ``min_steps`` and at least
    ``exchanges`` rounds (lockstep: at most 64 steps); the run with the median group
    tokens/s gives the row (a run's rate moves by several percent with the host's load
    on either core)."""
    steps = max(min_steps, exchanges * h) if h > 1 else min(min_steps, 64)
    if h == 1 and codec == "f32":
        steps = min(steps, 24)  # about 1.5 s a step: enough to measure
    runs = []
    for i in range(trials):
        r = two_peers(steps, h, codec, tmp, f"thr-{h}-{codec}-{overlap}-{i}", overlap=overlap)
        runs.append(r)
        print(f"{label} run {i + 1}: {r['tokens_per_s']:,.0f} tok/s "
              f"({r['tokens_per_s'] / solo_tps:.2f}x), comm {r['comm_share']:.0%}", flush=True)
    runs.sort(key=lambda r: r["tokens_per_s"])
    row = runs[len(runs) // 2]
    row.update(label=label, h=h, codec=codec, steps=steps,
               all_tps=[r["tokens_per_s"] for r in runs])
    return row


def reach_trial(index: int, solo_steps: int, reach_steps: int, tmp: Path) -> dict:
    """One peer trains ``solo_steps``; then two peers in the default mode train
    ``reach_steps`` each, both from run seed ``index`` (the initial weights, and the
    batches of a peer whose id is fixed: one peer alone is always "demo-0", so without a
    seed of its own its loss would be the same draw in every trial). The group's time to
    one peer's held-out loss is the sum of its rounds' wall times up to the first
    boundary at or below it (``main`` divides it by one peer's median time).

    The boundaries are evaluated afterwards, not during the run: each peer writes the
    round contributions it decoded (the replay oracle's input,
    ``DAISYWEB_TEST_DUMP_GRADS``), and the shared weights of every boundary are rebuilt
    from them (``replay.round_anchors``), each checked against the hash the group
    published for it. A leader evaluating at every boundary (``--eval-every``) shares
    its one core with the next round's head start and slowed the group by about 5%.
    (Until 2026-12-05 this subtracted the evaluations' seconds from rounds whose wall
    time already left them out: about 20% too flattering.)"""
    solo = one_peer(solo_steps, tmp, f"solo{index}", seed=index)
    target = held_out(solo["ckpt"])
    h, overlap = int(DEFAULTS["sync_every"]), int(DEFAULTS["overlap"])
    dumps = tmp / f"reach{index}-rounds"
    dumps.mkdir()
    group = two_peers(reach_steps, h, str(DEFAULTS["codec"]), tmp, f"reach{index}",
                      extra=("--seed", str(index)), overlap=overlap,
                      env=dict(ENV, DAISYWEB_TEST_DUMP_GRADS=str(dumps)))
    losses = boundary_losses(group["records"], group["ckpt"], dumps)
    reach_s, reach_at, reach_loss, elapsed = None, None, math.inf, 0.0
    for r, loss in zip(group["records"], losses, strict=True):
        elapsed += r["wall_s"]
        if loss <= target and reach_s is None:
            reach_s, reach_at, reach_loss = elapsed, r["step"], loss
    curve = [(r["step"], round(loss, 3)) for r, loss in zip(group["records"], losses,
                                                             strict=True)]
    print(f"trial {index}: one peer {target:.3f} in {solo['train_s']:.1f} s; two peers "
          f"{curve}; reached at {reach_at} in {reach_s} s", flush=True)
    return {"solo": solo, "target": target, "curve": curve, "reach_s": reach_s,
            "reach_at": reach_at, "reach_loss": reach_loss}


def boundary_losses(recs: list[dict], ckpt_path: Path, dumps: Path) -> list[float]:
    """Held-out loss of the shared weights after each of the leader's records' rounds,
    rebuilt from the peers' dumped contributions; SystemExit if a rebuilt boundary's
    hash is not the one the group published."""
    ckpt = load_checkpoint(ckpt_path)
    run = RunConfig.from_checkpoint(ckpt)
    batches = heldout_batches(run.model.seq)

    def contributions() -> Iterator[tuple[list[str], dict[str, np.ndarray]]]:
        for r in recs:
            roster = list(r["roster"])
            if len(set(r.get("shares") or [0])) > 1:
                raise SystemExit(f"round {r['round']}: unequal shares {r['shares']}")
            yield roster, {p: np.load(dumps / f"{p}-{r['round'] - 1}.npy") for p in roster}

    losses = []
    steps = [0, *(int(r["step"]) for r in recs)]
    lengths = [b - a for a, b in itertools.pairwise(steps)]
    anchors = round_anchors(init_params(run.model, run.seed), contributions(),
                            lengths=lengths, outer_lr=run.outer_lr)
    for r, (rounds, inner, anchor) in zip(recs, anchors, strict=True):
        if shared_hash(anchor, rounds, inner) != r["weight_hash"]:
            raise SystemExit(f"round {r['round']}: the rebuilt shared weights do not "
                             "hash to what the group published")
        losses.append(heldout_loss(run.model, anchor, batches))
    return losses


def _exchange_split(lead: list[dict], follow: list[dict]) -> dict[str, float]:
    """Seconds per exchange spent moving bytes vs waiting for the slower peer's compute.

    Each peer's ``exchange_s`` runs from its own contribution being ready to the roster's
    all present (``comm_s`` is the part of it no head start hid). The slower peer only
    waits for the last bytes (transfer); the faster one waits that long plus the
    difference in their compute (skew).
    """
    pairs = [(a["exchange_s"], b["exchange_s"]) for a, b in zip(lead, follow, strict=False)
             if a["round"] == b["round"]]
    if not pairs:
        return {"transfer_s": math.nan, "skew_s": math.nan}
    return {"transfer_s": sum(min(p) for p in pairs) / len(pairs),
            "skew_s": sum(max(p) - min(p) for p in pairs) / len(pairs)}


def _simulations(sim_steps: int, cache: Path | None) -> dict[str, SimResult]:
    """Held-out loss at equal tokens for one peer and every mode (those ``cache`` holds
    for this many steps are reused; the others are simulated and added to it)."""
    sims: dict[str, SimResult] = {}
    if cache is not None and cache.exists():
        stored = json.loads(cache.read_text())
        if stored.get("steps") == sim_steps:
            sims = {k: SimResult(**v) for k, v in stored["sims"].items()}
    for label, h, codec, overlap in [("one peer", 1, "f32", 0), *MODES]:
        if label in sims:
            continue
        peers = 1 if label == "one peer" else 2
        steps = 2 * sim_steps if peers == 1 else sim_steps
        sims[label] = simulate(peers, steps, h, codec, eval_every=max(steps // 6, 1),
                               overlap=overlap)
        print(f"sim {label}: held-out {sims[label].final:.3f}", flush=True)
    if cache is not None:
        cache.write_text(json.dumps({"steps": sim_steps,
                                     "sims": {k: asdict(v) for k, v in sims.items()}}))
    return sims


def median_interval(values: Sequence[float], level: float = 0.9, resamples: int = 10_000,
                    seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval for the median of ``values``: the central ``level`` of the
    medians of ``resamples`` resamplings with replacement. Trials spread widely (each
    group run draws its members' ids, and so their batches), so a median alone says
    little about how far the bar is; a fixed seed gives the same interval for the same
    trials. A trial that never reached the target counts as infinitely slow."""
    if not values:
        raise ValueError("no trials")
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(data, size=(resamples, data.size)), axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2], method="lower")
    return float(lo), float(hi)


def held_out(path: Path) -> float:
    ckpt = load_checkpoint(path)
    return heldout_loss(ckpt.model, ckpt.params, heldout_batches(ckpt.model.seq))


def projection(compute_step: float, rows: list[tuple[str, int, int, int]]) -> list[str]:
    """Group speed-up over one machine for N machines on links of B MB/s (all-to-all);
    with an overlap of K steps, K steps' compute hides as much of the transfer."""
    out = ["| mode | link | N=2 | N=4 | N=8 | N=16 |", "|---|---:|---:|---:|---:|---:|"]
    for label, h, overlap, nbytes in rows:
        for mbps in (5, 25, 100):
            cells = []
            for n in (2, 4, 8, 16):
                comm = (n - 1) * nbytes / (mbps * 1e6)  # each peer uploads to n-1 others
                exposed = max(0.0, comm - overlap * compute_step)
                cells.append(f"{n * h * compute_step / (h * compute_step + exposed):.1f}x")
            out.append(f"| {label} | {mbps} MB/s | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=3,
                    help="two-peer runs per mode for the throughput rows (the median run)")
    ap.add_argument("--reach-trials", type=int, default=5,
                    help="paired one-peer / two-peer runs for the time to one peer's "
                         "held-out loss (the median ratio is the result; the crossing "
                         "moves by up to 80 steps from run to run)")
    ap.add_argument("--sim-cache", type=Path, default=None, metavar="FILE.json",
                    help="reuse (or store) the equal-token simulations: they depend on "
                         "no timing, so a rerun of the timed part on a quiet machine "
                         "need not repeat them")
    args = ap.parse_args()
    quick = args.quick
    sim_steps, thr_steps, solo_steps = (16, 16, 32) if quick else (300, 256, 300)
    exchanges = 3 if quick else 8
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        # Trial i runs both sides from seed i (initial weights and batches), and a group
        # peer's batches are keyed by its random id too, so both one peer's 300-step loss
        # and the group's crossing move from run to run (one peer's by 0.27 over fifteen
        # seeds): the time-to-loss bar is the median over --reach-trials paired runs.
        trials = [reach_trial(i, solo_steps, 64 if quick else 288, tmp)
                  for i in range(args.reach_trials)]
        solo_tps = statistics.median(t["solo"]["tokens_per_s"] for t in trials)
        real = [throughput(label, h, codec, overlap, thr_steps, exchanges, args.trials, tmp,
                           solo_tps)
                for label, h, codec, overlap in MODES]
    sims = _simulations(sim_steps, None if quick else args.sim_cache)

    rows = ["| mode | steps per run | group tok/s (median run) | vs one peer | every run "
            "vs one peer | comm share | transfer s per exchange | waiting for the slower "
            "peer s | payload bytes per peer per 1,000 trained tokens | vs lockstep f32 |",
            "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    base_bpt = None
    for r in real:
        bpt = r["bytes_per_exchange"] / (r["h"] * STEP_TOKENS) * 1000  # one link (N = 2)
        base_bpt = base_bpt or bpt
        every = ", ".join(f"{t / solo_tps:.2f}x" for t in r["all_tps"])
        rows.append(f"| {r['label']} | {r['steps']} | {r['tokens_per_s']:,.0f} | "
                    f"{r['tokens_per_s'] / solo_tps:.2f}x | {every} | {r['comm_share']:.0%} | "
                    f"{r['transfer_s']:.3f} | {r['skew_s']:.3f} | "
                    f"{bpt:,.0f} | {base_bpt / bpt:.0f}x fewer |")
    one = sims["one peer"]
    sim_rows = ["| mode | held-out loss after 300 steps per peer (600 x 512 tokens in all) "
                "| one peer reaches it after |", "|---|---:|---:|"]
    sim_rows.append(f"| one peer, 600 steps | {one.final:.3f} | - |")
    for label, *_ in MODES:
        s = sims[label]
        reached = next((st for st, loss in one.curve if loss <= s.final), None)
        sim_rows.append(f"| {label} | {s.final:.3f} | "
                        + (f"{reached} steps" if reached else "> 600 steps") + " |")
    one_at_300 = next((loss for st, loss in one.curve if st >= sim_steps), one.final)
    sim_rows.append(f"| (one peer after 300 steps) | {one_at_300:.3f} | |")
    by_label = {r["label"]: r for r in real}
    compute_step = by_label[DEFAULT_LABEL]["compute_per_step"]
    projected = ("lockstep f32", "rounds H=32 int8 overlap 4", "rounds H=16 int8 overlap 2",
                 DEFAULT_LABEL)
    proj = projection(compute_step, [
        (label, h, overlap, int(by_label[label]["bytes_per_exchange"]))
        for label, h, _, overlap in MODES if label in projected])
    # One peer's time is the median of the trials' (a single solo run can be slowed by
    # the host), the same for every trial's ratio.
    solo_s = statistics.median(t["solo"]["train_s"] for t in trials)
    for t in trials:
        t["ratio"] = t["reach_s"] / solo_s if t["reach_s"] is not None else math.inf
    median_ratio = statistics.median(t["ratio"] for t in trials)
    low, high = median_interval([t["ratio"] for t in trials])
    trial_rows = ["| trial | one peer: held-out after 300 steps | one peer: training s | "
                  "two peers: held-out by step | two peers: first at or below | "
                  "two peers: s | **ratio** |", "|---:|---:|---:|---|---:|---:|---:|"]
    for i, t in enumerate(trials):
        reached = (f"{t['reach_at']} steps ({t['reach_loss']:.3f})" if t["reach_s"]
                   else "not reached")
        secs = f"{t['reach_s']:.1f}" if t["reach_s"] else "-"
        trial_rows.append(f"| {i + 1} | {t['target']:.3f} | {t['solo']['train_s']:.1f} | "
                          f"{t['curve']} | {reached} | {secs} | "
                          + (f"{t['ratio']:.2f}x |" if t["reach_s"] is not None else "- |"))
    md = "\n".join([
        "## A group against one machine (bench.scaling)",
        "",
        f"Command: `python -m bench.scaling{' --quick' if quick else ''}`. Machine: {machine()}.",
        "Each process pinned to its own core with `taskset`, `OPENBLAS_NUM_THREADS=1`; the "
        "signaling server shares the cores; default model (1.3 M parameters), batch "
        f"{DEFAULTS['batch']} x {DEFAULTS['seq']} tokens per peer per step, aiortc data "
        "channels on 127.0.0.1. Rates leave out the first exchange (link warm-up). Transfer "
        "vs waiting: per exchange, the slower peer's wait (the last bytes) and how much "
        "longer the faster peer waited (the two peers' compute differing).",
        "",
        f"One peer alone (`daisyweb-demo --peers 1`, core 0): {solo_tps:,.0f} tokens/s.",
        "",
        *rows,
        "",
        f"**Time to one peer's {solo_steps}-step held-out loss**, {len(trials)} paired "
        "runs, trial i from run seed i on both sides (initial weights and batches; a group "
        f"peer's batches are keyed by its random id too): one peer trains {solo_steps} "
        "steps; then two peers in the default mode, "
        "time the sum of their rounds' wall times (from a round's start to its commit) "
        "up to the first boundary at or below that run's one-peer loss. Every boundary is "
        "evaluated afterwards: its shared weights rebuilt from the contributions the peers "
        "decoded (written by each peer, `DAISYWEB_TEST_DUMP_GRADS`) and checked against "
        "the hash the group published, so no evaluation slows the run. Held-out: "
        f"`daisyweb-eval`'s {DEFAULT_BATCHES} fixed batches of the last 5% of the built-in "
        f"corpus. Ratios over the median one-peer time ({solo_s:.1f} s); median ratio: "
        f"**{median_ratio:.2f}x** one peer's time (90% bootstrap interval of the median "
        f"over these trials: {low:.2f}x-"
        + (f"{high:.2f}x)." if math.isfinite(high) else "not reached)."),
        "",
        *trial_rows,
        "",
        "**Held-out loss at equal tokens** (in-process simulation with the product's "
        "trainers, codecs and averaging; `bench/rounds_sim.py`; the same held-out batches):",
        "",
        *sim_rows,
        "",
        "**Projection, not a measurement**: group speed-up over one machine for N separate "
        f"machines, from the measured compute time per step ({compute_step * 1000:.0f} ms, "
        "one core) and the measured payload bytes per exchange, each peer uploading its "
        "payload to the N - 1 others at the link rate, no latency; with an overlap of K "
        "steps, K steps' compute hides as much of the transfer.",
        "",
        *proj,
    ])
    print(md)
    if not quick:
        write_section("scaling", md)


if __name__ == "__main__":
    main()
