"""The built-in English corpus shipped in the package, and its tokens.

The text is the King James Version of the Bible (public domain), one paragraph per
chapter; see SOURCES.md beside this file and scripts/build_corpus.py.

It is split once, by a fixed rule, into a training part and a held-out part:

- **training** (``builtin_text``, ``builtin_paragraphs``, ``builtin_tokens``): Genesis
  through Philippians, about 95% of the characters. Every run trains on this only.
- **held-out** (``heldout_text``, ``heldout_tokens``): the last 16 books, from
  ``The Book of Colossians`` to the end of Revelation, about 5% of the characters. No run
  trains on it; ``daisyweb.training.evaluate`` measures the loss on it.

The split is at the book boundary nearest to 95% of the characters (a paragraph
boundary). ``full_corpus_text`` is the whole shipped file: the shipped tokenizer was
trained on it (the tokenizer having seen the text is not the model training on it), and
nothing else may use it.
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path

import numpy as np

from .tokenizer import default_tokenizer

DATA_DIR = Path(__file__).resolve().parent
CORPUS_FILE = DATA_DIR / "corpus.txt.gz"

HELDOUT_FIRST_PARAGRAPH = "The Book of Colossians"
"""The title paragraph that starts the held-out part (the split is a fixed rule)."""


def _read_text() -> str:
    """The shipped file's text, read now and not kept (see :func:`builtin_tokens`)."""
    return gzip.decompress(CORPUS_FILE.read_bytes()).decode("utf-8")


@functools.cache
def full_corpus_text() -> str:
    """The whole shipped file, held-out part included. For the tokenizer only: never train on it."""
    return _read_text()


@functools.cache
def heldout_start() -> int:
    """Character offset in :func:`full_corpus_text` where the held-out part begins."""
    text = _read_text()
    marker = "\n\n" + HELDOUT_FIRST_PARAGRAPH + "\n\n"
    at = text.find(marker)
    if at < 0 or text.find(marker, at + 1) >= 0:
        raise RuntimeError(f"corpus: {HELDOUT_FIRST_PARAGRAPH!r} must begin exactly one paragraph")
    return at + 2


@functools.cache
def builtin_text() -> str:
    """The training part of the built-in corpus (about 3.9 MB), read once per process.

    Paragraphs separated by one blank line, ending with a newline; the held-out part
    (:func:`heldout_text`) is not in it.
    """
    return full_corpus_text()[: heldout_start() - 1]


@functools.cache
def heldout_text() -> str:
    """The held-out part: the last 5% of the corpus (Colossians to Revelation), never trained on."""
    return full_corpus_text()[heldout_start() :]


def _paragraphs(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split("\n\n") if p.strip())


@functools.cache
def builtin_paragraphs() -> tuple[str, ...]:
    """The training part split at blank lines: book titles and one paragraph per chapter."""
    return _paragraphs(builtin_text())


@functools.cache
def heldout_paragraphs() -> tuple[str, ...]:
    """The held-out part split at blank lines."""
    return _paragraphs(heldout_text())


def _encode(text: str) -> np.ndarray:
    # A word cache of its own, dropped with the text: the tokenizer's would keep every
    # distinct word of the corpus (~8 MB) for the rest of the process.
    ids = default_tokenizer().encode(text, cache={})
    ids.setflags(write=False)  # shared by every caller: nobody may edit it in place
    return ids


@functools.cache
def builtin_tokens() -> np.ndarray:
    """``default_tokenizer().encode(builtin_text())`` as int32, cached in memory (read-only).

    The training part only. Encoding takes a few seconds once per process; nothing is
    written to disk, since the package directory may be read-only. Only the tokens are
    kept: the text is read for the encoding and dropped (a peer never needs it again).
    """
    return _encode(_read_text()[: heldout_start() - 1])


@functools.cache
def heldout_tokens() -> np.ndarray:
    """``default_tokenizer().encode(heldout_text())`` as int32, cached (read-only)."""
    return _encode(_read_text()[heldout_start() :])
