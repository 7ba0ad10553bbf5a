"""GPT-style causal language model in numpy.

The parameters live in one flat float32 buffer; ``param_layout`` fixes the order,
names and shapes of the views, so a gradient or a weight hash is one contiguous array::

    wte [vocab, width], wpe [seq, width],
    per block i: h{i}.ln1.g/b [width], h{i}.attn.w_qkv [width, 3 width] (columns q|k|v,
      head h at h*D..(h+1)*D inside each), h{i}.attn.b_qkv, h{i}.attn.w_out [width, width],
      h{i}.attn.b_out, h{i}.ln2.g/b, h{i}.mlp.w_in [width, 4 width], h{i}.mlp.b_in,
      h{i}.mlp.w_out [4 width, width], h{i}.mlp.b_out,
    lnf.g/b [width], head.w [width, vocab]   (no bias, not tied to wte)

Weights are stored input-major: a linear layer is ``y = x @ w + b``.

Modes of ``forward`` / ``loss_and_grad`` / ``loss_only``:

* default: float32; every linear layer's forward runs through ``kernels.int8_matmul``,
  the backward is float32 BLAS with the straight-through estimator (the quantized
  matmul is differentiated as ``x @ w``). Attention scores, softmax, LayerNorm, GELU
  and the loss are plain float32 numpy.
* ``quantized=False``: the same float32 computation with plain matmuls (the path the
  PyTorch reference test compares against).
* ``exact=True``: float64 throughout, no quantization (finite-difference reference).

Replicas stay identical because every peer applies the same averaged gradient bytes,
so the backward may use any float32 BLAS; ``init_params`` is bit-identical everywhere.
The model's own reductions (means, sums, softmax) are numpy's, in a fixed order.

Speed: a call allocates no activation. Every activation, cache and backward scratch
lives in a workspace (``daisyweb.workspace``) kept for the next call with the same config
and batch shape; ``loss_and_grad(..., out=grad)`` also reuses the gradient. Each buffer is
written before it is read in every call, so results do not depend on what a workspace
held. A batch is computed in two fixed halves of rows (``daisyweb.parallel.halves``), on
two cores when ``daisyweb.parallel`` allows it, and the weight gradients over the whole
batch afterwards (see "model" below): the bits depend on the batch size, never on the
core count. A call by halves quantizes every linear weight once for both
(``kernels.quantize_weight``, int8 in the workspace: about one byte per weight) and each
half multiplies through ``kernels.int8_matmul_prepared``: the same bits as quantizing the
weight in each half.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import kernels
from daisyweb import parallel, workspace
from daisyweb.checkpoints.quote import short_repr
from daisyweb.parallel import Rows
from daisyweb.rules import DEFAULTS, MAX_LAYERS, MAX_PARAMS, MODEL_FIELDS, check_model
from daisyweb.workspace import Workspace

__all__ = [
    "ModelConfig",
    "forward",
    "init_params",
    "loss_and_grad",
    "loss_only",
    "param_count",
    "param_layout",
    "views",
]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    width: int = int(DEFAULTS["width"])
    layers: int = int(DEFAULTS["layers"])
    heads: int = int(DEFAULTS["heads"])
    seq: int = int(DEFAULTS["seq"])

    def __post_init__(self) -> None:
        # The shared rules (daisyweb.rules): every dimension a positive integer up to
        # MAX_DIM, width divisible by heads; then the size, before anyone builds the layout
        # (a config from a file or a peer could otherwise name 10**8 layers).
        check_model(self.vocab, self.width, self.layers, self.heads, self.seq)
        _check_size(self)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ModelConfig:
        """The config of a dict read from a file: exactly the five fields, each an int.

        Refusals quote at most a short prefix of what they refuse (the dict may be hostile).
        """
        if not isinstance(d, dict) or set(d) != set(MODEL_FIELDS):
            raise ValueError(f"model config must have {'/'.join(MODEL_FIELDS)}, "
                             f"got {short_repr(d)}")
        for name in MODEL_FIELDS:
            value = d[name]
            # Past 64 bits the shared rules would quote hundreds of digits.
            if type(value) is not int or value.bit_length() > 64:
                raise ValueError(f"model {name} must be a positive integer, "
                                 f"got {short_repr(value)}")
        return cls(**d)


def _layout_total(vocab: int, width: int, layers: int, seq: int) -> int:
    """The parameter count of ``param_layout``, in closed form (no list is built)."""
    per_layer = 12 * width * width + 13 * width  # ln1, qkv, attn out, ln2, mlp in, mlp out
    return 2 * vocab * width + seq * width + layers * per_layer + 2 * width


def _check_size(cfg: ModelConfig) -> None:
    if cfg.layers > MAX_LAYERS:
        raise ValueError(f"model layers must be at most {MAX_LAYERS}, got {cfg.layers}")
    total = _layout_total(cfg.vocab, cfg.width, cfg.layers, cfg.seq)
    if total > MAX_PARAMS:
        raise ValueError(f"model of vocab {cfg.vocab}, width {cfg.width}, layers "
                         f"{cfg.layers}, seq {cfg.seq} has {total:,} parameters, more than "
                         f"the limit of {MAX_PARAMS:,}")


def param_layout(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of every parameter, in buffer order."""
    return [(name, shape) for name, shape, _ in _layout(cfg)]


