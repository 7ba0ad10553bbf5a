import io
import os
import pickle
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch

from daisyweb.checkpoints.checkpoint import (
    FORMAT_VERSION,
    MAGIC,
    Checkpoint,
    CheckpointError,
    TokenizerInfo,
    checkpoint_from_bytes,
    checkpoint_from_tree,
    checkpoint_to_bytes,
    checkpoint_to_file,
    checkpoint_to_tree,
    load_checkpoint,
    make_checkpoint,
    model_diff,
    restore_optimizer,
    save_checkpoint,
)
from daisyweb.checkpoints.ptfile import PtFormatError, load_pt, save_pt
from daisyweb.model import ModelConfig, param_count, param_layout
from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash
from daisyweb.protocol import framing

MODEL = ModelConfig(vocab=50, width=8, layers=1, heads=2, seq=4)
TOK = TokenizerInfo(vocab_size=50, file_hash="ab" * 32)
RUN = {"batch": 4, "steps": 10, "lr": 0.01, "seed": 7, "data": "builtin", "shuffle": True}
ADAM = AdamConfig(lr=1e-2, weight_decay=0.1)


def _grads(seed, n, count):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(count)]


def _state(seed=0, steps=3, model=MODEL):
    n = param_count(model)
    params = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    opt = DaisyAdam(ADAM, n)
    for g in _grads(seed + 100, n, steps):
        opt.step(params, g)
    return params, opt


def _ckpt(seed=0, steps=3, model=MODEL):
    params, opt = _state(seed, steps, model)
    return make_checkpoint(model, TOK, params, opt, RUN)


def _tree():
    """A fresh, valid on-disk tree whose arrays we may modify freely."""
    tree = checkpoint_to_tree(_ckpt())
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in tree.items()}


def _pt(tree) -> bytes:
    buf = io.BytesIO()
    save_pt(buf, tree)
    return buf.getvalue()


def _flat(tree, model=MODEL):
    return np.concatenate([tree["params." + n].reshape(-1) for n, _ in param_layout(model)])


def _rehash(tree, model=MODEL):
    """Recompute the stored weight hash from whatever the tree holds (even invalid Adam
    state), so only the guard under test can refuse the file."""
    adam = tree["adam"]
    opt = DaisyAdam(ADAM, param_count(model))
    opt.m, opt.v = adam["m"], adam["v"]
    opt.step_count, opt.beta1_power, opt.beta2_power = (
        adam["step"], adam["beta1_power"], adam["beta2_power"])
    tree["weight_hash"] = weight_hash(_flat(tree, model), opt)
    return tree


def _refused(tree, match, **kw):
    with pytest.raises(CheckpointError, match=match):
        checkpoint_from_bytes(_pt(tree), **kw)


def _rezip(src: bytes, pkl: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else zin.read(info)
            zout.writestr(info.filename, data)
    return out.getvalue()


# ---------------------------------------------------------------------------- round trips
def test_unmodified_tree_loads():
    # Control for every refusal test below: the helpers themselves produce a good file.
    back = checkpoint_from_bytes(_pt(_rehash(_tree())))
    assert back == _ckpt()


def test_roundtrip_exact(tmp_path):
    params, opt = _state()
    ckpt = make_checkpoint(MODEL, TOK, params, opt, RUN)
    assert ckpt.step == 3 and ckpt.weight_hash == weight_hash(params, opt)
    path = tmp_path / "a.pt"
    save_checkpoint(path, ckpt)
    for back in (load_checkpoint(path), checkpoint_from_bytes(checkpoint_to_bytes(ckpt))):
        assert isinstance(back, Checkpoint)
        assert back.params.dtype == np.float32 and back.params.shape == params.shape
        assert back.params.tobytes() == params.tobytes()
        assert back.adam["m"].tobytes() == opt.m.tobytes()
        assert back.adam["v"].tobytes() == opt.v.tobytes()
        assert back.adam["beta1_power"] == opt.beta1_power
        assert back.adam["beta2_power"] == opt.beta2_power
        assert back.weight_hash == ckpt.weight_hash
        assert back.model == MODEL and back.tokenizer == TOK and back.step == 3
        assert back.run == RUN and type(back.run["shuffle"]) is bool
        assert back == ckpt
        restored = restore_optimizer(back)
        assert weight_hash(back.params, restored) == weight_hash(params, opt)


def test_bytes_are_deterministic():
    a, b = checkpoint_to_bytes(_ckpt()), checkpoint_to_bytes(_ckpt())
    assert a == b
    assert checkpoint_to_bytes(_ckpt(seed=1)) != a


def test_a_writers_check_reads_the_weights_in_place_only_from_one_flat_buffer():
    ck = _ckpt()
    tree = checkpoint_to_tree(ck)
    assert checkpoint_from_tree(tree, _copy=False).params is ck.params  # no copy
    assert checkpoint_from_tree(tree).params is not ck.params  # the default copies
    # tensors that are not consecutive views of one writable buffer: assembled as before
    apart = {k: (v.copy() if isinstance(v, np.ndarray) and k.startswith("params.") else v)
             for k, v in tree.items()}
    frozen = ck.params.copy()
    frozen.flags.writeable = False
    read_only = dict(tree, **{k: frozen[a:b].reshape(v.shape) for k, v, a, b in _spans(tree)})
    for other in (apart, read_only):
        back = checkpoint_from_tree(other, _copy=False)
        assert back.params is not ck.params and back.params is not frozen
        assert np.array_equal(back.params, ck.params) and back.params.flags.writeable


def _spans(tree):
    off = 0
    for k, v in tree.items():
        if k.startswith("params."):
            yield k, v, off, off + v.size
            off += v.size


def test_a_checkpoint_written_to_a_file_is_the_same_bytes(tmp_path):
    # What a leader's snapshot file and save_pt's streamed file hold (ptfile.write_pt).
    with open(tmp_path / "c.pt", "w+b") as f:
        checkpoint_to_file(_ckpt(), f)
    assert (tmp_path / "c.pt").read_bytes() == checkpoint_to_bytes(_ckpt())
    save_pt(tmp_path / "t.pt", _tree())
    assert (tmp_path / "t.pt").read_bytes() == _pt(_tree())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "t.pt"]  # no temp left


