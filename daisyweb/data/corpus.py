"""The built-in English corpus shipped in the package, and its tokens.

The text is the King James Version of the Bible (public domain), one paragraph per
chapter; see SOURCES.md beside this file and scripts/build_corpus.py.
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

import numpy as np

from .tokenizer import default_tokenizer

DATA_DIR = Path(__file__).resolve().parent
CORPUS_FILE = DATA_DIR / "corpus.txt.gz"


@functools.cache
def builtin_text() -> str:
    """The whole built-in corpus (about 4 MB of text), read once per process."""
    return gzip.decompress(CORPUS_FILE.read_bytes()).decode("utf-8")


@functools.cache
def builtin_paragraphs() -> tuple[str, ...]:
    """The corpus split at blank lines: book titles and one paragraph per chapter."""
    return tuple(p.strip() for p in builtin_text().split("\n\n") if p.strip())


@functools.cache
def builtin_tokens() -> np.ndarray:
    """``default_tokenizer().encode(builtin_text())`` as int32, cached in memory (read-only).

    Encoding takes a few seconds once per process; nothing is written to disk, since the
    package directory may be read-only.
    """
    ids = default_tokenizer().encode(builtin_text())
    ids.setflags(write=False)  # shared by every caller: nobody may edit it in place
    return ids
