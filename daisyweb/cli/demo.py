"""``daisyweb-demo``: the whole product on one machine, on loopback.

``--peers 1`` trains in this process on the built-in corpus. ``--peers N`` (N >= 2)
starts a signaling server and N ``daisyweb-peer`` processes on 127.0.0.1 that train as
one group in a private room; the dashboard URL (the host's link) is printed first.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import numpy as np

from daisyweb.checkpoints.checkpoint import CheckpointError, TokenizerInfo
from daisyweb.cli.peer import task_setting
from daisyweb.data import BatchSampler, builtin_tokens, default_tokenizer
from daisyweb.rules import CODEC_NAMES, COMPUTE_NAMES
from daisyweb.tasks import run_fields
from daisyweb.training.config import DEFAULTS, RunConfig, run_config
from daisyweb.training.loop import train_local
from daisyweb.training.metrics import MetricsWriter, Progress, kernel_line, kernel_report
from daisyweb.training.state import TrainState

MAX_PEERS = 8
# The demo shows the held-out curve: every third round of the default (about 0.2 s each,
# 7 points in a 300-step run, the last step's included).
EVAL_EVERY = 48


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="daisyweb-demo",
        description="Train a daisyweb group on this machine (loopback only).")
    p.add_argument("--peers", type=int, default=3, help="peers in the group (default 3)")
    # Run flags default to None: run_config() fills DEFAULTS (one set for every entry point).
    p.add_argument("--steps", type=int, help=f"training steps (default {DEFAULTS['steps']})")
    p.add_argument("--width", type=int, help=f"default {DEFAULTS['width']}")
    p.add_argument("--layers", type=int, help=f"default {DEFAULTS['layers']}")
    p.add_argument("--heads", type=int, help=f"default {DEFAULTS['heads']}")
    p.add_argument("--seq", type=int, help=f"default {DEFAULTS['seq']}")
    p.add_argument("--batch", type=int,
                   help=f"sequences per peer per step (default {DEFAULTS['batch']})")
    p.add_argument("--lr", type=float, help=f"default {DEFAULTS['lr']}")
    p.add_argument("--seed", type=int, help=f"default {DEFAULTS['seed']}")
    p.add_argument("--sync-every", type=int, metavar="H",
                   help=f"local steps per exchange; 1 = lockstep (default "
                        f"{DEFAULTS['sync_every']})")
    p.add_argument("--codec", choices=CODEC_NAMES,
                   help=f"what peers exchange (default {DEFAULTS['codec']})")
    p.add_argument("--outer-lr", type=float, help=f"default {DEFAULTS['outer_lr']}")
    p.add_argument("--sync-max", type=int, metavar="H",
                   help="the longest round the leader may make when a slow link needs it "
                        f"(default {DEFAULTS['sync_max']}: 4x --sync-every)")
    p.add_argument("--overlap", type=int, metavar="K",
                   help="steps of each round run while the last exchange is in flight "
                        f"(default {DEFAULTS['overlap']}; at most --sync-max: the whole "
                        "round, the group's update applied a round later)")
    p.add_argument("--compute", choices=COMPUTE_NAMES,
                   help="the forward GEMMs: the verified int8 kernels or plain float32 "
                        f"(default {DEFAULTS['compute']})")
    p.add_argument("--task", metavar="MODULE:NAME",
                   help="train a task of your own instead of the built-in GPT "
                        "(docs/tasks.md; e.g. daisyweb.tasks.teacher:Teacher)")
    p.add_argument("--task-set", action="append", type=task_setting, metavar="NAME=VALUE",
                   help="a setting of --task (repeatable)")
    p.add_argument("--capacity", choices=("on", "off"), default="on",
                   help="faster peers take a bigger share of each step's sequences "
                        "(default on)")
    p.add_argument("--save", metavar="FILE.pt", help="write the final checkpoint here")
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY, metavar="K",
                   help="leader: held-out loss every K steps (and the last) in progress, "
                        f"metrics and the dashboard's curve (default {EVAL_EVERY}; 0 = off)")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="also checkpoint every K steps (needs --save)")
    p.add_argument("--metrics", metavar="FILE.jsonl", help="one JSON object per step")
    p.add_argument("--transport", choices=("auto", "aiortc", "libwebrtc"), default=None,
                   help="the peers' WebRTC implementation (default auto: libwebrtc when the "
                        "wrtc package is installed, else aiortc); each peer says which")
    p.add_argument("--port", type=int, default=8787,
                   help="signaling/dashboard port for --peers >= 2 (default 8787; 0 = any)")
    return p


def _run_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RunConfig:
    vocab = default_tokenizer().vocab_size
    try:  # tasks.TaskError is a ValueError
        task = run_fields(args.task, dict(args.task_set or []))
        return run_config(vocab, width=args.width, layers=args.layers, heads=args.heads,
                          seq=args.seq, batch=args.batch, steps=args.steps, lr=args.lr,
                          seed=args.seed, data="builtin", sync_every=args.sync_every,
                          codec=args.codec, outer_lr=args.outer_lr, overlap=args.overlap,
                          compute=args.compute, sync_max=args.sync_max, **task)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def run_single(args: argparse.Namespace, run: RunConfig) -> int:
    tok = default_tokenizer()
    info = TokenizerInfo(tok.vocab_size, tok.file_hash)
    if run.task:
        def sample(step: int) -> np.ndarray:
            return run.task_impl.batch(run.seed, step, "demo-0", run.batch)
        data = f"task {run.task}"
    else:
        sample = BatchSampler(builtin_tokens(), batch=run.batch, seq=run.model.seq,
                              seed=run.seed, peer="demo-0").sample
        data = "built-in corpus"
    state = TrainState.fresh(run)
    print(f"daisyweb-demo: 1 peer, {state.size:,} parameters, {run.steps} steps, "
          f"{data}, kernels backend {_backend()}", flush=True)
    try:
        metrics = MetricsWriter(args.metrics)
    except OSError as exc:
        print(f"daisyweb-demo: --metrics: cannot open {args.metrics}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    final_save_failed = False

    def save_failed(exc: CheckpointError, final: bool) -> None:
        # A failed periodic save loses nothing yet: training goes on, the next save retries.
        nonlocal final_save_failed
        final_save_failed = final_save_failed or final
        what = "the final checkpoint" if final else "a periodic checkpoint (training goes on)"
        print(f"daisyweb-demo: could not save {what} of step {state.step}: {exc}",
              file=sys.stderr, flush=True)

    try:
        train_local(state, sample, tokenizer=info, save=args.save,
                    save_every=args.save_every, metrics=metrics,
                    progress=Progress(run.steps), on_save_error=save_failed)
    except KeyboardInterrupt:
        saved = args.save and not final_save_failed
        print(f"\ndaisyweb-demo: interrupted at step {state.step}"
              + (f"; checkpoint saved to {args.save}" if saved else ""), file=sys.stderr)
        return 130
    except Exception as exc:
        # A refused (NaN/Inf) gradient or a failing step: the state is the last committed
        # step, untouched by the failed one, and already saved by train_local.
        saved = args.save and not final_save_failed
        print(f"daisyweb-demo: training halted at step {state.step + 1}: "
              f"{type(exc).__name__}: {exc}"
              + (f"; the last committed step ({state.step}) is saved to {args.save}"
                 if saved else ""), file=sys.stderr, flush=True)
        print(f"daisyweb-demo: {kernel_line(kernel_report())}", flush=True)
        return 1
    finally:
        metrics.close()
    print(f"daisyweb-demo: {kernel_line(kernel_report())}", flush=True)
    if final_save_failed:
        return 1
    print(f"daisyweb-demo: done, step {state.step}, weight hash {state.weight_hash()[:16]}"
          + (f", saved {args.save}" if args.save else ""), flush=True)
    return 0


def _backend() -> str:
    import kernels

    return kernels.active_backend()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LINK_MARK = b"dashboard with Accept/Deny (keep it private): "


def _pump(prefix: str, stream: IO[bytes], out: IO[str], progress: bool = True) -> None:
    for raw in iter(stream.readline, b""):
        if b"aiohttp.access" in raw:
            continue  # one line per HTTP request drowns the training progress
        if not progress and raw.startswith(b"step "):
            continue  # followers commit the same steps; the leader's line shows them
        if progress and _LINK_MARK in raw:
            # The host's link carries the room's secret: the one URL that shows the room.
            link = raw.split(_LINK_MARK, 1)[1].decode(errors="replace").strip()
            out.write(f"daisyweb-demo: dashboard {link}\n")
            out.flush()
            continue
        out.write(f"{prefix}{raw.decode(errors='replace')}")
        out.flush()


def _port_in_use(port: int) -> bool:
    """True if another program already holds ``port`` on 127.0.0.1."""
    with socket.socket() as s:
        # As the server binds (aiohttp sets SO_REUSEADDR): a previous run's TIME_WAIT
        # connections must not count as "in use", only a live listener.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _healthy(port: int) -> bool:
    """True if the port answers ``GET /healthz`` the way our signaling server does."""
    # No proxies: an http_proxy in the environment must not see loopback requests.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=1.0) as r:
            body = json.loads(r.read(4096))
    except (OSError, ValueError):  # refused, reset, not HTTP, not JSON, HTTP error
        return False
    return isinstance(body, dict) and body.get("ok") is True


def _wait_http(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> bool:
    """Wait until OUR server (``proc``, still alive) answers /healthz with ok: true.

    Only a TCP accept is not enough: another program on the port would pass that.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if _healthy(port):
            return proc.poll() is None  # a foreign server answering for a dead one
        time.sleep(0.1)
    return False