@functools.lru_cache(maxsize=16)
def _layout(cfg: ModelConfig) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    """(name, shape, offset) of every parameter, built once per config (views() runs
    twice a step)."""
    w, v = cfg.width, cfg.vocab
    out: list[tuple[str, tuple[int, ...]]] = [("wte", (v, w)), ("wpe", (cfg.seq, w))]
    for i in range(cfg.layers):
        p = f"h{i}."
        out += [
            (p + "ln1.g", (w,)), (p + "ln1.b", (w,)),
            (p + "attn.w_qkv", (w, 3 * w)), (p + "attn.b_qkv", (3 * w,)),
            (p + "attn.w_out", (w, w)), (p + "attn.b_out", (w,)),
            (p + "ln2.g", (w,)), (p + "ln2.b", (w,)),
            (p + "mlp.w_in", (w, 4 * w)), (p + "mlp.b_in", (4 * w,)),
            (p + "mlp.w_out", (4 * w, w)), (p + "mlp.b_out", (w,)),
        ]
    out += [("lnf.g", (w,)), ("lnf.b", (w,)), ("head.w", (w, v))]
    offsets, total = [], 0
    for name, shape in out:
        offsets.append((name, shape, total))
        total += math.prod(shape)
    return tuple(offsets)


def param_count(cfg: ModelConfig) -> int:
    name, shape, offset = _layout(cfg)[-1]
    return offset + math.prod(shape)


# --------------------------------------------------------------------------- init

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_INIT_STD = 0.02


def _splitmix64_int(x: int) -> int:
    """splitmix64 finaliser on a Python int (used once, to turn the seed into a key)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _uniform(key: int, start: int, n: int) -> np.ndarray:
    """n floats uniform in (-1, 1) for counters start..start+n-1.

    Integer-only hashing (uint64 arithmetic wraps mod 2**64 the same everywhere), then the
    top 23 bits r become (2r + 1) * 2**-23 - 1: every step is exact in float32, so the
    result does not depend on the CPU, the BLAS or libm.
    """
    idx = np.arange(start, start + n, dtype=np.uint64)
    z = idx * np.uint64(_GOLDEN) + np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    r = (z >> np.uint64(41)).astype(np.float32)  # < 2**23, exact
    u = r * np.float32(2.0) + np.float32(1.0)
    u *= np.float32(2.0**-23)
    u -= np.float32(1.0)
    return u


def _init_std(cfg: ModelConfig, name: str) -> float | None:
    """Standard deviation of a randomly initialised tensor, None for LN/bias tensors."""
    leaf = name.rsplit(".", 1)[-1]
    if name in ("wte", "wpe", "head.w") or leaf in ("w_qkv", "w_in"):
        return _INIT_STD
    if leaf in ("w_out",):  # attention and MLP residual projections (GPT-2 scaling)
        return _INIT_STD / math.sqrt(2.0 * cfg.layers)
    return None


def init_params(cfg: ModelConfig, seed: int) -> np.ndarray:
    """GPT-2 style initial parameters, bit-identical on every machine.

    Weights are uniform with the GPT-2 standard deviation (0.02, residual projections
    scaled by 1/sqrt(2L)), drawn from a splitmix64 hash of (seed, flat index); LayerNorm
    gains are 1, LayerNorm biases and linear biases 0.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    seed = int(seed)
    if not 0 <= seed <= _MASK64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    key = _splitmix64_int(seed)
    flat = np.zeros(param_count(cfg), dtype=np.float32)
    offset = 0
    for name, view in views(cfg, flat).items():
        n = view.size
        std = _init_std(cfg, name)
        if std is not None:
            # uniform(-a, a) has std a/sqrt(3); the binary64 scalar is rounded once.
            u = _uniform(key, offset, n)
            u *= np.float32(std * math.sqrt(3.0))
            view[...] = u.reshape(view.shape)
        elif name.endswith(".g"):
            view[...] = 1.0
        offset += n
    return flat


