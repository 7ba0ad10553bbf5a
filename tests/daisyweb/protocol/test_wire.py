"""Tests for daisyweb.protocol.wire: message round trips, refusals, framing, fuzzing."""

from __future__ import annotations

import os
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daisyweb.protocol import wire
from daisyweb.protocol.wire import (
    CHUNK,
    HEADER_SIZE,
    MAX_FRAME,
    Config,
    Gradient,
    Halt,
    Heartbeat,
    Hello,
    Reassembler,
    RepairRequest,
    Roster,
    Snapshot,
    StepHashes,
    WireError,
    decode,
    encode,
    frame,
)

H = "ab" * 16

SAMPLES = [
    Hello("peer-a", 1),
    Config(
        width=64,
        layers=2,
        heads=4,
        seq=32,
        vocab=256,
        batch=8,
        steps=100,
        lr=3e-4,
        seed=7,
        data="tiny",
        sync_every=16,
        codec="int8",
        outer_lr=1.0,
    ),
    Snapshot(0, H, b"\x00\x01" * 100),
    Roster(5, ["a", "b", "c"]),
    Gradient(5, "a", struct.pack("<3f", 1.0, -2.5, 0.0)),
    StepHashes(5, "b", H, "cd" * 8),
    RepairRequest(5, "c"),
    Heartbeat(12.5),
    Halt(9, "peer c diverged"),
]


def _raw(msg: wire.Message) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def _pack(d: dict) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


# --- messages -----------------------------------------------------------------


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.type)
def test_round_trip(msg: wire.Message) -> None:
    data = encode(msg)
    assert _raw(msg)["type"] == msg.type
    back = decode(data)
    assert back == msg and type(back) is type(msg)
    assert encode(back) == data


def test_every_type_sampled() -> None:
    assert {m.type for m in SAMPLES} == set(wire.MESSAGE_TYPES)


def test_roster_members_normalised() -> None:
    assert Roster(1, ["a"]).members == ("a",)
    assert hash(Roster(1, ["a"])) == hash(Roster(1, ("a",)))


def _mutated(msg: wire.Message, **changes: object) -> bytes:
    d = _raw(msg)
    for k, v in changes.items():
        if v is _DEL:
            del d[k]
        else:
            d[k] = v
    return _pack(d)


_DEL = object()


@pytest.mark.parametrize(
    ("msg", "changes", "needle"),
    [
        (SAMPLES[0], {"type": "nope"}, "unknown message type"),
        (SAMPLES[0], {"type": 3}, "no string 'type'"),
        (SAMPLES[0], {"type": _DEL}, "no string 'type'"),
        (SAMPLES[0], {"version": _DEL}, "missing field"),
        (SAMPLES[0], {"extra": 1}, "unexpected field"),
        (SAMPLES[0], {"peer_id": ""}, "empty"),
        (SAMPLES[0], {"peer_id": "x" * 129}, "too long"),
        (SAMPLES[0], {"peer_id": b"peer"}, "expected str"),
        (SAMPLES[0], {"version": -1}, "out of range"),
        (SAMPLES[0], {"version": True}, "expected int"),
        (SAMPLES[1], {"heads": 3}, "not divisible"),
        (SAMPLES[1], {"width": 0}, "out of range"),
        (SAMPLES[1], {"lr": 0.0}, "out of range"),
        (SAMPLES[1], {"lr": float("nan")}, "not finite"),
        (SAMPLES[1], {"lr": "0.1"}, "expected float"),
        (SAMPLES[1], {"seed": -3}, "out of range"),
        (SAMPLES[1], {"data": "d" * 2000}, "too long"),
        (SAMPLES[2], {"step": -1}, "out of range"),
        (SAMPLES[2], {"step": 1.0}, "expected int"),
        (SAMPLES[2], {"weight_hash": "ABCD"}, "hex"),
        (SAMPLES[2], {"weight_hash": "abc"}, "hex"),
        (SAMPLES[2], {"payload": "text"}, "expected bytes"),
        (SAMPLES[3], {"members": []}, "members"),
        (SAMPLES[3], {"members": ["a", "a"]}, "duplicate"),
        (SAMPLES[3], {"members": ["a", 1]}, "expected str"),
        (SAMPLES[3], {"members": "ab"}, "expected list"),
        (SAMPLES[4], {"payload": b"\x00" * 5}, "multiple of 4"),
        (SAMPLES[5], {"probe_hash": "zz"}, "hex"),
        (SAMPLES[6], {"sender_of_missing": None}, "expected str"),
        (SAMPLES[7], {"t": float("inf")}, "not finite"),
        (SAMPLES[7], {"t": -1.0}, "out of range"),
        (SAMPLES[8], {"reason": "r" * 1025}, "too long"),
    ],
)
def test_decode_refuses_bad_fields(msg: wire.Message, changes: dict, needle: str) -> None:
    with pytest.raises(WireError, match=needle):
        decode(_mutated(msg, **changes))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x92\x01\x02",
        _pack([1, 2]),
        _pack("hello"),
        b"\x81\xa4type",
        b"\xff" * 9,
        encode(SAMPLES[0]) + b"\x00",
        _pack({1: 2}),
        _pack({"type": "hello", b"peer_id": "x"}),
    ],
)
def test_decode_refuses_garbage(data: bytes) -> None:
    with pytest.raises(WireError):
        decode(data)


