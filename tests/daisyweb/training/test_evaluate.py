"""Held-out evaluation: fixed windows of the held-out tokens, the loss averaged in order."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from daisyweb.data import builtin_tokens, default_tokenizer, heldout_tokens
from daisyweb.model import ModelConfig, init_params, loss_only
from daisyweb.training.evaluate import (
    DEFAULT_BATCH,
    DEFAULT_BATCHES,
    heldout_batches,
    heldout_loss,
    max_batches,
)

MODEL = ModelConfig(vocab=default_tokenizer().vocab_size, width=16, layers=1, heads=2, seq=16)


def test_batches_are_evenly_spaced_windows_of_the_heldout_tokens() -> None:
    held = heldout_tokens()
    b = heldout_batches(16, batches=3, batch=4)
    assert isinstance(b, list) and len(b) == 3
    assert all(x.shape == (4, 17) and x.dtype == np.int32 for x in b)
    windows = np.concatenate(b)
    starts = [k * (held.size - 17) // 11 for k in range(12)]
    for w, s in zip(windows, starts, strict=True):
        assert np.array_equal(w, held[s : s + 17])
    assert np.array_equal(windows[0], held[:17]) and np.array_equal(windows[-1], held[-17:])
    assert min(np.diff(starts)) >= 17  # no two windows share a token


def test_batches_are_fixed_and_never_training_tokens() -> None:
    a = heldout_batches(64)
    assert DEFAULT_BATCHES == 8 and len(a) == DEFAULT_BATCHES
    assert all(x.shape == (DEFAULT_BATCH, 65) for x in a)
    assert np.array_equal(np.stack(a), np.stack(heldout_batches(64)))
    a[0][0, 0] += 1  # editing it does not edit the shared held-out tokens
    assert np.array_equal(heldout_batches(64)[0][0], heldout_tokens()[:65])
    with pytest.raises(TypeError):
        heldout_batches(64, 8)  # batches and batch are keyword-only
    # a window of the held-out tokens is not a window of the training tokens
    train = builtin_tokens()
    w = heldout_batches(64, batches=1, batch=1)[0][0]
    hits = np.flatnonzero(train[: train.size - 64] == w[0])
    assert not any(np.array_equal(train[h : h + 65], w) for h in hits)


def test_default_batches_are_pinned() -> None:
    # the windows depend on integers only, so this digest holds on every machine; a
    # change here means every reported held-out loss changes meaning
    b = np.stack(heldout_batches(64))
    assert hashlib.sha256(b.astype("<i4").tobytes()).hexdigest() == (
        "13c151f1ec71be65569b2f3a2f06f70cfdcf88df7afe9ae239a1e7a44a22f03a")


def test_too_many_batches_and_bad_arguments_are_refused() -> None:
    fit = max_batches(16, 8)
    assert fit == heldout_tokens().size // (8 * 17)
    heldout_batches(16, batches=fit, batch=8)
    with pytest.raises(ValueError, match=f"at most {fit}"):
        heldout_batches(16, batches=fit + 1, batch=8)
    for kwargs in ({"batches": 0}, {"batch": 0}, {"batches": 1.5}, {"batches": True}):
        with pytest.raises(ValueError, match="positive integer"):
            heldout_batches(16, **kwargs)
    with pytest.raises(ValueError, match="positive integer"):
        heldout_batches(0)
    one = heldout_batches(16, batches=1, batch=1, tokens=np.arange(17, dtype=np.int32))
    assert [x.tolist() for x in one] == [[list(range(17))]]


def test_loss_is_the_in_order_mean_of_loss_only() -> None:
    params = init_params(MODEL, 3)
    b = heldout_batches(MODEL.seq, batches=5, batch=3)
    total = 0.0
    for x in b:
        total += loss_only(MODEL, params, x)
    assert heldout_loss(MODEL, params, b) == total / 5
    assert heldout_loss(MODEL, params, b) == heldout_loss(MODEL, params.copy(),
                                                          [x.copy() for x in b])
    assert heldout_loss(MODEL, params, b) == heldout_loss(MODEL, params, tuple(b))
    # untrained: about ln(vocab)
    assert abs(heldout_loss(MODEL, params, b) - np.log(MODEL.vocab)) < 0.5
    with pytest.raises(ValueError, match="shape"):
        heldout_loss(MODEL, params, [b[0][0]])  # a 1-D window is not a batch
    with pytest.raises(ValueError, match="at least one"):
        heldout_loss(MODEL, params, [])
