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

__all__ = ["StepRecord", "hashes_at", "train_local"]


@dataclass(frozen=True)
class StepRecord:
    """One step's metrics; ``weight_hash`` only on the steps that hash (:func:`hashes_at`)."""

    step: int
    loss: float
    weight_hash: str | None
    tokens_per_s: float
    compute_s: float

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "loss": self.loss}
        if self.weight_hash is not None:
            out["weight_hash"] = self.weight_hash
        out.update(tokens_per_s=self.tokens_per_s, compute_s=self.compute_s)
        return out


def hashes_at(step: int, run_steps: int, sync_every: int, saving: bool) -> bool:
    """Whether step ``step`` of a lone run records its weight hash: where a group with the
    same run config proves its replicas equal (every step in lockstep, every round's
    boundary in rounds), the last step and a saved one. The hash reads the weights and
    both moment vectors, 12P bytes (11.8 ms at the demo default against a 46 ms step):
    at every step it would take a fifth of a lone peer's wall time, and one peer alone has
    nobody to prove anything to in between."""
    return saving or step == run_steps or step % sync_every == 0


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
    group's step with one member: gradient, roster-order average, DaisyAdam; the weight
    hash where a group of this run would publish one (:func:`hashes_at`) and at the end.

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
            # Shared, not copied: written out before the loop steps the arrays again.
            save_checkpoint(save, state.checkpoint(tokenizer, copy=False))  # type: ignore[arg-type]
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
            tokens = int(batch.shape[0]) * run.task_impl.ROW_TOKENS  # GPT: seq a row
            tokens_per_s = progress.update(step, loss, tokens) if progress else (
                tokens / compute_s if compute_s > 0 else 0.0)
            saving = bool(save and save_every and step % save_every == 0)
            digest = (state.weight_hash() if hashes_at(step, run.steps, run.sync_every, saving)
                      else None)
            record = StepRecord(step, loss, digest, tokens_per_s, compute_s)
            metrics.write(record.to_dict())
            if on_step is not None:
                on_step(record)
            if saving:
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
