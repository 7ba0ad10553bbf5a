"""Running audit of live GEMM results: sampled cells re-computed by the mirror.

How it is hooked in: the dispatcher behind ``gemm_int8`` and ``int8_matmul`` (so every
linear layer of the model) audits *every* GEMM that ran on a non-mirror backend, with a
small budget (``DEFAULT_BUDGET`` cells), while the audit is enabled (the default). A
mismatch demotes the backend (logged, visible in ``active_backend()``), is counted in
``stats()``, and the GEMM is recomputed on the next backend, so the caller still gets the
exact result. ``configure(enabled=False)`` turns it off (the benchmark measures its cost).

Sampling is stratified: the four corners first, then cells in the last row and the last
column, then uniform random cells. Off-by-one and tail-tile bugs live at those edges; a
uniform sample of 8 cells from a 4096-wide output hits the last column 0.2% of the time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .backends import mirror_cells

Array = np.ndarray
DEFAULT_BUDGET = 8


@dataclass
class AuditConfig:
    enabled: bool = True
    budget: int = DEFAULT_BUDGET
    stratified: bool = True


config = AuditConfig()
_rng = np.random.default_rng(0xA0D17)
_stats = {"gemms": 0, "cells": 0, "mismatches": 0}
_last: list[str] = []


def configure(enabled: bool | None = None, budget: int | None = None,
              stratified: bool | None = None, seed: int | None = None) -> AuditConfig:
    """Change the live audit's settings; returns the current configuration."""
    global _rng
    if budget is not None:
        if budget < 1:
            raise ValueError(f"audit budget must be >= 1, got {budget}")
        config.budget = budget
    if enabled is not None:
        config.enabled = enabled
    if stratified is not None:
        config.stratified = stratified
    if seed is not None:
        _rng = np.random.default_rng(seed)
        _plans.clear()  # discard samples drawn from the old generator
    return config


def stats() -> dict[str, object]:
    """Audited GEMMs, cells checked, mismatching cells, and the last mismatch seen."""
    return {**_stats, "last_mismatch": _last[-1] if _last else None}


_BLOCK = 64  # samples drawn per refill of a shape's plan
_lock = threading.Lock()


class _Plan:
    """Per (m, n, budget, stratified): which slots are pinned to which row/column, and a
    block of pre-drawn samples. Live shapes repeat every step, so a GEMM's sample is two
    slices of a block refilled (one vectorised draw) every _BLOCK GEMMs."""

    def __init__(self, m: int, n: int, budget: int, stratified: bool) -> None:
        self.mult = np.array([m] * budget + [n] * budget, np.float64)
        pins: dict[int, int] = {}
        if stratified:
            c = min(budget, 4)
            corners = ((0, 0), (m - 1, n - 1), (0, n - 1), (m - 1, 0))[:c]
            for i, (r, q) in enumerate(corners):
                pins[i], pins[budget + i] = r, q
            # then, on half the rest, alternately a random cell of the last row / last
            # column; the remainder is uniform
            for j, i in enumerate(range(c, c + max(1, (budget - c) // 2)) if budget > c else ()):
                if j % 2 == 0:
                    pins[i] = m - 1
                else:
                    pins[budget + i] = n - 1
        self.idx = np.array(sorted(pins), np.intp)
        self.vals = np.array([pins[i] for i in sorted(pins)], np.intp)
        self.budget = budget
        self.block = np.empty((0, 2 * budget), np.intp)
        self.pos = 0

    def draw(self, rng: np.random.Generator, count: int) -> Array:
        """`count` samples, each a row of 2*budget indices (rows then columns)."""
        rc = (rng.random((count, self.mult.size)) * self.mult).astype(np.intp)
        rc[:, self.idx] = self.vals
        return rc

    def next(self) -> Array:
        with _lock:  # GEMMs may run on several threads
            if self.pos >= len(self.block):
                self.block = self.draw(_rng, _BLOCK)
                self.pos = 0
            self.pos += 1
            return self.block[self.pos - 1]


_plans: dict[tuple[int, int, int, bool], _Plan] = {}


def _plan(m: int, n: int, budget: int, stratified: bool) -> _Plan:
    key = (m, n, budget, stratified)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(m, n, budget, stratified)
        if len(_plans) > 256:  # bounded: forget the oldest shape
            del _plans[next(iter(_plans))]
    return plan


def sample_cells(m: int, n: int, budget: int, rng: np.random.Generator | None = None,
                 stratified: bool = True) -> tuple[Array, Array]:
    """Row and column indices of `budget` cells of an m x n output (stratified or uniform).

    Without `rng`, from the live audit's pre-drawn stream; with it, drawn from `rng`.
    """
    plan = _plan(m, n, budget, stratified)
    rc = plan.next() if rng is None else plan.draw(rng, 1)[0]
    return rc[:budget], rc[budget:]


def check(a: Array, b: Array, acc: Array, budget: int | None = None,
          stratified: bool | None = None, rng: np.random.Generator | None = None) -> str | None:
    """Audit `budget` cells of acc = a @ b; None if all match the mirror, else a description.

    `a`, `b` are int8 or integer-valued float operands; `acc` any integer-valued array.
    """
    budget = config.budget if budget is None else budget
    stratified = config.stratified if stratified is None else stratified
    m, n = acc.shape
    rows, cols = sample_cells(m, n, budget, rng, stratified)
    want = mirror_cells(a, b, rows, cols)
    got = acc[rows, cols]
    _stats["gemms"] += 1
    _stats["cells"] += budget
    if (got == want).all():  # the common path: ~10 us of numpy calls, any shape
        return None
    bad = got != want
    nbad = int(np.count_nonzero(bad))
    _stats["mismatches"] += nbad
    i = int(np.argmax(bad))
    msg = (f"{nbad}/{budget} audited cells wrong in a {m}x{a.shape[1]}x{n} GEMM, first "
           f"({rows[i]},{cols[i]}): got {got[i]}, mirror {want[i]}")
    _last.append(msg)
    del _last[:-1]
    return msg
