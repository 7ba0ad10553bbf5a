"""The asyncio driver of one peer: Mesh events -> :class:`sync.StepMachine` -> actions.

Everything the protocol decides lives in ``daisyweb.protocol.sync``; this module only moves bytes
and time: it connects the mesh, hands the start config and snapshot over, runs gradient
computations in a worker thread (so heartbeats and messages keep flowing during a step),
sends each peer's messages from its own ordered queue (a slow peer never blocks the
step loop), fetches text from the server's ``/data`` in the background (never waiting for
it: the built-in corpus is there from the start), and writes progress, metrics,
checkpoints and dashboard status.

Start handshake: the leader (``--start``) sends ``Config`` then ``Snapshot`` (checkpoint
bytes of the current boundary) to each peer that connects; a follower validates both --
the config by the wire decoder and ``RunConfig``, the snapshot with the checkpoint rules
(model, tokenizer) and against the snapshot's weight hash -- before its state machine
starts. Mid-run joins use the same path at a step boundary.

Test-only switches (environment only, read once at start; nothing on the wire can set
them): ``DAISYWEB_TEST_BREAK_KERNEL=1`` (an int8 GEMM that is off by one),
``DAISYWEB_TEST_DROP_GRADIENT=S`` (drop this peer's step-S gradient to one recipient),
``DAISYWEB_TEST_CORRUPT_GRADIENT=S:nan|short`` (corrupt the step-S gradient on the wire),
``DAISYWEB_TEST_FORK_AT=S`` (perturb one weight after step S is applied),
``DAISYWEB_TEST_DUMP_GRADS=DIR`` (write each local gradient to DIR for the replay oracle),
``DAISYWEB_TEST_STEP_DELAY=SECONDS`` (sleep before each gradient, to widen the window for
kill tests), ``DAISYWEB_TEST_GRADIENT_RAISES=S`` (the step-S gradient computation raises,
as a kernel refusing a non-finite activation would),
``DAISYWEB_TEST_CORRUPT_SNAPSHOT=byte|hash`` (the leader flips one byte of every snapshot
payload it sends, or announces a wrong weight hash with it),
``DAISYWEB_TEST_PROTOCOL_VERSION=N`` (this peer speaks protocol version N instead of
``wire.PROTOCOL_VERSION``: it announces N in its Hello and refuses peers that do not).

Version handshake: the first message to every newly connected peer is
``Hello(self, version)``. A follower refuses a leader of another version (one line, exit
1); the leader excludes a follower of another version (``sync.StepMachine``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import math
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from daisyweb.protocol import sync, wire
from daisyweb.protocol.codec import codec_by_name
from daisyweb.training.config import RunConfig, run_config
from daisyweb.training.rounds import Contribution, LockstepTrainer, RoundTrainer, round_count
from daisyweb.training.state import TrainState
from kernels import NonFiniteError

__all__ = [
    "PeerError",
    "PeerOptions",
    "TestHooks",
    "options_from_args",
    "run_peer",
    "data_url",
    "break_kernel_for_tests",
]

TICK_S = 0.2
BUFFER_BEFORE_START = 512  # messages kept while a follower waits for its snapshot
DRAIN_S = 5.0
LINGER_S = 0.3
PENDING_PER_PEER = 16  # messages held for a peer whose channel is not up yet
DATA_EVERY_S = 30.0
START_TEXT_CHARS = 1 << 18  # built-in text encoded before the first step
DATA_MAX_TOKENS = 4_000_000


class PeerError(Exception):
    """A clear one-line failure with the process exit code to use."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class PeerOptions:
    server: str
    room: str | None = None
    name: str | None = None
    approve: str = "ask"
    start: bool = False
    model: dict[str, int] | None = None  # width/layers/heads/seq given on the command line
    batch: int | None = None
    steps: int | None = None
    lr: float | None = None
    seed: int | None = None
    sync_every: int | None = None
    codec: str | None = None
    outer_lr: float | None = None
    resume: str | None = None
    save: str | None = None
    save_every: int = 0
    metrics: str | None = None
    join_timeout: float = 60.0
    stun: list[str] = field(default_factory=list)
    ice_hosts: list[str] = field(default_factory=list)
    wait_peers: int = 1
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    repair_after: float = 2.0
    progress: bool = True


def options_from_args(args: argparse.Namespace) -> PeerOptions:
    model = None
    if args.start:
        model = {k: getattr(args, k) for k in ("width", "layers", "heads", "seq")
                 if getattr(args, k) is not None}
    return PeerOptions(
        server=args.server, room=args.room, name=args.name, approve=args.approve,
        start=args.start, model=model, batch=args.batch, steps=args.steps, lr=args.lr,
        seed=args.seed, sync_every=args.sync_every, codec=args.codec, outer_lr=args.outer_lr,
        resume=args.resume, save=args.save, save_every=args.save_every,
        metrics=args.metrics, join_timeout=args.join_timeout, stun=list(args.stun),
        ice_hosts=list(args.ice_host), wait_peers=args.wait_peers,
    )


