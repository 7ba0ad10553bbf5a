from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import AccumulatorBoundError, dispatch, gemm_int8
from kernels.backends import LutBackend, build_product_table, certify_table

ALL = np.arange(-128, 128, dtype=np.int8)
BACKENDS = ("blas", "blas64", "mirror", "lut")


def ref_gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.int64) @ b.astype(np.int64)


def test_lut_table_covers_every_product() -> None:
    table = build_product_table()
    a, b = np.meshgrid(np.arange(-128, 128), np.arange(-128, 128), indexing="ij")
    assert table.tolist() == [int(x) * int(y) for x, y in zip(a.ravel(), b.ravel(), strict=True)]
    # and the table really is what the lut backend reads: all 65,536 products through it
    got = LutBackend().gemm(ALL[:, None].copy(), ALL[None, :].copy())
    assert np.array_equal(got, np.multiply.outer(ALL.astype(np.int64), ALL.astype(np.int64)))


def test_lut_certification_rejects_a_wrong_entry() -> None:
    table = build_product_table().copy()
    table[(-128 + 128) * 256 + (-128 + 128)] = 16383  # -128 * -128 off by one
    with pytest.raises(RuntimeError, match="1 wrong entries"):
        certify_table(table)


@pytest.mark.parametrize("name", BACKENDS)
def test_every_pair_through_k1_path(name: str) -> None:
    # [256,1] x [1,256] is one K=1 GEMM whose cells are all 65,536 int8 x int8 pairs
    with kernels.use_backend(name):
        got = gemm_int8(ALL[:, None].copy(), ALL[None, :].copy())
        assert kernels.active_backend() == name
    assert got.dtype == np.int32
    assert np.array_equal(got, np.multiply.outer(ALL.astype(np.int64), ALL.astype(np.int64)))


@pytest.mark.parametrize("name", BACKENDS)
def test_literal_1x1x1_calls(name: str) -> None:
    be = dispatch.get_backend(name)
    for x in range(-128, 128):
        a = np.array([[x]], np.int8)
        for y in range(-128, 128):
            assert be.gemm(a, np.array([[y]], np.int8))[0, 0] == x * y


dims = st.integers(1, 40)


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(m=dims, n=dims, k=st.sampled_from([1, 2, 7, 64, 513, 1023, 1024, 1025, 2100]),
       seed=st.integers(0, 2**32 - 1), extreme=st.booleans())
def test_random_shapes_exact(name: str, m: int, k: int, n: int, seed: int,
                             extreme: bool) -> None:
    rng = np.random.default_rng(seed)
    if extreme:  # only -128 and 127: the largest products and sums
        a = np.where(rng.random((m, k)) < 0.5, -128, 127).astype(np.int8)
        b = np.where(rng.random((k, n)) < 0.5, -128, 127).astype(np.int8)
    else:
        a = rng.integers(-128, 128, (m, k), dtype=np.int8)
        b = rng.integers(-128, 128, (k, n), dtype=np.int8)
    with kernels.use_backend(name):
        got = gemm_int8(a, b)
    assert got.dtype == np.int32 and np.array_equal(got, ref_gemm(a, b))


@pytest.mark.parametrize("name", BACKENDS)
def test_noncontiguous_operands(name: str) -> None:
    rng = np.random.default_rng(7)
    a = rng.integers(-128, 128, (30, 40), dtype=np.int8)[::2, 1::3]
    b = np.asfortranarray(rng.integers(-128, 128, (13, 9), dtype=np.int8))
    with kernels.use_backend(name):
        assert np.array_equal(gemm_int8(a, b), ref_gemm(a, b))


def test_float32_exactness_edges() -> None:
    # sum exactly 2**24 (representable) and 2**24 + 16129 (odd: needs the K-block split)
    for k in (1024, 1025, 2049, 3073):
        v = np.full(k, -128, np.int8)
        v[-1] = 127
        a = v[None, :].copy()
        want = (k - 1) * 16384 + 16129
        for name in BACKENDS:
            with kernels.use_backend(name):
                assert int(gemm_int8(a, a.T.copy())[0, 0]) == want


def test_largest_k_does_not_wrap() -> None:
    k = kernels.K_MAX
    a = np.full((1, k), -128, np.int8)
    for name in ("blas", "blas64", "mirror"):
        with kernels.use_backend(name):
            assert int(gemm_int8(a, a.T.copy())[0, 0]) == k * 16384 == 2**31 - 16384


