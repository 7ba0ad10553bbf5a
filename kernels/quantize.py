"""Row/column int8 quantization and the float32 dequantize epilogue, with the exact precision
schedule that makes them bit-identical on every IEEE-754 machine.

Exactly which operation runs in which precision (all IEEE-754, round to nearest even):

1. ``amax = max |x|`` along the row (``quantize_rows``) or column (``quantize_cols``), in
   float32. ``abs`` and ``max`` are exact, so this is the same everywhere.
2. ``scale = float32(max(float64(amax) / 127.0, 1e-8))``: the division and the floor run in
   float64, the result is rounded once to float32 (the stored scale).
3. ``q = clamp(floor(x / scale + 0.5), -127, 127)`` of the *real* quotient: its exact
   round-half-up. (Formed as ``floor(float64(x) / float64(scale) + 0.5)`` this is exact: for
   float32 ``x`` and ``scale`` the quotient is either exactly a half-integer or at least
   ~2**-35 (relative) away from one, far more than float64's rounding error of 2**-53.)
   ``quantize_values`` computes it in float32 with the rare near-integer cases decided
   exactly in float64 (see there); the clamp never binds (|x| <= amax, so
   |x / scale| <= 127 * (1 + 2**-23) < 127.5) but is kept because it is the definition.

The result is therefore bit-identical on every IEEE machine and does not depend on the
order numpy vectorises the loop.

Dequantize: ``y = f32(f32(f32(acc) * s_rows[:, None]) * s_cols[None, :])``, each product
rounded to float32, in that order.
"""

from __future__ import annotations

import threading

import numpy as np

from .errors import NonFiniteError, check_array

SCALE_FLOOR = 1e-8
# Elements per chunk: the chunk's float32 quotient and its flags stay in L1/L2 through
# every pass, so x and q cross memory once.
_CHUNK = 1 << 15
# Elements per chunk of the dequantize epilogue (two multiplies: larger chunks are faster
# for it, and the bits are the same whatever the chunking)
_SCALE_CHUNK = 1 << 17


class _Scratch(threading.local):
    """Per-thread chunk buffers (float32 quotient, bool flags), reused across calls."""

    def __init__(self) -> None:
        self.t = np.empty(_CHUNK, np.float32)
        self.flags = np.empty(_CHUNK, np.bool_)

    def fit(self, k: int) -> None:
        """Room for one row of k elements (a chunk is at least one row)."""
        if self.t.size < k:
            self.t = np.empty(k, np.float32)
            self.flags = np.empty(k, np.bool_)


_scratch = _Scratch()


def _nonfinite(x: np.ndarray, name: str) -> NonFiniteError:
    bad = int(x.size - np.count_nonzero(np.isfinite(x)))
    return NonFiniteError(f"{name} has {bad} non-finite value(s) (NaN or Inf); refusing")


def _scales(amax: np.ndarray) -> np.ndarray:
    # float64 division and floor, rounded once to float32 (step 2 of the docstring)
    s = np.divide(amax, 127.0, dtype=np.float64)
    np.maximum(s, SCALE_FLOOR, out=s)
    return s.astype(np.float32)


def _round_chunk(xc: np.ndarray, sc: np.ndarray, qc: np.ndarray, t: np.ndarray,
                 flags: np.ndarray, per_row: bool) -> None:
    """qc = floor(xc / sc + 1/2) for the real quotient, exactly (see quantize_values)."""
    np.divide(xc, sc, out=t)  # r = f32(x / s), correctly rounded
    t += np.float32(0.5)
    np.floor(t, out=qc)
    np.equal(t, qc, out=flags)  # f32(r + 1/2) landed on an integer: decide exactly
    if np.logical_or.reduce(flags, axis=None):  # flags.any(), without its wrapper
        # (np.nonzero on a 2-d mask costs ~15x np.flatnonzero's scan)
        rows, cols = np.divmod(np.flatnonzero(flags), flags.shape[1])
        s64 = (sc[rows, 0] if per_row else sc[0, cols]).astype(np.float64)
        half = qc[rows, cols].astype(np.float64) - 0.5  # the half-integer r + 1/2 hit
        # x / s < half  <=>  x < half * s (s > 0; the product has <= 33 bits: exact)
        qc[rows, cols] -= xc[rows, cols].astype(np.float64) < half * s64


def quantize_values(x: np.ndarray, axis: int, name: str = "x",
                    out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize along `axis` (1: per row, 0: per column); q returned as integer-valued float32
    (written into `out`, a float32 array of x's shape, if given).

    The float32 form is what the BLAS backend multiplies, so ``int8_matmul`` never converts
    int8 -> float32. ``q.astype(np.int8)`` gives the int8 form of ``quantize_rows/cols``.

    How step 3 of the module docstring is computed, exactly, in float32: r = f32(x / s)
    (one correctly rounded division), t = f32(r + 1/2), q = floor(t). Rounding is
    monotone and every integer and half-integer involved is a float32, so floor(t) can
    differ from the exact floor(x / s + 1/2) only when t is exactly an integer N (r hit
    the half-integer N - 1/2, or r + 1/2 rounded up onto N): then the answer is N or
    N - 1, and x < (N - 1/2) * s, exact in float64, decides it. Otherwise floor(t) is
    exact. |r| <= 127 (1 + 2**-23) keeps |q| <= 127: the clamp never binds. Chunks of
    rows stay cache-resident through the five passes.
    """
    check_array(name, x, np.float32)
    m, k = x.shape
    q = np.empty((m, k), np.float32) if out is None else out
    ws = _scratch
    ws.fit(k)
    rows = max(1, _CHUNK // k)
    if axis == 0:
        # column maxima need every row first: amax of finite data is finite, NaN
        # propagates through max and Inf stays Inf, so one check on the scales suffices
        amax = None
        for i in range(0, m, rows):
            xc = x[i : i + rows]
            t = ws.t[: xc.size].reshape(xc.shape)
            np.abs(xc, out=t)
            part = np.maximum.reduce(t, axis=0)
            amax = part if amax is None else np.maximum(amax, part, out=amax)
        assert amax is not None
        if not np.isfinite(amax).all():
            raise _nonfinite(x, name)
        scale = _scales(amax)
        sc = scale[None, :]
        for i in range(0, m, rows):
            xc = x[i : i + rows]
            n = xc.size
            _round_chunk(xc, sc, q[i : i + rows], ws.t[:n].reshape(xc.shape),
                         ws.flags[:n].reshape(xc.shape), False)
        return q, scale
    scale = np.empty(m, np.float32)
    for i in range(0, m, rows):
        xc = x[i : i + rows]
        n = xc.size
        t = ws.t[:n].reshape(xc.shape)
        np.abs(xc, out=t)
        amax = np.maximum.reduce(t, axis=1)
        # every row maximum finite <=> their maximum is < inf (NaN propagates through
        # max and compares False): one small call instead of isfinite + all()
        if not np.maximum.reduce(amax) < np.inf:
            raise _nonfinite(x, name)
        scale[i : i + rows] = _scales(amax)
        _round_chunk(xc, scale[i : i + rows, None], q[i : i + rows], t,
                     ws.flags[:n].reshape(xc.shape), True)
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
    rows = max(1, _SCALE_CHUNK // n)
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