@dataclass(frozen=True)
class TestHooks:
    """Test-only fault switches, from the environment only (see module docstring)."""

    break_kernel: bool = False
    drop_gradient: int | None = None
    corrupt_gradient: tuple[int, str] | None = None
    fork_at: int | None = None
    dump_grads: str | None = None
    step_delay: float = 0.0
    gradient_raises: int | None = None
    corrupt_snapshot: str | None = None  # "byte" or "hash"
    protocol_version: int | None = None  # announce this instead of wire.PROTOCOL_VERSION

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> TestHooks:
        env = dict(os.environ if env is None else env)

        def step_of(name: str) -> int | None:
            v = env.get(name)
            if not v:
                return None
            try:
                return int(v)
            except ValueError:
                raise PeerError(2, f"{name} must be a step number, got {v!r}") from None

        corrupt = None
        if env.get("DAISYWEB_TEST_CORRUPT_GRADIENT"):
            s, _, kind = env["DAISYWEB_TEST_CORRUPT_GRADIENT"].partition(":")
            if kind not in ("nan", "short") or not s.isdigit():
                raise PeerError(2, "DAISYWEB_TEST_CORRUPT_GRADIENT must be STEP:nan|short")
            corrupt = (int(s), kind)
        version = None
        if env.get("DAISYWEB_TEST_PROTOCOL_VERSION"):
            v = env["DAISYWEB_TEST_PROTOCOL_VERSION"]
            if not v.isdigit() or int(v) >= 1 << 32:
                raise PeerError(2, f"DAISYWEB_TEST_PROTOCOL_VERSION must be a version "
                                   f"number, got {v!r}")
            version = int(v)
        snap = env.get("DAISYWEB_TEST_CORRUPT_SNAPSHOT") or None
        if snap not in (None, "byte", "hash"):
            raise PeerError(2, "DAISYWEB_TEST_CORRUPT_SNAPSHOT must be byte|hash")
        return cls(
            break_kernel=env.get("DAISYWEB_TEST_BREAK_KERNEL") == "1",
            drop_gradient=step_of("DAISYWEB_TEST_DROP_GRADIENT"),
            corrupt_gradient=corrupt,
            fork_at=step_of("DAISYWEB_TEST_FORK_AT"),
            dump_grads=env.get("DAISYWEB_TEST_DUMP_GRADS") or None,
            step_delay=float(env.get("DAISYWEB_TEST_STEP_DELAY") or 0.0),
            gradient_raises=step_of("DAISYWEB_TEST_GRADIENT_RAISES"),
            corrupt_snapshot=snap,
            protocol_version=version,
        )