@pytest.mark.parametrize(
    "a, b, exc",
    [
        (np.zeros((2, 2), np.int16), np.zeros((2, 2), np.int8), TypeError),
        (np.zeros((2, 2), np.int8), np.zeros((2, 2), np.uint8), TypeError),
        (np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int8), TypeError),
        ([[1]], np.zeros((1, 1), np.int8), TypeError),
        (np.zeros((2, 3), np.int8), np.zeros((2, 2), np.int8), ValueError),
        (np.zeros(3, np.int8), np.zeros((3, 2), np.int8), ValueError),
        (np.zeros((1, 2, 3), np.int8), np.zeros((3, 2), np.int8), ValueError),
        (np.zeros((0, 3), np.int8), np.zeros((3, 2), np.int8), ValueError),
    ],
)
def test_gemm_input_errors(a: object, b: object, exc: type) -> None:
    with pytest.raises(exc):
        gemm_int8(a, b)  # type: ignore[arg-type]


def test_accumulator_bound() -> None:
    k = kernels.K_MAX + 1
    with pytest.raises(AccumulatorBoundError, match="131072"):
        gemm_int8(np.zeros((1, k), np.int8), np.zeros((k, 1), np.int8))
    with pytest.raises(AccumulatorBoundError):
        kernels.int8_matmul(np.zeros((1, k), np.float32), np.zeros((k, 1), np.float32))
    assert issubclass(AccumulatorBoundError, ValueError)


