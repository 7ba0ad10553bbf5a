"""The built-in English corpus served by /data when FineWeb is unavailable.

The same text the peers ship (``daisyweb.data.builtin_text()``: the King James Bible,
public domain, one paragraph per chapter), so a peer fed by /data trains on what the
offline demo trains on.
"""

import random

from daisyweb.data import builtin_paragraphs


def builtin_slice(n: int = 4, rng: random.Random | None = None) -> str:
    """``n`` consecutive paragraphs from a random place in the corpus (wrapping at the end)."""
    rng = rng or random.Random()
    paragraphs = builtin_paragraphs()
    start = rng.randrange(len(paragraphs))
    return "\n\n".join(paragraphs[(start + i) % len(paragraphs)] for i in range(n)) + "\n"
