"""Child process of ``test_fuzz_pickle.py``: mutate real ``.pt`` files opcode by opcode.

Usage: ``python pickle_fuzz.py SEED_DIR CASES RNG_SEED MEMORY_BYTES``. Every ``*.pt`` in
SEED_DIR is a seed (``*.ckpt.pt`` ones are daisyweb checkpoints and are also read by
``checkpoint_from_bytes``). Each case cuts a seed's ``data.pkl`` at its opcode boundaries
(``pickletools.genops``), drops, duplicates, swaps or moves opcodes, changes their integer
or string arguments, or inserts opcodes (BUILD, REDUCE, GLOBAL, ...), and loads the result.
It must be refused with a short ``PtFormatError`` / ``CheckpointError`` or load as a tree
whose every tensor holds only bytes from the file's storages (a view outside a storage
would show heap bytes). The address space is capped after the imports, so a memory
explosion fails the case (MemoryError) instead of the machine. Prints one JSON line.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import pickletools
import random
import resource
import struct
import sys
import traceback
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from daisyweb.checkpoints.checkpoint import CheckpointError, checkpoint_from_bytes
from daisyweb.checkpoints.ptfile import PtFormatError, load_pt

MAX_MESSAGE = 400
ITEM_SIZES = (1, 2, 4, 8)
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 11, 12, 13, 255, 256, 65535, 65536, 2**31 - 1, -1, -2,
               -(2**31), 2**32, 2**48, 2**62, 2**63, 2**64 + 1]
STRINGS = ["", "0", "1", "2", "storage", "cpu", "magic", "model", "params.wte", "adam", "m",
           "_metadata", "array", "x" * 300, "\x1b[2J", "\udcff"]
GLOBALS = [b"torch._utils\n_rebuild_tensor_v2\n", b"torch\nFloatStorage\n",
           b"torch\nLongStorage\n", b"torch\nByteStorage\n", b"collections\nOrderedDict\n",
           b"builtins\neval\n", b"posix\nsystem\n", b"numpy\nndarray\n",
           b"torch._utils\n_rebuild_parameter\n", b"collections\ndefaultdict\n"]
INSERTS = [pickle.BUILD, pickle.REDUCE, pickle.MARK, pickle.TUPLE, pickle.TUPLE1,
           pickle.TUPLE2, pickle.TUPLE3, pickle.EMPTY_DICT, pickle.EMPTY_LIST,
           pickle.EMPTY_TUPLE, pickle.SETITEM, pickle.SETITEMS, pickle.APPEND, pickle.APPENDS,
           pickle.POP, pickle.POP_MARK, pickle.NONE, pickle.NEWTRUE, pickle.BINPERSID,
           pickle.STACK_GLOBAL, pickle.MEMOIZE, pickle.DUP, pickle.NEWOBJ, pickle.STOP,
           pickle.INST + b"builtins\nobject\n", pickle.OBJ, pickle.EXT1 + b"\x01",
           pickle.SHORT_BINBYTES + b"\x02ab", pickle.LONG4 + b"\x02\x00\x00\x00\x01\x02",
           pickle.BINUNICODE + b"\xff\xff\xff\xff", pickle.FRAME + struct.pack("<Q", 1 << 40),
           pickle.LIST, pickle.DICT, pickle.BINGET + b"\x00", pickle.BINGET + b"\x05",
           pickle.LONG_BINGET + b"\x00\x00\x01\x00", pickle.BINPUT + b"\x00",
           pickle.PROTO + b"\x02", pickle.EMPTY_SET, pickle.BINFLOAT + b"\x7f\xf8" + b"\0" * 6]


# ------------------------------------------------------------------ seeds
class Seed:
    def __init__(self, path: Path) -> None:
        self.name = path.name
        self.is_checkpoint = path.name.endswith(".ckpt.pt")
        with zipfile.ZipFile(path) as zf:
            self.entries = [(i.filename, zf.read(i)) for i in zf.infolist()]
        self.pkl_name = next(n for n, _ in self.entries if n.endswith("/data.pkl"))
        pkl = dict(self.entries)[self.pkl_name]
        self.ops = [(op, arg, pos) for op, arg, pos in pickletools.genops(pkl)]
        cuts = [pos for _, _, pos in self.ops] + [len(pkl)]
        self.segments = [pkl[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        # Every aligned k-byte chunk of every storage: all a tensor may ever hold.
        self.chunks = {k: _storage_chunks(self.entries, k) for k in ITEM_SIZES}

    def zip_with(self, pkl: bytes) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
            for name, data in self.entries:
                zf.writestr(name, pkl if name == self.pkl_name else data)
        return out.getvalue()


def _storage_chunks(entries: list[tuple[str, bytes]], k: int) -> set[bytes]:
    return {data[i:i + k] for name, data in entries if "/data/" in name
            for i in range(0, len(data) - k + 1, k)}


# ------------------------------------------------------------------ mutations
def _int_op(value: int) -> bytes:
    if 0 <= value < 256:
        return pickle.BININT1 + bytes([value])
    if -(2**31) <= value < 2**31:
        return pickle.BININT + struct.pack("<i", value)
    raw = pickle.encode_long(value)
    return pickle.LONG1 + bytes([len(raw)]) + raw


def _memo_op(op_name: str, value: int) -> bytes:
    value %= 2**32
    short = pickle.BINGET if "GET" in op_name else pickle.BINPUT
    long = pickle.LONG_BINGET if "GET" in op_name else pickle.LONG_BINPUT
    return short + bytes([value]) if value < 256 else long + struct.pack("<I", value)


def _str_op(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _new_argument(rng: random.Random, op: Any, arg: Any) -> bytes | None:
    if op.name in ("BININT", "BININT1", "BININT2", "LONG1"):
        base = arg if type(arg) is int else 0
        value = rng.choice(INTERESTING + [base + 1, base - 1, base * 2, rng.randrange(1 << 16)])
        return _int_op(value)
    if op.name in ("BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"):
        return _memo_op(op.name, rng.choice([0, 1, 2, arg + 1, arg - 1, rng.randrange(64)]))
    if op.name in ("BINUNICODE", "SHORT_BINUNICODE"):
        return _str_op(rng.choice(STRINGS))
    if op.name == "GLOBAL":
        return pickle.GLOBAL + rng.choice(GLOBALS)
    return None


def mutate(rng: random.Random, seed: Seed) -> bytes:
    segs = list(seed.segments)
    ops = list(seed.ops)
    for _ in range(rng.choice((1, 1, 2, 3))):
        n = len(segs)
        i, j = rng.randrange(n), rng.randrange(n)
        kind = rng.randrange(8)
        if kind == 0 and n > 2:  # drop an opcode (never PROTO, to reach the interesting part)
            k = max(i, 1)
            del segs[k]
            del ops[k]
        elif kind == 1:  # duplicate
            segs.insert(i, segs[i])
            ops.insert(i, ops[i])
        elif kind == 2:  # swap
            segs[i], segs[j] = segs[j], segs[i]
            ops[i], ops[j] = ops[j], ops[i]
        elif kind == 3:  # copy a run of opcodes elsewhere (a whole tensor, a dict item)
            run = segs[i:i + rng.randrange(1, 30)]
            segs[j:j] = run
            ops[j:j] = [ops[min(j, len(ops) - 1)]] * len(run)
        elif kind in (4, 5):  # change an argument
            new = _new_argument(rng, ops[i][0], ops[i][1])
            if new is not None:
                segs[i] = new
        elif kind == 6:  # insert an opcode
            segs.insert(i, rng.choice(INSERTS))
            ops.insert(i, ops[i])
        else:  # flip a byte inside an opcode
            seg = bytearray(segs[i])
            seg[rng.randrange(len(seg))] ^= 1 << rng.randrange(8)
            segs[i] = bytes(seg)
    return b"".join(segs)


# ------------------------------------------------------------------ checks
def _arrays(obj: Any, seen: set[int] | None = None) -> list[np.ndarray]:
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, dict):
        out = [a for v in obj.values() for a in _arrays(v, seen)]
        if type(obj) is collections.OrderedDict and vars(obj):
            out += _arrays(vars(obj), seen)
        return out
    if isinstance(obj, (list, tuple)):
        return [a for v in obj for a in _arrays(v, seen)]
    return []


def _foreign_bytes(seed: Seed, tree: Any) -> str | None:
    """A description of the first tensor holding bytes no storage has, else None."""
    for arr in _arrays(tree):
        k = arr.dtype.itemsize
        raw = arr.tobytes()
        for i in range(0, len(raw), k):
            if raw[i:i + k] not in seed.chunks[k]:
                return f"{arr.dtype} {arr.shape} holds {raw[i:i + k].hex()} at byte {i}"
    return None


def run_case(seed: Seed, pkl: bytes) -> tuple[str, str]:
    """("refused" | "loaded", detail); raises AssertionError for a broken guarantee."""
    raw = seed.zip_with(pkl)
    try:
        tree = load_pt(io.BytesIO(raw), max_bytes=2 * len(raw))
    except PtFormatError as exc:
        message = str(exc)
        assert len(message) <= MAX_MESSAGE, f"long refusal ({len(message)} chars)"
        assert "reader fault" not in message, f"a reader bug turned refusal: {message}"
        outcome = ("refused", message.split(" (")[0][:60])
    else:
        foreign = _foreign_bytes(seed, tree)
        assert foreign is None, f"tensor reads outside its storage: {foreign}"
        outcome = ("loaded", type(tree).__name__)
    if seed.is_checkpoint:
        try:
            checkpoint_from_bytes(raw)
        except CheckpointError as exc:
            assert len(str(exc)) <= MAX_MESSAGE, f"long checkpoint refusal: {str(exc)[:200]}"
        else:
            outcome = ("loaded", "checkpoint")
    return outcome


def main() -> None:
    seed_dir, cases, rng_seed, memory = sys.argv[1], *map(int, sys.argv[2:5])
    seeds = [Seed(p) for p in sorted(Path(seed_dir).glob("*.pt"))]
    rng = random.Random(rng_seed)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    outcomes: collections.Counter[str] = collections.Counter()
    failures = []
    for case in range(cases):
        seed = seeds[case % len(seeds)]
        pkl = mutate(rng, seed)
        try:
            kind, detail = run_case(seed, pkl)
            outcomes[f"{kind}: {detail}"] += 1
        except BaseException as exc:  # every escape (MemoryError too) is a finding
            failures.append({"case": case, "seed": seed.name, "pickle": pkl.hex(),
                             "error": "".join(traceback.format_exception_only(exc))[-600:]})
            if len(failures) >= 5:
                break
    print(json.dumps({"cases": case + 1, "outcomes": dict(outcomes), "failures": failures}))


if __name__ == "__main__":
    main()