def peer_commands(args: argparse.Namespace, run: RunConfig, server: str,
                  room: str) -> list[list[str]]:
    """The ``daisyweb-peer`` command line of each demo peer (peer 0 leads and hosts)."""
    # Every peer admits with --approve auto: hosting passes on if the host leaves.
    base = [sys.executable, "-m", "daisyweb.cli.peer", "--server", server, "--room", room,
            "--ice-host", "127.0.0.1", "--join-timeout", "60", "--approve", "auto"]
    if args.transport is not None:  # else each peer's default (auto, or $DAISYWEB_TRANSPORT)
        base += ["--transport", args.transport]
    leader = base + [
        "--name", "peer-0", "--start", "--wait-peers", str(args.peers),
        "--width", str(run.model.width), "--layers", str(run.model.layers),
        "--heads", str(run.model.heads), "--seq", str(run.model.seq),
        "--batch", str(run.batch), "--steps", str(run.steps), "--lr", repr(run.lr),
        "--seed", str(run.seed), "--sync-every", str(run.sync_every), "--codec", run.codec,
        "--outer-lr", repr(run.outer_lr), "--overlap", str(run.overlap),
        "--sync-max", str(run.sync_max),
        "--compute", run.compute, "--capacity", args.capacity]
    if run.task:
        leader += ["--task", run.task]
        for name, value in run.task_config:
            leader += ["--task-set", f"{name}={value!r}"]
    if args.save:
        leader += ["--save", args.save]
        if args.save_every:
            leader += ["--save-every", str(args.save_every)]
    if args.metrics:
        leader += ["--metrics", args.metrics]
    if args.eval_every:
        leader += ["--eval-every", str(args.eval_every)]
    return [leader] + [base + ["--name", f"peer-{i}"] for i in range(1, args.peers)]


