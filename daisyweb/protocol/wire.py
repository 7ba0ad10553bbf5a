"""Peer-to-peer wire protocol: typed messages, one validating decoder, framing.

Messages
--------
Every message is a frozen dataclass with a class-level ``type`` string. On the wire
it is a msgpack map ``{"type": <type>, <field>: <value>, ...}``. :func:`encode`
turns a message into bytes, :func:`decode` is the *only* way back: it checks the
map's keys (no missing, no extra), every field's type and range, and raises
:class:`WireError` (a ``ValueError``) with a clear message on anything wrong.
Constructing a message validates it too, so an invalid message is never sent.

Frames
------
A data channel message is limited in size, so every encoded message travels as
one or more frames (small messages are a single frame: one uniform format).
Each frame is at most ``MAX_FRAME`` (48 KiB = 49152) bytes, header included::

    offset size  field
    0      4     magic    b"DWF1"
    4      8     msg_id   u64, little-endian; sender-chosen, unique per message
    12     4     index    u32, 0 <= index < count
    16     4     count    u32, number of frames of this message (>= 1)
    20     4     total    u32, length of the whole message in bytes (>= 1)
    24     8     checksum blake2b (digest_size=8) of the whole message
    32     ...   chunk    bytes [index*CHUNK, min(total, (index+1)*CHUNK))

with ``CHUNK = MAX_FRAME - HEADER_SIZE``. ``count`` must equal
``ceil(total / CHUNK)`` and every chunk has exactly its expected length, so a
truncated or padded frame is refused on arrival. :class:`Reassembler` collects
frames per ``msg_id`` in any order and returns the message once all arrived and
the checksum matches.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_FRAME",
    "HEADER_SIZE",
    "CHUNK",
    "WireError",
    "Hello",
    "Config",
    "Snapshot",
    "Roster",
    "Gradient",
    "StepHashes",
    "RepairRequest",
    "NO_ROSTER",
    "roster_digest",
    "Heartbeat",
    "Halt",
    "Message",
    "MESSAGE_TYPES",
    "encode",
    "decode",
    "frame",
    "Reassembler",
]

PROTOCOL_VERSION = 2  # 2: Config carries sync_every, codec, outer_lr

# Limits. Generous for the project's models, small enough that a hostile peer
# cannot make us allocate without bound.
MAX_ID_LEN = 128  # peer ids
MAX_TEXT_LEN = 1024  # free text (halt reason, data source)
MAX_HASH_LEN = 128  # hex digests (512-bit max)
MAX_MEMBERS = 1024  # roster size
MAX_PAYLOAD = 1 << 30  # snapshot / gradient bytes
MAX_MESSAGE = MAX_PAYLOAD + (1 << 16)  # decode refuses larger inputs outright
MAX_U64 = (1 << 64) - 1
MAX_STEP = (1 << 63) - 1  # steps fit a signed 64-bit int everywhere
MAX_DIM = 1 << 31

MAX_FRAME = 48 * 1024
_HEADER = struct.Struct("<4sQIII8s")
HEADER_SIZE = _HEADER.size  # 32
CHUNK = MAX_FRAME - HEADER_SIZE
_MAGIC = b"DWF1"
_MAX_TOTAL_FIELD = (1 << 32) - 1


class WireError(ValueError):
    """Anything wrong with bytes received from (or about to go to) the wire."""


# ----------------------------------------------------------------------------
# Field checkers: each takes (type name, field name, value) and returns the
# normalised value or raises WireError.

Checker = Callable[[str, str, Any], Any]


def _fail(t: str, name: str, why: str) -> WireError:
    return WireError(f"{t}.{name}: {why}")


def _int(lo: int, hi: int) -> Checker:
    def check(t: str, name: str, v: Any) -> int:
        # bool is an int subclass; True as a step is a bug, not a value.
        if type(v) is not int:
            raise _fail(t, name, f"expected int, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise _fail(t, name, f"{v} out of range [{lo}, {hi}]")
        return v

    return check


def _float(lo: float, hi: float, lo_open: bool = False) -> Checker:
    def check(t: str, name: str, v: Any) -> float:
        if type(v) not in (int, float):
            raise _fail(t, name, f"expected float, got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f):
            raise _fail(t, name, f"{f} is not finite")
        if f < lo or f > hi or (lo_open and f == lo):
            lb = "(" if lo_open else "["
            raise _fail(t, name, f"{f} out of range {lb}{lo}, {hi}]")
        return f

    return check


def _str(max_len: int, min_len: int = 1) -> Checker:
    def check(t: str, name: str, v: Any) -> str:
        if type(v) is not str:
            raise _fail(t, name, f"expected str, got {type(v).__name__}")
        if len(v) < min_len:
            raise _fail(t, name, "empty string")
        if len(v) > max_len:
            raise _fail(t, name, f"string too long ({len(v)} > {max_len})")
        return v

    return check


_HEX = frozenset("0123456789abcdef")


def _hex(t: str, name: str, v: Any) -> str:
    v = _str(MAX_HASH_LEN, 2)(t, name, v)
    # Lowercase only, so two peers never disagree on the spelling of one hash.
    if len(v) % 2 or not _HEX.issuperset(v):
        raise _fail(t, name, "expected lowercase hex digest of even length")
    return v


def _bytes(max_len: int, multiple: int = 1) -> Checker:
    def check(t: str, name: str, v: Any) -> bytes:
        if type(v) is not bytes:
            raise _fail(t, name, f"expected bytes, got {type(v).__name__}")
        if len(v) > max_len:
            raise _fail(t, name, f"payload too long ({len(v)} > {max_len})")
        if len(v) % multiple:
            raise _fail(t, name, f"payload length {len(v)} not a multiple of {multiple}")
        return v

    return check


def _choice(*allowed: str) -> Checker:
    def check(t: str, name: str, v: Any) -> str:
        if v not in allowed:
            raise _fail(t, name, f"must be one of {', '.join(allowed)}")
        return str(v)

    return check


def _members(t: str, name: str, v: Any) -> tuple[str, ...]:
    if type(v) not in (list, tuple):
        raise _fail(t, name, f"expected list of str, got {type(v).__name__}")
    if not 1 <= len(v) <= MAX_MEMBERS:
        raise _fail(t, name, f"needs 1..{MAX_MEMBERS} members, got {len(v)}")
    check_id = _str(MAX_ID_LEN)
    out = tuple(check_id(t, f"{name}[{i}]", m) for i, m in enumerate(v))
    # Roster order defines the summation order; a repeated peer would double-count.
    if len(set(out)) != len(out):
        raise _fail(t, name, "duplicate member")
    return out


_step = _int(0, MAX_STEP)
_peer = _str(MAX_ID_LEN)
_dim = _int(1, MAX_DIM)


# ----------------------------------------------------------------------------
# Messages


class _Msg:
    """Validating base: subclasses list a checker per field in ``_checks``."""

    type: ClassVar[str]
    _checks: ClassVar[dict[str, Checker]]

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            v = self._checks[f.name](self.type, f.name, getattr(self, f.name))
            # Frozen: normalise (int->float, list->tuple) behind the guard.
            object.__setattr__(self, f.name, v)
        self._check_cross()

    def _check_cross(self) -> None:
        """Cross-field checks; overridden where needed."""


@dataclass(frozen=True)
class Hello(_Msg):
    peer_id: str
    version: int = PROTOCOL_VERSION

    type: ClassVar[str] = "hello"
    _checks: ClassVar[dict[str, Checker]] = {
        "peer_id": _peer,
        "version": _int(0, (1 << 32) - 1),
    }


@dataclass(frozen=True)
class Config(_Msg):
    """The run config the leader broadcasts at start."""

    width: int
    layers: int
    heads: int
    seq: int
    vocab: int
    batch: int
    steps: int
    lr: float
    seed: int
    data: str
    sync_every: int
    codec: str
    outer_lr: float

    type: ClassVar[str] = "config"
    _checks: ClassVar[dict[str, Checker]] = {
        "width": _dim,
        "layers": _dim,
        "heads": _dim,
        "seq": _dim,
        "vocab": _dim,
        "batch": _dim,
        "steps": _int(1, MAX_STEP),
        "lr": _float(0.0, 10.0, lo_open=True),
        "seed": _int(0, MAX_U64),
        "data": _str(MAX_TEXT_LEN),
        "sync_every": _int(1, 1 << 20),
        "codec": _choice("f32", "int8"),
        "outer_lr": _float(0.0, 10.0, lo_open=True),
    }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """Validate a plain run-config dict (e.g. from CLI/JSON) into a Config."""
        if not isinstance(d, dict):
            raise WireError(f"config must be a dict, got {type(d).__name__}")
        return _from_fields(cls, d)  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _check_cross(self) -> None:
        if self.width % self.heads:
            raise _fail(self.type, "heads", f"width {self.width} not divisible by {self.heads}")


@dataclass(frozen=True)
class Snapshot(_Msg):
    step: int
    weight_hash: str
    payload: bytes

    type: ClassVar[str] = "snapshot"
    _checks: ClassVar[dict[str, Checker]] = {
        "step": _step,
        "weight_hash": _hex,
        "payload": _bytes(MAX_PAYLOAD),
    }


@dataclass(frozen=True)
class Roster(_Msg):
    step: int
    members: tuple[str, ...]  # a list is accepted and stored as a tuple (frozen)

    type: ClassVar[str] = "roster"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "members": _members}


@dataclass(frozen=True)
class Gradient(_Msg):
    """``payload`` is the flat gradient as float32 little-endian."""

    step: int
    sender: str
    payload: bytes

    type: ClassVar[str] = "gradient"
    _checks: ClassVar[dict[str, Checker]] = {
        "step": _step,
        "sender": _peer,
        "payload": _bytes(MAX_PAYLOAD, multiple=4),
    }


@dataclass(frozen=True)
class StepHashes(_Msg):
    """Hashes a peer publishes at boundary ``step`` (after ``step`` committed updates).

    ``roster_hash`` is :func:`roster_digest` of the roster whose average produced this
    boundary (``NO_ROSTER`` at a start or snapshot boundary): two peers' weight hashes
    are only comparable when they applied the same roster, which matters when a roster
    is amended and a peer recommits.
    """

    step: int
    sender: str
    weight_hash: str
    probe_hash: str
    roster_hash: str = "00"

    type: ClassVar[str] = "step_hashes"
    _checks: ClassVar[dict[str, Checker]] = {
        "step": _step,
        "sender": _peer,
        "weight_hash": _hex,
        "probe_hash": _hex,
        "roster_hash": _hex,
    }


NO_ROSTER = "00"


def roster_digest(members: tuple[str, ...] | list[str] | None) -> str:
    """Short hex digest of an ordered roster (``NO_ROSTER`` for None)."""
    if members is None:
        return NO_ROSTER
    h = hashlib.blake2b(digest_size=8)
    for m in members:
        b = m.encode("utf-8")
        h.update(struct.pack("<I", len(b)) + b)  # length-prefixed: no ambiguity
    return h.hexdigest()


@dataclass(frozen=True)
class RepairRequest(_Msg):
    step: int
    sender_of_missing: str

    type: ClassVar[str] = "repair_request"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "sender_of_missing": _peer}


@dataclass(frozen=True)
class Heartbeat(_Msg):
    t: float

    type: ClassVar[str] = "heartbeat"
    _checks: ClassVar[dict[str, Checker]] = {"t": _float(0.0, 1e12)}


@dataclass(frozen=True)
class Halt(_Msg):
    step: int
    reason: str

    type: ClassVar[str] = "halt"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "reason": _str(MAX_TEXT_LEN, 0)}


Message = (
    Hello | Config | Snapshot | Roster | Gradient | StepHashes | RepairRequest | Heartbeat | Halt
)

MESSAGE_TYPES: dict[str, type[_Msg]] = {
    cls.type: cls
    for cls in (
        Hello,
        Config,
        Snapshot,
        Roster,
        Gradient,
        StepHashes,
        RepairRequest,
        Heartbeat,
        Halt,
    )
}


def encode(msg: Message) -> bytes:
    """Message -> msgpack bytes (a map with ``type`` plus every field)."""
    cls = MESSAGE_TYPES.get(getattr(type(msg), "type", None))  # type: ignore[arg-type]
    if cls is None or type(msg) is not cls:
        raise WireError(f"not a wire message: {type(msg).__name__}")
    d: dict[str, Any] = {"type": cls.type}
    for f in fields(msg):
        v = getattr(msg, f.name)
        d[f.name] = list(v) if isinstance(v, tuple) else v
    return msgpack.packb(d, use_bin_type=True)


def decode(data: bytes, max_len: int = MAX_MESSAGE) -> Message:
    """Bytes -> Message, refusing anything not exactly a valid message."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_len:
        raise WireError(f"message too long ({len(data)} > {max_len} bytes)")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            # Bound container sizes so garbage cannot request huge allocations.
            max_array_len=MAX_MEMBERS,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types on garbage; all mean "not msgpack"
        raise WireError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if type(obj) is not dict:
        raise WireError(f"message must be a msgpack map, got {type(obj).__name__}")
    t = obj.get("type")
    if type(t) is not str:
        raise WireError("message has no string 'type' field")
    cls = MESSAGE_TYPES.get(t)
    if cls is None:
        raise WireError(f"unknown message type {t[:40]!r}")
    return _from_fields(cls, {k: v for k, v in obj.items() if k != "type"})  # type: ignore


