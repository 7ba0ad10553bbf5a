"""Assemble the offline inference kit: one HTML file, no network, no outside files.

The file holds:

* the tokenizer (merges, identity, and its character classes from ``tables``);
* the model: every linear weight as its int8 column quantization (``kernels.quantize_cols``,
  exactly what every forward computes from the float weights, stored transposed [n, k])
  with its float32 column scales, everything else (embeddings, LayerNorm, biases) as
  float32; all in one base64 blob inside a ``<script type="application/json">``;
* ``static/kit.js`` (the forward, shared with the dashboard) and a small boot script,
  inline, allowed by hash in a Content-Security-Policy of ``default-src 'none'``, so the
  page cannot load or send anything even if it tried.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np

import kernels
from daisyweb.checkpoints.checkpoint import Checkpoint
from daisyweb.data.tokenizer import Tokenizer
from daisyweb.kit.tables import tokenizer_spec
from daisyweb.model import param_layout, views

__all__ = ["KIT_FORMAT", "build_kit", "is_linear", "kit_js"]

KIT_FORMAT = "daisyweb-kit"
KIT_VERSION = 1
_LINEAR_LEAVES = ("attn.w_qkv", "attn.w_out", "mlp.w_in", "mlp.w_out")


def is_linear(name: str) -> bool:
    """Whether ``name`` is a weight the forward runs through ``kernels.int8_matmul``."""
    return name == "head.w" or (name.startswith("h") and name.split(".", 1)[-1] in _LINEAR_LEAVES)


def static_file(name: str) -> Path:
    """A file of the dashboard's directory: ``signaling/static`` when installed from a
    wheel, else the source tree's top-level ``static/`` (as ``signaling.server`` finds it)."""
    spec = importlib.util.find_spec("signaling")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for root in roots:
        for cand in (root / "static" / name, root.parent / "static" / name):
            if cand.is_file():
                return cand
    raise FileNotFoundError(f"static/{name} is missing from this installation")


def kit_js() -> str:
    """The shared JavaScript engine (static/kit.js)."""
    return static_file("kit.js").read_text(encoding="utf-8")


def _payload(ckpt: Checkpoint, tok: Tokenizer) -> dict[str, Any]:
    """The kit's data: header plus one base64 blob of 4-byte-aligned tensors."""
    cfg = ckpt.model
    named = views(cfg, ckpt.params)
    parts: list[bytes] = []
    tensors: list[dict[str, Any]] = []
    offset = 0

    def add(name: str, kind: str, arr: np.ndarray) -> None:
        nonlocal offset
        raw = arr.tobytes()
        tensors.append({"name": name, "kind": kind, "offset": offset, "length": int(arr.size)})
        pad = (-len(raw)) % 4  # Float32Array views need 4-byte offsets
        parts.append(raw + b"\0" * pad)
        offset += len(raw) + pad

    for name, _shape in param_layout(cfg):
        w = named[name]
        if is_linear(name):
            q, s = kernels.quantize_cols(np.ascontiguousarray(w))
            add(name, "i8t", np.ascontiguousarray(q.T))  # [n, k]: the GEMM's inner axis last
            add(name + "#scale", "f32", s.astype("<f4"))
        else:
            add(name, "f32", np.ascontiguousarray(w, dtype="<f4"))
    return {
        "format": KIT_FORMAT, "version": KIT_VERSION, "model": cfg.to_dict(),
        "step": ckpt.step, "weight_hash": ckpt.weight_hash, "tokenizer": tokenizer_spec(tok),
        "tensors": tensors, "blob": base64.b64encode(b"".join(parts)).decode("ascii"),
    }