def views(cfg: ModelConfig, flat: np.ndarray) -> dict[str, np.ndarray]:
    """Named views into ``flat`` (no copies), in ``param_layout`` order."""
    n = param_count(cfg)
    if not isinstance(flat, np.ndarray) or flat.shape != (n,):
        got = flat.shape if isinstance(flat, np.ndarray) else type(flat).__name__
        raise ValueError(f"flat parameters must be a 1-d array of {n} values, got {got}")
    if not flat.flags.c_contiguous:
        raise ValueError("flat parameters must be C-contiguous")
    return {name: flat[offset:offset + math.prod(shape)].reshape(shape)
            for name, shape, offset in _layout(cfg)}


# --------------------------------------------------------------------------- checks

def _check_params(cfg: ModelConfig, params: Any, exact: bool) -> np.ndarray:
    if not isinstance(params, np.ndarray):
        raise TypeError(f"params must be a numpy array, got {type(params).__name__}")
    allowed = (np.float32, np.float64) if exact else (np.float32,)
    if params.dtype not in [np.dtype(t) for t in allowed]:
        raise TypeError(f"params must be float32{' or float64' if exact else ''}, "
                        f"got {params.dtype}")
    n = param_count(cfg)
    if params.shape != (n,):
        raise ValueError(f"params must have shape ({n},) for this config, got {params.shape}")
    if exact:
        return np.ascontiguousarray(params, dtype=np.float64)
    return np.ascontiguousarray(params)


def _check_tokens(cfg: ModelConfig, tokens: Any, name: str, max_len: int) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got {tokens.dtype}")
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ValueError(f"{name} must be 2-d and non-empty, got shape {tokens.shape}")
    if tokens.shape[1] > max_len:
        raise ValueError(f"{name} has length {tokens.shape[1]}, more than {max_len} "
                         f"(model seq {cfg.seq})")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= cfg.vocab:
        raise ValueError(f"{name} holds token ids outside [0, {cfg.vocab}): {lo}..{hi}")
    return tokens.astype(np.intp, copy=False)


# --------------------------------------------------------------------------- pieces

_LN_EPS = 1e-5
_GELU_C = 0.044715
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class _Mode:
    """dtype and linear-layer matmul for one call (float32 int8/float, or float64 exact)."""

    def __init__(self, exact: bool, quantized: bool) -> None:
        self.dt = np.dtype(np.float64 if exact else np.float32)
        self.quantized = quantized and not exact

    def linear(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
               out: np.ndarray, prep: _Prepared | None = None, name: str = ""
               ) -> np.ndarray:
        # The forward of every linear layer is the verified int8 GEMM; the backward
        # treats it as x @ w (straight-through). With ``prep`` the weight ``name`` was
        # quantized once for both halves of the batch (the same bits).
        if self.quantized and prep is not None:
            kernels.int8_matmul_prepared(x, *prep[name], out=out)
        elif self.quantized:
            kernels.int8_matmul(x, w, out=out)
        else:
            np.matmul(x, w, out=out)
        if b is not None:
            out += b
        return out


_Prepared = dict[str, tuple[np.ndarray, np.ndarray]]  # weight name -> (int8 q, scales)


def _linear_names(cfg: ModelConfig) -> list[str]:
    names = ["head.w"]
    for i in range(cfg.layers):
        names += [f"h{i}.{w}" for w in ("attn.w_qkv", "attn.w_out", "mlp.w_in", "mlp.w_out")]
    return names


def _prepare(cfg: ModelConfig, p: dict[str, np.ndarray], mode: _Mode, work: Workspace
             ) -> _Prepared | None:
    """Every linear weight quantized once for a call computed in two halves (each half
    would otherwise quantize every weight again), the weights dealt to two cores by
    size; None when there is nothing to share (one whole batch, or float mode)."""
    if not mode.quantized:
        return None
    prep: _Prepared = {}
    for name in _linear_names(cfg):
        w = p[name]
        prep[name] = (work("wq:" + name, w.shape, dtype=np.int8),
                      work("ws:" + name, (w.shape[1],), dtype=np.float32))
    first, second = parallel.deal((p[name].size, name) for name in prep)

    def run(names: list[str]) -> None:
        for name in names:
            kernels.quantize_weight(p[name], *prep[name])

    parallel.both(lambda: run(first), lambda: run(second))
    return prep


def _row_mean(x: np.ndarray, out: np.ndarray) -> None:
    """out [n, 1] = mean of each row of x: what ``np.mean(x, axis=-1, keepdims=True,
    out=out)`` computes, bit for bit, without its Python wrapper (which holds the GIL
    through a float64 division of the small column: float32 operands divided in
    binary64 and rounded once equal the float32 division, 53 >= 2 * 24 + 2)."""
    np.add.reduce(x, axis=-1, keepdims=True, out=out)
    np.divide(out, out.dtype.type(x.shape[-1]), out=out)


