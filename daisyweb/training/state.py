"""One peer's training state: parameters plus DaisyAdam, the state every replica keeps
bit-identical, and the cross-machine kernel probe published next to its hash.

:class:`TrainState` computes a local gradient (``gradient``), applies the roster's
average (``apply``), hashes itself (``weight_hash``), backs up and restores itself for a
rolled-back step (``backup``/``restore``) and snapshots itself as a checkpoint. It is
what the step machine (``daisyweb.protocol.sync``) drives as its replica.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kernels
from daisyweb.checkpoints.checkpoint import (
    Checkpoint,
    TokenizerInfo,
    make_checkpoint,
    restore_optimizer,
)
from daisyweb.optim import DaisyAdam, weight_hash
from daisyweb.protocol.averaging import check_gradient
from daisyweb.training.config import RunConfig

__all__ = ["TrainState", "probe_hash"]


def probe_hash() -> str:
    """The kernel probe every peer publishes with its weight hash: the hash of a fixed
    seeded int8 GEMM through the live backend (``kernels.probe``), equal on every honest
    machine. Pass it as the step machine's ``probe``."""
    return kernels.probe_hash()


class TrainState:
    """Parameters plus optimizer: the state every replica keeps bit-identical."""

    def __init__(self, run: RunConfig, params: np.ndarray, optimizer: DaisyAdam) -> None:
        size = run.task_impl.size
        if params.dtype != np.float32 or params.shape != (size,):
            raise ValueError(f"params must be float32 of shape ({size},)")
        if optimizer.size != size:
            raise ValueError("optimizer size does not match the model")
        self.run = run
        self.params = params
        self.optimizer = optimizer

    @classmethod
    def fresh(cls, run: RunConfig) -> TrainState:
        params = run.task_impl.init_params(run.seed)
        return cls(run, params, DaisyAdam(run.adam(), params.size))

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, run: RunConfig | None = None,
                        copy: bool = True) -> TrainState:
        """The state in ``ckpt``; ``copy=False`` takes over its arrays (for a checkpoint
        that is dropped right after, such as a received snapshot)."""
        run = run or RunConfig.from_checkpoint(ckpt)
        if run.model != ckpt.model:
            raise ValueError("run config model differs from the checkpoint's model")
        optimizer = restore_optimizer(ckpt, copy=copy)
        if optimizer.config != run.adam():
            raise ValueError(
                f"checkpoint optimizer {optimizer.config} differs from the run's {run.adam()}")
        return cls(run, ckpt.params.copy() if copy else ckpt.params, optimizer)

    @property
    def step(self) -> int:
        """Number of committed steps (the optimizer's step count)."""
        return self.optimizer.step_count

    @property
    def size(self) -> int:
        return self.params.size

    def gradient(self, batch: np.ndarray) -> tuple[float, np.ndarray]:
        """Loss and float32 gradient on ``batch`` (the task's: [B, seq+1] token ids for
        the GPT); state untouched."""
        loss, grad = self.run.task_impl.loss_and_grad(self.params, batch)
        return float(loss), grad

    def apply(self, average: np.ndarray, *, owned: bool = False) -> None:
        """One DaisyAdam step with the roster's averaged gradient (validated first; read,
        never kept, so ``owned`` changes nothing)."""
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

    def checkpoint(self, tokenizer: TokenizerInfo, copy: bool = True) -> Checkpoint:
        """A checkpoint of this state; ``copy=False`` shares the arrays (see
        :func:`make_checkpoint`). Checkpoints hold the built-in GPT: a named task's run
        has none (ValueError)."""
        if self.run.task:
            raise ValueError(f"checkpoints hold the built-in GPT, not task {self.run.task}")
        return make_checkpoint(self.run.model, tokenizer, self.params, self.optimizer,
                               self.run.to_dict(), copy=copy)
