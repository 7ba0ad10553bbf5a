"""Training checkpoints as PyTorch-compatible ``.pt`` files, written and read without torch.

A checkpoint is everything a group needs to resume bit-exactly: model config, tokenizer
identity, step, the flat float32 parameters, the full DaisyAdam state, the weight hash that
the sync guard compares, and plain run metadata.

File layout
-----------
The file is a :mod:`daisyweb.checkpoints.ptfile` archive (the zip layout ``torch.save``
writes) whose ``data.pkl`` is one plain ``dict``, so
``torch.load(path, weights_only=True)`` opens it.
Keys, in this order::

    "magic"           str   "daisyweb-checkpoint"
    "format_version"  int   1
    "model"           dict  ModelConfig.to_dict(): vocab, width, layers, heads, seq
    "tokenizer"       dict  {"vocab_size": int, "file_hash": str}
    "step"            int   optimizer steps taken (== adam["step"])
    "weight_hash"     str   optim.weight_hash(params, optimizer) at save time
    "run"             dict  str -> str | int | float | bool (batch, steps, lr, seed, data...)
    "adam"            dict  DaisyAdam.state_dict(), unchanged:
                              "config": {lr, beta1, beta2, eps, weight_decay} (floats)
                              "size": int, "step": int,
                              "beta1_power", "beta2_power": float (binary64, exact)
                              "m", "v": float32 tensors of shape [param_count], FLAT, in
                                        the same order as the parameter buffer
    "params.<name>"   float32 tensor, one per entry of model.param_layout(model), in layout
                      order, with that entry's shape (e.g. "params.wte" [vocab, width],
                      "params.h0.attn.w_qkv" [width, 3*width], "params.head.w")

The parameter tensors are the named views of the flat buffer; concatenating them (each
flattened, C order) in layout order gives the buffer back byte for byte.

Reading
-------
:func:`checkpoint_from_bytes` / :func:`load_checkpoint` never run pickled code (the
restricted unpickler of :mod:`daisyweb.checkpoints.ptfile` resolves only tensor-rebuild globals) and
validate everything before returning a *new* :class:`Checkpoint`: magic, version, exact key
set, config, tensor shapes and dtypes, finiteness, Adam state (by restoring it into a fresh
DaisyAdam) and finally the weight hash recomputed from the contents. Any problem raises
:class:`CheckpointError`; nothing the caller owns is touched, so a refused file leaves the
current training state valid.

Writing
-------
:func:`checkpoint_to_bytes` (like :func:`checkpoint_to_file` and :func:`save_checkpoint`,
which write the same bytes into a file as they are encoded) runs the same validation on
the tree it is about to write (a corrupt in-memory checkpoint is refused before it
reaches disk or the wire) and is deterministic: the same checkpoint always gives the
same bytes. :func:`save_checkpoint` writes atomically (temp file in the target
directory, fsync, ``os.replace``, directory fsync), so a crash leaves either the old file
or the new one, never a torn one. The temp file is readable by its owner only while it is
written, and a temp file of the same target left by a process that died mid-save is
removed by the next save.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import re
import secrets
from dataclasses import dataclass, fields
from typing import IO, Any

import numpy as np

from daisyweb.checkpoints.ptfile import (
    DEFAULT_MAX_BYTES,
    PtFormatError,
    load_pt,
    write_pt,
)
from daisyweb.checkpoints.quote import short_repr
from daisyweb.model import ModelConfig, param_count, param_layout
from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash
from daisyweb.rules import MAX_DIM, MAX_STEP, is_lower_hex

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "CheckpointError",
    "TokenizerInfo",
    "Checkpoint",
    "make_checkpoint",
    "checkpoint_to_tree",
    "checkpoint_from_tree",
    "checkpoint_to_bytes",
    "checkpoint_to_file",
    "checkpoint_from_bytes",
    "save_checkpoint",
    "load_checkpoint",
    "restore_optimizer",
    "model_diff",
]

MAGIC = "daisyweb-checkpoint"
FORMAT_VERSION = 1
PARAM_PREFIX = "params."
_META_KEYS = ("magic", "format_version", "model", "tokenizer", "step", "weight_hash", "run",
              "adam")
_MAX_HASH_LEN = 256
_MAX_RUN_KEY = 128
_F32 = np.dtype(np.float32)
_ADAM_KEYS = ("config", "size", "step", "beta1_power", "beta2_power", "m", "v")
_ADAM_CONFIG_KEYS = frozenset(f.name for f in fields(AdamConfig))


class CheckpointError(ValueError):
    """A checkpoint was refused; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class TokenizerInfo:
    """Identity of the tokenizer a model was trained with (its size and file hash)."""

    vocab_size: int
    file_hash: str

    def __post_init__(self) -> None:
        if type(self.vocab_size) is not int or not 1 <= self.vocab_size <= MAX_DIM:
            raise CheckpointError(
                f"tokenizer vocab_size must be an int in 1..{MAX_DIM}, got "
                f"{short_repr(self.vocab_size)}")
        if (type(self.file_hash) is not str or not 1 <= len(self.file_hash) <= _MAX_HASH_LEN
                or not self.file_hash.isprintable()):
            raise CheckpointError(
                f"tokenizer file_hash must be a printable string of 1..{_MAX_HASH_LEN} "
                f"characters, got {short_repr(self.file_hash)}")

    def to_dict(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "file_hash": self.file_hash}


