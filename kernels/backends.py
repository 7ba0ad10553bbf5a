"""The GEMM backends, best first: ``blas``, ``blas64``, ``mirror``, ``lut``.

Every backend takes int8 [m,k] x int8 [k,n] (already validated) and returns the exact int32
product. ``gemm_values`` is the same product on integer-valued float32 operands (what
``int8_matmul`` produces), returned as any integer-valued array; only ``blas`` has a real
fast path there. Whether a backend may run at all is decided by ``kernels.gate``.

Extra memory per call (beyond inputs and the int32 result), the bound ``peak_bytes`` states
and the tests check with tracemalloc. No backend materialises an (m, n, k) temporary.
"""

from __future__ import annotations

import threading

import numpy as np

Array = np.ndarray


class Backend:
    """Interface and defaults. Subclasses override ``gemm`` (and maybe the rest)."""

    name = "?"
    #: K values where the backend's blocking changes; the gate probes K-1, K, K+1 at each.
    k_edges: tuple[int, ...] = ()
    #: m values where row blocking changes; the gate probes them the same way.
    m_edges: tuple[int, ...] = ()

    def gemm(self, a: Array, b: Array) -> Array:
        raise NotImplementedError

    def gemm_values(self, a: Array, b: Array) -> Array:
        """Exact product of integer-valued float32 operands in [-128, 127]."""
        return self.gemm(a.astype(np.int8), b.astype(np.int8))

    def gemm_values_into(self, a: Array, b: Array, out: Array) -> Array:
        """``gemm_values`` written into ``out`` (float32 [m,n]) if the backend can; it
        returns ``out`` then, or else any array ``gemm_values`` may return."""
        return self.gemm_values(a, b)

    def poison(self) -> None:
        """Fill every buffer reused across calls with garbage (the gate's dirty-pool test)."""

    def operand_buffers(self, m: int, k: int, n: int) -> tuple[Array, Array] | None:
        """Reusable float32 [m,k], [k,n] buffers ``gemm_values`` may be fed in, or None."""
        return None

    def peak_bytes(self, m: int, k: int, n: int) -> int:
        raise NotImplementedError


K_BLOCK_F32 = 1024  # float32 block: 1024 * 2**14 = 2**24, the last exact integer run


class _Workspaces(threading.local):
    """Per-thread reusable float32 buffers (the pool the gate poisons)."""

    def __init__(self) -> None:
        self.bufs: dict[str, Array] = {}