def test_restored_optimizer_continues_identically(tmp_path):
    n = param_count(MODEL)
    grads = _grads(42, n, 6)
    params_a = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    params_b = params_a.copy()
    opt_a, opt_b = DaisyAdam(ADAM, n), DaisyAdam(ADAM, n)
    for g in grads[:3]:
        opt_a.step(params_a, g)
        opt_b.step(params_b, g)
    path = tmp_path / "mid.pt"
    save_checkpoint(path, make_checkpoint(MODEL, TOK, params_b, opt_b, RUN))
    del params_b, opt_b
    back = load_checkpoint(path, expect_model=MODEL, expect_tokenizer=TOK)
    params_b, opt_b = back.params, restore_optimizer(back)
    assert opt_b.config == ADAM and opt_b.step_count == 3
    for g in grads[3:]:
        opt_a.step(params_a, g)
        opt_b.step(params_b, g)
        assert params_b.tobytes() == params_a.tobytes()
        assert weight_hash(params_b, opt_b) == weight_hash(params_a, opt_a)
    assert opt_b.step_count == 6


def test_make_checkpoint_copies_arrays():
    params, opt = _state()
    ckpt = make_checkpoint(MODEL, TOK, params, opt, RUN)
    before = checkpoint_to_bytes(ckpt)
    params += 1.0
    opt.step(params, np.ones_like(params))
    RUN_copy = dict(RUN)
    assert checkpoint_to_bytes(ckpt) == before  # still valid, still the same state
    assert RUN_copy == RUN


def test_torch_load_weights_only(tmp_path):
    params, opt = _state()
    ckpt = make_checkpoint(MODEL, TOK, params, opt, RUN)
    path = tmp_path / "t.pt"
    save_checkpoint(path, ckpt)
    t = torch.load(path, weights_only=True)
    layout = param_layout(MODEL)
    assert list(t) == ["magic", "format_version", "model", "tokenizer", "step", "weight_hash",
                       "run", "adam"] + ["params." + n for n, _ in layout]
    assert t["magic"] == MAGIC and t["format_version"] == FORMAT_VERSION
    assert t["model"] == MODEL.to_dict()
    assert t["tokenizer"] == {"vocab_size": 50, "file_hash": TOK.file_hash}
    assert t["step"] == 3 and t["weight_hash"] == ckpt.weight_hash and t["run"] == RUN
    off = 0
    for name, shape in layout:
        ten = t["params." + name]
        assert isinstance(ten, torch.Tensor) and ten.dtype == torch.float32
        assert tuple(ten.shape) == shape
        size = int(np.prod(shape))
        assert torch.equal(ten, torch.from_numpy(params[off:off + size].reshape(shape)))
        off += size
    assert off == params.size
    flat = torch.cat([t["params." + n].reshape(-1) for n, _ in layout])
    assert flat.numpy().tobytes() == params.tobytes()
    adam = t["adam"]
    assert adam["config"] == ADAM.to_dict() and adam["size"] == params.size
    assert adam["step"] == 3
    assert adam["beta1_power"] == opt.beta1_power and adam["beta2_power"] == opt.beta2_power
    assert adam["m"].dtype == torch.float32 and tuple(adam["m"].shape) == (params.size,)
    assert adam["m"].numpy().tobytes() == opt.m.tobytes()
    assert adam["v"].numpy().tobytes() == opt.v.tobytes()


def test_checkpoint_module_never_imports_torch(tmp_path):
    code = (
        "import sys, numpy as np\n"
        "from daisyweb.checkpoints.checkpoint import *\n"
        "from daisyweb.model import ModelConfig, param_count\n"
        "from daisyweb.optim import AdamConfig, DaisyAdam\n"
        "m = ModelConfig(vocab=50, width=8, layers=1, heads=2, seq=4)\n"
        "p = np.zeros(param_count(m), np.float32)\n"
        "c = make_checkpoint(m, TokenizerInfo(50, 'ab'), p, DaisyAdam(AdamConfig(0.1), p.size),"
        " {})\n"
        "save_checkpoint(sys.argv[1], c)\n"
        "assert load_checkpoint(sys.argv[1]) == c\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "n.pt")], check=True,
                   timeout=60)


