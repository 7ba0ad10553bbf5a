"""The built-in GPT as a task: the task a run trains when it names none.

Its settings are the run's model flags (``--width --layers --heads --seq``, the
tokenizer's vocabulary), carried in the run config as they always were; its batches are
windows of the built-in corpus (a peer's own ``DataFeed`` adds the server's text slices);
its held-out loss is over the corpus's last 5% (``training.evaluate``), through the run's
forward (int8 kernels or float32, ``--compute``).
"""

from __future__ import annotations

import numpy as np

from daisyweb.data import BatchSampler, builtin_tokens
from daisyweb.model import ModelConfig, init_params, loss_and_grad, param_count
from daisyweb.tasks.base import Task
from daisyweb.training.evaluate import heldout_batches, heldout_loss

__all__ = ["GPT"]


class GPT(Task):
    """Next-token prediction with daisyweb's GPT (``daisyweb.model``)."""

    ROW_TOKENS = 0  # set per model: a row is ``seq`` predicted tokens

    def __init__(self, model: ModelConfig, quantized: bool = True) -> None:
        super().__init__({}, quantized)
        self.model = model
        self.ROW_TOKENS = model.seq  # type: ignore[misc]
        self._size = param_count(model)
        self._heldout: list[np.ndarray] | None = None
        self._samplers: dict[tuple[int, str], BatchSampler] = {}

    @property
    def size(self) -> int:
        return self._size

    def init_params(self, seed: int) -> np.ndarray:
        return init_params(self.model, seed)

    def batch(self, seed: int, step: int, member: str, rows: int) -> np.ndarray:
        """Windows of the built-in corpus as a peer alone draws them (``DataFeed`` draws
        the same until the server's slices arrive)."""
        sampler = self._samplers.get((seed, member))
        if sampler is None or sampler.batch != rows:
            sampler = BatchSampler(builtin_tokens(), batch=rows, seq=self.model.seq,
                                   seed=seed, peer=member)
            self._samplers[(seed, member)] = sampler
        return sampler.sample(step + 1)

    def loss_and_grad(self, params: np.ndarray, batch: np.ndarray,
                      out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        loss, grad = loss_and_grad(self.model, params, batch, quantized=self.quantized,
                                   out=out)
        return float(loss), grad

    def heldout(self, params: np.ndarray) -> float:
        if self._heldout is None:
            self._heldout = heldout_batches(self.model.seq)
        return heldout_loss(self.model, params, self._heldout, self.quantized)
