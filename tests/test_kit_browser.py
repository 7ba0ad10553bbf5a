"""The inference kit and the dashboard's "try a checkpoint" in headless Chromium (Debian's).

The kit is opened from file:// with the browser offline and must reproduce
daisyweb-generate --temperature 0 token for token; the dashboard reads a checkpoint from
disk through its file chooser (nothing uploaded) and generates the same tokens; bad files
are refused with their reason, each by the guard that names it.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from playwright.async_api import Page, async_playwright

from daisyweb.checkpoints.checkpoint import (
    TokenizerInfo,
    checkpoint_to_bytes,
    load_checkpoint,
)
from daisyweb.cli import demo, export
from daisyweb.cli import generate as generate_cli
from daisyweb.cli.generate import sample_tokens
from daisyweb.data import default_tokenizer
from signaling.server import create_app

# seq 16 < prompt + new tokens: the window slides, as daisyweb-generate's does
TINY = ["--width", "32", "--layers", "2", "--heads", "4", "--seq", "16", "--batch", "4"]
PROMPTS = ["And God said", "", "In the beginning ¾ ünïcode\tand  spaces", "Jesus wept."]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained for 40 steps: its greedy choices are not near-ties."""
    path = tmp_path_factory.mktemp("kit") / "tiny.pt"
    assert demo.main(["--peers", "1", "--steps", "40", "--save", str(path), *TINY]) == 0
    return path


def python_greedy(path: Path, prompt: str, n: int = NEW_TOKENS) -> list[int]:
    """What daisyweb-generate --temperature 0 picks (its own sample_tokens)."""
    ckpt = load_checkpoint(path)
    tok = default_tokenizer()
    ids = tok.encode(prompt) if prompt else tok.encode("\n")
    return [int(t) for t in sample_tokens(ckpt.model, ckpt.params, ids, tokens=n,
                                          temperature=0, seed=0)]


async def generate(page: Page, prefix: str, prompt: str, n: int, temperature: float = 0,
                   seed: int = 0) -> tuple[list[int], str]:
    """Fill the prompt box, click Generate, wait; the new ids and the shown text."""
    await page.fill(f"#{prefix}prompt", prompt)
    await page.fill(f"#{prefix}tokens", str(n))
    await page.fill(f"#{prefix}temperature", str(temperature))
    await page.fill(f"#{prefix}seed", str(seed))
    await page.click(f"#{prefix}generate")
    out = page.locator(f"#{prefix}output")
    await page.wait_for_function(
        "(id) => ['done', 'error'].includes(document.getElementById(id).dataset.state)",
        arg=f"{prefix}output", timeout=60000)
    assert await out.get_attribute("data-state") == "done", await page.text_content(
        f"#{prefix}status")
    tokens = await out.get_attribute("data-tokens")
    return [int(x) for x in tokens.split(",")], await out.text_content()


# ---------------------------------------------------------------------------- the kit
async def test_kit_offline_reproduces_generate_greedy(trained: Path, tmp_path: Path,
                                                      chromium, capsys) -> None:
    kit = tmp_path / "kit.html"
    assert export.main([str(trained), "-o", str(kit)]) == 0
    html = kit.read_text()
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert "http://" not in html and "https://" not in html  # nothing to fetch, anywhere
    tok = default_tokenizer()
    async with async_playwright() as pw:
        ctx = await chromium(pw, {"width": 900, "height": 700})
        try:
            await ctx.set_offline(True)
            requests: list[str] = []
            ctx.on("request", lambda r: requests.append(r.url))
            page = await ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            await page.goto(kit.as_uri())
            await page.wait_for_function("() => document.body.dataset.ready", timeout=30000)
            assert await page.evaluate("() => document.body.dataset.ready") == "1", (
                await page.text_content("#status"))
            for prompt in PROMPTS:
                ids, text = await generate(page, "", prompt, NEW_TOKENS)
                assert ids == python_greedy(trained, prompt), prompt
                assert text == prompt + tok.decode(ids)
                # and the command itself prints the same text
                capsys.readouterr()
                assert generate_cli.main([str(trained), "--prompt", prompt, "--tokens",
                                          str(NEW_TOKENS), "--temperature", "0"]) == 0
                assert capsys.readouterr().out == text + "\n"
            # temperature sampling: seeded, so the same seed repeats itself
            a, _ = await generate(page, "", "And", 12, temperature=1.0, seed=7)
            b, _ = await generate(page, "", "And", 12, temperature=1.0, seed=7)
            assert a == b and all(0 <= i < tok.vocab_size for i in a)
            # the page's tokenizer splits tricky text exactly as Python's
            texts = ["a\x1cb\x85c\u00a0d\ufeffe \u3000f", "x²y ½ Ⅻ ٣٤ 12345", "e\u0301 日本 😀👍🏽",
                     "__init__ don't we'll", "w" * 700, "  \n\n  x\t\r\n"]
            got = await page.evaluate("(ts) => ts.map((t) => window.kit.tokenizer.encode(t))",
                                      texts)
            assert got == [[int(i) for i in tok.encode(t)] for t in texts]
        finally:
            await ctx.close()
    assert not errors, errors
    assert all(u.startswith("file://") for u in requests), requests