def test_bytes_travel_framed_and_are_checked_against_what_was_announced():
    model = ModelConfig(vocab=64, width=16, layers=2, heads=2, seq=8)
    ckpt = _ckpt(seed=3, model=model)
    payload = checkpoint_to_bytes(ckpt)
    frames = framing.frame(payload, msg_id=9)
    assert len(frames) >= 3 and all(len(f) <= framing.MAX_FRAME for f in frames)
    order = np.random.default_rng(0).permutation(len(frames))
    r = framing.Reassembler()
    out = [r.feed(frames[i]) for i in order]
    assert all(o is None for o in out[:-1]) and out[-1] is not None
    got = out[-1]
    assert got == payload
    back = checkpoint_from_bytes(got, expect_model=model, expect_tokenizer=TOK,
                                 expect_step=ckpt.step, expect_weight_hash=ckpt.weight_hash)
    assert back == ckpt
    # a valid checkpoint that is not the announced state is refused
    with pytest.raises(CheckpointError, match="at step 3, expected step 4"):
        checkpoint_from_bytes(got, expect_step=4)
    other = _ckpt(seed=4, model=model).weight_hash
    with pytest.raises(CheckpointError, match="differs from the expected " + other[:16]):
        checkpoint_from_bytes(got, expect_weight_hash=other)
    # a joiner also refuses a payload that is not the checkpoint it claims to be
    with pytest.raises(CheckpointError):
        checkpoint_from_bytes(got[:-1])


# ---------------------------------------------------------------------------- atomic save
def _dir_names(path):
    return sorted(os.listdir(path))


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_failed_save_keeps_old_file_and_no_temp(tmp_path, monkeypatch, where):
    path = tmp_path / "run.pt"
    old = _ckpt(seed=1)
    save_checkpoint(path, old)
    old_bytes = path.read_bytes()
    new = _ckpt(seed=2)
    real_write, calls = os.write, []

    def half_write(fd, data):
        # Write part of the data for real, then fail like a full disk.
        calls.append(len(data))
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    def fail(*a, **k):
        calls.append(1)
        raise OSError(5, "Input/output error")

    target = {"write": "write", "fsync": "fsync", "replace": "replace"}[where]
    monkeypatch.setattr(os, target, half_write if where == "write" else fail)
    with pytest.raises(CheckpointError, match="previous file is unchanged"):
        save_checkpoint(path, new)
    monkeypatch.undo()
    assert calls, "the failure was not injected"
    assert path.read_bytes() == old_bytes
    assert _dir_names(tmp_path) == ["run.pt"]
    assert load_checkpoint(path) == old
    save_checkpoint(path, new)  # and the next save works
    assert load_checkpoint(path) == new
    assert _dir_names(tmp_path) == ["run.pt"]


def test_interrupted_save_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "run.pt"
    save_checkpoint(path, _ckpt(seed=1))
    old_bytes = path.read_bytes()
    real_write = os.write

    def interrupted(fd, data):
        real_write(fd, bytes(data[:100]))
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, _ckpt(seed=2))
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert _dir_names(tmp_path) == ["run.pt"]


def test_save_refuses_invalid_checkpoint_before_touching_disk(tmp_path):
    ckpt = _ckpt()
    ckpt.params[0] = np.nextafter(ckpt.params[0], np.float32(np.inf))
    with pytest.raises(CheckpointError, match="weight hash mismatch"):
        save_checkpoint(tmp_path / "x.pt", ckpt)
    assert _dir_names(tmp_path) == []
    with pytest.raises(CheckpointError, match="cannot create"):
        save_checkpoint(tmp_path / "no-such-dir" / "x.pt", _ckpt())


def demo_checkpoint() -> Checkpoint:
    """A checkpoint of the demo default's size (16 MB): weights and both moments."""
    cfg = ModelConfig(vocab=2048)  # the built-in tokenizer's, the demo's dimensions
    n = param_count(cfg)
    params = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    opt = DaisyAdam(AdamConfig(lr=5e-3), n)
    opt.step(params, np.random.default_rng(1).standard_normal(n).astype(np.float32))
    run = {"batch": 8, "steps": 300, "lr": 5e-3, "seed": 0, "data": "builtin"}
    tok = TokenizerInfo(vocab_size=2048, file_hash="ab" * 32)
    return make_checkpoint(cfg, tok, params, opt, run)