class BlasBackend(Backend):
    """int8 values carried as float32 through numpy matmul (OpenBLAS sgemm), K-blocked.

    Exactness: whatever order, blocking or FMA use the BLAS kernel picks, each partial sum
    it forms is a sum of a subset of the K products a*b, each |a*b| <= 128*128 = 2**14, so
    its magnitude is <= K * 2**14. With K <= 1024 that is <= 2**24, and every integer of
    magnitude <= 2**24 is a float32, so every rounding step is exact and so is the result.
    K = 1024 with all -128 reaches exactly 2**24 (the edge; the gate tests it, and
    K = 1025 with one odd product beyond, which a 1025-wide block would round).
    For K > 1024, blocks of 1024 are multiplied separately and summed in int32, which is
    exact because K <= K_MAX keeps the total below 2**31.

    Speed: the float32 operands live in per-thread buffers reused across calls. sgemm on
    freshly allocated operands runs 2.5x slower at 256^3 (fresh pages / cold packing),
    and reuse also skips the allocation. ``operand_buffers`` lets ``int8_matmul`` quantize
    straight into them, so it never makes an int8 or a second float32 copy.

    Memory: buffers of 4(mk + kn) bytes for the operands and 4mn for the product (kept
    between calls while each is <= WORK_CAP), plus the int32 result; for K > 1024 another
    4mn int32 block temp.
    """

    name = "blas"
    K_BLOCK = K_BLOCK_F32
    k_edges = (1024, 2048)
    WORK_CAP = 64 << 20

    def __init__(self) -> None:
        self._ws = _Workspaces()

    def _buf(self, key: str, shape: tuple[int, int]) -> Array:
        bufs = self._ws.bufs
        size = shape[0] * shape[1]
        buf = bufs.get(key)
        if buf is None or buf.size < size:
            buf = np.empty(size, np.float32)
            if buf.nbytes > self.WORK_CAP:
                return buf.reshape(shape)
            bufs[key] = buf
        return buf[:size].reshape(shape)

    def poison(self) -> None:
        # only the calling thread's pool: that is the one its next GEMM reuses, and other
        # threads may be mid-GEMM in theirs
        for buf in self._ws.bufs.values():
            buf.fill(np.nan)

    def operand_buffers(self, m: int, k: int, n: int) -> tuple[Array, Array]:
        return self._buf("a", (m, k)), self._buf("b", (k, n))

    def product(self, af: Array, bf: Array, fresh: bool, out: Array | None = None) -> Array:
        """Exact product of integer-valued float32 operands: float32 if K <= 1024, else int32.

        `fresh`: the float32 result must be a new array (the caller keeps it); otherwise it
        may live in a workspace buffer valid until the next call. `out`: the caller's float32
        [m,n] array the K <= 1024 product is written to.
        """
        m, k = af.shape
        n = bf.shape[1]
        kb = self.K_BLOCK
        if k <= kb:
            if out is not None:
                return np.matmul(af, bf, out=out)
            return np.matmul(af, bf) if fresh else np.matmul(af, bf, out=self._buf("c", (m, n)))
        work = self._buf("c", (m, n))
        np.matmul(af[:, :kb], bf[:kb], out=work)
        acc = work.astype(np.int32)
        for j in range(kb, k, kb):
            np.matmul(af[:, j : j + kb], bf[j : j + kb], out=work)
            acc += work.astype(np.int32)
        return acc

    def gemm(self, a: Array, b: Array) -> Array:
        af, bf = self.operand_buffers(a.shape[0], a.shape[1], b.shape[1])
        np.copyto(af, a, casting="unsafe")  # int8 -> float32 is exact
        np.copyto(bf, b, casting="unsafe")
        r = self.product(af, bf, fresh=False)
        return r if r.dtype == np.int32 else r.astype(np.int32)

    def gemm_values(self, a: Array, b: Array) -> Array:
        return self.product(a, b, fresh=True)

    def gemm_values_into(self, a: Array, b: Array, out: Array) -> Array:
        return self.product(a, b, fresh=False, out=out)

    def peak_bytes(self, m: int, k: int, n: int) -> int:
        extra = 4 * m * n if k > self.K_BLOCK else 0
        return 4 * (m * k + k * n) + 4 * m * n + extra


class Blas64Backend(Backend):
    """float64 matmul (dgemm): every partial sum is an integer below 2**31 < 2**53, so one
    unblocked call is exact for every K <= K_MAX. About half the speed of ``blas``.

    Memory: 8(mk + kn + mn) bytes of float64 operands and product.
    """

    name = "blas64"

    def gemm(self, a: Array, b: Array) -> Array:
        return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.int32)

    def gemm_values(self, a: Array, b: Array) -> Array:
        return np.matmul(a.astype(np.float64), b.astype(np.float64))

    def peak_bytes(self, m: int, k: int, n: int) -> int:
        return 8 * (m * k + k * n + m * n)


class MirrorBackend(Backend):
    """Plain integer arithmetic (int64 numpy matmul, no BLAS): the definition of correct.

    Rows are processed in blocks of M_BLOCK so memory is 8kn + 8*M_BLOCK*(k + n) bytes.
    """

    name = "mirror"
    M_BLOCK = 256
    m_edges = (256,)

    def gemm(self, a: Array, b: Array) -> Array:
        m = a.shape[0]
        b64 = b.astype(np.int64)
        out = np.empty((m, b.shape[1]), np.int32)
        for i in range(0, m, self.M_BLOCK):
            out[i : i + self.M_BLOCK] = a[i : i + self.M_BLOCK].astype(np.int64) @ b64
        return out

    def peak_bytes(self, m: int, k: int, n: int) -> int:
        mb = min(m, self.M_BLOCK)
        return 8 * k * n + 8 * mb * (k + n)


def mirror_cells(a: Array, b: Array, rows: Array, cols: Array) -> Array:
    """Exact int64 dot of row rows[i] of a with column cols[i] of b, for each i.

    Works on int8 or integer-valued float operands; this is what the audit trusts.
    """
    ar = a.take(rows, axis=0).astype(np.int64)
    # int8/float x int64 promotes to int64/float64 inside the multiply: exact either way
    # (|products| <= 2**14, |sums| < 2**31), and one cast call fewer on the hot path
    return np.multiply(ar, b.take(cols, axis=1).T).sum(axis=1)