def _from_fields(cls: type[_Msg], obj: dict[str, Any]) -> _Msg:
    """Build ``cls`` from a field dict, refusing missing and extra keys."""
    t = cls.type
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    keys = set(obj)
    missing = [n for n in names if n not in keys]
    if missing:
        raise WireError(f"{t}: missing field(s) {', '.join(missing)}")
    extra = sorted(str(k)[:40] for k in keys - set(names))
    if extra:
        raise WireError(f"{t}: unexpected field(s) {', '.join(extra)}")
    return cls(**{n: obj[n] for n in names})


# ----------------------------------------------------------------------------
# Framing


def _checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def _count_for(total: int) -> int:
    return -(-total // CHUNK)


def frame(msg_bytes: bytes, msg_id: int) -> list[bytes]:
    """Cut one encoded message into frames of at most MAX_FRAME bytes each."""
    if type(msg_id) is not int or not 0 <= msg_id <= MAX_U64:
        raise WireError(f"msg_id must be a u64, got {msg_id!r}")
    if not isinstance(msg_bytes, (bytes, bytearray, memoryview)):
        raise WireError(f"message must be bytes, got {type(msg_bytes).__name__}")
    data = bytes(msg_bytes)
    total = len(data)
    if not 1 <= total <= _MAX_TOTAL_FIELD:
        raise WireError(f"message length {total} not in [1, {_MAX_TOTAL_FIELD}]")
    count = _count_for(total)
    digest = _checksum(data)
    return [
        _HEADER.pack(_MAGIC, msg_id, i, count, total, digest) + data[i * CHUNK : (i + 1) * CHUNK]
        for i in range(count)
    ]


class _Partial:
    __slots__ = ("count", "total", "checksum", "chunks", "size")

    def __init__(self, count: int, total: int, checksum: bytes) -> None:
        self.count = count
        self.total = total
        self.checksum = checksum
        self.chunks: dict[int, bytes] = {}
        self.size = 0


class Reassembler:
    """Collects frames (any order, interleaved ids) into whole messages.

    Memory is bounded by ``max_in_flight * max_total`` bytes of chunks plus a
    fixed-size memory of ``recent`` finished/refused ids. Any refused frame
    drops the partial state of its message id (if one exists) and raises
    WireError; other messages are unaffected.
    """

    def __init__(
        self, max_total: int = 256 * 1024 * 1024, max_in_flight: int = 64, recent: int = 1024
    ) -> None:
        if max_total < 1 or max_in_flight < 1 or recent < 0:
            raise ValueError("max_total and max_in_flight must be >= 1, recent >= 0")
        self.max_total = max_total
        self.max_in_flight = max_in_flight
        self._recent_cap = recent
        self._partials: dict[int, _Partial] = {}
        # Ids already completed or refused: late/duplicate frames for them must
        # not start a fresh partial that would never complete and hold a slot.
        self._recent: OrderedDict[int, None] = OrderedDict()

    @property
    def in_flight(self) -> int:
        """Number of messages partially received."""
        return len(self._partials)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of chunks held for incomplete messages."""
        return sum(p.size for p in self._partials.values())

    def discard(self, msg_id: int) -> None:
        """Forget a partial message (e.g. its sender went away)."""
        self._partials.pop(msg_id, None)

    def _remember(self, msg_id: int) -> None:
        if not self._recent_cap:
            return
        self._recent[msg_id] = None
        self._recent.move_to_end(msg_id)
        while len(self._recent) > self._recent_cap:
            self._recent.popitem(last=False)

    def _refuse(self, msg_id: int | None, why: str) -> WireError:
        if msg_id is not None:
            had = self._partials.pop(msg_id, None) is not None
            self._remember(msg_id)
            if had:
                why += f" (partial message {msg_id} dropped)"
        return WireError(why)

    def feed(self, frame: bytes) -> bytes | None:
        """Add one frame; return the whole message when it completes, else None."""
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise WireError(f"frame must be bytes, got {type(frame).__name__}")
        frame = bytes(frame)
        if len(frame) < HEADER_SIZE:
            raise WireError(f"frame too short ({len(frame)} < {HEADER_SIZE} header bytes)")
        if len(frame) > MAX_FRAME:
            raise WireError(f"frame too long ({len(frame)} > {MAX_FRAME})")
        magic, msg_id, index, count, total, digest = _HEADER.unpack_from(frame)
        if magic != _MAGIC:
            # Without the magic the header is garbage, msg_id included: touch no state.
            raise WireError(f"bad frame magic {magic!r}")
        if msg_id in self._recent:
            raise self._refuse(None, f"message {msg_id}: already completed or refused")
        if total < 1:
            raise self._refuse(msg_id, f"message {msg_id}: total length 0")
        if total > self.max_total:
            raise self._refuse(
                msg_id, f"message {msg_id}: total {total} over limit {self.max_total}"
            )
        if count != _count_for(total):
            raise self._refuse(
                msg_id, f"message {msg_id}: count {count} inconsistent with total {total}"
            )
        if index >= count:
            raise self._refuse(msg_id, f"message {msg_id}: index {index} >= count {count}")
        chunk = frame[HEADER_SIZE:]
        want = CHUNK if index < count - 1 else total - (count - 1) * CHUNK
        if len(chunk) != want:
            raise self._refuse(
                msg_id,
                f"message {msg_id}: frame {index} carries {len(chunk)} bytes, expected {want}",
            )
        p = self._partials.get(msg_id)
        if p is None:
            if len(self._partials) >= self.max_in_flight:
                # Refuse the newcomer, keep the ones already in progress.
                raise self._refuse(
                    msg_id, f"message {msg_id}: too many messages in flight ({self.max_in_flight})"
                )
            p = _Partial(count, total, digest)
            self._partials[msg_id] = p
        elif (p.count, p.total, p.checksum) != (count, total, digest):
            raise self._refuse(
                msg_id,
                f"message {msg_id}: frame {index} disagrees with earlier frames "
                f"(count/total/checksum {count}/{total}/{digest.hex()} vs "
                f"{p.count}/{p.total}/{p.checksum.hex()})",
            )
        if index in p.chunks:
            raise self._refuse(msg_id, f"message {msg_id}: duplicate frame {index}")
        p.chunks[index] = chunk
        p.size += len(chunk)
        if len(p.chunks) < p.count:
            return None
        del self._partials[msg_id]
        self._remember(msg_id)
        data = b"".join(p.chunks[i] for i in range(p.count))
        if _checksum(data) != p.checksum:
            raise WireError(f"message {msg_id}: checksum mismatch, message dropped")
        return data