def test_a_save_writes_the_archive_as_it_encodes_it(tmp_path):
    """save_checkpoint never holds the archive (16 MB at the demo default) in memory:
    what it allocates is the reader's checks' masks (~2.5 MB)."""
    ckpt = demo_checkpoint()
    tracemalloc.start()
    try:
        save_checkpoint(tmp_path / "a.pt", ckpt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4_000_000, peak
    assert (tmp_path / "a.pt").read_bytes() == checkpoint_to_bytes(ckpt)


def test_saved_file_has_normal_permissions(tmp_path):
    save_checkpoint(tmp_path / "a.pt", _ckpt())
    (tmp_path / "b").write_bytes(b"")
    assert (tmp_path / "a.pt").stat().st_mode == (tmp_path / "b").stat().st_mode


def _temps(path):
    return sorted(p for p in os.listdir(path) if p.endswith(".tmp"))


def test_the_temp_file_is_private_while_it_is_written(tmp_path, monkeypatch):
    modes, real_write = [], os.write

    def write(fd, data):
        modes.extend(os.stat(tmp_path / t).st_mode & 0o777 for t in _temps(tmp_path))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    save_checkpoint(tmp_path / "run.pt", _ckpt())
    monkeypatch.undo()
    assert modes and set(modes) == {0o600}
    assert _dir_names(tmp_path) == ["run.pt"]


_KILLED_SAVE = """
import os, sys, time
import numpy as np
from daisyweb.checkpoints.checkpoint import TokenizerInfo, make_checkpoint, save_checkpoint
from daisyweb.model import ModelConfig, param_count
from daisyweb.optim import AdamConfig, DaisyAdam
model = ModelConfig(vocab=50, width=8, layers=1, heads=2, seq=4)
n = param_count(model)
ckpt = make_checkpoint(model, TokenizerInfo(50, "ab" * 32), np.zeros(n, np.float32),
                       DaisyAdam(AdamConfig(lr=1e-2), n), {"batch": 4})
real_write = os.write
def stalled(fd, data):  # a disk that stops: the parent kills us mid-write
    real_write(fd, bytes(data[:10]))
    print("writing", flush=True)
    time.sleep(600)
os.write = stalled
save_checkpoint(sys.argv[1], ckpt)
"""


def test_a_save_killed_mid_write_leaves_a_private_temp_the_next_save_removes(tmp_path):
    path = tmp_path / "run.pt"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait()
    (litter,) = _temps(tmp_path)
    assert litter.startswith(f".run.pt.{proc.pid}.")
    assert os.stat(tmp_path / litter).st_mode & 0o777 == 0o600
    save_checkpoint(path, _ckpt())
    assert _dir_names(tmp_path) == ["run.pt"]
    assert load_checkpoint(path) == _ckpt()


def test_only_temps_of_this_target_from_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = [f".run.pt.{dead.pid}.0123abcd.tmp",  # removed
                 f".run.pt.{alive.pid}.0123abcd.tmp",  # another save may be writing it
                 f".run.pt.{os.getpid()}.0123abcd.tmp",  # this process's: the same
                 f".other.pt.{dead.pid}.0123abcd.tmp",  # another target's
                 f".run.pt.{dead.pid}.tmp", "run.pt.tmp", "notes.txt"]  # not ours
        for name in names:
            (tmp_path / name).write_bytes(b"x")
        save_checkpoint(tmp_path / "run.pt", _ckpt())
    finally:
        alive.kill()
        alive.wait()
    assert _dir_names(tmp_path) == sorted(["run.pt", *names[1:]])


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("data", [
    b"", b"not a zip at all", b"PK\x03\x04" + b"\x00" * 40, b"\x89PNG\r\n\x1a\n" + b"\x00" * 64,
    np.random.default_rng(1).bytes(5000)], ids=["empty", "text", "zip-header", "png", "random"])
def test_not_a_zip_refused(data):
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        checkpoint_from_bytes(data)


def test_other_zip_refused():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("notes/readme.txt", "hello")
    with pytest.raises(CheckpointError, match="not a readable checkpoint.*missing"):
        checkpoint_from_bytes(buf.getvalue())


def test_truncated_refused(tmp_path):
    raw = checkpoint_to_bytes(_ckpt())
    points = [1, 30, 200, len(raw) // 3, len(raw) // 2, len(raw) - 200, len(raw) - 22,
              len(raw) - 1]
    for n in points:
        with pytest.raises(CheckpointError, match="not a readable checkpoint"):
            checkpoint_from_bytes(raw[:n])
    path = tmp_path / "t.pt"
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="t.pt.*not a readable checkpoint"):
        load_checkpoint(path)


