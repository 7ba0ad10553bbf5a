// daisyweb's exchange arithmetic in plain JavaScript: what every member of a group must
// compute to the bit from the exchanged bytes (issue 40's first part, for a browser peer).
//
//  - decode: the codecs' payloads (daisyweb/protocol/codec.py: f32, int8, int4, int2,
//    sparse) to
//    float32, refusing what the Python decoder refuses (a wrong length, NaN/Inf, negative,
//    subnormal or too large scales, reserved codes, non-zero padding);
//  - squaredNorm and clipFactors: bounded influence (daisyweb/protocol/influence.py): the
//    squares in binary64, summed in chunks of 65536 by the same pairwise tree, Math.sqrt
//    (correctly rounded), the factor one binary64 division rounded to float32;
//  - average: the roster-order mean (daisyweb/protocol/averaging.py), clip factor and
//    share multiplications first, then float32 additions in roster order and one
//    multiplication by f32(1 / n) or f32(1 / T);
//  - outerStep: anchor - f32(outer_lr) * mean (daisyweb/training/rounds.py).
// Every float32 operation is a binary64 operation on float32 operands stored into a
// Float32Array (or Math.fround): for +, -, * and / of two float32 values that is the
// correctly rounded float32 result, the same bits numpy's float32 arithmetic gives.
// Tests: tests/test_exchange_browser.py (headless Chromium against numpy).
"use strict";

