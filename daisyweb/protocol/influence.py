"""Bounded influence: no member moves the model more than a fair share.

Every member's contribution is checked for what it does, not only for being finite:
its Euclidean norm is compared with the round's median norm and, above
``CLIP_FACTOR`` times it, the contribution is scaled down to that bound before the
roster-order average. A member that lies about its delta (a constant shift, a huge
scale) then moves the mean no further than an honest member would at that bound.

Every member must compute the same factors from the same decoded values, bit for bit,
so the norm is a reduction whose order is fixed here, never the CPU's: each value is
squared in binary64 (exact for a float32), the squares are summed in chunks of
``CHUNK`` values at fixed positions of the vector (a chunk's last part is zero-padded),
each chunk by a fixed pairwise tree of elementwise additions (element ``i`` with
``i + half``), and the chunk sums by the same tree. ``math.sqrt`` is correctly rounded,
the median is a sorted list's element and the factor is one binary64 division rounded
once to float32: the same numbers on every IEEE machine, whatever the parts' layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["CHUNK", "CLIP_FACTOR", "clip_factors", "squared_norm", "tree_sum"]

CHUNK = 1 << 16
CLIP_FACTOR = 2.0
"""A contribution's norm may be at most this many times the round's (lower) median
norm: honest round deltas of one round are alike in size, so an honest group is never
clipped (TEST_RESULTS.md, bench:influence: 0 of 57 honest contributions)."""


def tree_sum(values: np.ndarray) -> float:
    """The sum of float64 ``values`` by a fixed pairwise tree (zero-padded to a power of
    two): every addition is elementwise, so its order is the same on every machine."""
    v = np.asarray(values, dtype=np.float64)
    n = 1 << max(0, (len(v) - 1).bit_length())
    if n != len(v):
        v = np.concatenate([v, np.zeros(n - len(v))])
    while len(v) > 1:
        half = len(v) // 2
        v = v[:half] + v[half:]
    return float(v[0]) if len(v) else 0.0


def squared_norm(parts: Iterable[tuple[slice, np.ndarray]]) -> float:
    """Sum of squares of a float32 vector given part by part, in order (a codec's
    ``decode_parts``), the same for any layout of its parts (module docstring)."""
    chunk = np.zeros(CHUNK, np.float64)
    sums: list[float] = []
    filled = 0  # values of the current chunk written so far
    for where, values in parts:
        squares = np.square(values, dtype=np.float64)
        at = 0
        while at < len(squares):
            take = min(CHUNK - filled, len(squares) - at)
            chunk[filled:filled + take] = squares[at:at + take]
            filled += take
            at += take
            if filled == CHUNK:
                sums.append(tree_sum(chunk))
                chunk[:] = 0.0
                filled = 0
        del where
    if filled:
        sums.append(tree_sum(chunk))
    return tree_sum(np.array(sums)) if sums else 0.0


def clip_factors(norms2: Sequence[float],
                 factor: float = CLIP_FACTOR) -> tuple[np.float32 | None, ...]:
    """Per contribution (in roster order): the float32 factor that scales it down to
    ``factor`` times the lower median norm, or None where it is within the bound."""
    if not norms2:
        return ()
    norms = [math.sqrt(x) if x > 0.0 else 0.0 for x in norms2]
    median = sorted(norms)[(len(norms) - 1) // 2]
    bound = factor * median
    return tuple(np.float32(bound / x) if x > bound else None for x in norms)