_BOOT = """\
"use strict";
(function () {
  const K = window.DaisyKit;
  const $ = (id) => document.getElementById(id);
  try {
    const data = JSON.parse($("kit-data").textContent);
    if (data.format !== "daisyweb-kit" || data.version !== 1) throw new Error("not a kit");
    const blob = K.b64decode(data.blob);
    const f32 = {}, pre = {};
    for (const t of data.tensors) {
      if (t.kind === "f32") f32[t.name] = new Float32Array(blob.buffer, t.offset, t.length);
      else pre[t.name] = { q: new Int8Array(blob.buffer, t.offset, t.length) };
    }
    for (const name of Object.keys(pre)) pre[name].s = f32[name + "#scale"];
    const tokenizer = new K.Tokenizer(data.tokenizer);
    const model = K.buildModel(data.model, f32, pre);
    const m = data.model;
    $("info").textContent = `GPT: width ${m.width}, ${m.layers} layers, ${m.heads} heads, ` +
      `context ${m.seq}, vocab ${m.vocab}; step ${data.step}; weights ` +
      data.weight_hash.slice(0, 16) + "\\u2026";
    window.kit = { model, tokenizer, data: { model: data.model, step: data.step } };
    K.bindGenerator({ prompt: $("prompt"), tokens: $("tokens"), temperature: $("temperature"),
      seed: $("seed"), button: $("generate"), output: $("output"), status: $("status") },
    () => window.kit);
    $("generate").disabled = false;
    document.body.dataset.ready = "1";
  } catch (e) {
    $("status").textContent = "this kit cannot start: " + (e && e.message ? e.message : e);
    document.body.dataset.ready = "error";
  }
})();
"""

_STYLE = """\
body { font: 15px/1.45 system-ui, sans-serif; margin: 0; background: #fafafa; color: #222; }
main { max-width: 760px; margin: 2em auto; padding: 0 1em; }
h1 { font-size: 1.4em; margin-bottom: .2em; }
#info, #status { color: #555; font-size: .9em; }
textarea { width: 100%; box-sizing: border-box; font: inherit; padding: .4em; }
.row { display: flex; flex-wrap: wrap; gap: .8em; align-items: center; margin: .6em 0; }
.row input { width: 6em; }
button { font: inherit; padding: .3em 1.2em; }
#output { white-space: pre-wrap; background: #fff; border: 1px solid #ddd; padding: .8em;
  min-height: 4em; font: 14px/1.5 ui-monospace, monospace; }
"""


def _csp_hash(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


def _inline_json(obj: Any) -> str:
    # Inside <script> only "</" could end the element early; JSON allows "<\/".
    return json.dumps(obj, separators=(",", ":")).replace("</", "<\\/")


def build_kit(ckpt: Checkpoint, tok: Tokenizer, *, prompt: str = "And God said") -> str:
    """The kit's HTML text for a loaded (validated) checkpoint and its tokenizer."""
    if (ckpt.tokenizer.vocab_size, ckpt.tokenizer.file_hash) != (tok.vocab_size, tok.file_hash):
        raise ValueError("the checkpoint was trained with another tokenizer")
    js = kit_js()
    if "</script" in js.lower():  # it is inlined: that text would end the element early
        raise ValueError("static/kit.js contains '</script' and cannot be inlined")
    csp = (f"default-src 'none'; script-src {_csp_hash(js)} {_csp_hash(_BOOT)}; "
           f"style-src {_csp_hash(_STYLE)}")
    data = _inline_json(_payload(ckpt, tok))
    esc = prompt.replace("&", "&amp;").replace("<", "&lt;")
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>daisyweb kit</title>
<style>{_STYLE}</style>
</head>
<body>
<main>
<h1>daisyweb kit</h1>
<p id="info">loading&hellip;</p>
<label for="prompt">Prompt</label>
<textarea id="prompt" rows="4">{esc}</textarea>
<div class="row">
  <label>tokens <input id="tokens" type="number" value="60" min="1" max="10000"></label>
  <label>temperature <input id="temperature" type="number" value="0" min="0" max="100"
    step="0.1"></label>
  <label>seed <input id="seed" type="number" value="0" min="0" step="1"></label>
  <button id="generate" disabled>Generate</button>
</div>
<p id="status">Temperature 0 is greedy: the same text as daisyweb-generate --temperature 0.
Runs offline; nothing leaves this page.</p>
<pre id="output"></pre>
</main>
<script id="kit-data" type="application/json">{data}</script>
<script>{js}</script>
<script>{_BOOT}</script>
</body>
</html>
"""
