"""The payload codecs: f32 (lossless), int8 and int4 (blockwise absmax, exact), error
feedback."""

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from daisyweb.protocol.averaging import GradientError, average_in_roster_order
from daisyweb.protocol.codec import (
    CODECS,
    F32,
    INT2,
    INT2_BLOCK,
    INT4,
    INT4_BLOCK,
    INT8,
    INT8_BLOCK,
    SPARSE,
    SPARSE_BLOCK,
    SPARSE_KEEP,
    ErrorFeedback,
    ErrorFeedbackEncoder,
    F32Codec,
    Int2Codec,
    Int4Codec,
    Int8Codec,
    check_payload,
    codec_by_name,
)

B = INT8_BLOCK


def _vec(size: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # gradient-like: heavy tailed, with a different magnitude in each block
    per_block = np.repeat(10.0 ** rng.uniform(-3, 2, size=-(-size // B)), B)[:size]
    return (rng.standard_normal(size) * per_block * scale).astype(np.float32)


def _split(payload: bytes, size: int, codec: Int8Codec = INT8) -> tuple[np.ndarray, np.ndarray]:
    nb = codec.nblocks(size)
    return (np.frombuffer(payload, "<f4", count=nb),
            np.frombuffer(payload, np.int8, offset=4 * nb, count=size))


def _with_scale(payload: bytes, index: int, value: float) -> bytes:
    raw = bytearray(payload)
    raw[4 * index : 4 * index + 4] = np.array([value], "<f4").tobytes()
    return bytes(raw)


def _reference_blocks(x: np.ndarray, block: int, top: float
                      ) -> Iterator[tuple[np.float32, list[np.float32]]]:
    """The documented absmax recipe's blocks, one at a time with numpy float32 scalars:
    each block's values (subnormals as 0) and its scale ``max|v| / top`` (0 when it falls
    below the smallest normal)."""
    f = np.float32
    for start in range(0, x.size, block):
        vals = [f(0.0) if abs(v) < np.finfo(f).tiny else f(v) for v in x[start:start + block]]
        s = f(max(abs(v) for v in vals) / f(top))
        yield (f(0.0) if s < np.finfo(f).tiny else s), vals


def _reference_absmax(x: np.ndarray, block: int, top: float
                      ) -> tuple[np.ndarray, np.ndarray]:
    """int8's recipe with ``L = top``: round half up, clamp to [-L, L], value by value."""
    f = np.float32
    scales, qs = [], []
    for s, vals in _reference_blocks(x, block, top):
        scales.append(s)
        qs += [0 if s == 0 else int(min(max(float(np.floor(f(f(v / s) + f(0.5)))), -top), top))
               for v in vals]
    return np.array(scales, np.float32), np.array(qs, np.int8)


def _reference(x: np.ndarray, block: int = B) -> tuple[np.ndarray, np.ndarray]:
    """The documented int8 recipe."""
    return _reference_absmax(x, block, 127.0)


# -- registry and f32 -----------------------------------------------------------------------


def test_registry_names_every_codec() -> None:
    from daisyweb.rules import CODEC_NAMES

    assert set(CODECS) == {"f32", "int8", "int4", "int2", "sparse"} == set(CODEC_NAMES)
    assert codec_by_name("int8") is INT8 and INT8.name == "int8"
    assert codec_by_name("int4") is INT4 and INT4.name == "int4"
    assert codec_by_name("int2") is INT2 and INT2.name == "int2"
    assert codec_by_name("f32") is F32
    with pytest.raises(ValueError, match="unknown codec"):
        codec_by_name("int3")


def test_f32_round_trip_is_lossless() -> None:
    x = _vec(1000)
    assert F32.decode(F32.encode(x), 1000).tobytes() == x.tobytes()


# -- int8: layout, accuracy, exactness ----------------------------------------------------


def test_layout_is_scales_then_int8_and_matches_the_documented_recipe() -> None:
    x = _vec(3 * B + 17, seed=1)
    payload = INT8.encode(x)
    assert len(payload) == 4 * 4 + x.size == INT8.payload_size(x.size)
    scales, q = _split(payload, x.size)
    ref_scales, ref_q = _reference(x)
    assert scales.tobytes() == ref_scales.tobytes()
    assert q.tobytes() == ref_q.tobytes()
    # decode is f32(q) * scale, value by value
    out = INT8.decode(payload, x.size)
    expect = np.array([np.float32(np.float32(v) * scales[i // B]) for i, v in enumerate(q)],
                      np.float32)
    assert out.dtype == np.float32 and out.tobytes() == expect.tobytes()


def test_round_trip_error_is_at_most_half_a_step_per_block() -> None:
    x = _vec(20 * B + 5, seed=2)
    payload = INT8.encode(x)
    scales, q = _split(payload, x.size)
    out = INT8.decode(payload, x.size)
    step = np.repeat(scales.astype(np.float64), B)[: x.size]
    err = np.abs(out.astype(np.float64) - x)
    # half a step, plus two float32 roundings (x/scale and q*scale): < 2**-16 of a step
    assert np.all(err <= step * (0.5 + 2.0**-16))
    # every block uses its full range: the largest magnitude maps to +-127
    assert np.all(np.abs(q).reshape(-1)[: 20 * B].reshape(20, B).max(axis=1) == 127)
    assert np.abs(q).max() == 127 and q.min() >= -127


def test_encoding_is_deterministic_and_decoding_bit_identical() -> None:
    x = _vec(10 * B, seed=3)
    a, b = INT8.encode(x), INT8.encode(x.copy())
    assert a == b
    assert INT8.decode(a, x.size).tobytes() == INT8.decode(bytes(a), x.size).tobytes()
    # strided and non-contiguous inputs are the same values: the same bytes
    wide = np.zeros(2 * x.size, np.float32)
    wide[::2] = x
    assert INT8.encode(wide[::2]) == a


def test_ragged_last_block() -> None:
    x = _vec(2 * B + 3, seed=4)
    x[-3:] = [4.0, -2.0, 1.0]
    payload = INT8.encode(x)
    assert len(payload) == 3 * 4 + x.size
    scales, q = _split(payload, x.size)
    assert scales[2] == np.float32(np.float32(4.0) / np.float32(127.0))
    # x / scale = 127, -63.5, 31.75 exactly; floor(x / scale + 0.5) rounds halves upwards
    assert q[-3:].tolist() == [127, -63, 32]
    out = INT8.decode(payload, x.size)
    assert out.shape == (x.size,)
    assert np.all(np.abs(out[-3:] - x[-3:]) <= scales[2] * 0.5)


def test_zero_block_gets_scale_zero_and_decodes_to_zeros() -> None:
    x = _vec(3 * B, seed=5)
    x[B : 2 * B] = 0.0
    x[B + 7] = -0.0
    with np.errstate(all="raise"):  # no 0/0 anywhere
        payload = INT8.encode(x)
        out = INT8.decode(payload, x.size)
    scales, q = _split(payload, x.size)
    assert scales[1] == 0.0 and not np.signbit(scales[1])
    assert not q[B : 2 * B].any()
    assert out[B : 2 * B].tobytes() == np.zeros(B, np.float32).tobytes()
    assert INT8.decode(INT8.encode(np.zeros(5, np.float32)), 5).tobytes() == bytes(20)


def test_subnormals_count_as_zero_so_flush_to_zero_machines_agree() -> None:
    tiny = np.finfo(np.float32).tiny
    x = np.array([tiny / 4, -tiny / 2, tiny * 0.999], np.float32)  # all subnormal
    payload = INT8.encode(x)
    assert _split(payload, 3)[0][0] == 0.0
    assert not INT8.decode(payload, 3).any()
    # a block whose scale would be subnormal is a zero block too
    y = np.array([tiny * 100, -tiny], np.float32)
    assert _split(INT8.encode(y), 2)[0][0] == 0.0
    # subnormal values beside a normal block maximum are sent as 0: with scale 2**-126,
    # 0.9 * 2**-126 would round to q = 1 if it reached the division
    z = np.zeros(B, np.float32)
    z[0], z[1] = tiny * 127, tiny * 0.9
    scales, q = _split(INT8.encode(z), B)
    assert scales[0] == tiny and q[0] == 127 and q[1] == 0


def test_empty_vector() -> None:
    assert INT8.encode(np.zeros(0, np.float32)) == b""
    assert INT8.decode(b"", 0).shape == (0,)


def test_other_block_sizes() -> None:
    c = Int8Codec(1024)
    x = _vec(3000, seed=6)
    assert len(c.encode(x)) == 3 * 4 + 3000
    assert np.allclose(c.decode(c.encode(x), 3000), x, atol=float(np.abs(x).max()) / 127)
    with pytest.raises(ValueError, match="block"):
        Int8Codec(0)


# -- int8: refusals -------------------------------------------------------------------------


def test_encode_refuses_non_finite_and_huge_values() -> None:
    x = _vec(B + 1)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[3] = bad
        with pytest.raises(GradientError, match="NaN/Inf"):
            INT8.encode(y)
    y = x.copy()
    y[0] = 3e38
    with pytest.raises(GradientError, match="cannot be sent as int8"):
        INT8.encode(y)
    with pytest.raises(GradientError, match="float32"):
        INT8.encode(x.astype(np.float64))
    with pytest.raises(GradientError, match="1-D"):
        INT8.encode(x[: 2 * (B // 2)].reshape(2, -1))


@pytest.mark.parametrize("delta", [-1, 1, -4, 4, -(B + 4)])
def test_decode_refuses_wrong_lengths(delta: int) -> None:
    x = _vec(2 * B + 1)
    payload = INT8.encode(x)
    bad = payload + bytes(delta) if delta > 0 else payload[:delta]
    with pytest.raises(GradientError, match=r"expected 525 bytes of int8 payload"):
        INT8.decode(bad, x.size, "delta from p1")
    # the right bytes for another size are refused too
    with pytest.raises(GradientError, match="expected"):
        INT8.decode(payload, x.size + 1)


@pytest.mark.parametrize("value, what", [(np.nan, "NaN/Inf int8 scales"),
                                         (np.inf, "NaN/Inf int8 scales"),
                                         (-np.inf, "NaN/Inf int8 scales"),
                                         (-0.5, "negative int8 scales"),
                                         (-0.0, "negative int8 scales"),
                                         (1e-40, "subnormal int8 scales"),
                                         (2.0**121, r"int8 scales above 2\*\*120")])
def test_decode_refuses_bad_scales(value: float, what: str) -> None:
    x = _vec(3 * B)
    payload = _with_scale(INT8.encode(x), 1, value)
    with pytest.raises(GradientError, match=f"delta from p2: 1 {what}"):
        INT8.decode(payload, x.size, "delta from p2")


def test_decode_accepts_the_largest_allowed_scale() -> None:
    payload = _with_scale(INT8.encode(np.full(B, -1.0, np.float32)), 0, 2.0**120)
    out = INT8.decode(payload, B)
    assert np.all(np.isfinite(out)) and out[0] == np.float32(-127.0 * 2.0**120)


def test_decode_refuses_the_reserved_minus_128() -> None:
    x = _vec(2 * B)
    raw = bytearray(INT8.encode(x))
    raw[4 * 2 + 5] = 0x80  # int8 -128
    with pytest.raises(GradientError, match="1 int8 values are -128"):
        INT8.decode(bytes(raw), x.size)
    raw[4 * 2 + 5] = 0x81  # -127 is fine
    INT8.decode(bytes(raw), x.size)


# -- int8: properties -----------------------------------------------------------------------

_finite32 = st.floats(min_value=-(2.0**100), max_value=2.0**100, width=32, allow_nan=False,
                      allow_infinity=False, allow_subnormal=True)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 3 * B + 7), elements=_finite32),
       st.sampled_from([1, 7, B]))
def test_property_round_trip_bound_and_determinism(x: np.ndarray, block: int) -> None:
    c = Int8Codec(block)
    payload = _assert_round_trip(c, x)
    q = _split(payload, x.size, c)[1]
    assert q.size == 0 or q.min() >= -127


def _assert_round_trip(c: Int8Codec, x: np.ndarray) -> bytes:
    """What every absmax codec promises for ``x``; its payload."""
    payload = c.encode(x)
    assert len(payload) == c.payload_size(x.size) and payload == c.encode(x.copy())
    out = c.decode(payload, x.size)
    assert out.dtype == np.float32 and np.all(np.isfinite(out))
    assert out.tobytes() == c.decode(payload, x.size).tobytes()
    scales = np.frombuffer(payload, "<f4", count=c.nblocks(x.size)).astype(np.float64)
    step = np.repeat(scales, c.block)[: x.size]
    err = np.abs(out.astype(np.float64) - x.astype(np.float64))
    tiny = float(np.finfo(np.float32).tiny)
    # half a step, or the whole value in a zero block (its maximum is below L * 2**-126)
    assert np.all(err <= np.where(step > 0, step * (0.5 + 2.0**-16), c.levels * tiny))
    # a decoded payload re-encodes to itself: decoding loses nothing more
    assert c.encode(out) == payload
    return payload


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=4 * 3 + 2 * B + 2))
def test_property_decode_of_random_bytes_is_finite_or_refused(raw: bytes) -> None:
    size = 2 * B + 2
    if len(raw) != INT8.payload_size(size):
        raw = (raw * (INT8.payload_size(size) // max(len(raw), 1) + 1))[: INT8.payload_size(size)]
    try:
        out = INT8.decode(raw, size)
    except GradientError:
        return
    assert out.dtype == np.float32 and out.shape == (size,) and np.all(np.isfinite(out))


# -- error feedback -------------------------------------------------------------------------


def test_error_feedback_residual_is_what_the_bytes_missed() -> None:
    ef = ErrorFeedback(2 * B)
    v1 = _vec(2 * B, seed=7)
    payload, decoded = ef.encode_decoded(INT8, v1)
    assert payload == INT8.encode(v1)  # the first round has nothing to carry
    assert decoded.tobytes() == INT8.decode(payload, 2 * B).tobytes()
    assert ef.residual.tobytes() == (v1 - decoded).tobytes()
    v2 = _vec(2 * B, seed=8)
    old = ef.residual.copy()
    payload2 = ef.encode(INT8, v2)
    target = v2 + old
    assert payload2 == INT8.encode(target)
    assert ef.residual.tobytes() == (target - INT8.decode(payload2, 2 * B)).tobytes()
    ef.reset()
    assert not ef.residual.any()


def test_error_feedback_keeps_its_residual_when_encoding_fails() -> None:
    ef = ErrorFeedback(B)
    ef.encode(INT8, _vec(B, seed=9))
    before = ef.residual.copy()
    bad = _vec(B, seed=10)
    bad[0] = np.nan
    with pytest.raises(GradientError):
        ef.encode(INT8, bad)
    with pytest.raises(GradientError):
        ef.encode(INT8, _vec(B + 1))
    assert ef.residual.tobytes() == before.tobytes()


def test_error_feedback_sum_tracks_the_true_sum_within_one_step() -> None:
    size, rounds = 4 * B, 300
    rng = np.random.default_rng(11)
    # a biased contribution: each round the same small offset plus noise, which plain
    # rounding loses every round (0.3 of a step below 0.5 rounds away every time)
    base = (rng.standard_normal(size) * 1e-3).astype(np.float32)
    base[::B] = 0.127  # pins each block's scale near 1e-3
    ef = ErrorFeedback(size)
    true_sum = np.zeros(size)
    sent_ef = np.zeros(size)
    sent_plain = np.zeros(size)
    last_step = np.zeros(size)
    for _ in range(rounds):
        v = (base + rng.standard_normal(size).astype(np.float32) * 1e-5).astype(np.float32)
        true_sum += v
        payload, decoded = ef.encode_decoded(INT8, v)
        sent_ef += decoded
        sent_plain += INT8.decode(INT8.encode(v), size)
        last_step = np.repeat(_split(payload, size)[0].astype(np.float64), B)
    ef_err = np.abs(sent_ef - true_sum)
    plain_err = np.abs(sent_plain - true_sum)
    # EF: off by the last residual only (half a step, plus float32 rounding of the sums)
    assert np.all(ef_err <= last_step * 0.5 + 1e-6)
    assert np.allclose(sent_ef - true_sum, -ef.residual, atol=1e-6)
    # without EF the error of every round adds up: far beyond one step
    assert plain_err.max() > 20 * last_step.max()


def test_bound_encoder_is_a_codec_plus_feedback() -> None:
    enc = INT8.encoder(B)
    assert isinstance(enc, ErrorFeedbackEncoder) and enc.name == "int8"
    v = _vec(B, seed=12)
    ef = ErrorFeedback(B)
    for _ in range(3):
        assert enc.encode(v) == ef.encode(INT8, v)
    assert enc.feedback.residual.tobytes() == ef.residual.tobytes()


# -- what replicas must average -------------------------------------------------------------


def _mean_seen_by(member: int, vectors: list[np.ndarray], payloads: list[bytes],
                  own_undecoded: bool) -> np.ndarray:
    size = vectors[0].size
    parts = [vectors[i] if (own_undecoded and i == member) else INT8.decode(p, size)
             for i, p in enumerate(payloads)]
    return average_in_roster_order(parts)


def test_members_agree_only_when_the_sender_also_averages_the_decoded_bytes() -> None:
    size = 3 * B + 11
    vectors = [_vec(size, seed=20 + i) for i in range(3)]
    encoders = [ErrorFeedback(size) for _ in vectors]
    payloads = [ef.encode(INT8, v) for ef, v in zip(encoders, vectors, strict=True)]
    decoded_path = [_mean_seen_by(m, vectors, payloads, own_undecoded=False).tobytes()
                    for m in range(3)]
    assert len(set(decoded_path)) == 1  # every replica, sender included: the same bits
    undecoded_path = [_mean_seen_by(m, vectors, payloads, own_undecoded=True).tobytes()
                      for m in range(3)]
    assert len(set(undecoded_path)) == 3  # each sender sees its own exact value: a fork
    assert all(u != decoded_path[0] for u in undecoded_path)


def test_same_bytes_with_numpy_held_to_its_baseline_instructions() -> None:
    # as on an old CPU: numpy's SIMD dispatch switched off in a child process
    import hashlib
    import os
    import subprocess
    import sys

    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    script = (
        "import hashlib, numpy as np\n"
        "from daisyweb.protocol.codec import INT4, INT8, ErrorFeedback\n"
        "rng = np.random.default_rng(5)\n"
        "x = (rng.standard_normal(100_003) * 10.0 ** rng.uniform(-8, 3, 100_003))"
        ".astype(np.float32)\n"
        "h = hashlib.sha256()\n"
        "for codec in (INT8, INT4):\n"
        "    ef = ErrorFeedback(x.size)\n"
        "    for r in range(3):\n"
        "        p, d = ef.encode_decoded(codec, x * np.float32(r + 1))\n"
        "        h.update(p); h.update(d.tobytes()); h.update(ef.residual.tobytes())\n"
        "print(h.hexdigest())\n")
    here = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stdout
    off = " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))
    env = dict(os.environ, NPY_DISABLE_CPU_FEATURES=off)
    old = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env=env)
    assert old.stdout == here and len(here.strip()) == len(hashlib.sha256().hexdigest())


def test_every_codec_has_an_encoder_that_is_itself_a_codec() -> None:
    size = 2 * B + 3
    v = _vec(size, seed=30)
    assert F32.encoder(size).encode(v) == F32.encode(v)
    enc = INT8.encoder(size)
    payload = enc.encode(v)
    residual = enc.feedback.residual.copy()
    assert enc.decode(payload, size).tobytes() == INT8.decode(payload, size).tobytes()
    assert enc.feedback.residual.tobytes() == residual.tobytes()  # decode leaves it alone
    with pytest.raises(GradientError):
        enc.decode(payload[:-1], size)


def test_error_feedback_encoder_drives_a_step_machine_like_a_codec() -> None:
    # StepMachine(codec=...) calls encode for its own gradient and decode for every payload
    from daisyweb.protocol.codec import Codec

    enc: Codec = INT8.encoder(B)
    v = _vec(B, seed=31)
    assert enc.decode(enc.encode(v), B).dtype == np.float32


@pytest.mark.parametrize("delta", [-4, -1, 1, 4])
def test_f32_decode_refuses_wrong_lengths(delta: int) -> None:
    payload = F32.encode(_vec(10, seed=32))
    payload = payload[:delta] if delta < 0 else payload + b"\0" * delta
    with pytest.raises(GradientError, match="expected 10 values"):
        F32.decode(payload, 10)


def _whole_vector(x: np.ndarray, block: int = B) -> tuple[np.ndarray, np.ndarray]:
    """The recipe on the whole vector at once (what the codec did before it worked a
    chunk of blocks at a time): the bytes must not depend on the chunking."""
    f = np.float32
    x = np.where(np.abs(x) < np.finfo(f).tiny, f(0.0), x)
    nb = -(-x.size // block)
    blocks = np.zeros(nb * block, f)
    blocks[: x.size] = x
    blocks = blocks.reshape(nb, block)
    scales = np.max(np.abs(blocks), axis=1) / f(127.0)
    scales[scales < np.finfo(f).tiny] = 0.0
    divisor = np.where(scales == 0, f(1.0), scales)[:, None]
    q = np.clip(np.floor(blocks / divisor + f(0.5)), f(-127.0), f(127.0))
    return scales, q.reshape(-1)[: x.size].astype(np.int8)


@pytest.mark.parametrize("size", [256 * B, 256 * B + 1, 2 * 256 * B + 3 * B + 17])
def test_vectors_of_several_chunks_encode_and_decode_as_one_whole_vector(size: int) -> None:
    x = _vec(size, seed=7)
    x[B + 3 : 300 * B] = 0.0  # zero blocks across a chunk boundary
    payload = INT8.encode(x)
    scales, q = _split(payload, size)
    ref_scales, ref_q = _whole_vector(x)
    assert scales.tobytes() == ref_scales.tobytes() and q.tobytes() == ref_q.tobytes()
    expect = q.astype(np.float32) * np.repeat(scales, B)[:size]
    assert INT8.decode(payload, size).tobytes() == expect.tobytes()


@pytest.mark.parametrize("codec", [INT8, INT4, INT2, F32], ids=["int8", "int4", "int2", "f32"])
def test_check_refuses_exactly_what_decode_refuses(codec: Int8Codec | F32Codec) -> None:
    """A step machine checks each arriving payload on its bytes (no vector made) and
    decodes it only to average it: the check must refuse every payload decode refuses,
    with the same message, and pass every one it accepts."""
    size = 3 * B + 17
    good = codec.encode(_vec(size, seed=3))
    bad_payloads = [good[:-1], good + b"\x00"]
    if isinstance(codec, Int8Codec):
        nb = codec.nblocks(size)
        for value in (np.nan, np.inf, -1.0, -0.0, 1e-40, 2.0**121):
            raw = bytearray(good)
            raw[4:8] = np.float32(value).astype("<f4").tobytes()
            bad_payloads.append(bytes(raw))
        if codec is not INT2:  # every int2 code is a value
            raw = bytearray(good)
            raw[4 * nb + 5] = 0x80  # int8 -128; int4: -8 in the high nibble
            bad_payloads.append(bytes(raw))
        if codec is INT4:  # size is odd: the last high nibble is padding
            raw = bytearray(good)
            raw[-1] |= 0x10
            bad_payloads.append(bytes(raw))
        if codec is INT2:  # size is 1 mod 4: the last byte's three high codes are padding
            raw = bytearray(good)
            raw[-1] |= 0x40
            bad_payloads.append(bytes(raw))
    else:
        raw = bytearray(good)
        raw[8:12] = np.float32(np.nan).astype("<f4").tobytes()
        bad_payloads.append(bytes(raw))
    check_payload(codec, good, size, "g")
    for bad in bad_payloads:
        with pytest.raises(GradientError) as decoded:
            codec.decode(bad, size, "g")
        with pytest.raises(GradientError) as checked:
            check_payload(codec, bad, size, "g")
        assert str(checked.value) == str(decoded.value)
    # a codec without ``check`` is checked by decoding
    class DecodeOnly:
        name = "decode-only"
        decode = staticmethod(codec.decode)
    with pytest.raises(GradientError):
        check_payload(DecodeOnly(), bad_payloads[0], size, "g")


# -- int4 ----------------------------------------------------------------------------------

B4 = INT4_BLOCK


def _nibbles(payload: bytes, size: int) -> np.ndarray:
    """The int4 values of a payload, unpacked the slow way, one nibble at a time."""
    raw = payload[4 * INT4.nblocks(size):]
    out = []
    for i in range(size):
        nib = (raw[i // 2] >> (4 * (i % 2))) & 0x0F
        out.append(nib - 16 if nib >= 8 else nib)
    return np.array(out, np.int8)


def _reference4(x: np.ndarray, block: int = B4) -> tuple[np.ndarray, np.ndarray]:
    """int8's documented recipe with L = 7, one value at a time."""
    return _reference_absmax(x, block, 7.0)


@pytest.mark.parametrize("size", [0, 1, 2, B4 - 1, B4, 3 * B4 + 17, 256 * B4 + 1])
def test_int4_layout_matches_the_documented_recipe(size: int) -> None:
    x = _vec(size, seed=40)
    payload = INT4.encode(x)
    nb = -(-size // B4)
    assert len(payload) == 4 * nb + -(-size // 2) == INT4.payload_size(size)
    ref_scales, ref_q = _reference4(x)
    assert payload[: 4 * nb] == ref_scales.astype("<f4").tobytes()
    q = _nibbles(payload, size)
    assert q.tobytes() == ref_q.tobytes()
    if size % 2:
        assert payload[-1] >> 4 == 0  # the padding nibble
    out = INT4.decode(payload, size)
    expect = np.array([np.float32(np.float32(v) * ref_scales[i // B4]) for i, v in enumerate(q)],
                      np.float32)
    assert out.tobytes() == expect.tobytes()


def test_int4_is_about_half_the_bytes_of_int8_and_within_half_a_step() -> None:
    size = 1_000_003
    assert INT4.payload_size(size) / INT8.payload_size(size) < 0.56
    x = _vec(20 * B4 + 5, seed=41)
    out = INT4.decode(INT4.encode(x), x.size)
    scales, _ = _reference4(x)
    step = np.repeat(scales.astype(np.float64), B4)[: x.size]
    assert np.all(np.abs(out.astype(np.float64) - x) <= step * (0.5 + 2.0**-16))
    q = _nibbles(INT4.encode(x), x.size)
    assert q.min() >= -7 and np.abs(q).reshape(-1)[: 20 * B4].reshape(20, B4).max(axis=1).min() == 7


def test_int4_refuses_minus_8_and_a_set_padding_nibble() -> None:
    x = _vec(2 * B4 + 1, seed=42)
    good = INT4.encode(x)
    at = 4 * INT4.nblocks(x.size) + 3
    # -8 in the low, the high, both nibbles; then -7 in the same places is fine
    for byte, n, fine in ((0x08, 1, 0x09), (0x80, 1, 0x90), (0x88, 2, 0x99)):
        raw = bytearray(good)
        raw[at] = byte
        with pytest.raises(GradientError, match=f"p3: {n} int4 values are -8"):
            INT4.decode(bytes(raw), x.size, "p3")
        raw[at] = fine
        out = INT4.decode(bytes(raw), x.size)
        lo, hi = (-7 if fine & 0x0F else 0), (-7 if fine >> 4 else 0)
        scale = np.frombuffer(good, "<f4", count=1)[0]
        assert out[6:8].tobytes() == (np.array([lo, hi], np.float32) * scale).tobytes()
    raw = bytearray(good)
    raw[-1] |= 0x70
    with pytest.raises(GradientError, match="padding nibble"):
        INT4.decode(bytes(raw), x.size)
    with pytest.raises(GradientError, match=r"expected \d+ bytes of int4 payload"):
        INT4.decode(good[:-1], x.size)
    with pytest.raises(GradientError, match="NaN/Inf int4 scales"):
        INT4.decode(_with_scale(good, 1, np.nan), x.size)


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 3 * B4 + 7), elements=_finite32),
       st.sampled_from([1, 5, B4]))
def test_int4_property_round_trip_bound_and_determinism(x: np.ndarray, block: int) -> None:
    _assert_round_trip(Int4Codec(block), x)


@pytest.mark.parametrize("codec", [INT4, SPARSE], ids=["int4", "sparse"])
@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_decode_of_random_bytes_is_finite_or_refused(codec: Int8Codec, raw: bytes) -> None:
    size = 2 * codec.block + 3
    n = codec.payload_size(size)
    raw = (raw * (n // max(len(raw), 1) + 1))[:n] if raw else bytes(n)
    try:
        out = codec.decode(raw, size)
    except GradientError:
        return
    assert out.dtype == np.float32 and out.shape == (size,) and np.all(np.isfinite(out))


def _feedback_sums(codec: Int8Codec, size: int, rounds: int, seed: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(what the bytes of ``rounds`` error-fed contributions carried, their true sum, the
    residual left); each contribution's own decode checked against its payload's."""
    ef = ErrorFeedback(size)
    true_sum = np.zeros(size, np.float64)
    sent_sum = np.zeros(size, np.float64)
    for r in range(rounds):
        v = _vec(size, seed=seed + r)
        payload, decoded = ef.encode_decoded(codec, v)
        true_sum += v
        sent_sum += decoded
        assert decoded.tobytes() == codec.decode(payload, size).tobytes()
    return sent_sum, true_sum, ef.residual


def test_int4_error_feedback_sum_tracks_the_true_sum() -> None:
    sent_sum, true_sum, residual = _feedback_sums(INT4, 5 * B4 + 3, 30, seed=60)
    # what all rounds' bytes carried differs from the true sum by the last residual only
    assert np.allclose(sent_sum + residual, true_sum, rtol=1e-5, atol=1e-9)


def test_int4_decodes_every_byte_as_its_two_nibbles() -> None:
    """The decode's byte -> (low, high) lookup against the slow nibble-by-nibble reading,
    for every byte that holds no reserved -8, at scale 1 and an odd size (padding)."""
    values = bytes(b for b in range(256) if b & 0x0F != 8 and b >> 4 != 8)
    size = 2 * len(values) - 1  # the last byte's high nibble is padding: 0 there
    packed = values[:-1] + bytes([values[-1] & 0x0F])
    payload = np.ones(INT4.nblocks(size), "<f4").tobytes() + packed
    out = INT4.decode(payload, size)
    assert out.tobytes() == _nibbles(payload, size).astype(np.float32).tobytes()


@pytest.mark.parametrize("codec", [INT8, INT4, INT2, SPARSE],
                         ids=["int8", "int4", "int2", "sparse"])
@pytest.mark.parametrize("size", [0, 1, 7, B4 + 1, 3 * B + 17, 70_000])
def test_encode_decoded_is_the_encoding_and_the_decode_of_its_bytes(
        codec: Int8Codec, size: int) -> None:
    """A sender's own decoded vector is made from its integer values, not by unpacking
    its payload again: it must be that payload's decode, bit for bit (ragged last
    blocks, odd sizes, several chunks, zero and subnormal blocks included)."""
    x = _vec(size, seed=8)
    x[: min(size, codec.block)] = 0.0
    x[codec.block : min(size, 2 * codec.block)] = np.finfo(np.float32).tiny / 3
    payload, decoded = codec.encode_decoded(x)
    assert payload == codec.encode(x)
    assert decoded.dtype == np.float32 and decoded.shape == (size,)
    assert decoded.tobytes() == codec.decode(payload, size).tobytes()


# -- int2 -------------------------------------------------------------------------------

B2 = INT2_BLOCK


def _codes(payload: bytes, size: int) -> np.ndarray:
    """The q values of an int2 payload, read code by code (the slow, obvious way)."""
    raw = payload[4 * INT2.nblocks(size):]
    return np.array([2 * ((raw[i // 4] >> (2 * (i % 4))) & 3) - 3 for i in range(size)],
                    np.int8)


def _reference2(x: np.ndarray, block: int = B2) -> tuple[np.ndarray, np.ndarray]:
    """The documented int2 recipe, value by value in float32."""
    f = np.float32
    scales, qs = [], []
    for s, vals in _reference_blocks(x, block, 3.0):
        scales.append(s)
        for v in vals:
            if v == 0:
                qs.append(1)
            else:
                t = f(v / (s if s else f(1.0)))
                qs.append(int(min(max(2 * float(np.floor(f(t / f(2.0)))) + 1, -3.0), 3.0)))
    return np.array(scales, np.float32), np.array(qs, np.int8)


@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, B2 - 1, B2, 3 * B2 + 17, 256 * B2 + 3])
def test_int2_layout_matches_the_documented_recipe(size: int) -> None:
    x = _vec(size, seed=70)
    payload = INT2.encode(x)
    nb = -(-size // B2)
    assert len(payload) == 4 * nb + -(-size // 4) == INT2.payload_size(size)
    ref_scales, ref_q = _reference2(x)
    assert payload[: 4 * nb] == ref_scales.astype("<f4").tobytes()
    q = _codes(payload, size)
    assert q.tobytes() == ref_q.tobytes()
    if size % 4:
        assert payload[-1] >> (2 * (size % 4)) == 0  # the padding codes
    out = INT2.decode(payload, size)
    expect = np.array([np.float32(np.float32(v) * ref_scales[i // B2]) for i, v in enumerate(q)],
                      np.float32)
    assert out.tobytes() == expect.tobytes()


def test_int2_is_a_bit_over_half_the_bytes_of_int4_and_within_one_scale() -> None:
    size = 1_325_824  # the demo's model
    assert INT2.payload_size(size) / INT4.payload_size(size) < 0.56
    x = _vec(20 * B2 + 5, seed=71)
    out = INT2.decode(INT2.encode(x), x.size)
    scales, _ = _reference2(x)
    step = np.repeat(scales.astype(np.float64), B2)[: x.size]
    # the levels are 2 scales apart: every value within one scale of its decode
    assert np.all(np.abs(out.astype(np.float64) - x) <= step * (1.0 + 2.0**-16))
    q = _codes(INT2.encode(x), x.size)
    assert set(np.unique(q)) <= {-3, -1, 1, 3}


def test_int2_refuses_set_padding_codes_but_every_code_is_a_value() -> None:
    x = _vec(2 * B2 + 1, seed=72)
    good = INT2.encode(x)
    for bits in (0b00000100, 0b00010000, 0b01000000):  # one code in each padding place
        raw = bytearray(good)
        raw[-1] |= bits
        with pytest.raises(GradientError, match="p2: the int2 padding codes are not 0"):
            INT2.decode(bytes(raw), x.size, "p2")
    raw = bytearray(good)
    raw[-1] |= 0b11  # the last real value: any code is a value
    assert np.isfinite(INT2.decode(bytes(raw), x.size)).all()
    with pytest.raises(GradientError, match=r"expected \d+ bytes of int2 payload"):
        INT2.decode(good[:-1], x.size)
    with pytest.raises(GradientError, match="NaN/Inf int2 scales"):
        INT2.decode(_with_scale(good, 1, np.nan), x.size)


def test_int2_decodes_every_byte_as_its_four_codes() -> None:
    size = 4 * 256 - 3  # the last byte's three high codes are padding: 0 there
    packed = bytes(range(255)) + bytes([255 & 0b11])
    payload = np.ones(INT2.nblocks(size), "<f4").tobytes() + packed
    out = INT2.decode(payload, size)
    assert out.tobytes() == _codes(payload, size).astype(np.float32).tobytes()
    parts = np.concatenate([v for _, v in INT2.decode_parts(payload, size)])
    assert parts.tobytes() == out.tobytes()


def test_int2_zero_and_subnormal_values_take_the_code_of_zero() -> None:
    x = _vec(3 * B2, seed=73)
    x[:B2] = 0.0  # a zero block: scale 0, every value decodes to 0
    x[B2 + 1] = np.finfo(np.float32).tiny / 4  # a subnormal in a live block: as 0, q = 1
    x[B2 + 2] = -np.finfo(np.float32).tiny / 4
    payload = INT2.encode(x)
    q = _codes(payload, x.size)
    assert (q[:B2] == 1).all() and q[B2 + 1] == 1 and q[B2 + 2] == 1
    assert not INT2.decode(payload, x.size)[:B2].any()
    flushed = x.copy()
    flushed[B2 + 1: B2 + 3] = 0.0  # what a flush-to-zero machine computes with
    assert INT2.encode(flushed) == payload


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 3 * B2 + 7), elements=_finite32),
       st.sampled_from([1, 5, B2]))
def test_int2_property_round_trip_and_determinism(x: np.ndarray, block: int) -> None:
    c = Int2Codec(block)
    payload = c.encode(x)
    assert len(payload) == c.payload_size(x.size) and payload == c.encode(x.copy())
    out = c.decode(payload, x.size)
    assert out.dtype == np.float32 and np.all(np.isfinite(out))
    scales = np.frombuffer(payload, "<f4", count=c.nblocks(x.size)).astype(np.float64)
    step = np.repeat(scales, c.block)[: x.size]
    err = np.abs(out.astype(np.float64) - x.astype(np.float64))
    tiny = float(np.finfo(np.float32).tiny)
    assert np.all(err <= np.where(step > 0, step * (1.0 + 2.0**-16), 3 * tiny))


def test_int2_error_feedback_sum_tracks_the_true_sum() -> None:
    sent_sum, true_sum, residual = _feedback_sums(INT2, 5 * B2 + 3, 30, seed=80)
    assert np.allclose(sent_sum + residual, true_sum, rtol=1e-5, atol=1e-9)


# -- sparse -----------------------------------------------------------------------------

BS, KS = SPARSE_BLOCK, SPARSE_KEEP


def _reference_sparse(x: np.ndarray) -> bytes:
    """The documented sparse recipe, block by block in plain Python and float32."""
    f = np.float32
    tiny = np.finfo(f).tiny
    scales, records = [], b""
    for start in range(0, x.size, BS):
        vals = [f(0.0) if abs(v) < tiny else f(v) for v in x[start:start + BS]]
        k = min(KS, len(vals))
        kept = sorted(sorted(range(len(vals)), key=lambda i: (-abs(vals[i]), i))[:k])
        s = f(max(abs(v) for v in vals) / f(3.0))
        if s < tiny:
            s = f(0.0)
        scales.append(s)
        codes = []
        for i in kept:
            if vals[i] == 0:
                q = 1
            else:
                t = f(vals[i] / (s if s else f(1.0)))
                q = int(min(max(2 * float(np.floor(f(t / f(2.0)))) + 1, -3.0), 3.0))
            codes.append((q + 3) // 2)
        codes += [0] * (-len(codes) % 4)
        packed = bytes(codes[j] | codes[j + 1] << 2 | codes[j + 2] << 4 | codes[j + 3] << 6
                       for j in range(0, len(codes), 4))
        records += bytes(kept) + packed
    return np.array(scales, "<f4").tobytes() + records


@pytest.mark.parametrize("size", [0, 1, 5, KS, KS + 1, BS - 1, BS, BS + 3, 3 * BS + 17])
def test_sparse_layout_matches_the_documented_recipe(size: int) -> None:
    x = _vec(size, seed=90)
    if size > 20:
        x[10] = x[11] = np.float32(50.0)  # a tie: the lower index is kept first
    payload = SPARSE.encode(x)
    assert payload == _reference_sparse(x) and len(payload) == SPARSE.payload_size(size)
    out = SPARSE.decode(payload, size)
    kept = np.flatnonzero(out)
    per_block = [min(KS, size - b) for b in range(0, size, BS)]
    assert kept.size <= sum(per_block)
    assert np.array_equal(SPARSE.decode(SPARSE.encode(out), size), out)  # kept: itself


def test_sparse_sends_under_a_third_of_int4_and_keeps_the_largest() -> None:
    size = 1_325_824  # the demo's model
    assert SPARSE.payload_size(size) / INT4.payload_size(size) < 0.31
    assert 4 * size * 16 / SPARSE.payload_size(size) > 370  # against lockstep f32, H=16
    x = _vec(4 * BS, seed=91)
    out = SPARSE.decode(SPARSE.encode(x), x.size)
    for b in range(4):
        block, got = x[b * BS:(b + 1) * BS], out[b * BS:(b + 1) * BS]
        top = set(np.argsort(-np.abs(block), kind="stable")[:KS])
        assert set(np.flatnonzero(got)) == top
        assert np.all(np.sign(got[list(top)]) == np.sign(block[list(top)]))


@pytest.mark.parametrize("damage", ["order", "repeat", "past", "padding"])
def test_sparse_refuses_indices_out_of_order_or_range_and_set_padding(damage: str) -> None:
    size = 2 * BS + 5  # the short last block keeps 5: 3 padding codes
    x = _vec(size, seed=92)
    good = SPARSE.encode(x)
    raw = bytearray(good)
    first = 4 * SPARSE.nblocks(size)  # the first record's indices
    last = first + 2 * (KS + KS // 4)  # the short block's indices
    if damage == "order":
        raw[first], raw[first + 1] = raw[first + 1], raw[first]
        want = "not strictly increasing"
    elif damage == "repeat":
        raw[first + 1] = raw[first]
        want = "not strictly increasing"
    elif damage == "past":
        raw[last + 4] = 5  # its block has 5 values: 0..4
        want = "past its block's end"
    else:
        raw[-1] |= 0b11 << 2
        want = "padding codes are not 0"
    with pytest.raises(GradientError, match=want):
        SPARSE.decode(bytes(raw), size, "p")
    with pytest.raises(GradientError, match=want):
        check_payload(SPARSE, bytes(raw), size, "p")
    assert np.isfinite(SPARSE.decode(good, size)).all()


def test_sparse_error_feedback_sends_everything_in_time() -> None:
    sent_sum, true_sum, residual = _feedback_sums(SPARSE, 3 * BS + 7, 40, seed=100)
    assert np.allclose(sent_sum + residual, true_sum, rtol=1e-5, atol=1e-7)
    assert not np.allclose(sent_sum, true_sum, rtol=1e-2)  # what waits is real


def test_sparse_keeps_what_a_flush_to_zero_machine_keeps() -> None:
    x = np.zeros(BS, np.float32)
    x[[3, 50, 90]] = [1.0, -2.0, 0.5]
    x[200] = np.finfo(np.float32).tiny / 4  # a subnormal: counts as 0, ties by index
    flushed = x.copy()
    flushed[200] = 0.0
    assert SPARSE.encode(x) == SPARSE.encode(flushed)
    assert SPARSE.decode(SPARSE.encode(x), BS)[200] == 0.0
