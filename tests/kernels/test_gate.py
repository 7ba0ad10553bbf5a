"""The gate gated: honest backends pass, each deliberately broken one fails."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import kernels
from kernels import dispatch, gemm_int8, run_gate
from kernels.backends import FACTORIES, Backend, BlasBackend, LutBackend, MirrorBackend
from kernels.gate import gate_cases, gate_failure

Array = np.ndarray


def ref(a: Array, b: Array) -> Array:
    return (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)


def last_row_wrong(a: Array, b: Array) -> Array:
    r = ref(a, b)
    if r.shape[0] % 4:  # tail row tile only: 1x1x1 and tile-aligned shapes look fine
        r[-1] += 1
    return r


def last_col_wrong(a: Array, b: Array) -> Array:
    r = ref(a, b)
    if r.shape[1] % 4:
        r[:, -1] -= 1
    return r


def wrap16(a: Array, b: Array) -> Array:
    return ref(a, b).astype(np.int16).astype(np.int32)  # accumulator wraps past +-32767


def drop_last_block(a: Array, b: Array) -> Array:
    k = a.shape[1]
    kb = 1024
    stop = k if k <= kb else (k - 1) // kb * kb  # off by one: loses the final K block
    return ref(a[:, :stop], b[:stop])


def no_minus_128(a: Array, b: Array) -> Array:
    # assumes symmetric int8 ([-127, 127]); -128 is legal gemm input
    return ref(np.maximum(a, -127), np.maximum(b, -127))


_cache: dict[tuple[int, ...], Array] = {}


def cached_by_shape(a: Array, b: Array) -> Array:
    key = (*a.shape, b.shape[1])
    if key not in _cache:
        _cache[key] = ref(a, b)
    return _cache[key]


class StaleBuffer(Backend):
    """Accumulates into a persistent buffer it assumes is zero: correct from a clean start
    (it re-zeroes what it used), wrong as soon as the pool is dirty."""

    name = "stale"

    def __init__(self) -> None:
        self.buf = np.zeros((64, 64), np.int64)

    def poison(self) -> None:
        self.buf.fill(-7)

    def gemm(self, a: Array, b: Array) -> Array:
        m, n = a.shape[0], b.shape[1]
        if m > 64 or n > 64:
            return ref(a, b)
        view = self.buf[:m, :n]
        view += a.astype(np.int64) @ b.astype(np.int64)
        out = view.astype(np.int32)
        view[...] = 0
        return out

    def gemm_values(self, a: Array, b: Array) -> Array:
        return self.gemm(a.astype(np.int8), b.astype(np.int8))


class WideBlock(BlasBackend):
    K_BLOCK = 1025  # one product too many for float32: rounds past 2**24


class WiderBlock(BlasBackend):
    K_BLOCK = 2048


class FloatPathUnblocked(BlasBackend):
    """int8 entry point right, float32 entry point (int8_matmul's) not blocked at all."""

    def gemm_values(self, a: Array, b: Array) -> Array:
        return np.matmul(a, b)


class IntoUnblocked(BlasBackend):
    """Both entry points right except the in-place one ``int8_matmul(out=)`` takes: not
    K-blocked, so it rounds past 2**24."""

    def gemm_values_into(self, a: Array, b: Array, out: Array) -> Array:
        return np.matmul(a, b, out=out)


class IntoSkipsLastRow(BlasBackend):
    """The in-place entry point leaves the last output row as it found it."""

    def gemm_values_into(self, a: Array, b: Array, out: Array) -> Array:
        if a.shape[0] > 1:
            np.matmul(a[:-1], b, out=out[:-1])
            return out
        return super().gemm_values_into(a, b, out)


class ReturnsInt64(MirrorBackend):
    def gemm(self, a: Array, b: Array) -> Array:
        return a.astype(np.int64) @ b.astype(np.int64)


class Crashes(MirrorBackend):
    def gemm(self, a: Array, b: Array) -> Array:
        if a.shape[1] > 1024:
            raise MemoryError("boom")
        return super().gemm(a, b)


BROKEN = [last_row_wrong, last_col_wrong, wrap16, drop_last_block, no_minus_128,
          cached_by_shape, StaleBuffer(), WideBlock(), WiderBlock(), FloatPathUnblocked(),
          IntoUnblocked(), IntoSkipsLastRow(), ReturnsInt64(), Crashes()]


@pytest.mark.parametrize("impl", BROKEN, ids=lambda f: getattr(f, "__name__", type(f).__name__))
def test_broken_backend_fails_gate(impl: object) -> None:
    why = gate_failure(impl)  # type: ignore[arg-type]
    assert why is not None
    assert not run_gate(impl)  # type: ignore[arg-type]


def test_honest_backends_pass() -> None:
    for name, cls in FACTORIES.items():
        assert gate_failure(cls()) is None, name
    assert run_gate(ref)


def test_poisoning_is_what_catches_the_stale_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StaleBuffer, "poison", lambda self: None)
    assert run_gate(StaleBuffer())  # a clean pool hides the bug ...
    monkeypatch.undo()
    assert not run_gate(StaleBuffer())  # ... the dirty-pool re-sweep exposes it


