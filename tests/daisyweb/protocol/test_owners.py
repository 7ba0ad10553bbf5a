"""The owner exchange's math against all-to-all's (``protocol.owners``)."""

from __future__ import annotations

import numpy as np
import pytest

from daisyweb.protocol.averaging import GradientError, average_parts_in_roster_order
from daisyweb.protocol.codec import F32, INT2, INT4, INT8, SPARSE, decode_parts
from daisyweb.protocol.owners import (
    PART_ALIGN,
    MeanEncoder,
    assemble_mean,
    part_bounds,
    part_payload,
    reduce_part,
)

CODECS = [F32, INT8, INT4, INT2]
CUTTABLE = [*CODECS, SPARSE]  # sparse: a mean of it is not within one step (most is 0)


def vectors(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) * np.float32(1e-3)
            for _ in range(n)]


@pytest.mark.parametrize("size,parts", [(10_000, 3), (PART_ALIGN * 7, 7), (1001, 4),
                                        (300, 5), (0, 2), (145_731, 16)])
def test_parts_cover_the_vector_in_order_on_whole_blocks(size: int, parts: int) -> None:
    bounds = part_bounds(size, parts)
    assert len(bounds) == parts and bounds[0].start == 0 and bounds[-1].stop == size
    for a, b in zip(bounds, bounds[1:], strict=False):
        assert a.stop == b.start
    assert all(w.start % PART_ALIGN == 0 and w.start <= w.stop for w in bounds)
    lengths = [w.stop - w.start for w in bounds if w.stop < size]
    assert not lengths or max(lengths) - min(lengths) <= PART_ALIGN  # as equal as blocks allow
    with pytest.raises(ValueError):
        part_bounds(size, 0)


@pytest.mark.parametrize("codec", CUTTABLE, ids=lambda c: c.name)
@pytest.mark.parametrize("size", [145_731, 4097, 1000])
def test_a_part_of_a_payload_is_the_payload_of_the_part(codec, size: int) -> None:
    (v,) = vectors(1, size)
    whole = codec.encode(v)
    decoded = codec.decode(whole, size)
    for where in part_bounds(size, 5):
        part = part_payload(codec, whole, size, where)
        assert part == codec.encode(v[where])  # blocks are independent and aligned
        assert np.array_equal(codec.decode(part, where.stop - where.start), decoded[where])
    with pytest.raises(ValueError):
        part_payload(codec, whole, size, slice(3, 100))  # not on a part's edge


@pytest.mark.parametrize("codec", CUTTABLE, ids=lambda c: c.name)
@pytest.mark.parametrize("shares", [(), (2, 2, 2, 2), (1, 3, 2, 2)])
def test_without_clipping_the_owners_mean_is_all_to_alls_bit_for_bit(codec, shares) -> None:
    size, n = 70_001, 4
    payloads = [codec.encode(v) for v in vectors(n, size)]
    whole = average_parts_in_roster_order([decode_parts(codec, p, size) for p in payloads],
                                          size, shares)
    for where in part_bounds(size, n):
        parts = [part_payload(codec, p, size, where) for p in payloads]
        mean, clipped = reduce_part(codec, parts, where.stop - where.start, shares,
                                    clip=False)
        assert np.array_equal(mean, whole[where]) and clipped == ()


def test_a_member_that_lies_is_clipped_in_every_part() -> None:
    size, n = 50_000, 5
    honest = vectors(n, size, seed=1)
    liar = honest[:]
    liar[3] = honest[3] * np.float32(100.0)
    for vs, expect in ((honest, ()), (liar, (3,))):
        payloads = [INT4.encode(v) for v in vs]
        for where in part_bounds(size, n):
            parts = [part_payload(INT4, p, size, where) for p in payloads]
            mean, clipped = reduce_part(INT4, parts, where.stop - where.start)
            assert clipped == expect
            # the liar moves the part no further than twice an honest member would
            honest_norm = max(float(np.linalg.norm(v[where])) for v in honest)
            assert float(np.linalg.norm(mean)) <= 2.5 * honest_norm


def test_a_bad_part_is_refused_with_its_sender() -> None:
    size = 4096
    good = INT4.encode(vectors(1, size)[0])
    bad = bytearray(good)
    bad[0:4] = np.float32(np.nan).tobytes()
    with pytest.raises(GradientError, match="part from mallory"):
        reduce_part(INT4, [good, bytes(bad)], size, who=["alice", "mallory"])


@pytest.mark.parametrize("codec", [INT8, INT4, INT2, SPARSE], ids=lambda c: c.name)
def test_the_owners_error_feedback_carries_each_parts_error_into_the_next_round(codec) -> None:
    size = 3000
    bounds = part_bounds(size, 3)
    enc = MeanEncoder(codec, size)
    rounds = vectors(20, size, seed=2)
    where = bounds[1]
    sent = np.zeros(where.stop - where.start, np.float64)
    true = np.zeros_like(sent)
    for v in rounds:
        payload = enc.encode(where, v[where])
        sent += codec.decode(payload, where.stop - where.start)
        true += v[where]
    # the sum of what was sent differs from the true sum by the residual alone (sparse
    # keeps most of each value in the residual: its float32 rounding is that much larger)
    atol = 1e-7 if codec is SPARSE else 1e-9
    assert np.allclose(sent + enc.feedback.residual[where], true, rtol=0, atol=atol)
    assert not enc.feedback.residual[bounds[0]].any()  # parts it did not encode: untouched
    assert not enc.feedback.residual[bounds[2]].any()


def test_f32_means_go_as_they_are() -> None:
    (v,) = vectors(1, 1000)
    enc = MeanEncoder(F32, 1000)
    assert enc.encode(slice(0, 1000), v) == F32.encode(v)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_every_member_assembles_the_same_mean_from_the_owners_bytes(codec) -> None:
    size, n = 20_000, 4
    contributions = vectors(n, size, seed=3)
    payloads = [codec.encode(v) for v in contributions]
    bounds = part_bounds(size, n)
    owners = [MeanEncoder(codec, size) for _ in range(n)]
    sent = []
    for j, where in enumerate(bounds):
        parts = [part_payload(codec, p, size, where) for p in payloads]
        mean, _ = reduce_part(codec, parts, where.stop - where.start)
        sent.append(owners[j].encode(where, mean))
    assembled = [assemble_mean(codec, sent, bounds, size) for _ in range(n)]
    assert all(np.array_equal(a, assembled[0]) for a in assembled)
    exact = average_parts_in_roster_order(
        [decode_parts(codec, p, size) for p in payloads], size)
    step = float(np.abs(exact).max()) / codec.levels if codec is not F32 else 0.0
    assert float(np.abs(assembled[0] - exact).max()) <= step  # one more rounding at most
    with pytest.raises(GradientError):
        assemble_mean(codec, sent[:-1], bounds, size)
    with pytest.raises(GradientError):
        assemble_mean(codec, [sent[0][:-1], *sent[1:]], bounds, size)
