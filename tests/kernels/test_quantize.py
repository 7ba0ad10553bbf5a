from __future__ import annotations

from fractions import Fraction
from math import floor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kernels
from kernels import NonFiniteError, quantize_cols, quantize_rows


def exact_q(x: float, s: float) -> int:
    """Round-half-up of the *real* quotient, in exact rational arithmetic."""
    return max(-127, min(127, floor(Fraction(x) / Fraction(s) + Fraction(1, 2))))


def spec_scales(x: np.ndarray, axis: int) -> np.ndarray:
    amax = np.abs(x.astype(np.float64)).max(axis=axis)
    return np.maximum(amax / 127.0, 1e-8).astype(np.float32)


floats = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
    elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True),
)


@settings(max_examples=40, deadline=None)
@given(floats)
def test_quantize_matches_exact_rational_definition(x: np.ndarray) -> None:
    for axis, fn in ((1, quantize_rows), (0, quantize_cols)):
        q, s = fn(x)
        assert q.dtype == np.int8 and s.dtype == np.float32
        assert np.array_equal(s, spec_scales(x, axis))
        sb = np.broadcast_to(s[:, None] if axis == 1 else s[None, :], x.shape)
        want = [[exact_q(float(v), float(c)) for v, c in zip(r, rs, strict=True)]
                for r, rs in zip(x, sb, strict=True)]
        assert q.tolist() == want


def test_quantize_exact_ties_round_half_up() -> None:
    # x / s exactly k + 0.5 (and -k - 0.5) must round up: floor(v + 0.5)
    s = np.float32(2.0**-3)
    x = np.array([[127 * s, 2.5 * s, -2.5 * s, 0.5 * s, -0.5 * s, 3.5 * s]], np.float32)
    q, sc = quantize_rows(x)
    assert sc[0] == np.float32(np.float64(127 * s) / 127)
    assert q.tolist() == [[127, 3, -2, 1, 0, 4]]


def test_exact_ties_with_an_arbitrary_scale() -> None:
    # a 16-bit-mantissa scale makes every (k + 0.5) * s exactly representable
    s = np.float32(np.round(1.2345 * 2**15) / 2**15)
    ks = np.arange(-127, 127)
    row = np.concatenate([[127 * s], (ks + 0.5) * s]).astype(np.float32)
    assert np.array_equal(row[1:].astype(np.float64) / np.float64(s), ks + 0.5)  # true ties
    for fn, x in ((quantize_rows, row[None, :]), (quantize_cols, row[:, None])):
        q, sc = fn(np.ascontiguousarray(x))
        assert sc[0] == s
        assert q.ravel().tolist() == [127, *(ks + 1).tolist()]  # half rounds up, always


def test_round_trip_error_bound() -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 300)) * rng.lognormal(0, 3, (64, 1))).astype(np.float32)
    for axis, fn in ((1, quantize_rows), (0, quantize_cols)):
        q, s = fn(x)
        sw = s.astype(np.float64)
        sw = sw[:, None] if axis == 1 else sw[None, :]
        err = np.abs(x.astype(np.float64) - q.astype(np.float64) * sw)
        assert (err <= sw / 2 * (1 + 1e-12)).all()
        assert np.abs(q).max() == 127  # the max element maps to +-127 (scale is tight)


def test_scale_floor_and_zero_input() -> None:
    q, s = quantize_rows(np.zeros((2, 3), np.float32))
    assert (q == 0).all() and (s == np.float32(1e-8)).all()
    tiny = np.full((1, 4), 1e-12, np.float32)
    q, s = quantize_rows(tiny)
    assert s[0] == np.float32(1e-8) and (q == 0).all()


def test_quantize_deterministic_across_calls() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((257, 1031)).astype(np.float32)  # several internal chunks
    first = quantize_rows(x), quantize_cols(x)
    for _ in range(3):
        again = quantize_rows(x.copy()), quantize_cols(np.asfortranarray(x))
        for (q0, s0), (q1, s1) in zip(first, again, strict=True):
            assert np.array_equal(q0, q1) and np.array_equal(s0, s1)


def test_nonfinite_refused_with_count() -> None:
    x = np.ones((4, 5), np.float32)
    x[0, 0] = np.nan
    x[1, 2] = np.inf
    x[3, 4] = -np.inf
    for fn in (quantize_rows, quantize_cols):
        with pytest.raises(NonFiniteError, match=r"\b3 non-finite"):
            fn(x)
    w = np.ones((5, 2), np.float32)
    w[1, 1] = np.nan
    with pytest.raises(NonFiniteError, match=r"w has 1 non-finite"):
        kernels.int8_matmul(np.ones((2, 5), np.float32), w)


