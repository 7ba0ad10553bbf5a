"""Tests for daisyweb.protocol.framing: frames, reassembly, refusals, fuzzing."""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daisyweb.peer.pieces import Layout
from daisyweb.protocol import framing, wire
from daisyweb.protocol.framing import (
    CHUNK,
    HEADER_SIZE,
    MAX_FRAME,
    Reassembler,
    frame,
    frame_id,
    iter_frames,
)
from daisyweb.protocol.wire import Hello, WireError, decode, encode

H = "ab" * 16

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_small_message_is_one_frame() -> None:
    data = encode(Hello("peer-a", 1))
    frames = frame(data, 1)
    assert len(frames) == 1 and len(frames[0]) == HEADER_SIZE + len(data)
    assert Reassembler().feed(frames[0]) == data


def test_multi_mb_payload_bit_exact() -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    msg = wire.OwnedPart(42, "a", 0, 1, payload)
    data = encode(msg)
    frames = frame(data, 2**64 - 1)
    assert len(frames) == -(-len(data) // CHUNK)
    assert all(len(f) <= MAX_FRAME for f in frames)
    assert all(len(f) == MAX_FRAME for f in frames[:-1])
    r = Reassembler(max_total=8 * 1024 * 1024)
    out = [r.feed(f) for f in frames]
    assert out[:-1] == [None] * (len(frames) - 1)
    assert out[-1] == data and decode(out[-1]) == msg
    assert r.in_flight == 0 and r.buffered_bytes == 0


def test_out_of_order_and_interleaved() -> None:
    a, b = os.urandom(3 * CHUNK + 5), os.urandom(2 * CHUNK)
    fa, fb = frame(a, 1), frame(b, 2)
    r = Reassembler()
    got = [r.feed(f) for f in (fa[3], fb[1], fa[0], fa[2], fb[0], fa[1])]
    assert got == [None, None, None, None, b, a]


def _hdr(msg_id: int, index: int, count: int, total: int, digest: bytes = b"\0" * 8) -> bytes:
    return struct.pack("<4sQIII8s", b"DWF1", msg_id, index, count, total, digest)


def _two_frame(msg_id: int = 5) -> tuple[bytes, list[bytes]]:
    data = os.urandom(CHUNK + 100)
    return data, frame(data, msg_id)


def _assert_still_works(r: Reassembler, msg_id: int = 999) -> None:
    data = os.urandom(CHUNK + 1)
    fs = frame(data, msg_id)
    assert r.feed(fs[0]) is None
    assert r.feed(fs[1]) == data


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (b"", "too short"),
        (b"garbage", "too short"),
        (b"X" * 40, "magic"),
        (b"\0" * (MAX_FRAME + 1), "too long"),
        (_hdr(5, 0, 1, 0), "total length 0"),
        (_hdr(5, 0, 2, 10) + b"x" * 10, "inconsistent"),
        (_hdr(5, 1, 1, 10) + b"x" * 10, "index"),
        (_hdr(5, 0, 1, 10) + b"x" * 9, "carries 9 bytes"),
        (_hdr(5, 0, 1, 10) + b"x" * 11, "carries 11 bytes"),
        (_hdr(5, 0, 1, 10) + b"x" * 10, "checksum"),
    ],
)
def test_reassembler_refuses(bad: bytes, needle: str) -> None:
    r = Reassembler()
    with pytest.raises(WireError, match=needle):
        r.feed(bad)
    assert r.in_flight == 0
    _assert_still_works(r)


def test_truncated_frame_drops_partial() -> None:
    _, fs = _two_frame()
    r = Reassembler()
    assert r.feed(fs[0]) is None and r.in_flight == 1
    with pytest.raises(WireError, match="dropped"):
        r.feed(fs[1][:-1])
    assert r.in_flight == 0
    # Late frames of a refused id are refused too, without new state.
    with pytest.raises(WireError, match="refused"):
        r.feed(fs[1])
    assert r.in_flight == 0
    _assert_still_works(r)


def test_duplicate_index_refused() -> None:
    _, fs = _two_frame()
    r = Reassembler()
    r.feed(fs[0])
    with pytest.raises(WireError, match="duplicate"):
        r.feed(fs[0])
    assert r.in_flight == 0
    _assert_still_works(r)