(function (root) {
  const f32 = Math.fround;
  const TINY = 2 ** -126; // the smallest normal float32
  const MAX_SCALE = 2 ** 120;
  const CHUNK = 1 << 16; // influence.CHUNK
  const CLIP_FACTOR = 2.0; // influence.CLIP_FACTOR
  const CODECS = {
    f32: null,
    int8: { block: 256, bits: 8 },
    int4: { block: 64, bits: 4 },
    int2: { block: 64, bits: 2 },
    sparse: { block: 256, keep: 32 }, // per block: k indices, then k int2 codes
  };

  class ExchangeError extends Error {}

  function sparseRecord(length) {
    const k = Math.min(CODECS.sparse.keep, length);
    return k + Math.ceil(k / 4);
  }

  function valuesSize(codec, size) {
    if (codec === "sparse") {
      const block = CODECS.sparse.block;
      const rest = size % block;
      return Math.floor(size / block) * sparseRecord(block) + (rest ? sparseRecord(rest) : 0);
    }
    return Math.ceil((size * CODECS[codec].bits) / 8);
  }

  function payloadSize(codec, size) {
    if (codec === "f32") return 4 * size;
    return 4 * Math.ceil(size / CODECS[codec].block) + valuesSize(codec, size);
  }

  // The payload of ``size`` values as a new Float32Array, or ExchangeError saying why not.
  function decode(codec, bytes, size, who = "payload") {
    if (!(codec in CODECS)) throw new ExchangeError(`unknown codec ${codec}`);
    const want = payloadSize(codec, size);
    if (bytes.length !== want) {
      throw new ExchangeError(`${who}: expected ${want} bytes of ${codec} payload for ` +
                              `${size} values, got ${bytes.length} bytes`);
    }
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const out = new Float32Array(size);
    if (codec === "f32") {
      for (let i = 0; i < size; i++) {
        const v = view.getFloat32(4 * i, true);
        if (!Number.isFinite(v)) throw new ExchangeError(`${who}: NaN/Inf values`);
        out[i] = v;
      }
      return out;
    }
    const { block } = CODECS[codec];
    const nb = Math.ceil(size / block);
    const scales = new Float32Array(nb);
    for (let b = 0; b < nb; b++) {
      const s = view.getFloat32(4 * b, true);
      if (!Number.isFinite(s)) throw new ExchangeError(`${who}: NaN/Inf ${codec} scales`);
      if (s < 0 || Object.is(s, -0)) {
        throw new ExchangeError(`${who}: negative ${codec} scales`);
      }
      if (s !== 0 && s < TINY) throw new ExchangeError(`${who}: subnormal ${codec} scales`);
      if (s > MAX_SCALE) throw new ExchangeError(`${who}: ${codec} scales above 2**120`);
      scales[b] = s;
    }
    const raw = bytes.subarray(4 * nb);
    if (codec === "sparse") return decodeSparse(raw, scales, size, who);
    for (let i = 0; i < size; i++) {
      out[i] = code(codec, raw, i, who) * scales[Math.floor(i / block)];
    }
    checkPadding(codec, raw, size, who);
    return out;
  }

  // SparseCodec: block b's record holds k strictly increasing in-block indices, then their
  // int2 codes (padding codes 0); the values not kept are 0.
  function decodeSparse(raw, scales, size, who) {
    const { block } = CODECS.sparse;
    const out = new Float32Array(size);
    let at = 0;
    for (let b = 0, lo = 0; lo < size; b++, lo += block) {
      const length = Math.min(block, size - lo);
      const k = Math.min(CODECS.sparse.keep, length);
      for (let j = 0; j < k; j++) {
        const index = raw[at + j];
        if (j > 0 && index <= raw[at + j - 1]) {
          throw new ExchangeError(`${who}: sparse indices not strictly increasing`);
        }
        if (index >= length) {
          throw new ExchangeError(`${who}: a sparse index past its block's end`);
        }
        const level = 2 * ((raw[at + k + (j >> 2)] >> (2 * (j & 3))) & 3) - 3;
        out[lo + index] = level * scales[b];
      }
      for (let j = k; j < 4 * Math.ceil(k / 4); j++) {
        if ((raw[at + k + (j >> 2)] >> (2 * (j & 3))) & 3) {
          throw new ExchangeError(`${who}: the sparse padding codes are not 0`);
        }
      }
      at += sparseRecord(length);
    }
    return out;
  }

  // The integer level of value ``i`` (int8: a byte; int4: a nibble, low first; int2: a
  // 2-bit code, lowest bits first, as the odd level 2c - 3).
  function code(codec, raw, i, who) {
    if (codec === "int8") {
      const q = (raw[i] << 24) >> 24;
      if (q === -128) throw new ExchangeError(`${who}: int8 values are -128 (reserved)`);
      return q;
    }
    if (codec === "int4") {
      const nibble = (raw[i >> 1] >> (4 * (i & 1))) & 0x0f;
      if (nibble === 8) throw new ExchangeError(`${who}: int4 values are -8 (reserved)`);
      return nibble > 7 ? nibble - 16 : nibble;
    }
    return 2 * ((raw[i >> 2] >> (2 * (i & 3))) & 3) - 3;
  }

  function checkPadding(codec, raw, size, who) {
    if (codec === "int4" && size % 2 && raw[raw.length - 1] >> 4) {
      throw new ExchangeError(`${who}: the int4 padding nibble is not 0`);
    }
    const pad = 4 * valuesSize("int2", size) - size;
    if (codec === "int2" && pad && raw[raw.length - 1] >> (2 * (4 - pad))) {
      throw new ExchangeError(`${who}: the int2 padding codes are not 0`);
    }
  }

  // influence.tree_sum: zero-padded to a power of two, element i plus element i + half.
  function treeSum(values) {
    let n = 1;
    while (n < values.length) n *= 2;
    let v = new Float64Array(n);
    v.set(values);
    while (v.length > 1) {
      const half = v.length / 2;
      const next = new Float64Array(half);
      for (let i = 0; i < half; i++) next[i] = v[i] + v[i + half];
      v = next;
    }
    return v.length ? v[0] : 0.0;
  }

  // influence.squared_norm of a whole vector: chunks of CHUNK squares, each by the tree,
  // then the chunk sums by the tree.
  function squaredNorm(vector) {
    const sums = [];
    for (let start = 0; start < vector.length; start += CHUNK) {
      const stop = Math.min(start + CHUNK, vector.length);
      const chunk = new Float64Array(CHUNK);
      for (let i = start; i < stop; i++) chunk[i - start] = vector[i] * vector[i];
      sums.push(treeSum(chunk));
    }
    return sums.length ? treeSum(sums) : 0.0;
  }

  // influence.clip_factors: per contribution the float32 factor down to CLIP_FACTOR times
  // the lower median norm, or null.
  function clipFactors(norms2) {
    if (!norms2.length) return [];
    const norms = norms2.map((x) => (x > 0 ? Math.sqrt(x) : 0.0));
    const sorted = [...norms].sort((a, b) => a - b);
    const bound = CLIP_FACTOR * sorted[Math.floor((norms.length - 1) / 2)];
    return norms.map((x) => (x > bound ? f32(bound / x) : null));
  }

  // averaging.average_parts_in_roster_order over whole decoded vectors, in roster order.
  function average(vectors, shares = [], factors = []) {
    if (!vectors.length) throw new ExchangeError("cannot average an empty roster");
    const size = vectors[0].length;
    if (vectors.some((v) => v.length !== size)) {
      throw new ExchangeError("contributions of different lengths");
    }
    if (shares.length && shares.length !== vectors.length) {
      throw new ExchangeError(`${shares.length} shares for ${vectors.length} contributions`);
    }
    const weighted = new Set(shares).size > 1;
    const total = new Float32Array(size);
    const value = new Float32Array(1);
    vectors.forEach((v, k) => {
      const clip = factors.length ? factors[k] : null;
      for (let i = 0; i < size; i++) {
        value[0] = v[i];
        if (clip !== null) value[0] = value[0] * clip;
        if (weighted) value[0] = value[0] * f32(shares[k]);
        total[i] = k === 0 ? value[0] : total[i] + value[0];
      }
    });
    let scale = null;
    if (weighted) scale = f32(1.0 / shares.reduce((s, n) => s + n, 0));
    else if (vectors.length > 1) scale = f32(1.0 / vectors.length);
    if (scale !== null) for (let i = 0; i < size; i++) total[i] = total[i] * scale;
    return total;
  }

  // rounds.outer_step: anchor - f32(outer_lr) * mean, elementwise float32.
  function outerStep(anchor, mean, outerLr) {
    const out = new Float32Array(anchor.length);
    const lr = f32(outerLr);
    for (let i = 0; i < anchor.length; i++) {
      out[i] = outerLr === 1.0 ? anchor[i] - mean[i] : anchor[i] - f32(mean[i] * lr);
    }
    return out;
  }

  root.DaisyExchange = {
    ExchangeError, payloadSize, decode, squaredNorm, clipFactors, average, outerStep,
  };
})(typeof window !== "undefined" ? window : globalThis);
