"""A task that is not a language model: a student network learns a fixed random teacher.

``--task daisyweb.tasks.teacher:Teacher``. The teacher is a two-layer tanh network drawn
from its own seed (the ``teacher`` setting: the problem, apart from the run's seed, which
draws the student's initial weights and the examples); each example is a standard normal
input and the teacher's output plus a little noise; the student has the teacher's inputs
and outputs with ``hidden`` units and learns by mean squared error. Small enough for the
tests (about 700 parameters at the defaults), and it shows what a task owes daisyweb:
parameters from a seed, batches, a loss with its gradient, a held-out loss.
"""

from __future__ import annotations

import hashlib

import numpy as np

from daisyweb.tasks.base import FieldSpec, Task

__all__ = ["Teacher"]

_HELDOUT_ROWS = 512
_TEACHER_KEY = 0x7EAC  # the teacher's weights, apart from the student's initial ones
_HELDOUT_KEY = 0x4E1D  # the held-out examples, apart from every member's


def _member_key(member: str) -> int:
    return int.from_bytes(hashlib.blake2b(member.encode(), digest_size=8).digest(), "little")


class Teacher(Task):
    """Regression onto a random two-layer tanh teacher (see the module docstring)."""

    FIELDS = {
        "inputs": FieldSpec(int, 1, 4096, 16),
        "hidden": FieldSpec(int, 1, 4096, 32),
        "outputs": FieldSpec(int, 1, 1024, 4),
        "noise": FieldSpec(float, 0.0, 10.0, 0.01),
        "teacher": FieldSpec(int, 0, 2**31 - 1, 0),
        "teacher_hidden": FieldSpec(int, 1, 4096, 8),
    }

    def __init__(self, config: dict, quantized: bool = True) -> None:
        super().__init__(config, quantized)  # float32 either way: no int8 forward here
        c = self.config
        self.n_in, self.n_hidden, self.n_out = int(c["inputs"]), int(c["hidden"]), \
            int(c["outputs"])
        self.shapes = [(self.n_in, self.n_hidden), (self.n_hidden,),
                       (self.n_hidden, self.n_out), (self.n_out,)]
        self._size = sum(int(np.prod(s)) for s in self.shapes)
        self.teacher_shapes = [(self.n_in, int(c["teacher_hidden"])),
                               (int(c["teacher_hidden"]),),
                               (int(c["teacher_hidden"]), self.n_out), (self.n_out,)]
        self.teacher = self._draw([int(c["teacher"]), _TEACHER_KEY], self.teacher_shapes)
        self._heldout: np.ndarray | None = None

    @property
    def size(self) -> int:
        return self._size

    def _views(self, flat: np.ndarray, shapes: list | None = None) -> list[np.ndarray]:
        out, off = [], 0
        for shape in shapes or self.shapes:
            n = int(np.prod(shape))
            out.append(flat[off:off + n].reshape(shape))
            off += n
        return out

    @staticmethod
    def _draw(key: list[int], shapes: list) -> np.ndarray:
        """Weights with a 1/sqrt(fan-in) scale, biases zero: PCG64 and a float32
        multiply, the same bits on every machine."""
        rng = np.random.default_rng(key)
        parts = []
        for shape in shapes:
            if len(shape) == 2:
                scale = np.float32(1.0 / np.sqrt(shape[0]))
                parts.append(rng.standard_normal(shape).astype(np.float32).ravel() * scale)
            else:
                parts.append(np.zeros(shape, dtype=np.float32))
        return np.concatenate(parts).astype(np.float32)

    def init_params(self, seed: int) -> np.ndarray:
        return self._draw([seed], self.shapes)

    def _examples(self, key: list[int], rows: int) -> np.ndarray:
        """``rows`` examples ``[rows, inputs + outputs]``: an input, the teacher's output
        and noise."""
        rng = np.random.default_rng(key)
        x = rng.standard_normal((rows, self.n_in)).astype(np.float32)
        y = self._forward(self.teacher, x, self.teacher_shapes)[0]
        y += np.float32(self.config["noise"]) * rng.standard_normal(y.shape).astype(np.float32)
        return np.concatenate([x, y], axis=1)

    def batch(self, seed: int, step: int, member: str, rows: int) -> np.ndarray:
        return self._examples([seed, step, _member_key(member)], rows)

    def _forward(self, flat: np.ndarray, x: np.ndarray,
                 shapes: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        w1, b1, w2, b2 = self._views(flat, shapes)
        h = np.tanh(x @ w1 + b1)
        return h @ w2 + b2, h

    def loss_and_grad(self, params: np.ndarray, batch: np.ndarray,
                      out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        x, y = batch[:, :self.n_in], batch[:, self.n_in:]
        pred, h = self._forward(params, x)
        err = pred - y
        loss = float(np.mean(err * err))
        grad = np.empty(self._size, dtype=np.float32) if out is None else out
        g1, gb1, g2, gb2 = self._views(grad)
        d_pred = err * np.float32(2.0 / err.size)
        g2[...] = h.T @ d_pred
        gb2[...] = d_pred.sum(axis=0)
        _, _, w2, _ = self._views(params)
        d_h = (d_pred @ w2.T) * (np.float32(1.0) - h * h)
        g1[...] = x.T @ d_h
        gb1[...] = d_h.sum(axis=0)
        return loss, grad

    def heldout(self, params: np.ndarray) -> float:
        """Over examples of the teacher's own (no run's seed draws them)."""
        if self._heldout is None:
            self._heldout = self._examples([int(self.config["teacher"]), _HELDOUT_KEY],
                                           _HELDOUT_ROWS)
        return self.loss_and_grad(params, self._heldout)[0]
