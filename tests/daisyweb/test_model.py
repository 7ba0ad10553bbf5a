"""daisyweb.model: layout, deterministic init, float64 gradient check, PyTorch agreement."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import kernels
from bench.torch_gpt import torch_loss
from daisyweb import model
from daisyweb.model import (
    ModelConfig,
    forward,
    init_params,
    loss_and_grad,
    loss_only,
    param_count,
    param_layout,
    views,
)
from daisyweb.optim import AdamConfig, DaisyAdam

TINY = ModelConfig(vocab=11, width=8, layers=2, heads=2, seq=5)
SMALL = ModelConfig(vocab=50, width=32, layers=2, heads=4, seq=16)
# blake2b-128 of init_params(SMALL, 7): the init must be the same bytes on every machine
GOLDEN_SMALL_SEED7 = "318f6ae37a48c27cd4e80f8a75928347"


def _batch(cfg: ModelConfig, b: int, t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab, size=(b, t + 1))


def _perturbed(cfg: ModelConfig, seed: int = 0, scale: float = 0.3) -> np.ndarray:
    """Init plus noise on every tensor, so LN gains/biases are not 1/0 and grads are generic."""
    p = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 99)
    p += (scale * rng.standard_normal(p.size)).astype(np.float32)
    return p


# ------------------------------------------------------------------------- layout / init

def test_views_are_no_copy_and_in_layout_order() -> None:
    flat = np.arange(param_count(SMALL), dtype=np.float32)
    v = views(SMALL, flat)
    assert [(k, a.shape) for k, a in v.items()] == param_layout(SMALL)
    offset = 0
    for a in v.values():
        assert np.shares_memory(a, flat)
        assert a.reshape(-1)[0] == offset  # contiguous, back to back
        offset += a.size
    assert offset == flat.size
    v["h1.mlp.b_in"][3] = -7.0
    assert (flat == -7.0).sum() == 1


def test_views_refuse_wrong_size_and_strided() -> None:
    n = param_count(TINY)
    with pytest.raises(ValueError, match="1-d array"):
        views(TINY, np.zeros(n + 1, np.float32))
    with pytest.raises(ValueError, match="1-d array"):
        views(TINY, np.zeros((1, n), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        views(TINY, np.zeros(2 * n, np.float32)[::2])


def test_init_is_pinned_and_seeded() -> None:
    a = init_params(SMALL, 7)
    assert a.dtype == np.float32 and a.shape == (param_count(SMALL),)
    # Pinned bytes: the init must be the same on every machine and numpy version.
    assert hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest() == GOLDEN_SMALL_SEED7
    assert np.array_equal(a, init_params(SMALL, 7))
    assert not np.array_equal(a, init_params(SMALL, 8))
    big = init_params(ModelConfig(vocab=2048, width=64, layers=3, heads=4, seq=64), 2**64 - 1)
    assert np.isfinite(big).all()



def test_init_distribution() -> None:
    cfg = ModelConfig(vocab=1024, width=64, layers=3, heads=4, seq=64)
    v = views(cfg, init_params(cfg, 0))
    resid = 0.02 / math.sqrt(2 * cfg.layers)
    for name, a in v.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "g":
            assert (a == 1.0).all(), name
        elif leaf.startswith("b"):
            assert (a == 0.0).all(), name
        else:
            std = resid if leaf == "w_out" else 0.02
            assert abs(float(a.std()) / std - 1.0) < 0.05, name
            assert abs(float(a.mean())) < 0.1 * std, name
            # uniform with that std: bounded by std*sqrt(3)
            assert float(np.abs(a).max()) <= std * math.sqrt(3) * (1 + 1e-6), name
    # tensors draw from different counters, so they are not copies of each other
    assert not np.array_equal(v["h0.attn.w_out"].reshape(-1)[:64] / resid,
                              v["h1.attn.w_out"].reshape(-1)[:64] / resid)


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.5, "3"])
def test_init_refuses_bad_seed(seed: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        init_params(TINY, seed)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- float64 check

def test_finite_difference_gradient_exact_mode() -> None:
    cfg = TINY
    params = _perturbed(cfg).astype(np.float64)
    batch = _batch(cfg, 3, cfg.seq, seed=1)
    loss, grad = loss_and_grad(cfg, params, batch, exact=True)
    assert isinstance(loss, float) and grad.dtype == np.float64
    rng = np.random.default_rng(5)
    offset, worst = 0, 0.0

    def central(i: int, h: float) -> float:
        p1, p2 = params.copy(), params.copy()
        p1[i] += h
        p2[i] -= h
        return (loss_only(cfg, p1, batch, exact=True)
                - loss_only(cfg, p2, batch, exact=True)) / (2 * h)

    # What float64 rounding of the loss alone can put into a difference quotient (a few
    # ulps of the loss over the smaller h): where the true gradient is 0 (a key bias,
    # which shifts every score of a row alike) the estimate is only that noise.
    noise = 16 * np.finfo(np.float64).eps * abs(loss) / 5e-4
    gv = views(cfg, grad)
    for name, shape in param_layout(cfg):
        size = math.prod(shape)
        if name == "wte":
            # only rows of tokens that occur carry gradient; sample those plus one absent row
            present = np.unique(batch[:, :-1])
            rows = list(rng.choice(present, 3, replace=False))
            idx = [offset + r * cfg.width + int(rng.integers(cfg.width)) for r in rows]
        else:
            idx = list(offset + rng.choice(size, min(size, 8), replace=False))
        for i in idx:
            # Richardson-extrapolated central difference: O(h^4) truncation, and h large
            # enough that float64 rounding of the loss stays far below 1e-6 relative
            fd = (4.0 * central(i, 5e-4) - central(i, 1e-3)) / 3.0
            an = grad[i]
            rel = max(abs(fd - an) - noise, 0.0) / max(abs(fd), abs(an), 1e-7)
            worst = max(worst, rel)
            assert rel < 1e-6, (name, i, fd, an, noise)
        assert np.abs(gv[name]).max() > 0, name  # every tensor gets gradient
        offset += size
    assert worst < 1e-6


def test_exact_mode_is_float64_and_unquantized(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise AssertionError("exact mode must not call the int8 kernel")

    monkeypatch.setattr(kernels, "int8_matmul", boom)
    p = init_params(TINY, 0)
    logits = forward(TINY, p, _batch(TINY, 2, 4)[:, :-1], exact=True)
    assert logits.dtype == np.float64 and logits.shape == (2, 4, TINY.vocab)


# ------------------------------------------------------------------------- PyTorch reference

def _torch_loss_and_grad(cfg: ModelConfig, flat_np: np.ndarray, batch: np.ndarray
                         ) -> tuple[float, np.ndarray]:
    """The same architecture in PyTorch float32 (bench.torch_gpt), gradients by autograd."""
    flat = torch.tensor(flat_np, dtype=torch.float32, requires_grad=True)
    p: dict[str, torch.Tensor] = {}
    off = 0
    for name, shape in param_layout(cfg):
        n = math.prod(shape)
        p[name] = flat[off:off + n].view(shape)
        off += n
    inp = torch.tensor(batch[:, :-1], dtype=torch.long)
    tgt = torch.tensor(batch[:, 1:], dtype=torch.long)
    loss = torch_loss(cfg, p, inp, tgt)
    loss.backward()
    assert flat.grad is not None
    return float(loss.item()), flat.grad.numpy().copy()


@pytest.mark.parametrize("t", [SMALL.seq, 9])
def test_float_path_matches_torch(t: int) -> None:
    params = _perturbed(SMALL, seed=3, scale=0.1)
    batch = _batch(SMALL, 4, t, seed=2)
    loss, grad = loss_and_grad(SMALL, params, batch, quantized=False)
    tloss, tgrad = _torch_loss_and_grad(SMALL, params, batch)
    assert grad.dtype == np.float32 and grad.shape == params.shape
    assert abs(loss - tloss) < 1e-5 * max(1.0, abs(tloss))
    gv, tv = views(SMALL, grad), views(SMALL, tgrad)
    for name in gv:
        err = float(np.abs(gv[name] - tv[name]).max())
        ref = float(np.abs(tv[name]).max())
        assert err <= 1e-4 * ref + 1e-7, (name, err, ref)
    assert loss_only(SMALL, params, batch, quantized=False) == pytest.approx(loss, rel=1e-6)


def test_int8_path_close_to_float_path_and_uses_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SMALL
    params = init_params(cfg, 1)
    batch = _batch(cfg, 4, cfg.seq, seed=4)
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = kernels.int8_matmul

    def counting(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        calls.append((x.shape, w.shape))
        return real(x, w, out=out)

    real_prepared = kernels.int8_matmul_prepared

    def counting_prepared(x: np.ndarray, q: np.ndarray, s: np.ndarray,
                          out: np.ndarray | None = None) -> np.ndarray:
        calls.append((x.shape, q.shape))
        return real_prepared(x, q, s, out=out)

    monkeypatch.setattr(kernels, "int8_matmul", counting)
    monkeypatch.setattr(kernels, "int8_matmul_prepared", counting_prepared)
    q_loss, q_grad = loss_and_grad(cfg, params, batch)
    # every linear layer's forward, and nothing else: 4 per block + LM head, once over
    # the batch (one core) or once per half of it (two cores, with weights quantized
    # once for both), its rows adding up
    per_pass = 4 * cfg.layers + 1
    assert len(calls) in (per_pass, 2 * per_pass)
    heads = [x for x, w in calls if w == (cfg.width, cfg.vocab)]
    assert sum(x[0] for x in heads) == 4 * cfg.seq and len(heads) == len(calls) // per_pass
    assert calls[-1][1] == (cfg.width, cfg.vocab)
    calls.clear()
    f_loss, f_grad = loss_and_grad(cfg, params, batch, quantized=False)
    assert calls == []
    assert q_loss != f_loss  # the int8 path really quantizes
    assert abs(q_loss - f_loss) < 0.02 * f_loss
    cos = float(q_grad @ f_grad) / float(np.linalg.norm(q_grad) * np.linalg.norm(f_grad))
    assert cos > 0.95
    assert loss_only(cfg, params, batch) == pytest.approx(q_loss, rel=1e-6)


# ------------------------------------------------------------------------- behaviour

def test_forward_is_causal_and_consistent_with_loss() -> None:
    params = _perturbed(SMALL, seed=5, scale=0.1)
    batch = _batch(SMALL, 2, SMALL.seq, seed=6)
    tokens = batch[:, :-1]
    logits = forward(SMALL, params, tokens, quantized=False)
    assert logits.shape == (2, SMALL.seq, SMALL.vocab) and logits.dtype == np.float32
    changed = tokens.copy()
    changed[:, 10] = (changed[:, 10] + 1) % SMALL.vocab
    other = forward(SMALL, params, changed, quantized=False)
    np.testing.assert_array_equal(logits[:, :10], other[:, :10])
    assert not np.allclose(logits[:, 10:], other[:, 10:])
    # mean cross-entropy from the logits equals loss_only
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    picked = np.take_along_axis(z, batch[:, 1:, None], -1)[..., 0]
    assert loss_only(SMALL, params, batch, quantized=False) == pytest.approx(
        float((lse - picked).mean()), rel=1e-5)


def test_initial_loss_near_log_vocab_and_grad_is_fresh() -> None:
    cfg = ModelConfig(vocab=256, width=32, layers=2, heads=2, seq=16)
    params = init_params(cfg, 0)
    before = params.copy()
    batch = _batch(cfg, 4, 12)
    loss, grad = loss_and_grad(cfg, params, batch)
    assert abs(loss - math.log(cfg.vocab)) < 0.1
    assert not np.shares_memory(grad, params)
    np.testing.assert_array_equal(params, before)
    loss2, grad2 = loss_and_grad(cfg, params, batch)
    assert loss2 == loss and grad2.tobytes() == grad.tobytes() and grad2 is not grad
    # positions past T get no gradient; tokens that never occur as input get none
    gv = views(cfg, grad)
    assert (gv["wpe"][12:] == 0).all() and (np.abs(gv["wpe"][:12]).sum(1) > 0).all()
    absent = np.setdiff1d(np.arange(cfg.vocab), batch[:, :-1])
    assert (gv["wte"][absent] == 0).all()


def test_training_reduces_loss() -> None:
    cfg = SMALL
    params = init_params(cfg, 0)
    opt = DaisyAdam(AdamConfig(lr=1e-2), params.size)
    batch = _batch(cfg, 4, cfg.seq, seed=9)
    first = loss_only(cfg, params, batch)
    for _ in range(30):
        _, grad = loss_and_grad(cfg, params, batch)
        opt.step(params, grad)
    assert loss_only(cfg, params, batch) < 0.5 * first


def test_refuses_bad_tokens_and_params() -> None:
    p = init_params(TINY, 0)
    ok = _batch(TINY, 2, TINY.seq)
    with pytest.raises(ValueError, match="outside"):
        loss_and_grad(TINY, p, np.where(ok == 0, TINY.vocab, ok))
    with pytest.raises(ValueError, match="outside"):
        forward(TINY, p, -np.ones((1, 3), np.int64))
    with pytest.raises(ValueError, match="more than"):
        loss_and_grad(TINY, p, _batch(TINY, 2, TINY.seq + 1))
    with pytest.raises(ValueError, match="more than"):
        forward(TINY, p, np.zeros((1, TINY.seq + 1), np.int64))
    with pytest.raises(ValueError, match="at least 2"):
        loss_only(TINY, p, np.zeros((2, 1), np.int64))
    with pytest.raises(TypeError, match="integer"):
        forward(TINY, p, np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="2-d"):
        forward(TINY, p, np.zeros(3, np.int64))
    with pytest.raises(TypeError, match="float32"):
        loss_and_grad(TINY, p.astype(np.float64), ok)  # float64 only in exact mode
    with pytest.raises(ValueError, match="shape"):
        loss_and_grad(TINY, p[:-1].copy(), ok)
    with pytest.raises(TypeError, match="numpy"):
        forward(TINY, list(p), ok[:, :-1])  # type: ignore[arg-type]
    # the exact mode accepts float32 params too (upcast) and agrees with float64 input
    a = loss_only(TINY, p, ok, exact=True)
    assert a == loss_only(TINY, p.astype(np.float64), ok, exact=True)


def test_model_runs_without_torch() -> None:
    # product code never imports torch: a training step in a fresh interpreter leaves it out
    code = ("import sys, numpy as np\n"
            "from daisyweb.model import ModelConfig, init_params, loss_and_grad\n"
            "cfg = ModelConfig(vocab=11, width=8, layers=2, heads=2, seq=5)\n"
            "loss, _ = loss_and_grad(cfg, init_params(cfg, 0), np.zeros((1, 6), np.int64))\n"
            "print('torch' in sys.modules, loss > 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, timeout=120)
    assert r.stdout.split() == ["False", "True"]
    assert "torch" not in open(model.__file__, encoding="utf-8").read()
