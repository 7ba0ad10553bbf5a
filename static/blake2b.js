// BLAKE2b (RFC 7693) in plain JavaScript, unkeyed, any digest length up to 64 bytes: the
// hash daisyweb's members publish at every boundary (hashlib.blake2b in Python; WebCrypto
// has no BLAKE2). 64-bit words are kept as two 32-bit halves (low, high) in Uint32Arrays.
// sharedHash is daisyweb/training/rounds.py's shared_hash: what a browser member of a
// group in rounds publishes and checks a snapshot against.
// Tests: tests/test_exchange_browser.py (headless Chromium against hashlib).
"use strict";

(function (root) {
  const IV = new Uint32Array([
    0xf3bcc908, 0x6a09e667, 0x84caa73b, 0xbb67ae85, 0xfe94f82b, 0x3c6ef372,
    0x5f1d36f1, 0xa54ff53a, 0xade682d1, 0x510e527f, 0x2b3e6c1f, 0x9b05688c,
    0xfb41bd6b, 0x1f83d9ab, 0x137e2179, 0x5be0cd19,
  ]);
  const SIGMA = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
    [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
    [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
    [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
    [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
    [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
    [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
    [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
  ];

  // v[a] += v[b] + m[x] (64-bit words at 2a, 2a + 1).
  function add3(v, a, b, m, x) {
    const lo = v[2 * a] + v[2 * b] + m[2 * x];
    const hi = v[2 * a + 1] + v[2 * b + 1] + m[2 * x + 1] + Math.floor(lo / 0x100000000);
    v[2 * a] = lo;
    v[2 * a + 1] = hi;
  }

  function add2(v, a, b) {
    const lo = v[2 * a] + v[2 * b];
    v[2 * a + 1] = v[2 * a + 1] + v[2 * b + 1] + Math.floor(lo / 0x100000000);
    v[2 * a] = lo;
  }

  // v[d] = rotr64(v[d] ^ v[a], n)
  function xorRot(v, d, a, n) {
    let lo = v[2 * d] ^ v[2 * a];
    let hi = v[2 * d + 1] ^ v[2 * a + 1];
    if (n >= 32) {
      [lo, hi] = [hi, lo];
      n -= 32;
    }
    if (n) {
      const l = (lo >>> n) | (hi << (32 - n));
      const h = (hi >>> n) | (lo << (32 - n));
      lo = l;
      hi = h;
    }
    v[2 * d] = lo;
    v[2 * d + 1] = hi;
  }

  function mix(v, m, a, b, c, d, x, y) {
    add3(v, a, b, m, x);
    xorRot(v, d, a, 32);
    add2(v, c, d);
    xorRot(v, b, c, 24);
    add3(v, a, b, m, y);
    xorRot(v, d, a, 16);
    add2(v, c, d);
    xorRot(v, b, c, 63);
  }

  function compress(h, block, offset, counter, last) {
    const m = new Uint32Array(32);
    for (let i = 0; i < 32; i++) {
      const j = offset + 4 * i;
      m[i] = block[j] | (block[j + 1] << 8) | (block[j + 2] << 16) | (block[j + 3] << 24);
    }
    const v = new Uint32Array(32);
    v.set(h);
    v.set(IV, 16);
    v[24] ^= counter % 0x100000000; // the byte counter's low 64 bits (t0)
    v[25] ^= Math.floor(counter / 0x100000000);
    if (last) {
      v[28] = ~v[28];
      v[29] = ~v[29];
    }
    for (let r = 0; r < 12; r++) {
      const s = SIGMA[r % 10];
      mix(v, m, 0, 4, 8, 12, s[0], s[1]);
      mix(v, m, 1, 5, 9, 13, s[2], s[3]);
      mix(v, m, 2, 6, 10, 14, s[4], s[5]);
      mix(v, m, 3, 7, 11, 15, s[6], s[7]);
      mix(v, m, 0, 5, 10, 15, s[8], s[9]);
      mix(v, m, 1, 6, 11, 12, s[10], s[11]);
      mix(v, m, 2, 7, 8, 13, s[12], s[13]);
      mix(v, m, 3, 4, 9, 14, s[14], s[15]);
    }
    for (let i = 0; i < 16; i++) h[i] ^= v[i] ^ v[i + 16];
  }

  // BLAKE2b of the concatenated byte arrays ``parts`` (Uint8Arrays), ``outlen`` bytes, hex.
  function blake2b(parts, outlen = 32) {
    const h = new Uint32Array(IV);
    h[0] ^= 0x01010000 ^ outlen;
    const buf = new Uint8Array(128);
    let filled = 0;
    let counter = 0;
    for (const part of parts) {
      for (let i = 0; i < part.length; ) {
        if (filled === 128) { // a full block with more to come: not the last one
          counter += 128;
          compress(h, buf, 0, counter, false);
          filled = 0;
        }
        const take = Math.min(128 - filled, part.length - i);
        buf.set(part.subarray(i, i + take), filled);
        filled += take;
        i += take;
      }
    }
    counter += filled;
    buf.fill(0, filled);
    compress(h, buf, 0, counter, true);
    const out = new Uint8Array(h.buffer).subarray(0, outlen); // little-endian words
    return Array.from(out, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function u64le(values) {
    const out = new Uint8Array(8 * values.length);
    const view = new DataView(out.buffer);
    values.forEach((x, i) => {
      view.setUint32(8 * i, x % 0x100000000, true);
      view.setUint32(8 * i + 4, Math.floor(x / 0x100000000), true);
    });
    return out;
  }

  const SHARED_MAGIC = new TextEncoder().encode("daisyweb-round-state-v1\0");

  // rounds.shared_hash(anchor, rounds_done, inner_steps): the hash a member of a group in
  // rounds publishes at every boundary (a Float32Array anchor, little-endian on the
  // platforms browsers run on; checked below).
  function sharedHash(anchor, roundsDone, innerSteps) {
    if (new Uint8Array(new Float32Array([1]).buffer)[3] !== 0x3f) {
      throw new Error("a big-endian platform: the anchor's bytes would be swapped");
    }
    return blake2b([SHARED_MAGIC, u64le([anchor.length, roundsDone, innerSteps]),
                    new Uint8Array(anchor.buffer, anchor.byteOffset, anchor.byteLength)]);
  }

  root.DaisyBlake2b = { blake2b, sharedHash };
})(typeof window !== "undefined" ? window : globalThis);
