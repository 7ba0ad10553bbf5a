"""Backend selection (gate at first use, demote on any mismatch), GEMM entry points and
multiply-accumulate counters."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from . import audit
from .backends import FACTORIES, ORDER, Backend
from .errors import check_array, check_k, check_pair
from .gate import gate_failure
from .quantize import quantize_values, scale_inplace

log = logging.getLogger("kernels")

Array = np.ndarray

_instances: dict[str, Backend] = {}
_status: dict[str, bool] = {}
_reason: dict[str, str] = {}
_events: list[dict[str, str]] = []
_forced: str | None = None
_counts: dict[str, int] = {name: 0 for name in ORDER}


def get_backend(name: str) -> Backend:
    """The live instance of backend `name` (created on first use)."""
    if name not in _instances:
        _instances[name] = FACTORIES[name]()
    return _instances[name]


def demote(name: str, reason: str) -> None:
    """Mark `name` unusable for the rest of the process; logged and kept in ``demotions()``."""
    _status[name] = False
    _reason[name] = reason
    _events.append({"backend": name, "reason": reason})
    log.warning("kernels: backend %s demoted: %s", name, reason)


_gate_lock = threading.Lock()


def _gated(name: str) -> bool:
    if name in _status:
        return _status[name]
    with _gate_lock:  # one thread gates; the others wait for its verdict
        if name in _status:
            return _status[name]
        try:
            why = gate_failure(get_backend(name))
        except Exception as e:  # e.g. the lut table failed certification while building
            why = f"could not start: {type(e).__name__}: {e}"
        if why is None:
            _status[name] = True
        else:
            demote(name, f"failed its exact gate: {why}")
    return _status[name]


def active_backend() -> str:
    """Name of the backend GEMMs run on now: the first that passed its gate (starting at
    the forced one, if any) and has not been demoted since."""
    start = ORDER.index(_forced) if _forced else 0
    for name in (*ORDER[start:], "mirror"):
        if _gated(name):
            return name
    raise RuntimeError("no kernel backend passed its gate, not even the integer mirror")


def gate_verdicts() -> list[tuple[str, bool | None]]:
    """[(backend name, verdict)] best first: True passed its gate, False demoted, None not
    gated yet. (Named so, not ``backends``, to leave ``kernels.backends`` the submodule.)"""
    return [(name, _status.get(name)) for name in ORDER]


def backend_status() -> dict[str, dict[str, Any]]:
    return {name: {"ok": _status.get(name), "reason": _reason.get(name)} for name in ORDER}


def demotions() -> list[dict[str, str]]:
    """Every demotion so far (gate or audit), oldest first."""
    return list(_events)


def reset() -> None:
    """Forget gate results and demotions and rebuild backends (tests; counters are kept)."""
    _instances.clear()
    _status.clear()
    _reason.clear()
    _events.clear()


class use_backend:
    """Force a backend (``None`` for automatic); a plain call or a context manager.

    A forced backend is still gated and audited; if it fails, GEMMs fall to the next one.
    """

    def __init__(self, name: str | None) -> None:
        global _forced
        if name is not None and name not in ORDER:
            raise ValueError(f"unknown backend {name!r}; choose from {ORDER}")
        self.prev = _forced
        _forced = name

    def __enter__(self) -> use_backend:
        return self

    def __exit__(self, *exc: object) -> None:
        global _forced
        _forced = self.prev


def counters() -> dict[str, int]:
    """Multiply-accumulates run through each backend since start."""
    return dict(_counts)


_VALUE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _run(a: Array, b: Array, macs: int, values: bool, out: Array | None = None) -> Array:
    while True:
        name = active_backend()
        be = get_backend(name)
        if not values:
            res = be.gemm(a, b)
        elif out is None:
            res = be.gemm_values(a, b)
        else:
            res = be.gemm_values_into(a, b, out)
        _counts[name] += macs
        shape = (a.shape[0], b.shape[1])
        ok_type = res.dtype == np.int32 or (values and res.dtype in _VALUE_DTYPES)
        if res.shape != shape or not ok_type:  # cheap, every call: wrong kind of result
            demote(name, f"returned {res.dtype} {res.shape} for a {shape} GEMM")
            continue
        if name == "mirror" or not audit.config.enabled:
            return res
        why = audit.check(a, b, res)
        if why is None:
            return res
        demote(name, f"audit: {why}")  # then recompute on the next backend


def gemm_int8(a_q: Array, b_q: Array) -> Array:
    """int8 [m,k] x int8 [k,n] -> exact int32 [m,n] on the active backend (audited).

    Any int8 value (-128 included) is allowed; K > 131071 raises AccumulatorBoundError;
    wrong dtypes raise TypeError and wrong shapes ValueError (never a silent cast).
    """
    m, k, n = check_pair(a_q, b_q, np.int8, ("a_q", "b_q"))
    return _run(a_q, b_q, m * k * n, values=False)


def int8_matmul(x: Array, w: Array, out: Array | None = None) -> Array:
    """float32 [m,k] @ [k,n] the way a model layer does it: quantize_rows(x),
    quantize_cols(w), exact int8 GEMM, dequantize; bit-identical to calling those three.

    Fast path: the quantized values stay integer-valued float32 (what sgemm consumes) and,
    for K <= 1024, the exact float32 product is the f32(acc) the epilogue starts from and is
    scaled in place, so no int8 or int32 copy of anything is made. With ``out`` (float32
    [m,n], C-contiguous, sharing no memory with x or w) the result is written there and
    returned: a caller that reuses its buffers allocates nothing per call.
    """
    x = check_array("x", x, np.float32)
    w = check_array("w", w, np.float32)
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"inner dimensions differ: x is {x.shape}, w is {w.shape}")
    qa, sa, bufs = _quantized_x(x, w, out)
    qb, sb = quantize_values(w, 0, "w", out=None if bufs is None else bufs[1])
    return _product(qa, qb, sa, sb, out)


def _quantized_x(x: Array, w: Array, out: Array | None
                 ) -> tuple[Array, Array, tuple[Array, Array] | None]:
    """What every product does first, once the shapes fit: check K and ``out``, take the
    backend's operand buffers (or None) and quantize ``x``'s rows into the first one."""
    (m, k), n = x.shape, w.shape[1]
    check_k(k)
    if out is not None:
        _check_out(out, m, n, x, w)
    bufs = get_backend(active_backend()).operand_buffers(m, k, n)
    qa, sa = quantize_values(x, 1, "x", out=None if bufs is None else bufs[0])
    return qa, sa, bufs


def _product(qa: Array, qb: Array, sa: Array, sb: Array, out: Array | None) -> Array:
    """The exact GEMM of the quantized operands, dequantized (into ``out`` if given)."""
    m, k = qa.shape
    acc = _run(qa, qb, m * k * qb.shape[1], values=True, out=out)
    if out is None:
        # float32 products are fresh arrays owned here; int32/float64 ones round once
        y = acc if acc.dtype == np.float32 else acc.astype(np.float32)
    else:
        y = out
        if acc is not out:  # a backend without an in-place path: f32(acc), rounded once
            np.copyto(out, acc, casting="unsafe")
    return scale_inplace(y, sa, sb)


def quantize_weight(w: Array, q_out: Array, s_out: Array) -> None:
    """``quantize_cols(w)`` into the caller's buffers: int8 ``q_out`` [k,n] and float32
    ``s_out`` [n] (the same bits). A weight used by several ``int8_matmul_prepared``
    calls (two halves of a batch) is then quantized once."""
    w = check_array("w", w, np.float32)
    k, n = w.shape
    check_array("q_out", q_out, np.int8)
    check_array("s_out", s_out, np.float32, ndim=1)
    if q_out.shape != (k, n) or s_out.shape != (n,):
        raise ValueError(f"q_out/s_out must have shapes {(k, n)}/{(n,)}, "
                         f"got {q_out.shape}/{s_out.shape}")
    bufs = get_backend(active_backend()).operand_buffers(1, k, n)
    q, s = quantize_values(w, 0, "w", out=None if bufs is None else bufs[1])
    np.copyto(q_out, q, casting="unsafe")  # integer values in [-127, 127]: exact
    s_out[...] = s


def int8_matmul_prepared(x: Array, q_w: Array, s_w: Array, out: Array | None = None
                         ) -> Array:
    """``int8_matmul(x, w, out)`` for a weight already quantized by ``quantize_weight``
    (int8 ``q_w`` [k,n], float32 scales ``s_w`` [n]): the same bits, the same gated and
    audited GEMM; the weight costs one int8 -> float32 copy instead of a quantization."""
    x = check_array("x", x, np.float32)
    q_w = check_array("q_w", q_w, np.int8)
    s_w = check_array("s_w", s_w, np.float32, ndim=1)
    if x.shape[1] != q_w.shape[0] or s_w.shape != (q_w.shape[1],):
        raise ValueError(f"shapes do not fit: x is {x.shape}, q_w is {q_w.shape}, "
                         f"s_w is {s_w.shape}")
    qa, sa, bufs = _quantized_x(x, q_w, out)
    if bufs is None:
        qb = q_w.astype(np.float32)
    else:
        qb = bufs[1]
        np.copyto(qb, q_w, casting="unsafe")  # int8 -> float32 is exact
    return _product(qa, qb, sa, s_w, out)


def _check_out(out: object, m: int, n: int, x: Array, w: Array) -> None:
    out = check_array("out", out, np.float32)
    if out.shape != (m, n):
        raise ValueError(f"out must have shape {(m, n)}, got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writable")
    if np.shares_memory(out, x) or np.shares_memory(out, w):
        raise ValueError("out must not share memory with x or w")
