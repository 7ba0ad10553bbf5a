"""Tokenizer, built-in corpus and batch sampler (everything ships in the package).

- ``Tokenizer`` / ``default_tokenizer()``: byte-level BPE, vocab 2048, no special tokens.
- ``builtin_text()`` / ``builtin_tokens()``: about 4 MB of public-domain English prose,
  the training part only; ``heldout_text()`` / ``heldout_tokens()``: its last 5%, which no
  run trains on (``daisyweb-eval`` measures the loss there).
- ``BatchSampler``: per-peer seeded windows from a counter-based hash.
"""

from .corpus import (
    builtin_paragraphs,
    builtin_text,
    builtin_tokens,
    heldout_paragraphs,
    heldout_text,
    heldout_tokens,
)
from .sampler import BatchSampler
from .tokenizer import PATTERN, Tokenizer, TokenizerError, default_tokenizer, train_bpe

__all__ = [
    "PATTERN",
    "BatchSampler",
    "Tokenizer",
    "TokenizerError",
    "builtin_paragraphs",
    "builtin_text",
    "builtin_tokens",
    "default_tokenizer",
    "heldout_paragraphs",
    "heldout_text",
    "heldout_tokens",
    "train_bpe",
]
