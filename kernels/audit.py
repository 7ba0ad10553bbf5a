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
    return config


def stats() -> dict[str, object]:
    """Audited GEMMs, cells checked, mismatching cells, and the last mismatch seen."""
    return {**_stats, "last_mismatch": _last[-1] if _last else None}


_plans: dict[int, tuple[Array, Array, Array, Array]] = {}


def _plan(budget: int) -> tuple[Array, Array, Array, Array]:
    """Which sample slots are pinned to row 0 / row m-1 / column 0 / column n-1."""
    if budget not in _plans:
        c = min(budget, 4)
        # corners (0,0), (m-1,n-1), (0,n-1), (m-1,0); then, on half the rest, alternately
        # a random cell of the last row and of the last column; the remainder is uniform
        edge = range(c, c + max(1, (budget - c) // 2)) if budget > c else range(0)
        row0 = [i for i in (0, 2) if i < c]
        row_last = [i for i in (1, 3) if i < c] + [i for i in edge if (i - c) % 2 == 0]
        col0 = [i for i in (0, 3) if i < c]
        col_last = [i for i in (1, 2) if i < c] + [i for i in edge if (i - c) % 2 == 1]
        _plans[budget] = tuple(np.array(v, np.intp) for v in (row0, row_last, col0, col_last))
    return _plans[budget]


def sample_cells(m: int, n: int, budget: int, rng: np.random.Generator,
                 stratified: bool = True) -> tuple[Array, Array]:
    """Row and column indices of `budget` cells of an m x n output (stratified or uniform)."""
    u = rng.random(2 * budget)
    u[:budget] *= m
    u[budget:] *= n
    rc = u.astype(np.intp)
    rows, cols = rc[:budget], rc[budget:]
    if stratified:
        row0, row_last, col0, col_last = _plan(budget)
        rows[row0] = 0
        rows[row_last] = m - 1
        cols[col0] = 0
        cols[col_last] = n - 1
    return rows, cols


def check(a: Array, b: Array, acc: Array, budget: int | None = None,
          stratified: bool | None = None, rng: np.random.Generator | None = None) -> str | None:
    """Audit `budget` cells of acc = a @ b; None if all match the mirror, else a description.

    `a`, `b` are int8 or integer-valued float operands; `acc` any integer-valued array.
    """
    budget = config.budget if budget is None else budget
    stratified = config.stratified if stratified is None else stratified
    m, n = acc.shape
    rows, cols = sample_cells(m, n, budget, _rng if rng is None else rng, stratified)
    want = mirror_cells(a, b, rows, cols)
    got = acc[rows, cols]
    _stats["gemms"] += 1
    _stats["cells"] += budget
    bad = got != want
    if not bad.any():  # the common path: ~15 us of numpy calls per GEMM, any shape
        return None
    nbad = int(np.count_nonzero(bad))
    _stats["mismatches"] += nbad
    i = int(np.argmax(bad))
    msg = (f"{nbad}/{budget} audited cells wrong in a {m}x{a.shape[1]}x{n} GEMM, first "
           f"({rows[i]},{cols[i]}): got {got[i]}, mirror {want[i]}")
    _last.append(msg)
    del _last[:-1]
    return msg
