"""The training loop: one peer's state, one step, progress and metrics.

The mesh driver (``daisyweb.peer.run``) reuses these pieces; a single machine is simply a
roster of one. The step is split the way the group protocol needs it: compute a local
gradient (``TrainState.gradient``), average the roster's gradients
(``daisyweb.protocol.averaging``), then apply the average (``TrainState.apply``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from daisyweb.checkpoints.checkpoint import (
    Checkpoint,
    CheckpointError,
    TokenizerInfo,
    make_checkpoint,
    restore_optimizer,
    save_checkpoint,
)
from daisyweb.model import ModelConfig, init_params, loss_and_grad, param_count
from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash
from daisyweb.protocol import wire
from daisyweb.protocol.averaging import average_in_roster_order, check_gradient

__all__ = [
    "RunConfig",
    "TrainState",
    "MetricsWriter",
    "Progress",
    "StepRecord",
    "train_local",
    "kernel_report",
    "kernel_line",
]


@dataclass(frozen=True)
class RunConfig:
    """Everything the leader fixes for a run (what ``wire.Config`` carries)."""

    model: ModelConfig
    batch: int = 8
    steps: int = 300
    lr: float = 3e-3
    seed: int = 0
    data: str = "builtin"

    def __post_init__(self) -> None:
        # wire.Config holds the validation rules for every field; reuse them.
        try:
            self.to_wire()
        except wire.WireError as exc:
            raise ValueError(f"bad run config: {exc}") from None

    def adam(self) -> AdamConfig:
        return AdamConfig(lr=self.lr)

    def to_wire(self) -> wire.Config:
        m = self.model
        return wire.Config.from_dict({
            "width": m.width, "layers": m.layers, "heads": m.heads, "seq": m.seq,
            "vocab": m.vocab, "batch": self.batch, "steps": self.steps, "lr": self.lr,
            "seed": self.seed, "data": self.data,
        })

    @classmethod
    def from_wire(cls, msg: wire.Config) -> RunConfig:
        model = ModelConfig(vocab=msg.vocab, width=msg.width, layers=msg.layers,
                            heads=msg.heads, seq=msg.seq)
        return cls(model=model, batch=msg.batch, steps=msg.steps, lr=msg.lr,
                   seed=msg.seed, data=msg.data)

    def to_dict(self) -> dict[str, Any]:
        """Plain metadata for a checkpoint's ``run`` dict (the model goes separately)."""
        return {"batch": self.batch, "steps": self.steps, "lr": self.lr,
                "seed": self.seed, "data": self.data}

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> RunConfig:
        run = ckpt.run
        try:
            return cls(model=ckpt.model, batch=int(run["batch"]), steps=int(run["steps"]),
                       lr=float(run["lr"]), seed=int(run["seed"]), data=str(run["data"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint run metadata is incomplete: {exc}") from None


class TrainState:
    """Parameters plus optimizer: the state every replica keeps bit-identical."""

    def __init__(self, run: RunConfig, params: np.ndarray, optimizer: DaisyAdam) -> None:
        size = param_count(run.model)
        if params.dtype != np.float32 or params.shape != (size,):
            raise ValueError(f"params must be float32 of shape ({size},)")
        if optimizer.size != size:
            raise ValueError("optimizer size does not match the model")
        self.run = run
        self.params = params
        self.optimizer = optimizer

    @classmethod
    def fresh(cls, run: RunConfig) -> TrainState:
        params = init_params(run.model, run.seed)
        return cls(run, params, DaisyAdam(run.adam(), params.size))

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, run: RunConfig | None = None) -> TrainState:
        run = run or RunConfig.from_checkpoint(ckpt)
        if run.model != ckpt.model:
            raise ValueError("run config model differs from the checkpoint's model")
        optimizer = restore_optimizer(ckpt)
        if optimizer.config != run.adam():
            raise ValueError(
                f"checkpoint optimizer {optimizer.config} differs from the run's {run.adam()}")
        return cls(run, ckpt.params.copy(), optimizer)

    @property
    def step(self) -> int:
        """Number of committed steps (the optimizer's step count)."""
        return self.optimizer.step_count

    @property
    def size(self) -> int:
        return self.params.size

    def gradient(self, batch: np.ndarray) -> tuple[float, np.ndarray]:
        """Loss and float32 gradient on ``batch`` ([B, seq+1] token ids); state untouched."""
        loss, grad = loss_and_grad(self.run.model, self.params, batch)
        return float(loss), grad

    def apply(self, average: np.ndarray) -> None:
        """One DaisyAdam step with the roster's averaged gradient (validated first)."""
        self.optimizer.step(self.params, check_gradient(average, self.size, "average"))

    def weight_hash(self) -> str:
        return weight_hash(self.params, self.optimizer)

    def backup(self) -> tuple[np.ndarray, dict[str, Any]]:
        """A copy of params and optimizer state to :meth:`restore` after a rollback."""
        return self.params.copy(), self.optimizer.state_dict()

    def restore(self, token: tuple[np.ndarray, dict[str, Any]]) -> None:
        params, opt = token
        # New arrays, not in place: a gradient thread may still read the old ones.
        self.params = params.copy()
        self.optimizer.load_state_dict(opt)

    def checkpoint(self, tokenizer: TokenizerInfo) -> Checkpoint:
        return make_checkpoint(self.run.model, tokenizer, self.params, self.optimizer,
                               self.run.to_dict())


class MetricsWriter:
    """One JSON object per line, flushed each write so a crash loses at most one line."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self._file: IO[str] | None = open(path, "a", encoding="utf-8") if path else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds + 0.5)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


@dataclass
class Progress:
    """Prints ``step k/N  loss  tokens/s  ETA`` at most every ``every`` seconds."""

    total_steps: int
    stream: IO[str] | None = field(default_factory=lambda: sys.stderr)
    every: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _start: float = field(init=False, default=0.0)
    _start_step: int | None = field(init=False, default=None)
    _last_print: float = field(init=False, default=-math.inf)
    _tokens: int = field(init=False, default=0)

    def start(self, step: int) -> None:
        """Mark the clock before the first step (``step`` = steps already committed)."""
        self._start, self._start_step, self._tokens = self.clock(), step, 0

    def line(self, step: int, loss: float, tokens_per_s: float) -> str:
        now = self.clock()
        done = step - (self._start_step or 0)
        rate = done / (now - self._start) if now > self._start and done > 0 else 0.0
        eta = (self.total_steps - step) / rate if rate > 0 else math.inf
        return (f"step {step}/{self.total_steps}  loss {loss:.4f}  "
                f"{tokens_per_s:,.0f} tok/s  eta {_duration(eta)}")

    def update(self, step: int, loss: float, tokens: int) -> float:
        """Record a committed step of ``tokens`` tokens; return tokens/s so far."""
        now = self.clock()
        if self._start_step is None:
            self._start, self._start_step = now, step - 1
        self._tokens += tokens
        elapsed = now - self._start
        tokens_per_s = self._tokens / elapsed if elapsed > 0 else 0.0
        final = step >= self.total_steps
        if self.stream is not None and (final or now - self._last_print >= self.every):
            self._last_print = now
            print(self.line(step, loss, tokens_per_s), file=self.stream, flush=True)
        return tokens_per_s


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    weight_hash: str
    tokens_per_s: float
    compute_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "loss": self.loss, "weight_hash": self.weight_hash,
                "tokens_per_s": self.tokens_per_s, "compute_s": self.compute_s}


def kernel_report() -> dict[str, Any]:
    """The end-of-run kernel facts (SPEC section 4, "Counts"): the backend GEMMs run on
    now, every demotion so far, and multiply-accumulates per backend since start."""
    import kernels

    return {"backend": kernels.active_backend(), "demotions": kernels.demotions(),
            "macs": kernels.counters()}


def kernel_line(report: dict[str, Any]) -> str:
    """``report`` as one line for the terminal."""
    macs = ", ".join(f"{name} {n:,}" for name, n in report["macs"].items() if n) or "none"
    demoted = "; ".join(f"{d['backend']} ({d['reason']})" for d in report["demotions"])
    return (f"kernels: backend {report['backend']}, demotions: {demoted or 'none'}, "
            f"multiply-accumulates: {macs}")


def train_local(
    state: TrainState,
    sample: Callable[[int], np.ndarray],
    *,
    tokenizer: TokenizerInfo,
    save: str | os.PathLike[str] | None = None,
    save_every: int = 0,
    metrics: MetricsWriter | None = None,
    progress: Progress | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    on_save_error: Callable[[CheckpointError, bool], None] | None = None,
) -> TrainState:
    """Train ``state`` alone (a roster of one) up to ``state.run.steps``.

    ``sample(step)`` returns the [batch, seq+1] token batch for a step. The loop is the
    group's step with one member: gradient, roster-order average, DaisyAdam, hash.

    An error in a step is raised after the last committed state is saved (``save``) and
    the end record written. A failed save raises CheckpointError, unless
    ``on_save_error(error, final)`` is given: then a periodic save failure lets training
    go on and a final one is only reported (the caller decides the exit).
    """
    run = state.run
    metrics = metrics or MetricsWriter(None)
    reason = "done"
    save_error: CheckpointError | None = None

    def save_now(final: bool) -> None:
        nonlocal save_error
        try:
            save_checkpoint(save, state.checkpoint(tokenizer))  # type: ignore[arg-type]
        except CheckpointError as exc:
            save_error = exc if final else save_error
            if on_save_error is None:
                raise
            on_save_error(exc, final)

    if progress is not None:
        progress.start(state.step)
    try:
        while state.step < run.steps:
            step = state.step + 1
            t0 = time.perf_counter()
            batch = sample(step)
            loss, grad = state.gradient(batch)
            state.apply(average_in_roster_order([check_gradient(grad, state.size)]))
            compute_s = time.perf_counter() - t0
            tokens = int(batch.shape[0] * (batch.shape[1] - 1))
            tokens_per_s = progress.update(step, loss, tokens) if progress else (
                tokens / compute_s if compute_s > 0 else 0.0)
            record = StepRecord(step, loss, state.weight_hash(), tokens_per_s, compute_s)
            metrics.write(record.to_dict())
            if on_step is not None:
                on_step(record)
            if save and save_every and step % save_every == 0:
                save_now(final=False)
    except KeyboardInterrupt:
        reason = "interrupted"
        raise
    except Exception as exc:
        reason = f"error: {exc}"
        raise
    finally:
        # The saved state is always a committed step: apply() changes nothing on error.
        # The end record is written even if this save fails.
        try:
            if save:
                save_now(final=True)
        finally:
            end: dict[str, Any] = {"end": reason, "step": state.step,
                                   "weight_hash": state.weight_hash()}
            if save_error is not None:
                end["save_error"] = str(save_error)
            with contextlib.suppress(Exception):  # the report must not hide the real end
                end["kernels"] = kernel_report()
            metrics.write(end)
    return state
