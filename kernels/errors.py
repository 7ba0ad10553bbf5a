"""Exceptions, hard limits and operand checks shared by the kernel modules."""

from __future__ import annotations

import numpy as np

# Largest K whose int32 accumulation cannot wrap for *any* int8 inputs:
# K * (-128 * -128) = K * 2**14 <= 2**31 - 1  <=>  K <= 131071.
K_MAX = 131071


class NonFiniteError(ValueError):
    """A float input held NaN or Inf; the message names how many values were bad."""


class AccumulatorBoundError(ValueError):
    """K is so large that an exact int32 accumulator could wrap (K > K_MAX)."""


def check_array(name: str, x: object, dtype: type, ndim: int = 2) -> np.ndarray:
    """Refuse anything but an ndarray of exactly `dtype` and `ndim` (never cast)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(
            f"{name} must have dtype {np.dtype(dtype)}, got {x.dtype} (no silent casts)"
        )
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{name} is empty (shape {x.shape})")
    return x


def check_k(k: int) -> None:
    if k > K_MAX:
        raise AccumulatorBoundError(
            f"K={k} exceeds {K_MAX}: an int32 accumulator could wrap (K * 128 * 128 >= 2**31)"
        )


def check_pair(a: object, b: object, dtype: type, names: tuple[str, str]) -> tuple[int, int, int]:
    """Validate GEMM operands [m,k] x [k,n]; return (m, k, n)."""
    a = check_array(names[0], a, dtype)
    b = check_array(names[1], b, dtype)
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(
            f"inner dimensions differ: {names[0]} is {a.shape}, {names[1]} is {b.shape}"
        )
    check_k(k)
    return m, k, n