def _layernorm(x: np.ndarray, g: np.ndarray, b: np.ndarray, out: np.ndarray,
               xhat: np.ndarray, rstd: np.ndarray, tmp: np.ndarray) -> None:
    """out = LN(x) * g + b; keeps xhat and rstd [n, 1] for the backward."""
    _row_mean(x, rstd)
    np.subtract(x, rstd, out=xhat)  # xc
    np.multiply(xhat, xhat, out=tmp)
    _row_mean(tmp, rstd)  # var
    rstd += x.dtype.type(_LN_EPS)
    np.sqrt(rstd, out=rstd)
    np.divide(1.0, rstd, out=rstd)
    xhat *= rstd
    np.multiply(xhat, g, out=out)
    out += b


def _layernorm_back(dy: np.ndarray, g: np.ndarray, xhat: np.ndarray, rstd: np.ndarray,
                    dg: np.ndarray, db: np.ndarray, tmp: np.ndarray, col: np.ndarray
                    ) -> np.ndarray:
    """dL/dx into ``dy`` (overwritten); fills dg, db. ``col`` is [n, 1] scratch."""
    np.multiply(dy, xhat, out=tmp)
    np.add.reduce(tmp, axis=0, out=dg)
    np.add.reduce(dy, axis=0, out=db)
    dy *= g  # dxhat
    np.multiply(dy, xhat, out=tmp)
    _row_mean(tmp, col)  # c
    np.multiply(xhat, col, out=tmp)
    _row_mean(dy, col)  # a
    dy -= col
    dy -= tmp
    dy *= rstd
    return dy


def _gelu(u: np.ndarray, out: np.ndarray, t: np.ndarray) -> None:
    """out = GELU(u), tanh approximation; t keeps the tanh term for the backward."""
    f = u.dtype.type
    np.multiply(u, u, out=t)
    t *= f(_GELU_C)
    t += f(1.0)
    t *= u
    t *= f(_SQRT_2_OVER_PI)
    np.tanh(t, out=t)
    np.add(t, f(1.0), out=out)
    out *= u
    out *= f(0.5)


def _gelu_back(da: np.ndarray, u: np.ndarray, t: np.ndarray, s1: np.ndarray,
               s2: np.ndarray, out: np.ndarray) -> np.ndarray:
    """dL/du into ``out`` (may be u: it is read before the last write); s1, s2 scratch."""
    f = u.dtype.type
    # d/du 0.5 u (1 + t) = 0.5 (1 + t) + 0.5 u (1 - t^2) s (1 + 3 c u^2)
    np.multiply(u, u, out=s1)
    s1 *= f(3.0 * _GELU_C)
    s1 += f(1.0)
    s1 *= f(_SQRT_2_OVER_PI)
    s1 *= u
    np.multiply(t, t, out=s2)
    np.subtract(f(1.0), s2, out=s2)
    s1 *= s2
    s1 += t
    s1 += f(1.0)
    s1 *= f(0.5)
    return np.multiply(s1, da, out=out)


# --------------------------------------------------------------------------- model
#
# A call computes its batch in two halves of rows (``parallel.halves``), in parallel when
# two cores are allowed. Every buffer of the workspace is full-batch; a half reads and
# writes only its own rows of it. Row-wise work (forward, loss, the backward's chain of
# dL/dx) runs per half; the weight gradients, which sum over all rows, run afterwards on
# the whole batch (``_weight_grads``), one tensor per GEMM, dealt to two cores by cost
# (``parallel.deal``). LayerNorm gains and biases are the one exception: their column
# sums are taken per half and added, first half first.


def _causal_mask(t: int, dt: np.dtype) -> np.ndarray:
    """The additive causal mask [t, t]: 0 on and below the diagonal, -inf above."""
    bias = np.zeros((t, t), dtype=dt)
    bias[np.triu_indices(t, 1)] = -np.inf
    return bias


