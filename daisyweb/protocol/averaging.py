"""Gradient averaging in roster order: the one reduction whose order replicas must share.

Every member receives the same gradient bytes and must produce the same average bit for
bit. numpy's ``sum``/``mean`` over a stacked array may reorder additions (pairwise, SIMD
lanes), so the average is written as explicit elementwise float32 additions in roster
order, then one multiplication by ``float32(1 / n)`` (computed in binary64, rounded once).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["GradientError", "check_gradient", "average_in_roster_order"]

_F32 = np.dtype(np.float32)


class GradientError(ValueError):
    """A gradient that must not be averaged: wrong dtype, length, or non-finite values."""


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


def average_in_roster_order(grads: Sequence[np.ndarray]) -> np.ndarray:
    """``f32(1/n) * (((g0 + g1) + g2) + ...)``, every operation elementwise float32.

    All gradients must already be validated float32 vectors of one length.
    """
    if not grads:
        raise GradientError("cannot average an empty roster")
    size = grads[0].shape
    for g in grads:
        if not isinstance(g, np.ndarray) or g.dtype != _F32 or g.shape != size:
            raise GradientError("all gradients must be float32 arrays of the same shape")
    total = grads[0].copy()
    for g in grads[1:]:
        np.add(total, g, out=total)
    if len(grads) > 1:
        np.multiply(total, np.float32(1.0 / len(grads)), out=total)
    return total
