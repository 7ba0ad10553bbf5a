"""Codecs for what members exchange each step or round: float32 vectors <-> payload bytes.

Every member decodes the *same bytes* (its own included) and averages the decoded
vectors, so a lossy codec still leaves every replica bit-identical. ``decode`` is the
validating side: a wrong length or any NaN/Inf raises :class:`GradientError`, exactly as
a bad raw gradient does.

``int8`` (:class:`Int8Codec`) is blockwise absmax int8 with float32 scales on the wire;
its quantization is a fixed sequence of elementwise IEEE float32 operations, so every
machine turns one vector into the same bytes and one payload into the same vector.
``int4`` (:class:`Int4Codec`) is the same recipe with 4-bit values (two to a byte) in
smaller blocks: 0.56 bytes a value instead of 1.02. The sender keeps its quantization
error and adds it to its next contribution (:class:`ErrorFeedback`), which is what lets
a round delta lose so many bits and the run train as well (``docs/limits.md``, 2).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from daisyweb.protocol.averaging import GradientError, Parts, check_gradient

__all__ = ["Codec", "F32Codec", "F32", "Int8Codec", "INT8", "Int4Codec", "INT4", "Int2Codec",
           "INT2", "SparseCodec", "SPARSE",
           "ErrorFeedback",
           "ErrorFeedbackEncoder", "check_payload", "codec_by_name", "decode_parts", "CODECS"]

_F32 = np.float32


class Codec(Protocol):
    """Turns a float32 vector into payload bytes and back (validated)."""

    name: str

    def encode(self, vector: np.ndarray) -> bytes: ...

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray:
        """A new float32 array of ``size`` (the caller may write it: the step machine sums
        into the first it decodes), or GradientError."""
        ...


class F32Codec:
    """Little-endian float32, lossless: DaisyChain-Web's exchange (``--sync-every 1
    --codec f32``)."""

    name = "f32"

    def encode(self, vector: np.ndarray) -> bytes:
        return np.ascontiguousarray(vector, dtype="<f4").tobytes()

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray:
        if len(payload) != 4 * size:
            raise GradientError(f"{who}: expected {size} values, got {len(payload)} bytes")
        return check_gradient(np.frombuffer(payload, dtype="<f4").astype(np.float32), size, who)

    def decode_parts(self, payload: bytes, size: int, who: str = "payload") -> Parts:
        self.check(payload, size, who)
        return _f32_parts(payload, size)

    def check(self, payload: bytes, size: int, who: str = "payload") -> None:
        """What :meth:`decode` refuses, checked on the bytes in place (no vector made)."""
        if len(payload) != 4 * size:
            raise GradientError(f"{who}: expected {size} values, got {len(payload)} bytes")
        view = np.frombuffer(payload, dtype="<f4").astype(np.float32, copy=False)
        check_gradient(view, size, who)

    def encoder(self, size: int) -> F32Codec:
        """Lossless, so there is no error to feed back: the codec is its own encoder."""
        return self


# -- int8 -------------------------------------------------------------------------------

INT8_BLOCK = 256
"""Values per scale: 4/256 = 1.6% extra bytes; about 25% less error than 1024 per value."""

_TINY = _F32(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32
_MAX_SCALE = _F32(2.0**120)  # 127 * _MAX_SCALE < 2**127: a decoded value is always finite
_HALF = _F32(0.5)
_ONE = _F32(1.0)
_TWO = _F32(2.0)
_CHUNK_VALUES = 1 << 16  # values per chunk of encoding work (256 KiB of float32), whole blocks


class Int8Codec:
    """Blockwise absmax int8 with float32 scales, exact on every IEEE machine.

    Wire layout of a vector of ``size`` values (no header, little-endian)::

        [scale float32 x nblocks][q int8 x size]      nblocks = ceil(size / block)

    Block ``b`` holds values ``b*block .. min((b+1)*block, size) - 1`` (the last block may
    be shorter). Encoding, all elementwise float32 (``L = 127``, :attr:`levels`):

    - values whose magnitude is below 2**-126 (subnormals) count as 0, so flush-to-zero
      hardware gives the same bytes;
    - ``m = max|x|`` over the block (a max is exact in any order);
    - ``scale = f32(m / L)``; a scale below 2**-126 becomes 0 (a zero block);
    - ``q = clamp(floor(x / scale + 0.5), -L, L)``; a zero block divides by 1 instead
      (its values are all below L * 2**-126, so q = 0) and never computes 0/0.

    Decoding is ``f32(q) * scale``. ``-(L + 1)`` (-128) is never produced and is refused,
    as are scales that are NaN/Inf, negative (``-0.0`` included), subnormal or above
    2**120, so every decoded value is a finite float32.
    """

    name = "int8"
    levels = 127  # the largest |q|
    default_block = INT8_BLOCK

    def __init__(self, block: int | None = None) -> None:
        block = self.default_block if block is None else block
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"{self.name} block must be a positive integer, got {block!r}")
        self.block = block
        self._levels = _F32(self.levels)

    def nblocks(self, size: int) -> int:
        return -(-size // self.block)

    def _chunk(self) -> int:
        """Values per chunk of encoding work: whole blocks, about ``_CHUNK_VALUES``
        (a size in values, not a count of blocks: int4's small blocks would otherwise
        make many more chunks, each a round of Python calls)."""
        return max(1, _CHUNK_VALUES // self.block) * self.block

    def values_size(self, size: int) -> int:
        """Bytes of the values part of a payload of ``size`` values."""
        return size

    def payload_size(self, size: int) -> int:
        return 4 * self.nblocks(size) + self.values_size(size)

    def _blocks(self, flat: np.ndarray) -> np.ndarray:
        """``flat`` zero-padded to whole blocks, shape [nblocks, block]."""
        nb = self.nblocks(flat.size)
        padded = np.zeros(nb * self.block, np.float32)
        padded[: flat.size] = flat
        return padded.reshape(nb, self.block)

    def quantize(self, vector: np.ndarray, who: str = "vector") -> tuple[np.ndarray, np.ndarray]:
        """``(scales float32 [nblocks], q int8 [size])`` of a finite float32 vector."""
        if not isinstance(vector, np.ndarray) or vector.ndim != 1:
            raise GradientError(f"{who}: expected a 1-D float32 array")
        x = check_gradient(vector, vector.size, who)
        scales = np.empty(self.nblocks(x.size), np.float32)
        q = np.empty(x.size, np.int8)
        # Whole blocks at a time: every operation is per element or per block, so the
        # bytes are those of the whole vector at once, with temporaries of one chunk.
        step = self._chunk()
        for start in range(0, x.size, step):
            stop = min(start + step, x.size)
            first = start // self.block
            s, qc = self._quantize_blocks(x[start:stop])
            scales[first : first + s.size] = s
            q[start:stop] = qc
        if np.any(scales > _MAX_SCALE):
            raise GradientError(f"{who}: values above {float(_MAX_SCALE) * self.levels:.3g} "
                                f"cannot be sent as {self.name}")
        return scales.astype("<f4"), q

    def _quantize_blocks(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scales and integer values of ``x``, whole blocks (the last one may be short)."""
        blocks = self._blocks(x) if x.size % self.block else x.reshape(-1, self.block)
        magnitude = np.abs(blocks)
        # Subnormals count as 0 without being zeroed first: one never sets a block's
        # scale (a block whose largest magnitude is subnormal gets scale 0 below either
        # way), and its q is set to 0 after the arithmetic.
        scales, divisor = self._block_scales(magnitude)
        q = np.divide(blocks, divisor)
        self._round(q, magnitude < _TINY)
        # |x / scale| <= L * (1 + 2**-23), so the clamp never binds; it states the range.
        np.clip(q, -self._levels, self._levels, out=q)
        return scales, q.reshape(-1)[: x.size].astype(np.int8)

    def _block_scales(self, magnitude: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each block's scale (a row of ``magnitude``: ``f32(max / L)``, 0 below 2**-126)
        and what its values are divided by (the scale; 1 for a zero block, so 0/0 is
        never computed)."""
        m = magnitude.max(axis=1) if magnitude.size else np.zeros(0, np.float32)
        scales = m / self._levels
        scales[scales < _TINY] = 0.0
        return scales, np.where(scales == 0, _ONE, scales)[:, None]

    def _round(self, t: np.ndarray, zero: np.ndarray) -> None:
        """``t = x / scale`` to its level, in place: the nearest integer (ties upward);
        where ``zero`` (the value counts as 0), 0."""
        t += _HALF
        np.floor(t, out=t)
        np.copyto(t, _F32(0.0), where=zero)

    def _pack(self, q: np.ndarray) -> bytes:
        """The values part of the payload."""
        return q.tobytes()

    def _check_values(self, raw: memoryview, size: int, who: str) -> None:
        """Refuse a values part holding the reserved value."""
        bad = int(np.count_nonzero(np.frombuffer(raw, dtype=np.int8, count=size) == -128))
        if bad:
            raise GradientError(f"{who}: {bad} int8 values are -128 (reserved)")

    def _values(self, raw: memoryview, size: int) -> np.ndarray:
        """``f32(q)`` of a checked values part: a new float32 array of ``size``."""
        return self._values_range(raw, 0, size)

    def _values_range(self, raw: memoryview, start: int, stop: int) -> np.ndarray:
        """``f32(q)`` of values ``start .. stop`` (``start`` even for int4): a new array."""
        return np.frombuffer(raw, dtype=np.int8, count=stop - start,
                             offset=start).astype(np.float32)

    def _scale(self, values: np.ndarray, scales: np.ndarray) -> None:
        """``values *= scale`` of each one's block, in place: ``f32(q) * scale``."""
        full = values.size // self.block
        whole = full * self.block
        values[:whole].reshape(full, self.block)[...] *= scales[:full, None]
        if values.size > whole:
            values[whole:] *= scales[full]

    def encode(self, vector: np.ndarray) -> bytes:
        scales, q = self.quantize(vector)
        return scales.tobytes() + self._pack(q)

    def encode_decoded(self, vector: np.ndarray) -> tuple[bytes, np.ndarray]:
        """``(payload, decode(payload))`` without unpacking the payload again: the decoded
        vector is made from the integer values the encoding produced (the same
        ``f32(q) * scale``, so the same bits)."""
        scales, q = self.quantize(vector)
        decoded = q.astype(np.float32)
        self._scale(decoded, scales)
        return scales.tobytes() + self._pack(q), decoded

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray:
        scales, raw = self._checked(payload, size, who)
        out = self._values(raw, size)
        self._scale(out, scales)
        return check_gradient(out, size, who)

    def decode_parts(self, payload: bytes, size: int, who: str = "payload") -> Parts:
        scales, raw = self._checked(payload, size, who)
        return self._parts(scales, raw, size)

    def _parts(self, scales: np.ndarray, raw: memoryview, size: int) -> Parts:
        step = self._chunk()
        step *= 1 + step % 2  # int4 packs two values a byte: parts start on a byte
        for start in range(0, size, step):
            stop = min(start + step, size)
            values = self._values_range(raw, start, stop)
            self._scale(values, scales[start // self.block:])
            yield slice(start, stop), values

    def check(self, payload: bytes, size: int, who: str = "payload") -> None:
        """What :meth:`decode` refuses, without making the vector: the scales and values
        it refuses are all that can make a decoded value wrong (valid ones always decode
        to finite float32, see the class docstring)."""
        self._checked(payload, size, who)

    def _checked(self, payload: bytes, size: int, who: str) -> tuple[np.ndarray, memoryview]:
        """The payload's scales (float32) and its values part, validated."""
        nb = self.nblocks(size)
        want = self.payload_size(size)
        if len(payload) != want:
            raise GradientError(f"{who}: expected {want} bytes of {self.name} payload for "
                                f"{size} values ({nb} scales), got {len(payload)} bytes")
        scales = np.frombuffer(payload, dtype="<f4", count=nb).astype(np.float32)
        bad = int(np.count_nonzero(~np.isfinite(scales)))
        if bad:
            raise GradientError(f"{who}: {bad} NaN/Inf {self.name} scales")
        bad = int(np.count_nonzero(np.signbit(scales)))
        if bad:
            raise GradientError(f"{who}: {bad} negative {self.name} scales")
        bad = int(np.count_nonzero((scales != 0) & (scales < _TINY)))
        if bad:
            raise GradientError(f"{who}: {bad} subnormal {self.name} scales")
        bad = int(np.count_nonzero(scales > _MAX_SCALE))
        if bad:
            raise GradientError(f"{who}: {bad} {self.name} scales above 2**120")
        raw = memoryview(payload)[4 * nb:]
        self._check_values(raw, size, who)
        return scales, raw

    def encoder(self, size: int) -> ErrorFeedbackEncoder:
        """A sender's stateful encoder for vectors of ``size``: this codec + error feedback."""
        return ErrorFeedbackEncoder(self, size)


INT4_BLOCK = 64
"""Values per int4 scale: 4/64 = 0.06 extra bytes a value, 0.56 in all."""


class Int4Codec(Int8Codec):
    """Blockwise absmax with 4-bit values: :class:`Int8Codec`'s recipe with ``L = 7``.

    Wire layout (no header)::

        [scale float32 x nblocks][ceil(size / 2) bytes of values]

    Value ``2i`` is the low nibble of byte ``i`` and value ``2i + 1`` its high nibble,
    each a 4-bit two's complement integer in -7..7; an odd ``size`` leaves the last high
    nibble 0. -8 is never produced and is refused, as is a non-zero padding nibble (so a
    vector has exactly one payload), besides everything :class:`Int8Codec` refuses.
    """

    name = "int4"
    levels = 7
    default_block = INT4_BLOCK

    def values_size(self, size: int) -> int:
        return -(-size // 2)

    def _pack(self, q: np.ndarray) -> bytes:
        nibbles = np.zeros(2 * self.values_size(q.size), np.uint8)
        np.bitwise_and(q.view(np.uint8), 0x0F, out=nibbles[: q.size])
        return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()

    def _check_values(self, raw: memoryview, size: int, who: str) -> None:
        packed = np.frombuffer(raw, dtype=np.uint8, count=self.values_size(size))
        if size % 2 and packed[-1] >> 4:
            raise GradientError(f"{who}: the int4 padding nibble is not 0")
        # -8 is nibble 0b1000, in either half of a byte (a padding nibble is 0: checked above)
        bad = int(np.count_nonzero((packed & 0x0F) == 8)) + int(np.count_nonzero(
            (packed >> 4) == 8))
        if bad:
            raise GradientError(f"{who}: {bad} int4 values are -8 (reserved)")

    def _values_range(self, raw: memoryview, start: int, stop: int) -> np.ndarray:
        first, last = start // 2, self.values_size(stop)
        packed = np.frombuffer(raw, dtype=np.uint8, count=last - first, offset=first)
        # Each byte looked up as its two values (low nibble first), one 8-byte table entry
        # per byte (indexing, not np.take: about 3x faster here); an odd size leaves the
        # padding nibble's 0 past the end.
        return _INT4_PAIRS[packed].view(np.float32)[: stop - start]


def _int4_pairs() -> np.ndarray:
    """uint64 [256]: byte -> its low nibble's value then its high nibble's value as two
    float32 (native byte order), each nibble a 4-bit two's complement integer."""
    nibble = np.arange(16)
    value = np.where(nibble > 7, nibble - 16, nibble).astype(np.float32)
    byte = np.arange(256)
    pairs = np.ascontiguousarray(np.stack([value[byte & 0x0F], value[byte >> 4]], axis=1))
    table = pairs.view(np.uint64).reshape(256)
    table.flags.writeable = False
    return table


_INT4_PAIRS = _int4_pairs()

INT2_BLOCK = 64
"""Values per int2 scale: 4/64 = 0.06 extra bytes a value, 0.31 in all."""

class Int2Codec(Int8Codec):
    """Blockwise absmax with 2-bit values: four levels, ``q`` in {-3, -1, 1, 3}.

    Wire layout (no header)::

        [scale float32 x nblocks][ceil(size / 4) bytes of values]

    ``scale = f32(max|x| / 3)`` as :class:`Int8Codec` with ``L = 3``; ``q`` is the odd
    integer nearest ``x / scale`` (ties upward): ``2 floor(x / scale / 2) + 1``, clamped to
    [-3, 3], all exact float32 operations; values below 2**-126 count as 0 and take
    ``q = 1`` (0 has no code: what a small value loses, error feedback carries to the next
    contribution). Value ``4i + k`` is bits ``2k .. 2k + 1`` of byte ``i``, the code
    ``(q + 3) / 2`` (0..3); the padding codes of a size that is not a multiple of 4 are 0
    and anything else is refused, so a vector has exactly one payload. Decoding is
    ``f32(q) * scale``.
    """

    name = "int2"
    levels = 3
    default_block = INT2_BLOCK

    def values_size(self, size: int) -> int:
        return -(-size // 4)

    def _round(self, t: np.ndarray, zero: np.ndarray) -> None:
        _round_odd(t, zero)

    def _pack(self, q: np.ndarray) -> bytes:
        return _pack_crumbs(q).tobytes()

    def _check_values(self, raw: memoryview, size: int, who: str) -> None:
        pad = 4 * self.values_size(size) - size
        if pad:
            last = int(np.frombuffer(raw, dtype=np.uint8, count=self.values_size(size))[-1])
            if last >> (2 * (4 - pad)):
                raise GradientError(f"{who}: the int2 padding codes are not 0")

    def _values_range(self, raw: memoryview, start: int, stop: int) -> np.ndarray:
        first, last = start // 4, self.values_size(stop)
        packed = np.frombuffer(raw, dtype=np.uint8, count=last - first, offset=first)
        skip = start - 4 * first
        return _INT2_QUADS[packed].reshape(-1)[skip: skip + stop - start].copy()


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    """Odd levels ``q`` (-3..3, along the last axis) as 2-bit codes ``(q + 3) / 2``, four
    to a byte, lowest bits first; a last byte's missing codes are 0."""
    codes = np.zeros((*q.shape[:-1], 4 * -(-q.shape[-1] // 4)), np.uint8)
    codes[..., : q.shape[-1]] = (q + 3) // 2
    return (codes[..., 0::4] | (codes[..., 1::4] << 2) | (codes[..., 2::4] << 4)
            | (codes[..., 3::4] << 6)).astype(np.uint8)


def _round_odd(t: np.ndarray, zero: np.ndarray) -> None:
    """``t`` to the odd integer nearest it (ties upward), in place, exactly in float32:
    ``2 floor(t / 2) + 1``; where ``zero`` (the value counts as 0, which has no code), 1."""
    t /= _TWO  # exact: a power of two
    np.floor(t, out=t)
    t *= _TWO
    t += _ONE
    np.copyto(t, _ONE, where=zero)


def _int2_quads() -> np.ndarray:
    """float32 [256, 4]: byte -> its four values, lowest bits first."""
    value = np.array([-3.0, -1.0, 1.0, 3.0], np.float32)
    byte = np.arange(256)
    table = np.stack([value[(byte >> (2 * k)) & 3] for k in range(4)], axis=1)
    table = np.ascontiguousarray(table, dtype=np.float32)
    table.flags.writeable = False
    return table


_INT2_QUADS = _int2_quads()

SPARSE_BLOCK = 256
SPARSE_KEEP = 32
"""Values kept of every ``SPARSE_BLOCK``: 12.5%, each at two bits. Keeping 3% (SparseLoCo
keeps 1-3% over far longer runs) cost 0.19 in held-out loss at the demo's 300 steps, 12.5%
0.06 (``python -m bench.codecs``, TEST_RESULTS.md section "codecs")."""


class SparseCodec(Int8Codec):
    """The ``keep`` largest of every block of ``block`` values at 2 bits, the rest 0.

    Wire layout (no header)::

        [scale float32 x nblocks][record x nblocks]

    Block ``b``'s record holds ``k = min(keep, its length)`` kept values: their in-block
    indices (uint8, strictly increasing), then their :class:`Int2Codec` codes, four to a
    byte, lowest bits first, padding codes 0. Kept are the ``k`` values of largest
    magnitude, ties to the lower index (values below 2**-126 count as 0): a stable sort
    on exact float32 magnitudes, so every machine keeps the same ones. A kept value is
    quantized as :class:`Int2Codec` does, ``scale = f32(max|x| / 3)``; the others decode
    to 0. Error feedback carries what was not sent into the next contribution. Indices
    out of order, repeated or past the block's end, and set padding codes, are refused.
    """

    name = "sparse"
    levels = 3
    default_block = SPARSE_BLOCK
    keep = SPARSE_KEEP

    def __init__(self, block: int | None = None) -> None:
        super().__init__(block)
        if self.block > 256:
            raise ValueError(f"{self.name} block must be at most 256, got {self.block}")

    def _kept(self, length: int) -> int:
        return min(self.keep, length)

    def _record(self, length: int) -> int:
        k = self._kept(length)
        return k + -(-k // 4)

    def values_size(self, size: int) -> int:
        full, rest = divmod(size, self.block)
        return full * self._record(self.block) + (self._record(rest) if rest else 0)

    def _runs(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``start .. stop`` (``start`` on a block) as runs ``(lo, hi, block length)`` of
        blocks of one length: the whole blocks, then a short last one."""
        whole = start + (stop - start) // self.block * self.block
        runs = [(start, whole, self.block)] if whole > start else []
        return runs + ([(whole, stop, stop - whole)] if stop > whole else [])

    def _quantize_blocks(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scales = np.empty(self.nblocks(x.size), np.float32)
        q = np.zeros(x.size, np.int8)
        for lo, hi, length in self._runs(0, x.size):
            s, qr = self._quantize_whole(x[lo:hi].reshape(-1, length))
            scales[lo // self.block: lo // self.block + s.size], q[lo:hi] = s, qr.reshape(-1)
        return scales, q

    def _quantize_whole(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scales and q of blocks of one length (rows of ``blocks``)."""
        magnitude = np.abs(blocks)
        magnitude[magnitude < _TINY] = 0.0
        k = self._kept(blocks.shape[1])
        order = np.argsort(-magnitude, axis=1, kind="stable")[:, :k]
        rows = np.arange(blocks.shape[0])[:, None]
        scales, divisor = self._block_scales(magnitude)
        kept = np.divide(blocks[rows, order], divisor)
        _round_odd(kept, magnitude[rows, order] == 0)
        np.clip(kept, -self._levels, self._levels, out=kept)
        q = np.zeros(blocks.shape, np.int8)
        q[rows, order] = kept.astype(np.int8)
        return scales, q

    def _pack(self, q: np.ndarray) -> bytes:
        out = []
        for lo, hi, length in self._runs(0, q.size):
            blocks = q[lo:hi].reshape(-1, length)
            # each block's kept values are its non-zero q: their indices, in order
            idx = np.argsort(blocks == 0, axis=1, kind="stable")[:, : self._kept(length)]
            codes = _pack_crumbs(np.take_along_axis(blocks, idx, axis=1))
            out.append(np.concatenate([idx.astype(np.uint8), codes], axis=1).tobytes())
        return b"".join(out)

    def _records(self, raw: memoryview, start: int, stop: int
                 ) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """(first value, block length, indices [n, k], levels [n, 4 ceil(k / 4)]) of the
        blocks of ``start .. stop`` (``start`` on a block), in runs of one length; a
        padding code (0) reads as the level -3."""
        out = []
        for lo, hi, length in self._runs(start, stop):
            n, k, rec = (hi - lo) // length, self._kept(length), self._record(length)
            recs = np.frombuffer(raw, dtype=np.uint8, count=n * rec,
                                 offset=self.values_size(lo)).reshape(n, rec)
            out.append((lo, length, recs[:, :k], _INT2_QUADS[recs[:, k:]].reshape(n, -1)))
        return out

    def _check_values(self, raw: memoryview, size: int, who: str) -> None:
        for _, length, idx, levels in self._records(raw, 0, size):
            k = idx.shape[1]
            if k > 1 and not (idx[:, 1:] > idx[:, :-1]).all():
                raise GradientError(f"{who}: {self.name} indices not strictly increasing")
            if (idx >= length).any():
                raise GradientError(f"{who}: a {self.name} index past its block's end")
            if (levels[:, k:] != -3).any():  # code 0
                raise GradientError(f"{who}: the {self.name} padding codes are not 0")

    def _values_range(self, raw: memoryview, start: int, stop: int) -> np.ndarray:
        out = np.zeros(stop - start, np.float32)
        for lo, length, idx, levels in self._records(raw, start, stop):
            base = (lo - start) + length * np.arange(idx.shape[0])[:, None]
            out[(base + idx).reshape(-1)] = levels[:, : idx.shape[1]].reshape(-1)
        return out


class ErrorFeedback:
    """A sender's quantization error, carried into its next contribution.

    ``encode(codec, v)`` sends ``v + residual`` and keeps
    ``residual = (v + residual) - decode(bytes)``, all float32 elementwise; so the sum of
    what a sender's bytes decode to over any number of rounds differs from the sum of its
    true vectors by the current residual only (about half a quantization step), instead
    of accumulating every round's error. Purely local: it never goes on the wire.
    """

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be a non-negative integer, got {size!r}")
        self.size = size
        self.residual = np.zeros(size, np.float32)

    def encode_decoded(self, codec: Codec, vector: np.ndarray) -> tuple[bytes, np.ndarray]:
        """``(payload, what every member decodes it to)``; the residual moves only on success."""
        x = check_gradient(vector, self.size, "vector")
        target = x + self.residual
        both = getattr(codec, "encode_decoded", None)
        if both is not None:
            payload, decoded = both(target)
        else:
            payload = codec.encode(target)
            decoded = codec.decode(payload, self.size, "own payload")
        # target - decoded, into target's own buffer (a temporary): the same values
        self.residual = np.subtract(target, decoded, out=target)
        return payload, decoded

    def encode(self, codec: Codec, vector: np.ndarray) -> bytes:
        return self.encode_decoded(codec, vector)[0]

    def reset(self) -> None:
        self.residual = np.zeros(self.size, np.float32)


class ErrorFeedbackEncoder:
    """``codec`` bound to one sender's :class:`ErrorFeedback`: ``encode(vector) -> bytes``."""

    def __init__(self, codec: Codec, size: int) -> None:
        self.codec = codec
        self.feedback = ErrorFeedback(size)

    @property
    def name(self) -> str:
        return self.codec.name

    def encode(self, vector: np.ndarray) -> bytes:
        return self.feedback.encode(self.codec, vector)

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray:
        """The codec's validating decode (stateless; the residual does not move)."""
        return self.codec.decode(payload, size, who)

    def check(self, payload: bytes, size: int, who: str = "payload") -> None:
        check_payload(self.codec, payload, size, who)

    def decode_parts(self, payload: bytes, size: int, who: str = "payload") -> Parts:
        return decode_parts(self.codec, payload, size, who)


def _f32_parts(payload: bytes, size: int) -> Parts:
    """A checked float32 payload's values, ``_CHUNK_VALUES`` at a time (new arrays)."""
    for start in range(0, size, _CHUNK_VALUES):
        stop = min(start + _CHUNK_VALUES, size)
        yield slice(start, stop), np.frombuffer(payload, dtype="<f4", count=stop - start,
                                                offset=4 * start).astype(np.float32)


F32 = F32Codec()
INT8 = Int8Codec()
INT4 = Int4Codec()
INT2 = Int2Codec()
SPARSE = SparseCodec()
CODECS: dict[str, F32Codec | Int8Codec] = {"f32": F32, "int8": INT8, "int4": INT4,
                                           "int2": INT2, "sparse": SPARSE}


def check_payload(codec: Codec, payload: bytes, size: int, who: str = "payload") -> None:
    """Refuse (GradientError) exactly what ``codec.decode`` refuses, without making the
    vector where the codec can tell from the bytes (``check``): a step machine checks
    each payload as it arrives and decodes it only to average it."""
    check = getattr(codec, "check", None)
    if check is None:
        codec.decode(payload, size, who)
    else:
        check(payload, size, who)


def decode_parts(codec: Codec, payload: bytes, size: int, who: str = "payload") -> Parts:
    """What ``codec.decode`` returns, in order, as ``(where, values)`` parts (new arrays
    the caller may write; the payload validated before the first is given): about
    ``_CHUNK_VALUES`` values each where the codec can (``decode_parts``), else one. The
    ranges depend only on the codec and ``size``, so members' parts line up
    (``averaging.average_parts_in_roster_order``)."""
    parts = getattr(codec, "decode_parts", None)
    if parts is not None:
        return parts(payload, size, who)
    return iter([(slice(0, size), codec.decode(payload, size, who))])


def codec_by_name(name: str) -> F32Codec | Int8Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODECS)})") from None
