import numpy as np
import pytest

import kernels
from kernels import run_gate


@pytest.mark.parametrize("name", ["blas", "mirror", "lut"])
def test_backends_exact(name):
    rng = np.random.default_rng(1)
    a = rng.integers(-128, 128, (7, 1030), dtype=np.int8)
    b = rng.integers(-128, 128, (1030, 5), dtype=np.int8)
    with kernels.use_backend(name):
        got = kernels.gemm_int8(a, b)
    assert np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


def test_probe_hash_pinned():
    with kernels.use_backend("mirror"):
        h = kernels.probe_hash()
    assert h == (
        "6059dffa2a7779f6446ff7aa9dc02d64d40444ba29a5d38ada5b03b23874b9f3"
        "bd8e9a503b7d546d0c1f405d95ed5b9e1d5b67ad662ffd841ac92c6c52e22fce"
    )
    assert kernels.probe_hash() == h


def test_errors():
    with pytest.raises(TypeError):
        kernels.gemm_int8(np.zeros((2, 2), np.int16), np.zeros((2, 2), np.int8))
    with pytest.raises(ValueError):
        kernels.gemm_int8(np.zeros((2, 3), np.int8), np.zeros((2, 2), np.int8))
    with pytest.raises(kernels.AccumulatorBoundError):
        kernels.gemm_int8(np.zeros((1, 131072), np.int8), np.zeros((131072, 1), np.int8))
    x = np.ones((3, 3), np.float32)
    x[0, 0] = np.nan
    x[1, 1] = np.inf
    with pytest.raises(kernels.NonFiniteError, match="2"):
        kernels.quantize_rows(x)


def test_gate_rejects_broken():
    def last_row(a, b):
        r = kernels._mirror(a, b)
        r[-1] += 1
        return r

    def last_col(a, b):
        r = kernels._mirror(a, b)
        r[:, -1] += 1
        return r

    def wrap16(a, b):
        return kernels._mirror(a, b).astype(np.int16).astype(np.int32)

    def drop_block(a, b):
        k = min(a.shape[1], kernels.K_BLOCK)
        return kernels._mirror(a[:, :k], b[:k])

    for fn in (last_row, last_col, wrap16, drop_block):
        assert not run_gate(fn)
    assert run_gate(kernels._blas)


def test_int8_matmul_close():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((32, 8)).astype(np.float32)
    y = kernels.int8_matmul(x, w)
    assert np.abs(y - x @ w).max() < 0.1 * np.abs(x @ w).max()
