"""Crafted checkpoints from issue 14 (findings 5, 6, 7) and the bounds that refuse them.

Files that used to take all memory are loaded in a child process under an address-space
limit, so a regression fails the test instead of taking the machine.
"""

import collections
import io
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch

from daisyweb.checkpoints import ptfile, unpickle
from daisyweb.checkpoints.checkpoint import (
    CheckpointError,
    TokenizerInfo,
    checkpoint_from_bytes,
    checkpoint_to_tree,
    make_checkpoint,
)
from daisyweb.checkpoints.ptfile import PtFormatError, load_pt, save_pt
from daisyweb.data import default_tokenizer
from daisyweb.model import ModelConfig, param_count
from daisyweb.optim import AdamConfig, DaisyAdam

MODEL = ModelConfig(vocab=50, width=8, layers=1, heads=2, seq=4)
SHORT = 300  # a refusal is one readable line, whatever the file holds
CHILD_MEMORY = 512 << 20


def _tree(model: ModelConfig = MODEL, tokenizer: TokenizerInfo | None = None) -> dict:
    n = param_count(model)
    params = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    opt = DaisyAdam(AdamConfig(lr=1e-2), n)
    opt.step(params, np.random.default_rng(1).standard_normal(n).astype(np.float32))
    tok = tokenizer or TokenizerInfo(model.vocab, "ab" * 32)
    return checkpoint_to_tree(make_checkpoint(model, tok, params, opt, {"batch": 4}))


def _pt(tree) -> bytes:
    buf = io.BytesIO()
    save_pt(buf, tree)
    return buf.getvalue()


def _with_pickle(src: bytes, pkl: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename,
                          pkl if info.filename.endswith("/data.pkl") else zin.read(info))
    return out.getvalue()