def _forward(cfg: ModelConfig, p: dict[str, np.ndarray], tokens: np.ndarray, mode: _Mode,
             work: Workspace, keep: bool, logits: np.ndarray, half: Rows,
             prep: _Prepared | None = None) -> None:
    """Logits of ``half``'s rows into ``logits`` ([half rows * T, vocab]); with ``keep``
    every layer's activations stay in ``work`` for the backward (without, layers share
    one set of buffers)."""
    bsz, t = tokens.shape
    c, h = cfg.width, cfg.heads
    d = c // h
    n = bsz * t
    f = mode.dt.type
    scale = f(1.0 / math.sqrt(d))
    b, r = half.size, half.r
    x = work("x", (n, c))[r]
    np.take(p["wte"], tokens[half.b].reshape(-1), axis=0, out=x, mode="clip")  # ids checked
    x3 = x.reshape(b, t, c)
    x3 += p["wpe"][:t]
    tmp = work("tmp", (n, c))[r]
    col = work("col4", (bsz, h, t, 1))[half.b]
    proj = work("proj", (n, c))[r]
    bias = work.constant("causal", lambda: _causal_mask(t, mode.dt))
    for i in range(cfg.layers):
        q_ = f"h{i}."
        j = i if keep else 0
        h1 = work("h1", (n, c), j)[r]
        xhat1, rstd1 = work("xhat1", (n, c), j)[r], work("rstd1", (n, 1), j)[r]
        _layernorm(x, p[q_ + "ln1.g"], p[q_ + "ln1.b"], h1, xhat1, rstd1, tmp)
        qkv = mode.linear(h1, p[q_ + "attn.w_qkv"], p[q_ + "attn.b_qkv"],
                          work("qkv", (n, 3 * c), j)[r], prep, q_ + "attn.w_qkv")
        # [B, T, 3, H, D] -> three [B, H, T, D] views
        q5 = qkv.reshape(b, t, 3, h, d).transpose(2, 0, 3, 1, 4)
        qs = work("qs", (bsz, h, t, d), j)[half.b]
        np.multiply(q5[0], scale, out=qs)  # scaling q (smaller than the scores): same math
        att = work("att", (bsz, h, t, t), j)[half.b]
        np.matmul(qs, q5[1].transpose(0, 1, 3, 2), out=att)
        att += bias
        np.maximum.reduce(att, axis=-1, keepdims=True, out=col)
        att -= col
        np.exp(att, out=att)
        np.add.reduce(att, axis=-1, keepdims=True, out=col)
        att /= col
        y = work("y", (n, c), j)[r]
        np.matmul(att, q5[2], out=y.reshape(b, t, h, d).transpose(0, 2, 1, 3))
        x += mode.linear(y, p[q_ + "attn.w_out"], p[q_ + "attn.b_out"], proj, prep,
                         q_ + "attn.w_out")
        h2 = work("h2", (n, c), j)[r]
        xhat2, rstd2 = work("xhat2", (n, c), j)[r], work("rstd2", (n, 1), j)[r]
        _layernorm(x, p[q_ + "ln2.g"], p[q_ + "ln2.b"], h2, xhat2, rstd2, tmp)
        u = mode.linear(h2, p[q_ + "mlp.w_in"], p[q_ + "mlp.b_in"],
                        work("u", (n, 4 * c), j)[r], prep, q_ + "mlp.w_in")
        a, tanh_u = work("a", (n, 4 * c), j)[r], work("tanh", (n, 4 * c), j)[r]
        _gelu(u, a, tanh_u)
        x += mode.linear(a, p[q_ + "mlp.w_out"], p[q_ + "mlp.b_out"], proj, prep,
                         q_ + "mlp.w_out")
    hf = work("hf", (n, c))[r]
    _layernorm(x, p["lnf.g"], p["lnf.b"], hf, work("xhatf", (n, c))[r],
               work("rstdf", (n, 1))[r], tmp)
    mode.linear(hf, p["head.w"], None, logits, prep, "head.w")


def _cross_entropy(logits: np.ndarray, targets: np.ndarray, want_grad: bool, total: int,
                   nll: np.ndarray) -> None:
    """Next-token cross-entropy of each row into ``nll``; with want_grad, logits are
    overwritten with dloss/dlogits of the mean over ``total`` rows (the whole batch)."""
    n = logits.shape[0]
    rows = np.arange(n)
    z = logits
    z -= np.maximum.reduce(z, axis=-1, keepdims=True)
    picked = z[rows, targets]  # fancy indexing: a copy
    e = np.exp(z, out=z)
    sums = np.add.reduce(e, axis=-1)
    np.subtract(np.log(sums), picked, out=nll)
    if want_grad:
        e /= sums[:, None]
        e[rows, targets] -= 1.0
        e *= e.dtype.type(1.0 / total)


_SCATTER_RANKS = 64  # past this many repeats of one id, np.add.at itself is faster


def _scatter_rows(g: np.ndarray, index: np.ndarray, rows: np.ndarray) -> None:
    """g[index[i]] += rows[i] for every i in index order (g starts zeroed): what
    ``np.add.at`` computes, bit for bit, about 8x faster.

    The i-th occurrence of every id is added in pass i: within a pass no id repeats, so
    one fancy-indexed add does it, and each row of g still sums its rows in index order.
    """
    order = np.argsort(index, kind="stable")
    ids = index[order]
    first = np.concatenate(([True], ids[1:] != ids[:-1]))
    starts = np.flatnonzero(first)
    rank = np.arange(ids.size) - starts[np.cumsum(first) - 1]
    if rank.max() >= _SCATTER_RANKS:
        np.add.at(g, index, rows)
        return
    ranked = rows[order]
    for k in range(int(rank.max()) + 1):
        sel = rank == k
        g[ids[sel]] += ranked[sel]


