"""DaisyAdam's chunked, two-range update against the whole-array sequence it replaces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from daisyweb import optim, parallel
from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash


def _plain_step(cfg: AdamConfig, state: dict, params: np.ndarray, grad: np.ndarray) -> None:
    """The module docstring's order, one whole-array pass per operation."""
    f32 = np.float32
    state["p1"] *= cfg.beta1
    state["p2"] *= cfg.beta2
    step_size = f32(cfg.lr / (1.0 - state["p1"]))
    bc2 = f32(math.sqrt(1.0 - state["p2"]))
    m, v = state["m"], state["v"]
    if cfg.weight_decay:
        params *= f32(1.0 - cfg.lr * cfg.weight_decay)
    m *= f32(cfg.beta1)
    m += grad * f32(1.0 - cfg.beta1)
    v *= f32(cfg.beta2)
    s = grad * grad
    s *= f32(1.0 - cfg.beta2)
    v += s
    den = np.sqrt(v)
    den /= bc2
    den += f32(cfg.eps)
    upd = m / den
    upd *= step_size
    params -= upd


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("size", [1, 7, optim._CHUNK, 2 * optim._CHUNK + 3,
                                  5 * optim._CHUNK - 1])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_chunked_update_is_the_plain_sequence_bit_for_bit(cores: int, size: int,
                                                          wd: float) -> None:
    cfg = AdamConfig(lr=3e-3, weight_decay=wd)
    rng = np.random.default_rng(size)
    params = rng.standard_normal(size).astype(np.float32)
    ref = params.copy()
    state = {"p1": 1.0, "p2": 1.0, "m": np.zeros(size, np.float32),
             "v": np.zeros(size, np.float32)}
    opt = DaisyAdam(cfg, size)
    before = parallel.cores()
    parallel.set_cores(cores)
    try:
        for _ in range(3):
            grad = (rng.standard_normal(size) * 10.0 ** rng.integers(-6, 3)).astype(np.float32)
            opt.step(params, grad)
            _plain_step(cfg, state, ref, grad)
    finally:
        parallel.set_cores(before)
    assert params.tobytes() == ref.tobytes()
    assert opt.m.tobytes() == state["m"].tobytes() and opt.v.tobytes() == state["v"].tobytes()


def test_two_ranges_cover_the_buffer_in_whole_chunks() -> None:
    for size in (0, 1, optim._CHUNK, optim._CHUNK + 1, 3 * optim._CHUNK + 5):
        (a, b), (c, d) = DaisyAdam(AdamConfig(lr=1e-3), size)._ranges()
        assert a == 0 and b == c and d == size and b % optim._CHUNK in (0, size % optim._CHUNK)


@pytest.mark.parametrize("where", [0, optim._CHUNK + 2, -1])
def test_non_finite_anywhere_is_refused_before_any_change(where: int) -> None:
    size = 3 * optim._CHUNK + 11
    opt = DaisyAdam(AdamConfig(lr=1e-3), size)
    params = np.ones(size, np.float32)
    opt.step(params, np.full(size, 0.5, np.float32))
    h = weight_hash(params, opt)
    for cores in (1, 2):
        before = parallel.cores()
        parallel.set_cores(cores)
        try:
            grad = np.full(size, 0.5, np.float32)
            grad[where] = np.inf
            with pytest.raises(ValueError, match="NaN or Inf"):
                opt.step(params, grad)
        finally:
            parallel.set_cores(before)
        assert weight_hash(params, opt) == h