def test_missing_file_refused(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*nope.pt"):
        load_checkpoint(tmp_path / "nope.pt")


def test_flipped_byte_in_storage_refused():
    raw = bytearray(checkpoint_to_bytes(_ckpt()))
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as zf:
        info = zf.getinfo("archive/data/0")
    off = info.header_offset
    nlen, elen = struct.unpack("<HH", raw[off + 26:off + 30])
    raw[off + 30 + nlen + elen] ^= 0x01
    with pytest.raises(CheckpointError):
        checkpoint_from_bytes(bytes(raw))


class _System:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Exec:
    def __reduce__(self):
        return (exec, ("import os; os.environ['DAISYWEB_PWNED'] = '1'",))


def _would_run(payload: bytes, check: str) -> str:
    """Unpickle ``payload`` with the *plain* unpickler in a child process: proof it is live."""
    code = ("import pickle, sys, os; pickle.loads(bytes.fromhex(sys.argv[1])); "
            f"print({check})")
    out = subprocess.run([sys.executable, "-c", code, payload.hex()], check=True, timeout=60,
                         capture_output=True, text=True)
    return out.stdout.strip()


def test_malicious_reduce_refused_and_not_run(tmp_path):
    monkey_env = os.environ.pop("DAISYWEB_PWNED", None)
    assert monkey_env is None
    probe = tmp_path / "probe"
    assert _would_run(pickle.dumps(_System(probe), protocol=2), "1") == "1"
    assert probe.exists()
    assert _would_run(pickle.dumps(_Exec(), protocol=2),
                      "os.environ.get('DAISYWEB_PWNED')") == "1"
    marker = tmp_path / "pwned"
    valid = checkpoint_to_bytes(_ckpt())
    payloads = [
        pickle.dumps(_System(marker), protocol=2),
        pickle.dumps(_Exec(), protocol=2),
        # hidden inside otherwise plausible checkpoint metadata
        pickle.dumps({"magic": MAGIC, "format_version": 1, "run": {"x": _System(marker)}},
                     protocol=2),
        pickle.dumps({"magic": MAGIC, "run": [_Exec()]}, protocol=4),
    ]
    for pkl in payloads:
        with pytest.raises(CheckpointError, match="not a safe checkpoint: refusing global "
                                                  "(posix|os|nt|builtins|__builtin__)\\."):
            checkpoint_from_bytes(_rezip(valid, pkl))
    assert not marker.exists()
    assert "DAISYWEB_PWNED" not in os.environ


@pytest.mark.parametrize("module,name", [
    ("builtins", "eval"), ("builtins", "getattr"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy", "dtype"), ("torch", "load"), ("torch._utils", "_rebuild_parameter"),
    ("torch.nn.modules.linear", "Linear"), ("collections", "defaultdict"),
    ("daisyweb.checkpoints.checkpoint", "save_checkpoint")])
def test_unknown_global_refused(module, name):
    pkl = (pickle.PROTO + b"\x02" + pickle.GLOBAL + f"{module}\n{name}\n".encode()
           + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP)
    with pytest.raises(CheckpointError, match=f"not a safe.*refusing global {module}.{name}"):
        checkpoint_from_bytes(_rezip(checkpoint_to_bytes(_ckpt()), pkl))


def test_plain_torch_file_refused(tmp_path):
    path = tmp_path / "sd.pt"
    sd = torch.nn.Linear(3, 2).state_dict()
    torch.save(sd, path)
    # Regression (ptfile): a real state_dict carries a ``_metadata`` attribute and was
    # refused as "unexpected OrderedDict attributes"; it reads now and is refused by magic.
    plain = load_pt(path)
    assert plain["weight"].tobytes() == sd["weight"].numpy().tobytes()
    with pytest.raises(CheckpointError, match="no 'magic'.*plain PyTorch"):
        load_checkpoint(path)
    torch.save([torch.zeros(2)], path)
    with pytest.raises(CheckpointError, match="holds a list"):
        load_checkpoint(path)


@pytest.mark.parametrize("magic", ["daisyweb-checkpoinX", "", "DAISYWEB-CHECKPOINT", 1,
                                   np.zeros(2, np.float32)])
def test_wrong_magic_refused(magic):
    tree = _rehash(_tree())
    tree["magic"] = magic
    _refused(tree, "not a daisyweb checkpoint: magic")


@pytest.mark.parametrize("version", [0, 2, 99, "1", 1.0, True, None])
def test_unsupported_version_refused(version):
    tree = _rehash(_tree())
    tree["format_version"] = version
    _refused(tree, "unsupported checkpoint format version")


@pytest.mark.parametrize("key", ["format_version", "model", "tokenizer", "step",
                                 "weight_hash", "run", "adam"])
def test_missing_metadata_refused(key):
    tree = _rehash(_tree())
    del tree[key]
    if key == "format_version":
        _refused(tree, "unsupported checkpoint format version None")
    else:
        _refused(tree, f"checkpoint is missing '{key}'")


@pytest.mark.parametrize("name", ["wte", "h0.attn.w_qkv", "h0.mlp.b_out", "head.w"])
def test_missing_tensor_refused(name):
    tree = _rehash(_tree())
    del tree["params." + name]
    _refused(tree, f"missing 1 parameter tensor.*params.{name}")


def test_unexpected_entry_refused():
    tree = _rehash(_tree())
    tree["params.h1.ln1.g"] = np.zeros(8, np.float32)
    _refused(tree, "unexpected entries.*params.h1.ln1.g")


@pytest.mark.parametrize("name,value", [
    ("head.w", "transpose"),  # same element count, wrong shape
    ("wte", np.zeros((51, 8), np.float32)),
    ("h0.ln1.g", np.zeros((1, 8), np.float32)),
    ("wpe", np.zeros((4, 8), np.float64)),
    ("lnf.b", [0.0] * 8),
])
def test_tensor_shape_mismatch_refused(name, value):
    tree = _tree()
    key = "params." + name
    tree[key] = np.ascontiguousarray(tree[key].T) if isinstance(value, str) else value
    if isinstance(value, str):
        _rehash(tree)  # flat bytes differ after transposing: keep the hash consistent
    _refused(tree, f"tensor {key} is .* needs float32")


def test_config_not_matching_tensors_refused():
    tree = _rehash(_tree())
    tree["model"] = dict(tree["model"], width=16, heads=2)
    _refused(tree, "tensor params.wte is float32 \\(50, 8\\).*needs float32 \\(50, 16\\)")


@pytest.mark.parametrize("model", [{"vocab": 50, "width": 8, "layers": 1, "heads": 2},
                                   {"vocab": 50, "width": 8, "layers": 1, "heads": 3, "seq": 4},
                                   {"vocab": 0, "width": 8, "layers": 1, "heads": 2, "seq": 4},
                                   [50, 8, 1, 2, 4]])
def test_bad_model_config_refused(model):
    tree = _rehash(_tree())
    tree["model"] = model
    _refused(tree, "bad model config")


@pytest.mark.parametrize("change", [dict(width=16), dict(vocab=51), dict(layers=2),
                                    dict(heads=4), dict(seq=8)])
def test_expect_model_mismatch_refused(change):
    data = checkpoint_to_bytes(_ckpt())
    other = ModelConfig(**dict(MODEL.to_dict(), **change))
    field = next(iter(change))
    with pytest.raises(CheckpointError, match=f"differs from the expected.*{field} "
                                              f"{getattr(MODEL, field)} vs {change[field]}"):
        checkpoint_from_bytes(data, expect_model=other)
    assert checkpoint_from_bytes(data, expect_model=MODEL).model == MODEL


def test_model_diff():
    assert model_diff(MODEL, MODEL) == ""
    wide = ModelConfig(vocab=50, width=16, layers=1, heads=4, seq=4)
    assert model_diff(MODEL, wide) == "width 8 vs 16, heads 2 vs 4"


@pytest.mark.parametrize("other", [TokenizerInfo(51, TOK.file_hash),
                                   TokenizerInfo(50, "cd" * 32)])
def test_expect_tokenizer_mismatch_refused(other, tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, _ckpt())
    with pytest.raises(CheckpointError, match="trained with tokenizer"):
        load_checkpoint(path, expect_tokenizer=other)
    assert load_checkpoint(path, expect_tokenizer=TOK).tokenizer == TOK


@pytest.mark.parametrize("tok", [{"vocab_size": 50}, {"vocab_size": 50, "file_hash": ""},
                                 {"vocab_size": -1, "file_hash": "ab"},
                                 {"vocab_size": 60, "file_hash": "ab"}, "ab"])
def test_bad_tokenizer_entry_refused(tok):
    tree = _rehash(_tree())
    tree["tokenizer"] = tok
    _refused(tree, "tokenizer")


@pytest.mark.parametrize("where", ["wte", "head.w", "m", "v", "step"])
def test_weight_hash_mismatch_refused(where):
    tree = _tree()
    if where == "step":  # step, beta powers and Adam state all consistent, hash is not
        n = param_count(MODEL)
        opt = DaisyAdam(ADAM, n)
        opt.load_state_dict(tree["adam"])
        opt.step(_flat(tree).copy(), np.zeros(n, np.float32))
        tree["adam"] = dict(opt.state_dict())
        tree["step"] = 4
    else:  # flip one float to its neighbour (still finite)
        arr = tree["adam"][where] if where in ("m", "v") else tree["params." + where]
        idx = (0,) * arr.ndim
        arr[idx] = np.nextafter(arr[idx], np.float32(np.inf))
    _refused(tree, "weight hash mismatch")


def test_stored_weight_hash_malformed_refused():
    for bad in ["", "XYZ", "AB" * 32, 123]:
        tree = _tree()
        tree["weight_hash"] = bad
        _refused(tree, "weight_hash .* is not a lowercase hex digest")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_params_refused(value):
    tree = _tree()
    tree["params.h0.mlp.w_in"][1, 2] = value
    _rehash(tree)  # the hash matches the poisoned contents: only the NaN guard can refuse
    _refused(tree, "params contain 1 NaN/Inf")


def _adam_bad(kind, tree):
    adam = tree["adam"]
    if kind == "beta_power":
        adam["beta1_power"] = float(np.nextafter(adam["beta1_power"], 1.0))
    elif kind == "negative_v":
        adam["v"][3] = -1e-3
    elif kind == "nan_m":
        adam["m"][0] = np.nan
    elif kind == "short_m":
        adam["m"] = adam["m"][:-1].copy()
    elif kind == "missing_v":
        del adam["v"]
    elif kind == "size":
        adam["size"] += 1
    elif kind == "resized":  # self-consistent Adam state for a different param count
        adam["size"] += 1
        adam["m"] = np.append(adam["m"], np.float32(0))
        adam["v"] = np.append(adam["v"], np.float32(0))
    elif kind == "bad_config":
        adam["config"] = dict(adam["config"], lr=-1.0)
    elif kind == "config_keys":
        adam["config"] = dict(adam["config"], momentum=0.9)
    elif kind == "not_dict":
        tree["adam"] = [1, 2]
    elif kind == "step_mismatch":  # a consistent Adam state at step 2, checkpoint says 3
        n = param_count(MODEL)
        opt = DaisyAdam(ADAM, n)
        p = np.zeros(n, np.float32)
        for g in _grads(0, n, 2):
            opt.step(p, g)
        tree["adam"] = opt.state_dict()
    return tree


ADAM_CASES = ["beta_power", "negative_v", "nan_m", "short_m", "missing_v", "size", "resized",
              "bad_config", "config_keys", "not_dict", "step_mismatch"]


@pytest.mark.parametrize("kind", ADAM_CASES)
def test_inconsistent_adam_refused(kind):
    tree = _adam_bad(kind, _tree())
    if kind not in ("missing_v", "short_m", "not_dict", "resized"):
        _rehash(tree)
    match = "adam state is at step 2 but the checkpoint says 3" if kind == "step_mismatch" \
        else "adam state"
    _refused(tree, match)


@pytest.mark.parametrize("step", [-1, True, 3.0, "3"])
def test_bad_step_refused(step):
    tree = _rehash(_tree())
    tree["step"] = step
    _refused(tree, "step .* is not a non-negative int")


@pytest.mark.parametrize("run", [{"x": None}, {"x": [1]}, {"x": {"y": 1}}, {"": 1},
                                 {"x": float("nan")}, [("x", 1)]])
def test_bad_run_metadata_refused(run):
    tree = _rehash(_tree())
    tree["run"] = run
    _refused(tree, "run metadata")
    params, opt = _state()
    with pytest.raises(CheckpointError, match="run metadata"):
        make_checkpoint(MODEL, TOK, params, opt, run)


# ---------------------------------------------------------------------------- make / restore
def test_make_checkpoint_refusals():
    params, opt = _state()
    bad = params.copy()
    bad[5] = np.nan
    with pytest.raises(CheckpointError, match="NaN/Inf"):
        make_checkpoint(MODEL, TOK, bad, opt, RUN)
    with pytest.raises(CheckpointError, match="flat float32 array"):
        make_checkpoint(MODEL, TOK, params[:-1], opt, RUN)
    with pytest.raises(CheckpointError, match="flat float32 array"):
        make_checkpoint(MODEL, TOK, params.astype(np.float64), opt, RUN)
    with pytest.raises(CheckpointError, match="optimizer size"):
        make_checkpoint(MODEL, TOK, params, DaisyAdam(ADAM, 7), RUN)
    with pytest.raises(CheckpointError, match="tokenizer has 51 tokens"):
        make_checkpoint(MODEL, TokenizerInfo(51, "ab"), params, opt, RUN)
    with pytest.raises(CheckpointError, match="TokenizerInfo"):
        make_checkpoint(MODEL, (50, "ab"), params, opt, RUN)
    with pytest.raises(CheckpointError, match="vocab_size"):
        TokenizerInfo(True, "ab")
    with pytest.raises(CheckpointError, match="file_hash"):
        TokenizerInfo(50, "a\nb")


@pytest.mark.parametrize("kind", ["beta_power", "negative_v", "size", "resized",
                                  "step_mismatch", "missing_v", "not_dict"])
def test_restore_optimizer_refusals(kind):
    ckpt = _ckpt()
    tree = {"adam": dict(ckpt.adam, m=ckpt.adam["m"].copy(), v=ckpt.adam["v"].copy())}
    _adam_bad(kind, tree)
    ckpt.adam = tree["adam"]
    with pytest.raises(CheckpointError, match="adam state"):
        restore_optimizer(ckpt)


def test_to_bytes_refuses_tampered_checkpoint():
    ckpt = _ckpt()
    ckpt.adam["m"][0] += 1.0
    with pytest.raises(CheckpointError, match="weight hash mismatch"):
        checkpoint_to_bytes(ckpt)
    ckpt = _ckpt()
    ckpt.run = {"x": np.float32(1.0)}
    with pytest.raises(CheckpointError, match="run metadata 'x' has type float32"):
        checkpoint_to_bytes(ckpt)


# ---------------------------------------------------------------------------- no mutation
def test_loading_never_touches_caller_state(tmp_path):
    params, opt = _state()
    ckpt = make_checkpoint(MODEL, TOK, params, opt, RUN)
    live_hash = weight_hash(params, opt)
    ckpt_bytes = checkpoint_to_bytes(ckpt)
    bad = bytearray(ckpt_bytes[: len(ckpt_bytes) // 2])
    bad_copy = bytes(bad)
    for attempt in (lambda: checkpoint_from_bytes(bad),
                    lambda: checkpoint_from_bytes(ckpt_bytes, expect_model=ModelConfig(9)),
                    lambda: checkpoint_from_bytes(ckpt_bytes, expect_tokenizer=TokenizerInfo(
                        50, "00"))):
        with pytest.raises(CheckpointError):
            attempt()
    assert bytes(bad) == bad_copy
    assert weight_hash(params, opt) == live_hash
    assert checkpoint_to_bytes(ckpt) == ckpt_bytes
    a = checkpoint_from_bytes(bytearray(ckpt_bytes))
    b = checkpoint_from_bytes(ckpt_bytes)
    for x in (a.params, a.adam["m"], a.adam["v"]):
        assert x.flags.writeable and x.flags.c_contiguous
        for y in (b.params, b.adam["m"], b.adam["v"], params, opt.m, opt.v, ckpt.params):
            assert not np.shares_memory(x, y)
    a.params += 1.0
    a.adam["m"][:] = 0
    assert b == ckpt and weight_hash(params, opt) == live_hash


# ---------------------------------------------------------------------------- ptfile hardening
def _dag_pickle(levels: int) -> bytes:
    # L0 = []; L[k] = [L[k-1], L[k-1]]: 2**levels paths through a tiny pickle.
    pkl = pickle.PROTO + b"\x02" + pickle.EMPTY_LIST
    for _ in range(levels):
        pkl += (pickle.BINPUT + b"\x00" + pickle.POP + pickle.MARK + pickle.BINGET + b"\x00"
                + pickle.BINGET + b"\x00" + pickle.LIST)
    return pkl + pickle.STOP


def test_shared_containers_checked_in_linear_time():
    # Regression (ptfile): the tree check visited every one of the 2**levels paths, so a
    # few hundred bytes at 60 levels hung the reader for ever. 23 levels took ~8 s; now ms.
    raw = _rezip(checkpoint_to_bytes(_ckpt()), _dag_pickle(23))
    t0 = time.perf_counter()
    obj = load_pt(io.BytesIO(raw))
    assert time.perf_counter() - t0 < 1.0
    load_pt(io.BytesIO(_rezip(raw, _dag_pickle(60))))  # and 60 levels still returns
    assert isinstance(obj, list) and len(obj) == 2 and obj[0] is obj[1]
    with pytest.raises(CheckpointError, match="holds a list"):
        checkpoint_from_bytes(raw)
    # true recursion is still refused
    rec = (pickle.PROTO + b"\x02" + pickle.EMPTY_LIST + pickle.BINPUT + b"\x00"
           + pickle.BINGET + b"\x00" + pickle.APPEND + pickle.STOP)
    with pytest.raises(PtFormatError, match="recursive"):
        load_pt(io.BytesIO(_rezip(raw, rec)))


def _tensor(size: int, stride: int, key: bytes = b"0", numel: int = 1) -> bytes:
    return (pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n" + pickle.MARK + pickle.MARK
            + pickle.BINUNICODE + struct.pack("<I", 7) + b"storage"
            + pickle.GLOBAL + b"torch\nFloatStorage\n"
            + pickle.BINUNICODE + struct.pack("<I", len(key)) + key
            + pickle.BINUNICODE + struct.pack("<I", 3) + b"cpu"
            + pickle.BININT + struct.pack("<i", numel) + pickle.TUPLE + pickle.BINPERSID
            + pickle.BININT1 + b"\x00"
            + pickle.MARK + pickle.BININT + struct.pack("<i", size) + pickle.TUPLE
            + pickle.MARK + pickle.BININT + struct.pack("<i", stride) + pickle.TUPLE
            + pickle.NEWFALSE + pickle.NONE + pickle.TUPLE + pickle.REDUCE)


def _one_float_file(pkl: bytes) -> bytes:
    buf = io.BytesIO()
    save_pt(buf, {"w": np.ones(1, np.float32)})
    return _rezip(buf.getvalue(), pkl)


def test_tensor_expansion_bombs_refused():
    # Regression (ptfile): a zero stride, or one storage rebuilt over and over through the
    # memo, made the reader allocate far more than the file holds.
    zero_stride = pickle.PROTO + b"\x02" + _tensor(1 << 26, 0) + pickle.STOP  # 256 MB
    raw = _one_float_file(zero_stride)
    with pytest.raises(CheckpointError, match="max_bytes"):
        checkpoint_from_bytes(raw)
    with pytest.raises(PtFormatError, match="max_bytes"):
        load_pt(io.BytesIO(raw), max_bytes=1 << 20)
    many = (pickle.PROTO + b"\x02" + pickle.EMPTY_LIST + pickle.MARK
            + _tensor(1, 1) * 5000 + pickle.APPENDS + pickle.STOP)
    raw = _one_float_file(many)
    with pytest.raises(PtFormatError, match="max_bytes"):
        load_pt(io.BytesIO(raw), max_bytes=4096)
    assert len(load_pt(io.BytesIO(raw))) == 5000  # within the default limit it is fine