@pytest.mark.parametrize(
    "bad, exc",
    [
        (np.ones((2, 2), np.float64), TypeError),
        (np.ones((2, 2), np.float16), TypeError),
        ([[1.0, 2.0]], TypeError),
        (np.ones(4, np.float32), ValueError),
        (np.ones((2, 2, 2), np.float32), ValueError),
        (np.ones((0, 3), np.float32), ValueError),
    ],
)
def test_quantize_input_errors(bad: object, exc: type) -> None:
    for fn in (quantize_rows, quantize_cols):
        with pytest.raises(exc):
            fn(bad)  # type: ignore[arg-type]


def test_dequantize_schedule_and_errors() -> None:
    rng = np.random.default_rng(5)
    acc = rng.integers(-(2**31), 2**31 - 1, (33, 70), dtype=np.int32)
    sr = rng.random(33).astype(np.float32)
    sc = rng.random(70).astype(np.float32)
    y = kernels.dequantize(acc, sr, sc)
    want = (acc.astype(np.float32) * sr[:, None]).astype(np.float32) * sc[None, :]
    assert y.dtype == np.float32 and np.array_equal(y.view(np.int32), want.view(np.int32))
    # the order matters: scaling by s_cols first differs somewhere on this data
    other = (acc.astype(np.float32) * sc[None, :]) * sr[:, None]
    assert not np.array_equal(y, other)
    with pytest.raises(TypeError):
        kernels.dequantize(acc.astype(np.int64), sr, sc)
    with pytest.raises(TypeError):
        kernels.dequantize(acc, sr.astype(np.float64), sc)
    with pytest.raises(ValueError):
        kernels.dequantize(acc, sr[:-1], sc)
    with pytest.raises(ValueError):
        kernels.dequantize(acc, sr, sc[:, None])


def _exact_rows(x: np.ndarray, axis: int) -> list[list[int]]:
    s = spec_scales(x, axis)
    sb = np.broadcast_to(s[:, None] if axis == 1 else s[None, :], x.shape)
    return [[exact_q(float(v), float(c)) for v, c in zip(r, rs, strict=True)]
            for r, rs in zip(x, sb, strict=True)]


def test_float32_quotient_near_integers_is_decided_exactly() -> None:
    # quantize_values divides in float32: f32(x/s) + 1/2 can land exactly on an integer
    # from below (x/s = 1/2 - 2**-25 rounds to 1/2; k + 1/2 - tiny rounds to k + 1/2):
    # those cells are re-decided exactly. Near-ties on both sides and true ties, at many
    # scales, by rows and by columns.
    rng = np.random.default_rng(11)
    cells = []
    for _ in range(300):
        s = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** int(rng.integers(-30, 30)))
        k = int(rng.integers(-126, 126))
        exact = np.float64(k + 0.5) * np.float64(s)
        tie = np.float32(exact)
        below = np.nextafter(tie, np.float32(-np.inf))
        above = np.nextafter(tie, np.float32(np.inf))
        tiny = np.float32(np.float64(s) * (0.5 - int(rng.integers(1, 4)) * 2.0**-25))
        cells.append([np.float32(127) * s, tie, below, above, tiny, -tiny, -tie])
    x = np.array(cells, np.float32)
    for axis, fn in ((1, quantize_rows), (0, quantize_cols)):
        arr = np.ascontiguousarray(x if axis == 1 else x.T)
        q, _ = fn(arr)
        assert q.tolist() == _exact_rows(arr, axis)


@pytest.mark.parametrize("shape", [(3, 40000), (40000, 3), (70, 1000)])
def test_chunk_boundaries_and_rows_wider_than_a_chunk(shape: tuple[int, int]) -> None:
    # rows longer than quantize's chunk, many chunks of rows, ragged last chunk
    rng = np.random.default_rng(shape[0])
    x = (rng.standard_normal(shape) * rng.lognormal(0, 2, (shape[0], 1))).astype(np.float32)
    for axis, fn in ((1, quantize_rows), (0, quantize_cols)):
        q, s = fn(x)
        assert np.array_equal(s, spec_scales(x, axis))
        sw = s.astype(np.float64)[:, None] if axis == 1 else s.astype(np.float64)[None, :]
        want = np.clip(np.floor(x.astype(np.float64) / sw + 0.5), -127, 127)  # exact here
        assert np.array_equal(q.astype(np.float64), want)
