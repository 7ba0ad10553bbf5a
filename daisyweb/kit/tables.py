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

__all__ = ["char_classes"]

_CLASSES = {"letter": r"[^\W\d_]+", "digit": r"\d+", "space": r"\s+"}


@functools.cache
def char_classes() -> dict[str, list[list[int]]]:
    """{"letter" | "digit" | "space": [[first, last], ...]} over every code point."""
    every = "".join(map(chr, range(sys.maxunicode + 1)))  # surrogates included: not in any
    out: dict[str, list[list[int]]] = {}
    for name, pattern in _CLASSES.items():
        out[name] = [[m.start(), m.end() - 1] for m in re.finditer(pattern, every)]
    return out