def blas_threads(peers: int, cores: int | None = None) -> dict[str, str]:
    """BLAS thread counts for ``peers`` processes sharing this machine's cores.

    Each OpenBLAS thread spins after a call, so N peers with a thread per core each
    oversubscribe the machine (three peers on two cores run 5x slower than with one thread
    each). A count the user set in the environment is kept.
    """
    per_peer = str(max(1, (cores or os.cpu_count() or 1) // peers))
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    return {n: per_peer for n in names if n not in os.environ}


def run_group(args: argparse.Namespace, run: RunConfig) -> int:
    if args.port and _port_in_use(args.port):
        # Said at once: our server could not bind, and whoever holds it is not ours.
        print(f"daisyweb-demo: port {args.port} is in use; try --port 0", file=sys.stderr)
        return 1
    port = args.port or _free_port()
    room = "demo-" + secrets.token_hex(4)
    server_url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **blas_threads(args.peers))
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []

    def spawn(prefix: str, cmd: list[str], progress: bool = True) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        t = threading.Thread(target=_pump, args=(prefix, proc.stdout, sys.stdout, progress),
                             daemon=True)
        t.start()
        procs.append(proc)
        pumps.append(t)
        return proc

    try:
        server = spawn("[signal] ", [sys.executable, "-m", "signaling.cli", "--host",
                                     "127.0.0.1", "--port", str(port), "--data", "builtin"])
        if not _wait_http(port, server):
            print(f"daisyweb-demo: the signaling server did not start on port {port} "
                  "(is the port taken? try --port 0)", file=sys.stderr)
            return 1
        print(f"daisyweb-demo: signaling server {server_url}, room {room} "
              f"({args.peers} peers, {run.steps} steps, built-in corpus)", flush=True)
        commands = peer_commands(args, run, server_url, room)
        peers = [spawn("[peer-0] ", commands[0])]
        time.sleep(1.0)  # the leader must join first: the room's first peer is its host
        peers += [spawn(f"[peer-{i}] ", cmd, progress=False)
                  for i, cmd in enumerate(commands[1:], 1)]
        codes = [p.wait() for p in peers]
        for t in pumps[1:]:
            t.join(timeout=2)
        failed = [i for i, c in enumerate(codes) if c != 0]
        if failed:
            print(f"daisyweb-demo: peers {failed} exited with codes "
                  f"{[codes[i] for i in failed]}", file=sys.stderr)
            return 1
        print("daisyweb-demo: done" + (f", saved {args.save}" if args.save else ""),
              flush=True)
        return 0
    except KeyboardInterrupt:
        print("\ndaisyweb-demo: interrupted", file=sys.stderr)
        return 130
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in reversed(procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 1 <= args.peers <= MAX_PEERS:
        parser.error(f"--peers must be between 1 and {MAX_PEERS}")
    if args.save_every < 0 or (args.save_every and not args.save):
        parser.error("--save-every needs --save and must be >= 0")
    if args.eval_every < 0:
        parser.error("--eval-every must be >= 0")
    if args.task_set and not args.task:
        parser.error("--task-set needs --task")
    if args.task and args.save:
        parser.error("--save holds the built-in GPT's checkpoints, not a --task run's")
    if args.save and not Path(args.save).resolve().parent.is_dir():
        parser.error(f"--save: directory of {args.save} does not exist")
    run = _run_config(args, parser)
    if args.peers == 1:
        return run_single(args, run)
    return run_group(args, run)


if __name__ == "__main__":
    sys.exit(main())
