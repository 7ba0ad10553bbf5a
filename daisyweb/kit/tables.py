"""The tokenizer's character classes as code point ranges, computed with Python's ``re``.

The pre-tokenisation pattern (``daisyweb.data.tokenizer.PATTERN``) uses Python's Unicode
``\\s``, ``\\d`` and ``[^\\W\\d_]``, which JavaScript's classes do not match exactly (its
``\\s`` has U+FEFF but not U+001C..U+001F or U+0085; Python's letters include the Nl and No
numbers). The kit's JavaScript builds its pattern from these ranges, so it splits text
exactly as this Python does.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any

from daisyweb.data.tokenizer import Tokenizer

__all__ = ["char_classes", "tokenizer_spec"]

_CLASSES = {"letter": r"[^\W\d_]+", "digit": r"\d+", "space": r"\s+"}


@functools.cache
def char_classes() -> dict[str, list[list[int]]]:
    """{"letter" | "digit" | "space": [[first, last], ...]} over every code point."""
    every = "".join(map(chr, range(sys.maxunicode + 1)))  # surrogates included: not in any
    out: dict[str, list[list[int]]] = {}
    for name, pattern in _CLASSES.items():
        out[name] = [[m.start(), m.end() - 1] for m in re.finditer(pattern, every)]
    return out


def tokenizer_spec(tok: Tokenizer) -> dict[str, Any]:
    """What kit.js's Tokenizer takes: identity, merges, character classes. The kit embeds
    it; the signaling server serves it to the dashboard (``/api/tokenizer``)."""
    return {"vocab_size": tok.vocab_size, "file_hash": tok.file_hash,
            "merges": [list(m) for m in tok.merges], "classes": char_classes()}
