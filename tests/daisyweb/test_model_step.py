"""daisyweb.model's fast step (workspaces, halves, two cores) against a plain reference.

The reference below is the straightforward way to compute what ``loss_and_grad``
defines: fresh arrays for every intermediate, no workspace, one half of the batch after
the other, then the whole-batch weight gradients. The fast step must equal it bit for bit,
on one core and on two, and must not carry anything from one call into the next.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kernels
from daisyweb import model, parallel, workspace
from daisyweb.model import ModelConfig, forward, init_params, loss_and_grad, loss_only, views

SMALL = ModelConfig(vocab=50, width=32, layers=2, heads=4, seq=16)
MID = ModelConfig(vocab=97, width=64, layers=2, heads=2, seq=12)


# ----------------------------------------------------------------------------- reference

def _ref_ln(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, Any]:
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + x.dtype.type(1e-5))
    xhat = xc * rstd
    return xhat * g + b, (xhat, rstd)


def _ref_ln_back(dy: np.ndarray, g: np.ndarray, cache: Any) -> tuple[np.ndarray, ...]:
    xhat, rstd = cache
    dg = np.sum(dy * xhat, axis=0)
    db = np.sum(dy, axis=0)
    dxhat = dy * g
    a = dxhat.mean(axis=-1, keepdims=True)
    c = np.mean(dxhat * xhat, axis=-1, keepdims=True)
    dxhat -= a
    dxhat -= xhat * c
    dxhat *= rstd
    return dxhat, dg, db


def _ref_gelu(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    f = u.dtype.type
    inner = u * u
    inner *= f(0.044715)
    inner += f(1.0)
    inner *= u
    inner *= f(math.sqrt(2.0 / math.pi))
    t = np.tanh(inner)
    a = t + f(1.0)
    a *= u
    a *= f(0.5)
    return a, t


def _ref_gelu_back(da: np.ndarray, u: np.ndarray, t: np.ndarray) -> np.ndarray:
    f = u.dtype.type
    du = u * u
    du *= f(3.0 * 0.044715)
    du += f(1.0)
    du *= f(math.sqrt(2.0 / math.pi))
    du *= u
    du *= f(1.0) - t * t
    du += t
    du += f(1.0)
    du *= f(0.5)
    return du * da


def _ref_linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, quantized: bool
                ) -> np.ndarray:
    y = kernels.int8_matmul(x, w) if quantized else x @ w
    return y if b is None else y + b


def _ref_forward(cfg: ModelConfig, p: dict[str, np.ndarray], tokens: np.ndarray,
                 quantized: bool) -> tuple[np.ndarray, list[Any]]:
    bsz, t = tokens.shape
    c, h = cfg.width, cfg.heads
    d = c // h
    n = bsz * t
    f = p["wte"].dtype.type
    bias = np.zeros((t, t), p["wte"].dtype)
    bias[np.triu_indices(t, 1)] = -np.inf
    x = (p["wte"][tokens] + p["wpe"][:t]).reshape(n, c)
    caches: list[Any] = []
    for i in range(cfg.layers):
        q_ = f"h{i}."
        h1, ln1 = _ref_ln(x, p[q_ + "ln1.g"], p[q_ + "ln1.b"])
        qkv = _ref_linear(h1, p[q_ + "attn.w_qkv"], p[q_ + "attn.b_qkv"], quantized)
        qkv = qkv.reshape(bsz, t, 3, h, d).transpose(2, 0, 3, 1, 4)
        qs = qkv[0] * f(1.0 / math.sqrt(d))
        k, v = qkv[1], qkv[2]
        s = np.matmul(qs, k.transpose(0, 1, 3, 2))
        s += bias
        s -= s.max(axis=-1, keepdims=True)
        att = np.exp(s)
        att /= att.sum(axis=-1, keepdims=True)
        y = np.matmul(att, v).transpose(0, 2, 1, 3).reshape(n, c)
        x = x + _ref_linear(y, p[q_ + "attn.w_out"], p[q_ + "attn.b_out"], quantized)
        h2, ln2 = _ref_ln(x, p[q_ + "ln2.g"], p[q_ + "ln2.b"])
        u = _ref_linear(h2, p[q_ + "mlp.w_in"], p[q_ + "mlp.b_in"], quantized)
        a, tanh_u = _ref_gelu(u)
        x = x + _ref_linear(a, p[q_ + "mlp.w_out"], p[q_ + "mlp.b_out"], quantized)
        caches.append((h1, ln1, qs, k, v, att, y, h2, ln2, u, tanh_u, a))
    hf, lnf = _ref_ln(x, p["lnf.g"], p["lnf.b"])
    caches.append((hf, lnf))
    return _ref_linear(hf, p["head.w"], None, quantized), caches


def reference_loss_and_grad(cfg: ModelConfig, params: np.ndarray, batch: np.ndarray,
                            quantized: bool = True) -> tuple[float, np.ndarray]:
    """What loss_and_grad defines, written plainly (see the module docstring)."""
    c, h = cfg.width, cfg.heads
    d = c // h
    p = views(cfg, params)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    bsz, t = inputs.shape
    total = bsz * t
    mid = (bsz + 1) // 2
    halves = [slice(0, mid), slice(mid, bsz)] if bsz > 1 else [slice(0, bsz)]
    grad = np.zeros_like(params)
    g = views(cfg, grad)
    nll_parts, dlogit_parts, cache_parts, keep_parts = [], [], [], []
    ln_parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for rows in halves:
        tok = inputs[rows]
        b = tok.shape[0]
        logits, caches = _ref_forward(cfg, p, tok, quantized)
        z = logits - logits.max(axis=-1, keepdims=True)
        tg = targets[rows].reshape(-1)
        picked = z[np.arange(z.shape[0]), tg]
        e = np.exp(z)
        sums = e.sum(axis=-1)
        nll_parts.append(np.log(sums) - picked)
        e /= sums[:, None]
        e[np.arange(z.shape[0]), tg] -= 1.0
        e *= e.dtype.type(1.0 / total)
        dlogit_parts.append(e)
        cache_parts.append(caches)
        # the chain of dL/dx, this half's rows only
        dx, dg, db = _ref_ln_back(e @ p["head.w"].T, p["lnf.g"], caches[-1][1])
        ln_parts.setdefault("lnf", []).append((dg, db))
        keep: dict[str, Any] = {}
        for i in reversed(range(cfg.layers)):
            q_ = f"h{i}."
            h1, ln1, qs, k, v, att, y, h2, ln2, u, tanh_u, a = caches[i]
            du = _ref_gelu_back(dx @ p[q_ + "mlp.w_out"].T, u, tanh_u)
            dh, dg, db = _ref_ln_back(du @ p[q_ + "mlp.w_in"].T, p[q_ + "ln2.g"], ln2)
            ln_parts.setdefault(q_ + "ln2", []).append((dg, db))
            dxa = dx + dh
            dy = (dxa @ p[q_ + "attn.w_out"].T).reshape(b, t, h, d).transpose(0, 2, 1, 3)
            datt = np.matmul(dy, v.transpose(0, 1, 3, 2))
            dqkv = np.empty((b, t, 3, h, d), dtype=dx.dtype)
            dqkv[:, :, 2] = np.matmul(att.transpose(0, 1, 3, 2), dy).transpose(0, 2, 1, 3)
            datt -= np.sum(datt * att, axis=-1, keepdims=True)
            datt *= att
            dq = np.matmul(datt, k)
            dq *= dx.dtype.type(1.0 / math.sqrt(d))
            dqkv[:, :, 0] = dq.transpose(0, 2, 1, 3)
            dqkv[:, :, 1] = np.matmul(datt.transpose(0, 1, 3, 2), qs).transpose(0, 2, 1, 3)
            dqkv2 = dqkv.reshape(b * t, 3 * c)
            dh, dg, db = _ref_ln_back(dqkv2 @ p[q_ + "attn.w_qkv"].T, p[q_ + "ln1.g"], ln1)
            ln_parts.setdefault(q_ + "ln1", []).append((dg, db))
            keep[i] = (dx, du, dxa, dqkv2)
            dx = dxa + dh
        keep["emb"] = dx
        keep_parts.append(keep)

    def whole(part: Any) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate(part, axis=0))

    # weight gradients over the whole batch
    hf = whole([cp[-1][0] for cp in cache_parts])
    np.matmul(hf.T, whole(dlogit_parts), out=g["head.w"])
    for i in range(cfg.layers):
        q_ = f"h{i}."
        acts = {name: whole([cp[i][j] for cp in cache_parts])
                for name, j in (("h1", 0), ("y", 6), ("h2", 7), ("a", 11))}
        dxm, du, dxa, dqkv = (whole([kp[i][j] for kp in keep_parts]) for j in range(4))
        for wname, bname, act, dout in (("mlp.w_out", "mlp.b_out", acts["a"], dxm),
                                        ("mlp.w_in", "mlp.b_in", acts["h2"], du),
                                        ("attn.w_out", "attn.b_out", acts["y"], dxa),
                                        ("attn.w_qkv", "attn.b_qkv", acts["h1"], dqkv)):
            np.matmul(act.T, dout, out=g[q_ + wname])
            g[q_ + bname][...] = np.sum(dout, axis=0)
    for name, parts in ln_parts.items():
        g[name + ".g"][...] = parts[0][0] if len(parts) == 1 else parts[0][0] + parts[1][0]
        g[name + ".b"][...] = parts[0][1] if len(parts) == 1 else parts[0][1] + parts[1][1]
    dxe = whole([kp["emb"] for kp in keep_parts])
    g["wpe"][:t] = np.sum(dxe.reshape(bsz, t, c), axis=0)
    np.add.at(g["wte"], inputs.reshape(-1), dxe)
    loss = float(np.mean(np.concatenate(nll_parts), dtype=np.float64))
    return loss, grad


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(params=[1, 2], ids=["one core", "two cores"])
def cores(request: pytest.FixtureRequest) -> Iterator[int]:
    before = parallel.cores()
    parallel.set_cores(request.param)
    try:
        yield request.param
    finally:
        parallel.set_cores(before)


def _params(cfg: ModelConfig, seed: int) -> np.ndarray:
    p = init_params(cfg, seed)
    p += (0.1 * np.random.default_rng(seed + 5).standard_normal(p.size)).astype(np.float32)
    return p


def _batch(cfg: ModelConfig, b: int, t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab, size=(b, t + 1))


def _poison_workspaces() -> int:
    """NaN into every float buffer of every idle workspace, -128 (a value quantization
    never makes) into the int8 ones of the prepared weights; returns how many."""
    count = 0
    for work in workspace._pool:
        for buf in work.buffers():
            buf.fill(np.nan if buf.dtype.kind == "f" else -128)
            count += 1
    return count


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("cfg, b, t", [(SMALL, 4, 16), (SMALL, 3, 9), (SMALL, 1, 16),
                                       (MID, 5, 12)])
@pytest.mark.parametrize("quantized", [True, False], ids=["int8", "float"])
def test_step_equals_plain_reference_bit_for_bit(cores: int, cfg: ModelConfig, b: int, t: int,
                                                 quantized: bool) -> None:
    params = _params(cfg, 1)
    batch = _batch(cfg, b, t, seed=b)
    want_loss, want = reference_loss_and_grad(cfg, params, batch, quantized)
    loss, grad = loss_and_grad(cfg, params, batch, quantized=quantized)
    assert loss == want_loss
    gv, wv = views(cfg, grad), views(cfg, want)
    bad = [name for name in gv if gv[name].tobytes() != wv[name].tobytes()]
    assert bad == []
    assert loss_only(cfg, params, batch, quantized=quantized) == want_loss


def test_one_core_and_two_give_the_same_bytes() -> None:
    cfg = MID
    params = _params(cfg, 2)
    batch = _batch(cfg, 6, cfg.seq, seed=3)
    before = parallel.cores()
    got = []
    try:
        for n in (1, 2):
            parallel.set_cores(n)
            loss, grad = loss_and_grad(cfg, params, batch)
            logits = forward(cfg, params, batch[:, :-1])
            got.append((loss, grad.tobytes(), logits.tobytes()))
    finally:
        parallel.set_cores(before)
    assert got[0] == got[1]


def test_reused_buffers_carry_nothing_between_calls(cores: int) -> None:
    cfg = SMALL
    params = _params(cfg, 3)
    a, b = _batch(cfg, 4, cfg.seq, seed=1), _batch(cfg, 4, cfg.seq, seed=2)
    first = loss_and_grad(cfg, params, a)
    out = np.full(params.size, np.nan, np.float32)  # garbage in the caller's buffer too
    loss_and_grad(cfg, params, b, out=out)  # same workspace, other data
    assert _poison_workspaces() > 20  # and then every buffer it kept is NaN
    loss, grad = loss_and_grad(cfg, params, a, out=out)
    assert grad is out
    assert loss == first[0] and grad.tobytes() == first[1].tobytes()
    # other shapes in between (their own workspaces, then a poisoned reuse)
    loss_and_grad(cfg, params, _batch(cfg, 3, 7, seed=4))
    forward(cfg, params, a[:, :-1])
    _poison_workspaces()
    assert loss_and_grad(cfg, params, a)[1].tobytes() == first[1].tobytes()
    assert forward(cfg, params, a[:, :-1]).tobytes() == forward(cfg, params, a[:, :-1]).tobytes()


def test_forward_and_loss_only_do_not_depend_on_workspace_contents(cores: int) -> None:
    cfg = SMALL
    params = _params(cfg, 4)
    batch = _batch(cfg, 4, cfg.seq, seed=6)
    logits = forward(cfg, params, batch[:, :-1])
    loss = loss_only(cfg, params, batch)
    _poison_workspaces()
    assert forward(cfg, params, batch[:, :-1]).tobytes() == logits.tobytes()
    assert loss_only(cfg, params, batch) == loss
    assert not np.isnan(logits).any()


def test_training_steps_reusing_buffers_match_fresh_ones() -> None:
    from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash

    cfg = SMALL
    runs = []
    for reuse in (False, True):
        params = init_params(cfg, 0)
        opt = DaisyAdam(AdamConfig(lr=1e-2), params.size)
        grad = np.empty_like(params)
        for step in range(4):
            batch = _batch(cfg, 4, cfg.seq, seed=step)
            if reuse:
                loss_and_grad(cfg, params, batch, out=grad)
                opt.step(params, grad)
            else:
                opt.step(params, loss_and_grad(cfg, params, batch)[1])
        runs.append(weight_hash(params, opt))
    assert runs[0] == runs[1]


def test_a_new_batch_shape_replaces_the_idle_workspace_of_the_old_one() -> None:
    """A peer whose share of the batch changes must not keep a training workspace for
    each shape it ever had (each one is tens of MB at the demo default)."""
    p = init_params(SMALL, 0)
    workspace._pool.clear()
    loss_and_grad(SMALL, p, _batch(SMALL, 4, 16))
    loss_only(SMALL, p, _batch(SMALL, 4, 16))  # another kind: kept beside it
    loss_and_grad(SMALL, p, _batch(SMALL, 3, 16))
    kinds = sorted((w.shape, w.kind[1]) for w in workspace._pool)
    assert kinds == [((3, 16), True), ((4, 16), False)]
    # and the result does not depend on it: the same bits as with a fresh workspace
    g1 = loss_and_grad(SMALL, p, _batch(SMALL, 4, 16, seed=1))[1]
    workspace._pool.clear()
    assert g1.tobytes() == loss_and_grad(SMALL, p, _batch(SMALL, 4, 16, seed=1))[1].tobytes()


def test_a_new_batch_shape_is_made_only_after_the_old_idle_workspace_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropped after the call with the new shape would still hold both during it."""
    p = init_params(SMALL, 0)
    workspace._pool.clear()
    loss_and_grad(SMALL, p, _batch(SMALL, 4, 16))
    held: list[list[tuple[Any, ...]]] = []
    made = workspace.Workspace.__init__

    def spy(self: workspace.Workspace, *args: Any) -> None:
        held.append([w.key for w in workspace._pool])
        made(self, *args)

    monkeypatch.setattr(workspace.Workspace, "__init__", spy)
    loss_and_grad(SMALL, p, _batch(SMALL, 3, 16))
    assert len(held) == 1 and held[0] == []


