"""Read and write PyTorch-compatible ``.pt`` files without importing torch.

Layout written by :func:`save_pt` (the same as ``torch.save`` of torch 2.x)::

    archive/data.pkl              pickle protocol 2, storages as persistent ids
    archive/.format_version       b"1"
    archive/.storage_alignment    b"64"
    archive/byteorder             b"little"
    archive/data/0 .. N-1         raw little-endian storage bytes, one per array
    archive/version               b"3\\n"

Every entry is stored uncompressed and its data starts at a multiple of 64 bytes (the
local header's extra field is padded with an ``FB`` record, like torch does).

The pickle references only ``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2``
and the typed storage classes (``torch.FloatStorage`` ...), which is exactly what
``torch.load(path, weights_only=True)`` accepts. The pickle bytes are emitted by a small
hand-written encoder, so writing needs neither torch nor any fake ``torch`` module.

:func:`load_pt` reads ``data.pkl`` with the restricted machine of
:mod:`daisyweb.checkpoints.unpickle`: only those globals, as inert markers, only the
opcodes and object shapes such a pickle has, and objects bounded by a small multiple of
the pickle's size; anything else raises :class:`PtFormatError`, so loading never runs
pickled code. Every tensor is a copy of a view that is proven to lie inside the flat
storage array it reads, of that storage's own element count and dtype.
"""

from __future__ import annotations

import collections
import contextlib
import io
import math
import os
import pickle
import struct
import zipfile
from typing import IO, Any

import numpy as np

from daisyweb.checkpoints.quote import short_name, short_repr
from daisyweb.checkpoints.unpickle import Global, PickleRefused, load_restricted

__all__ = ["PtFormatError", "save_pt", "dumps_pt", "write_pt", "load_pt", "DEFAULT_MAX_BYTES",
           "MAX_PICKLE_BYTES"]

DEFAULT_MAX_BYTES = 4 << 30
# The largest model ModelConfig admits (1024 layers) pickles to about 2 MB; a data.pkl
# beyond this is not a checkpoint, and the limit bounds the reader's work and strings.
MAX_PICKLE_BYTES = 16 << 20
_ALIGN = 64
_MAX_DEPTH = 64
_MAX_NDIM = 32  # numpy 1.x's limit; a checkpoint tensor has 0-2
_MAX_EXTENT = 1 << 48  # any size, stride or element count: far beyond max_bytes, int64-safe
_MAX_KEY_LEN = 256  # a storage key ("0", "1", ...) or location ("cpu")
_MAX_MARKER_BYTES = 64  # the version and byteorder entries
_REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor_v2")
_ARCHIVE = "archive"


class PtFormatError(ValueError):
    """The file is not a valid (or not an acceptable) ``.pt`` checkpoint."""


# numpy dtype (little-endian) <-> torch typed storage class name
_STORAGE_FOR_DTYPE: dict[np.dtype, str] = {
    np.dtype("<f8"): "DoubleStorage",
    np.dtype("<f4"): "FloatStorage",
    np.dtype("<f2"): "HalfStorage",
    np.dtype("<i8"): "LongStorage",
    np.dtype("<i4"): "IntStorage",
    np.dtype("<i2"): "ShortStorage",
    np.dtype("i1"): "CharStorage",
    np.dtype("u1"): "ByteStorage",
    np.dtype("?"): "BoolStorage",
}
_DTYPE_FOR_STORAGE = {name: dt for dt, name in _STORAGE_FOR_DTYPE.items()}


