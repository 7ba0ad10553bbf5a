"""Data channel framing: one encoded wire message as frames of at most 48 KiB.

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

Errors are :class:`daisyweb.protocol.wire.WireError`, like every other refusal of bytes
from the wire. :func:`frame_id` reads just the message id of a frame, for a receiver
that wants to report one broken message once rather than once per frame.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from daisyweb.protocol.wire import MAX_U64, Part, WireError

__all__ = ["MAX_FRAME", "HEADER_SIZE", "CHUNK", "BudgetExceeded", "frame", "frame_id",
           "iter_frames", "Reassembler"]

MAX_FRAME = 48 * 1024
_HEADER = struct.Struct("<4sQIII8s")
HEADER_SIZE = _HEADER.size  # 32
CHUNK = MAX_FRAME - HEADER_SIZE
_MAGIC = b"DWF1"
_ID = struct.Struct("<4sQ")  # the start of the header: magic, msg_id
_MAX_TOTAL_FIELD = (1 << 32) - 1


def _checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def _count_for(total: int) -> int:
    return -(-total // CHUNK)


def frame(msg_bytes: bytes, msg_id: int) -> list[bytes]:
    """Cut one encoded message into frames of at most MAX_FRAME bytes each."""
    return list(iter_frames(msg_bytes, msg_id))


def iter_frames(msg_bytes: bytes | Sequence[Part], msg_id: int) -> Iterator[bytes]:
    """The frames of :func:`frame`, made one at a time as the sender takes them (a big
    message is not copied into a list of frames first). Checked before the first one.

    ``msg_bytes`` may also be a sequence of parts (``wire.encode_parts``): the frames
    are those of the parts' concatenation, which is never made.
    """
    if type(msg_id) is not int or not 0 <= msg_id <= MAX_U64:
        raise WireError(f"msg_id must be a u64, got {msg_id!r}")
    parts = [msg_bytes] if isinstance(msg_bytes, (bytes, bytearray, memoryview)) else (
        list(msg_bytes) if isinstance(msg_bytes, (list, tuple)) else [msg_bytes])
    for part in parts:
        if not isinstance(part, (bytes, bytearray, memoryview)):
            raise WireError(f"message must be bytes, got {type(part).__name__}")
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(len(v) for v in views)
    if not 1 <= total <= _MAX_TOTAL_FIELD:
        raise WireError(f"message length {total} not in [1, {_MAX_TOTAL_FIELD}]")
    count = _count_for(total)
    h = hashlib.blake2b(digest_size=8)
    for v in views:
        h.update(v)
    digest = h.digest()
    if len(views) == 1:
        data = views[0]
        return (
            _HEADER.pack(_MAGIC, msg_id, i, count, total, digest)
            + data[i * CHUNK : (i + 1) * CHUNK]
            for i in range(count)
        )
    return _frames_of_parts(views, msg_id, count, total, digest)


def _frames_of_parts(views: list[memoryview], msg_id: int, count: int,
                     total: int, digest: bytes) -> Iterator[bytes]:
    starts = [0]
    for v in views:
        starts.append(starts[-1] + len(v))
    for i in range(count):
        lo, hi = i * CHUNK, min((i + 1) * CHUNK, total)
        chunk = [v[max(lo - a, 0):hi - a]
                 for v, a, b in zip(views, starts, starts[1:], strict=False)
                 if a < hi and b > lo]
        yield b"".join([_HEADER.pack(_MAGIC, msg_id, i, count, total, digest), *chunk])


def frame_id(data: bytes) -> int | None:
    """The msg_id of a frame, or None if it is too short for one or has no magic.

    Reads only the first 12 header bytes, so a frame refused for any other reason
    (truncated, padded, inconsistent) still names the message it belonged to.
    """
    if len(data) < _ID.size:
        return None
    magic, msg_id = _ID.unpack_from(data)
    return msg_id if magic == _MAGIC else None


class BudgetExceeded(WireError):
    """A new message would push the bytes reserved for reassembly over ``max_buffered``:
    the sender is not following the protocol (the receiver drops it, not the message)."""


class _Partial:
    # Chunks are copied into one buffer of the declared size as they arrive (what the
    # budget reserved), so completing a message never holds its bytes twice.
    __slots__ = ("count", "total", "checksum", "buf", "have", "size")

    def __init__(self, count: int, total: int, checksum: bytes) -> None:
        self.count = count
        self.total = total
        self.checksum = checksum
        self.buf = bytearray(total)
        self.have: set[int] = set()
        self.size = 0


class Reassembler:
    """Collects frames (any order, interleaved ids) into whole messages.

    Memory is bounded by ``max_buffered`` bytes of chunks (the declared totals of the
    messages in progress are reserved when their first frame arrives; default
    ``max_in_flight * max_total``) plus a fixed-size memory of ``recent``
    finished/refused ids. Any refused frame drops the partial state of its message id
    (if one exists) and raises WireError; other messages are unaffected. A new message
    that does not fit the budget raises :class:`BudgetExceeded`.
    """

    def __init__(
        self, max_total: int = 256 * 1024 * 1024, max_in_flight: int = 64, recent: int = 1024,
        max_buffered: int | None = None,
    ) -> None:
        if max_total < 1 or max_in_flight < 1 or recent < 0:
            raise ValueError("max_total and max_in_flight must be >= 1, recent >= 0")
        self.max_total = max_total
        self.max_in_flight = max_in_flight
        self.max_buffered = max_in_flight * max_total if max_buffered is None else max_buffered
        self._reserved = 0  # declared totals of the partial messages
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

    @property
    def reserved_bytes(self) -> int:
        """Declared sizes of the incomplete messages (what the budget counts)."""
        return self._reserved

    def set_limits(self, max_total: int, max_buffered: int) -> None:
        """New bounds (the run became known); messages already in progress are kept."""
        if max_total < 1 or max_buffered < 1:
            raise ValueError("max_total and max_buffered must be >= 1")
        self.max_total = max_total
        self.max_buffered = max_buffered

    def discard(self, msg_id: int) -> None:
        """Forget a partial message (e.g. its sender went away)."""
        p = self._partials.pop(msg_id, None)
        if p is not None:
            self._reserved -= p.total

    def _drop(self, msg_id: int) -> bool:
        p = self._partials.pop(msg_id, None)
        if p is None:
            return False
        self._reserved -= p.total
        return True

    def _remember(self, msg_id: int) -> None:
        if not self._recent_cap:
            return
        self._recent[msg_id] = None
        self._recent.move_to_end(msg_id)
        while len(self._recent) > self._recent_cap:
            self._recent.popitem(last=False)

    def _refuse(self, msg_id: int | None, why: str) -> WireError:
        if msg_id is not None:
            had = self._drop(msg_id)
            self._remember(msg_id)
            if had:
                why += f" (partial message {msg_id} dropped)"
        return WireError(why)

    def feed(self, frame: bytes) -> bytearray | None:
        """Add one frame; return the whole message when it completes, else None (a
        bytearray: the buffer it was assembled in, not copied again)."""
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
        chunk = memoryview(frame)[HEADER_SIZE:]
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
            if count > 1 and self._reserved + total > self.max_buffered:
                self._remember(msg_id)  # its other frames are refused without a new error
                raise BudgetExceeded(
                    f"message {msg_id} of {total:,} bytes would hold "
                    f"{self._reserved + total:,} bytes in reassembly, over the budget of "
                    f"{self.max_buffered:,}")
            p = _Partial(count, total, digest)
            self._partials[msg_id] = p
            self._reserved += total
        elif (p.count, p.total, p.checksum) != (count, total, digest):
            raise self._refuse(
                msg_id,
                f"message {msg_id}: frame {index} disagrees with earlier frames "
                f"(count/total/checksum {count}/{total}/{digest.hex()} vs "
                f"{p.count}/{p.total}/{p.checksum.hex()})",
            )
        if index in p.have:
            raise self._refuse(msg_id, f"message {msg_id}: duplicate frame {index}")
        p.have.add(index)
        p.buf[index * CHUNK : index * CHUNK + len(chunk)] = chunk
        p.size += len(chunk)
        if len(p.have) < p.count:
            return None
        self._drop(msg_id)
        self._remember(msg_id)
        if _checksum(p.buf) != p.checksum:
            raise WireError(f"message {msg_id}: checksum mismatch, message dropped")
        return p.buf
