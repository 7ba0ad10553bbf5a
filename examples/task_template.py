"""A task template: copy this file, rename the class, fill in the five methods.

Run it in a group (docs/tasks.md):

    PYTHONPATH=examples daisyweb-peer --server URL --room CODE --start \
        --task task_template:Polynomial --task-set degree=3
    PYTHONPATH=examples daisyweb-peer --server URL --room CODE      # on every other machine

Every member must import the same file: the run config carries a hash of it, and a
member whose copy differs refuses the run.

This one fits a polynomial of ``degree`` to noisy samples of sin(pi x) on [-1, 1]:
``degree + 1`` parameters, the least a task can have.
"""

from __future__ import annotations

import hashlib

import numpy as np

from daisyweb.tasks import FieldSpec, Task


class Polynomial(Task):
    # The task's own settings: type, bounds, default. `--task-set degree=5` on the leader;
    # every member checks them with these bounds.
    FIELDS = {
        "degree": FieldSpec(int, 0, 32, 3),
        "noise": FieldSpec(float, 0.0, 1.0, 0.05),
    }

    @property
    def size(self) -> int:
        """How many float32 parameters the group trains."""
        return int(self.config["degree"]) + 1

    def init_params(self, seed: int) -> np.ndarray:
        """The same bits for the same seed on every machine: the group hashes them. Use
        numpy's Generator (PCG64: the same stream everywhere) and elementwise float32."""
        rng = np.random.default_rng([seed])
        return (rng.standard_normal(self.size) * 0.1).astype(np.float32)

    def batch(self, seed: int, step: int, member: str, rows: int) -> np.ndarray:
        """The ``rows`` examples ``member`` trains on at inner step ``step``. Any array
        your ``loss_and_grad`` understands; here one row is (x, y)."""
        key = int.from_bytes(hashlib.blake2b(member.encode(), digest_size=8).digest(), "little")
        rng = np.random.default_rng([seed, step, key])
        x = rng.uniform(-1.0, 1.0, rows)
        y = np.sin(np.pi * x) + self.config["noise"] * rng.standard_normal(rows)
        return np.stack([x, y], axis=1).astype(np.float32)

    def _features(self, x: np.ndarray) -> np.ndarray:
        return np.stack([x ** k for k in range(self.size)], axis=1).astype(np.float32)

    def loss_and_grad(self, params: np.ndarray, batch: np.ndarray,
                      out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        """The batch's mean loss and its float32 gradient, into ``out`` when given (every
        element written). Only the exchanged bytes must agree across machines, so this
        may use any BLAS."""
        features = self._features(batch[:, 0])
        err = features @ params - batch[:, 1]
        grad = np.empty(self.size, dtype=np.float32) if out is None else out
        grad[:] = features.T @ (err * np.float32(2.0 / len(err)))
        return float(np.mean(err * err)), grad

    def heldout(self, params: np.ndarray) -> float:
        """The loss on examples no member trains on (``--eval-every``)."""
        x = np.linspace(-1.0, 1.0, 201)
        err = self._features(x) @ params - np.sin(np.pi * x).astype(np.float32)
        return float(np.mean(err * err))