# ---------------------------------------------------------------------------- writing
class _Encoder:
    """Minimal pickle protocol-2 encoder for the checkpoint value tree."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.storages: list[memoryview] = []

    def w(self, b: bytes) -> None:
        self.out.write(b)

    def global_(self, module: str, name: str) -> None:
        self.w(pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n")

    def str_(self, s: str) -> None:
        b = s.encode("utf-8", "surrogatepass")
        self.w(pickle.BINUNICODE + struct.pack("<I", len(b)) + b)

    def int_(self, i: int) -> None:
        if 0 <= i < 256:
            self.w(pickle.BININT1 + bytes([i]))
        elif -(2**31) <= i < 2**31:
            self.w(pickle.BININT + struct.pack("<i", i))
        else:
            b = pickle.encode_long(i)
            if len(b) > 255:  # LONG4: the reader refuses it, so never write it
                raise ValueError(f"integer of {i.bit_length()} bits is too large to save")
            self.w(pickle.LONG1 + bytes([len(b)]) + b)

    def tuple_(self, items: tuple[int, ...]) -> None:
        self.w(pickle.MARK)
        for i in items:
            self.int_(i)
        self.w(pickle.TUPLE)

    def array(self, arr: np.ndarray) -> None:
        dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        dt = np.dtype(dt.str)
        if dt not in _STORAGE_FOR_DTYPE:
            raise TypeError(f"unsupported array dtype {arr.dtype}")
        # C order in the file's byte order: a view of ``arr`` itself when it already is
        # (no copy of the weights and moments: the file is built before anything can
        # change them, every writer here being synchronous), else a converted copy.
        arr = np.asarray(arr, dtype=dt, order="C")  # keeps 0-d shape
        key = str(len(self.storages))
        self.storages.append(memoryview(arr.reshape(-1)).cast("B"))
        shape = tuple(int(s) for s in arr.shape)
        stride = tuple(int(s) // dt.itemsize for s in arr.strides) if arr.size else tuple(
            int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
        self.global_("torch._utils", "_rebuild_tensor_v2")
        self.w(pickle.MARK)
        # persistent id: ('storage', StorageClass, key, 'cpu', numel)
        self.w(pickle.MARK)
        self.str_("storage")
        self.global_("torch", _STORAGE_FOR_DTYPE[dt])
        self.str_(key)
        self.str_("cpu")
        self.int_(int(arr.size))
        self.w(pickle.TUPLE + pickle.BINPERSID)
        self.int_(0)
        self.tuple_(shape)
        self.tuple_(stride)
        self.w(pickle.NEWFALSE)
        self.global_("collections", "OrderedDict")
        self.w(pickle.EMPTY_TUPLE + pickle.REDUCE)
        self.w(pickle.TUPLE + pickle.REDUCE)

    def value(self, obj: Any, depth: int = 0) -> None:
        if depth > _MAX_DEPTH:
            raise ValueError("object nested too deeply")
        if obj is None:
            self.w(pickle.NONE)
        elif obj is True:
            self.w(pickle.NEWTRUE)
        elif obj is False:
            self.w(pickle.NEWFALSE)
        elif type(obj) is int:
            self.int_(obj)
        elif type(obj) is float:
            self.w(pickle.BINFLOAT + struct.pack(">d", obj))
        elif type(obj) is str:
            self.str_(obj)
        elif isinstance(obj, np.ndarray):
            self.array(obj)
        elif isinstance(obj, dict):
            if isinstance(obj, collections.OrderedDict):
                self.global_("collections", "OrderedDict")
                self.w(pickle.EMPTY_TUPLE + pickle.REDUCE)
            else:
                self.w(pickle.EMPTY_DICT)
            if obj:
                self.w(pickle.MARK)
                for k, v in obj.items():
                    if type(k) is not str:
                        raise TypeError(f"dict keys must be str, got {type(k).__name__}")
                    self.str_(k)
                    self.value(v, depth + 1)
                self.w(pickle.SETITEMS)
        elif type(obj) is list:
            self.w(pickle.EMPTY_LIST)
            if obj:
                self.w(pickle.MARK)
                for v in obj:
                    self.value(v, depth + 1)
                self.w(pickle.APPENDS)
        elif type(obj) is tuple:
            self.w(pickle.MARK)
            for v in obj:
                self.value(v, depth + 1)
            self.w(pickle.TUPLE)
        else:
            raise TypeError(f"cannot save value of type {type(obj).__name__}")


def _aligned_entry(zf: zipfile.ZipFile, buf: IO[bytes], name: str,
                   data: bytes | memoryview) -> None:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 0
    fname_len = len(info.filename.encode("utf-8"))
    offset = buf.tell()
    pad = (-(offset + 30 + fname_len + 4)) % _ALIGN
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding record
    zf.writestr(info, data)


def save_pt(path_or_file: str | os.PathLike[str] | IO[bytes], obj: Any) -> None:
    """Write ``obj`` (nested dict/list/tuple of arrays and plain values) as a ``.pt`` file.

    A path is written through a temporary file beside it, renamed once complete, so a
    failure never leaves a partial file (nor the archive in memory: :func:`write_pt`);
    a file object gets the archive built in memory, in one write.
    """
    if hasattr(path_or_file, "write"):
        path_or_file.write(dumps_pt(obj))  # type: ignore[union-attr]
    else:
        tmp = f"{os.fspath(path_or_file)}.tmp.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                write_pt(f, obj)
            os.replace(tmp, path_or_file)
        except BaseException:
            # Never leave a half-written temp file behind (e.g. disk full).
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def write_pt(file: IO[bytes], obj: Any) -> None:
    """Write the ``.pt`` archive of ``obj`` into ``file`` (binary, seekable, empty): the
    same bytes as :func:`dumps_pt`, each array written from its own buffer, so a file
    on disk never holds the archive in memory too."""
    enc = _Encoder()
    enc.w(pickle.PROTO + b"\x02")
    enc.value(obj)
    enc.w(pickle.STOP)
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        entries = [("data.pkl", enc.out.getvalue()), (".format_version", b"1"),
                   (".storage_alignment", b"64"), ("byteorder", b"little")]
        entries += [(f"data/{i}", b) for i, b in enumerate(enc.storages)]
        entries.append(("version", b"3\n"))
        for name, data in entries:
            _aligned_entry(zf, file, f"{_ARCHIVE}/{name}", data)


def dumps_pt(obj: Any) -> bytes:
    """The ``.pt`` file bytes of ``obj`` (what :func:`save_pt` writes)."""
    buf = io.BytesIO()
    write_pt(buf, obj)
    return buf.getvalue()


# ---------------------------------------------------------------------------- reading
class _StorageType:
    """The ``torch.<X>Storage`` global a persistent id names (inert: never called)."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = _DTYPE_FOR_STORAGE[name]


