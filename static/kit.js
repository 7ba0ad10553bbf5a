// daisyweb inference kit: the tokenizer, the model's int8 forward and sampling, in plain
// JavaScript with no outside files. One file shared by the exported kit (daisyweb-export
// inlines it) and the dashboard's "try a checkpoint" (served as /static/kit.js).
//
// The forward follows daisyweb/model.py + kernels/ op by op (one place: forwardLast):
//  - every linear layer is kernels.int8_matmul: activations quantized per row, weights per
//    column (scale = f32(max(amax / 127, 1e-8)) in binary64, q = clamp(floor(x / s + 0.5))),
//    an exact integer GEMM, then y = f32(f32(f32(acc) * s_row) * s_col), then f32(y + b);
//  - LayerNorm, softmax and GELU in model.py's float32 op order through Math.fround, with
//    numpy's pairwise summation order for every mean and sum (numpySum);
//  - where numpy's result has no portable order, the kit picks a fixed one and the logit
//    difference is measured (docs/kit.md): attention's two small matmuls (BLAS in numpy)
//    are dot products accumulated in binary64 and rounded once, exp and tanh are
//    Math.exp / Math.tanh rounded to float32.
// Greedy output equals daisyweb-generate --temperature 0 token for token on the tested
// prompts (tests/test_kit_browser.py, bench/kit.py).
"use strict";