def _ln_grads(work: Workspace, g: dict[str, np.ndarray], name: str, k: int, split: bool
              ) -> tuple[np.ndarray, np.ndarray]:
    """Where half ``k`` puts LayerNorm ``name``'s dg and db: the gradient itself for an
    unsplit batch, else this half's partial sums (added by ``_ln_finish``)."""
    dg = g[name + ".g"]
    if not split:
        return dg, g[name + ".b"]
    part = work("ln:" + name, (2, 2, dg.size))
    return part[k, 0], part[k, 1]


def _ln_finish(work: Workspace, g: dict[str, np.ndarray], name: str) -> None:
    part = work("ln:" + name, (2, 2, g[name + ".g"].size))
    np.add(part[0, 0], part[1, 0], out=g[name + ".g"])
    np.add(part[0, 1], part[1, 1], out=g[name + ".b"])


def _ln_names(cfg: ModelConfig) -> list[str]:
    return ["lnf"] + [f"h{i}.ln{j}" for i in range(cfg.layers) for j in (1, 2)]


def _backward_rows(cfg: ModelConfig, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
                   bsz: int, t: int, dlogits: np.ndarray, work: Workspace, half: Rows, k: int,
                   split: bool) -> None:
    """The chain of dL/dx for ``half``'s rows, from its dlogits rows down to the
    embeddings. Keeps what the weight gradients need per layer: dL/d(MLP output) in
    "dxm", dL/du in "u" (u is not needed after the GELU's backward), dL/d(attention
    output) in "dxa", dL/dqkv in "dqkv", dL/d(embedding) in "dxe"."""
    c, h = cfg.width, cfg.heads
    d = c // h
    n = bsz * t
    b, r = half.size, half.r
    scale = dlogits.dtype.type(1.0 / math.sqrt(d))
    tmp, col = work("tmp", (n, c))[r], work("col", (n, 1))[r]
    dx = work("dxm", (n, c), cfg.layers - 1)[r]
    np.matmul(dlogits, p["head.w"].T, out=dx)
    _layernorm_back(dx, p["lnf.g"], work("xhatf", (n, c))[r], work("rstdf", (n, 1))[r],
                    *_ln_grads(work, g, "lnf", k, split), tmp, col)
    dh = work("dh", (n, c))[r]
    da = work("da", (n, 4 * c))[r]
    s1, s2 = work("s1", (n, 4 * c))[r], work("s2", (n, 4 * c))[r]
    datt, tmp4 = work("datt", (bsz, h, t, t))[half.b], work("tmp4", (bsz, h, t, t))[half.b]
    col4 = work("col4", (bsz, h, t, 1))[half.b]
    for i in reversed(range(cfg.layers)):
        q_ = f"h{i}."
        dxm = work("dxm", (n, c), i)[r]
        # MLP
        np.matmul(dxm, p[q_ + "mlp.w_out"].T, out=da)
        u = work("u", (n, 4 * c), i)[r]
        du = _gelu_back(da, u, work("tanh", (n, 4 * c), i)[r], s1, s2, out=u)
        np.matmul(du, p[q_ + "mlp.w_in"].T, out=dh)
        _layernorm_back(dh, p[q_ + "ln2.g"], work("xhat2", (n, c), i)[r],
                        work("rstd2", (n, 1), i)[r], *_ln_grads(work, g, q_ + "ln2", k, split),
                        tmp, col)
        dxa = work("dxa", (n, c), i)[r]
        np.add(dxm, dh, out=dxa)
        # attention
        att = work("att", (bsz, h, t, t), i)[half.b]
        q5 = work("qkv", (n, 3 * c), i)[r].reshape(b, t, 3, h, d).transpose(2, 0, 3, 1, 4)
        dqkv = work("dqkv", (n, 3 * c), i)[r]
        d5 = dqkv.reshape(b, t, 3, h, d).transpose(2, 0, 3, 1, 4)  # three [B, H, T, D]
        np.matmul(dxa, p[q_ + "attn.w_out"].T, out=dh)
        dy = dh.reshape(b, t, h, d).transpose(0, 2, 1, 3)
        np.matmul(dy, q5[2].transpose(0, 1, 3, 2), out=datt)
        np.matmul(att.transpose(0, 1, 3, 2), dy, out=d5[2])
        # softmax backward: ds = att * (datt - sum(datt * att))
        np.multiply(datt, att, out=tmp4)
        np.add.reduce(tmp4, axis=-1, keepdims=True, out=col4)
        datt -= col4
        datt *= att
        np.matmul(datt, q5[1], out=d5[0])
        d5[0] *= scale
        np.matmul(datt.transpose(0, 1, 3, 2), work("qs", (bsz, h, t, d), i)[half.b],
                  out=d5[1])
        np.matmul(dqkv, p[q_ + "attn.w_qkv"].T, out=dh)
        _layernorm_back(dh, p[q_ + "ln1.g"], work("xhat1", (n, c), i)[r],
                        work("rstd1", (n, 1), i)[r], *_ln_grads(work, g, q_ + "ln1", k, split),
                        tmp, col)
        np.add(dxa, dh, out=work("dxm", (n, c), i - 1)[r] if i else work("dxe", (n, c))[r])


