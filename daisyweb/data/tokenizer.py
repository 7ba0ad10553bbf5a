"""Byte-level BPE tokenizer: the shipped vocabulary file, encode/decode, and training.

Ids 0..255 are the raw bytes; id 256 + i is merge i of the file's merge list. There are no
special tokens. Text is first split into pre-tokens by a GPT-2-like pattern written for the
stdlib ``re`` module, then each pre-token's UTF-8 bytes are merged by rank (lowest first),
so every string round-trips through encode/decode. (A lone surrogate, which has no UTF-8
form, is encoded with ``surrogatepass`` and decodes to U+FFFD.)

Vocabulary file (JSON, UTF-8):
    {"format": "daisyweb-bpe", "version": 1, "vocab_size": 256 + len(merges),
     "pattern": PATTERN, "merges": [[left_id, right_id], ...], ...optional metadata}
"""

from __future__ import annotations

import array
import functools
import hashlib
import heapq
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

FORMAT = "daisyweb-bpe"
VERSION = 1
N_BYTES = 256
TOKENIZER_FILE = Path(__file__).resolve().parent / "tokenizer.json"
# Pre-tokens longer than this are encoded in chunks of this many characters: BPE on one
# word costs O(len * merges), so a megabyte without spaces (hostile /data text) would
# otherwise stall a peer. Prose never has words this long, so ordinary text is unaffected.
MAX_WORD = 256
# Bound on the per-word cache (about 30-60 MB when full); past it, words are not cached.
CACHE_WORDS = 1 << 18
# GPT-2's pre-tokenisation with stdlib classes: [^\W\d_] is a letter, \d a digit, and
# (?:[^\s\w]|_) anything else that is not whitespace. Every character falls in one of the
# alternatives, so the pre-tokens always concatenate back to the input.
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""


class TokenizerError(ValueError):
    """A vocabulary file or an id sequence the tokenizer cannot accept."""


def _file_error(path: object, why: str) -> TokenizerError:
    return TokenizerError(f"tokenizer file {path}: {why}")


def _check_merges(raw: object, where: object) -> list[tuple[int, int]]:
    if not isinstance(raw, list):
        raise _file_error(where, "'merges' must be a list of [left_id, right_id] pairs")
    merges: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    for i, pair in enumerate(raw):
        ok = (isinstance(pair, list) and len(pair) == 2
              and all(type(x) is int for x in pair))
        if not ok:
            raise _file_error(where, f"merge {i} is {pair!r}, not a pair of integer ids")
        a, b = pair
        # a merge may only use ids that exist before it: bytes and earlier merges
        if not (0 <= a < N_BYTES + i and 0 <= b < N_BYTES + i):
            raise _file_error(where, f"merge {i} {pair!r} uses an id not defined before it")
        if (a, b) in seen:
            raise _file_error(where, f"merge {i} {pair!r} repeats an earlier merge")
        seen.add((a, b))
        merges.append((a, b))
    return merges


def _merge_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """``ids`` with every non-overlapping occurrence of ``pair`` (left to right) replaced
    by ``new_id``: the one merge rule shared by encoding and training."""
    out: list[int] = []
    i, n = 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