class _Storage:
    """One ``data/<key>`` entry: a 1-d read-only array of exactly ``numel`` ``dtype``s.

    Nothing in a pickle can reach its fields (the reader has no BUILD for it), and every
    view is checked against ``numel`` and ``dtype`` as well as the array itself.
    """

    __slots__ = ("array", "numel", "dtype")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.numel = int(array.size)
        self.dtype = array.dtype


def _is_int(x: Any) -> bool:
    return type(x) is int


def _is_empty_mapping(x: Any) -> bool:
    # Exact types: ``x == {}`` on a hostile array would raise instead of answering.
    return type(x) in (dict, collections.OrderedDict) and not x


def _check_dims(size: Any, stride: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if type(size) is not tuple or type(stride) is not tuple:
        raise PtFormatError("tensor size/stride must be tuples")
    if len(size) != len(stride):
        raise PtFormatError("tensor size/stride length mismatch")
    if len(size) > _MAX_NDIM:
        raise PtFormatError(f"tensor has {len(size)} dimensions (at most {_MAX_NDIM})")
    if not all(_is_int(s) and 0 <= s <= _MAX_EXTENT for s in size + stride):
        raise PtFormatError("bad tensor size/stride")
    # numpy refuses a shape whose non-zero dims multiply past its limit, even if empty.
    if math.prod(max(s, 1) for s in size) > _MAX_EXTENT:
        raise PtFormatError(f"tensor size {short_repr(size)} is too large")
    return size, stride


def _view_in_storage(storage: _Storage, offset: int, size: tuple[int, ...],
                     stride: tuple[int, ...]) -> np.ndarray:
    """The strided view, after proving that its first and last element lie in the storage.

    Strides are >= 0, so the lowest element is ``offset`` and the highest is
    ``offset + sum((n - 1) * stride)``; both must be below the storage's element count.
    """
    data = storage.array
    if (data.ndim != 1 or data.size != storage.numel or data.dtype != storage.dtype
            or not data.flags.c_contiguous):
        raise PtFormatError("storage is not a flat array of its own type")
    last = offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True))
    if last >= storage.numel:
        raise PtFormatError(
            f"tensor of size {short_repr(size)} stride {short_repr(stride)} offset {offset} "
            f"exceeds storage of {storage.numel} elements")
    item = storage.dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        data[offset:], shape=size, strides=tuple(st * item for st in stride), writeable=False)