def _weight_jobs(cfg: ModelConfig, g: dict[str, np.ndarray], work: Workspace, n: int,
                 dlogits: np.ndarray) -> list[tuple[int, Any]]:
    """(cost, job) for every whole-batch weight and bias gradient."""
    c = cfg.width
    jobs: list[tuple[int, Any]] = []

    def gemm(name: str, a: np.ndarray, b: np.ndarray) -> None:
        # dW = a.T @ b over all rows: one GEMM on one thread, whatever the core count
        jobs.append((a.shape[1] * b.shape[1],
                     lambda: np.matmul(a.T, b, out=g[name])))

    def bias(name: str, b: np.ndarray) -> None:
        jobs.append((0, lambda: np.add.reduce(b, axis=0, out=g[name])))

    gemm("head.w", work("hf", (n, c)), dlogits)
    for i in range(cfg.layers):
        q_ = f"h{i}."
        dxm, du = work("dxm", (n, c), i), work("u", (n, 4 * c), i)
        dxa, dqkv = work("dxa", (n, c), i), work("dqkv", (n, 3 * c), i)
        gemm(q_ + "mlp.w_out", work("a", (n, 4 * c), i), dxm)
        bias(q_ + "mlp.b_out", dxm)
        gemm(q_ + "mlp.w_in", work("h2", (n, c), i), du)
        bias(q_ + "mlp.b_in", du)
        gemm(q_ + "attn.w_out", work("y", (n, c), i), dxa)
        bias(q_ + "attn.b_out", dxa)
        gemm(q_ + "attn.w_qkv", work("h1", (n, c), i), dqkv)
        bias(q_ + "attn.b_qkv", dqkv)
    return jobs


def _weight_grads(cfg: ModelConfig, g: dict[str, np.ndarray], tokens: np.ndarray,
                  work: Workspace, dlogits: np.ndarray, split: bool) -> None:
    """Every gradient that sums over all rows, from what ``_backward_rows`` kept: the
    jobs are dealt to two lists of about equal cost (one per core)."""
    bsz, t = tokens.shape
    n = bsz * t
    first, second = parallel.deal(_weight_jobs(cfg, g, work, n, dlogits))

    def embeddings() -> None:
        dxe = work("dxe", (n, cfg.width))
        np.sum(dxe.reshape(bsz, t, cfg.width), axis=0, out=g["wpe"][:t])
        g["wpe"][t:] = 0
        g["wte"][...] = 0
        _scatter_rows(g["wte"], tokens.reshape(-1), dxe)
        if split:
            for name in _ln_names(cfg):
                _ln_finish(work, g, name)

    second.append(embeddings)
    parallel.both(lambda: [job() for job in first], lambda: [job() for job in second])


# --------------------------------------------------------------------------- API

def _take(cfg: ModelConfig, tokens: np.ndarray, mode: _Mode, keep: bool) -> Workspace:
    """The workspace of one call: one kind per (config, whether it keeps every layer's
    activations for the backward)."""
    return workspace.take((cfg, keep), tokens.shape, mode.dt)


def _forward_rows(cfg: ModelConfig, p: dict[str, np.ndarray], mode: _Mode, work: Workspace,
                  tokens: np.ndarray, body: Any) -> None:
    """``body(half index, Rows, prepared weights)`` over the whole batch at once where
    :func:`_whole_forward` allows, else by halves (``parallel.in_halves``) sharing the
    weights quantized once (:func:`_prepare`)."""
    bsz, t = tokens.shape
    if _whole_forward(mode):
        body(0, Rows(slice(0, bsz), t), None)
        return
    prep = _prepare(cfg, p, mode, work) if len(parallel.halves(bsz)) > 1 else None
    parallel.in_halves(bsz, t, lambda k, half: body(k, half, prep))


def _whole_forward(mode: _Mode) -> bool:
    """On one core, run the forward over the whole batch at once (half the calls): the
    same bits as by halves, because with int8 linear layers every forward operation is
    row by row (exact GEMMs, per-row scales, per-sequence attention GEMMs, row-wise
    LayerNorm and softmax, elementwise GELU). The float path keeps the halves: a float
    GEMM's rounding may depend on how many rows it is given."""
    return mode.quantized and parallel.cores() < 2


