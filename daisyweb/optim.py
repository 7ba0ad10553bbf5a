"""DaisyAdam: a bit-reproducible AdamW on one flat float32 parameter buffer.

Every peer must end each step with byte-identical weights and optimizer state, so the
update is written as a fixed sequence of elementwise float32 numpy ufuncs with explicit
``out=`` buffers: no reductions, no ``np.power``/``**``, no fused or BLAS operations whose
rounding could depend on the machine.

Bias corrections come from running products ``beta1_power`` / ``beta2_power``. They are
kept as Python floats (IEEE-754 binary64) and updated by exactly one multiplication per
step (``beta1_power = beta1_power * beta1``), which is deterministic on every platform.
The scalars derived from them (step size, sqrt of the second bias correction) are
computed in binary64 and rounded once to float32 before they touch any array.

Order of operations in :meth:`DaisyAdam.step` (``t`` is the new step number, all arrays
float32, ``s1``/``s2`` scratch buffers)::

    0. validate params and grad (shape, dtype, finite) -- nothing is modified on failure
    1. step += 1; beta1_power *= beta1; beta2_power *= beta2           (binary64)
       step_size = f32(lr / (1 - beta1_power))
       bc2_sqrt  = f32(sqrt(1 - beta2_power))
    2. if weight_decay != 0: params *= f32(1 - lr * weight_decay)     (decoupled decay)
    3. m *= f32(beta1);  s1 = grad * f32(1 - beta1);  m += s1
    4. v *= f32(beta2);  s1 = grad * grad;  s1 *= f32(1 - beta2);  v += s1
    5. s1 = sqrt(v);  s1 /= bc2_sqrt;  s1 += f32(eps)
    6. s2 = m / s1;  s2 *= step_size;  params -= s2

Steps 2-6 run chunk by chunk (``_CHUNK`` elements at a time, scratch of one chunk):
every operation is elementwise, so the bits are those of whole-array passes, while each
array crosses memory once per step instead of once per operation. The chunks form two
fixed ranges that run on two cores when ``daisyweb.parallel`` allows it (same bits).

This matches ``torch.optim.AdamW`` (non-fused, non-foreach semantics) to float tolerance.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from daisyweb import parallel

__all__ = ["AdamConfig", "DaisyAdam", "powers_for", "weight_hash"]

_F32 = np.dtype(np.float32)
# Elements per chunk of the update: the chunk of params, grad, m, v and the two scratch
# buffers (6 x 256 KiB) stays in L2 through all eleven operations, so the arrays cross
# memory once a step instead of once per operation. Elementwise ops give the same bits
# whatever the chunking.
_CHUNK = 1 << 16
_HASH_MAGIC = b"daisyweb-weight-hash-v1\x00"


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


@dataclass(frozen=True)
class AdamConfig:
    """Hyperparameters of DaisyAdam (AdamW with decoupled weight decay)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        lr = _check_real("lr", self.lr)
        b1 = _check_real("beta1", self.beta1)
        b2 = _check_real("beta2", self.beta2)
        eps = _check_real("eps", self.eps)
        wd = _check_real("weight_decay", self.weight_decay)
        if lr <= 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0.0 <= b1 < 1.0:
            raise ValueError(f"beta1 must be in [0, 1), got {b1}")
        if not 0.0 <= b2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {b2}")
        if eps <= 0.0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if wd < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {wd}")
        if lr * wd >= 1.0:
            raise ValueError("lr * weight_decay must be < 1")
        for name, val in (("lr", lr), ("beta1", b1), ("beta2", b2), ("eps", eps),
                          ("weight_decay", wd)):
            object.__setattr__(self, name, val)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def powers_for(config: AdamConfig, step: int) -> tuple[float, float]:
    """Recompute the running products for ``step`` exactly as :meth:`DaisyAdam.step` does."""
    p1 = 1.0
    p2 = 1.0
    for _ in range(step):
        p1 = p1 * config.beta1
        p2 = p2 * config.beta2
    return p1, p2


class _Scalars:
    """The float32 scalars of one step, each from binary64 rounded once."""

    def __init__(self, cfg: AdamConfig, p1: float, p2: float) -> None:
        f32 = np.float32
        self.step_size = f32(cfg.lr / (1.0 - p1))
        self.bc2_sqrt = f32(math.sqrt(1.0 - p2))
        self.decay = f32(1.0 - cfg.lr * cfg.weight_decay)
        self.b1, self.c1 = f32(cfg.beta1), f32(1.0 - cfg.beta1)
        self.b2, self.c2 = f32(cfg.beta2), f32(1.0 - cfg.beta2)
        self.eps = f32(cfg.eps)