def _rebuild_tensor_v2(limit: list[int], storage: Any, offset: Any, size: Any, stride: Any,
                       requires_grad: Any = False, hooks: Any = None, *rest: Any) -> np.ndarray:
    # ``limit`` (bytes still allowed, shared with the storage loader) is charged *before*
    # the copy: a zero stride or one storage rebuilt many times via the memo could otherwise
    # allocate far more than the file holds.
    if type(storage) is not _Storage:
        raise PtFormatError("tensor storage is not a storage")
    if rest and not (len(rest) == 1 and (rest[0] is None or _is_empty_mapping(rest[0]))):
        raise PtFormatError("unexpected tensor rebuild arguments")
    size, stride = _check_dims(size, stride)
    if not _is_int(offset) or not 0 <= offset <= storage.numel:
        raise PtFormatError("bad storage offset")
    if type(requires_grad) is not bool:
        raise PtFormatError("bad requires_grad")
    if hooks is not None and not _is_empty_mapping(hooks):
        raise PtFormatError("backward hooks are not supported")
    numel = math.prod(size)
    dtype = storage.dtype.newbyteorder("=")
    if numel == 0:
        return np.zeros(size, dtype=dtype)
    limit[0] -= numel * storage.dtype.itemsize
    if limit[0] < 0:
        raise PtFormatError("tensors exceed max_bytes")
    view = _view_in_storage(storage, offset, size, stride)
    return np.array(view, dtype=dtype, order="C", copy=True)


class _TensorReader:
    """The hooks the restricted pickle machine calls: globals, storages, tensor rebuilds."""

    def __init__(self, zf: zipfile.ZipFile, prefix: str, limit: list[int]) -> None:
        self._zf = zf
        self._prefix = prefix
        self._limit = limit
        self._storages: dict[str, tuple[_StorageType, _Storage]] = {}

    def find_global(self, module: str, name: str) -> Any:
        if (module, name) == _REBUILD_TENSOR:
            return Global(module, name)
        if module == "torch" and name in _DTYPE_FOR_STORAGE:
            return _StorageType(name)
        raise PtFormatError(f"refusing global {short_name(module)}.{short_name(name)}")

    def rebuild(self, func: Global, args: tuple) -> np.ndarray:
        if (func.module, func.name) != _REBUILD_TENSOR:
            raise PtFormatError(f"refusing call of {func.module}.{func.name}")
        if not 4 <= len(args) <= 7:
            raise PtFormatError(f"tensor rebuild with {len(args)} arguments")
        return _rebuild_tensor_v2(self._limit, *args)

    def persistent_load(self, pid: Any) -> _Storage:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise PtFormatError(f"unsupported persistent id {short_repr(pid)}")
        _, stype, key, location, numel = pid
        if type(stype) is not _StorageType:
            raise PtFormatError("persistent id has no storage type")
        if (type(key) is not str or type(location) is not str
                or len(key) > _MAX_KEY_LEN or len(location) > _MAX_KEY_LEN):
            raise PtFormatError(f"bad storage key/location {short_repr((key, location))}")
        if not _is_int(numel) or not 0 <= numel <= _MAX_EXTENT:
            raise PtFormatError("bad storage size")
        if key in self._storages:
            prev_type, prev = self._storages[key]
            if prev_type.name != stype.name or prev.numel != numel:
                raise PtFormatError(f"storage {short_name(key)} used with conflicting types")
            return prev
        name = f"{self._prefix}data/{key}"
        try:
            info = self._zf.getinfo(name)
        except KeyError:
            raise PtFormatError(f"missing storage entry {short_name(name)}") from None
        expected = numel * stype.dtype.itemsize
        if info.file_size != expected:
            raise PtFormatError(
                f"storage {short_name(key)}: {info.file_size} bytes, expected {expected}")
        self._limit[0] -= expected
        if self._limit[0] < 0:
            raise PtFormatError("file exceeds max_bytes")
        raw = _read_entry(self._zf, info)
        storage = _Storage(np.frombuffer(raw, dtype=stype.dtype))
        self._storages[key] = (stype, storage)
        return storage


def _read_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    try:
        data = zf.read(info)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise PtFormatError(f"cannot read {info.filename}: {exc}") from None
    if len(data) != info.file_size:
        raise PtFormatError(f"truncated entry {info.filename}")
    return data


def _read_small_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    # "3\n", "little": a marker entry is a few bytes, never worth reading a big one.
    if info.file_size > _MAX_MARKER_BYTES:
        raise PtFormatError(f"entry {short_name(info.filename)} is {info.file_size} bytes")
    return _read_entry(zf, info)


