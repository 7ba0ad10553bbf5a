from __future__ import annotations

import logging

import numpy as np
import pytest

import kernels
from kernels import audit, dispatch
from kernels.backends import FACTORIES, BlasBackend

Array = np.ndarray


class LastColumnWideBug(BlasBackend):
    """Exact except the last output column of wide (n >= 4096) GEMMs: invisible to the
    start-up gate, whose outputs are narrow."""

    def gemm(self, a: Array, b: Array) -> Array:
        return self._bug(super().gemm(a, b))

    def gemm_values(self, a: Array, b: Array) -> Array:
        return self._bug(super().gemm_values(a, b))

    @staticmethod
    def _bug(r: Array) -> Array:
        if r.shape[1] >= 4096:
            r[:, -1] += 1
        return r


def test_stratified_sample_order() -> None:
    rng = np.random.default_rng(0)
    rows, cols = audit.sample_cells(50, 70, 12, rng)
    cells = list(zip(rows.tolist(), cols.tolist(), strict=True))
    assert set(cells[:4]) == {(0, 0), (0, 69), (49, 0), (49, 69)}
    assert 49 in rows[4:8] and 69 in cols[4:8]  # then the last row and last column
    assert ((rows >= 0) & (rows < 50) & (cols >= 0) & (cols < 70)).all()
    for m, n in ((1, 1), (1, 5), (5, 1)):
        r, c = audit.sample_cells(m, n, 8, rng)
        assert (r < m).all() and (c < n).all()
    r, c = audit.sample_cells(50, 70, 3, rng)
    assert len(r) == 3


def test_last_column_bug_stratified_catches_uniform_misses() -> None:
    rng = np.random.default_rng(1)
    be = LastColumnWideBug()
    budget = audit.DEFAULT_BUDGET
    caught = {True: 0, False: 0}
    for _ in range(50):
        a = rng.integers(-128, 128, (8, 16), dtype=np.int8)
        b = rng.integers(-128, 128, (16, 4096), dtype=np.int8)
        acc = be.gemm(a, b)
        for stratified in (True, False):
            why = audit.check(a, b, acc, budget=budget, stratified=stratified, rng=rng)
            caught[stratified] += why is not None
    assert caught[True] == 50  # every GEMM
    # uniform: P(hit the last column) = 1 - (1 - 1/4096)**8 ~ 0.2% per GEMM
    assert caught[False] <= 3


def test_audit_reports_mismatch_details_and_counts() -> None:
    a = np.ones((3, 4), np.int8)
    b = np.ones((4, 5), np.int8)
    acc = np.full((3, 5), 4, np.int32)
    before = audit.stats()
    assert audit.check(a, b, acc) is None
    acc[2, 4] = 5
    why = audit.check(a, b, acc)
    assert why is not None and "(2,4)" in why and "got 5, mirror 4" in why
    after = audit.stats()
    assert after["gemms"] == before["gemms"] + 2
    assert after["mismatches"] >= before["mismatches"] + 1
    assert after["last_mismatch"] == why
    # a fractional (non-integer) value is a mismatch too
    bad = acc.astype(np.float64)
    bad[2, 4] = 4.5
    assert audit.check(a, b, bad) is not None


def _wide_case() -> tuple[Array, Array]:
    rng = np.random.default_rng(2)
    return (rng.standard_normal((4, 32)).astype(np.float32),
            rng.standard_normal((32, 4096)).astype(np.float32))


def test_live_audit_demotes_and_recomputes(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(FACTORIES, "blas", LastColumnWideBug)
    dispatch.reset()
    assert kernels.active_backend() == "blas"  # the gate cannot see this bug
    x, w = _wide_case()
    qa, sa = kernels.quantize_rows(x)
    qb, sb = kernels.quantize_cols(w)
    want = kernels.dequantize((qa.astype(np.int64) @ qb).astype(np.int32), sa, sb)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        y = kernels.int8_matmul(x, w)
    assert np.array_equal(y, want)  # recomputed on the next backend
    assert kernels.active_backend() == "blas64"
    assert "audit" in kernels.backend_status()["blas"]["reason"]
    assert "blas demoted: audit" in caplog.text
    # int8_matmul_prepared (a weight quantized once) goes through the same audit
    dispatch.reset()
    q, s = np.empty(qb.shape, np.int8), np.empty(sb.shape, np.float32)
    kernels.quantize_weight(w, q, s)
    assert np.array_equal(kernels.int8_matmul_prepared(x, q, s), want)
    assert kernels.active_backend() == "blas64"
    # gemm_int8 goes through the same audited dispatch
    dispatch.reset()
    got = kernels.gemm_int8(qa, qb)
    assert np.array_equal(got, qa.astype(np.int64) @ qb)
    assert kernels.active_backend() == "blas64"


def test_without_the_audit_the_bug_leaks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(FACTORIES, "blas", LastColumnWideBug)
    dispatch.reset()
    audit.configure(enabled=False)
    x, w = _wide_case()
    qa, _ = kernels.quantize_rows(x)
    qb, _ = kernels.quantize_cols(w)
    got = kernels.gemm_int8(qa, qb)
    assert not np.array_equal(got, qa.astype(np.int64) @ qb)
    assert kernels.active_backend() == "blas"


def test_mirror_is_not_audited_against_itself() -> None:
    a = np.ones((2, 2), np.int8)
    n0 = audit.stats()["gemms"]
    with kernels.use_backend("mirror"):
        kernels.gemm_int8(a, a)
    assert audit.stats()["gemms"] == n0
    kernels.gemm_int8(a, a)
    assert audit.stats()["gemms"] == n0 + 1


def test_configure_validates() -> None:
    with pytest.raises(ValueError):
        audit.configure(budget=0)
    cfg = audit.configure(budget=5, stratified=False, seed=3)
    assert cfg.budget == 5 and not cfg.stratified


def test_wrong_kind_of_result_demotes_without_an_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    class WideOnlyInt64(BlasBackend):
        def gemm(self, a: Array, b: Array) -> Array:
            r = super().gemm(a, b)
            return r.astype(np.int64) if r.shape[1] >= 4096 else r

    monkeypatch.setitem(FACTORIES, "blas", WideOnlyInt64)
    dispatch.reset()
    audit.configure(enabled=False)
    a = np.ones((2, 3), np.int8)
    b = np.ones((3, 4096), np.int8)
    got = kernels.gemm_int8(a, b)
    assert got.dtype == np.int32 and (got == 3).all()
    assert kernels.active_backend() == "blas64"
    assert "int64" in kernels.backend_status()["blas"]["reason"]


def test_sampling_plans_stay_bounded() -> None:
    for m in range(1, 400):
        audit.sample_cells(m, 7, 8)
    assert len(audit._plans) <= 257
