"""bench.torch_gap compares gradients per parameter kind, every layer's together."""

from __future__ import annotations

import numpy as np
import pytest

from bench.torch_gap import _per_tensor, _torch_grad
from daisyweb.model import ModelConfig, init_params, loss_and_grad, param_layout, views

CFG = ModelConfig(vocab=64, width=16, layers=2, heads=2, seq=8)


def test_kinds_gather_every_layers_tensor_and_compare_them() -> None:
    size = sum(int(np.prod(s)) for _, s in param_layout(CFG))
    a = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    b = a.copy()
    scaled = views(CFG, b)
    scaled["h1.mlp.w_in"][...] *= np.float32(2.0)  # one layer's of two, twice as large
    got = _per_tensor(CFG, b, a)
    assert "mlp.w_in" in got and "h0.mlp.w_in" not in got and "wte" in got
    assert got["wte"] == pytest.approx((1.0, 1.0))
    w0, w1 = views(CFG, a)["h0.mlp.w_in"], views(CFG, a)["h1.mlp.w_in"]
    n0, n1 = float(np.sum(w0.astype(np.float64) ** 2)), float(np.sum(w1.astype(np.float64) ** 2))
    assert got["mlp.w_in"][1] == pytest.approx(np.sqrt((n0 + 4 * n1) / (n0 + n1)), rel=1e-6)
    assert got["mlp.w_in"][0] < 1.0


def test_the_torch_gradient_is_daisywebs_float_one() -> None:
    params = init_params(CFG, 1)
    batch = np.random.default_rng(2).integers(0, 64, (2, 9))
    loss, grad = _torch_grad(CFG, params, batch)
    ours = loss_and_grad(CFG, params, batch, quantized=False)
    assert loss == pytest.approx(ours[0], rel=1e-5)
    assert all(cos > 0.99999 for cos, _ in _per_tensor(CFG, ours[1], grad).values())
