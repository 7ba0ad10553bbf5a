"""Held-out evaluation: the loss of a model on fixed batches of text no run trains on.

The held-out text is the last 5% of the built-in corpus (``daisyweb.data.heldout_tokens``,
Colossians to Revelation). ``heldout_batches`` cuts it into evenly spaced,
non-overlapping windows by integer arithmetic only, so every machine evaluates the same
tokens; ``heldout_loss`` averages ``daisyweb.model.loss_only`` over them in batch order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from daisyweb.data import heldout_tokens
from daisyweb.model import ModelConfig, loss_only

__all__ = ["DEFAULT_BATCHES", "DEFAULT_BATCH", "max_batches", "heldout_batches",
           "heldout_loss"]

DEFAULT_BATCHES = 8
"""Batches evaluated by default: 8 x 8 x 64 = 4,096 predicted tokens at the default seq 64."""
DEFAULT_BATCH = 8
"""Windows per batch. The mean over equal-sized batches does not depend on it."""


def _tokens(tokens: np.ndarray | None) -> np.ndarray:
    return heldout_tokens() if tokens is None else np.asarray(tokens, dtype=np.int32)


def max_batches(seq: int, batch: int = DEFAULT_BATCH, tokens: np.ndarray | None = None) -> int:
    """How many batches of ``batch`` windows of ``seq + 1`` tokens fit without overlap."""
    if seq < 1 or batch < 1:
        raise ValueError(f"seq and batch must be >= 1, got seq={seq}, batch={batch}")
    return _tokens(tokens).size // (batch * (seq + 1))


def heldout_batches(seq: int, *, batches: int = DEFAULT_BATCHES, batch: int = DEFAULT_BATCH,
                    tokens: np.ndarray | None = None) -> list[np.ndarray]:
    """``batches`` int32 arrays of shape ``[batch, seq + 1]``: windows spread evenly over
    the held-out tokens.

    Window ``k`` (``k = 0 .. batches * batch - 1``, batch-major) starts at
    ``k * (n - (seq + 1)) // (batches * batch - 1)`` of the ``n`` held-out tokens, so the
    first window starts at the first token and the last ends at the last. No randomness:
    the same arguments give the same array on every machine. Windows never overlap; asking
    for more than fit raises ValueError. ``tokens`` replaces the held-out tokens (tests).
    """
    for name, value in (("seq", seq), ("batches", batches), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    toks = _tokens(tokens)
    fit = max_batches(seq, batch, toks)
    if batches > fit:
        raise ValueError(f"{batches} batches of {batch} x {seq + 1} tokens need "
                         f"{batches * batch * (seq + 1)} held-out tokens; {toks.size} hold "
                         f"at most {fit}")
    windows, width = batches * batch, seq + 1
    span = toks.size - width
    starts = [k * span // (windows - 1) if windows > 1 else 0 for k in range(windows)]
    out = np.stack([toks[s : s + width] for s in starts]).astype(np.int32)
    return list(out.reshape(batches, batch, width))


def heldout_loss(model_config: ModelConfig, params: np.ndarray,
                 batches: Sequence[np.ndarray], quantized: bool = True) -> float:
    """Mean next-token cross-entropy of ``params`` over ``batches`` (each ``[B, T + 1]``).

    Each batch's mean comes from ``loss_only`` (the forward training uses: int8, or plain
    float32 without ``quantized``); the N means are added as Python floats in list order
    and divided by N once.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("batches must hold at least one batch")
    for b in batches:
        if np.ndim(b) != 2:
            raise ValueError(f"each batch must have shape [B, T + 1], got {np.shape(b)}")
    total = 0.0
    for b in batches:
        total += float(loss_only(model_config, params, b, quantized=quantized))
    return total / len(batches)
