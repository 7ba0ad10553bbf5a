import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
import torch

from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash

SIZE = 257


def _grads(seed, steps, size=SIZE):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) for _ in range(steps)]


def _init(seed=0, size=SIZE):
    return np.random.default_rng(seed + 1000).standard_normal(size).astype(np.float32)


_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash
    rng = np.random.default_rng(1234)
    size = 513
    params = rng.standard_normal(size).astype(np.float32)
    opt = DaisyAdam(AdamConfig(lr=3e-3, weight_decay=0.1), size)
    for _ in range(100):
        opt.step(params, rng.standard_normal(size).astype(np.float32))
    sys.stdout.write(params.tobytes().hex() + ":" + opt.m.tobytes().hex() + ":"
                     + opt.v.tobytes().hex() + ":" + repr(opt.beta1_power) + ":"
                     + repr(opt.beta2_power) + ":" + str(opt.step_count) + ":"
                     + weight_hash(params, opt))
    """
)


def test_two_processes_byte_identical():
    outs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                           check=True, timeout=120)
        outs.append(r.stdout)
    assert outs[0] == outs[1]
    assert outs[0].split(":")[5] == "100"


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.8, 0.999)])
def test_matches_torch_adamw(wd, betas):
    lr, eps = 1e-2, 1e-8
    p0 = _init()
    grads = _grads(7, 50)
    params = p0.copy()
    opt = DaisyAdam(AdamConfig(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                               weight_decay=wd), SIZE)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    topt = torch.optim.AdamW([tp], lr=lr, betas=betas, eps=eps, weight_decay=wd,
                             foreach=False)
    for g in grads:
        opt.step(params, g)
        tp.grad = torch.from_numpy(g.copy())
        topt.step()
    st = topt.state[tp]
    np.testing.assert_allclose(params, tp.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.m, st["exp_avg"].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(opt.v, st["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-9)
    assert opt.step_count == int(st["step"]) == 50


def _snapshot(params, opt):
    return (params.copy(), opt.m.copy(), opt.v.copy(), opt.step_count, opt.beta1_power,
            opt.beta2_power, weight_hash(params, opt))


def _same(a, b):
    return (all(np.array_equal(x, y) for x, y in zip(a[:3], b[:3], strict=True)) and a[3:] == b[3:])


@pytest.mark.parametrize(
    "bad",
    [
        lambda g: g.astype(np.float64),
        lambda g: g[:-1].copy(),
        lambda g: np.concatenate([g, g[:1]]),
        lambda g: g.reshape(1, -1),
        lambda g: np.where(np.arange(g.size) == 5, np.float32("nan"), g).astype(np.float32),
        lambda g: np.where(np.arange(g.size) == g.size - 1, np.float32("inf"), g).astype(
            np.float32),
        lambda g: np.where(np.arange(g.size) == 0, np.float32("-inf"), g).astype(np.float32),
        lambda g: list(g),
    ],
)
def test_refusal_leaves_state_untouched(bad):
    params = _init()
    opt = DaisyAdam(AdamConfig(lr=1e-2, weight_decay=0.1), SIZE)
    for g in _grads(3, 3):
        opt.step(params, g)
    before = _snapshot(params, opt)
    g = _grads(4, 1)[0]
    with pytest.raises(ValueError):
        opt.step(params, bad(g))
    assert _same(before, _snapshot(params, opt))
    # still usable afterwards
    opt.step(params, g)
    assert opt.step_count == 4


def test_refuses_bad_params():
    opt = DaisyAdam(AdamConfig(lr=1e-2), SIZE)
    g = _grads(1, 1)[0]
    with pytest.raises(ValueError):
        opt.step(_init().astype(np.float64), g)
    ro = _init()
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        opt.step(ro, g)
    p = _init()
    with pytest.raises(ValueError):
        opt.step(p, p)
    assert opt.step_count == 0 and not opt.m.any() and not opt.v.any()


def test_powers_are_running_products():
    cfg = AdamConfig(lr=1e-3, beta1=0.9, beta2=0.95)
    opt = DaisyAdam(cfg, 4)
    p = np.zeros(4, np.float32)
    e1 = e2 = 1.0
    for _ in range(20):
        opt.step(p, np.ones(4, np.float32))
        e1 *= 0.9
        e2 *= 0.95
    assert opt.beta1_power == e1 and opt.beta2_power == e2
    assert isinstance(opt.beta1_power, float)


def test_hash_changes_with_every_component():
    params = _init()
    opt = DaisyAdam(AdamConfig(lr=1e-2), SIZE)
    for g in _grads(5, 2):
        opt.step(params, g)
    base = weight_hash(params, opt)
    assert base == weight_hash(params.copy(), opt)
    assert len(base) == 64

    def tweak(arr):
        arr = arr.copy()
        arr.view(np.uint32)[10] ^= 1
        return arr

    assert weight_hash(tweak(params), opt) != base
    for name in ("m", "v"):
        orig = getattr(opt, name)
        setattr(opt, name, tweak(orig))
        assert weight_hash(params, opt) != base
        setattr(opt, name, orig)
    for name, val in (("step_count", opt.step_count + 1),
                      ("beta1_power", opt.beta1_power * (1 + 2**-50)),
                      ("beta2_power", opt.beta2_power * (1 + 2**-50))):
        orig = getattr(opt, name)
        setattr(opt, name, val)
        assert weight_hash(params, opt) != base
        setattr(opt, name, orig)
    assert weight_hash(params, opt) == base


def test_state_dict_roundtrip_and_validation():
    cfg = AdamConfig(lr=1e-2, weight_decay=0.01)
    params = _init()
    opt = DaisyAdam(cfg, SIZE)
    grads = _grads(9, 10)
    for g in grads[:5]:
        opt.step(params, g)
    sd = opt.state_dict()
    p2 = params.copy()
    opt2 = DaisyAdam(cfg, SIZE)
    opt2.load_state_dict(sd)
    assert weight_hash(p2, opt2) == weight_hash(params, opt)
    for g in grads[5:]:
        opt.step(params, g)
        opt2.step(p2, g)
    assert weight_hash(p2, opt2) == weight_hash(params, opt)

    fresh = DaisyAdam(cfg, SIZE)
    h0 = weight_hash(np.zeros(SIZE, np.float32), fresh)
    bads = []
    for key, val in (("step", sd["step"] + 1), ("step", -1), ("step", True),
                     ("beta1_power", 0.5), ("m", sd["m"][:-1]),
                     ("v", sd["v"].astype(np.float64)), ("v", -np.abs(sd["v"]) - 1),
                     ("m", np.full(SIZE, np.nan, np.float32)), ("size", SIZE + 1),
                     ("config", {**sd["config"], "lr": 0.5})):
        bads.append({**sd, key: val})
    bads.append({k: v for k, v in sd.items() if k != "m"})
    bads.append({**sd, "extra": 1})
    for bad in bads:
        with pytest.raises(ValueError):
            fresh.load_state_dict(bad)
        assert weight_hash(np.zeros(SIZE, np.float32), fresh) == h0


def test_state_can_be_handed_over_without_copies_and_stays_exact():
    """``state_dict(copy=False)`` / ``load_state_dict(copy=False)`` share m and v (the
    rounds trainer hands states over this way); a read-only array is still copied, since
    step() writes m and v in place."""
    cfg = AdamConfig(lr=1e-2, weight_decay=0.01)
    params, grads = _init(), _grads(3, 6)
    opt = DaisyAdam(cfg, SIZE)
    for g in grads[:3]:
        opt.step(params, g)
    shared = opt.state_dict(copy=False)
    assert shared["m"] is opt.m and shared["v"] is opt.v
    assert opt.state_dict()["m"] is not opt.m
    other = DaisyAdam(cfg, SIZE)
    other.load_state_dict(shared, copy=False)
    assert other.m is opt.m and other.v is opt.v
    frozen = dict(shared, m=opt.m.copy(), v=opt.v.copy())
    frozen["m"].setflags(write=False)
    third = DaisyAdam(cfg, SIZE)
    third.load_state_dict(frozen, copy=False)
    assert third.m is not frozen["m"] and third.v is frozen["v"]
    p2 = params.copy()
    for g in grads[3:]:
        third.step(p2, g)  # steps a copy of the read-only m: no error
        opt.step(params, g)
    assert weight_hash(p2, third) == weight_hash(params, opt)


@pytest.mark.parametrize(
    "kw",
    [dict(lr=0.0), dict(lr=-1.0), dict(lr=float("nan")), dict(lr=1e-3, beta1=1.0),
     dict(lr=1e-3, beta2=-0.1), dict(lr=1e-3, eps=0.0), dict(lr=1e-3, weight_decay=-1.0),
     dict(lr="0.1"), dict(lr=True), dict(lr=1.0, weight_decay=1.0)],
)
def test_config_validation(kw):
    with pytest.raises(ValueError):
        AdamConfig(**kw)


def test_config_frozen():
    cfg = AdamConfig(lr=1e-3)
    with pytest.raises(AttributeError):
        cfg.lr = 1.0


def test_optim_never_imports_torch():
    code = ("import sys, numpy as np\n"
            "from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash\n"
            "o = DaisyAdam(AdamConfig(lr=1e-3), 3); p = np.zeros(3, np.float32)\n"
            "o.step(p, np.ones(3, np.float32)); weight_hash(p, o)\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_optimizer_built_from_a_state_is_that_state_without_zero_moments():
    """``DaisyAdam(config, size, state)`` is a fresh one after ``load_state_dict(state)``
    (the same refusals), and never makes the zero moments a fresh one starts from: at
    the demo default those are 10.6 MB held for nothing at every round boundary."""
    cfg = AdamConfig(lr=1e-2, weight_decay=0.01)
    params, grads = _init(), _grads(4, 8)
    opt = DaisyAdam(cfg, SIZE)
    for g in grads[:4]:
        opt.step(params, g)
    sd = opt.state_dict()
    built = DaisyAdam(cfg, SIZE, sd)
    assert built.m is not sd["m"] and weight_hash(params, built) == weight_hash(params, opt)
    adopted = DaisyAdam(cfg, SIZE, opt.state_dict(), copy=False)
    p2 = params.copy()
    for g in grads[4:]:
        opt.step(params, g)
        adopted.step(p2, g)
    assert weight_hash(p2, adopted) == weight_hash(params, opt)
    for bad in ({**sd, "step": sd["step"] + 1}, {**sd, "m": sd["m"][:-1]}, {**sd, "x": 1}):
        with pytest.raises(ValueError):
            DaisyAdam(cfg, SIZE, bad)

    big = 1 << 20  # 4 MiB a moment
    state = DaisyAdam(cfg, big).state_dict()
    tracemalloc.start()
    try:
        DaisyAdam(cfg, big, state, copy=False)
        _, peak_adopted = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        DaisyAdam(cfg, big, state)
        _, peak_copied = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    moment = 4 * big
    assert peak_adopted < moment  # no zeros (8 MiB), only small checking temporaries
    assert peak_copied < 3 * moment  # the two copies and temporaries, no zeros besides
