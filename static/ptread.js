// daisyweb checkpoint reader for the browser: a strict reader of exactly the .pt files
// daisyweb writes (daisyweb/checkpoints/ptfile.py save_pt + checkpoint.py), refusing
// anything else with a one-line reason. The file never leaves the page.
//
// What it accepts, and nothing more:
//  - a zip with no comment, no zip64, every entry stored (uncompressed), CRC-32 checked,
//    entries archive/{data.pkl, .format_version, .storage_alignment, byteorder, version,
//    data/0..N-1} with the marker contents daisyweb writes;
//  - a data.pkl of the opcodes daisyweb's encoder emits (protocol 2, dicts, str, int,
//    float, bool, tuples, three globals: torch._utils._rebuild_tensor_v2,
//    torch.FloatStorage, collections.OrderedDict); no memo, no lists, no other global;
//    within a budget of memory, container sizes and nesting depth (see unpickle);
//  - tensors: float32, offset 0, C-contiguous, each its own whole storage, each storage
//    used once;
//  - the checkpoint rules of daisyweb/checkpoints/checkpoint.py: magic, format version,
//    exact key set, model config bounds (daisyweb/rules.py), the page's tokenizer,
//    tensor shapes, finite weights, Adam state shape and step, and the weight hash
//    (BLAKE2b-256 over weights and optimizer state, daisyweb/optim.py weight_hash).
"use strict";