def test_sweep_covers_the_danger_points() -> None:
    shapes = {(a.shape[0], a.shape[1], b.shape[1]) for a, b in gate_cases(LutBackend())}
    ks = {k for _, k, _ in shapes}
    assert (1, 1, 1) in shapes
    assert {1023, 1024, 1025, 2047, 2048, 2049} <= ks
    assert any(m % 8 and n % 8 and k % 8 for m, k, n in shapes)  # ragged
    extremes = [(a, b) for a, b in gate_cases() if np.isin(a, (-128, 127)).all()]
    assert any((a == -128).all() and a.shape[1] == 1024 for a, _ in extremes)


def test_gate_failure_demotes_logged_and_visible(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(FACTORIES, "blas", WideBlock)
    dispatch.reset()
    rng = np.random.default_rng(1)
    a = rng.integers(-128, 128, (4, 9), dtype=np.int8)
    b = rng.integers(-128, 128, (9, 3), dtype=np.int8)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        got = gemm_int8(a, b)
    assert np.array_equal(got, ref(a, b))
    assert kernels.active_backend() == "blas64"
    assert dict(kernels.gate_verdicts())["blas"] is False
    assert "blas demoted" in caplog.text and "gate" in caplog.text
    assert kernels.demotions()[0]["backend"] == "blas"
    assert "2x1025x3" in kernels.backend_status()["blas"]["reason"]


def test_forced_backend_that_fails_falls_to_next(monkeypatch: pytest.MonkeyPatch) -> None:
    class BadTable(LutBackend):
        def __init__(self) -> None:
            super().__init__()
            self.table = self.table.copy()
            self.table[0] += 1  # -128 * -128 read wrong

    monkeypatch.setitem(FACTORIES, "lut", BadTable)
    dispatch.reset()
    with kernels.use_backend("lut"):
        assert kernels.active_backend() == "mirror"
    assert dict(kernels.gate_verdicts())["lut"] is False


def test_backend_that_cannot_start_is_demoted(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_table() -> None:
        raise RuntimeError("lut product table failed certification (1 wrong entries)")

    monkeypatch.setattr(LutBackend, "__init__", lambda self: broken_table())
    dispatch.reset()
    with kernels.use_backend("lut"):
        assert kernels.active_backend() == "mirror"
    assert "certification" in kernels.backend_status()["lut"]["reason"]


def test_use_backend_rejects_unknown_and_restores() -> None:
    with pytest.raises(ValueError):
        kernels.use_backend("gpu")
    before = kernels.active_backend()
    with kernels.use_backend("mirror"):
        assert kernels.active_backend() == "mirror"
    assert kernels.active_backend() == before


def test_no_backend_at_all_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FACTORIES:
        monkeypatch.setitem(FACTORIES, name, WideBlock if name != "lut" else Crashes)
    monkeypatch.setattr(WideBlock, "gemm", lambda self, a, b: ref(a, b) + 1)
    dispatch.reset()
    with pytest.raises(RuntimeError, match="no kernel backend passed"):
        kernels.active_backend()


@pytest.mark.parametrize("cls", [IntoUnblocked, IntoSkipsLastRow])
def test_broken_in_place_path_is_demoted_and_out_still_exact(
        monkeypatch: pytest.MonkeyPatch, cls: type[BlasBackend]) -> None:
    monkeypatch.setitem(FACTORIES, "blas", cls)
    dispatch.reset()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 1100)).astype(np.float32)
    w = rng.standard_normal((1100, 5)).astype(np.float32)
    qa, sa = kernels.quantize_rows(x)
    qb, sb = kernels.quantize_cols(w)
    want = kernels.dequantize(ref(qa, qb).astype(np.int32), sa, sb)
    out = np.full((6, 5), np.nan, np.float32)
    assert kernels.int8_matmul(x, w, out=out) is out
    assert out.tobytes() == want.tobytes()
    assert dict(kernels.gate_verdicts())["blas"] is False
    assert "gemm_values_into" in kernels.backend_status()["blas"]["reason"]
