"""The page's checkpoint reader (static/ptread.js) against bomb files, in headless Chromium.

Each bomb is a well-formed stored zip with daisyweb's marker entries and a data.pkl made
of opcodes the reader accepts, built to pass one budget of the reader (the memory its
objects may cost, proportional and capped; a dict's entries; a tuple's items; nesting
depth) or the 1 GiB file size. The page must refuse each with the reason naming that
budget, so removing the budget fails its case: without it the file is refused later,
for another reason, after building everything it asks for. The largest checkpoint the
rules admit (1024 layers) must still load. A file over 1 GiB is refused before the page
reads a byte of it.
"""

from __future__ import annotations

import io
import re
import struct
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from playwright.async_api import async_playwright

from daisyweb.checkpoints.checkpoint import TokenizerInfo, checkpoint_to_bytes, make_checkpoint
from daisyweb.data import default_tokenizer
from daisyweb.model import ModelConfig, param_count
from daisyweb.optim import DaisyAdam
from daisyweb.training.config import RunConfig
from signaling.server import create_app
from tests.signaling.local_server import serving

# static/ptread.js's budget
MEMORY_PER_PICKLE_BYTE = 16
MEMORY_FLOOR = 1 << 20
MAX_PICKLE_MEMORY = 32 << 20
EMPTY_DICT_COST = 136  # a Map and its stack reference
REF_COST = 8
MAX_FILE_BYTES = 1 << 30

PROTO = b"\x80\x02"
STOP = b"."


def pt_with_pickle(pkl: bytes) -> bytes:
    """A stored zip with the marker entries daisyweb writes and ``pkl`` as data.pkl."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, body in [("version", b"3\n"), ("byteorder", b"little"),
                           (".format_version", b"1"), (".storage_alignment", b"64"),
                           ("data.pkl", pkl)]:
            z.writestr(zipfile.ZipInfo("archive/" + name, (1980, 1, 1, 0, 0, 0)), body)
    return buf.getvalue()


def budget(pickle_bytes: int) -> int:
    return min(MAX_PICKLE_MEMORY, MEMORY_PER_PICKLE_BYTE * pickle_bytes + MEMORY_FLOOR)


def key(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def bombs() -> dict[str, tuple[bytes, str, int | None]]:
    """name -> (data.pkl, what the refusal must say, the last byte it may stop at)."""
    capped = 4 << 20  # 16 per byte would allow 65 MB: the cap is what stops it
    small = 64 << 10  # the proportional part: 2 MB for a 64 KB pickle
    trues = 5 << 20  # no object at all, only stack references
    entries = b"".join(key(f"k{i}") + b"K\x00" for i in range(16385))
    return {
        # 4 M one-byte EMPTY_DICTs (the file had 16.7 M of them)
        "dicts": (PROTO + b"}" * capped + STOP, f"budget of {MAX_PICKLE_MEMORY} bytes",
                  MAX_PICKLE_MEMORY // EMPTY_DICT_COST + 2),
        "small": (PROTO + b"}" * small + STOP, f"budget of {budget(small + 3)} bytes",
                  budget(small + 3) // EMPTY_DICT_COST + 2),
        "trues": (PROTO + b"\x88" * trues + STOP, f"budget of {MAX_PICKLE_MEMORY} bytes",
                  MAX_PICKLE_MEMORY // REF_COST + 2),
        "entries": (PROTO + b"}(" + entries + b"u" + STOP, "a dict of more than 16384 entries",
                    None),
        "items": (PROTO + b"(" + b"K\x00" * 33 + b"t" + STOP, "a tuple of more than 32 items",
                  None),
        "depth": (PROTO + b"(" * 64 + b")" + b"t" * 64 + STOP, "nests more than 64 deep", None),
    }


def largest_checkpoint() -> bytes:
    """A valid checkpoint of the most layers the rules admit (1024, width 1): 12,295
    tensors, the most objects a real data.pkl has."""
    tok = default_tokenizer()
    model = ModelConfig(vocab=tok.vocab_size, width=1, layers=1024, heads=1, seq=1)
    run = RunConfig(model=model)
    n = param_count(model)
    params = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    ckpt = make_checkpoint(model, TokenizerInfo(tok.vocab_size, tok.file_hash), params,
                           DaisyAdam(run.adam(), n), run.to_dict())
    return checkpoint_to_bytes(ckpt)


# Every read of a file the page makes, by size: the big file must never be read.
COUNT_READS = """
  window.__reads = [];
  for (const m of ["arrayBuffer", "text", "stream", "bytes"]) {
    const real = Blob.prototype[m];
    if (!real) continue;
    Blob.prototype[m] = function (...a) {
      window.__reads.push(this.size);
      return real.apply(this, a);
    };
  }
"""


async def test_the_page_reader_refuses_every_bomb_by_its_budget(tmp_path: Path,
                                                                chromium) -> None:
    files: dict[str, tuple[Path, str, int | None]] = {}
    for name, (pkl, says, last) in bombs().items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(pt_with_pickle(pkl))
        files[name] = (path, says, last)
    largest = tmp_path / "largest.pt"
    largest.write_bytes(largest_checkpoint())
    huge = tmp_path / "huge.pt"
    with open(huge, "wb") as f:  # sparse: nothing is written but its size
        f.truncate(MAX_FILE_BYTES + 1)

    async with serving(create_app()) as url, async_playwright() as pw:
        ctx = await chromium(pw, {"width": 1000, "height": 800})
        try:
            page = await ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.add_init_script(COUNT_READS)
            await page.goto(f"{url}/?poll=1000")
            chooser = page.locator("#try-file")

            async def pick(path: Path) -> tuple[str, str, float]:
                await page.evaluate("() => { document.getElementById('try-file')"
                                    ".dataset.state = ''; }")
                t0 = time.monotonic()
                await chooser.set_input_files(str(path))
                await page.wait_for_function(
                    "() => ['loaded', 'refused'].includes("
                    "document.getElementById('try-file').dataset.state)", timeout=60000)
                took = time.monotonic() - t0
                state = await chooser.get_attribute("data-state")
                text = await page.text_content("#try-error" if state == "refused"
                                               else "#try-info")
                return state, text, took

            for name, (path, says, last) in files.items():
                state, shown, took = await pick(path)
                print(f"{name}: {path.stat().st_size} bytes refused in {took:.2f} s: {shown}")
                assert state == "refused" and says in shown, (name, shown)
                if last is not None:  # stopped where the budget runs out, not later
                    at = int(re.search(r"at byte (\d+)", shown).group(1))
                    assert at <= last, (name, at, last)

            state, shown, took = await pick(largest)
            print(f"largest: {largest.stat().st_size} bytes {state} in {took:.2f} s")
            assert state == "loaded", shown
            assert "1024 layers" in shown

            before = len(await page.evaluate("window.__reads"))
            state, shown, took = await pick(huge)
            assert state == "refused" and f"larger than {MAX_FILE_BYTES} bytes" in shown, shown
            assert len(await page.evaluate("window.__reads")) == before, "the page read it"
            assert took < 10, took
        finally:
            await ctx.close()
    assert not errors, errors


@pytest.mark.parametrize("name", ["dicts", "trues"])
def test_bombs_pass_the_size_limits_the_reader_had(name: str) -> None:
    """The capped bombs are within the 16 MiB data.pkl limit, and past what 16 bytes a
    pickle byte would allow: only the cap refuses them where the test says."""
    pkl = bombs()[name][0]
    assert len(pkl) <= 16 << 20
    assert MEMORY_PER_PICKLE_BYTE * len(pkl) + MEMORY_FLOOR > 2 * MAX_PICKLE_MEMORY
