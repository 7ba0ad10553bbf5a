"""Verified int8 kernels (SPEC section 4).

Precision: quantize scales are computed in float64 (max|x| / 127, floored at 1e-8)
and stored as float32; x / scale is done in float64 with the float32 scale widened;
q = clamp(floor(x / scale + 0.5), -127, 127). GEMM is exact int32. Dequantize is
f32(f32(f32(acc) * s_rows[:, None]) * s_cols[None, :]).
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

log = logging.getLogger(__name__)

K_MAX = 131071
K_BLOCK = 512
M_BLOCK = 256


class NonFiniteError(ValueError):
    pass


class AccumulatorBoundError(ValueError):
    pass


def _check_float(x, ndim=2):
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise TypeError("expected float32 ndarray")
    if x.ndim != ndim:
        raise ValueError(f"expected {ndim}-d array")
    bad = int(np.count_nonzero(~np.isfinite(x)))
    if bad:
        raise NonFiniteError(f"{bad} non-finite values")


def _quant(x, axis):
    _check_float(x)
    scale = np.maximum(np.abs(x).max(axis=axis).astype(np.float64) / 127.0, 1e-8)
    s32 = scale.astype(np.float32)
    sw = s32.astype(np.float64)
    sw = sw[:, None] if axis == 1 else sw[None, :]
    q = np.clip(np.floor(x.astype(np.float64) / sw + 0.5), -127, 127).astype(np.int8)
    return q, s32


def quantize_rows(x):
    """float32 [m,k] -> (int8 [m,k], float32 scales [m])."""
    return _quant(x, 1)


def quantize_cols(w):
    """float32 [k,n] -> (int8 [k,n], float32 scales [n])."""
    return _quant(w, 0)


def _mirror(a, b):
    return (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)


def _blas(a, b):
    m, k = a.shape
    out = np.zeros((m, b.shape[1]), dtype=np.int64)
    for i in range(0, m, M_BLOCK):
        af = a[i : i + M_BLOCK].astype(np.float32)
        for j in range(0, k, K_BLOCK):
            out[i : i + M_BLOCK] += (
                af[:, j : j + K_BLOCK] @ b[j : j + K_BLOCK].astype(np.float32)
            ).astype(np.int64)
    return out.astype(np.int32)


_TABLE = None


def _lut(a, b):
    global _TABLE
    if _TABLE is None:
        v = np.arange(-128, 128, dtype=np.int32)
        t = np.outer(v, v).astype(np.int32)
        ref = np.array(
            [[x * y for y in range(-128, 128)] for x in range(-128, 128)], dtype=np.int32
        )
        if not np.array_equal(t, ref):
            raise RuntimeError("lut table certification failed")
        _TABLE = t
    ai = a.astype(np.int32) + 128
    bi = b.astype(np.int32) + 128
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.int32)
    for j in range(a.shape[1]):
        out += _TABLE[ai[:, j][:, None], bi[j][None, :]]
    return out


_IMPLS = {"blas": _blas, "mirror": _mirror, "lut": _lut}
_ORDER = ["blas", "mirror", "lut"]
_gate = {}
_forced = None
_counts = {n: 0 for n in _ORDER}


def _gate_cases():
    rng = np.random.default_rng(0)
    cases = []
    for m, k, n in [
        (1, 1, 1),
        (3, 5, 7),
        (2, K_BLOCK, 3),
        (2, K_BLOCK + 1, 3),
        (5, 2 * K_BLOCK - 1, 4),
    ]:
        cases.append(
            (
                rng.integers(-128, 128, (m, k), dtype=np.int8),
                rng.integers(-128, 128, (k, n), dtype=np.int8),
            )
        )
    cases.append((np.full((3, 1030), -128, np.int8), np.full((1030, 2), -128, np.int8)))
    cases.append((np.full((2, 1030), 127, np.int8), np.full((1030, 3), -128, np.int8)))
    return cases


def run_gate(fn):
    for a, b in _gate_cases():
        try:
            got = fn(a, b)
        except Exception:
            return False
        if not (
            isinstance(got, np.ndarray)
            and got.dtype == np.int32
            and np.array_equal(got, _mirror(a, b))
        ):
            return False
    return True


def _gated(name):
    if name not in _gate:
        _gate[name] = run_gate(_IMPLS[name])
        if not _gate[name]:
            log.warning("backend %s failed gate; demoted", name)
    return _gate[name]


def active_backend():
    if _forced:
        return _forced
    for n in _ORDER:
        if _gated(n):
            return n
    return "mirror"


def backends():
    return [(n, _gate.get(n)) for n in _ORDER]


class use_backend:
    """Force a backend; works as a setter or a context manager."""

    def __init__(self, name):
        global _forced
        if name is not None and name not in _IMPLS:
            raise ValueError(f"unknown backend {name}")
        self.prev = _forced
        _forced = name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _forced
        _forced = self.prev


def gemm_int8(a_q, b_q):
    for x in (a_q, b_q):
        if not isinstance(x, np.ndarray) or x.dtype != np.int8:
            raise TypeError("expected int8 ndarray")
        if x.ndim != 2:
            raise ValueError("expected 2-d array")
    if a_q.shape[1] != b_q.shape[0]:
        raise ValueError("inner dimensions differ")
    if a_q.shape[1] > K_MAX:
        raise AccumulatorBoundError(f"K={a_q.shape[1]} exceeds {K_MAX}")
    name = active_backend()
    _counts[name] += a_q.shape[0] * a_q.shape[1] * b_q.shape[1]
    return _IMPLS[name](a_q, b_q)


def dequantize(acc, s_rows, s_cols):
    if acc.dtype != np.int32 or s_rows.dtype != np.float32 or s_cols.dtype != np.float32:
        raise TypeError("dtype")
    y = (acc.astype(np.float32) * s_rows[:, None]).astype(np.float32)
    return (y * s_cols[None, :]).astype(np.float32)


def int8_matmul(x, w):
    a, sa = quantize_rows(x)
    b, sb = quantize_cols(w)
    return dequantize(gemm_int8(a, b), sa, sb)


def _hash_data(n, seed):
    i = np.arange(n, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    i ^= i >> np.uint64(33)
    with np.errstate(over="ignore"):
        i *= np.uint64(0xFF51AFD7ED558CCD)
    i ^= i >> np.uint64(33)
    return (i & np.uint64(0xFF)).astype(np.uint8).view(np.int8)


def probe_hash():
    a = _hash_data(64 * 96, 1).reshape(64, 96)
    b = _hash_data(96 * 80, 2).reshape(96, 80)
    acc = gemm_int8(a, b)
    return hashlib.blake2b(acc.astype("<i4").tobytes()).hexdigest()


def counters():
    return dict(_counts)