def _data_pkl(raw: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        return zf.read("archive/data.pkl")


def _run_limited(body: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``body`` in a child whose address space is capped (after its imports)."""
    code = ("import resource, sys\n"
            "from daisyweb.checkpoints.checkpoint import CheckpointError, load_checkpoint\n"
            "from daisyweb.cli import generate\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({CHILD_MEMORY}, {CHILD_MEMORY}))\n"
            + textwrap.dedent(body))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


# -------------------------------------------------------------- pickle fragments
def _u(text: str) -> bytes:
    raw = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _i(n: int) -> bytes:
    if -(1 << 31) <= n < 1 << 31:
        return pickle.BININT + struct.pack("<i", n)
    raw = pickle.encode_long(n)
    return pickle.LONG1 + bytes([len(raw)]) + raw


def _ints(values: tuple[int, ...]) -> bytes:
    return pickle.MARK + b"".join(_i(v) for v in values) + pickle.TUPLE


def _put(k: int) -> bytes:
    return pickle.LONG_BINPUT + struct.pack("<I", k)


def _get(k: int) -> bytes:
    return pickle.LONG_BINGET + struct.pack("<I", k)


def _storage(key: str, numel: int) -> bytes:
    return (pickle.MARK + _u("storage") + pickle.GLOBAL + b"torch\nFloatStorage\n" + _u(key)
            + _u("cpu") + _i(numel) + pickle.TUPLE + pickle.BINPERSID)


def _tensor(storage: bytes, offset: int, size: tuple[int, ...],
            stride: tuple[int, ...]) -> bytes:
    return (pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n" + pickle.MARK + storage
            + _i(offset) + _ints(size) + _ints(stride) + pickle.NEWFALSE + pickle.NONE
            + pickle.TUPLE + pickle.REDUCE)


# -------------------------------------------------------------- finding 5
@pytest.mark.parametrize("change,words", [
    (dict(layers=10**8), "layers must be at most 1024, got 100000000"),
    (dict(vocab=1 << 20, width=1 << 12, heads=1), "parameters, more than the limit"),
])
def test_huge_model_config_refused_before_allocation(tmp_path, change, words):
    # Regression (issue 14, finding 5): a 1 KB checkpoint naming 10**8 layers made
    # param_layout() build its list before anything was refused (MemoryError in
    # daisyweb-generate and daisyweb-peer --resume); a huge vocab x width made the reader
    # allocate the parameter buffer.
    tok = default_tokenizer()
    tree = _tree(ModelConfig(vocab=tok.vocab_size, width=8, layers=1, heads=2, seq=4),
                 TokenizerInfo(tok.vocab_size, tok.file_hash))
    tree["model"] = dict(tree["model"], **change)
    path = tmp_path / "huge.pt"
    path.write_bytes(_pt(tree))
    out = _run_limited("sys.exit(generate.main([sys.argv[1]]))", str(path))
    assert out.returncode == 1, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and len(lines[0]) < SHORT + len(str(path)), out.stderr[-2000:]
    assert "bad model config in checkpoint" in lines[0] and words in lines[0]


# -------------------------------------------------------------- finding 6
PLACEHOLDER = "\x00hostile\x00"
HOSTILE_KEY = "\x00hostile-key\x00"


def _many_references(count: int, size: int) -> bytes:
    """A list of ``count`` memo references to one string of ``size`` characters."""
    return (pickle.EMPTY_LIST + _u("x" * size) + _put(9000) + pickle.POP + pickle.MARK
            + _get(9000) * count + pickle.APPENDS)


def _hostile_file(place) -> bytes:
    tree = _tree()
    place(tree)
    pkl = _data_pkl(_pt(tree))
    assert pkl.count(_u(PLACEHOLDER)) + pkl.count(_u(HOSTILE_KEY)) == 1
    pkl = pkl.replace(_u(PLACEHOLDER), _many_references(100_000, 1 << 20))
    pkl = pkl.replace(_u(HOSTILE_KEY), _u("k" * (1 << 20)))
    return _with_pickle(_pt(tree), pkl)


def _set(*path):
    def place(tree):
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = PLACEHOLDER
    return place


HOSTILE_PLACES = {
    "model": _set("model"),
    "model width": _set("model", "width"),
    "tokenizer": _set("tokenizer"),
    "tokenizer vocab_size": _set("tokenizer", "vocab_size"),
    "tokenizer file_hash": _set("tokenizer", "file_hash"),
    "magic": _set("magic"),
    "format_version": _set("format_version"),
    "step": _set("step"),
    "weight_hash": _set("weight_hash"),
    "adam config lr": _set("adam", "config", "lr"),
    "adam size": _set("adam", "size"),
    "extra entry": lambda tree: tree.__setitem__(HOSTILE_KEY, 1),
}


def test_refusals_quote_a_short_prefix_of_hostile_data(tmp_path):
    # Regression (issue 14, finding 6): a 1.5 MB file whose model or tokenizer entry is a
    # list of 100k references to one 1 MB string ran out of memory formatting the refusal
    # ({d!r} in model.py; 2k references already used 2 GB).
    paths = []
    for name, place in HOSTILE_PLACES.items():
        path = tmp_path / f"{name.replace(' ', '_')}.pt"
        path.write_bytes(_hostile_file(place))
        assert path.stat().st_size < 3 << 20
        paths.append(str(path))
    out = _run_limited("""
        for path in sys.argv[1:]:
            try:
                load_checkpoint(path)
            except CheckpointError as exc:
                print(str(exc).replace(path, "PATH"))
            else:
                print("LOADED")
        """, *paths)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == len(HOSTILE_PLACES)
    for name, line in zip(HOSTILE_PLACES, lines, strict=True):
        assert line.startswith("PATH: ") and len(line) < SHORT, (name, line[:SHORT])
        assert "xxxx" not in line or "...(1048576 chars)" in line, (name, line[:SHORT])


def test_model_config_refusal_names_the_problem():
    tree = _tree()
    tree["model"] = ["x" * 1000] * 3
    with pytest.raises(CheckpointError) as exc:
        checkpoint_from_bytes(_pt(tree))
    assert "model config must have vocab/width/layers/heads/seq, got ['xxxx" in str(exc.value)
    assert "...(1000 chars)" in str(exc.value) and len(str(exc.value)) < SHORT


# -------------------------------------------------------------- finding 7
def _two_storages() -> bytes:
    return _pt({"small": np.arange(12, dtype=np.float32),
                "big": np.arange(8192, dtype=np.float32)})


def test_build_cannot_swap_a_storage_for_a_larger_tensor():
    # Regression (issue 14, finding 7): BUILD replaced storage 0's array with an earlier
    # (2, 4096) tensor; a view at offset 1 then passed the element check (8191 < 8192) and
    # read 16 KB past the buffer, because the 2-d array was sliced by rows.
    pkl = (pickle.PROTO + b"\x02"
           + _tensor(_storage("1", 8192), 0, (2, 4096), (4096, 1)) + _put(1) + pickle.POP
           + _storage("0", 12) + _put(0) + pickle.POP
           + _get(0) + pickle.NONE + pickle.EMPTY_DICT + _u("array") + _get(1)
           + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.POP
           + _tensor(_get(0), 1, (8191,), (1,)) + pickle.STOP)
    raw = _with_pickle(_two_storages(), pkl)
    with pytest.raises(PtFormatError, match=r"BUILD on a _Storage \(BUILD at byte \d+\)"):
        load_pt(io.BytesIO(raw))
    with pytest.raises(CheckpointError, match="not a readable checkpoint: bad data.pkl: BUILD"):
        checkpoint_from_bytes(raw)


def test_view_is_checked_against_the_storage_array_itself():
    # Should anything ever replace a storage's array (the attack above, past the pickle
    # machine), the view is still measured against the flat array of its own type.
    storage = ptfile._Storage(np.arange(12, dtype=np.float32))
    assert ptfile._rebuild_tensor_v2([1 << 20], storage, 1, (11,), (1,)).tolist() == \
        list(range(1, 12))
    for replacement in (np.zeros((2, 4096), np.float32), np.zeros(12, np.float64),
                        np.zeros(24, np.float32)[::2]):
        storage.array = replacement
        with pytest.raises(PtFormatError, match="storage is not a flat array of its own type"):
            ptfile._rebuild_tensor_v2([1 << 20], storage, 1, (11,), (1,))


@pytest.mark.parametrize("ops,words", [
    (pickle.EMPTY_DICT + pickle.EMPTY_DICT + pickle.BUILD, "BUILD on a dict"),
    (pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_TUPLE + pickle.REDUCE
     + pickle.EMPTY_DICT + _u("other") + pickle.NONE + pickle.SETITEM + pickle.BUILD,
     "BUILD with other state than one _metadata"),
    (pickle.GLOBAL + b"torch\nFloatStorage\n" + pickle.EMPTY_TUPLE + pickle.REDUCE,
     "call of a _StorageType"),
    (pickle.GLOBAL + b"collections\nOrderedDict\n" + _ints((1,)) + pickle.REDUCE,
     "OrderedDict with arguments"),
    (pickle.EMPTY_LIST + _u("k") + pickle.NONE + pickle.SETITEM, "item assignment to a list"),
    (pickle.EMPTY_DICT + pickle.NONE + pickle.APPEND, "append to a dict"),
    (pickle.EMPTY_DICT + pickle.EMPTY_TUPLE + pickle.NONE + pickle.SETITEM,
     "dict key of type tuple"),
    (pickle.LONG4 + struct.pack("<i", 300) + b"\x01" * 300, "integer of more than 255 bytes"),
    (pickle.INST + b"builtins\nobject\n", "refusing pickle opcode (INST at byte 2)"),
    (pickle.SHORT_BINBYTES + b"\x01x", "refusing pickle opcode (SHORT_BINBYTES"),
    (pickle.EMPTY_SET, "refusing pickle opcode (EMPTY_SET"),
    (pickle.EXT1 + b"\x01", "refusing pickle opcode (EXT1"),
    (pickle.NEWOBJ, "refusing pickle opcode (NEWOBJ"),
    (pickle.NONE + pickle.DUP, "refusing pickle opcode (DUP"),
    (pickle.NONE + pickle.STOP + pickle.NONE, "data after STOP"),
    (pickle.NONE + pickle.NONE, "stack does not end with one value"),
    (_get(3), "memo entry 3 was never stored"),
    (pickle.MARK + pickle.NONE + pickle.POP + pickle.POP + pickle.NONE,
     "ok"),  # POP of an empty MARK drops the mark, as pickle does
])
def test_only_the_shapes_of_a_checkpoint_pickle_are_admitted(ops, words):
    raw = _with_pickle(_two_storages(), pickle.PROTO + b"\x02" + ops + pickle.STOP)
    if words == "ok":
        assert load_pt(io.BytesIO(raw)) is None
        return
    with pytest.raises(PtFormatError) as exc:
        load_pt(io.BytesIO(raw))
    assert words in str(exc.value) and len(str(exc.value)) < SHORT


def test_torch_state_dict_metadata_still_loads(tmp_path):
    sd = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2)).state_dict()
    path = tmp_path / "sd.pt"
    torch.save(sd, path)
    back = load_pt(path)
    assert type(back) is collections.OrderedDict and list(back) == list(sd)
    assert back._metadata == sd._metadata
    torch.save(sd, path, pickle_protocol=4)  # FRAME, MEMOIZE, SHORT_BINUNICODE
    assert list(load_pt(path)) == list(sd)


def test_storage_and_view_bounds():
    raw = _two_storages()
    cases = {
        "tensor has 33 dimensions": _tensor(_storage("0", 12), 0, (1,) * 33, (1,) * 33),
        "is too large": _tensor(_storage("0", 12), 0, (0, 1 << 40, 1 << 40), (1, 1, 1)),
        "bad storage offset": _tensor(_storage("0", 12), 13, (0,), (1,)),
        "bad tensor size/stride": _tensor(_storage("0", 12), 0, (1,), (-1,)),
        "exceeds storage of 12 elements": _tensor(_storage("0", 12), 11, (2,), (1,)),
    }
    for words, ops in cases.items():
        with pytest.raises(PtFormatError, match=words):
            load_pt(io.BytesIO(_with_pickle(raw, pickle.PROTO + b"\x02" + ops + pickle.STOP)))
    empty = _tensor(_storage("0", 12), 12, (0, 5), (5, 1))
    assert load_pt(io.BytesIO(_with_pickle(raw, pickle.PROTO + b"\x02" + empty
                                           + pickle.STOP))).shape == (0, 5)


def test_writer_never_writes_what_the_reader_refuses():
    with pytest.raises(ValueError, match="too large to save"):
        save_pt(io.BytesIO(), {"x": 1 << 4000})
    assert load_pt(io.BytesIO(_pt({"x": -(1 << 2000)})))["x"] == -(1 << 2000)


# -------------------------------------------------------------- memory and size bounds
def _explosions(n: int) -> dict[str, bytes]:
    """Pickles of about ``n`` bytes; most build far more Python objects than they have bytes."""
    many = pickle.EMPTY_LIST + pickle.MARK
    return {
        "empty dicts": many + pickle.EMPTY_DICT * n + pickle.APPENDS,  # 1 byte, 72 built
        "empty lists": many + pickle.EMPTY_LIST * n + pickle.APPENDS,  # 1 byte, 64 built
        "ordered dicts": pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.BINPUT + b"\0"
        + pickle.POP + many
        + (pickle.BINGET + b"\0" + pickle.EMPTY_TUPLE + pickle.REDUCE) * (n // 4)
        + pickle.APPENDS,  # 4 bytes, 144 built
        "1-tuples": many + (pickle.NONE + pickle.TUPLE1) * (n // 2) + pickle.APPENDS,
        "dict entries": pickle.EMPTY_DICT + pickle.MARK
        + b"".join(_i(k) + pickle.NONE for k in range(1000, 1000 + n // 6)) + pickle.SETITEMS,
        "memo entries": pickle.NONE + b"".join(_put(k) for k in range(n // 5)),
    }


@pytest.mark.parametrize("name", list(_explosions(1)))
def test_pickle_objects_stay_within_a_small_multiple_of_its_size(name):
    # Regression (issue 14): a 256 KB pickle of one-byte opcodes built ~18 MB of objects,
    # and nothing bounded it but max_bytes, which counts tensors only.
    pkl = pickle.PROTO + b"\x02" + _explosions(1 << 18)[name] + pickle.STOP
    raw = _with_pickle(_two_storages(), pkl)
    tracemalloc.start()
    try:
        load_pt(io.BytesIO(raw))
    except PtFormatError as exc:
        assert len(str(exc)) < SHORT
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    bound = unpickle.memory_limit(len(pkl)) * 5 // 4 + 2 * len(raw)
    assert peak < bound, (name, peak, len(pkl))


def _largest_model_pickles() -> dict[str, bytes]:
    # The tensors of a 1024-layer model (12 per layer + 5), tiny, so only the pickle is big.
    names = [f"params.h{i // 12}.mlp.w_{i % 12}" for i in range(12 * 1024 + 5)]
    sd = collections.OrderedDict((k, torch.zeros(2, 3)) for k in names)
    sd._metadata = collections.OrderedDict((f"h{i}", {"version": 1}) for i in range(1024))
    buf = io.BytesIO()
    torch.save(sd, buf)
    return {"ours": _pt({k: np.zeros((2, 3), np.float32) for k in names}),
            "torch": buf.getvalue()}


def test_real_pickles_are_far_below_the_bounds():
    # The bounds leave room for the largest model ModelConfig admits, from either writer.
    for name, raw in _largest_model_pickles().items():
        pkl = _data_pkl(raw)
        assert len(pkl) * 4 < ptfile.MAX_PICKLE_BYTES, name
        machine_limit = unpickle.memory_limit(len(pkl))
        unpickle.load_restricted(pkl, find_global=ptfile._TensorReader(
            zipfile.ZipFile(io.BytesIO(raw)), "archive/", [1 << 30]).find_global,
            rebuild=lambda f, a: None, persistent_load=lambda pid: None,
            max_memory=machine_limit // 2)  # loads with half the allowance
        assert len(load_pt(io.BytesIO(raw))) == 12 * 1024 + 5


def test_data_pkl_and_marker_entries_are_bounded(monkeypatch):
    raw = _two_storages()
    monkeypatch.setattr(ptfile, "MAX_PICKLE_BYTES", len(_data_pkl(raw)) - 1)
    with pytest.raises(PtFormatError, match=r"data.pkl is \d+ bytes \(a checkpoint's is at"):
        load_pt(io.BytesIO(raw))
    monkeypatch.undo()
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            data = b"3" * 100_000 if info.filename.endswith("/version") else zin.read(info)
            zout.writestr(info.filename, data)
    with pytest.raises(PtFormatError, match="entry archive/version is 100000 bytes"):
        load_pt(io.BytesIO(out.getvalue()))
