import collections
import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from daisyweb.checkpoints.ptfile import PtFormatError, load_pt, save_pt

DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.int16, np.int8,
          np.uint8, np.bool_]


def _sample():
    rng = np.random.default_rng(0)
    obj = {
        "meta": {"magic": "daisyweb", "version": 1, "lr": 3e-4, "flag": True, "none": None,
                 "dims": [4, 8, 2**40, -3], "tup": (1, "x")},
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 5), np.float32),
        "nested": collections.OrderedDict(w=rng.standard_normal((3, 4)).astype(np.float32)),
    }
    for i, dt in enumerate(DTYPES):
        a = rng.integers(-100, 100, size=(2, 3, i + 1))
        obj[f"t{i}"] = (a > 0) if dt is np.bool_ else a.astype(dt)
    return obj


def _assert_same_tree(a, b):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _assert_same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same_tree(x, y)
    else:
        assert type(a) is type(b) and a == b


def _to_numpy_tree(t):
    if isinstance(t, torch.Tensor):
        return t.numpy()
    if isinstance(t, dict):
        return type(t)((k, _to_numpy_tree(v)) for k, v in t.items())
    if isinstance(t, (list, tuple)):
        return type(t)(_to_numpy_tree(v) for v in t)
    return t


def test_torch_loads_our_file_exactly(tmp_path):
    obj = _sample()
    path = tmp_path / "ours.pt"
    save_pt(path, obj)
    loaded = torch.load(path, weights_only=True)
    for k, v in obj.items():
        if isinstance(v, np.ndarray):
            assert isinstance(loaded[k], torch.Tensor)
            assert not loaded[k].requires_grad
    _assert_same_tree(obj, _to_numpy_tree(loaded))


def test_roundtrip_ours(tmp_path):
    obj = _sample()
    obj["noncontig"] = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    obj["bigendian"] = np.arange(5, dtype=">i4")
    buf = io.BytesIO()
    save_pt(buf, obj)
    back = load_pt(io.BytesIO(buf.getvalue()))
    obj["noncontig"] = np.ascontiguousarray(obj["noncontig"])
    obj["bigendian"] = obj["bigendian"].astype("<i4")
    _assert_same_tree(obj, back)


def test_output_is_deterministic_and_aligned(tmp_path):
    a, b = io.BytesIO(), io.BytesIO()
    save_pt(a, _sample())
    save_pt(b, _sample())
    raw = a.getvalue()
    assert raw == b.getvalue()
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        names = zf.namelist()
        assert names[0] == "archive/data.pkl"
        assert zf.read("archive/version") == b"3\n"
        assert zf.read("archive/byteorder") == b"little"
        assert "archive/data/0" in names
        for info in zf.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            o = info.header_offset
            nlen, elen = struct.unpack("<HH", raw[o + 26:o + 30])
            assert (o + 30 + nlen + elen) % 64 == 0, info.filename


def test_pickle_references_only_allowed_globals():
    buf = io.BytesIO()
    save_pt(buf, _sample())
    import pickletools

    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        pkl = zf.read("archive/data.pkl")
    globals_ = {arg for op, arg, _ in pickletools.genops(pkl) if op.name == "GLOBAL"}
    allowed = {"collections OrderedDict", "torch._utils _rebuild_tensor_v2"}
    assert all(g in allowed or (g.startswith("torch ") and g.endswith("Storage"))
               for g in globals_), globals_


def test_we_load_torch_save(tmp_path):
    torch.manual_seed(0)
    sd = collections.OrderedDict(
        w=torch.randn(5, 7),
        b=torch.arange(4, dtype=torch.int64),
        i=torch.arange(6, dtype=torch.int32).reshape(2, 3),
        u=torch.arange(10, dtype=torch.uint8),
        d=torch.randn(3, dtype=torch.float64),
        h=torch.randn(3).half(),
        m=torch.tensor([True, False]),
        s=torch.tensor(1.25),
        t=torch.randn(4, 3).t(),
        v=torch.arange(20.0)[5:9],
        meta={"step": 3, "name": "x", "lst": [1.0, None]},
    )
    path = tmp_path / "torch.pt"
    torch.save(sd, path)
    back = load_pt(path)
    assert isinstance(back, collections.OrderedDict)
    _assert_same_tree(_to_numpy_tree(sd), back)
    sd2 = {"model": sd, "opt": {"step": 1}}
    torch.save(sd2, path)
    _assert_same_tree(_to_numpy_tree(sd2), load_pt(path))