def break_kernel_for_tests() -> None:
    """Install an int8 GEMM that is wrong in one cell, as the live backend (tests only).

    The mirror backend is the reference the audit trusts, so a broken mirror is what a
    miscompiled or faulty machine looks like from the inside: only the cross-machine
    probe can tell.
    """
    # By module path: the package re-exports functions named like its submodules.
    backends = importlib.import_module("kernels.backends")
    dispatch = importlib.import_module("kernels.dispatch")

    class _OffByOne(backends.MirrorBackend):
        def gemm(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
            out = super().gemm(a, b)
            out.flat[0] += 1
            return out

    dispatch._instances["mirror"] = _OffByOne()
    dispatch._status["mirror"] = True
    dispatch.use_backend("mirror")


def data_url(server: str) -> str:
    """The server's ``/data`` URL (http or https) from the signaling URL the user gave."""
    u = urlsplit(server)
    scheme = {"ws": "http", "wss": "https"}.get(u.scheme, u.scheme)
    return urlunsplit((scheme, u.netloc, "/data", "", ""))


def _probe() -> str:
    import kernels

    return kernels.probe_hash()


class _Replica:
    """A lockstep or round trainer as a :class:`sync.Replica`, with the fork test hook."""

    def __init__(self, trainer: LockstepTrainer | RoundTrainer, fork_at: int | None) -> None:
        self.trainer = trainer
        self.fork_at = fork_at

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def size(self) -> int:
        return self.trainer.size

    def apply(self, average: np.ndarray) -> None:
        self.trainer.apply(average)
        if self.fork_at is not None and self.trainer.step == self.fork_at:
            self.trainer.state.params[0] += np.float32(1e-3)  # test hook: a silent divergence

    def weight_hash(self) -> str:
        return self.trainer.weight_hash()

    def backup(self) -> Any:
        return self.trainer.backup()

    def restore(self, token: Any) -> None:
        self.trainer.restore(token)


def make_trainer(state: TrainState) -> LockstepTrainer | RoundTrainer:
    """Lockstep for ``sync_every == 1``, rounds of local steps otherwise."""
    run = state.run
    if run.sync_every == 1:
        return LockstepTrainer(state)
    return RoundTrainer(state, run.sync_every, run.outer_lr)


class _RecordingEncoder:
    """The run's codec with error feedback; remembers the last payload it produced, so
    the replay-oracle dump (a test switch) can store what the wire really carried."""

    def __init__(self, name: str, size: int) -> None:
        codec = codec_by_name(name)
        self.name = codec.name
        self._codec = codec
        self._encoder = codec.encoder(size) if hasattr(codec, "encoder") else codec
        self.last_payload = b""
        self.bytes_sent = 0  # payload bytes of this member's own contributions so far

    def encode(self, vector: np.ndarray) -> bytes:
        self.last_payload = self._encoder.encode(vector)
        self.bytes_sent += len(self.last_payload)
        return self.last_payload

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray:
        return self._codec.decode(payload, size, who)


def _mode(run: RunConfig) -> str:
    """The exchange mode as shown to users: ``lockstep f32`` or ``rounds H=32 int8``."""
    if run.sync_every == 1:
        return f"lockstep {run.codec}"
    return f"rounds H={run.sync_every} {run.codec}"


def _machine_steps(run: RunConfig) -> int:
    """What the step machine counts to: steps in lockstep, rounds otherwise."""
    return run.steps if run.sync_every == 1 else round_count(run.steps, run.sync_every)


def _raising_contribution(index: int, batch: Callable[[int], np.ndarray]) -> Contribution:
    """Test hook (DAISYWEB_TEST_GRADIENT_RAISES): what a kernel refusing NaN looks like."""
    raise NonFiniteError("test: injected gradient failure")


def _is_hello(item: tuple[Any, ...]) -> bool:
    return (item[0] == "mesh" and type(item[1]).__name__ == "Received"
            and isinstance(item[1].message, wire.Hello))


def _log(msg: str) -> None:
    print(f"daisyweb-peer: {msg}", file=sys.stderr, flush=True)


async def _maybe_await(x: Any) -> Any:
    if inspect.isawaitable(x):
        return await x
    return x


def _tokenizer_info() -> tuple[Any, Any]:
    from daisyweb.checkpoints.checkpoint import TokenizerInfo
    from daisyweb.data import default_tokenizer

    tok = default_tokenizer()
    return tok, TokenizerInfo(tok.vocab_size, tok.file_hash)


def _leader_state(opts: PeerOptions, tokinfo: Any) -> Any:
    """The leader's starting TrainState: fresh from flags or resumed from --resume."""
    from daisyweb.checkpoints.checkpoint import CheckpointError, load_checkpoint
    if opts.resume:
        if not Path(opts.resume).is_file():
            raise PeerError(2, f"--resume: no such file {opts.resume}")
        try:
            ckpt = load_checkpoint(opts.resume, expect_tokenizer=tokinfo)
            run = RunConfig.from_checkpoint(ckpt)
            state = TrainState.from_checkpoint(ckpt, run)
        except (CheckpointError, ValueError, OSError) as exc:
            raise PeerError(2, f"--resume {opts.resume}: {exc}") from None
        given = dict(opts.model or {})
        for k in ("batch", "steps", "lr", "seed", "sync_every", "codec", "outer_lr"):
            if getattr(opts, k) is not None:
                given[k] = getattr(opts, k)
        have = {**ckpt.model.to_dict(), **run.to_dict()}
        conflicts = [f"--{k} {v} (file: {have[k]})" for k, v in given.items()
                     if k in have and have[k] != v]
        if conflicts:
            _log("the checkpoint's config wins over " + ", ".join(conflicts))
        if state.step >= run.steps:
            raise PeerError(2, f"--resume {opts.resume}: already at step {state.step} "
                               f"of {run.steps}")
        try:
            make_trainer(state)
        except ValueError as exc:
            raise PeerError(2, f"--resume {opts.resume}: {exc}") from None
        return state
    m = opts.model or {}
    try:
        run = run_config(tokinfo.vocab_size, **m, batch=opts.batch, steps=opts.steps,
                         lr=opts.lr, seed=opts.seed, data="server",
                         sync_every=opts.sync_every, codec=opts.codec, outer_lr=opts.outer_lr)
    except (TypeError, ValueError) as exc:
        raise PeerError(2, f"bad run config: {exc}") from None
    return TrainState.fresh(run)


async def run_peer(
    opts: PeerOptions,
    *,
    hooks: TestHooks | None = None,
    mesh_factory: Callable[..., Any] | None = None,
) -> int:
    """Run one peer to the end. Returns the exit code; raises PeerError for setup errors.

    ``mesh_factory`` (default ``daisyweb.net.mesh.Mesh``) lets tests run several peers in
    one process over an in-memory mesh with the same interface.
    """
    hooks = TestHooks.from_env() if hooks is None else hooks
    if opts.save:
        parent = Path(opts.save).resolve().parent
        if parent.exists() and not parent.is_dir():
            raise PeerError(2, f"--save: {parent} is not a directory")
        if not parent.is_dir():
            raise PeerError(2, f"--save: directory {parent} does not exist")
    if hooks.break_kernel:
        break_kernel_for_tests()
    tok, tokinfo = _tokenizer_info()
    state = _leader_state(opts, tokinfo) if opts.start else None
    try:
        driver = _Driver(opts, hooks, tok, tokinfo, state, mesh_factory)
    except OSError as exc:  # the only file the driver opens up front is --metrics
        raise PeerError(2, f"--metrics: cannot open {opts.metrics}: "
                           f"{exc.strerror or exc}") from None
    return await driver.main()


class _Driver:
    def __init__(self, opts: PeerOptions, hooks: TestHooks, tok: Any, tokinfo: Any,
                 state: Any, mesh_factory: Callable[..., Any] | None) -> None:
        from daisyweb.training.train import MetricsWriter

        self.mesh_factory = mesh_factory
        self.opts = opts
        self.hooks = hooks
        pv = hooks.protocol_version
        self.version = wire.PROTOCOL_VERSION if pv is None else pv
        self.tok = tok
        self.tokinfo = tokinfo
        self.state = state
        self.replica: _Replica | None = None
        self.machine: sync.StepMachine | None = None
        self.mesh: Any = None
        self.metrics = MetricsWriter(opts.metrics)
        self.queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.outboxes: dict[str, asyncio.Queue[wire.Message]] = {}
        self.senders: dict[str, asyncio.Task[None]] = {}
        self.connected: list[str] = []
        # Peers whose Hello arrived on the current link: the leader offers a snapshot
        # only after it, so a peer of another version is refused before it gets one.
        self.hello_from: set[str] = set()
        self.tasks: list[asyncio.Task[Any]] = []
        self.sampler: Any = None
        self.pending_tokens: deque[np.ndarray] = deque()
        self.fetched_tokens = 0
        self.builtin_loaded = False
        self.last_loss = 0.0
        self.last_peers = 1
        self.last_extra: dict[str, Any] = {}  # tokens_per_s and probe of the last step
        self.progress: Any = None
        self.result: tuple[int, str] | None = None
        self.dropped_once = False
        self.step_t0: dict[int, float] = {}
        self.compute_s: dict[int, float] = {}
        self.grad_ready: dict[int, float] = {}
        self.last_saved = -1

    # ------------------------------------------------------------------ setup
    def _mesh(self) -> Any:
        factory = self.mesh_factory
        if factory is None:
            from daisyweb.net.mesh import Mesh

            factory = Mesh
        return factory(
            self.opts.server, room=self.opts.room, name=self.opts.name or "peer",
            approve=self._approve_callback(), ice_hosts=self.opts.ice_hosts or None,
            stun=list(self.opts.stun), join_timeout=self.opts.join_timeout,
            heartbeat_interval=self.opts.heartbeat_interval,
            heartbeat_timeout=self.opts.heartbeat_timeout,
        )

    def _approve_callback(self) -> Any:
        if self.opts.approve == "auto":
            return None

        async def ask(*who: Any) -> bool:
            label = " ".join(str(w) for w in who if w)
            prompt = f"daisyweb-peer: admit {label or 'a waiting peer'}? [y/N] "
            if not sys.stdin or not sys.stdin.isatty():
                link = getattr(self.mesh, "host_link", lambda: None)()
                if link is None:
                    _log(f"refusing {label}: --approve ask needs a terminal or the dashboard")
                    return False
                # No terminal: the dashboard decides; the mesh cancels this wait when
                # the decision arrives.
                _log(f"{label} is waiting: accept or deny on the dashboard")
                await asyncio.Event().wait()
            answer = await asyncio.get_running_loop().run_in_executor(None, input, prompt)
            return answer.strip().lower() in ("y", "yes")

        return ask

    async def main(self) -> int:
        self.mesh = self._mesh()
        if self.hooks.drop_gradient is not None:
            self.mesh.fault_drop = self._fault_drop
        try:
            try:
                await self.mesh.start()
            except Exception as exc:
                # By name: the mesh's JoinTimeout/JoinDenied (or a test mesh's own);
                # checked first, as a JoinTimeout may well be an OSError too.
                kind = type(exc).__name__
                if kind == "JoinTimeout":
                    raise PeerError(3, f"{exc}") from None
                if kind == "JoinDenied":
                    raise PeerError(3, f"the host denied this peer: {exc}") from None
                if kind == "MeshError" or isinstance(exc, OSError):
                    raise PeerError(3, f"cannot join: {exc}") from None
                raise
            _log(f"joined as {self.mesh.self_id}"
                 + (f" in room {self.opts.room}" if self.opts.room else ""))
            self.tasks.append(asyncio.create_task(self._pump_mesh()))
            self.tasks.append(asyncio.create_task(self._ticker()))
            self.tasks.append(asyncio.create_task(self._announce_host_link()))
            if self.opts.start:
                await self._start_leader()
            else:
                await self._start_follower()
            loop = asyncio.get_running_loop()
            # From here on an interrupt ends the run cleanly: end record, checkpoint.
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self.queue.put_nowait, ("interrupt",))
            await self._loop()
            code = await self._finish()
            await self._drain()
            return code
        finally:
            for t in self.tasks + list(self.senders.values()):
                t.cancel()
            for t in self.tasks + list(self.senders.values()):
                with contextlib.suppress(BaseException):
                    await t
            with contextlib.suppress(Exception):
                await _maybe_await(self.mesh.close())
            self.metrics.close()

    async def _pump_mesh(self) -> None:
        while True:
            ev = await self.mesh.next_event()
            await self.queue.put(("mesh", ev))

    async def _announce_host_link(self) -> None:
        """Print the dashboard approval link whenever this peer gets (new) hosting."""
        shown = None
        while True:
            link = getattr(self.mesh, "host_link", lambda: None)()
            if link is not None and link != shown:
                shown = link
                _log(f"hosting this room; dashboard with Accept/Deny (keep it private): {link}")
            await asyncio.sleep(0.5)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self.queue.put(("tick",))

    async def _start_leader(self) -> None:
        run = self.state.run
        self._make_replica(self.state)
        self._make_sampler(run)
        deadline = time.monotonic() + self.opts.join_timeout
        ups: list[str] = []
        held: list[tuple[Any, ...]] = []
        # A peer counts once its link is up and its Hello arrived (a peer of another
        # version counts too: it is excluded as soon as the machine starts).
        while len(ready := [p for p in ups if p in self.hello_from]) + 1 < self.opts.wait_peers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(3, f"only {len(ready) + 1} of {self.opts.wait_peers} peers "
                                   f"joined within {self.opts.join_timeout:g} s")
            try:
                item = await asyncio.wait_for(self.queue.get(), left)
            except TimeoutError:
                continue
            if item[0] == "mesh":
                kind = type(item[1]).__name__
                if kind == "PeerUp":
                    self._peer_connected(item[1].peer)
                    ups.append(item[1].peer)
                    continue
                if kind == "PeerDown" and item[1].peer in ups:
                    ups.remove(item[1].peer)
                    self.hello_from.discard(item[1].peer)
                if _is_hello(item) and item[1].message.peer_id == item[1].peer:
                    self.hello_from.add(item[1].peer)
            held.append(item)
        self.machine = sync.StepMachine(
            self.mesh.self_id, self.replica, _machine_steps(run), _probe,
            leader=self.mesh.self_id, repair_after=self.opts.repair_after,
            join_timeout=self.opts.join_timeout, version=self.version, codec=self.encoder)
        _log(f"leading: {self.state.size:,} parameters, {run.steps} steps, "
             f"from step {self.state.step}, {_mode(run)}")
        self._begin_progress()
        # Hellos first: a peer of another version is excluded before it is offered a
        # snapshot or a place in the first roster.
        hellos = [i for i in held if _is_hello(i)]
        for item in hellos:
            await self._handle(item)
        now = time.monotonic()
        for p in ups:
            if p in self.hello_from:  # the others are announced when their Hello comes
                await self._do(self.machine.peer_up(p, now))
        await self._do(self.machine.start(now))
        for item in held:
            if not _is_hello(item):
                await self._handle(item)

    async def _start_follower(self) -> None:
        """Wait for Config + Snapshot from a leader; buffer everything else meanwhile."""
        from daisyweb.checkpoints.checkpoint import CheckpointError, checkpoint_from_bytes
        from daisyweb.training.train import RunConfig, TrainState

        deadline = time.monotonic() + self.opts.join_timeout
        held: deque[tuple[Any, ...]] = deque(maxlen=BUFFER_BEFORE_START)
        configs: dict[str, wire.Config] = {}
        versions: dict[str, int] = {}  # peers whose Hello announced another version
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(3, f"no leader sent a run within {self.opts.join_timeout:g} s "
                                   "(start one peer with --start)")
            try:
                item = await asyncio.wait_for(self.queue.get(), left)
            except TimeoutError:
                continue
            if item[0] != "mesh":
                continue
            ev = item[1]
            kind = type(ev).__name__
            if kind == "PeerUp":
                self._peer_connected(ev.peer)
                continue
            if kind == "PeerDown":
                self._peer_gone(ev.peer)
                configs.pop(ev.peer, None)
                continue
            if kind != "Received":
                continue
            msg = ev.message
            if isinstance(msg, wire.Hello):
                if msg.peer_id == ev.peer and msg.version != self.version:
                    versions[ev.peer] = msg.version
                held.append(item)  # the state machine refuses a non-leader one later
                continue
            if ev.peer in versions and isinstance(msg, (wire.Config, wire.Snapshot,
                                                         wire.Halt)):
                # Only a leader sends these (a Halt: it excluded us for our version).
                raise PeerError(1, f"refused the leader {ev.peer}: it speaks protocol "
                                   f"version {versions[ev.peer]}, this peer speaks "
                                   f"{self.version}")
            if isinstance(msg, wire.Config):
                configs[ev.peer] = msg
                continue
            if not isinstance(msg, wire.Snapshot) or ev.peer not in configs:
                held.append(item)
                continue
            try:
                run = RunConfig.from_wire(configs[ev.peer])
                ckpt = checkpoint_from_bytes(msg.payload, expect_model=run.model,
                                             expect_tokenizer=self.tokinfo)
                state = TrainState.from_checkpoint(ckpt, run)
            except (CheckpointError, ValueError, wire.WireError) as exc:
                raise PeerError(1, f"refused the snapshot from {ev.peer}: {exc}") from None
            boundary = state.step if run.sync_every == 1 else round_count(
                state.step, run.sync_every)
            if boundary != msg.step or state.weight_hash() != msg.weight_hash:
                raise PeerError(1, f"refused the snapshot from {ev.peer}: its weight hash or "
                                   "step does not match what it announced")
            leader = ev.peer
            break
        self.state = state
        try:
            self._make_replica(state)
        except ValueError as exc:
            raise PeerError(1, f"refused the snapshot from {leader}: {exc}") from None
        self._make_sampler(run)
        self.machine = sync.StepMachine(
            self.mesh.self_id, self.replica, _machine_steps(run), _probe, leader=leader,
            repair_after=self.opts.repair_after, join_timeout=self.opts.join_timeout,
            version=self.version, codec=self.encoder)
        _log(f"following {leader}: {state.size:,} parameters, from step {state.step} "
             f"of {run.steps} (snapshot {msg.weight_hash[:16]} verified)")
        self._begin_progress()
        await self._do(self.machine.start(time.monotonic()))
        for item in held:
            await self._handle(item)

    def _shared_hash(self) -> str:
        replica = self.replica
        return replica.weight_hash() if replica is not None else self.state.weight_hash()

    def _make_replica(self, state: TrainState) -> None:
        self.trainer = make_trainer(state)
        self.replica = _Replica(self.trainer, self.hooks.fork_at)
        self.encoder = _RecordingEncoder(state.run.codec, state.size)

    def _begin_progress(self) -> None:
        from daisyweb.training.train import Progress

        self.progress = Progress(self.state.run.steps,
                                 stream=sys.stderr if self.opts.progress else None)
        self.progress.start(self.state.step)
        self.last_saved = self.state.step  # --save-every counts from where this run starts

    # ------------------------------------------------------------------ data
    def _make_sampler(self, run: Any) -> None:
        """Sampler over the head of the built-in corpus now; then /data slices in the
        background, or the rest of the built-in corpus if /data is not there (encoding
        all of it takes a second or two, so it is not done up front)."""
        from daisyweb.data import BatchSampler, builtin_text

        head = self.tok.encode(builtin_text()[:START_TEXT_CHARS])
        self.sampler = BatchSampler(head, batch=run.batch, seq=run.model.seq,
                                    seed=run.seed, peer=self.mesh.self_id)
        # The whole built-in corpus always loads: training on the head alone (or on a
        # few /data slices) overfits it within a few dozen steps.
        self.tasks.append(asyncio.create_task(self._load_builtin()))
        if run.data != "builtin":
            self.tasks.append(asyncio.create_task(self._fetch_data()))

    async def _load_builtin(self) -> None:
        from daisyweb.data import builtin_text

        if self.builtin_loaded:
            return
        self.builtin_loaded = True
        loop = asyncio.get_running_loop()
        rest = await loop.run_in_executor(
            None, self.tok.encode, builtin_text()[START_TEXT_CHARS:])
        self.pending_tokens.append(np.asarray(rest))

    async def _fetch_data(self) -> None:
        """Fetch text slices from /data now and then; failures just keep the corpus."""
        import aiohttp

        url = data_url(self.opts.server)
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while self.fetched_tokens < DATA_MAX_TOKENS:
                try:
                    async with session.get(url) as resp:
                        text = await resp.text() if resp.status == 200 else ""
                        source = resp.headers.get("X-Daisyweb-Source", "?")
                except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
                    _log(f"/data unavailable ({type(exc).__name__}); using the built-in corpus")
                    text, source = "", "-"
                if source == "builtin":
                    text = ""  # the server's built-in corpus is ours, already loaded
                if text:
                    loop = asyncio.get_running_loop()
                    ids = await loop.run_in_executor(None, self.tok.encode, text)
                    arr = np.asarray(ids, dtype=np.int64)
                    if arr.size:
                        self.pending_tokens.append(arr)
                        self.fetched_tokens += int(arr.size)
                        _log(f"/data: {arr.size:,} tokens ({source})")
                await asyncio.sleep(DATA_EVERY_S)

    def _batch(self, step: int) -> np.ndarray:
        # Called by the one compute in flight (in its worker thread) and nowhere else, so
        # the sampler is never used from two threads at once; the deque is thread-safe.
        while self.pending_tokens:
            self.sampler.extend(self.pending_tokens.popleft())
        return self.sampler.sample(step + 1)

    # ------------------------------------------------------------------ sending
    def _peer_connected(self, peer: str) -> None:
        if peer not in self.connected:
            self.connected.append(peer)
        box = self.outboxes.setdefault(peer, asyncio.Queue())
        if peer not in self.senders:
            # The Hello goes out first on a new link, ahead of anything held for it.
            held = [box.get_nowait() for _ in range(box.qsize())]
            for _ in held:
                box.task_done()
            box.put_nowait(wire.Hello(self.mesh.self_id, self.version))
            for m in held:
                box.put_nowait(m)
            self.senders[peer] = asyncio.create_task(self._sender(peer))

    def _peer_gone(self, peer: str) -> None:
        self.hello_from.discard(peer)  # a new link starts with a new Hello
        if peer in self.connected:
            self.connected.remove(peer)
        self.outboxes.pop(peer, None)
        task = self.senders.pop(peer, None)
        if task is not None:
            task.cancel()

    async def _sender(self, peer: str) -> None:
        box = self.outboxes[peer]
        while True:
            msg = await box.get()
            try:
                await self.mesh.send(peer, msg)
            except Exception as exc:  # a dead channel: the heartbeat will report it
                _log(f"send to {peer} failed: {type(exc).__name__}: {exc}")
            finally:
                box.task_done()

    async def _drain(self, timeout: float = DRAIN_S) -> None:
        """Let queued messages (a Halt, the last hashes) leave before the mesh closes."""
        boxes = [b for p, b in self.outboxes.items() if p in self.senders]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(b.join() for b in boxes)), timeout)
        # The channel still holds what send() handed it; give it a moment to go out.
        await asyncio.sleep(LINGER_S)

    def _fault_drop(self, peer: str, msg: Any) -> bool:
        """Test hook: drop this peer's gradient of one step to exactly one recipient."""
        if (isinstance(msg, wire.Gradient) and not self.dropped_once
                and msg.step == self.hooks.drop_gradient
                and self.machine is not None and msg.sender == self.machine.self_id
                and peer != self.machine.leader):
            self.dropped_once = True
            _log(f"test: dropped gradient of step {msg.step} to {peer}")
            return True
        return False

    def _corrupt(self, msg: wire.Message) -> wire.Message:
        c = self.hooks.corrupt_gradient
        if c is None or not isinstance(msg, wire.Gradient) or msg.step != c[0]:
            return msg
        if self.machine is None or msg.sender != self.machine.self_id:
            return msg
        data = bytearray(msg.payload)
        if c[1] == "nan":
            data[0:4] = np.float32(np.nan).tobytes()
        else:
            del data[-4:]
        return wire.Gradient(msg.step, msg.sender, bytes(data))

    def _send(self, to: tuple[str, ...] | None, msg: wire.Message) -> None:
        msg = self._corrupt(msg)
        for p in self.connected if to is None else to:
            box = self.outboxes.get(p)
            if box is None:
                # A roster member whose channel to us is not up yet: hold a few
                # messages for it (bounded); repair covers anything beyond.
                box = self.outboxes[p] = asyncio.Queue()
            if p not in self.senders and box.qsize() >= PENDING_PER_PEER:
                box.get_nowait()
                box.task_done()
            box.put_nowait(msg)

    # ------------------------------------------------------------------ loop
    async def _loop(self) -> None:
        while self.result is None:
            await self._handle(await self.queue.get())

    async def _handle(self, item: tuple[Any, ...]) -> None:
        m = self.machine
        if m is None or self.result is not None:
            return
        now = time.monotonic()
        kind = item[0]
        if kind == "interrupt":
            _log(f"interrupted at step {m.boundary}")
            self.result = (130, "interrupted")
        elif kind == "tick":
            await self._do(m.tick(now))
        elif kind == "grad":
            _, step, contribution, secs = item
            self.compute_s[step] = secs
            self.grad_ready[step] = now
            self.trainer.stage(contribution)
            self.encoder.last_payload = b""
            actions = m.local_gradient(step, contribution.loss, contribution.vector, now)
            if self.hooks.dump_grads and self.encoder.last_payload:
                # What every member decodes from our bytes: the replay oracle's input.
                path = Path(self.hooks.dump_grads) / f"{m.self_id}-{step}.npy"
                np.save(path, self.encoder.decode(self.encoder.last_payload, m.replica.size))
            await self._do(actions)
        elif kind == "grad_error":
            _, step, exc = item
            if m.done or step != m.boundary:
                return  # stale: the step was rolled forward while this one computed
            reason = (f"gradient computation failed on {m.self_id} at step {step}: "
                      f"{type(exc).__name__}: {exc}")
            await self._do(m.halt(step, reason))
        elif kind == "mesh":
            ev = item[1]
            name = type(ev).__name__
            if name == "Received":
                msg = ev.message
                if isinstance(msg, (wire.Config, wire.Snapshot, wire.Heartbeat)):
                    return  # start handshake messages after the start: nothing to do
                await self._do(m.message(ev.peer, msg, now))
                if isinstance(msg, wire.Hello) and msg.peer_id == ev.peer:
                    self.hello_from.add(ev.peer)
                    if ev.peer in self.connected:  # no-op unless leading (or excluded)
                        await self._do(m.peer_up(ev.peer, now))
            elif name == "PeerUp":
                self._peer_connected(ev.peer)
                if ev.peer in self.hello_from:
                    await self._do(m.peer_up(ev.peer, now))
            elif name == "PeerDown":
                self._peer_gone(ev.peer)
                _log(f"peer {ev.peer} down ({getattr(ev, 'reason', '?')})")
                was_leader = m.is_leader
                await self._do(m.peer_down(ev.peer, now))
                if m.is_leader and not was_leader:
                    _log(f"leading now from step {m.boundary} (the leader was lost)")
                    # Peers still waiting for a snapshot were announced to the old leader.
                    for p in list(self.connected):
                        if p in self.hello_from:
                            await self._do(m.peer_up(p, now))
            elif name == "BadMessage":
                _log(f"refused a message from {ev.peer}: {ev.error}")

    async def _do(self, actions: list[sync.Action]) -> None:
        for a in actions:
            if isinstance(a, sync.Send):
                self._send(a.to, a.message)
            elif isinstance(a, sync.Compute):
                self.step_t0.setdefault(a.step, time.monotonic())
                self.tasks.append(asyncio.create_task(self._compute(a.step)))
            elif isinstance(a, sync.Commit):
                await self._on_commit(a)
            elif isinstance(a, sync.SendSnapshot):
                self._send_snapshot(a.peer, a.step)
            elif isinstance(a, sync.Excluded):
                _log(f"excluded {a.peer}: {a.reason}")
            elif isinstance(a, sync.Finish):
                self.result = (0, "done")
            elif isinstance(a, sync.Stopped):
                _log(f"halted at step {a.step}: {a.reason}")
                self.result = (1, a.reason)
        self.tasks = [t for t in self.tasks if not t.done()]

    async def _compute(self, step: int) -> None:
        if self.hooks.step_delay:
            await asyncio.sleep(self.hooks.step_delay)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            contribute = self.trainer.contribute
            if self.hooks.gradient_raises == step:
                contribute = _raising_contribution
            contribution = await loop.run_in_executor(None, contribute, step, self._batch)
        except Exception as exc:
            # Any failure here (a kernel refusing a NaN activation, a bug) must halt the
            # group: a peer that silently never sends its gradient stalls everyone.
            await self.queue.put(("grad_error", step, exc))
            return
        await self.queue.put(("grad", step, contribution, time.perf_counter() - t0))

    def _send_snapshot(self, peer: str, step: int) -> None:
        from daisyweb.checkpoints.checkpoint import checkpoint_to_bytes

        if self.trainer.step != step:  # cannot happen: the machine asks at its boundary
            _log(f"not sending a snapshot of step {step} from step {self.trainer.step}")
            return
        payload = checkpoint_to_bytes(self.state.checkpoint(self.tokinfo))
        announced = self.state.weight_hash()
        if self.hooks.corrupt_snapshot == "byte":
            # Test hook: one flipped byte, which the follower must catch before using it.
            data = bytearray(payload)
            data[len(data) // 2] ^= 0x01
            payload = bytes(data)
        elif self.hooks.corrupt_snapshot == "hash":
            announced = ("0" if announced[0] != "0" else "1") + announced[1:]
        self._send((peer,), self.state.run.to_wire())
        self._send((peer,), wire.Snapshot(step, announced, payload))
        _log(f"sent snapshot of step {step} ({len(payload):,} bytes) to {peer}")

    async def _on_commit(self, c: sync.Commit) -> None:
        from daisyweb.checkpoints.checkpoint import CheckpointError, save_checkpoint

        now = time.monotonic()
        run = self.state.run
        # A commit is one step in lockstep and one round of local steps otherwise;
        # progress, metrics and saves count optimizer steps either way.
        done = self.trainer.inner_steps
        inner = self.trainer.steps_in(c.step)
        tokens = run.batch * run.model.seq * len(c.roster) * inner
        t0 = self.step_t0.pop(c.step, now)
        ready = self.grad_ready.pop(c.step, now)
        compute_s = self.compute_s.pop(c.step, 0.0)
        comm_s = max(0.0, now - ready)
        wall_s = max(0.0, now - t0)
        comm_share = comm_s / wall_s if wall_s > 0 else 0.0
        loss = c.loss if c.loss is not None else math.nan
        note = f"{_mode(run)}  comm {comm_share:.0%}"
        if run.sync_every > 1:
            note = f"round {c.step + 1}/{self.machine.total_steps}  " + note
        tokens_per_s = self.progress.update(done, loss, tokens, note=note)
        record = {
            "step": done, "loss": loss, "weight_hash": c.weight_hash,
            "probe_hash": c.probe_hash, "roster": list(c.roster),
            "tokens_per_s": tokens_per_s, "comm_s": comm_s,
            "compute_s": compute_s, "wall_s": wall_s, "comm_share": comm_share,
            "mode": _mode(run), "sync_every": run.sync_every, "codec": run.codec,
            "round": c.step + 1, "bytes_sent": self.encoder.bytes_sent,
        }
        if c.rollback:
            record["rollback"] = True
        self.metrics.write(record)
        every = self.opts.save_every
        if self.opts.save and every and done // every > self.last_saved // every:
            try:
                save_checkpoint(self.opts.save, self.state.checkpoint(self.tokinfo))
                self.last_saved = done
            except CheckpointError as exc:
                # The write is atomic (the old file stays) and the replica is fine, so
                # training goes on; the next save (or the final one) tries again.
                _log(f"could not save the checkpoint of step {done} "
                     f"(training goes on): {exc}")
        self.last_loss = float(loss) if math.isfinite(loss) else 0.0
        self.last_peers = len(c.roster)
        # Kept for the final report, so the dashboard still shows them after the run.
        self.last_extra = {"tokens_per_s": float(tokens_per_s), "probe": c.probe_hash[:16]}
        with contextlib.suppress(Exception):
            await self.mesh.report_status(
                step=done, loss=self.last_loss,
                hash=c.weight_hash[:16], peers=len(c.roster),
                tokens_per_s=float(tokens_per_s), probe=c.probe_hash[:16], state="training")

    async def _finish(self) -> int:
        from daisyweb.checkpoints.checkpoint import CheckpointError, save_checkpoint
        from daisyweb.training.train import kernel_line, kernel_report

        assert self.result is not None
        code, reason = self.result
        # The replica is always a committed boundary (a refused step touches nothing).
        saved = None
        save_error = None
        if self.opts.save and self.state is not None:
            try:
                save_checkpoint(self.opts.save, self.state.checkpoint(self.tokinfo))
                saved = self.opts.save
            except CheckpointError as exc:
                save_error = str(exc)
        end: dict[str, Any] = {"end": reason, "step": self.state.step,
                               # What the group shares (in rounds: not the local moments).
                               "weight_hash": self._shared_hash()}
        if save_error is not None:
            end["save_error"] = save_error
        kernels: dict[str, Any] | None = None
        with contextlib.suppress(Exception):  # the report must never hide the run's end
            kernels = end["kernels"] = kernel_report()
        self.metrics.write(end)
        with contextlib.suppress(Exception):
            await self.mesh.report_status(
                step=self.state.step, loss=self.last_loss, hash=end["weight_hash"][:16],
                peers=self.last_peers, state="done" if code == 0 else "halted",
                **self.last_extra)
        if code == 0:
            _log(f"done at step {self.state.step}, weight hash {end['weight_hash'][:16]}"
                 + (f", saved {saved}" if saved else ""))
        elif saved:
            _log(f"checkpoint of step {self.state.step} saved to {saved}")
        if kernels is not None:
            _log(kernel_line(kernels))
        if save_error is not None:
            # A run whose final checkpoint is lost did not end well, even if it trained.
            _log(f"could not save the final checkpoint of step {self.state.step}: {save_error}")
            code = code or 1
        return code