def test_export_refuses_bad_files_in_one_line(trained: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "kit.html"
    assert export.main([str(tmp_path / "missing.pt"), "-o", str(out)]) == 1
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    assert export.main([str(bad), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("daisyweb-export: cannot use") and err.count("\n") == 1
    other = load_checkpoint(trained)
    other.tokenizer = TokenizerInfo(other.tokenizer.vocab_size, "0" * 64)
    alien = tmp_path / "alien.pt"
    alien.write_bytes(checkpoint_to_bytes(other))
    assert export.main([str(alien), "-o", str(out)]) == 1
    assert "tokenizer" in capsys.readouterr().err
    assert not out.exists()  # nothing written for a refused file


def test_kit_stores_the_forward_quantization(trained: Path) -> None:
    """The kit's int8 weights are kernels.quantize_cols of the checkpoint's, transposed."""
    import base64

    import kernels
    from daisyweb.kit.build import build_kit
    from daisyweb.model import views

    ckpt = load_checkpoint(trained)
    html = build_kit(ckpt, default_tokenizer())
    start = html.index('type="application/json">') + len('type="application/json">')
    data = json.loads(html[start:html.index("</script>", start)])
    blob = base64.b64decode(data["blob"])
    entries = {t["name"]: t for t in data["tensors"]}
    w = views(ckpt.model, ckpt.params)["h1.mlp.w_in"]
    q, s = kernels.quantize_cols(np.ascontiguousarray(w))
    e, es = entries["h1.mlp.w_in"], entries["h1.mlp.w_in#scale"]
    stored = np.frombuffer(blob, np.int8, e["length"], e["offset"]).reshape(q.shape[::-1])
    assert (stored == q.T).all()
    assert np.frombuffer(blob, "<f4", es["length"], es["offset"]).tobytes() == s.tobytes()
    wte = entries["wte"]
    assert np.frombuffer(blob, "<f4", wte["length"], wte["offset"]).tobytes() == (
        views(ckpt.model, ckpt.params)["wte"].tobytes())


# ---------------------------------------------------------------------------- dashboard
def rewrite(data: bytes, change: dict[str, bytes | None], *,
            compress: str | None = None) -> bytes:
    """The .pt archive with some entries replaced (None: dropped), rewritten by zipfile
    (so every CRC is right again); ``compress`` names an entry to store deflated."""
    src = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = change.get(info.filename, src.read(info))
            if body is None:
                continue
            method = zipfile.ZIP_DEFLATED if info.filename == compress else zipfile.ZIP_STORED
            dst.writestr(zipfile.ZipInfo(info.filename, (1980, 1, 1, 0, 0, 0)), body,
                         compress_type=method)
        for name, body in change.items():
            if name not in src.namelist() and body is not None:
                dst.writestr(name, body)
    return buf.getvalue()


def bad_files(good: bytes, tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the page must say), one per guard of static/ptread.js."""
    pkl = zipfile.ZipFile(io.BytesIO(good)).read("archive/data.pkl")
    storage = zipfile.ZipFile(io.BytesIO(good)).read("archive/data/3")
    flipped = bytes([storage[0] ^ 0x01]) + storage[1:]
    raw_flip = bytearray(good)
    at = good.index(storage)
    raw_flip[at] ^= 0x01
    other = load_checkpoint_bytes(good)
    other.tokenizer = TokenizerInfo(other.tokenizer.vocab_size, "0" * 64)
    cases = {
        "garbage": (b"not a checkpoint at all", "not a .pt checkpoint"),
        "crc": (bytes(raw_flip), "fails its CRC check"),
        "hash": (rewrite(good, {"archive/data/3": flipped}), "weight hash mismatch"),
        "global": (rewrite(good, {"archive/data.pkl": pkl.replace(
            b"collections\nOrderedDict\n", b"os\nsystem\n", 1)}), "never needs"),
        "memo": (rewrite(good, {"archive/data.pkl": pkl[:2] + b"q\x00" + pkl[2:]}),
                 "opcode 0x71"),
        "deflated": (rewrite(good, {}, compress="archive/data.pkl"), "is compressed"),
        "extra": (rewrite(good, {"archive/extra": b"x"}), "unexpected archive entry"),
        "tokenizer": (checkpoint_to_bytes(other), "trained with tokenizer"),
    }
    out = {}
    for name, (body, says) in cases.items():
        path = tmp / f"{name}.pt"
        path.write_bytes(body)
        out[name] = (path, says)
    return out


def load_checkpoint_bytes(data: bytes):
    from daisyweb.checkpoints.checkpoint import checkpoint_from_bytes

    return checkpoint_from_bytes(data)


async def test_dashboard_tries_a_checkpoint_in_the_page(trained: Path, tmp_path: Path,
                                                        chromium) -> None:
    seen: list[tuple[str, str, int]] = []  # what the server received: method, path, body

    @web.middleware
    async def record(request: web.Request, handler):
        body = await request.read()
        seen.append((request.method, request.path, len(body)))
        return await handler(request)

    app = create_app()
    app.middlewares.append(record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    bad = bad_files(trained.read_bytes(), tmp_path)
    try:
        async with async_playwright() as pw:
            ctx = await chromium(pw, {"width": 1100, "height": 900})
            try:
                page = await ctx.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                response = await page.goto(f"{url}/?poll=200")
                assert response.headers["content-security-policy"].startswith(
                    "default-src 'self'")
                await page.wait_for_selector("#try-file")
                files = page.locator("#try-file")

                async def pick(path: Path) -> str:
                    await files.set_input_files(str(path))
                    await page.wait_for_function(
                        "() => ['loaded', 'refused'].includes("
                        "document.getElementById('try-file').dataset.state)", timeout=30000)
                    return await files.get_attribute("data-state")

                for name, (path, says) in bad.items():
                    assert await pick(path) == "refused", name
                    shown = await page.text_content("#try-error")
                    assert shown.startswith(f"cannot use {path.name}: ") and says in shown, (
                        name, shown)
                    assert await page.locator("#try-box").is_hidden()
                # after refusals a good file loads, and generates daisyweb-generate's tokens
                assert await pick(trained) == "loaded", await page.text_content("#try-error")
                assert await page.locator("#try-error").is_hidden()
                assert "hash checked" in await page.text_content("#try-info")
                for prompt in PROMPTS[:3]:
                    ids, _ = await generate(page, "try-", prompt, NEW_TOKENS)
                    assert ids == python_greedy(trained, prompt), prompt
                await page.screenshot(path=str(tmp_path / "try.png"), full_page=True)
            finally:
                await ctx.close()
    finally:
        await runner.cleanup()
    assert not errors, errors
    # the server never received a file: only GETs without bodies
    assert seen and all(m == "GET" and n == 0 for m, _, n in seen), seen
    assert ("GET", "/api/tokenizer", 0) in seen


async def test_kit_default_size_logits_match_numpy(tmp_path: Path, chromium) -> None:
    """The default model's shape (width 128, 4 layers, 4 heads, context 64, vocab 2048):
    the kit's logits stay within 1e-4 of numpy's on windows up to the full context (the
    bench measures a trained model over thousands of steps: bench:kit)."""
    import kernels
    from daisyweb.checkpoints.checkpoint import make_checkpoint
    from daisyweb.data import heldout_tokens
    from daisyweb.kit.build import build_kit
    from daisyweb.model import ModelConfig, forward, init_params
    from daisyweb.optim import AdamConfig, DaisyAdam

    tok = default_tokenizer()
    cfg = ModelConfig(vocab=tok.vocab_size)
    params = init_params(cfg, 3)
    ckpt = make_checkpoint(cfg, TokenizerInfo(tok.vocab_size, tok.file_hash), params,
                           DaisyAdam(AdamConfig(lr=5e-3), params.size), {})
    kit = tmp_path / "default.html"
    kit.write_text(build_kit(ckpt, tok))
    held = heldout_tokens()
    windows = [[int(t) for t in held[s:s + n]] for s, n in [(0, 1), (900, 9), (4000, 64)]]
    rng = np.random.default_rng(5)
    rows = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
            for n in [*range(1, 140), 255, 256, 300, 512, 1000]]
    mat = (rng.standard_normal((130, 70)) * 0.02).astype(np.float32)
    mat[3, 5] = 1.5  # one outlier column
    async with async_playwright() as pw:
        ctx = await chromium(pw, {"width": 800, "height": 600})
        try:
            await ctx.set_offline(True)
            page = await ctx.new_page()
            await page.goto(kit.as_uri())
            await page.wait_for_function("() => document.body.dataset.ready === '1'",
                                         timeout=30000)
            got = await page.evaluate(
                "(ws) => ws.map((w) => Array.from(DaisyKit.forwardLast(window.kit.model, w)))",
                windows)
            # the exact pieces, bit for bit: numpy's float32 sum order, int8 quantization
            sums = await page.evaluate(
                "(rows) => rows.map((r) => DaisyKit.numpySum(new Float32Array(r), 0, r.length))",
                [r.tolist() for r in rows])
            quant = await page.evaluate(
                "([w, k, n]) => { const r = DaisyKit.quantizeCols(new Float32Array(w), k, n);"
                " return [Array.from(r.q), Array.from(r.s)]; }",
                [mat.reshape(-1).tolist(), *mat.shape])
        finally:
            await ctx.close()
    assert [np.float32(x).tobytes() for x in sums] == [r.sum().tobytes() for r in rows]
    q, sc = kernels.quantize_cols(mat)
    assert quant[0] == q.T.reshape(-1).tolist()
    assert np.asarray(quant[1], np.float32).tobytes() == sc.tobytes()
    for w, js in zip(windows, got, strict=True):
        py = forward(cfg, params, np.asarray([w]))[0, -1].astype(np.float64)
        assert np.max(np.abs(py - np.asarray(js))) < 1e-4, len(w)