class DaisyAdam:
    """AdamW over one flat, C-contiguous float32 buffer of ``size`` elements."""

    def __init__(self, config: AdamConfig, size: int, state: dict[str, Any] | None = None,
                 copy: bool = True) -> None:
        """A fresh optimizer (zero moments, step 0), or with ``state`` one holding it, as
        :meth:`load_state_dict` (``copy`` as there) would leave it: the zero moments are
        then never made, which would hold 8P bytes for nothing while the state is copied."""
        if not isinstance(config, AdamConfig):
            raise TypeError("config must be an AdamConfig")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be a non-negative int, got {size!r}")
        self.config = config
        self.size = size
        empty = state is not None  # moments come from ``state`` below
        self.m = np.zeros(0 if empty else size, dtype=np.float32)
        self.v = np.zeros(0 if empty else size, dtype=np.float32)
        # The step counter is ``step_count`` (``step`` is the update method); it is
        # exported as ``"step"`` by state_dict().
        self.step_count = 0
        self.beta1_power = 1.0  # binary64, = beta1 ** step_count by repeated multiplication
        self.beta2_power = 1.0
        # Scratch for one chunk: the update runs chunk by chunk (see ``step``).
        # (one set per range the buffer is split into for two cores: see ``_ranges``)
        chunk = min(size, _CHUNK)
        self._scratch = [(np.empty(chunk, np.float32), np.empty(chunk, np.float32),
                          np.empty(chunk, np.bool_)) for _ in range(2)]
        if state is not None:
            self.load_state_dict(state, copy=copy)

    def _check_buffer(self, name: str, arr: Any, writable: bool) -> np.ndarray:
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"{name} must be a numpy array, got {type(arr).__name__}")
        if arr.dtype != _F32:
            raise ValueError(f"{name} must be float32, got {arr.dtype}")
        if arr.shape != (self.size,):
            raise ValueError(f"{name} must have shape ({self.size},), got {arr.shape}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        if writable and not arr.flags.writeable:
            raise ValueError(f"{name} must be writable")
        return arr

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        """Apply one AdamW update to ``params`` in place (see module docstring for order)."""
        params = self._check_buffer("params", params, writable=True)
        grad = self._check_buffer("grad", grad, writable=False)
        if np.shares_memory(params, grad):
            raise ValueError("grad must not alias params")
        ranges = self._ranges()
        ok = [True, True]

        def check(k: int) -> None:
            ok[k] = self._finite(grad, *ranges[k], self._scratch[k][2])

        parallel.both(lambda: check(0), lambda: check(1))
        if not all(ok):
            raise ValueError("grad contains NaN or Inf")

        cfg = self.config
        # 1. counters and scalars (binary64, then rounded once to float32)
        step = self.step_count + 1
        p1 = self.beta1_power * cfg.beta1
        p2 = self.beta2_power * cfg.beta2
        scalars = _Scalars(cfg, p1, p2)
        parallel.both(lambda: self._update(params, grad, *ranges[0], scalars, 0),
                      lambda: self._update(params, grad, *ranges[1], scalars, 1))

        self.step_count = step
        self.beta1_power = p1
        self.beta2_power = p2

    def _ranges(self) -> list[tuple[int, int]]:
        """Two ranges of whole chunks (the second may be empty), one per core: the split
        depends on the size alone, and elementwise math gives the same bits either way."""
        mid = min(self.size, -(-self.size // (2 * _CHUNK)) * _CHUNK)
        return [(0, mid), (mid, self.size)]

    @staticmethod
    def _finite(grad: np.ndarray, start: int, stop: int, ok: np.ndarray) -> bool:
        """Every value of grad[start:stop] finite, chunk by chunk into ``ok`` scratch."""
        for lo in range(start, stop, _CHUNK):
            chunk = grad[lo:min(lo + _CHUNK, stop)]
            part = ok[: chunk.size]
            np.isfinite(chunk, out=part)
            if not part.all():
                return False
        return True

    def _update(self, params: np.ndarray, grad: np.ndarray, start: int, stop: int,
                c: _Scalars, k: int) -> None:
        """Steps 2-6 of the module docstring on [start, stop), one chunk at a time."""
        decay = self.config.weight_decay != 0.0
        for lo in range(start, stop, _CHUNK):
            hi = min(lo + _CHUNK, stop)
            p, g = params[lo:hi], grad[lo:hi]
            m, v = self.m[lo:hi], self.v[lo:hi]
            s1, s2 = self._scratch[k][0][: hi - lo], self._scratch[k][1][: hi - lo]
            # 2. decoupled weight decay
            if decay:
                np.multiply(p, c.decay, out=p)
            # 3. first moment
            np.multiply(m, c.b1, out=m)
            np.multiply(g, c.c1, out=s1)
            np.add(m, s1, out=m)
            # 4. second moment
            np.multiply(v, c.b2, out=v)
            np.multiply(g, g, out=s1)
            np.multiply(s1, c.c2, out=s1)
            np.add(v, s1, out=v)
            # 5. denominator
            np.sqrt(v, out=s1)
            np.divide(s1, c.bc2_sqrt, out=s1)
            np.add(s1, c.eps, out=s1)
            # 6. update
            np.divide(m, s1, out=s2)
            np.multiply(s2, c.step_size, out=s2)
            np.subtract(p, s2, out=p)

    # ------------------------------------------------------------------ state
    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """A copy of the full optimizer state (arrays copied, floats binary64).

        ``copy=False`` hands out the live ``m`` and ``v`` instead (no 8P bytes copied): for
        an optimizer that is done stepping, or a caller that only reads them before the
        next step.
        """
        m, v = (self.m.copy(), self.v.copy()) if copy else (self.m, self.v)
        return {
            "config": self.config.to_dict(),
            "size": self.size,
            "step": self.step_count,
            "beta1_power": float(self.beta1_power),
            "beta2_power": float(self.beta2_power),
            "m": m,
            "v": v,
        }

    def load_state_dict(self, state: dict[str, Any], copy: bool = True) -> None:
        """Validate ``state`` completely, then replace the current state (all or nothing).

        ``copy=False`` adopts contiguous, writable ``m`` and ``v`` arrays as they are (no
        copy): the caller hands them over and must not use them elsewhere while this
        optimizer steps.
        """
        if not isinstance(state, dict):
            raise ValueError("state must be a dict")
        expected = {"config", "size", "step", "beta1_power", "beta2_power", "m", "v"}
        if set(state) != expected:
            raise ValueError(f"state keys must be {sorted(expected)}, got {sorted(state)}")
        cfg = state["config"]
        if not isinstance(cfg, dict):
            raise ValueError("state['config'] must be a dict")
        try:
            loaded_cfg = AdamConfig(**cfg)
        except TypeError as exc:
            raise ValueError(f"bad config: {exc}") from None
        if loaded_cfg != self.config:
            raise ValueError(f"config mismatch: {loaded_cfg} != {self.config}")
        if state["size"] != self.size or isinstance(state["size"], bool):
            raise ValueError(f"size mismatch: {state['size']!r} != {self.size}")
        step = state["step"]
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
            raise ValueError("step must be an int")
        step = int(step)
        if step < 0:
            raise ValueError("step must be >= 0")
        p1, p2 = state["beta1_power"], state["beta2_power"]
        for name, val in (("beta1_power", p1), ("beta2_power", p2)):
            if isinstance(val, bool) or not isinstance(val, (float, int, np.floating)):
                raise ValueError(f"{name} must be a float")
        e1, e2 = powers_for(self.config, step)
        if float(p1) != e1 or float(p2) != e2:
            raise ValueError("beta powers are inconsistent with step")
        arrays = {}
        for name in ("m", "v"):
            arr = state[name]
            if not isinstance(arr, np.ndarray) or arr.dtype != _F32:
                raise ValueError(f"{name} must be a float32 numpy array")
            if arr.shape != (self.size,):
                raise ValueError(f"{name} must have shape ({self.size},), got {arr.shape}")
            if not np.isfinite(arr).all():
                raise ValueError(f"{name} contains NaN or Inf")
            arr = np.ascontiguousarray(arr)
            # A read-only array is copied all the same: step() updates m and v in place.
            arrays[name] = arr.copy() if copy or not arr.flags.writeable else arr
        if (arrays["v"] < 0).any():
            raise ValueError("v must be non-negative")
        self.m = arrays["m"]
        self.v = arrays["v"]
        self.step_count = step
        self.beta1_power = e1
        self.beta2_power = e2


def le_f32_bytes(arr: np.ndarray) -> memoryview:
    """The little-endian float32 bytes of ``arr`` for hashing: a view of the array itself
    when it already is contiguous ``<f4`` (no 4P-byte copy, as ``tobytes`` would make), else of
    a converted copy. The same bytes either way."""
    return memoryview(np.ascontiguousarray(arr, dtype="<f4")).cast("B")


def weight_hash(params: np.ndarray, optimizer: DaisyAdam) -> str:
    """blake2b-256 hex digest over the weights and the full optimizer state.

    Fixed order, little-endian: magic, size (u64), params (f32), m (f32), v (f32),
    step (u64), beta1_power (f64), beta2_power (f64).
    """
    if not isinstance(params, np.ndarray) or params.dtype != _F32:
        raise ValueError("params must be a float32 numpy array")
    if params.shape != (optimizer.size,):
        raise ValueError(f"params must have shape ({optimizer.size},)")
    h = hashlib.blake2b(digest_size=32)
    h.update(_HASH_MAGIC)
    h.update(struct.pack("<Q", optimizer.size))
    for arr in (params, optimizer.m, optimizer.v):
        h.update(le_f32_bytes(arr))
    h.update(struct.pack("<Qdd", optimizer.step_count, optimizer.beta1_power,
                         optimizer.beta2_power))
    return h.hexdigest()