(function (root) {
  const f32 = Math.fround;
  const N_BYTES = 256;
  const MAX_WORD = 256; // daisyweb.data.tokenizer.MAX_WORD
  const LN_EPS = f32(1e-5);
  const GELU_C = f32(0.044715);
  const SQRT_2_OVER_PI = f32(Math.sqrt(2.0 / Math.PI));
  const SCALE_FLOOR = 1e-8; // kernels.quantize.SCALE_FLOOR

  class KitError extends Error {}

  // ------------------------------------------------------------------ base64
  function b64decode(text) {
    const bin = atob(text);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  // ------------------------------------------------------------------ tokenizer
  // Byte-level BPE as daisyweb/data/tokenizer.py. The pre-tokenizer is its PATTERN with
  // Python's \s, \d and [^\W\d_] given as code point ranges that the exporter (and the
  // signaling server) computed with Python's own re module, so both split text alike.
  function charClass(ranges) {
    const hex = (c) => "\\u{" + c.toString(16) + "}";
    return ranges.map(([lo, hi]) => (lo === hi ? hex(lo) : hex(lo) + "-" + hex(hi))).join("");
  }

  function utf8(word) {
    // UTF-8 with lone surrogates encoded as 3 bytes, like Python's "surrogatepass".
    const out = [];
    for (let i = 0; i < word.length;) {
      const cp = word.codePointAt(i);
      i += cp > 0xffff ? 2 : 1;
      if (cp < 0x80) out.push(cp);
      else if (cp < 0x800) out.push(0xc0 | (cp >> 6), 0x80 | (cp & 63));
      else if (cp < 0x10000) out.push(0xe0 | (cp >> 12), 0x80 | ((cp >> 6) & 63), 0x80 | (cp & 63));
      else out.push(0xf0 | (cp >> 18), 0x80 | ((cp >> 12) & 63), 0x80 | ((cp >> 6) & 63), 0x80 | (cp & 63));
    }
    return out;
  }

  class Tokenizer {
    // spec: {vocab_size, file_hash, merges: [[a, b], ...], classes: {letter, digit, space}}
    constructor(spec) {
      const merges = spec && spec.merges;
      if (!Array.isArray(merges)) throw new KitError("tokenizer: merges missing");
      if (spec.vocab_size !== N_BYTES + merges.length) {
        throw new KitError("tokenizer: vocab_size does not match its merges");
      }
      this.vocabSize = spec.vocab_size;
      this.fileHash = String(spec.file_hash);
      this.ranks = new Map();
      this.pieces = [];
      for (let i = 0; i < N_BYTES; i++) this.pieces.push(Uint8Array.of(i));
      merges.forEach(([a, b], i) => {
        const ok = Number.isInteger(a) && Number.isInteger(b) && a >= 0 && b >= 0 &&
          a < N_BYTES + i && b < N_BYTES + i && !this.ranks.has(a * 4194304 + b);
        if (!ok) throw new KitError(`tokenizer: bad merge ${i}`);
        this.ranks.set(a * 4194304 + b, N_BYTES + i);
        const pa = this.pieces[a], pb = this.pieces[b];
        const p = new Uint8Array(pa.length + pb.length);
        p.set(pa);
        p.set(pb, pa.length);
        this.pieces.push(p);
      });
      const L = charClass(spec.classes.letter);
      const D = charClass(spec.classes.digit);
      const S = charClass(spec.classes.space);
      // PATTERN = '(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+
      // "(?:[^\s\w]|_)" is exactly what is neither space, letter nor digit.
      this.re = new RegExp(
        `'(?:[sdmt]|ll|ve|re)| ?[${L}]+| ?[${D}]+| ?[^${S}${L}${D}]+|[${S}]+(?![^${S}])|[${S}]+`,
        "gu");
      this.cache = new Map();
      this.decoder = new TextDecoder("utf-8", { ignoreBOM: true });
    }

    bpe(word) {
      let ids = utf8(word);
      while (ids.length > 1) {
        let best = Infinity, bi = -1;
        for (let i = 0; i + 1 < ids.length; i++) {
          const r = this.ranks.get(ids[i] * 4194304 + ids[i + 1]);
          if (r !== undefined && r < best) { best = r; bi = i; }
        }
        if (bi < 0) break;
        const a = ids[bi], b = ids[bi + 1];
        const out = [];
        for (let i = 0; i < ids.length;) {
          if (i + 1 < ids.length && ids[i] === a && ids[i + 1] === b) { out.push(best); i += 2; }
          else { out.push(ids[i]); i += 1; }
        }
        ids = out;
      }
      return ids;
    }

    encode(text) {
      const out = [];
      let covered = 0;
      for (const m of String(text).matchAll(this.re)) {
        const word = m[0];
        if (m.index !== covered) throw new KitError("tokenizer: pre-tokens skip text");
        covered += word.length;
        let ids = this.cache.get(word);
        if (ids === undefined) {
          const chars = Array.from(word); // code points, as Python's len(str)
          if (chars.length > MAX_WORD) {
            ids = [];
            for (let k = 0; k < chars.length; k += MAX_WORD) {
              ids.push(...this.bpe(chars.slice(k, k + MAX_WORD).join("")));
            }
          } else {
            ids = this.bpe(word);
            if (this.cache.size < 65536) this.cache.set(word, ids);
          }
        }
        for (const id of ids) out.push(id);
      }
      if (covered !== String(text).length) throw new KitError("tokenizer: pre-tokens skip text");
      return out;
    }

    decode(ids) {
      let n = 0;
      for (const id of ids) {
        if (!(Number.isInteger(id) && id >= 0 && id < this.vocabSize)) {
          throw new KitError(`token id ${id} is outside 0..${this.vocabSize - 1}`);
        }
        n += this.pieces[id].length;
      }
      const bytes = new Uint8Array(n);
      let o = 0;
      for (const id of ids) { bytes.set(this.pieces[id], o); o += this.pieces[id].length; }
      return this.decoder.decode(bytes); // invalid bytes become U+FFFD, as errors="replace"
    }
  }

  // ------------------------------------------------------------------ int8 kernels
  // kernels/quantize.py, step for step; every quotient in binary64 as there.
  function scaleOf(amax) {
    return f32(Math.max(amax / 127.0, SCALE_FLOOR));
  }

  function quantizeValue(x, s) {
    const q = Math.floor(x / s + 0.5);
    return q < -127 ? -127 : q > 127 ? 127 : q;
  }

  function nonFinite(name) {
    return new KitError(`${name} has non-finite values (NaN or Inf); refusing`);
  }

  // float32 [k, n] row-major -> {q: Int8Array [n, k] (transposed for the GEMM), s: [n]}
  function quantizeCols(w, k, n, name) {
    const q = new Int8Array(n * k);
    const s = new Float32Array(n);
    for (let j = 0; j < n; j++) {
      let amax = 0;
      for (let i = 0; i < k; i++) {
        const v = w[i * n + j];
        if (!Number.isFinite(v)) throw nonFinite(name || "w");
        const a = Math.abs(v);
        if (a > amax) amax = a;
      }
      const sc = scaleOf(amax);
      s[j] = sc;
      for (let i = 0; i < k; i++) q[j * k + i] = quantizeValue(w[i * n + j], sc);
    }
    return { q, s, k, n };
  }

  function quantizeRows(x, m, k) {
    const q = new Int8Array(m * k);
    const s = new Float32Array(m);
    for (let r = 0; r < m; r++) {
      let amax = 0;
      const o = r * k;
      for (let i = 0; i < k; i++) {
        const v = x[o + i];
        if (!Number.isFinite(v)) throw nonFinite("x");
        const a = Math.abs(v);
        if (a > amax) amax = a;
      }
      const sc = scaleOf(amax);
      s[r] = sc;
      for (let i = 0; i < k; i++) q[o + i] = quantizeValue(x[o + i], sc);
    }
    return { q, s };
  }

  // kernels.int8_matmul(x, w) then "y += b": x float32 [m, k]; lin from quantizeCols.
  function linear(x, m, lin, bias) {
    const { k, n } = lin;
    const qa = quantizeRows(x, m, k);
    const qb = lin.q, sb = lin.s;
    const y = new Float32Array(m * n);
    for (let r = 0; r < m; r++) {
      const ao = r * k, sa = qa.s[r];
      for (let j = 0; j < n; j++) {
        const bo = j * k;
        let acc = 0; // exact: |acc| <= 127 * 127 * k, far below 2**53
        for (let i = 0; i < k; i++) acc += qa.q[ao + i] * qb[bo + i];
        let v = f32(f32(f32(acc) * sa) * sb[j]);
        if (bias) v = f32(v + bias[j]);
        y[r * n + j] = v;
      }
    }
    return y;
  }

  // ------------------------------------------------------------------ float32 pieces
  // numpy's float32 add-reduction along a contiguous axis: 0 + pairwise_sum(a) (blocks of
  // 128, eight accumulators inside a block, halves split at a multiple of 8).
  function pairwise(a, o, n) {
    if (n < 8) {
      let r = 0;
      for (let i = 0; i < n; i++) r = f32(r + a[o + i]);
      return r;
    }
    if (n <= 128) {
      let r0 = a[o], r1 = a[o + 1], r2 = a[o + 2], r3 = a[o + 3];
      let r4 = a[o + 4], r5 = a[o + 5], r6 = a[o + 6], r7 = a[o + 7];
      const end = n - (n % 8);
      let i = 8;
      for (; i < end; i += 8) {
        r0 = f32(r0 + a[o + i]); r1 = f32(r1 + a[o + i + 1]);
        r2 = f32(r2 + a[o + i + 2]); r3 = f32(r3 + a[o + i + 3]);
        r4 = f32(r4 + a[o + i + 4]); r5 = f32(r5 + a[o + i + 5]);
        r6 = f32(r6 + a[o + i + 6]); r7 = f32(r7 + a[o + i + 7]);
      }
      let res = f32(f32(f32(r0 + r1) + f32(r2 + r3)) + f32(f32(r4 + r5) + f32(r6 + r7)));
      for (; i < n; i++) res = f32(res + a[o + i]);
      return res;
    }
    let n2 = Math.floor(n / 2);
    n2 -= n2 % 8;
    return f32(pairwise(a, o, n2) + pairwise(a, o + n2, n - n2));
  }

  function numpySum(a, o, n) {
    return f32(0 + pairwise(a, o, n));
  }

  // model._layernorm on rows [r0, m) of x [m, c]; returns those rows, [m - r0, c].
  function layernorm(x, m, c, g, b, r0) {
    const out = new Float32Array((m - r0) * c);
    const xc = new Float32Array(c);
    const sq = new Float32Array(c);
    for (let r = r0; r < m; r++) {
      const o = r * c;
      const mu = f32(numpySum(x, o, c) / c);
      for (let i = 0; i < c; i++) { xc[i] = f32(x[o + i] - mu); sq[i] = f32(xc[i] * xc[i]); }
      const v = f32(numpySum(sq, 0, c) / c);
      const rstd = f32(1.0 / f32(Math.sqrt(f32(v + LN_EPS))));
      const oo = (r - r0) * c;
      for (let i = 0; i < c; i++) out[oo + i] = f32(f32(f32(xc[i] * rstd) * g[i]) + b[i]);
    }
    return out;
  }

  // model._gelu, in place.
  function gelu(u) {
    for (let i = 0; i < u.length; i++) {
      const x = u[i];
      let inner = f32(x * x);
      inner = f32(inner * GELU_C);
      inner = f32(inner + 1.0);
      inner = f32(inner * x);
      inner = f32(inner * SQRT_2_OVER_PI);
      const t = f32(Math.tanh(inner));
      u[i] = f32(f32(f32(t + 1.0) * x) * 0.5);
    }
    return u;
  }

  // ------------------------------------------------------------------ the model
  const LINEAR = (name) => /^h\d+\.(attn\.w_qkv|attn\.w_out|mlp\.w_in|mlp\.w_out)$/.test(name) ||
    name === "head.w";

  // model.param_layout, in order.
  function paramLayout(cfg) {
    const w = cfg.width, v = cfg.vocab;
    const out = [["wte", [v, w]], ["wpe", [cfg.seq, w]]];
    for (let i = 0; i < cfg.layers; i++) {
      const p = `h${i}.`;
      out.push([p + "ln1.g", [w]], [p + "ln1.b", [w]], [p + "attn.w_qkv", [w, 3 * w]],
        [p + "attn.b_qkv", [3 * w]], [p + "attn.w_out", [w, w]], [p + "attn.b_out", [w]],
        [p + "ln2.g", [w]], [p + "ln2.b", [w]], [p + "mlp.w_in", [w, 4 * w]],
        [p + "mlp.b_in", [4 * w]], [p + "mlp.w_out", [4 * w, w]], [p + "mlp.b_out", [w]]);
    }
    out.push(["lnf.g", [w]], ["lnf.b", [w]], ["head.w", [w, v]]);
    return out;
  }

  // A model from float32 tensors (name -> Float32Array, layout shapes); a linear weight
  // may instead come pre-quantized as {q: Int8Array [n, k], s: Float32Array [n]} (the kit).
  function buildModel(cfg, tensors, quantized) {
    const p = {};
    for (const [name, shape] of paramLayout(cfg)) {
      const numel = shape.reduce((a, b) => a * b, 1);
      if (LINEAR(name)) {
        const [k, n] = shape;
        const pre = quantized && quantized[name];
        if (pre) {
          if (pre.q.length !== numel || pre.s.length !== n) throw new KitError(`bad ${name}`);
          p[name] = { q: pre.q, s: pre.s, k, n };
        } else {
          const w = tensors[name];
          if (!w || w.length !== numel) throw new KitError(`missing tensor ${name}`);
          p[name] = quantizeCols(w, k, n, name);
        }
      } else {
        const t = tensors[name];
        if (!t || t.length !== numel) throw new KitError(`missing tensor ${name}`);
        p[name] = t;
      }
    }
    return { cfg, p };
  }

  // The float32 logits [vocab] of the last position of `ids` (1 <= length <= seq), as
  // model.forward(cfg, params, ids[None])[0, -1]. Every row is computed the way numpy
  // computes it for this window length; rows past the last one are not needed after the
  // last block's attention (everything after attention is row-wise).
  function forwardLast(model, ids) {
    const { cfg, p } = model;
    const t = ids.length, c = cfg.width, h = cfg.heads, d = c / h;
    if (t < 1 || t > cfg.seq) throw new KitError(`window of ${t} tokens (1..${cfg.seq})`);
    const scale = f32(1.0 / Math.sqrt(d));
    let x = new Float32Array(t * c);
    for (let r = 0; r < t; r++) {
      const id = ids[r];
      if (!(Number.isInteger(id) && id >= 0 && id < cfg.vocab)) throw new KitError(`bad token ${id}`);
      for (let i = 0; i < c; i++) x[r * c + i] = f32(p.wte[id * c + i] + p.wpe[r * c + i]);
    }
    let rows = t; // rows of x still carried (only the last one after the last attention)
    const srow = new Float32Array(t);
    for (let l = 0; l < cfg.layers; l++) {
      const q = `h${l}.`;
      const last = l === cfg.layers - 1;
      const h1 = layernorm(x, t, c, p[q + "ln1.g"], p[q + "ln1.b"], 0);
      const qkv = linear(h1, t, p[q + "attn.w_qkv"], p[q + "attn.b_qkv"]); // [t, 3c]: q|k|v
      const r0 = last ? t - 1 : 0; // query rows needed
      const y = new Float32Array((t - r0) * c);
      const qs = new Float32Array(d);
      for (let hh = 0; hh < h; hh++) {
        const qo = hh * d, ko = c + hh * d, vo = 2 * c + hh * d;
        for (let i = r0; i < t; i++) {
          for (let e = 0; e < d; e++) qs[e] = f32(qkv[i * 3 * c + qo + e] * scale);
          // scores s[j] = qs . k_j (BLAS in numpy; here binary64, rounded once); causal:
          // j > i is -inf, exp(-inf) = 0.
          let mx = -Infinity;
          for (let j = 0; j <= i; j++) {
            let acc = 0;
            const kb = j * 3 * c + ko;
            for (let e = 0; e < d; e++) acc += qs[e] * qkv[kb + e];
            const s = f32(acc);
            srow[j] = s;
            if (s > mx) mx = s;
          }
          for (let j = 0; j <= i; j++) srow[j] = f32(Math.exp(f32(srow[j] - mx)));
          for (let j = i + 1; j < t; j++) srow[j] = 0;
          const total = numpySum(srow, 0, t); // the whole row, masked zeros included
          for (let j = 0; j <= i; j++) srow[j] = f32(srow[j] / total);
          const yo = (i - r0) * c + hh * d;
          for (let e = 0; e < d; e++) {
            let acc = 0;
            for (let j = 0; j <= i; j++) acc += srow[j] * qkv[j * 3 * c + vo + e];
            y[yo + e] = f32(acc);
          }
        }
      }
      if (last && rows !== 1) { x = x.slice((t - 1) * c); rows = 1; }
      const ao = linear(y, rows, p[q + "attn.w_out"], p[q + "attn.b_out"]);
      for (let i = 0; i < x.length; i++) x[i] = f32(x[i] + ao[i]);
      const h2 = layernorm(x, rows, c, p[q + "ln2.g"], p[q + "ln2.b"], 0);
      const u = gelu(linear(h2, rows, p[q + "mlp.w_in"], p[q + "mlp.b_in"]));
      const mo = linear(u, rows, p[q + "mlp.w_out"], p[q + "mlp.b_out"]);
      for (let i = 0; i < x.length; i++) x[i] = f32(x[i] + mo[i]);
    }
    const hf = layernorm(x, rows, c, p["lnf.g"], p["lnf.b"], rows - 1);
    return linear(hf, 1, p["head.w"], null);
  }

  // ------------------------------------------------------------------ sampling
  function mulberry32(seed) {
    let a = seed >>> 0;
    return () => {
      a = (a + 0x6d2b79f5) >>> 0;
      let z = a;
      z = Math.imul(z ^ (z >>> 15), z | 1);
      z ^= z + Math.imul(z ^ (z >>> 7), z | 61);
      return ((z ^ (z >>> 14)) >>> 0) / 4294967296;
    };
  }

  function argmax(logits) {
    let best = 0;
    for (let i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i;
    return best; // the first of equal maxima, as np.argmax
  }

  // As daisyweb-generate's sample_tokens: greedy (temperature 0) is the first maximum of
  // the last position's logits; otherwise softmax(logits / temperature) in binary64 with
  // this kit's own seeded generator (not numpy's stream).
  function pick(logits, temperature, rand) {
    if (!(temperature > 0)) return argmax(logits);
    let mx = -Infinity;
    const z = new Float64Array(logits.length);
    for (let i = 0; i < z.length; i++) { z[i] = logits[i] / temperature; if (z[i] > mx) mx = z[i]; }
    let total = 0;
    for (let i = 0; i < z.length; i++) { z[i] = Math.exp(z[i] - mx); total += z[i]; }
    let u = rand() * total;
    for (let i = 0; i < z.length; i++) { u -= z[i]; if (u < 0) return i; }
    return z.length - 1;
  }

  // Prompt ids as daisyweb-generate: an empty prompt conditions on a newline.
  function promptIds(tok, text) {
    const ids = text ? tok.encode(text) : [];
    return ids.length ? ids : tok.encode("\n");
  }

  // Generate `count` new ids after `prompt`; onToken(id, allNew) after each, awaited so
  // the page can redraw. Returns the new ids.
  async function generate(model, prompt, { count, temperature, seed, onToken }) {
    const ids = prompt.slice();
    const rand = mulberry32(seed || 0);
    const fresh = [];
    for (let n = 0; n < count; n++) {
      const logits = forwardLast(model, ids.slice(-model.cfg.seq));
      const next = pick(logits, temperature, rand);
      ids.push(next);
      fresh.push(next);
      if (onToken) await onToken(next, fresh);
    }
    return fresh;
  }

  // ------------------------------------------------------------------ the prompt box
  // Wires a prompt box to a model: els = {prompt, tokens, temperature, seed, button,
  // output, status}; getEngine() -> {model, tokenizer} or null. The output element gets
  // data-tokens (the new ids, comma-separated) and data-state ("running"/"done"/"error").
  function bindGenerator(els, getEngine) {
    const yieldToPage = () => new Promise((r) => setTimeout(r, 0));
    els.button.addEventListener("click", async () => {
      const engine = getEngine();
      if (!engine) return;
      const count = Number(els.tokens.value);
      const temperature = Number(els.temperature.value);
      const seed = Number(els.seed.value);
      const bad = !(Number.isInteger(count) && count >= 1 && count <= 10000) ? "tokens must be 1..10000"
        : !(temperature >= 0 && temperature <= 100) ? "temperature must be 0..100"
          : !(Number.isInteger(seed) && seed >= 0) ? "seed must be an integer >= 0" : "";
      if (bad) { els.status.textContent = bad; return; }
      const text = els.prompt.value;
      els.button.disabled = true;
      els.output.dataset.state = "running";
      els.output.dataset.tokens = "";
      els.output.textContent = text;
      const started = performance.now();
      try {
        const prompt = promptIds(engine.tokenizer, text);
        const fresh = await generate(engine.model, prompt, {
          count, temperature, seed,
          onToken: async (id, all) => {
            els.output.textContent = text + engine.tokenizer.decode(all);
            els.status.textContent = `${all.length} / ${count} tokens`;
            await yieldToPage();
          },
        });
        els.output.dataset.tokens = fresh.join(",");
        const secs = (performance.now() - started) / 1000;
        els.status.textContent = `${fresh.length} tokens in ${secs.toFixed(1)} s` +
          (temperature > 0 ? ` (temperature ${temperature}, seed ${seed})` : " (greedy)");
        els.output.dataset.state = "done";
      } catch (e) {
        els.status.textContent = "generation failed: " + (e && e.message ? e.message : e);
        els.output.dataset.state = "error";
      } finally {
        els.button.disabled = false;
      }
    });
  }

  root.DaisyKit = {
    KitError, Tokenizer, b64decode, paramLayout, buildModel, quantizeCols, forwardLast,
    generate, promptIds, bindGenerator, numpySum, LINEAR,
  };
})(typeof window !== "undefined" ? window : globalThis);