def test_decode_refuses_non_bytes_and_oversize() -> None:
    with pytest.raises(WireError):
        decode("text")  # type: ignore[arg-type]
    with pytest.raises(WireError, match="too long"):
        decode(encode(SAMPLES[2]), max_len=10)


def test_construct_and_encode_validate() -> None:
    with pytest.raises(WireError, match="out of range"):
        Halt(-1, "x")
    with pytest.raises(WireError, match="not a wire message"):
        encode("hello")  # type: ignore[arg-type]


# --- framing ------------------------------------------------------------------


def test_small_message_is_one_frame() -> None:
    data = encode(SAMPLES[0])
    frames = frame(data, 1)
    assert len(frames) == 1 and len(frames[0]) == HEADER_SIZE + len(data)
    assert Reassembler().feed(frames[0]) == data


def test_multi_mb_payload_bit_exact() -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    msg = Snapshot(42, H, payload)
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
    data = encode(SAMPLES[0])
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


# --- fuzz ---------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_decode_random_bytes(data: bytes) -> None:
    try:
        msg = decode(data)
    except WireError:
        return
    assert decode(encode(msg)) == msg


_mp_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
_field_names = sorted({f for cls in wire.MESSAGE_TYPES.values() for f in cls._checks} | {"type"})


@FUZZ
@given(
    st.sampled_from(SAMPLES),
    st.dictionaries(st.sampled_from(_field_names) | st.text(max_size=6), _mp_values, max_size=4),
    st.lists(st.sampled_from(_field_names), max_size=3),
)
def test_fuzz_decode_mutated_messages(msg: wire.Message, changes: dict, drop: list) -> None:
    d = _raw(msg)
    d.update(changes)
    for k in drop:
        d.pop(k, None)
    try:
        out = decode(_pack(d))
    except WireError:
        return
    assert decode(encode(out)) == out


@FUZZ
@given(
    st.sampled_from(SAMPLES),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
    st.integers(0, 10**6),
)
def test_fuzz_decode_flipped_bytes(msg: wire.Message, flips: list, cut: int) -> None:
    b = bytearray(encode(msg))
    for pos, x in flips:
        b[pos % len(b)] ^= x
    for data in (bytes(b), bytes(b[: cut % (len(b) + 1)])):
        try:
            out = decode(data)
        except WireError:
            continue
        assert decode(encode(out)) == out


def test_config_dict_round_trip() -> None:
    cfg = SAMPLES[1]
    assert Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(WireError, match="missing"):
        Config.from_dict({"width": 64})
    with pytest.raises(WireError, match="unexpected"):
        Config.from_dict({**cfg.to_dict(), "bogus": 1})


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


# --- roster digest ------------------------------------------------------------


def test_roster_digest_is_order_sensitive_and_unambiguous() -> None:
    d = wire.roster_digest
    assert d(None) == wire.NO_ROSTER
    assert d(("a", "b")) == d(["a", "b"]) != d(("b", "a"))
    assert d(("ab", "c")) != d(("a", "bc"))  # length-prefixed, not joined
    assert len(d(("a",))) == 16 and d(("a",)) != wire.NO_ROSTER


def test_step_hashes_carry_a_valid_roster_hash() -> None:
    msg = StepHashes(3, "a", H, H, wire.roster_digest(("a", "b")))
    assert decode(encode(msg)) == msg
    with pytest.raises(WireError, match="roster_hash"):
        decode(_mutated(msg, roster_hash="XY"))
    with pytest.raises(WireError, match="missing field"):
        decode(_mutated(msg, roster_hash=_DEL))
