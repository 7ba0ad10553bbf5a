"""The owner exchange's math: each part of the mean reduced once, by the member that owns it.

All-to-all sends every member's whole contribution to every other member, so a member's
bytes per round grow with the group. Here the parameter vector is cut into as many fixed
parts as the roster has members (:func:`part_bounds`); the member at roster position
``j`` owns part ``j``. Each member sends the bytes of part ``j`` of its encoded
contribution to its owner (:func:`part_payload`: a slice of the whole payload, itself a
valid payload of the part's values, so the encoding, and its error feedback, are those
of all-to-all). The owner reduces its part (:func:`reduce_part`: every member's part
decoded, clipped and averaged in roster order, exactly as all-to-all averages the whole
vector), encodes the mean of its part with its own error feedback
(:class:`MeanEncoder`) and sends those bytes to every member. Every member, the owner
included, decodes the owners' bytes into the mean it applies (:func:`assemble_mean`),
so replicas stay bit-identical: nobody applies a value it did not receive as bytes.

A member then sends and receives about two contributions' worth per round whatever the
group's size, against ``n - 1`` for all-to-all.

Bounded influence is applied per part: the owner clips each member's part against the
lower median of the members' part norms (``influence.clip_factors``), so a member that
lies moves each part of the mean no further than an honest member would.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from daisyweb.protocol.averaging import GradientError, Parts, average_parts_in_roster_order
from daisyweb.protocol.codec import Codec, ErrorFeedback, F32Codec, Int8Codec, decode_parts
from daisyweb.protocol.influence import clip_factors, squared_norm

__all__ = ["MEAN_BOUND", "PART_ALIGN", "MeanEncoder", "assemble_mean", "mean_out_of_bounds",
           "part_bounds", "part_norms", "part_payload", "reduce_part"]

PART_ALIGN = 256
"""Parts start at multiples of this many values: whole int8 (256) and int4 (64) blocks,
so a part's bytes are a slice of the whole payload's."""


def part_bounds(size: int, parts: int) -> list[slice]:
    """``parts`` contiguous ranges covering ``0 .. size`` in order, each starting at a
    multiple of :data:`PART_ALIGN` and as equal as that allows (a small vector leaves
    the last parts empty). The same for every member: it depends on nothing else."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    blocks = -(-size // PART_ALIGN)
    edges = [min(size, (blocks * j // parts) * PART_ALIGN) for j in range(parts)] + [size]
    return [slice(edges[j], edges[j + 1]) for j in range(parts)]


def part_payload(codec: Codec, payload: bytes, size: int, where: slice) -> bytes:
    """The bytes of values ``where`` of a whole ``size``-value payload: themselves a
    payload of ``where``'s values (``where`` from :func:`part_bounds`)."""
    if where.start % PART_ALIGN or not 0 <= where.start <= where.stop <= size:
        raise ValueError(f"part {where.start}..{where.stop} of {size} values is not a part")
    if isinstance(codec, F32Codec):
        return payload[4 * where.start:4 * where.stop]
    if isinstance(codec, Int8Codec):
        first, last = where.start // codec.block, codec.nblocks(where.stop)
        values_at = 4 * codec.nblocks(size)
        # int4 packs two values a byte; a part starts on an even value (PART_ALIGN)
        lo = values_at + codec.values_size(where.start)
        hi = values_at + codec.values_size(where.stop)
        return payload[4 * first:4 * last] + payload[lo:hi]
    raise ValueError(f"the owner exchange cannot cut {codec.name} payloads")


def part_norms(codec: Codec, payloads: Sequence[bytes], length: int,
               who: Sequence[str] = ()) -> list[float]:
    """The squared norm of each member's part (``influence.squared_norm``)."""
    names = list(who) or [f"member {i}" for i in range(len(payloads))]
    return [squared_norm(decode_parts(codec, p, length, f"part from {names[i]}"))
            for i, p in enumerate(payloads)]


def reduce_part(codec: Codec, payloads: Sequence[bytes], length: int,
                shares: Sequence[int] = (), clip: bool = True,
                who: Sequence[str] = (), norms2: Sequence[float] | None = None,
                ) -> tuple[np.ndarray, tuple[int, ...]]:
    """The owner's mean of one part: every member's part payload (roster order) decoded,
    each clipped against the lower median of their norms (``norms2``: :func:`part_norms`,
    if already known), averaged as all-to-all averages
    (``averaging.average_parts_in_roster_order``). Returns the mean (float32, ``length``
    values) and the roster positions that were clipped."""
    names = list(who) or [f"member {i}" for i in range(len(payloads))]

    def parts(i: int) -> Parts:  # a part's payload decodes to ranges from 0
        return decode_parts(codec, payloads[i], length, f"part from {names[i]}")

    factors: tuple[np.float32 | None, ...] = ()
    if clip:
        if norms2 is None:
            norms2 = part_norms(codec, payloads, length, names)
        factors = clip_factors(list(norms2))
    mean = average_parts_in_roster_order([parts(i) for i in range(len(payloads))], length,
                                         shares, factors)
    return mean, tuple(i for i, f in enumerate(factors) if f is not None)


class MeanEncoder:
    """An owner's encoder of the means of the parts it owns: the codec with error
    feedback over the whole vector, of which each round moves the owned part's slice
    (parts move when the roster changes; the residual of a part a member no longer owns
    waits until it owns it again). Purely local, as a contributor's error feedback is.

    A step machine encodes with :meth:`offer` and moves the residual only when the step
    commits (:meth:`commit`): a mean reduced again over an amended roster starts from the
    same residual, and a commit rolled back gives its residual back (:meth:`rollback`)."""

    def __init__(self, codec: Codec, size: int) -> None:
        self.codec = codec
        self.feedback = ErrorFeedback(size)
        self._offered: dict[tuple[int, int], tuple[slice, np.ndarray]] = {}
        self._undo: tuple[int, list[tuple[slice, np.ndarray]]] | None = None

    def encode(self, where: slice, mean: np.ndarray) -> bytes:
        """The bytes of part ``where``'s mean (``mean``: float32, its values); the
        residual moves at once."""
        payload, residual = self._encode(where, mean)
        if residual is not None:
            self.feedback.residual[where] = residual
        return payload

    def offer(self, step: int, where: slice, mean: np.ndarray) -> bytes:
        """:meth:`encode` for ``step``, the residual kept aside until :meth:`commit`."""
        payload, residual = self._encode(where, mean)
        if residual is not None:
            self._offered[(step, where.start)] = (where, residual)
        return payload

    def commit(self, step: int, starts: Sequence[int]) -> None:
        """``step`` committed the means offered for the parts starting at ``starts``."""
        undo = []
        for start in starts:
            got = self._offered.get((step, start))
            if got is not None:
                where, residual = got
                undo.append((where, self.feedback.residual[where].copy()))
                self.feedback.residual[where] = residual
        # the step's own offers stay: a rollback may commit them again
        self._offered = {k: v for k, v in self._offered.items() if k[0] >= step}
        self._undo = (step, undo)

    def rollback(self, step: int) -> None:
        """``step``'s commit is undone: its residuals as they were before it."""
        if self._undo is None or self._undo[0] != step:
            return
        for where, residual in self._undo[1]:
            self.feedback.residual[where] = residual
        self._undo = None

    def _encode(self, where: slice, mean: np.ndarray) -> tuple[bytes, np.ndarray | None]:
        if self.codec.name == "f32":
            return self.codec.encode(mean), None  # lossless: nothing to feed back
        part = ErrorFeedback(where.stop - where.start)
        part.residual = self.feedback.residual[where].copy()
        payload, _ = part.encode_decoded(self.codec, mean)
        return payload, part.residual


MEAN_BOUND = 3.0
"""A part's mean, as its owner's bytes decode, may be at most this many times the lower
median of the members' part norms: the clipped mean's own bound (``CLIP_FACTOR``) with
room for the owner's rounding and its error feedback's carry."""


def mean_out_of_bounds(codec: Codec, payload: bytes, length: int,
                       norms2: Sequence[float], members: int) -> str | None:
    """Why a mean part must not be applied, or None: its bytes do not decode to
    ``length`` finite values, the owner gave other than ``members`` part norms, or the
    mean's norm is beyond :data:`MEAN_BOUND` times their lower median (what an owner that
    inflates its part would need to hide behind)."""
    if len(norms2) != members:
        return f"{len(norms2)} part norms for {members} members"
    try:
        got = squared_norm(decode_parts(codec, payload, length, "mean part"))
    except GradientError as exc:
        return str(exc)
    norms = sorted(math.sqrt(x) for x in norms2)
    bound = MEAN_BOUND * norms[(len(norms) - 1) // 2]
    if math.sqrt(got) > bound * (1 + 1e-9):
        return f"its norm {math.sqrt(got):.4g} is beyond {bound:.4g} ({MEAN_BOUND:g} x the " \
               f"median part's)"
    return None


def assemble_mean(codec: Codec, payloads: Sequence[bytes], bounds: Sequence[slice],
                  size: int, who: Sequence[str] = ()) -> np.ndarray:
    """The whole mean from the owners' part payloads (part order), decoded and checked
    (a wrong length or a non-finite value raises ``GradientError``)."""
    if len(payloads) != len(bounds):
        raise GradientError(f"{len(payloads)} mean parts for {len(bounds)} parts")
    names = list(who) or [f"owner of part {j}" for j in range(len(bounds))]
    mean = np.empty(size, np.float32)
    done = 0
    for j, (payload, where) in enumerate(zip(payloads, bounds, strict=True)):
        if where.start != done:
            raise GradientError(f"part {j} starts at {where.start}, expected {done}")
        mean[where] = codec.decode(payload, where.stop - where.start,
                                   f"mean part {j} from {names[j]}")
        done = where.stop
    if done != size:
        raise GradientError(f"mean parts cover {done} of {size} values")
    return mean