def build_product_table() -> Array:
    """The 65,536 exact int8 x int8 products, flat, index (a + 128) * 256 + (b + 128).

    Built by repeated addition (a cumulative sum) and certified against integer multiply
    over the whole domain, so a fault in either construction is caught at build time.
    """
    v = np.arange(-128, 128, dtype=np.int32)
    # row i of the cumulative sum is (i + 1) * v; shifting by 129 * v gives (i - 128) * v
    table = np.cumsum(np.broadcast_to(v, (256, 256)), axis=0, dtype=np.int32) - 129 * v
    certify_table(table.reshape(-1))
    return table.reshape(-1)


def certify_table(table: Array) -> None:
    v = np.arange(-128, 128, dtype=np.int64)
    ref = np.multiply.outer(v, v).reshape(-1)
    if table.shape != (65536,) or table.dtype != np.int32 or not np.array_equal(table, ref):
        bad = int(np.count_nonzero(table != ref)) if table.shape == ref.shape else -1
        raise RuntimeError(f"lut product table failed certification ({bad} wrong entries)")


class LutBackend(Backend):
    """Products read from the certified 65,536-entry table, int32 accumulation (the emulated
    GPU unit of the original). Exact: |sum| <= K_MAX * 2**14 < 2**31.

    Works on (mb rows) x (kb of K) x n blocks of at most MAX_PRODUCTS products through two
    buffers the instance keeps and reuses (intp indices, int32 products: 12 * MAX_PRODUCTS
    bytes), so a call's extra memory is only 4(mk + kn) of table indices + 4 * mb * n of
    block sums, whatever the shape.
    """

    name = "lut"
    MAX_PRODUCTS = 1 << 20
    M_BLOCK = 64
    m_edges = (64,)

    def __init__(self) -> None:
        self.table = build_product_table()
        self._idx = np.empty(self.MAX_PRODUCTS, np.intp)  # take() wants intp: no cast copy
        self._prod = np.empty(self.MAX_PRODUCTS, np.int32)

    def poison(self) -> None:
        self._idx.fill(0x7F7F7F7F)
        self._prod.fill(-0x12345679)

    def blocks(self, m: int, k: int, n: int) -> tuple[int, int]:
        mb = max(1, min(m, self.M_BLOCK, self.MAX_PRODUCTS // n))
        kb = max(1, min(k, self.MAX_PRODUCTS // (mb * n)))
        return mb, kb

    def gemm(self, a: Array, b: Array) -> Array:
        m, k = a.shape
        n = b.shape[1]
        if n > self.MAX_PRODUCTS:
            raise ValueError(f"lut backend supports n <= {self.MAX_PRODUCTS}, got {n}")
        ia = a.astype(np.int32)  # in-place index arithmetic: no second (m, k) temporary
        ia += 128
        ia *= 256
        ib = b.astype(np.int32)
        ib += 128
        mb, kb = self.blocks(m, k, n)
        out = np.zeros((m, n), np.int32)
        part = np.empty((mb, n), np.int32)
        for i in range(0, m, mb):
            rows = min(mb, m - i)
            for j in range(0, k, kb):
                cols = min(kb, k - j)
                size = rows * cols * n
                idx = self._idx[:size].reshape(rows, cols, n)
                prod = self._prod[:size].reshape(rows, cols, n)
                np.add(ia[i : i + rows, j : j + cols, None], ib[None, j : j + cols], out=idx)
                np.take(self.table, idx, out=prod, mode="clip")  # in range: no buffer
                np.add.reduce(prod, axis=1, dtype=np.int32, out=part[:rows])
                out[i : i + rows] += part[:rows]
        return out

    def peak_bytes(self, m: int, k: int, n: int) -> int:
        mb, _ = self.blocks(m, k, n)
        return 4 * (m * k + k * n) + 4 * mb * n + 4 * m * n


ORDER = ("blas", "blas64", "mirror", "lut")
FACTORIES: dict[str, type[Backend]] = {
    "blas": BlasBackend,
    "blas64": Blas64Backend,
    "mirror": MirrorBackend,
    "lut": LutBackend,
}
