"""Tests for daisyweb.protocol.wire: message round trips, refusals, fuzzing.

Frame tests are in test_framing.py."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daisyweb.protocol import wire
from daisyweb.protocol.pace import Pace
from daisyweb.protocol.wire import (
    Config,
    Contribution,
    Following,
    Halt,
    Heartbeat,
    Hello,
    MeanPart,
    MeanRequest,
    OwnedPart,
    PartRequest,
    RepairRequest,
    Roster,
    StepHashes,
    WireError,
    decode,
    encode,
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
        overlap=4,
        sync_max=32,
    ),
    Roster(5, ["a", "b", "c"]),
    Contribution(5, "a", struct.pack("<3f", 1.0, -2.5, 0.0)),
    StepHashes(5, "b", H, "cd" * 8),
    RepairRequest(5, "c"),
    Heartbeat(12.5),
    Halt(9, "peer c diverged"),
    Following("peer-a"),
    Following("peer-a", 3),
    Heartbeat(12.5, 11.75),  # an answer to a beat
    Roster(6, ["a", "b"], [3, 13]),  # capacity-weighted shares
    StepHashes(6, "a", H, "cd" * 8, "00", 812.5),  # with the sender's speed
    Roster(7, ["a", "b", "c"], [], 2, ["a", "a", "c"]),  # the parts' owners
    OwnedPart(7, "b", 2, 3, b"\x01\x02\x03"),
    MeanPart(7, "c", 2, "cd" * 8, (1.5, 0.0, 2.0), b"\x01\x02\x03\x04\x05"),
    PartRequest(7, 2, "b"),
    MeanRequest(7, 1),
    wire.SnapshotPlan(8, H, 128, 256, "ab" * 32, ("cd" * 16, "ef" * 16), ("a", "b")),
    wire.PieceRequest(8, 5),
    wire.Piece(8, 5, struct.pack("<2f", 1.0, 0.5)),
    wire.Piece(8, 6, b""),  # refused
]


PLAN = next(m for m in SAMPLES if isinstance(m, wire.SnapshotPlan))
PIECE = next(m for m in SAMPLES if isinstance(m, wire.Piece))


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


def test_a_contribution_keeps_its_wire_name_and_bytes() -> None:
    # The Python class says what it is; the bytes keep the protocol's historical names.
    msg = Contribution(5, "a", b"\x01\x02\x03\x04")
    assert encode(msg) == (b"\x84\xa4type\xa8gradient\xa4step\x05\xa6sender\xa1a"
                           b"\xa7payload\xc4\x04\x01\x02\x03\x04")
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("owners", [["a", "z"], ["a"] * 1025, [""], "ab"])
def test_a_roster_refuses_owners_that_are_not_members(owners: object) -> None:
    with pytest.raises(WireError, match="owners"):
        Roster(1, ["a", "b"], [], 0, owners)  # type: ignore[arg-type]
    with pytest.raises(WireError, match="owners|msgpack"):  # (msgpack: too long to read)
        decode(_pack({"type": "roster", "step": 1, "members": ["a", "b"], "shares": [],
                      "term": 0, "owners": owners, "ahead": 0,
                      "length": 0}))


@pytest.mark.parametrize("part", [-1, 1024, 1.0, True])
def test_a_part_index_out_of_range_is_refused(part: object) -> None:
    with pytest.raises(WireError, match="part"):
        decode(_pack({"type": "mean_request", "step": 1, "part": part}))
    with pytest.raises(WireError, match="part"):
        decode(_pack({"type": "owned_part", "step": 1, "sender": "a", "part": part, "parts": 4,
                      "payload": b""}))


def test_a_part_must_be_one_of_its_cuts_parts() -> None:
    with pytest.raises(WireError, match="part 3 of 3"):
        OwnedPart(1, "a", 3, 3, b"")
    with pytest.raises(WireError, match="part 3 of 3"):
        decode(_pack({"type": "owned_part", "step": 1, "sender": "a", "part": 3, "parts": 3,
                      "payload": b""}))


def test_the_roster_digest_names_the_owners() -> None:
    members = ("a", "b")
    assert wire.roster_digest(members) == wire.roster_digest(members, (), ())
    assert wire.roster_digest(members, (), ("a", "b")) != wire.roster_digest(members)
    assert (wire.roster_digest(members, (), ("a", "b"))
            != wire.roster_digest(members, (), ("b", "b")))


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
        (PLAN, {"step": -1}, "out of range"),
        (PLAN, {"step": 1.0}, "expected int"),
        (PLAN, {"weight_hash": "ABCD"}, "hex"),
        (PLAN, {"weight_hash": "abc"}, "hex"),
        (PIECE, {"payload": "text"}, "expected bytes"),
        (PIECE, {"payload": b"\x00" * 5}, "multiple of 4"),
        (PLAN, {"holders": []}, "members"),
        (PLAN, {"digests": ["xyz"]}, "hex"),
        (PLAN, {"inner_step": -1}, "out of range"),
        (SAMPLES[2], {"members": []}, "members"),
        (SAMPLES[2], {"members": ["a", "a"]}, "duplicate"),
        (SAMPLES[2], {"members": ["a", 1]}, "expected str"),
        (SAMPLES[2], {"members": "ab"}, "expected list"),
        (SAMPLES[3], {"payload": "bytes"}, "expected bytes"),
        (SAMPLES[4], {"probe_hash": "zz"}, "hex"),
        (SAMPLES[5], {"sender_of_missing": None}, "expected str"),
        (SAMPLES[6], {"t": float("inf")}, "not finite"),
        (SAMPLES[6], {"t": -1.0}, "out of range"),
        (SAMPLES[7], {"reason": "r" * 1025}, "too long"),
        (SAMPLES[8], {"leader": "x" * 129}, "too long"),
        (SAMPLES[8], {"leader": None}, "expected str"),
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


@pytest.mark.parametrize(("shares", "why"), [
    ([3], "1 shares for 2 members"), ([3, 0], "out of range"), ([3, True], "expected int"),
    ([3, 2.0], "expected int"), ("33", "expected list"), ([1, 1 << 21], "out of range"),
])
def test_roster_shares_are_checked(shares: object, why: str) -> None:
    with pytest.raises(WireError, match=why):
        decode(_pack({"type": "roster", "step": 1, "members": ["a", "b"],
                           "shares": shares, "term": 0, "owners": [], "ahead": 0,
                           "length": 0}))


@pytest.mark.parametrize("name", ["ahead", "length"])
@pytest.mark.parametrize("bad", [-1, (1 << 20) + 1, 2.0, True, None])
def test_a_rosters_pace_is_a_round_length_at_most(name: str, bad: object) -> None:
    good = {"type": "roster", "step": 1, "members": ["a", "b"], "shares": [], "term": 0,
            "owners": [], "ahead": 16, "length": 32}
    assert decode(_pack(good)).pace == Pace(32, 16)  # type: ignore[union-attr]
    with pytest.raises(WireError, match=name):
        decode(_pack({**good, name: bad}))


@pytest.mark.parametrize("digests", ["ab", ["AB"], ["xyz1"], [1], ["ab"] * 1025])
def test_step_hashes_digests_are_checked(digests: object) -> None:
    good = {"type": "step_hashes", "step": 1, "sender": "a", "weight_hash": H,
            "probe_hash": "cd" * 8, "roster_hash": "00", "speed": 0.0, "ahead": 0}
    msg = decode(_pack({**good, "digests": [wire.payload_digest(b"x"), "ab"]}))
    assert msg.digests == (wire.payload_digest(b"x"), "ab")  # type: ignore[union-attr]
    with pytest.raises(WireError):
        decode(_pack({**good, "digests": digests}))


@pytest.mark.parametrize("kind", ["roster", "following"])
@pytest.mark.parametrize("term", [-1, 1 << 63, 1.0, "1", True, None])
def test_terms_are_checked(kind: str, term: object) -> None:
    fields = ({"step": 1, "members": ["a"], "shares": [], "owners": [], "ahead": 0,
               "length": 0}
              if kind == "roster"
              else {"leader": "a"})
    assert decode(_pack({"type": kind, **fields, "term": 7})).term == 7  # type: ignore[union-attr]
    with pytest.raises(WireError, match="term"):
        decode(_pack({"type": kind, **fields, "term": term}))


@pytest.mark.parametrize("speed", [-1.0, float("inf"), float("nan"), 1e13, "fast", True])
def test_step_hashes_speed_is_checked(speed: object) -> None:
    with pytest.raises(WireError, match="speed"):
        decode(_pack({"type": "step_hashes", "step": 1, "sender": "a",
                           "weight_hash": H, "probe_hash": "cd" * 8, "roster_hash": "00",
                           "speed": speed, "digests": [], "ahead": 0}))


@pytest.mark.parametrize("ahead", [-1, (1 << 20) + 1, 2.0, True, None])
def test_step_hashes_need_is_a_round_length_at_most(ahead: object) -> None:
    good = {"type": "step_hashes", "step": 1, "sender": "a", "weight_hash": H,
            "probe_hash": "cd" * 8, "roster_hash": "00", "speed": 0.0, "digests": [],
            "ahead": 7}
    assert decode(_pack(good)).ahead == 7  # type: ignore[union-attr]
    with pytest.raises(WireError, match="ahead"):
        decode(_pack({**good, "ahead": ahead}))


def test_roster_digest_covers_the_shares() -> None:
    from daisyweb.protocol.wire import roster_digest

    assert roster_digest(("a", "b")) == roster_digest(("a", "b"), ())
    assert roster_digest(("a", "b"), (3, 13)) != roster_digest(("a", "b"))
    assert roster_digest(("a", "b"), (3, 13)) != roster_digest(("a", "b"), (13, 3))
