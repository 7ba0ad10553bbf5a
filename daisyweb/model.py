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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import kernels
from daisyweb.checkpoints.quote import short_repr
from daisyweb.rules import DEFAULTS, MAX_LAYERS, MAX_PARAMS, MODEL_FIELDS, check_model

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
    return out


def param_count(cfg: ModelConfig) -> int:
    total = 0
    for _, shape in param_layout(cfg):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


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
    out: dict[str, np.ndarray] = {}
    offset = 0
    for name, shape in param_layout(cfg):
        size = math.prod(shape)
        out[name] = flat[offset:offset + size].reshape(shape)
        offset += size
    return out


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

    def linear(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        # The forward of every linear layer is the verified int8 GEMM; the backward
        # treats it as x @ w (straight-through).
        y = kernels.int8_matmul(x, w) if self.quantized else x @ w
        if b is not None:
            y += b
        return y


def _layernorm(x: np.ndarray, g: np.ndarray, b: np.ndarray
               ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + x.dtype.type(_LN_EPS))
    xhat = xc * rstd
    return xhat * g + b, (xhat, rstd)


def _layernorm_back(dy: np.ndarray, g: np.ndarray, cache: tuple[np.ndarray, np.ndarray],
                    dg: np.ndarray, db: np.ndarray) -> np.ndarray:
    xhat, rstd = cache
    dg[...] = np.sum(dy * xhat, axis=0)
    db[...] = np.sum(dy, axis=0)
    dxhat = dy * g
    a = dxhat.mean(axis=-1, keepdims=True)
    c = np.mean(dxhat * xhat, axis=-1, keepdims=True)
    dxhat -= a
    dxhat -= xhat * c
    dxhat *= rstd
    return dxhat


def _gelu(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GELU, tanh approximation; returns (gelu(u), tanh term) for the backward."""
    f = u.dtype.type
    inner = u * u
    inner *= f(_GELU_C)
    inner += f(1.0)
    inner *= u
    inner *= f(_SQRT_2_OVER_PI)
    t = np.tanh(inner, out=inner)
    a = t + f(1.0)
    a *= u
    a *= f(0.5)
    return a, t


def _gelu_back(da: np.ndarray, u: np.ndarray, t: np.ndarray) -> np.ndarray:
    f = u.dtype.type
    # d/du 0.5 u (1 + t) = 0.5 (1 + t) + 0.5 u (1 - t^2) s (1 + 3 c u^2)
    du = u * u
    du *= f(3.0 * _GELU_C)
    du += f(1.0)
    du *= f(_SQRT_2_OVER_PI)
    du *= u
    du *= f(1.0) - t * t
    du += t
    du += f(1.0)
    du *= f(0.5)
    du *= da
    return du


def _causal_bias(t: int, dt: np.dtype) -> np.ndarray:
    bias = np.zeros((t, t), dtype=dt)
    bias[np.triu_indices(t, 1)] = -np.inf
    return bias


# --------------------------------------------------------------------------- model

def _forward(cfg: ModelConfig, p: dict[str, np.ndarray], tokens: np.ndarray, mode: _Mode,
             keep: bool) -> tuple[np.ndarray, list[Any]]:
    """Logits [B*T, vocab] and (if keep) the activations the backward needs."""
    bsz, t = tokens.shape
    c, h = cfg.width, cfg.heads
    d = c // h
    n = bsz * t
    f = mode.dt.type
    scale = f(1.0 / math.sqrt(d))
    bias = _causal_bias(t, mode.dt)
    x = (p["wte"][tokens] + p["wpe"][:t]).reshape(n, c)
    caches: list[Any] = []
    for i in range(cfg.layers):
        q_ = f"h{i}."
        h1, ln1 = _layernorm(x, p[q_ + "ln1.g"], p[q_ + "ln1.b"])
        qkv = mode.linear(h1, p[q_ + "attn.w_qkv"], p[q_ + "attn.b_qkv"])
        # [B, T, 3, H, D] -> three [B, H, T, D] views
        qkv = qkv.reshape(bsz, t, 3, h, d).transpose(2, 0, 3, 1, 4)
        qs = qkv[0] * scale  # scaling q (smaller than the scores) is the same math
        k, v = qkv[1], qkv[2]
        s = np.matmul(qs, k.transpose(0, 1, 3, 2))
        s += bias
        s -= s.max(axis=-1, keepdims=True)
        att = np.exp(s, out=s)
        att /= att.sum(axis=-1, keepdims=True)
        y = np.matmul(att, v).transpose(0, 2, 1, 3).reshape(n, c)
        x = x + mode.linear(y, p[q_ + "attn.w_out"], p[q_ + "attn.b_out"])
        h2, ln2 = _layernorm(x, p[q_ + "ln2.g"], p[q_ + "ln2.b"])
        u = mode.linear(h2, p[q_ + "mlp.w_in"], p[q_ + "mlp.b_in"])
        a, tanh_u = _gelu(u)
        x = x + mode.linear(a, p[q_ + "mlp.w_out"], p[q_ + "mlp.b_out"])
        if keep:
            caches.append((h1, ln1, qs, k, v, att, y, h2, ln2, u, tanh_u, a))
    hf, lnf = _layernorm(x, p["lnf.g"], p["lnf.b"])
    logits = mode.linear(hf, p["head.w"], None)
    if keep:
        caches.append((hf, lnf))
    return logits, caches


def _cross_entropy(logits: np.ndarray, targets: np.ndarray, want_grad: bool
                   ) -> tuple[float, np.ndarray | None]:
    """Mean next-token cross-entropy; overwrites logits with dloss/dlogits if want_grad."""
    n = logits.shape[0]
    rows = np.arange(n)
    # with want_grad the logits buffer is ours to reuse; otherwise work on a copy
    z = logits if want_grad else logits.copy()
    z -= z.max(axis=-1, keepdims=True)
    picked = z[rows, targets].copy()
    e = np.exp(z, out=z)
    total = e.sum(axis=-1)
    nll = np.log(total) - picked
    loss = float(np.mean(nll, dtype=np.float64))
    if not want_grad:
        return loss, None
    e /= total[:, None]
    e[rows, targets] -= 1.0
    e *= e.dtype.type(1.0 / n)
    return loss, e


def _backward(cfg: ModelConfig, p: dict[str, np.ndarray], g: dict[str, np.ndarray],
              tokens: np.ndarray, dlogits: np.ndarray, caches: list[Any]) -> None:
    """Fill the gradient views ``g`` (float matmuls throughout: straight-through)."""
    bsz, t = tokens.shape
    c, h = cfg.width, cfg.heads
    d = c // h
    n = bsz * t
    scale = dlogits.dtype.type(1.0 / math.sqrt(d))
    hf, lnf = caches[-1]
    np.matmul(hf.T, dlogits, out=g["head.w"])
    dx = _layernorm_back(dlogits @ p["head.w"].T, p["lnf.g"], lnf, g["lnf.g"], g["lnf.b"])
    for i in reversed(range(cfg.layers)):
        q_ = f"h{i}."
        h1, ln1, qs, k, v, att, y, h2, ln2, u, tanh_u, a = caches[i]
        # MLP
        np.matmul(a.T, dx, out=g[q_ + "mlp.w_out"])
        np.sum(dx, axis=0, out=g[q_ + "mlp.b_out"])
        du = _gelu_back(dx @ p[q_ + "mlp.w_out"].T, u, tanh_u)
        np.matmul(h2.T, du, out=g[q_ + "mlp.w_in"])
        np.sum(du, axis=0, out=g[q_ + "mlp.b_in"])
        dx = dx + _layernorm_back(du @ p[q_ + "mlp.w_in"].T, p[q_ + "ln2.g"], ln2,
                                  g[q_ + "ln2.g"], g[q_ + "ln2.b"])
        # attention
        np.matmul(y.T, dx, out=g[q_ + "attn.w_out"])
        np.sum(dx, axis=0, out=g[q_ + "attn.b_out"])
        dy = (dx @ p[q_ + "attn.w_out"].T).reshape(bsz, t, h, d).transpose(0, 2, 1, 3)
        datt = np.matmul(dy, v.transpose(0, 1, 3, 2))
        dqkv = np.empty((bsz, t, 3, h, d), dtype=dx.dtype)
        dqkv[:, :, 2] = np.matmul(att.transpose(0, 1, 3, 2), dy).transpose(0, 2, 1, 3)
        # softmax backward: ds = att * (datt - sum(datt * att))
        datt -= np.sum(datt * att, axis=-1, keepdims=True)
        datt *= att
        dq = np.matmul(datt, k)
        dq *= scale
        dqkv[:, :, 0] = dq.transpose(0, 2, 1, 3)
        dqkv[:, :, 1] = np.matmul(datt.transpose(0, 1, 3, 2), qs).transpose(0, 2, 1, 3)
        dqkv2 = dqkv.reshape(n, 3 * c)
        np.matmul(h1.T, dqkv2, out=g[q_ + "attn.w_qkv"])
        np.sum(dqkv2, axis=0, out=g[q_ + "attn.b_qkv"])
        dx = dx + _layernorm_back(dqkv2 @ p[q_ + "attn.w_qkv"].T, p[q_ + "ln1.g"], ln1,
                                  g[q_ + "ln1.g"], g[q_ + "ln1.b"])
    dx3 = dx.reshape(bsz, t, c)
    np.sum(dx3, axis=0, out=g["wpe"][:t])
    # scatter-add in index order: deterministic for a given batch
    np.add.at(g["wte"], tokens.reshape(-1), dx)


# --------------------------------------------------------------------------- API

def forward(cfg: ModelConfig, params: np.ndarray, tokens: np.ndarray, *,
            exact: bool = False, quantized: bool = True) -> np.ndarray:
    """Logits [B, T, vocab] (float32; float64 with ``exact``) for tokens [B, T], T <= seq."""
    mode = _Mode(exact, quantized)
    flat = _check_params(cfg, params, exact)
    tokens = _check_tokens(cfg, tokens, "tokens", cfg.seq)
    logits, _ = _forward(cfg, views(cfg, flat), tokens, mode, keep=False)
    return logits.reshape(tokens.shape[0], tokens.shape[1], cfg.vocab)


def _split_batch(cfg: ModelConfig, batch: Any) -> tuple[np.ndarray, np.ndarray]:
    batch = _check_tokens(cfg, batch, "batch", cfg.seq + 1)
    if batch.shape[1] < 2:
        raise ValueError(f"batch must have at least 2 columns (inputs + targets), "
                         f"got shape {batch.shape}")
    return batch[:, :-1], batch[:, 1:].reshape(-1)


def loss_and_grad(cfg: ModelConfig, params: np.ndarray, batch: np.ndarray, *,
                  exact: bool = False, quantized: bool = True) -> tuple[float, np.ndarray]:
    """Mean next-token cross-entropy of batch [B, T+1] and its gradient (a fresh flat array).

    Inputs are ``batch[:, :-1]``, targets ``batch[:, 1:]``. The gradient has the layout of
    ``params``: float32, or float64 with ``exact`` (float64 reference, no quantization).
    """
    mode = _Mode(exact, quantized)
    flat = _check_params(cfg, params, exact)
    inputs, targets = _split_batch(cfg, batch)
    p = views(cfg, flat)
    logits, caches = _forward(cfg, p, inputs, mode, keep=True)
    loss, dlogits = _cross_entropy(logits, targets, want_grad=True)
    assert dlogits is not None
    grad = np.zeros(flat.size, dtype=mode.dt)  # wpe rows past T and unused wte rows stay 0
    _backward(cfg, p, views(cfg, grad), inputs, dlogits, caches)
    return loss, grad


def loss_only(cfg: ModelConfig, params: np.ndarray, batch: np.ndarray, *,
              exact: bool = False, quantized: bool = True) -> float:
    """Mean next-token cross-entropy of batch [B, T+1], forward only (evaluation)."""
    mode = _Mode(exact, quantized)
    flat = _check_params(cfg, params, exact)
    inputs, targets = _split_batch(cfg, batch)
    logits, _ = _forward(cfg, views(cfg, flat), inputs, mode, keep=False)
    loss, _ = _cross_entropy(logits, targets, want_grad=False)
    return loss