def test_disagreeing_count_total_refused() -> None:
    _, fs = _two_frame(5)
    other = frame(os.urandom(3 * CHUNK), 5)  # same id, different count and total
    r = Reassembler()
    r.feed(fs[0])
    with pytest.raises(WireError, match="disagrees"):
        r.feed(other[1])
    assert r.in_flight == 0
    _assert_still_works(r)


def test_disagreeing_checksum_refused() -> None:
    _, fs = _two_frame(5)
    _, gs = _two_frame(5)  # same sizes, different content -> different checksum
    r = Reassembler()
    r.feed(fs[0])
    with pytest.raises(WireError, match="disagrees"):
        r.feed(gs[1])
    _assert_still_works(r)


def test_bad_checksum_on_completion() -> None:
    _, fs = _two_frame()
    corrupt = bytearray(fs[1])
    corrupt[-1] ^= 1
    r = Reassembler()
    r.feed(fs[0])
    with pytest.raises(WireError, match="checksum"):
        r.feed(bytes(corrupt))
    assert r.in_flight == 0
    _assert_still_works(r)


def test_total_over_limit() -> None:
    data = os.urandom(4 * CHUNK)
    r = Reassembler(max_total=3 * CHUNK)
    with pytest.raises(WireError, match="over limit"):
        r.feed(frame(data, 1)[0])
    assert r.in_flight == 0
    # A header claiming 4 GiB is refused before any allocation.
    with pytest.raises(WireError, match="over limit"):
        r.feed(_hdr(2, 0, -(-(2**32 - 1) // CHUNK), 2**32 - 1) + b"x" * CHUNK)
    _assert_still_works(r)


def test_too_many_in_flight() -> None:
    r = Reassembler(max_in_flight=2)
    firsts = [frame(os.urandom(CHUNK + 1), i) for i in range(3)]
    r.feed(firsts[0][0])
    r.feed(firsts[1][0])
    with pytest.raises(WireError, match="in flight"):
        r.feed(firsts[2][0])
    assert r.in_flight == 2
    # The in-progress messages still complete; then there is room again.
    assert r.feed(firsts[0][1]) is not None
    assert r.feed(firsts[1][1]) is not None
    _assert_still_works(r)


def test_replayed_completed_message_refused() -> None:
    data = encode(Hello("peer-a", 1))
    (f,) = frame(data, 3)
    r = Reassembler()
    assert r.feed(f) == data
    with pytest.raises(WireError, match="already completed"):
        r.feed(f)


def test_frame_argument_checks() -> None:
    with pytest.raises(WireError):
        frame(b"", 1)
    with pytest.raises(WireError):
        frame(b"x", -1)
    with pytest.raises(WireError):
        frame(b"x", 2**64)
    with pytest.raises(WireError):
        frame("text", 1)  # type: ignore[arg-type]


def test_frame_id_reads_only_the_id() -> None:
    data = os.urandom(CHUNK + 100)
    first, second = frame(data, 77)
    assert frame_id(first) == frame_id(second) == 77
    assert frame_id(second[:12]) == 77  # a truncated frame still names its message
    assert frame_id(second[:11]) is None
    assert frame_id(b"XXXX" + second[4:]) is None  # no magic: the id is garbage
    assert frame_id(b"") is None


# --- fuzz ---------------------------------------------------------------------


def _mutate(f: bytes, kind: int, pos: int, val: int) -> bytes:
    b = bytearray(f)
    if kind == 0 and b:  # flip a byte
        b[pos % len(b)] ^= (val % 255) + 1
    elif kind == 1:  # truncate
        del b[pos % (len(b) + 1) :]
    elif kind == 2:  # extend
        b += bytes([val % 256]) * (pos % 64 + 1)
    elif kind == 3:  # overwrite a header field with a random u32
        off = (4, 12, 16, 20)[pos % 4]
        b[off : off + 4] = struct.pack("<I", val % 2**32)
    return bytes(b)


_MAX_IN_FLIGHT = 4
_MAX_TOTAL = 4 * CHUNK


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("raw"), st.binary(max_size=80)),
            st.tuples(
                st.just("frame"),
                st.integers(0, 7),  # message id (also picks the message)
                st.integers(0, 5),  # which frame
                st.integers(0, 4),  # mutation kind (4 = none)
                st.integers(0, 2**16),
                st.integers(0, 2**32),
            ),
        ),
        max_size=40,
    )
)
def test_fuzz_reassembler(ops: list) -> None:
    msgs = {i: os.urandom(1 + (i * 9973) % (3 * CHUNK)) for i in range(8)}
    framed = {i: frame(m, i) for i, m in msgs.items()}
    r = Reassembler(max_total=_MAX_TOTAL, max_in_flight=_MAX_IN_FLIGHT, recent=16)
    for op in ops:
        if op[0] == "raw":
            f = op[1]
        else:
            _, mid, which, kind, pos, val = op
            f = _mutate(framed[mid][which % len(framed[mid])], kind, pos, val)
        try:
            out = r.feed(f)
        except WireError:
            pass
        else:
            # Anything returned must be a genuine message, bit-exact.
            assert out is None or out in msgs.values()
        assert r.in_flight <= _MAX_IN_FLIGHT
        assert r.buffered_bytes <= _MAX_IN_FLIGHT * _MAX_TOTAL
        assert len(r._recent) <= 16


