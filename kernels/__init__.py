"""Verified exact int8 kernels: every forward GEMM of the model runs through them, and each
result is bit-identical on every machine. No I/O here; demotions are logged via ``logging``.

Modules: ``quantize`` (quantize/dequantize and their exact precision schedule), ``backends``
(blas, blas64, mirror, lut), ``gate`` (the exact start-up sweep), ``audit`` (stratified
sampled-cell checks of live GEMMs), ``dispatch`` (backend choice, demotion, counters, the
GEMM entry points), ``probe`` (the cross-machine probe hash).

    q, s = quantize_rows(x)            # float32 [m,k] -> int8 [m,k], float32 scales [m]
    q, s = quantize_cols(w)            # float32 [k,n] -> int8 [k,n], float32 scales [n]
    acc = gemm_int8(a_q, b_q)          # int8 x int8 -> exact int32
    y = dequantize(acc, s_rows, s_cols)
    y = int8_matmul(x, w)              # the three above, bit-identical, faster
    quantize_weight(w, q, s); y = int8_matmul_prepared(x, q, s)   # w quantized once

Every backend is gated on first use and demoted (logged, ``active_backend()`` moves on) on
a gate failure or a live audit mismatch; see ``kernels.audit`` for how the audit is hooked.
"""

from . import audit
from .backends import K_BLOCK_F32 as K_BLOCK
from .dispatch import (
    active_backend,
    backend_status,
    counters,
    demotions,
    gate_verdicts,
    gemm_int8,
    int8_matmul,
    int8_matmul_prepared,
    quantize_weight,
    use_backend,
)
from .errors import K_MAX, AccumulatorBoundError, NonFiniteError
from .gate import run_gate
from .probe import probe_hash
from .quantize import dequantize, quantize_cols, quantize_rows

__all__ = [
    "K_BLOCK",
    "K_MAX",
    "AccumulatorBoundError",
    "NonFiniteError",
    "active_backend",
    "audit",
    "backend_status",
    "counters",
    "demotions",
    "dequantize",
    "gate_verdicts",
    "gemm_int8",
    "int8_matmul",
    "int8_matmul_prepared",
    "probe_hash",
    "quantize_cols",
    "quantize_rows",
    "quantize_weight",
    "run_gate",
    "use_backend",
]
