"""The built-in English corpus served by /data when FineWeb is unavailable.

The same text the peers train on (``daisyweb.data.builtin_paragraphs()``: the training
part of the King James Bible, public domain, one paragraph per chapter), so a peer fed by
/data trains on what the offline demo trains on. The held-out last 5% of the corpus
(``daisyweb.data.heldout_text()``) is never served.
"""

import random

from daisyweb.data import builtin_paragraphs


def builtin_slice(n: int = 4, rng: random.Random | None = None) -> str:
    """``n`` consecutive training paragraphs from a random place (wrapping at their end)."""
    rng = rng or random.Random()
    paragraphs = builtin_paragraphs()
    start = rng.randrange(len(paragraphs))
    return "\n\n".join(paragraphs[(start + i) % len(paragraphs)] for i in range(n)) + "\n"