@dataclass
class Checkpoint:
    model: ModelConfig
    tokenizer: TokenizerInfo
    step: int
    params: np.ndarray  # flat float32 [param_count(model)]
    adam: dict  # DaisyAdam.state_dict()
    weight_hash: str
    run: dict  # str -> str | int | float | bool

    # Explicit __eq__ (dataclass keeps it): the generated one would compare arrays with
    # ``==`` and fail on their ambiguous truth value. Equality here is byte equality.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Checkpoint):
            return NotImplemented
        return (self.model == other.model and self.tokenizer == other.tokenizer
                and self.step == other.step and self.weight_hash == other.weight_hash
                and self.run == other.run and _same_array(self.params, other.params)
                and _same_adam(self.adam, other.adam))


def _same_array(a: Any, b: Any) -> bool:
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
            and a.shape == b.shape and a.tobytes() == b.tobytes())


def _same_adam(a: Any, b: Any) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict) or set(a) != set(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not _same_array(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


# ---------------------------------------------------------------------------- checks
def _err(what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{what}; {fix}")


def _check_run(run: Any) -> dict[str, str | int | float | bool]:
    if type(run) is not dict:
        raise _err(f"run metadata must be a dict, got {type(run).__name__}",
                   "pass plain run settings (batch, steps, lr, seed, data...)")
    out: dict[str, str | int | float | bool] = {}
    for k, v in run.items():
        if type(k) is not str or not 1 <= len(k) <= _MAX_RUN_KEY:
            raise _err(f"run metadata key {short_repr(k)} is not a string of 1..{_MAX_RUN_KEY} "
                       "characters", "use short string keys")
        if type(v) not in (str, int, float, bool):
            raise _err(f"run metadata {short_repr(k)} has type {type(v).__name__}",
                       "only str, int, float and bool values are stored (convert numpy "
                       "scalars with int()/float())")
        if type(v) is float and not math.isfinite(v):
            raise _err(f"run metadata {short_repr(k)} is {v}", "store finite numbers only")
        out[k] = v
    return out


def _check_hash(value: Any) -> str:
    if not is_lower_hex(value) or len(value) > _MAX_HASH_LEN:
        raise _err(f"weight_hash {short_repr(value)} is not a lowercase hex digest",
                   "the file is damaged or not written by daisyweb; use another checkpoint")
    return value


def _check_step(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= MAX_STEP:
        raise _err(f"step {short_repr(value)} is not a non-negative int (at most {MAX_STEP})",
                   "the file is damaged; use another checkpoint")
    return value


def model_diff(a: ModelConfig, b: ModelConfig) -> str:
    """The fields where two model configs differ, e.g. ``"width 128 vs 256"`` ("" if equal).

    For reporting a conflict between a checkpoint's config (which wins) and model flags.
    """
    da, db = a.to_dict(), b.to_dict()
    return ", ".join(f"{k} {da[k]} vs {db[k]}" for k in da if da[k] != db[k])


def _check_adam_values(adam: dict, cfg: dict) -> None:
    """Every Adam value a plain number (or an array for m/v) before DaisyAdam sees it: its
    messages quote values in full, and a value from a file may be a huge structure."""
    if set(adam) != set(_ADAM_KEYS):
        raise _err(f"adam state must have keys {'/'.join(_ADAM_KEYS)}, got "
                   f"{short_repr(list(itertools.islice(adam, 8)))}",
                   "the optimizer state was damaged; use another checkpoint")
    unknown = [k for k in cfg if k not in _ADAM_CONFIG_KEYS]
    if unknown:
        raise _err(f"adam state config has unexpected key {short_repr(unknown[0])}",
                   "the optimizer state was damaged; use another checkpoint")
    numbers = [(f"config {k}", v) for k, v in cfg.items()]
    numbers += [(k, adam[k]) for k in ("size", "step", "beta1_power", "beta2_power")]
    for name, value in numbers:
        if type(value) not in (int, float) or (type(value) is int and value.bit_length() > 64):
            raise _err(f"adam state {name} must be a number, got {short_repr(value)}",
                       "the optimizer state was damaged; use another checkpoint")
    for name in ("m", "v"):
        if not isinstance(adam[name], np.ndarray):
            raise _err(f"adam state {name} must be an array, got {type(adam[name]).__name__}",
                       "the optimizer state was damaged; use another checkpoint")


def _restore(adam: Any, size: int, copy: bool = True) -> DaisyAdam:
    """A fresh DaisyAdam holding ``adam`` (fully validated by load_state_dict; its arrays
    adopted as they are with ``copy=False``)."""
    if not isinstance(adam, dict):
        raise _err(f"adam state must be a dict, got {type(adam).__name__}",
                   "the file is damaged or not a daisyweb checkpoint")
    cfg = adam.get("config")
    if not isinstance(cfg, dict):
        raise _err("adam state has no 'config' dict", "the file is damaged; use another one")
    _check_adam_values(adam, cfg)
    try:
        opt = DaisyAdam(AdamConfig(**cfg), size, adam, copy=copy)
    except (TypeError, ValueError) as exc:
        raise _err(f"adam state is inconsistent: {exc}",
                   "the optimizer state was damaged; use another checkpoint") from None
    return opt


def _check_params(model: ModelConfig, params: Any) -> np.ndarray:
    n = param_count(model)
    if not isinstance(params, np.ndarray) or params.dtype != _F32 or params.shape != (n,):
        got = (f"{params.dtype} {params.shape}" if isinstance(params, np.ndarray)
               else type(params).__name__)
        raise _err(f"params must be a flat float32 array of {n} elements for {model}, "
                   f"got {got}", "pass the model's flat parameter buffer")
    if not np.isfinite(params).all():
        bad = int(np.count_nonzero(~np.isfinite(params)))
        raise _err(f"params contain {bad} NaN/Inf value(s)",
                   "training diverged before this state; resume from an earlier checkpoint")
    return params


# ---------------------------------------------------------------------------- build
def make_checkpoint(model: ModelConfig, tokenizer: TokenizerInfo, params: np.ndarray,
                    optimizer: DaisyAdam, run: dict, copy: bool = True) -> Checkpoint:
    """Snapshot the current training state (arrays copied, weight hash computed).

    ``copy=False`` shares the arrays instead: for a checkpoint turned into bytes at once
    (a snapshot to send), before anything can change them.
    """
    if not isinstance(model, ModelConfig):
        raise _err(f"model must be a ModelConfig, got {type(model).__name__}",
                   "pass the run's ModelConfig")
    if not isinstance(tokenizer, TokenizerInfo):
        raise _err(f"tokenizer must be a TokenizerInfo, got {type(tokenizer).__name__}",
                   "pass TokenizerInfo(vocab_size, file_hash)")
    if not isinstance(optimizer, DaisyAdam):
        raise _err(f"optimizer must be a DaisyAdam, got {type(optimizer).__name__}",
                   "pass the run's optimizer")
    if tokenizer.vocab_size > model.vocab:
        raise _err(f"tokenizer has {tokenizer.vocab_size} tokens but the model only "
                   f"{model.vocab}", "build the model with vocab >= the tokenizer's size")
    params = _check_params(model, params)
    if optimizer.size != params.size:
        raise _err(f"optimizer size {optimizer.size} != param count {params.size}",
                   "pass the optimizer that trains these params")
    return Checkpoint(model=model, tokenizer=tokenizer, step=optimizer.step_count,
                      params=params.copy() if copy else params,
                      adam=optimizer.state_dict(copy=copy),
                      weight_hash=weight_hash(params, optimizer), run=dict(_check_run(run)))


def checkpoint_to_tree(ckpt: Checkpoint) -> dict[str, Any]:
    """The plain dict written to the ``.pt`` file (see module docstring), unvalidated.

    Tensors are views of the checkpoint's arrays; the writer copies them.
    """
    if not isinstance(ckpt, Checkpoint):
        raise _err(f"expected a Checkpoint, got {type(ckpt).__name__}",
                   "build one with make_checkpoint()")
    if not isinstance(ckpt.model, ModelConfig) or not isinstance(ckpt.tokenizer, TokenizerInfo):
        raise _err("checkpoint model/tokenizer have the wrong types",
                   "build the checkpoint with make_checkpoint()")
    params = _check_params(ckpt.model, ckpt.params)
    tree: dict[str, Any] = {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "model": ckpt.model.to_dict(),
        "tokenizer": ckpt.tokenizer.to_dict(),
        "step": ckpt.step,
        "weight_hash": ckpt.weight_hash,
        "run": ckpt.run,
        "adam": dict(ckpt.adam) if isinstance(ckpt.adam, dict) else ckpt.adam,
    }
    off = 0
    for name, shape in param_layout(ckpt.model):
        n = math.prod(shape)
        tree[PARAM_PREFIX + name] = params[off:off + n].reshape(shape)
        off += n
    return tree


def checkpoint_from_tree(tree: Any, *, expect_model: ModelConfig | None = None,
                         expect_tokenizer: TokenizerInfo | None = None,
                         expect_step: int | None = None,
                         expect_weight_hash: str | None = None,
                         _copy: bool = True) -> Checkpoint:
    """Validate a loaded ``.pt`` dict completely and build a new Checkpoint from it.

    ``expect_*`` (all optional) refuse a checkpoint that is valid but not the one the
    caller wants: another model or tokenizer, or, for a snapshot, not the step and weight
    hash the group announced. ``_copy=False`` (this module's readers, whose tree was just
    loaded and is theirs alone, and the writers' check): the result's Adam moments are the
    tree's arrays, and so are its weights where the tree's tensors are consecutive views
    of one flat buffer (:func:`_one_buffer`), as :func:`checkpoint_to_tree` makes them.
    """
    if not isinstance(tree, dict):
        raise _err(f"the file holds a {type(tree).__name__}, not a daisyweb checkpoint dict",
                   "pass a checkpoint written by daisyweb (--save)")
    if "magic" not in tree:
        raise _err("not a daisyweb checkpoint: no 'magic' entry (a plain PyTorch file?)",
                   "pass a checkpoint written by daisyweb (--save)")
    if type(tree["magic"]) is not str or tree["magic"] != MAGIC:
        raise _err(f"not a daisyweb checkpoint: magic {short_repr(tree['magic'])}, expected "
                   f"{MAGIC!r}", "pass a checkpoint written by daisyweb (--save)")
    version = tree.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise _err(f"unsupported checkpoint format version {short_repr(version)} (this daisyweb "
                   f"reads version {FORMAT_VERSION})",
                   "use the daisyweb version that wrote it, or re-save with this one")
    missing = [k for k in _META_KEYS if k not in tree]
    if missing:
        raise _err(f"checkpoint is missing {', '.join(map(repr, missing))}",
                   "the file is damaged or incomplete; use another checkpoint")
    try:
        model = ModelConfig.from_dict(tree["model"])
    except (TypeError, ValueError) as exc:
        raise _err(f"bad model config in checkpoint: {exc}",
                   "the file is damaged; use another checkpoint") from None
    tok = tree["tokenizer"]
    if not isinstance(tok, dict) or set(tok) != {"vocab_size", "file_hash"}:
        raise _err(f"bad tokenizer entry {short_repr(tok)} (needs vocab_size and file_hash)",
                   "the file is damaged; use another checkpoint")
    tokenizer = TokenizerInfo(tok["vocab_size"], tok["file_hash"])
    if expect_model is not None and model != expect_model:
        raise _err(f"checkpoint model {model} differs from the expected {expect_model} "
                   f"({model_diff(model, expect_model)})",
                   "drop the conflicting model flags (the checkpoint's config wins) or pick "
                   "the checkpoint of this model")
    if expect_tokenizer is not None and tokenizer != expect_tokenizer:
        raise _err(f"checkpoint was trained with tokenizer {tokenizer} but this run uses "
                   f"{expect_tokenizer}", "use the same tokenizer file the checkpoint names")
    if tokenizer.vocab_size > model.vocab:
        raise _err(f"checkpoint tokenizer has {tokenizer.vocab_size} tokens but its model "
                   f"only {model.vocab}", "the file is damaged; use another checkpoint")
    step = _check_step(tree["step"])
    stored_hash = _check_hash(tree["weight_hash"])
    run = _check_run(tree["run"])
    if expect_step is not None and step != expect_step:
        raise _err(f"checkpoint is at step {step}, expected step {expect_step}",
                   "ask the sender for the snapshot of the announced step")
    if expect_weight_hash is not None and stored_hash != expect_weight_hash:
        raise _err(f"checkpoint weight hash {stored_hash[:16]}... differs from the expected "
                   f"{str(expect_weight_hash)[:16]}...",
                   "this is not the state the group published; ask for a fresh snapshot")

    layout = param_layout(model)
    names = {PARAM_PREFIX + n for n, _ in layout}
    missing = [k for k in (PARAM_PREFIX + n for n, _ in layout) if k not in tree]
    if missing:
        raise _err(f"checkpoint is missing {len(missing)} parameter tensor(s): "
                   f"{', '.join(missing[:5])}", "the file is incomplete; use another one")
    # Keys may be str or int (the reader allows both), so they are sorted as text.
    extra = sorted((k for k in tree if k not in names and k not in _META_KEYS), key=str)
    if extra:
        raise _err(f"checkpoint has unexpected entries {short_repr(extra[:5], 200)}",
                   "the file was not written by this daisyweb; re-save it with daisyweb")
    tensors = []
    for name, shape in layout:
        arr = tree[PARAM_PREFIX + name]
        if not isinstance(arr, np.ndarray) or arr.dtype != _F32 or arr.shape != shape:
            got = (f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray)
                   else type(arr).__name__)
            raise _err(f"tensor {PARAM_PREFIX + name} is {got}, but the checkpoint's model "
                       f"{model} needs float32 {shape}",
                       "the file's tensors do not match its config; use another checkpoint")
        tensors.append(arr)
    params = None if _copy else _one_buffer(tensors, param_count(model))
    if params is None:
        params = np.empty(param_count(model), dtype=_F32)
        off = 0
        for arr in tensors:
            params[off:off + arr.size] = arr.reshape(-1)
            off += arr.size
    params = _check_params(model, params)

    opt = _restore(tree["adam"], params.size, copy=_copy)
    if opt.step_count != step:
        raise _err(f"adam state is at step {opt.step_count} but the checkpoint says {step}",
                   "the file is inconsistent; use another checkpoint")
    actual = weight_hash(params, opt)
    if actual != stored_hash:
        raise _err(f"weight hash mismatch: contents hash to {actual[:16]}..., the file "
                   f"records {stored_hash[:16]}...",
                   "the weights or optimizer state were altered or damaged; use another copy")
    # The same dict as opt.state_dict(), but ``opt`` is ours alone, so its freshly
    # validated arrays become the result instead of being copied once more.
    adam = {"config": opt.config.to_dict(), "size": opt.size, "step": opt.step_count,
            "beta1_power": opt.beta1_power, "beta2_power": opt.beta2_power,
            "m": opt.m, "v": opt.v}
    return Checkpoint(model=model, tokenizer=tokenizer, step=step, params=params,
                      adam=adam, weight_hash=actual, run=run)


def _one_buffer(tensors: list[np.ndarray], n: int) -> np.ndarray | None:
    """The flat, writable float32 array of ``n`` values that ``tensors`` are consecutive
    views of, in order, else None. A leader's snapshot check then reads its weights in
    place instead of assembling a copy (5.3 MB at the demo default, at a boundary)."""
    base = tensors[0].base if tensors else None
    if (not isinstance(base, np.ndarray) or base.dtype != _F32 or base.shape != (n,)
            or not base.flags.c_contiguous or not base.flags.writeable):
        return None
    at = base.__array_interface__["data"][0]
    for arr in tensors:
        if arr.base is not base or not arr.flags.c_contiguous \
                or arr.__array_interface__["data"][0] != at:
            return None
        at += arr.nbytes
    return base if at == base.__array_interface__["data"][0] + base.nbytes else None


# ---------------------------------------------------------------------------- bytes / files
def checkpoint_to_bytes(ckpt: Checkpoint) -> bytes:
    """The ``.pt`` file bytes of a checkpoint (validated first; deterministic)."""
    buf = io.BytesIO()
    checkpoint_to_file(ckpt, buf)
    return buf.getvalue()


def checkpoint_to_file(ckpt: Checkpoint, file: IO[bytes]) -> None:
    """Write :func:`checkpoint_to_bytes`'s bytes into ``file`` (binary, seekable, empty),
    the arrays straight from their buffers (``ptfile.write_pt``)."""
    _write_tree(_checked_tree(ckpt), file)


def _checked_tree(ckpt: Checkpoint) -> dict[str, Any]:
    tree = checkpoint_to_tree(ckpt)
    # Same checks as a reader would run: refuse to write or send what nobody could load.
    # (The Checkpoint it builds is dropped at once, so it may share the tree's arrays.)
    checkpoint_from_tree(tree, _copy=False)
    return tree


def _write_tree(tree: dict[str, Any], file: IO[bytes]) -> None:
    try:
        write_pt(file, tree)
    except (TypeError, ValueError) as exc:
        raise _err(f"cannot encode checkpoint: {exc}", "check the run metadata values") from None


def checkpoint_from_bytes(data: bytes, *, expect_model: ModelConfig | None = None,
                          expect_tokenizer: TokenizerInfo | None = None,
                          expect_step: int | None = None,
                          expect_weight_hash: str | None = None,
                          max_bytes: int = DEFAULT_MAX_BYTES) -> Checkpoint:
    """Parse and fully validate checkpoint bytes (e.g. a Snapshot payload).

    For a snapshot pass ``expect_step=snap.step, expect_weight_hash=snap.weight_hash``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _err(f"checkpoint data must be bytes, got {type(data).__name__}",
                   "pass the file contents")
    data = bytes(data)
    tree = _load_tree(io.BytesIO(data), len(data), max_bytes)
    return checkpoint_from_tree(tree, expect_model=expect_model,
                                expect_tokenizer=expect_tokenizer, expect_step=expect_step,
                                expect_weight_hash=expect_weight_hash, _copy=False)


def _load_tree(f: IO[bytes], size: int, max_bytes: int) -> Any:
    # A valid file's storages plus their rebuilt copies come to at most twice its size;
    # anything more is a crafted file trying to make us allocate.
    budget = min(max_bytes, 2 * size)
    try:
        return load_pt(f, max_bytes=budget)
    except PtFormatError as exc:
        if str(exc).startswith("refusing global"):
            raise _err(f"not a safe checkpoint: {exc} (a checkpoint never needs it; it "
                       "could run code, and nothing was executed)",
                       "do not use this file; get the checkpoint from a trusted "
                       "source") from None
        raise _err(f"not a readable checkpoint: {exc}",
                   "the file is damaged, truncated or not a .pt checkpoint; use another "
                   "copy") from None


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class _FdFile:
    """The file ``fd`` as zipfile writes it (write, tell, seek), each write whole."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes | memoryview) -> int:
        _write_all(self.fd, data)
        return len(data)

    def tell(self) -> int:
        return os.lseek(self.fd, 0, os.SEEK_CUR)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return os.lseek(self.fd, offset, whence)

    def flush(self) -> None:
        """Nothing is buffered."""


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable; not possible on every platform (e.g. Windows).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    # /proc tells it without changing it: os.umask() sets it for every thread at once.
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _remove_stale_temps(directory: str, base: str) -> None:
    """Unlink the temp files of ``base`` that processes which no longer run left behind
    (a save killed mid-write); a live process's, this one's included, may be in use."""
    pattern = re.compile(rf"\.{re.escape(base)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        m = pattern.fullmatch(name)
        if m is not None and int(m[1]) != os.getpid() and not _pid_alive(int(m[1])):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


def save_checkpoint(path: str | os.PathLike[str], ckpt: Checkpoint) -> None:
    """Write ``ckpt`` to ``path`` atomically: the old file or the new one, never a torn one.

    The temp file lives in the target directory (same filesystem, so ``os.replace`` is
    atomic) and is removed on any failure. I/O errors raise CheckpointError. The archive
    is written into it as it is encoded, never built in memory: 16 MB less at each save
    of the demo default. The temp file is mode 600 until it is complete (then it gets
    the mode a new file gets); temp files of ``path`` that dead processes left are
    removed first.
    """
    tree = _checked_tree(ckpt)  # validate before touching the disk
    target = os.path.abspath(os.fspath(path))
    directory, base = os.path.split(target)
    _remove_stale_temps(directory, base)
    tmp = os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    try:
        # Private while written: a save killed midway leaves weights nobody else reads.
        fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        raise _err(f"cannot create a temp file next to {target}: {exc}",
                   "check that the directory exists and is writable") from None
    try:
        try:
            _write_tree(tree, _FdFile(fd))  # type: ignore[arg-type]
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o666 & ~_umask())  # complete: the mode of a normal file
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _err(f"cannot write checkpoint {target}: {exc}",
                       "check free disk space and permissions; the previous file is "
                       "unchanged") from None
        raise
    _fsync_dir(directory)


def load_checkpoint(path: str | os.PathLike[str], *, expect_model: ModelConfig | None = None,
                    expect_tokenizer: TokenizerInfo | None = None,
                    expect_step: int | None = None, expect_weight_hash: str | None = None,
                    max_bytes: int = DEFAULT_MAX_BYTES) -> Checkpoint:
    """Read and fully validate the checkpoint at ``path`` (see :func:`checkpoint_from_bytes`)."""
    name = os.fspath(path)
    try:
        # Read through the open file rather than into one big bytes object: one copy less
        # of the whole checkpoint at peak.
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise _err(f"checkpoint {name} is larger than {max_bytes} bytes",
                           "this is not a daisyweb checkpoint, or raise max_bytes")
            tree = _load_tree(f, size, max_bytes)
        return checkpoint_from_tree(tree, expect_model=expect_model,
                                    expect_tokenizer=expect_tokenizer, expect_step=expect_step,
                                    expect_weight_hash=expect_weight_hash, _copy=False)
    except OSError as exc:
        raise _err(f"cannot read checkpoint {name}: {exc.strerror or exc}",
                   "check the path") from None
    except CheckpointError as exc:
        raise CheckpointError(f"{name}: {exc}") from None


def restore_optimizer(ckpt: Checkpoint, copy: bool = True) -> DaisyAdam:
    """A new DaisyAdam in the checkpoint's state (config from ``ckpt.adam["config"]``);
    with ``copy=False`` it takes over the checkpoint's moment arrays."""
    if not isinstance(ckpt, Checkpoint):
        raise _err(f"expected a Checkpoint, got {type(ckpt).__name__}",
                   "load one with load_checkpoint()")
    size = ckpt.adam.get("size") if isinstance(ckpt.adam, dict) else None
    if type(size) is not int or size < 0:
        raise _err(f"adam state has no valid 'size' ({short_repr(size)})",
                   "the optimizer state was damaged; use another checkpoint")
    if size != param_count(ckpt.model):
        raise _err(f"adam state size {size} != param count {param_count(ckpt.model)} of "
                   f"{ckpt.model}", "the checkpoint is inconsistent; use another one")
    opt = _restore(ckpt.adam, size, copy=copy)
    if opt.step_count != ckpt.step:
        raise _err(f"adam state is at step {opt.step_count} but the checkpoint says "
                   f"{ckpt.step}", "the checkpoint is inconsistent; use another one")
    return opt
