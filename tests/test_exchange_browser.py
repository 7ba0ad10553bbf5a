"""static/exchange.js against numpy, in headless Chromium: the codecs' decode, the
bounded-influence norms and factors, the roster-order mean and the outer step give the
same bits as daisyweb's Python on random and adversarial inputs, and the payloads the
Python decoder refuses are refused (issue 40's first part: what a browser peer must
compute to the bit)."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
import pytest
from playwright.async_api import async_playwright

from daisyweb.protocol.averaging import GradientError, average_parts_in_roster_order
from daisyweb.protocol.codec import codec_by_name
from daisyweb.protocol.influence import clip_factors, squared_norm
from daisyweb.training.rounds import outer_step, shared_hash
from signaling.server import create_app
from tests.signaling.local_server import serving

CODECS = ("f32", "int8", "int4", "int2", "sparse")
SIZES = (1, 3, 63, 64, 65, 255, 257, 1000, 4099)


def _vector(rng: np.random.Generator, size: int) -> np.ndarray:
    """Values over many magnitudes: tiny (subnormal once scaled), zeros, huge."""
    v = rng.standard_normal(size) * 10.0 ** rng.uniform(-40, 30, size)
    v[rng.random(size) < 0.05] = 0.0
    return v.astype(np.float32)


def _bits(a: np.ndarray) -> list[int]:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).tolist()


JS_DECODE = """([codec, bytes, size]) => {
  const v = DaisyExchange.decode(codec, Uint8Array.from(bytes), size);
  return Array.from(new Uint32Array(v.buffer));
}"""
JS_REFUSES = """([codec, bytes, size]) => {
  try { DaisyExchange.decode(codec, Uint8Array.from(bytes), size); return null; }
  catch (e) { return e instanceof DaisyExchange.ExchangeError ? e.message : String(e); }
}"""
JS_MEAN = """([codec, payloads, size, shares, lr, anchor]) => {
  const E = DaisyExchange;
  const vs = payloads.map((p) => E.decode(codec, Uint8Array.from(p), size));
  const norms = vs.map((v) => E.squaredNorm(v));
  const factors = E.clipFactors(norms);
  const mean = E.average(vs, shares, factors);
  const a = new Float32Array(new Uint32Array(anchor).buffer);
  const next = E.outerStep(a, mean, lr);
  return {norms, factors, mean: Array.from(new Uint32Array(mean.buffer)),
          next: Array.from(new Uint32Array(next.buffer))};
}"""


async def _run(chromium: Any, checks: Any) -> None:
    async with serving(create_app()) as url, async_playwright() as pw:
        ctx = await chromium(pw, {"width": 800, "height": 600})
        try:
            page = await ctx.new_page()
            await page.goto(f"{url}/healthz")
            await page.add_script_tag(url=f"{url}/static/exchange.js")
            await page.add_script_tag(url=f"{url}/static/blake2b.js")
            await checks(page)
        finally:
            await ctx.close()


@pytest.mark.asyncio
async def test_decode_norms_mean_and_outer_step_are_numpys_bits(chromium: Any) -> None:
    rng = np.random.default_rng(40)

    async def checks(page: Any) -> None:
        for codec_name in CODECS:
            codec = codec_by_name(codec_name)
            for size in SIZES:
                payload = codec.encode(_vector(rng, size))
                got = await page.evaluate(JS_DECODE, [codec_name, list(payload), size])
                assert got == _bits(codec.decode(payload, size)), (codec_name, size)
        # A round of three members: one sends a huge delta (its factor applies), over
        # more than one norm chunk (65,536 values), with equal and unequal shares.
        for codec_name, size, shares, lr in [("int2", 70_001, [8, 8, 8], 1.0),
                                            ("int8", 5_000, [3, 9, 4], 0.7),
                                            ("sparse", 3_000, [5, 2, 9], 1.0),
                                            ("f32", 777, [], 1.0)]:
            codec = codec_by_name(codec_name)
            vectors = [_vector(rng, size) for _ in range(3)]
            vectors = [np.clip(v, -1e3, 1e3) for v in vectors]
            vectors[2] = vectors[2] * np.float32(50.0)
            payloads = [codec.encode(v) for v in vectors]
            anchor = rng.standard_normal(size).astype(np.float32)
            got = await page.evaluate(JS_MEAN, [codec_name, [list(p) for p in payloads],
                                                size, shares, lr, _bits(anchor)])
            norms = [squared_norm(codec.decode_parts(p, size)) for p in payloads]
            factors = clip_factors(norms)
            assert got["norms"] == norms
            assert got["factors"] == [None if f is None else float(f) for f in factors]
            assert factors[2] is not None  # the huge one is held to the bound
            mean = average_parts_in_roster_order(
                [codec.decode_parts(p, size) for p in payloads], size, shares, factors)
            assert got["mean"] == _bits(mean), (codec_name, size)
            assert got["next"] == _bits(outer_step(anchor, mean, lr))

    await _run(chromium, checks)


def _bad_payloads() -> list[tuple[str, bytes, int, str]]:
    """(codec, payload, size, what is wrong), each refused by the Python decoder."""
    out = []
    rng = np.random.default_rng(1)
    for name in ("int8", "int4", "int2"):
        size = 130 if name != "int4" else 131  # a short last block; int4: a padding nibble
        good = bytearray(codec_by_name(name).encode(_vector(rng, size)))
        for what, scale in [("NaN scale", float("nan")), ("negative zero scale", -0.0),
                            ("subnormal scale", 1e-40), ("scale above 2**120", 2.0 ** 121),
                            ("negative scale", -1.0)]:
            bad = bytearray(good)
            bad[0:4] = struct.pack("<f", scale)
            out.append((name, bytes(bad), size, what))
        out.append((name, bytes(good[:-1]), size, "one byte short"))
        out.append((name, bytes(good) + b"\x00", size, "one byte long"))
    size = 130
    good = bytearray(codec_by_name("int8").encode(_vector(rng, size)))
    nb = -(-size // 256)
    bad = bytearray(good)
    bad[4 * nb + 7] = 0x80
    out.append(("int8", bytes(bad), size, "-128"))
    good = bytearray(codec_by_name("int4").encode(_vector(rng, 131)))
    nb4 = -(-131 // 64)
    bad = bytearray(good)
    bad[4 * nb4 + 3] = (bad[4 * nb4 + 3] & 0xF0) | 0x08
    out.append(("int4", bytes(bad), 131, "-8 in a low nibble"))
    bad = bytearray(good)
    bad[-1] |= 0x10
    out.append(("int4", bytes(bad), 131, "padding nibble"))
    good = bytearray(codec_by_name("int2").encode(_vector(rng, 130)))
    bad = bytearray(good)
    bad[-1] |= 0xC0
    out.append(("int2", bytes(bad), 130, "padding codes"))
    sparse = codec_by_name("sparse")
    size = 300  # a block of 256 (32 kept) and a short one of 44 (32 kept)
    good = bytearray(sparse.encode(_vector(rng, size)))
    rec = 4 * 2  # the two scales; the first record starts here
    bad = bytearray(good)
    bad[rec + 1] = bad[rec]  # a repeated index
    out.append(("sparse", bytes(bad), size, "indices not increasing"))
    second = rec + 32 + 8  # the short block's record: 32 indices, 8 code bytes
    bad = bytearray(good)
    bad[second + 31] = 44  # past the short block's 44 values
    out.append(("sparse", bytes(bad), size, "index past the block"))
    good = bytearray(sparse.encode(_vector(rng, 258)))  # last block 2: 2 kept, 2 padding
    bad = bytearray(good)
    bad[-1] |= 0x30
    out.append(("sparse", bytes(bad), 258, "padding codes"))
    f32 = bytearray(codec_by_name("f32").encode(_vector(rng, 5)))
    f32[4:8] = struct.pack("<f", float("inf"))
    out.append(("f32", bytes(f32), 5, "Inf value"))
    return out


@pytest.mark.asyncio
async def test_what_the_python_decoder_refuses_is_refused(chromium: Any) -> None:
    bad = _bad_payloads()
    for codec, payload, size, what in bad:
        with pytest.raises(GradientError):
            codec_by_name(codec).decode(payload, size)
        assert what  # each case says what is wrong with it

    async def checks(page: Any) -> None:
        for codec, payload, size, what in bad:
            why = await page.evaluate(JS_REFUSES, [codec, list(payload), size])
            assert why is not None and "payload" in why, (codec, what, why)

    await _run(chromium, checks)


JS_BLAKE2B = """([parts, outlen]) => DaisyBlake2b.blake2b(parts.map((p) => Uint8Array.from(p)),
                                                         outlen)"""
JS_SHARED = """([anchor, rounds, inner]) => DaisyBlake2b.sharedHash(
  new Float32Array(new Uint32Array(anchor).buffer), rounds, inner)"""


@pytest.mark.asyncio
async def test_blake2b_and_the_shared_hash_are_hashlibs(chromium: Any) -> None:
    """The hash a browser member publishes at a boundary (``rounds.shared_hash``) and its
    BLAKE2b under it: every length around the 128-byte block, split across parts, 32- and
    64-byte digests, and counts beyond 2**32."""
    rng = np.random.default_rng(7)

    async def checks(page: Any) -> None:
        for n in (0, 1, 3, 127, 128, 129, 255, 256, 257, 1000, 70_000):
            data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            for outlen in (32, 64):
                want = hashlib.blake2b(data, digest_size=outlen).hexdigest()
                cut = n // 3
                got = await page.evaluate(JS_BLAKE2B, [[list(data[:cut]), list(data[cut:])],
                                                       outlen])
                assert got == want, (n, outlen)
        for size, rounds, inner in [(1, 0, 0), (777, 3, 48), (70_001, 2**33 + 5, 2**40 + 7)]:
            anchor = rng.standard_normal(size).astype(np.float32)
            got = await page.evaluate(JS_SHARED, [_bits(anchor), rounds, inner])
            assert got == shared_hash(anchor, rounds, inner), (size, rounds, inner)

    await _run(chromium, checks)