(function (root) {
  class CheckpointRefused extends Error {}
  const refuse = (msg) => new CheckpointRefused(msg);

  const MAX_FILE_BYTES = 1 << 30; // what a browser tab can hold twice over
  const MAX_PICKLE_BYTES = 16 << 20; // ptfile.MAX_PICKLE_BYTES
  // The pickle's budget, as daisyweb/checkpoints/unpickle.py's: what the objects it
  // builds may cost (bytes, estimated for V8): MEMORY_PER_PICKLE_BYTE per pickle byte
  // plus a floor, capped. The largest model the rules admit (1024 layers, 12,295
  // tensors) pickles to 1.9 MB and costs 15 MB here (8 a pickle byte); a one-byte opcode
  // that builds a dict costs 136, so a 16 MB pickle of them stops after 0.25 M dicts.
  const MEMORY_PER_PICKLE_BYTE = 16;
  const MEMORY_FLOOR = 1 << 20;
  const MAX_PICKLE_MEMORY = 32 << 20;
  const MAX_DEPTH = 64; // ptfile._MAX_DEPTH: nesting of dicts and tuples
  const MAX_DICT_ENTRIES = 1 << 14; // the largest checkpoint's top dict has 12,301 keys
  const MAX_TUPLE_ITEMS = 32; // ptfile._MAX_NDIM; a checkpoint's tuples hold 0-6 items
  const MAX_DIM = 2 ** 31; // rules.MAX_DIM
  const MAX_LAYERS = 1024; // rules.MAX_LAYERS
  const MAX_PARAMS = 2 ** 27; // rules.MAX_PARAMS
  const MAGIC = "daisyweb-checkpoint";
  const META_KEYS = ["magic", "format_version", "model", "tokenizer", "step", "weight_hash",
    "run", "adam"];
  const MODEL_FIELDS = ["vocab", "width", "layers", "heads", "seq"];
  const ADAM_KEYS = ["config", "size", "step", "beta1_power", "beta2_power", "m", "v"];
  const HASH_MAGIC = "daisyweb-weight-hash-v1\0";

  // ------------------------------------------------------------------ CRC-32 (zip)
  const CRC_TABLE = (() => {
    const t = new Uint32Array(256);
    for (let n = 0; n < 256; n++) {
      let c = n;
      for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
      t[n] = c >>> 0;
    }
    return t;
  })();

  function crc32(bytes) {
    let c = 0xffffffff;
    for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
    return (c ^ 0xffffffff) >>> 0;
  }

  // ------------------------------------------------------------------ BLAKE2b-256
  // RFC 7693 with 64-bit words as pairs of 32-bit halves (low, high).
  const IV = new Uint32Array([0xf3bcc908, 0x6a09e667, 0x84caa73b, 0xbb67ae85, 0xfe94f82b,
    0x3c6ef372, 0x5f1d36f1, 0xa54ff53a, 0xade682d1, 0x510e527f, 0x2b3e6c1f, 0x9b05688c,
    0xfb41bd6b, 0x1f83d9ab, 0x137e2179, 0x5be0cd19]);
  const SIGMA = [
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
    14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3,
    11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4,
    7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8,
    9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13,
    2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9,
    12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11,
    13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10,
    6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5,
    10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0,
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
    14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3].map((x) => x * 2);

  class Blake2b256 {
    constructor() {
      this.h = new Uint32Array(IV);
      this.h[0] ^= 0x01010000 ^ 32; // no key, 32-byte digest
      this.b = new Uint8Array(128);
      this.c = 0;
      this.t = 0;
      this.v = new Uint32Array(32);
      this.m = new Uint32Array(32);
    }

    add(a, b) { // v[a] += v[b] (64-bit)
      const v = this.v;
      const lo = v[a] + v[b];
      v[a + 1] = v[a + 1] + v[b + 1] + (lo >= 0x100000000 ? 1 : 0);
      v[a] = lo;
    }

    addm(a, i) { // v[a] += m[i] (64-bit)
      const v = this.v, m = this.m;
      const lo = v[a] + m[i];
      v[a + 1] = v[a + 1] + m[i + 1] + (lo >= 0x100000000 ? 1 : 0);
      v[a] = lo;
    }

    g(a, b, c, d, x, y) {
      const v = this.v;
      this.add(a, b); this.addm(a, x);
      let lo = v[d] ^ v[a], hi = v[d + 1] ^ v[a + 1];
      v[d] = hi; v[d + 1] = lo; // rotr 32
      this.add(c, d);
      lo = v[b] ^ v[c]; hi = v[b + 1] ^ v[c + 1];
      v[b] = (lo >>> 24) ^ (hi << 8); v[b + 1] = (hi >>> 24) ^ (lo << 8); // rotr 24
      this.add(a, b); this.addm(a, y);
      lo = v[d] ^ v[a]; hi = v[d + 1] ^ v[a + 1];
      v[d] = (lo >>> 16) ^ (hi << 16); v[d + 1] = (hi >>> 16) ^ (lo << 16); // rotr 16
      this.add(c, d);
      lo = v[b] ^ v[c]; hi = v[b + 1] ^ v[c + 1];
      v[b] = (hi >>> 31) ^ (lo << 1); v[b + 1] = (lo >>> 31) ^ (hi << 1); // rotr 63
    }

    compress(last) {
      const v = this.v, m = this.m, h = this.h, bb = this.b;
      for (let i = 0; i < 16; i++) { v[i] = h[i]; v[i + 16] = IV[i]; }
      v[24] ^= this.t % 0x100000000;
      v[25] ^= Math.floor(this.t / 0x100000000);
      if (last) { v[28] = ~v[28]; v[29] = ~v[29]; }
      for (let i = 0; i < 32; i++) {
        m[i] = bb[4 * i] | (bb[4 * i + 1] << 8) | (bb[4 * i + 2] << 16) | (bb[4 * i + 3] << 24);
      }
      for (let r = 0; r < 12; r++) {
        const s = r * 16;
        this.g(0, 8, 16, 24, SIGMA[s], SIGMA[s + 1]);
        this.g(2, 10, 18, 26, SIGMA[s + 2], SIGMA[s + 3]);
        this.g(4, 12, 20, 28, SIGMA[s + 4], SIGMA[s + 5]);
        this.g(6, 14, 22, 30, SIGMA[s + 6], SIGMA[s + 7]);
        this.g(0, 10, 20, 30, SIGMA[s + 8], SIGMA[s + 9]);
        this.g(2, 12, 22, 24, SIGMA[s + 10], SIGMA[s + 11]);
        this.g(4, 14, 16, 26, SIGMA[s + 12], SIGMA[s + 13]);
        this.g(6, 8, 18, 28, SIGMA[s + 14], SIGMA[s + 15]);
      }
      for (let i = 0; i < 16; i++) h[i] ^= v[i] ^ v[i + 16];
    }

    update(bytes) {
      for (let i = 0; i < bytes.length; i++) {
        if (this.c === 128) { this.t += 128; this.compress(false); this.c = 0; }
        this.b[this.c++] = bytes[i];
      }
      return this;
    }

    hex() {
      this.t += this.c;
      this.b.fill(0, this.c);
      this.compress(true);
      let out = "";
      for (let i = 0; i < 32; i++) {
        out += ((this.h[i >> 2] >>> (8 * (i & 3))) & 0xff).toString(16).padStart(2, "0");
      }
      return out;
    }
  }

  // ------------------------------------------------------------------ zip
  function u16(b, o) { return b[o] | (b[o + 1] << 8); }
  function u32(b, o) { return (b[o] | (b[o + 1] << 8) | (b[o + 2] << 16) | (b[o + 3] << 24)) >>> 0; }

  function readZip(bytes) {
    const n = bytes.length;
    const eocd = n - 22; // daisyweb writes no archive comment
    if (n < 22 || u32(bytes, eocd) !== 0x06054b50) {
      throw refuse("not a .pt checkpoint (no zip directory at the end of the file)");
    }
    const count = u16(bytes, eocd + 10), cdSize = u32(bytes, eocd + 12);
    const cdOff = u32(bytes, eocd + 16);
    if (u16(bytes, eocd + 4) !== 0 || u16(bytes, eocd + 6) !== 0 ||
      u16(bytes, eocd + 8) !== count || u16(bytes, eocd + 20) !== 0) {
      throw refuse("unsupported zip layout (split archive or comment)");
    }
    if (count === 0xffff || cdOff === 0xffffffff || cdOff + cdSize !== eocd) {
      throw refuse("unsupported zip layout (zip64 or a gap before the directory)");
    }
    const entries = new Map();
    let p = cdOff;
    for (let i = 0; i < count; i++) {
      if (p + 46 > eocd || u32(bytes, p) !== 0x02014b50) throw refuse("damaged zip directory");
      const flags = u16(bytes, p + 8), method = u16(bytes, p + 10), crc = u32(bytes, p + 16);
      const csize = u32(bytes, p + 20), usize = u32(bytes, p + 24);
      const nlen = u16(bytes, p + 28), xlen = u16(bytes, p + 30), clen = u16(bytes, p + 32);
      const local = u32(bytes, p + 42);
      const name = new TextDecoder().decode(bytes.subarray(p + 46, p + 46 + nlen));
      p += 46 + nlen + xlen + clen;
      if (p > eocd) throw refuse("damaged zip directory");
      if (method !== 0) throw refuse(`entry ${name} is compressed (daisyweb stores entries)`);
      if ((flags & ~0x800) !== 0) throw refuse(`entry ${name} is encrypted or streamed`);
      if (csize !== usize) throw refuse(`entry ${name} has inconsistent sizes`);
      if (entries.has(name)) throw refuse(`entry ${name} appears twice`);
      if (local + 30 > cdOff || u32(bytes, local) !== 0x04034b50) {
        throw refuse(`entry ${name} has no local header`);
      }
      const lnlen = u16(bytes, local + 26), lxlen = u16(bytes, local + 28);
      const lname = new TextDecoder().decode(bytes.subarray(local + 30, local + 30 + lnlen));
      if (lname !== name || u16(bytes, local + 8) !== 0) throw refuse(`entry ${name} is damaged`);
      const start = local + 30 + lnlen + lxlen;
      if (start + usize > cdOff) throw refuse(`entry ${name} runs past the archive`);
      entries.set(name, { start, size: usize, crc, local });
    }
    if (p !== eocd) throw refuse("damaged zip directory");
    // entries may not share bytes (each a whole, separate range)
    const sorted = [...entries.values()].sort((a, b) => a.local - b.local);
    for (let i = 1; i < sorted.length; i++) {
      if (sorted[i].local < sorted[i - 1].start + sorted[i - 1].size) {
        throw refuse("zip entries overlap");
      }
    }
    return {
      names: [...entries.keys()],
      has: (name) => entries.has(name),
      read(name) {
        const e = entries.get(name);
        if (!e) throw refuse(`missing entry ${name}`);
        const data = bytes.subarray(e.start, e.start + e.size);
        if (crc32(data) !== e.crc) throw refuse(`entry ${name} fails its CRC check (damaged file)`);
        return data;
      },
    };
  }

  // ------------------------------------------------------------------ pickle
  class Tuple { constructor(items) { this.items = items; this.depth = 1; } }
  class Global { constructor(name) { this.name = name; } }
  class Storage { constructor(key, numel) { this.key = key; this.numel = numel; } }
  class Tensor { constructor(key, shape) { this.key = key; this.shape = shape; } }
  const EMPTY_ORDERED = Object.freeze({ orderedDict: true });
  const GLOBALS = new Set(["torch._utils._rebuild_tensor_v2", "torch.FloatStorage",
    "collections.OrderedDict"]);

  // What the machine charges (bytes, V8 estimates): a reference on the stack or in a
  // container, and each kind of object it creates.
  const COST = { ref: 8, map: 128, entry: 32, tuple: 48, string: 24, number: 16, object: 48 };

  function pickleBudget(n) {
    return Math.min(MAX_PICKLE_MEMORY, MEMORY_PER_PICKLE_BYTE * n + MEMORY_FLOOR);
  }

  function unpickle(b) {
    const stack = [], marks = [];
    const dec = new TextDecoder("utf-8");
    const depths = new WeakMap(); // dict -> its nesting depth (1 + its deepest value's)
    const budget = pickleBudget(b.length);
    let left = budget;
    let p = 0, at = 0; // the next byte, and where the current opcode starts
    const need = (n) => { if (p + n > b.length) throw refuse("data.pkl is truncated"); };
    // Every push, mark and entry is charged before it exists, so a pickle of 16 M
    // one-byte EMPTY_DICTs is refused after a few MB instead of building 16 M Maps.
    const charge = (n) => {
      left -= n;
      if (left < 0) {
        throw refuse(`data.pkl builds more objects than its budget of ${budget} bytes ` +
          `(at byte ${at}); a checkpoint never needs that many`);
      }
    };
    const push = (v, cost = 0) => { charge(COST.ref + cost); stack.push(v); };
    const depthOf = (v) => (v instanceof Tuple ? v.depth : v instanceof Map ? depths.get(v) : 0);
    const deeper = (d) => {
      if (d > MAX_DEPTH) throw refuse(`data.pkl nests more than ${MAX_DEPTH} deep (at byte ${at})`);
      return d;
    };
    const popMark = () => {
      if (!marks.length) throw refuse("data.pkl: unbalanced mark");
      const start = marks.pop();
      charge(COST.ref * (stack.length - start)); // the slice is a second list of them
      return stack.splice(start);
    };
    const pop = () => {
      if (stack.length <= (marks.length ? marks[marks.length - 1] : 0)) {
        throw refuse("data.pkl: stack underflow");
      }
      return stack.pop();
    };
    const line = () => {
      const end = b.indexOf(10, p);
      if (end < 0 || end - p > 64) throw refuse("data.pkl: bad global");
      const s = dec.decode(b.subarray(p, end));
      p = end + 1;
      return s;
    };
    need(2);
    if (b[0] !== 0x80 || b[1] !== 2) throw refuse("data.pkl is not a protocol 2 pickle");
    p = 2;
    for (;;) {
      need(1);
      at = p;
      const op = b[p++];
      switch (op) {
        case 0x7d: { // EMPTY_DICT
          const d = new Map();
          push(d, COST.map);
          depths.set(d, 1);
          break;
        }
        case 0x28: charge(COST.ref); marks.push(stack.length); break; // MARK
        case 0x75: { // SETITEMS
          const items = popMark();
          const d = stack[stack.length - 1];
          if (!(d instanceof Map) || items.length % 2) throw refuse("data.pkl: bad SETITEMS");
          if (d.size + items.length / 2 > MAX_DICT_ENTRIES) {
            throw refuse(`data.pkl: a dict of more than ${MAX_DICT_ENTRIES} entries (at byte ${at})`);
          }
          let depth = depths.get(d);
          for (let i = 0; i < items.length; i += 2) {
            if (typeof items[i] !== "string") throw refuse("data.pkl: a dict key is not a string");
            if (d.has(items[i])) throw refuse(`data.pkl: key ${items[i].slice(0, 40)} repeats`);
            charge(COST.entry);
            depth = Math.max(depth, deeper(1 + depthOf(items[i + 1])));
            d.set(items[i], items[i + 1]);
          }
          depths.set(d, depth);
          break;
        }
        case 0x58: { // BINUNICODE
          need(4);
          const n = u32(b, p); p += 4;
          need(n);
          charge(COST.string + 2 * n); // two bytes a character at worst
          push(dec.decode(b.subarray(p, p + n))); p += n;
          break;
        }
        case 0x4b: need(1); push(b[p++]); break; // BININT1
        case 0x4a: need(4); push(u32(b, p) | 0, COST.number); p += 4; break; // BININT
        case 0x8a: { // LONG1: little-endian two's complement
          need(1);
          const n = b[p++];
          need(n);
          charge(COST.number + n);
          let v = 0n;
          for (let i = n - 1; i >= 0; i--) v = (v << 8n) | BigInt(b[p + i]);
          if (n && b[p + n - 1] & 0x80) v -= 1n << BigInt(8 * n);
          p += n;
          push(v);
          break;
        }
        case 0x47: need(8); push(new DataView(b.buffer, b.byteOffset + p, 8).getFloat64(0, false), COST.number); p += 8; break; // BINFLOAT
        case 0x88: push(true); break; // NEWTRUE
        case 0x89: push(false); break; // NEWFALSE
        case 0x63: { // GLOBAL
          const name = line() + "." + line();
          if (!GLOBALS.has(name)) {
            throw refuse(`data.pkl names ${name.slice(0, 80)}, which a checkpoint never needs ` +
              "(it could run code); refusing");
          }
          push(new Global(name), COST.object + COST.string + 2 * name.length);
          break;
        }
        case 0x74: { // TUPLE
          const items = popMark();
          if (items.length > MAX_TUPLE_ITEMS) {
            throw refuse(`data.pkl: a tuple of more than ${MAX_TUPLE_ITEMS} items (at byte ${at})`);
          }
          const t = new Tuple(items);
          t.depth = deeper(1 + items.reduce((d, v) => Math.max(d, depthOf(v)), 0));
          push(t, COST.tuple);
          break;
        }
        case 0x29: push(new Tuple([]), COST.tuple); break; // EMPTY_TUPLE
        case 0x51: { // BINPERSID: ('storage', FloatStorage, key, 'cpu', numel)
          const pid = pop();
          const it = pid instanceof Tuple ? pid.items : [];
          if (it.length !== 5 || it[0] !== "storage" || !(it[1] instanceof Global) ||
            it[1].name !== "torch.FloatStorage" || typeof it[2] !== "string" || it[3] !== "cpu" ||
            !Number.isInteger(it[4]) || it[4] < 0) {
            throw refuse("data.pkl: a storage that is not float32");
          }
          push(new Storage(it[2], it[4]), COST.object);
          break;
        }
        case 0x52: { // REDUCE
          const args = pop(), fn = pop();
          if (!(fn instanceof Global) || !(args instanceof Tuple)) throw refuse("data.pkl: bad call");
          if (fn.name === "collections.OrderedDict" && args.items.length === 0) {
            push(EMPTY_ORDERED);
          } else if (fn.name === "torch._utils._rebuild_tensor_v2") {
            push(rebuild(args.items), COST.object);
          } else {
            throw refuse(`data.pkl: refusing call of ${fn.name}`);
          }
          break;
        }
        case 0x2e: // STOP
          if (p !== b.length || marks.length || stack.length !== 1) {
            throw refuse("data.pkl has data after its end or an unbalanced stack");
          }
          return stack[0];
        default:
          throw refuse(`data.pkl uses pickle opcode 0x${op.toString(16)}, which daisyweb ` +
            "never writes; refusing");
      }
    }
  }

  // torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict()) with
  // a C-contiguous stride over the whole storage: what ptfile's encoder writes.
  function rebuild(args) {
    const [storage, offset, size, stride, grad, hooks] = args;
    if (args.length !== 6 || !(storage instanceof Storage) || offset !== 0 ||
      !(size instanceof Tuple) || !(stride instanceof Tuple) || grad !== false ||
      hooks !== EMPTY_ORDERED) {
      throw refuse("data.pkl: a tensor daisyweb would not write");
    }
    const shape = size.items;
    if (shape.length > 2 || !shape.every((x) => Number.isInteger(x) && x >= 0)) {
      throw refuse("data.pkl: a tensor of unexpected shape");
    }
    let expect = 1;
    const want = [];
    for (let i = shape.length - 1; i >= 0; i--) { want.unshift(expect); expect *= shape[i]; }
    if (expect === 0) throw refuse("data.pkl: an empty tensor");
    if (stride.items.length !== want.length || stride.items.some((s, i) => s !== want[i]) ||
      storage.numel !== expect) {
      throw refuse("data.pkl: a tensor that is not one whole C-contiguous storage");
    }
    return new Tensor(storage.key, shape);
  }

  // ------------------------------------------------------------------ the checkpoint
  const isInt = (x) => Number.isInteger(x) || typeof x === "bigint";
  const short = (x) => JSON.stringify(typeof x === "bigint" ? String(x) : x ?? null)?.slice(0, 60);

  function keysExactly(map, keys, what) {
    if (!(map instanceof Map)) throw refuse(`${what} is not a dict`);
    const want = new Set(keys); // linear: the top dict may have 12 K keys
    const extra = [...map.keys()].filter((k) => !want.has(k));
    const missing = keys.filter((k) => !map.has(k));
    const list = (ks) => ks.slice(0, 5).map((k) => k.slice(0, 40)).join(", ");
    if (missing.length) throw refuse(`${what} is missing ${list(missing)}`);
    if (extra.length) throw refuse(`${what} has unexpected entries ${list(extra)}`);
  }

  function checkModel(m) {
    keysExactly(m, MODEL_FIELDS, "the model config");
    const cfg = {};
    for (const k of MODEL_FIELDS) {
      const v = m.get(k);
      if (!Number.isInteger(v) || v < 1 || v > MAX_DIM) {
        throw refuse(`model ${k} must be a positive integer, got ${short(v)}`);
      }
      cfg[k] = v;
    }
    if (cfg.width % cfg.heads) throw refuse(`width ${cfg.width} is not divisible by heads ${cfg.heads}`);
    if (cfg.layers > MAX_LAYERS) throw refuse(`model layers must be at most ${MAX_LAYERS}`);
    const w = cfg.width;
    const total = 2 * cfg.vocab * w + cfg.seq * w + cfg.layers * (12 * w * w + 13 * w) + 2 * w;
    if (total > MAX_PARAMS) throw refuse(`model has ${total} parameters, more than ${MAX_PARAMS}`);
    return { cfg, total };
  }

  function u64le(v) {
    const b = new Uint8Array(8);
    new DataView(b.buffer).setBigUint64(0, BigInt(v), true);
    return b;
  }

  function f64le(v) {
    const b = new Uint8Array(8);
    new DataView(b.buffer).setFloat64(0, v, true);
    return b;
  }

  // A caller holding a File checks its size before reading it: the read itself is what
  // a 1.2 GB pick would cost.
  function checkFileSize(n) {
    if (n > MAX_FILE_BYTES) throw refuse(`file is larger than ${MAX_FILE_BYTES} bytes (${n})`);
  }

  // bytes: the whole file; tokenizer: {vocabSize, fileHash} of this page.
  // Returns {model, step, weightHash, run, tensors: name -> Float32Array}.
  function readCheckpoint(bytes, tokenizer) {
    if (new Uint8Array(new Uint16Array([1]).buffer)[0] !== 1) {
      throw refuse("this browser is big-endian; the reader needs little-endian floats");
    }
    checkFileSize(bytes.length);
    const zip = readZip(bytes);
    const A = "archive/";
    const text = (name) => new TextDecoder().decode(zip.read(A + name));
    if (!zip.names.every((n) => n.startsWith(A))) {
      throw refuse("not a daisyweb checkpoint (its entries are not under archive/)");
    }
    for (const [name, want] of [["version", "3\n"], ["byteorder", "little"],
      [".format_version", "1"], [".storage_alignment", "64"]]) {
      if (!zip.has(A + name)) throw refuse(`not a daisyweb checkpoint (no ${name} entry)`);
      if (text(name) !== want) throw refuse(`unsupported ${name} entry`);
    }
    if (!zip.has(A + "data.pkl")) throw refuse("not a daisyweb checkpoint (no data.pkl)");
    const pkl = zip.read(A + "data.pkl");
    if (pkl.length > MAX_PICKLE_BYTES) throw refuse("data.pkl is too large for a checkpoint");
    const tree = unpickle(pkl);
    if (!(tree instanceof Map)) throw refuse("the file does not hold a checkpoint dict");

    // checkpoint_from_tree's order: magic, version, keys, model, tokenizer, ...
    if (tree.get("magic") !== MAGIC) {
      throw refuse(`not a daisyweb checkpoint: magic ${short(tree.get("magic"))}`);
    }
    if (tree.get("format_version") !== 1) {
      throw refuse(`unsupported checkpoint format version ${short(tree.get("format_version"))}`);
    }
    const missing = META_KEYS.filter((k) => !tree.has(k));
    if (missing.length) throw refuse(`checkpoint is missing ${missing.join(", ")}`);
    const { cfg, total } = checkModel(tree.get("model"));
    const tok = tree.get("tokenizer");
    keysExactly(tok, ["vocab_size", "file_hash"], "the tokenizer entry");
    if (tok.get("vocab_size") !== tokenizer.vocabSize || tok.get("file_hash") !== tokenizer.fileHash) {
      throw refuse(`checkpoint was trained with tokenizer ${short(tok.get("vocab_size"))}/` +
        `${String(tok.get("file_hash")).slice(0, 12)}, this page has ${tokenizer.vocabSize}/` +
        `${tokenizer.fileHash.slice(0, 12)}`);
    }
    if (tok.get("vocab_size") > cfg.vocab) throw refuse("tokenizer is larger than the model's vocab");
    const step = tree.get("step");
    if (!isInt(step) || step < 0) throw refuse(`step ${short(step)} is not a non-negative int`);
    const stored = tree.get("weight_hash");
    if (typeof stored !== "string" || !/^[0-9a-f]{1,256}$/.test(stored)) {
      throw refuse("weight_hash is not a lowercase hex digest");
    }
    const run = tree.get("run");
    if (!(run instanceof Map)) throw refuse("run metadata is not a dict");
    for (const v of run.values()) {
      if (!["string", "number", "boolean", "bigint"].includes(typeof v)) {
        throw refuse("run metadata holds a value that is not str/int/float/bool");
      }
    }
    const layout = root.DaisyKit.paramLayout(cfg);
    const names = layout.map(([n]) => "params." + n);
    keysExactly(tree, [...META_KEYS, ...names], "the checkpoint");
    const adam = tree.get("adam");
    keysExactly(adam, ADAM_KEYS, "the adam state");
    if (adam.get("size") !== total) throw refuse(`adam state size ${short(adam.get("size"))} != ${total}`);
    if (adam.get("step") !== step) throw refuse("adam state step differs from the checkpoint's");
    for (const k of ["beta1_power", "beta2_power"]) {
      if (typeof adam.get(k) !== "number" || !Number.isFinite(adam.get(k))) {
        throw refuse(`adam state ${k} is not a number`);
      }
    }

    // storages: each data/<key> entry used by exactly one tensor, none left over
    const used = new Set();
    const data = (t, what, shape) => {
      if (!(t instanceof Tensor) || t.shape.length !== shape.length ||
        t.shape.some((x, i) => x !== shape[i])) {
        throw refuse(`tensor ${what} is not float32 [${shape.join(", ")}] as the config needs`);
      }
      if (used.has(t.key)) throw refuse(`storage ${t.key.slice(0, 20)} is used twice`);
      used.add(t.key);
      const raw = zip.read(A + "data/" + t.key);
      const n = shape.reduce((a, b) => a * b, 1);
      if (raw.length !== 4 * n) throw refuse(`storage of ${what} has ${raw.length} bytes, expected ${4 * n}`);
      return { raw, values: new Float32Array(raw.slice().buffer) };
    };
    const tensors = {};
    const h = new Blake2b256();
    h.update(new TextEncoder().encode(HASH_MAGIC)).update(u64le(total));
    for (const [name, shape] of layout) {
      const { raw, values } = data(tree.get("params." + name), "params." + name, shape);
      for (let i = 0; i < values.length; i++) {
        if (!Number.isFinite(values[i])) {
          throw refuse(`params.${name} holds NaN/Inf (training diverged before this state)`);
        }
      }
      tensors[name] = values;
      h.update(raw);
    }
    for (const k of ["m", "v"]) h.update(data(adam.get(k), "adam " + k, [total]).raw);
    const storages = zip.names.filter((n) => n.startsWith(A + "data/"));
    if (storages.length !== used.size) throw refuse("the archive holds storages no tensor uses");
    h.update(u64le(step)).update(f64le(adam.get("beta1_power"))).update(f64le(adam.get("beta2_power")));
    const actual = h.hex();
    if (actual !== stored) {
      throw refuse(`weight hash mismatch: contents hash to ${actual.slice(0, 16)}..., the file ` +
        `records ${stored.slice(0, 16)}... (altered or damaged)`);
    }
    const known = new Set([...zip.names].filter((n) => !n.startsWith(A + "data/")));
    for (const n of known) {
      if (![A + "data.pkl", A + "version", A + "byteorder", A + ".format_version",
        A + ".storage_alignment"].includes(n)) {
        throw refuse(`unexpected archive entry ${n.slice(0, 60)}`);
      }
    }
    return { model: cfg, step: Number(step), weightHash: actual, run, tensors };
  }

  root.DaisyPt = { CheckpointRefused, readCheckpoint, checkFileSize, Blake2b256, crc32 };
})(typeof window !== "undefined" ? window : globalThis);