def test_workspace_buffers_do_not_overlap_and_start_on_cache_lines() -> None:
    p = init_params(MID, 0)
    workspace._pool.clear()
    loss_and_grad(MID, p, _batch(MID, 5, 12))
    (work,) = workspace._pool
    spans = sorted((b.__array_interface__["data"][0], b.nbytes) for b in work.buffers())
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))
    assert work.mapped() >= sum(n for _, n in spans)


RETURNED = """
import gc
import numpy as np
from daisyweb import model, workspace
from daisyweb.peer.memory import keep_step_buffers, tune_malloc
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
cfg = model.ModelConfig(vocab=2048)  # the demo default
params = model.init_params(cfg, 0)
assert tune_malloc() and keep_step_buffers(params.size)  # as a peer runs
batch = np.random.default_rng(0).integers(0, cfg.vocab, size=(8, cfg.seq + 1))
grad = np.empty_like(params)
model.loss_and_grad(cfg, params, batch, out=grad)
(work,) = workspace._pool
size = sum(b.nbytes for b in work.buffers())
before = anon()
del work
workspace._pool.clear()
gc.collect()
print(size, before - anon())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_dropped_workspace_gives_its_memory_back_to_the_system() -> None:
    """With the peer's malloc settings (``peer.memory``) a workspace's buffers are below
    the mmap threshold: from the heap they would stay resident as holes once freed."""
    r = subprocess.run([sys.executable, "-c", RETURNED], capture_output=True, text=True,
                       timeout=120, check=True,
                       env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    size, returned = map(int, r.stdout.split())
    assert size > 30 << 20  # the demo default's training workspace
    assert returned >= 0.9 * size


def test_out_is_checked() -> None:
    cfg = SMALL
    params = init_params(cfg, 0)
    batch = _batch(cfg, 2, 5)
    for bad in (np.empty(params.size, np.float64), np.empty(params.size - 1, np.float32),
                np.empty((params.size, 1), np.float32), [0.0] * params.size):
        with pytest.raises(ValueError, match="out must be"):
            loss_and_grad(cfg, params, batch, out=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="share memory"):
        loss_and_grad(cfg, params, batch, out=params)
    strided = np.empty(2 * params.size, np.float32)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        loss_and_grad(cfg, params, batch, out=strided)
    with pytest.raises(ValueError, match="float64"):
        loss_and_grad(cfg, params, batch, exact=True, out=np.empty(params.size, np.float32))


@pytest.mark.parametrize("repeats", [1, 3, model._SCATTER_RANKS + 5])
def test_scatter_rows_is_add_at_bit_for_bit(repeats: int) -> None:
    rng = np.random.default_rng(repeats)
    index = np.concatenate([rng.integers(0, 30, 200), np.full(repeats, 7)])
    rng.shuffle(index)
    rows = rng.standard_normal((index.size, 6)).astype(np.float32)
    rows[::17] = -0.0  # a row of negative zeros: add.at leaves +0.0 where it is alone
    want = np.zeros((30, 6), np.float32)
    np.add.at(want, index, rows)
    got = np.zeros((30, 6), np.float32)
    model._scatter_rows(got, index, rows)
    assert got.tobytes() == want.tobytes()


def test_halves_depend_on_the_batch_size_only() -> None:
    assert parallel.halves(1) == [slice(0, 1)]
    assert parallel.halves(8) == [slice(0, 4), slice(4, 8)]
    assert parallel.halves(5) == [slice(0, 3), slice(3, 5)]


def test_parallel_both_runs_everything_and_reraises() -> None:
    before = parallel.cores()
    try:
        for n in (1, 2):
            parallel.set_cores(n)
            seen: list[int] = []
            parallel.both(lambda s=seen: s.append(1), lambda s=seen: s.append(2))
            assert sorted(seen) == [1, 2]

            def boom() -> None:
                raise RuntimeError("second half failed")

            with pytest.raises(RuntimeError, match="second half"):
                parallel.both(lambda: None, boom)
            # nested use from inside a half runs in turn instead of waiting on itself
            inner: list[int] = []
            parallel.both(lambda: None,
                          lambda i=inner: parallel.both(lambda: i.append(1),
                                                        lambda: i.append(2)))
            assert inner == [1, 2]
    finally:
        parallel.set_cores(before)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            parallel.set_cores(bad)  # type: ignore[arg-type]


def test_parallel_both_from_two_threads_at_once() -> None:
    """A second caller while the helper thread is taken runs its halves in turn: each
    call still runs both of its own halves exactly once, and nobody waits forever."""
    import threading

    before = parallel.cores()
    parallel.set_cores(2)
    try:
        holding, release = threading.Event(), threading.Event()
        seen_a: list[str] = []
        seen_b: list[tuple[str, bool]] = []

        def a_first() -> None:
            holding.set()
            assert release.wait(10)
            seen_a.append("first")

        def caller_a() -> None:
            parallel.both(a_first, lambda: seen_a.append("second"))

        ta = threading.Thread(target=caller_a)
        ta.start()
        assert holding.wait(10)  # A is inside both(), the helper thread is taken
        me = threading.current_thread()
        parallel.both(lambda: seen_b.append(("first", threading.current_thread() is me)),
                      lambda: seen_b.append(("second", threading.current_thread() is me)))
        assert seen_b == [("first", True), ("second", True)]  # in turn, on this thread
        release.set()
        ta.join(10)
        assert not ta.is_alive() and sorted(seen_a) == ["first", "second"]
    finally:
        parallel.set_cores(before)


def test_blas_runs_one_thread_per_call_at_any_core_count() -> None:
    """The model's GEMMs never depend on how OpenBLAS splits them over its threads."""
    get = parallel._openblas_fn("scipy_openblas_get_num_threads64_",
                                "scipy_openblas_get_num_threads")
    if get is None:
        pytest.skip("numpy's BLAS is not the bundled OpenBLAS")
    before = parallel.cores()
    try:
        for n in (2, 1, 2, 1):
            parallel.set_cores(n)
            assert get() == 1, n
    finally:
        parallel.set_cores(before)


def test_one_core_and_two_give_the_same_bytes_on_the_zen_kernels() -> None:
    """The same check in a process whose OpenBLAS loaded the kernel set daisyweb asks
    for on AMD Zen 4 (daisyweb.blascore), where two BLAS threads changed some bits."""
    import os
    import subprocess
    import sys

    code = ("import daisyweb, numpy; from tests.daisyweb import test_model_step as t; "
            "t.test_one_core_and_two_give_the_same_bytes(); print('ok')")
    env = {**os.environ, "OPENBLAS_CORETYPE": "ZEN"}
    env.pop("OPENBLAS_NUM_THREADS", None)
    env.pop("DAISYWEB_THREADS", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-1:] == ["ok"], r.stderr[-2000:]