class Tokenizer:
    """Byte-level BPE with a per-word cache (encoding a few MB takes seconds)."""

    vocab_size: int
    file_hash: str
    merges: list[tuple[int, int]]
    pattern: str

    def __init__(self, merges: Iterable[tuple[int, int]], *, pattern: str = PATTERN,
                 file_hash: str = "", meta: dict | None = None) -> None:
        self.merges = _check_merges([list(m) for m in merges], "<merges>")
        self.pattern = pattern
        self._re = re.compile(pattern)
        self.vocab_size = N_BYTES + len(self.merges)
        self.file_hash = file_hash
        self.meta = dict(meta or {})
        self._ranks = {pair: N_BYTES + i for i, pair in enumerate(self.merges)}
        pieces = [bytes([i]) for i in range(N_BYTES)]
        for a, b in self.merges:
            pieces.append(pieces[a] + pieces[b])
        self._pieces = pieces
        self._cache: dict[str, tuple[int, ...]] = {}

    # -- file -----------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise _file_error(path, f"cannot be read ({e.strerror or e})") from e
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _file_error(path, f"is not valid JSON (truncated or corrupted?): {e}") from e
        if not isinstance(obj, dict):
            raise _file_error(path, "top level must be a JSON object")
        if obj.get("format") != FORMAT:
            raise _file_error(path, f"format is {obj.get('format')!r}, expected {FORMAT!r}")
        if obj.get("version") != VERSION:
            raise _file_error(path, f"version is {obj.get('version')!r}, expected {VERSION}")
        pattern = obj.get("pattern")
        # only the pattern this code was written and tested for: another one may drop
        # characters (no round trip) or backtrack catastrophically
        if pattern != PATTERN:
            raise _file_error(path, f"'pattern' {pattern!r:.80} is not the supported "
                              "pre-tokenisation pattern")
        merges = _check_merges(obj.get("merges"), path)
        declared = obj.get("vocab_size")
        # the declared size catches a merge list cut short by an edit or a bad copy
        if declared != N_BYTES + len(merges):
            raise _file_error(path, f"vocab_size {declared!r} does not match 256 bytes + "
                              f"{len(merges)} merges = {N_BYTES + len(merges)}")
        meta = {k: v for k, v in obj.items() if k not in ("merges", "pattern")}
        return cls(merges, pattern=pattern, file_hash=hashlib.sha256(data).hexdigest(),
                   meta=meta)

    def to_json(self, **meta: object) -> str:
        """The vocabulary file's text (one merge per line, so diffs stay readable)."""
        head = {"format": FORMAT, "version": VERSION, "vocab_size": self.vocab_size,
                "pattern": self.pattern, **meta}
        lines = ["{"]
        lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
        lines.append('  "merges": [')
        body = [f"    [{a}, {b}]" for a, b in self.merges]
        lines.append(",\n".join(body))
        lines.append("  ]")
        lines.append("}")
        return "\n".join(lines) + "\n"

    # -- encode / decode ------------------------------------------------------------------

    def _bpe(self, word: str) -> tuple[int, ...]:
        ids = list(word.encode("utf-8", errors="surrogatepass"))
        ranks = self._ranks
        while len(ids) > 1:
            # merge the lowest-ranked adjacent pair everywhere it occurs, as trained
            best = min((ranks.get(p, 1 << 30), p) for p in zip(ids, ids[1:], strict=False))
            new_id, pair = best
            if new_id == 1 << 30:
                break
            ids = _merge_pair(ids, pair, new_id)
        return tuple(ids)

    def encode(self, text: str, cache: dict[str, tuple[int, ...]] | None = None) -> np.ndarray:
        """int32 ids of ``text``. Safe to call from several threads (the cache is a dict
        whose single get/set operations are atomic; a race only recomputes a word).

        ``cache`` replaces the tokenizer's own word cache for this call (the ids are the
        same): a caller encoding one big text once passes a dict it drops afterwards, so
        the text's words are not kept for the rest of the process.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode takes str, not {type(text).__name__}")
        if cache is None:
            cache = self._cache
        # Words one at a time (finditer, not findall) into 4-byte ids: the built-in corpus
        # as a list of ~1 M word strings and Python ints would take ~70 MB per peer.
        out = array.array("i")
        for match in self._re.finditer(text):
            word = match.group()
            ids = cache.get(word)
            if ids is None:
                if len(word) > MAX_WORD:
                    ids = tuple(i for k in range(0, len(word), MAX_WORD)
                                for i in self._bpe(word[k : k + MAX_WORD]))
                else:
                    ids = self._bpe(word)
                    if len(cache) < CACHE_WORDS:
                        cache[word] = ids
            out.extend(ids)
        return np.frombuffer(out, dtype=np.int32).copy() if out else np.zeros(0, np.int32)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        arr = np.asarray(ids)
        if arr.size == 0:
            return ""
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise TokenizerError("decode takes a 1-D sequence of integer token ids")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise TokenizerError(f"token id {bad} is outside 0..{self.vocab_size - 1}")
        pieces = self._pieces
        return b"".join([pieces[i] for i in arr.tolist()]).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside 0..{self.vocab_size - 1}")
        return self._pieces[token_id]


@functools.cache
def default_tokenizer() -> Tokenizer:
    """The shipped tokenizer (tokenizer.json beside this module), loaded once."""
    return Tokenizer.from_file(TOKENIZER_FILE)


def train_bpe(text: str, vocab_size: int, *, pattern: str = PATTERN) -> list[tuple[int, int]]:
    """Learn ``vocab_size - 256`` merges from ``text``; deterministic (ties: smallest pair).

    Counts pre-token words once, then updates pair counts incrementally: only the words
    that contain the merged pair are touched, which keeps a few MB well under a minute.
    """
    if vocab_size < N_BYTES:
        raise ValueError(f"vocab_size must be at least {N_BYTES}, got {vocab_size}")
    # words are chunked exactly as encode() chunks them
    counts = Counter(w[k : k + MAX_WORD] for w in re.findall(pattern, text)
                     for k in range(0, len(w), MAX_WORD))
    words: list[list[int]] = []
    freqs: list[int] = []
    for w, c in sorted(counts.items()):  # sorted: the result must not depend on dict order
        words.append(list(w.encode("utf-8", errors="surrogatepass")))
        freqs.append(c)
    pair_count: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for wi, ids in enumerate(words):
        for p in zip(ids, ids[1:], strict=False):
            pair_count[p] += freqs[wi]
            where.setdefault(p, set()).add(wi)
    # max-heap of (-count, pair); stale entries are skipped when popped
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges: list[tuple[int, int]] = []
    while len(merges) < vocab_size - N_BYTES and heap:
        negc, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -negc:
            continue
        if -negc <= 0:
            break
        new_id = N_BYTES + len(merges)
        merges.append(pair)
        touched: Counter[tuple[int, int]] = Counter()
        for wi in sorted(where.pop(pair, ())):
            ids, f = words[wi], freqs[wi]
            for p in zip(ids, ids[1:], strict=False):
                pair_count[p] -= f
                touched[p] -= f
            out = _merge_pair(ids, pair, new_id)
            words[wi] = out
            for p in zip(out, out[1:], strict=False):
                pair_count[p] += f
                touched[p] += f
                where.setdefault(p, set()).add(wi)
        pair_count.pop(pair, None)
        for p, delta in touched.items():
            if delta and p != pair and pair_count.get(p, 0) > 0:
                heapq.heappush(heap, (-pair_count[p], p))
    return merges