def forward(cfg: ModelConfig, params: np.ndarray, tokens: np.ndarray, *,
            exact: bool = False, quantized: bool = True) -> np.ndarray:
    """Logits [B, T, vocab] (float32; float64 with ``exact``) for tokens [B, T], T <= seq."""
    mode = _Mode(exact, quantized)
    flat = _check_params(cfg, params, exact)
    tokens = _check_tokens(cfg, tokens, "tokens", cfg.seq)
    bsz, t = tokens.shape
    logits = np.empty((bsz * t, cfg.vocab), mode.dt)  # the caller's: fresh
    p = views(cfg, flat)
    work = _take(cfg, tokens, mode, False)

    def body(_: int, half: Rows, prep: _Prepared | None) -> None:
        _forward(cfg, p, tokens, mode, work, False, logits[half.r], half, prep)

    try:
        _forward_rows(cfg, p, mode, work, tokens, body)
    finally:
        workspace.give(work)
    return logits.reshape(bsz, t, cfg.vocab)


def _split_batch(cfg: ModelConfig, batch: Any) -> tuple[np.ndarray, np.ndarray]:
    batch = _check_tokens(cfg, batch, "batch", cfg.seq + 1)
    if batch.shape[1] < 2:
        raise ValueError(f"batch must have at least 2 columns (inputs + targets), "
                         f"got shape {batch.shape}")
    return batch[:, :-1], batch[:, 1:].reshape(-1)


def _check_out(out: Any, flat: np.ndarray, dt: np.dtype) -> np.ndarray:
    if not isinstance(out, np.ndarray) or out.dtype != dt or out.shape != flat.shape:
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"out must be a {dt} array of shape {flat.shape}, got {got}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writable")
    if np.shares_memory(out, flat):
        raise ValueError("out must not share memory with params")
    return out


def loss_and_grad(cfg: ModelConfig, params: np.ndarray, batch: np.ndarray, *,
                  exact: bool = False, quantized: bool = True,
                  out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """Mean next-token cross-entropy of batch [B, T+1] and its gradient.

    Inputs are ``batch[:, :-1]``, targets ``batch[:, 1:]``. The gradient has the layout of
    ``params``: float32, or float64 with ``exact`` (float64 reference, no quantization).
    It is a fresh array, or ``out`` (every element overwritten) if given: a training loop
    that hands the same buffer every step allocates nothing per step.
    """
    mode = _Mode(exact, quantized)
    flat = _check_params(cfg, params, exact)
    inputs, targets = _split_batch(cfg, batch)
    grad = np.empty(flat.size, mode.dt) if out is None else _check_out(out, flat, mode.dt)
    p, g = views(cfg, flat), views(cfg, grad)
    bsz, t = inputs.shape
    split = len(parallel.halves(bsz)) > 1
    nll = np.empty(targets.size, mode.dt)
    work = _take(cfg, inputs, mode, True)
    try:
        logits = work("logits", (targets.size, cfg.vocab))

        def forward_rows(half: Rows, prep: _Prepared | None) -> None:
            lg = logits[half.r]
            _forward(cfg, p, inputs, mode, work, True, lg, half, prep)
            _cross_entropy(lg, targets[half.r], True, targets.size, nll[half.r])

        whole = _whole_forward(mode)
        prep = None
        if whole:
            forward_rows(Rows(slice(0, bsz), t), None)
        elif split:
            prep = _prepare(cfg, p, mode, work)

        def body(k: int, half: Rows) -> None:
            if not whole:
                forward_rows(half, prep)
            _backward_rows(cfg, p, g, bsz, t, logits[half.r], work, half, k, split)

        parallel.in_halves(bsz, t, body)
        _weight_grads(cfg, g, inputs, work, logits, split)
    finally:
        workspace.give(work)
    return float(np.mean(nll, dtype=np.float64)), grad


def loss_only(cfg: ModelConfig, params: np.ndarray, batch: np.ndarray, *,
              exact: bool = False, quantized: bool = True) -> float:
    """Mean next-token cross-entropy of batch [B, T+1], forward only (evaluation)."""
    mode = _Mode(exact, quantized)
    flat = _check_params(cfg, params, exact)
    inputs, targets = _split_batch(cfg, batch)
    p = views(cfg, flat)
    bsz, t = inputs.shape
    nll = np.empty(targets.size, mode.dt)
    work = _take(cfg, inputs, mode, False)
    try:
        logits = work("logits", (targets.size, cfg.vocab))

        def body(_: int, half: Rows, prep: _Prepared | None) -> None:
            lg = logits[half.r]
            _forward(cfg, p, inputs, mode, work, False, lg, half, prep)
            _cross_entropy(lg, targets[half.r], False, targets.size, nll[half.r])

        _forward_rows(cfg, p, mode, work, inputs, body)
    finally:
        workspace.give(work)
    return float(np.mean(nll, dtype=np.float64))
