// daisyweb dashboard, "Try a checkpoint": the user picks a local .pt file; it is read in
// this page by ptread.js (never uploaded, the server never sees weights) and generates
// with kit.js, the same code the exported kit runs. Only the tokenizer comes from the
// server (/api/tokenizer), and a checkpoint of another tokenizer is refused.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const K = window.DaisyKit;
  let tokenizer = null; // a promise, fetched once on first use
  let engine = null; // {model, tokenizer} of the loaded checkpoint

  const clipName = (s) => {
    const t = String(s).replace(/[\p{Cc}\p{Cf}\p{Cs}\p{Zl}\p{Zp}]/gu, "");
    return t.length > 80 ? t.slice(0, 79) + "…" : t;
  };

  function getTokenizer() {
    tokenizer ||= fetch("/api/tokenizer").then((r) => {
      if (!r.ok) throw new Error(`the server has no tokenizer (HTTP ${r.status})`);
      return r.json();
    }).then((spec) => new K.Tokenizer(spec));
    tokenizer.catch(() => { tokenizer = null; }); // a later pick may try again
    return tokenizer;
  }

  async function load(file) {
    const info = $("try-info"), err = $("try-error"), input = $("try-file");
    engine = null;
    $("try-box").hidden = true;
    err.hidden = true;
    input.dataset.state = "reading";
    info.textContent = `reading ${clipName(file.name)}…`;
    try {
      window.DaisyPt.checkFileSize(file.size); // before reading: the read is the cost
      const tok = await getTokenizer();
      const bytes = new Uint8Array(await file.arrayBuffer());
      const ck = window.DaisyPt.readCheckpoint(bytes, tok);
      const model = K.buildModel(ck.model, ck.tensors);
      engine = { model, tokenizer: tok };
      const m = ck.model;
      info.textContent = `${clipName(file.name)}: GPT width ${m.width}, ${m.layers} layers, ` +
        `${m.heads} heads, context ${m.seq}; step ${ck.step}; weights ` +
        `${ck.weightHash.slice(0, 16)}… (hash checked)`;
      $("try-output").textContent = "";
      $("try-box").hidden = false;
      input.dataset.state = "loaded";
    } catch (e) {
      info.textContent = "";
      err.textContent = `cannot use ${clipName(file.name)}: ${e && e.message ? e.message : e}`;
      err.hidden = false;
      input.dataset.state = "refused";
    }
  }

  $("try-file").addEventListener("change", () => {
    const file = $("try-file").files[0];
    if (file) load(file);
  });
  K.bindGenerator({
    prompt: $("try-prompt"), tokens: $("try-tokens"), temperature: $("try-temperature"),
    seed: $("try-seed"), button: $("try-generate"), output: $("try-output"),
    status: $("try-status"),
  }, () => engine);
})();
