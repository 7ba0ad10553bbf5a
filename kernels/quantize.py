"""Row/column int8 quantization and the float32 dequantize epilogue, with the exact precision
schedule that makes them bit-identical on every IEEE-754 machine.

Exactly which operation runs in which precision (all IEEE-754, round to nearest even):

1. ``amax = max |x|`` along the row (``quantize_rows``) or column (``quantize_cols``), in
   float32. ``abs`` and ``max`` are exact, so this is the same everywhere.
2. ``scale = float32(max(float64(amax) / 127.0, 1e-8))``: the division and the floor run in
   float64, the result is rounded once to float32 (the stored scale).
3. ``q = clamp(floor(float64(x) / float64(scale) + 0.5), -127, 127)``: the division and the
   ``+ 0.5`` run in float64, each correctly rounded; ``floor`` and the clamp are exact.

Step 3 equals the exact round-half-up of the real quotient ``x / scale``: for float32 ``x`` and
``scale`` the quotient is either exactly a half-integer or at least ~2**-35 (relative) away
from one, far more than the float64 rounding error of 2**-53, so no rounding can move it
across a ``floor`` boundary. The result is therefore bit-identical on every IEEE machine and
does not depend on the order numpy vectorises the loop. The clamp never binds (|x| <= amax,
so |x / scale| <= 127 * (1 + 2**-23) < 127.5) but is kept because it is the definition.

Dequantize: ``y = f32(f32(f32(acc) * s_rows[:, None]) * s_cols[None, :])``, each product
rounded to float32, in that order.
"""

from __future__ import annotations

import numpy as np

from .errors import NonFiniteError, check_array

SCALE_FLOOR = 1e-8
# Elements per chunk of the float64 quotient: 64 Ki doubles = 512 KiB stays in L2, which
# measured ~2x faster than whole-matrix float64 temporaries streamed through memory.
_CHUNK = 1 << 16


def _nonfinite(x: np.ndarray, name: str) -> NonFiniteError:
    bad = int(x.size - np.count_nonzero(np.isfinite(x)))
    return NonFiniteError(f"{name} has {bad} non-finite value(s) (NaN or Inf); refusing")


def _scales(amax: np.ndarray) -> np.ndarray:
    s = np.maximum(amax.astype(np.float64) / 127.0, SCALE_FLOOR)
    return s.astype(np.float32)


def quantize_values(x: np.ndarray, axis: int, name: str = "x",
                    out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize along `axis` (1: per row, 0: per column); q returned as integer-valued float32
    (written into `out`, a float32 array of x's shape, if given).

    The float32 form is what the BLAS backend multiplies, so ``int8_matmul`` never converts
    int8 -> float32. ``q.astype(np.int8)`` gives the int8 form of ``quantize_rows/cols``.
    The float64 quotient is formed chunk by chunk so its temporary stays cache-resident.
    (A float32 fast path with an exact float64 fallback near ties was tried: it needs ~8
    passes instead of 4 and measured no faster here.)
    """
    check_array(name, x, np.float32)
    m, k = x.shape
    # amax of finite data is finite; NaN propagates through max and Inf stays Inf, so one
    # check on the (small) scale vector replaces a full isfinite pass over x.
    amax = np.abs(x).max(axis=axis)
    if not np.isfinite(amax).all():
        raise _nonfinite(x, name)
    scale = _scales(amax)
    wide = scale.astype(np.float64)
    wide = wide[:, None] if axis == 1 else wide[None, :]
    q = np.empty((m, k), np.float32) if out is None else out
    rows = max(1, _CHUNK // k)
    tmp = np.empty((min(rows, m), k), np.float64)
    for i in range(0, m, rows):
        t = tmp[: min(rows, m - i)]
        np.divide(x[i : i + rows], wide[i : i + rows] if axis == 1 else wide, out=t)
        np.add(t, 0.5, out=t)
        np.floor(t, out=q[i : i + rows])  # integer-valued, |v| <= 128: exact in float32
    np.clip(q, -127.0, 127.0, out=q)
    return q, scale


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [m,k] -> (int8 [m,k], float32 scales [m]); see the module docstring."""
    q, s = quantize_values(x, 1, "x")
    return q.astype(np.int8), s


def quantize_cols(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [k,n] -> (int8 [k,n], float32 scales [n]); see the module docstring."""
    q, s = quantize_values(w, 0, "w")
    return q.astype(np.int8), s


def check_scales(m: int, n: int, s_rows: object, s_cols: object) -> None:
    sr = check_array("s_rows", s_rows, np.float32, ndim=1)
    sc = check_array("s_cols", s_cols, np.float32, ndim=1)
    if sr.shape[0] != m or sc.shape[0] != n:
        raise ValueError(f"scales do not match acc [{m},{n}]: s_rows {sr.shape}, s_cols {sc.shape}")


def scale_inplace(y: np.ndarray, s_rows: np.ndarray, s_cols: np.ndarray) -> np.ndarray:
    """y <- f32(f32(y * s_rows[:, None]) * s_cols[None, :]) in place; y is float32."""
    # float32 * float32 in numpy is one correctly rounded IEEE multiply, so doing it in
    # place (row chunks, cache-resident) rounds exactly like the two-temporary expression.
    m, n = y.shape
    rows = max(1, _CHUNK // n)
    sr = s_rows[:, None]
    sc = s_cols[None, :]
    for i in range(0, m, rows):
        yc = y[i : i + rows]
        np.multiply(yc, sr[i : i + rows], out=yc)
        np.multiply(yc, sc, out=yc)
    return y


def dequantize(acc: np.ndarray, s_rows: np.ndarray, s_cols: np.ndarray) -> np.ndarray:
    """int32 [m,n] accumulators -> float32: f32(f32(f32(acc) * s_rows[:,None]) * s_cols)."""
    check_array("acc", acc, np.int32)
    check_scales(acc.shape[0], acc.shape[1], s_rows, s_cols)
    return scale_inplace(acc.astype(np.float32), s_rows, s_cols)