def test_shared_storage_from_torch(tmp_path):
    base = torch.arange(10.0)
    path = tmp_path / "shared.pt"
    torch.save({"a": base[:4], "b": base[2:]}, path)
    back = load_pt(path)
    assert back["a"].tolist() == [0, 1, 2, 3]
    assert back["b"].tolist() == list(range(2, 10))
    back["a"][0] = 99  # independent copies
    assert back["b"][0] == 2


def _rezip(src: bytes, replace: dict[str, bytes | None]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            if info.filename in replace:
                data = replace[info.filename]
                if data is None:
                    continue
            else:
                data = zin.read(info)
            zout.writestr(info.filename, data)
    return out.getvalue()


def _valid_bytes():
    buf = io.BytesIO()
    save_pt(buf, {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": 1})
    return buf.getvalue()


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_reduce_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps({"w": _Evil(marker)}, protocol=2)
    # sanity: the payload really would run under a plain unpickler
    probe = tmp_path / "probe"
    subprocess.run([sys.executable, "-c",
                    "import pickle,sys; pickle.loads(bytes.fromhex(sys.argv[1]))",
                    pickle.dumps(_Evil(probe), protocol=2).hex()], check=True, timeout=60)
    assert probe.exists()
    raw = _rezip(_valid_bytes(), {"archive/data.pkl": evil})
    with pytest.raises(PtFormatError, match="posix.system|os.system|refusing"):
        load_pt(io.BytesIO(raw))
    assert not marker.exists()


@pytest.mark.parametrize("module,name", [("builtins", "eval"), ("torch", "load"),
                                         ("torch._utils", "_rebuild_parameter"),
                                         ("numpy", "frombuffer"), ("collections", "Counter"),
                                         ("torch", "Tensor")])
def test_unknown_global_refused(module, name):
    pkl = (pickle.PROTO + b"\x02" + pickle.GLOBAL + f"{module}\n{name}\n".encode()
           + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP)
    raw = _rezip(_valid_bytes(), {"archive/data.pkl": pkl})
    with pytest.raises(PtFormatError, match="refusing global"):
        load_pt(io.BytesIO(raw))


def test_garbage_and_truncated_refused(tmp_path):
    raw = _valid_bytes()
    cases = [b"", b"not a zip at all", raw[: len(raw) // 2], raw[:-10], os.urandom(4096)]
    for data in cases:
        with pytest.raises(PtFormatError):
            load_pt(io.BytesIO(data))
    p = tmp_path / "trunc.pt"
    p.write_bytes(raw[:100])
    with pytest.raises(PtFormatError):
        load_pt(p)
    with pytest.raises(PtFormatError):
        load_pt(tmp_path / "does-not-exist.pt")


def test_corrupted_storage_bytes_refused():
    raw = bytearray(_valid_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as zf:
        info = zf.getinfo("archive/data/0")
    off = info.header_offset
    nlen, elen = struct.unpack("<HH", raw[off + 26:off + 30])
    raw[off + 30 + nlen + elen] ^= 0xFF  # CRC mismatch
    with pytest.raises(PtFormatError):
        load_pt(io.BytesIO(bytes(raw)))


@pytest.mark.parametrize("drop", ["archive/data.pkl", "archive/version", "archive/data/0"])
def test_missing_entries_refused(drop):
    raw = _rezip(_valid_bytes(), {drop: None})
    with pytest.raises(PtFormatError, match="missing"):
        load_pt(io.BytesIO(raw))


def test_short_storage_refused():
    raw = _rezip(_valid_bytes(), {"archive/data/0": b"\x00" * 44})
    with pytest.raises(PtFormatError, match="bytes, expected"):
        load_pt(io.BytesIO(raw))


def _tensor_pkl(size, stride, offset=0, numel=12, extra=b""):
    def tup(xs):
        return pickle.MARK + b"".join(pickle.BININT + struct.pack("<i", x) for x in xs) + \
            pickle.TUPLE

    return (pickle.PROTO + b"\x02" + pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n"
            + pickle.MARK + pickle.MARK + pickle.BINUNICODE + struct.pack("<I", 7) + b"storage"
            + pickle.GLOBAL + b"torch\nFloatStorage\n"
            + pickle.BINUNICODE + struct.pack("<I", 1) + b"0"
            + pickle.BINUNICODE + struct.pack("<I", 3) + b"cpu"
            + pickle.BININT + struct.pack("<i", numel) + pickle.TUPLE + pickle.BINPERSID
            + pickle.BININT + struct.pack("<i", offset) + tup(size) + tup(stride)
            + pickle.NEWFALSE + extra + pickle.NONE + pickle.TUPLE + pickle.REDUCE + pickle.STOP)


def test_handmade_tensor_pickle_ok():
    raw = _rezip(_valid_bytes(), {"archive/data.pkl": _tensor_pkl((3, 4), (4, 1))})
    arr = load_pt(io.BytesIO(raw))
    assert arr.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
    raw = _rezip(_valid_bytes(), {"archive/data.pkl": _tensor_pkl((2, 2), (1, 4), offset=6)})
    assert load_pt(io.BytesIO(raw)).tolist() == [[6, 10], [7, 11]]


@pytest.mark.parametrize(
    "size,stride,offset,numel",
    [((3, 5), (5, 1), 0, 12), ((4, 4), (4, 1), 0, 12), ((12,), (1,), 1, 12), ((3,), (6,), 0, 12),
     ((3, 4), (4,), 0, 12), ((3, 4), (4, 1), 0, 13), ((2,), (-1,), 5, 12)],
)
def test_size_stride_mismatch_refused(size, stride, offset, numel):
    raw = _rezip(_valid_bytes(),
                 {"archive/data.pkl": _tensor_pkl(size, stride, offset, numel)})
    with pytest.raises(PtFormatError):
        load_pt(io.BytesIO(raw))


def test_max_bytes_enforced():
    raw = _valid_bytes()
    load_pt(io.BytesIO(raw), max_bytes=len(raw))
    with pytest.raises(PtFormatError, match="max_bytes"):
        load_pt(io.BytesIO(raw), max_bytes=40)


def test_compressed_entries_refused():
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(_valid_bytes())) as zin, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    with pytest.raises(PtFormatError, match="compressed"):
        load_pt(io.BytesIO(out.getvalue()))


def test_recursive_list_refused():
    # L = []; L.append(L)
    pkl = (pickle.PROTO + b"\x02" + pickle.EMPTY_LIST + pickle.BINPUT + b"\x00"
           + pickle.BINGET + b"\x00" + pickle.APPEND + pickle.STOP)
    raw = _rezip(_valid_bytes(), {"archive/data.pkl": pkl})
    with pytest.raises(PtFormatError, match="nested"):
        load_pt(io.BytesIO(raw))


def test_bad_pickle_refused():
    for pkl in (b"\x80\x02garbage", b"", pickle.PROTO + b"\x02" + pickle.MARK + pickle.STOP):
        raw = _rezip(_valid_bytes(), {"archive/data.pkl": pkl})
        with pytest.raises(PtFormatError):
            load_pt(io.BytesIO(raw))


def test_save_refuses_unsupported_values(tmp_path):
    for bad in ({1: np.zeros(1)}, {"x": object()}, {"x": np.zeros(2, np.complex64)},
                {"x": np.float32(1.0)}, {"x": {1, 2}}):
        with pytest.raises(TypeError):
            save_pt(io.BytesIO(), bad)
    path = tmp_path / "x.pt"
    with pytest.raises(TypeError):
        save_pt(path, {"x": object()})
    assert not path.exists()


def test_ptfile_never_imports_torch(tmp_path):
    code = ("import sys, numpy as np\n"
            "from daisyweb.checkpoints.ptfile import save_pt, load_pt\n"
            "p = sys.argv[1]\n"
            "save_pt(p, {'w': np.ones(3, np.float32)})\n"
            "assert load_pt(p)['w'].tolist() == [1.0, 1.0, 1.0]\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "n.pt")], check=True,
                   timeout=60)


def test_optimizer_state_roundtrips_through_pt(tmp_path):
    from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash

    cfg = AdamConfig(lr=1e-2, weight_decay=0.1)
    params = np.linspace(-1, 1, 33, dtype=np.float32)
    opt = DaisyAdam(cfg, 33)
    rng = np.random.default_rng(2)
    for _ in range(7):
        opt.step(params, rng.standard_normal(33).astype(np.float32))
    path = tmp_path / "ckpt.pt"
    save_pt(path, {"params": params, "optim": opt.state_dict()})
    back = load_pt(path)
    opt2 = DaisyAdam(cfg, 33)
    opt2.load_state_dict(back["optim"])
    assert weight_hash(back["params"], opt2) == weight_hash(params, opt)
    t = torch.load(path, weights_only=True)
    assert torch.equal(t["params"], torch.from_numpy(params))
    assert t["optim"]["step"] == 7