def test_int8_matmul_is_the_three_steps_bit_for_bit() -> None:
    rng = np.random.default_rng(8)
    for m, k, n in ((16, 32, 8), (5, 1024, 3), (7, 1500, 9)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = (rng.standard_normal((k, n)) * 3).astype(np.float32)
        qa, sa = kernels.quantize_rows(x)
        qb, sb = kernels.quantize_cols(w)
        want = kernels.dequantize(ref_gemm(qa, qb).astype(np.int32), sa, sb)
        for name in BACKENDS:
            with kernels.use_backend(name):
                y = kernels.int8_matmul(x, w)
            assert y.dtype == np.float32 and np.array_equal(y.view(np.int32), want.view(np.int32))
        assert np.abs(want - x @ w).max() < 0.05 * np.abs(x @ w).max()


def test_int8_matmul_into_out_is_the_same_bits() -> None:
    rng = np.random.default_rng(9)
    for m, k, n in ((16, 32, 8), (5, 1024, 3), (7, 1500, 9)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = (rng.standard_normal((k, n)) * 3).astype(np.float32)
        for name in BACKENDS:
            with kernels.use_backend(name):
                want = kernels.int8_matmul(x, w)
                out = np.full((m, n), np.nan, np.float32)
                assert kernels.int8_matmul(x, w, out=out) is out
                got = kernels.int8_matmul(x, w, out=out)  # again, into its own old result
            assert got.tobytes() == want.tobytes(), name


def test_int8_matmul_out_is_checked() -> None:
    x = np.ones((3, 4), np.float32)
    w = np.ones((4, 2), np.float32)
    with pytest.raises(TypeError, match="dtype float32"):
        kernels.int8_matmul(x, w, out=np.empty((3, 2), np.float64))
    with pytest.raises(ValueError, match="shape"):
        kernels.int8_matmul(x, w, out=np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.int8_matmul(x, w, out=np.empty((3, 4), np.float32)[:, :2])
    with pytest.raises(ValueError, match="contiguous"):
        kernels.int8_matmul(x, w, out=np.ones((2, 3), np.float32).T)  # F-order
    square = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="share memory"):
        kernels.int8_matmul(square, np.ones((2, 2), np.float32), out=square)


def test_prepared_weight_is_int8_matmul_bit_for_bit() -> None:
    rng = np.random.default_rng(10)
    for m, k, n in ((16, 32, 8), (5, 1024, 3), (7, 1500, 9)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = (rng.standard_normal((k, n)) * 3).astype(np.float32)
        qb, sb = kernels.quantize_cols(w)
        for name in BACKENDS:
            with kernels.use_backend(name):
                want = kernels.int8_matmul(x, w)
                q = np.full((k, n), -128, np.int8)
                s = np.full(n, np.nan, np.float32)
                kernels.quantize_weight(w, q, s)
                assert np.array_equal(q, qb) and s.tobytes() == sb.tobytes(), name
                out = np.full((m, n), np.nan, np.float32)
                assert kernels.int8_matmul_prepared(x, q, s, out=out) is out
                fresh = kernels.int8_matmul_prepared(x, q, s)
            assert out.tobytes() == want.tobytes() == fresh.tobytes(), name


def test_prepared_weight_input_errors() -> None:
    w = np.ones((4, 2), np.float32)
    q, s = np.empty((4, 2), np.int8), np.empty(2, np.float32)
    with pytest.raises(ValueError, match="shapes"):
        kernels.quantize_weight(w, np.empty((2, 4), np.int8), s)
    with pytest.raises(TypeError, match="int8"):
        kernels.quantize_weight(w, np.empty((4, 2), np.float32), s)
    w[1, 1] = np.nan
    with pytest.raises(kernels.NonFiniteError):
        kernels.quantize_weight(w, q, s)
    x = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.int8_matmul_prepared(np.ones((3, 5), np.float32), q, s)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.int8_matmul_prepared(x, q, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="int8"):
        kernels.int8_matmul_prepared(x, q.astype(np.float32), s)
    with pytest.raises(ValueError, match="shape"):
        kernels.int8_matmul_prepared(x, q, s, out=np.empty((2, 3), np.float32))


def test_int8_matmul_input_errors() -> None:
    with pytest.raises(TypeError):
        kernels.int8_matmul(np.ones((2, 2)), np.ones((2, 2), np.float32))
    with pytest.raises(ValueError):
        kernels.int8_matmul(np.ones((2, 3), np.float32), np.ones((2, 2), np.float32))


def test_counters_count_macs_per_backend() -> None:
    before = kernels.counters()
    a = np.ones((3, 5), np.int8)
    b = np.ones((5, 7), np.int8)
    with kernels.use_backend("lut"):
        gemm_int8(a, b)
    kernels.int8_matmul(np.ones((2, 4), np.float32), np.ones((4, 6), np.float32))
    after = kernels.counters()
    assert after["lut"] - before["lut"] == 3 * 5 * 7
    assert after[kernels.active_backend()] - before[kernels.active_backend()] == 2 * 4 * 6


def test_probe_hash_pinned() -> None:
    want = ("6059dffa2a7779f6446ff7aa9dc02d64d40444ba29a5d38ada5b03b23874b9f3"
            "bd8e9a503b7d546d0c1f405d95ed5b9e1d5b67ad662ffd841ac92c6c52e22fce")
    for name in BACKENDS:
        with kernels.use_backend(name):
            assert kernels.probe_hash() == want


def _peak_extra(fn: object, *args: object) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn(*args)  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["blas", "blas64", "mirror", "lut"])
def test_memory_bound_512x768x768(name: str) -> None:
    m, k, n = 512, 768, 768
    rng = np.random.default_rng(9)
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-128, 128, (k, n), dtype=np.int8)
    be = dispatch.get_backend(name)
    result = 4 * m * n
    peak = _peak_extra(be.gemm, a, b)
    bound = be.peak_bytes(m, k, n) + result + (64 << 10)
    assert peak <= bound, (peak, bound)
    assert peak < 20 << 20  # MB-scale; an (m, n, k) int32 temporary would be 1.2 GB


@pytest.mark.parametrize("k", [300, 1500])
def test_results_do_not_alias_reused_buffers(k: int) -> None:
    rng = np.random.default_rng(10)
    a1, a2 = (rng.integers(-128, 128, (20, k), dtype=np.int8) for _ in range(2))
    b1, b2 = (rng.integers(-128, 128, (k, 30), dtype=np.int8) for _ in range(2))
    r1 = gemm_int8(a1, b1)
    x1 = rng.standard_normal((20, k)).astype(np.float32)
    w1 = rng.standard_normal((k, 30)).astype(np.float32)
    y1 = kernels.int8_matmul(x1, w1)
    y1_copy = y1.copy()
    gemm_int8(a2, b2)
    kernels.int8_matmul(x1 * 2, w1 + 1)
    assert np.array_equal(r1, ref_gemm(a1, b1))
    assert np.array_equal(y1, y1_copy)


def test_threads_do_not_share_buffers() -> None:
    import threading

    rng = np.random.default_rng(11)
    cases = [(rng.integers(-128, 128, (64, 200), dtype=np.int8),
              rng.integers(-128, 128, (200, 48), dtype=np.int8)) for _ in range(4)]
    errors: list[int] = []

    def work(i: int) -> None:
        a, b = cases[i]
        want = ref_gemm(a, b)
        for _ in range(60):
            if not np.array_equal(gemm_int8(a, b), want):
                errors.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert kernels.demotions() == [] and kernels.active_backend() == "blas"  # gated once


def test_lut_refuses_rows_wider_than_its_buffers() -> None:
    be = LutBackend()
    n = be.MAX_PRODUCTS + 1
    with pytest.raises(ValueError, match="n <="):
        be.gemm(np.ones((1, 1), np.int8), np.ones((1, n), np.int8))


def test_blas_keeps_only_small_workspaces() -> None:
    from kernels.backends import BlasBackend

    be = BlasBackend()
    be.WORK_CAP = 4 * 100 * 100  # bytes
    a = np.ones((100, 100), np.int8)
    assert (be.gemm(a, a) == 100).all()
    kept = {key: buf.size for key, buf in be._ws.bufs.items()}
    assert kept == {"a": 10000, "b": 10000, "c": 10000}
    big = np.ones((101, 100), np.int8)
    assert (be.gemm(big, a) == 100).all()
    assert be._ws.bufs["a"].size == 10000  # the 101x100 operand was not kept
