"""The local training loop: one peer alone, a roster of one.

The step is split the way the group protocol needs it: compute a local gradient
(``TrainState.gradient``), average the roster's gradients
(``daisyweb.protocol.averaging``), then apply the average (``TrainState.apply``). The
group driver (``daisyweb.peer``) runs the same three pieces through the step machine.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from daisyweb.checkpoints.checkpoint import CheckpointError, TokenizerInfo, save_checkpoint
from daisyweb.protocol.averaging import average_in_roster_order, check_gradient
from daisyweb.training.metrics import MetricsWriter, Progress, kernel_report
from daisyweb.training.state import TrainState

__all__ = ["StepRecord", "train_local"]


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