def _check_tree(obj: Any, depth: int = 0, seen: set[int] | None = None,
                path: set[int] | None = None) -> None:
    # The pickle memo lets a tiny file reference one container many times (a DAG such as
    # L[k] = [L[k-1], L[k-1]]); visiting each container once keeps this linear instead of
    # exponential, and ``path`` (the ancestors) still catches true recursion.
    if seen is None or path is None:
        seen, path = set(), set()
    if depth > _MAX_DEPTH:
        raise PtFormatError("object nested too deeply (or recursive)")
    if obj is None or type(obj) in (bool, int, float, str) or isinstance(obj, np.ndarray):
        return
    if type(obj) not in (dict, collections.OrderedDict, list, tuple):
        raise PtFormatError(f"unexpected object of type {type(obj).__name__}")
    key = id(obj)
    if key in path:
        raise PtFormatError("object nested too deeply (or recursive)")
    if key in seen:
        return
    seen.add(key)
    path.add(key)
    if type(obj) in (dict, collections.OrderedDict):
        if obj.__class__ is collections.OrderedDict and vars(obj):
            # torch's state_dict() carries a plain ``_metadata`` attribute (module
            # versions); allow exactly that, checked like any other value.
            attrs = vars(obj)
            if set(attrs) != {"_metadata"}:
                raise PtFormatError("unexpected OrderedDict attributes")
            _check_tree(attrs["_metadata"], depth + 1, seen, path)
        for k, v in obj.items():
            if type(k) not in (str, int):
                raise PtFormatError(f"bad dict key type {type(k).__name__}")
            _check_tree(v, depth + 1, seen, path)
    else:
        for v in obj:
            _check_tree(v, depth + 1, seen, path)
    path.discard(key)


def load_pt(path_or_file: str | os.PathLike[str] | IO[bytes],
            max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Read a ``.pt`` file (ours or torch's) with numpy arrays in place of tensors.

    Raises :class:`PtFormatError` for anything that is not a plain tensor checkpoint:
    bad or truncated zip, missing entries, unknown globals, size/stride mismatches,
    more than ``max_bytes`` of (uncompressed) content.
    """
    try:
        zf = zipfile.ZipFile(path_or_file, "r")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise PtFormatError(f"not a .pt zip archive: {exc}") from None
    with zf:
        infos = zf.infolist()
        if not infos:
            raise PtFormatError("empty archive")
        total = 0
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise PtFormatError(f"entry {info.filename} is compressed")
            if info.flag_bits & 0x1:
                raise PtFormatError(f"entry {info.filename} is encrypted")
            total += info.file_size
        if total > max_bytes:
            raise PtFormatError(f"archive content {total} bytes exceeds max_bytes {max_bytes}")
        first = infos[0].filename
        if "/" not in first:
            raise PtFormatError("archive entries have no common root directory")
        prefix = first.split("/", 1)[0] + "/"
        if any(not i.filename.startswith(prefix) for i in infos):
            raise PtFormatError("archive entries have no common root directory")
        names = {i.filename: i for i in infos}
        for required in ("data.pkl", "version"):
            if prefix + required not in names:
                raise PtFormatError(f"missing entry {prefix}{required}")
        version = _read_small_entry(zf, names[prefix + "version"]).strip()
        if version not in (b"1", b"2", b"3"):
            raise PtFormatError(f"unsupported archive version {version[:16]!r}")
        if prefix + "byteorder" in names:
            order = _read_small_entry(zf, names[prefix + "byteorder"]).strip()
            if order != b"little":
                raise PtFormatError(f"unsupported byteorder {order[:16]!r}")
        pkl_info = names[prefix + "data.pkl"]
        if pkl_info.file_size > MAX_PICKLE_BYTES:
            raise PtFormatError(f"data.pkl is {pkl_info.file_size} bytes (a checkpoint's "
                                f"is at most {MAX_PICKLE_BYTES})")
        pkl = _read_entry(zf, pkl_info)
        reader = _TensorReader(zf, prefix, [max_bytes])
        try:
            obj = load_restricted(pkl, find_global=reader.find_global, rebuild=reader.rebuild,
                                  persistent_load=reader.persistent_load)
        except PtFormatError:
            raise
        except PickleRefused as exc:
            raise PtFormatError(f"bad data.pkl: {exc}") from None
        except Exception as exc:  # a reader bug, not a file problem: still a refusal
            raise PtFormatError(f"bad data.pkl: reader fault {type(exc).__name__}") from None
        if isinstance(obj, (_Storage, _StorageType)):
            raise PtFormatError("top-level object is a bare storage")
        _check_tree(obj)
        return obj