def test_reassembly_budget_reserves_declared_sizes_and_frees_them() -> None:
    from daisyweb.protocol import budget

    size = 3 * framing.CHUNK  # three frames each
    r = framing.Reassembler(max_total=size, max_buffered=2 * size)
    a, b, c = (framing.frame(bytes([i]) * size, i) for i in (1, 2, 3))
    assert r.feed(a[0]) is None and r.feed(b[0]) is None
    assert r.reserved_bytes == 2 * size  # declared, before their bytes arrive
    assert r.feed(framing.frame(b"one frame", 9)[0]) == b"one frame"  # never reserved
    with pytest.raises(framing.BudgetExceeded, match="over the budget of"):
        r.feed(c[0])
    with pytest.raises(wire.WireError):  # the rest of the refused message: no new state
        r.feed(c[1])
    assert r.in_flight == 2
    assert r.feed(a[1]) is None and r.feed(a[2]) == bytes([1]) * size
    assert r.reserved_bytes == size  # a completed message frees its reservation
    c2 = framing.frame(bytes([4]) * size, 4)
    assert [r.feed(f) for f in c2][-1] == bytes([4]) * size
    r.set_limits(size, size)  # lowered below what is held: the held message completes
    assert [r.feed(f) for f in b[1:]][-1] == bytes([2]) * size
    assert r.reserved_bytes == 0
    # A run's budget: two of its largest messages (an f32 contribution, 4 bytes per
    # parameter; a snapshot piece is smaller)
    size = 1_325_824
    largest = len(wire.encode(wire.Contribution(1, "a" * 128, bytes(4 * size))))
    assert budget.largest_message(size) > largest
    piece = wire.Piece(1, 191, bytes(4 * Layout(size, True).piece_floats))
    assert budget.largest_message(size) > len(wire.encode(piece))
    assert budget.link_budget(size) == 2 * budget.largest_message(size)
    with pytest.raises(ValueError):
        budget.largest_message(0)


@pytest.mark.parametrize("size", [1, 65535, 65536, 65537, 3 * CHUNK + 5, 2_000_003])
def test_a_message_sent_as_parts_is_framed_as_its_concatenation(size: int) -> None:
    """A big payload is framed from its own buffer (``wire.encode_parts``): the frames
    must be exactly those of the whole encoded message, which is never built."""
    msg = wire.OwnedPart(3, "a", 0, 1,
                         bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    parts = wire.encode_parts(msg)
    whole = wire.encode(msg)
    assert b"".join(bytes(p) for p in parts) == whole
    assert len(parts) == (2 if size >= 65536 else 1)
    frames = list(iter_frames(parts, 9))
    assert frames == frame(whole, 9)
    r = Reassembler()
    assert [r.feed(f) for f in frames][-1] == whole
