"""Averaging contributions in roster order: the one reduction whose order replicas must
share.

Every member receives the same contribution bytes and must produce the same average bit for
bit. numpy's ``sum``/``mean`` over a stacked array may reorder additions (pairwise, SIMD
lanes), so the average is written as explicit elementwise float32 additions in roster
order, then one multiplication by ``float32(1 / n)`` (computed in binary64, rounded once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from itertools import zip_longest

import numpy as np

__all__ = ["GradientError", "check_gradient", "average_in_roster_order",
           "average_parts_in_roster_order", "weighted_average_in_roster_order"]

Parts = Iterator[tuple[slice, np.ndarray]]
"""A vector given part by part, in order: ``(where, values)`` (a codec's ``decode_parts``)."""

_F32 = np.dtype(np.float32)


class GradientError(ValueError):
    """A gradient or contribution that must not be used: wrong dtype, length, or
    non-finite values."""


def check_gradient(grad: object, size: int, who: str = "gradient") -> np.ndarray:
    """Return ``grad`` as a contiguous float32 vector of ``size`` or raise GradientError."""
    if not isinstance(grad, np.ndarray) or grad.dtype != _F32:
        raise GradientError(f"{who}: expected a float32 array")
    if grad.shape != (size,):
        raise GradientError(f"{who}: expected {size} values, got shape {grad.shape}")
    bad = int(np.count_nonzero(~np.isfinite(grad)))
    if bad:
        raise GradientError(f"{who}: {bad} NaN/Inf values")
    return np.ascontiguousarray(grad)


def average_in_roster_order(vectors: Iterable[np.ndarray], *,
                            owned: bool = False) -> np.ndarray:
    """``f32(1/n) * (((g0 + g1) + g2) + ...)``, every operation elementwise float32.

    All contributions must already be validated float32 vectors of one length. They are
    read one at a time, in order: ``vectors`` may be a generator that decodes each only
    when it is added, and each is let go once added: then only the sum and the vector
    being added are held, not also the one added before (5.3 MB at the demo default).
    With ``owned`` they are the caller's to give up (freshly decoded): the first becomes
    the sum instead of being copied (the same bits). Without it nothing passed in is
    written.
    """
    total: np.ndarray | None = None
    n = 0
    for g in vectors:
        _check_same(g, total)
        if total is None:
            total = g if owned else g.copy()
        else:
            np.add(total, g, out=total)
        del g  # not held while the next one is decoded
        n += 1
    if total is None:
        raise GradientError("cannot average an empty roster")
    if n > 1:
        np.multiply(total, np.float32(1.0 / n), out=total)
    return total


def _check_same(g: object, total: np.ndarray | None) -> None:
    if not isinstance(g, np.ndarray) or g.dtype != _F32 or (
            total is not None and g.shape != total.shape):
        raise GradientError("all gradients must be float32 arrays of the same shape")


def weighted_average_in_roster_order(vectors: Iterable[np.ndarray], shares: Sequence[int], *,
                                     owned: bool = False) -> np.ndarray:
    """The full-batch mean of contributions over ``shares[i]`` sequences each.

    Member i's contribution is the mean over its ``n_i`` sequences, so the mean over all
    ``T = sum(n_i)`` of them is ``sum(n_i * g_i) / T``: here
    ``f32(1/T) * (((f32(n_0) g_0 + f32(n_1) g_1) + f32(n_2) g_2) + ...)``, every operation
    elementwise float32 in roster order. Equal shares are the plain mean, computed as
    :func:`average_in_roster_order` does (bit for bit what capacity off computes).
    ``vectors`` is read one at a time, as there; with ``owned`` each is scaled in its own
    buffer (no scratch vector) and the first becomes the sum.
    """
    _check_shares(shares, len(vectors) if isinstance(vectors, Sized) else None)
    if len(set(int(n) for n in shares)) <= 1:
        return _counted(lambda gs: average_in_roster_order(gs, owned=owned), vectors,
                        len(shares))
    total: np.ndarray | None = None
    scaled: np.ndarray | None = None
    count = 0
    for g in vectors:
        if count >= len(shares):
            raise GradientError(f"{len(shares)} shares for more contributions")
        _check_same(g, total)
        n = np.float32(shares[count])
        if total is None:
            total = np.multiply(g, n, out=g) if owned else np.multiply(g, n, dtype=np.float32)
        else:
            if not owned and scaled is None:
                scaled = np.empty_like(total)
            np.add(total, np.multiply(g, n, out=g if owned else scaled), out=total)
        del g  # not held while the next one is decoded
        count += 1
    if total is None or count != len(shares):
        raise GradientError(f"{len(shares)} shares for {count} contributions")
    np.multiply(total, np.float32(1.0 / sum(int(n) for n in shares)), out=total)
    return total


def average_parts_in_roster_order(parts: Sequence[Parts], size: int,
                                  shares: Sequence[int] = (),
                                  factors: Sequence[np.float32 | None] = ()) -> np.ndarray:
    """What :func:`weighted_average_in_roster_order` (``shares`` given and unequal) or
    :func:`average_in_roster_order` (otherwise) computes from the whole vectors, bit for
    bit, from vectors given part by part: every member's part of one range is added in
    roster order before the next range is read.

    Each element sees the same float32 operations in the same order as there (the first
    value, times its share if weighted; each next one added; one multiplication by
    ``f32(1/n)`` or ``f32(1/T)``), so the result is the same; but only the sum and one
    part of each member are held, never a whole decoded vector besides the sum (5.3 MB
    less at a commit of the demo default). Every member must yield the same ranges,
    together covering ``0 .. size`` in order. ``factors`` (``influence.clip_factors``)
    scales a member's values first (one float32 multiplication) where it is not None.
    """
    if not parts:
        raise GradientError("cannot average an empty roster")
    if shares:
        _check_shares(shares, len(parts))
    weighted = len(set(int(n) for n in shares)) > 1
    weights = [np.float32(n) for n in shares] if weighted else None
    if factors and len(factors) != len(parts):
        raise GradientError(f"{len(factors)} clip factors for {len(parts)} contributions")
    clip = list(factors) if factors else [None] * len(parts)
    total = np.empty(size, np.float32)
    done = 0
    for row in zip_longest(*parts):
        if any(part is None for part in row):
            raise GradientError("contributions of different lengths")
        where = row[0][0]
        if where.start != done or where.stop > size or where.stop <= where.start:
            raise GradientError(f"a part covers {where.start}..{where.stop}, "
                                f"expected one from {done}")
        out = total[where]
        for k, (at, values) in enumerate(row):
            if at != where:
                raise GradientError("members' parts cover different ranges")
            _check_same(values, out)
            if clip[k] is not None:
                values = np.multiply(values, clip[k], out=values)
            if weights is not None:
                values = np.multiply(values, weights[k], out=values)
            if k == 0:
                out[...] = values
            else:
                np.add(out, values, out=out)
        done = where.stop
    if done != size:
        raise GradientError(f"contributions cover {done} of {size} values")
    if weights is not None:
        np.multiply(total, np.float32(1.0 / sum(int(n) for n in shares)), out=total)
    elif len(parts) > 1:
        np.multiply(total, np.float32(1.0 / len(parts)), out=total)
    return total


def _check_shares(shares: Sequence[int], count: int | None) -> None:
    """Refuse shares that are not positive integers, or not ``count`` of them (if known)."""
    if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1
           for n in shares):
        raise GradientError("shares must be positive integers")
    if count is not None and len(shares) != count:
        raise GradientError(f"{len(shares)} shares for {count} contributions")


def _counted(average: Callable[[Iterable[np.ndarray]], np.ndarray],
             vectors: Iterable[np.ndarray], expected: int) -> np.ndarray:
    """``average(vectors)``, refusing unless exactly ``expected`` vectors were read."""
    seen = 0

    def counting() -> Iterator[np.ndarray]:
        nonlocal seen
        for g in vectors:
            seen += 1
            yield g
            del g  # not held while the next one is decoded

    total = average(counting())
    if seen != expected:
        raise GradientError(f"{expected} shares for {seen} contributions")
    return total
