"""Exact start-up gate: a backend runs only after matching the integer reference bit for bit
on a sweep built to hit the places fast kernels break.

The sweep: 1x1x1 and other degenerate shapes; ragged sizes (nothing a multiple of a tile);
K at and around every block edge (the backend's own and the common 1024/2048 float32
edges); m around the backend's row-block edges; all-extreme operands (+127/-128, including
sums that land exactly on 2**24 and odd sums just past it, which only an exact block
boundary survives); and every case twice with fresh data of the same shape, each call
preceded by poisoning the backend's reused buffers, so a kernel that assumes zeroed memory
or returns a stale result fails deterministically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from .backends import Backend

Array = np.ndarray
Gemm = Callable[[Array, Array], Array]

#: float32 exactness edges every backend is probed at (2**24 / 2**14 = 1024 products)
COMMON_K_EDGES = (1024, 2048)
_SHAPES = [(1, 1, 1), (1, 1, 7), (7, 1, 1), (1, 7, 1), (2, 3, 2), (3, 5, 7), (17, 33, 9),
           (31, 64, 29), (5, 130, 67), (65, 9, 3)]


def _edge_pattern(e: int) -> Array:
    """e copies of -128 then one 127: with itself, the dot is e * 2**14 + 16129 (odd)."""
    v = np.full(e + 1, -128, np.int8)
    v[-1] = 127
    return v


def gate_cases(backend: Backend | None = None) -> Iterator[tuple[Array, Array]]:
    rng = np.random.default_rng(0x6A7E)
    k_edges = sorted(set(COMMON_K_EDGES) | set(backend.k_edges if backend else ()))
    m_edges = sorted(set(backend.m_edges if backend else ()))

    def rand(m: int, k: int, n: int) -> tuple[Array, Array]:
        return (rng.integers(-128, 128, (m, k), dtype=np.int8),
                rng.integers(-128, 128, (k, n), dtype=np.int8))

    shapes = list(_SHAPES)
    shapes += [(3, k, 5) for e in k_edges for k in (e - 1, e, e + 1)]
    shapes += [(m, 3, 2) for e in m_edges for m in (e - 1, e, e + 1)]
    for m, k, n in shapes:
        yield rand(m, k, n)
        yield rand(m, k, n)  # same shape, fresh data: catches results cached by shape
    # all-extreme operands
    lo = np.int8(-128)
    yield np.full((2, 1024), lo, np.int8), np.full((1024, 3), lo, np.int8)  # exactly 2**24
    yield np.full((2, 1030), lo, np.int8), np.full((1030, 3), 127, np.int8)
    yield np.full((3, 1101), 127, np.int8), np.full((1101, 2), 127, np.int8)  # odd, > 2**24
    yield np.full((1, 1), lo, np.int8), np.full((1, 1), lo, np.int8)
    for e in k_edges:
        v = _edge_pattern(e)
        a = np.stack([v, v[::-1]])
        yield a, np.ascontiguousarray(a.T[:, [0, 1, 0]])
    sign = rng.integers(0, 2, (5, 2049)).astype(bool)
    a = np.where(sign, np.int8(127), lo).astype(np.int8)
    sign = rng.integers(0, 2, (2049, 4)).astype(bool)
    yield a, np.where(sign, lo, np.int8(127)).astype(np.int8)


def _mismatch(got: object, ref: Array, want_int32: bool) -> str | None:
    if not isinstance(got, np.ndarray):
        return f"returned {type(got).__name__}, not an ndarray"
    if got.shape != ref.shape:
        return f"returned shape {got.shape}, expected {ref.shape}"
    if want_int32 and got.dtype != np.int32:
        return f"returned dtype {got.dtype}, expected int32"
    if not want_int32 and got.dtype not in (np.int32, np.float32, np.float64):
        return f"returned dtype {got.dtype} from the float path"
    bad = np.argwhere(got != ref)
    if len(bad):
        i, j = bad[0]
        return f"{len(bad)} wrong cell(s), first ({i},{j}): got {got[i, j]}, want {ref[i, j]}"
    return None


def _into(backend: Backend) -> Gemm:
    """``gemm_values_into`` on a NaN-filled output: a result that leaves a cell unwritten,
    or reads the output before writing it, fails the comparison."""

    def call(a: Array, b: Array) -> Array:
        out = np.full((a.shape[0], b.shape[1]), np.nan, np.float32)
        return backend.gemm_values_into(a, b, out)

    return call


def gate_failure(impl: Backend | Gemm) -> str | None:
    """Run the sweep; None if every result is exact, else a description of the first miss.

    A ``Backend`` is checked on every entry point (int8 ``gemm``, and the float32
    ``gemm_values`` and ``gemm_values_into`` that ``int8_matmul`` uses) with its buffers
    poisoned before each call;
    a bare callable ``(a, b) -> int32`` is checked as ``gemm``.
    """
    backend = impl if isinstance(impl, Backend) else None
    for a, b in gate_cases(backend):
        ref = a.astype(np.int64) @ b.astype(np.int64)
        shape = f"{a.shape[0]}x{a.shape[1]}x{b.shape[1]}"
        calls: list[tuple[str, Gemm, Array, Array, bool]] = []
        if backend is None:
            calls.append(("gemm", impl, a, b, True))  # type: ignore[arg-type]
        else:
            calls.append(("gemm", backend.gemm, a, b, True))
            calls.append(("gemm_values", backend.gemm_values,
                          a.astype(np.float32), b.astype(np.float32), False))
            calls.append(("gemm_values_into", _into(backend),
                          a.astype(np.float32), b.astype(np.float32), False))
        for label, fn, x, y, want_int32 in calls:
            if backend is not None:
                backend.poison()
            try:
                got = fn(x, y)
            except Exception as e:  # a crash is a failed gate, not a crashed program
                return f"{label} {shape}: raised {type(e).__name__}: {e}"
            why = _mismatch(got, ref, want_int32)
            if why:
                return f"{label} {shape}: {why}"
    return None


def run_gate(impl: Backend | Gemm) -> bool:
    """True iff `impl` is exact on the whole gate sweep."""
    return gate_failure(impl) is None
