"""Seeded batch sampler: each peer draws its own windows of tokens, identically everywhere.

Offsets come from a counter-based integer hash (SplitMix64's finaliser on uint64, which
wraps mod 2**64 the same way on every machine and numpy version), keyed by blake2b of
(seed, peer). No ``np.random`` and no Python ``hash()``: both can differ between versions
or processes, and a replay or a repair must redraw the exact batch of a past step.
"""

from __future__ import annotations

import hashlib

import numpy as np

DEFAULT_MAX_TOKENS = 1 << 22  # about 4M tokens (16 MB of int32) kept at most
_M64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(seed: int, peer: str) -> int:
    digest = hashlib.blake2b(f"daisyweb-sampler\0{seed}\0{peer}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def _as_tokens(tokens: np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError("tokens must be a 1-D array of integer token ids")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(np.int32).max):
        raise ValueError("token ids must be non-negative int32 values")
    if arr.dtype == np.int32 and not arr.flags.writeable and arr.base is None:
        return arr  # read-only and owning its data (the built-in tokens): shared, not copied
    return arr.astype(np.int32)  # a private copy: later edits by the caller change nothing


class BatchSampler:
    """``sample(step)`` -> int32 [batch, seq + 1]: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""

    def __init__(self, tokens: np.ndarray, *, batch: int, seq: int, seed: int, peer: str,
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        for name, v in (("batch", batch), ("seq", seq), ("seed", seed)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if batch < 1 or seq < 1:
            raise ValueError(f"batch and seq must be at least 1, got batch={batch} seq={seq}")
        if not isinstance(peer, str):
            raise ValueError(f"peer must be a string id, got {peer!r}")
        if max_tokens < seq + 2:
            raise ValueError(f"max_tokens {max_tokens} cannot hold one window of seq {seq}")
        arr = _as_tokens(tokens)
        # at least two distinct windows, or every draw would be the same one
        if arr.size < seq + 2:
            raise ValueError(f"need at least seq + 2 = {seq + 2} tokens, got {arr.size}")
        self.batch, self.seq, self.seed, self.peer = int(batch), int(seq), int(seed), peer
        self.max_tokens = int(max_tokens)
        self._key = np.uint64(_key(self.seed, peer))
        # _as_tokens made a private copy or shares a read-only array: copy again only to
        # release a head beyond max_tokens.
        self._tokens = arr[-self.max_tokens:].copy() if arr.size > self.max_tokens else arr

    @property
    def tokens(self) -> np.ndarray:
        """The current window of tokens (read-only view)."""
        view = self._tokens.view()
        view.setflags(write=False)
        return view

    def offsets(self, step: int, rows: int | None = None) -> np.ndarray:
        """Start offsets (int64 [rows], default [batch]) of the windows drawn at ``step``;
        row ``r`` is the same window whatever the number of rows."""
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        span = self._tokens.size - self.seq  # valid starts: 0 .. size - seq - 1
        # counter = (step, row): two mixing rounds so nearby steps are unrelated
        base = _mix(np.array([(int(step) * 0x9E3779B97F4A7C15) & _M64], dtype=np.uint64)
                    ^ self._key)
        n = self.batch if rows is None else int(rows)
        if n < 1:
            raise ValueError(f"rows must be at least 1, got {rows!r}")
        index = np.arange(n, dtype=np.uint64)
        h = _mix(base ^ (index * np.uint64(0xD1B54A32D192ED03) + np.uint64(1)))
        # integer remainder: exact on every machine; its bias (span / 2**64) is negligible
        return (h % np.uint64(span)).astype(np.int64)

    def sample(self, step: int, rows: int | None = None) -> np.ndarray:
        offs = self.offsets(step, rows)
        idx = offs[:, None] + np.arange(self.seq + 1, dtype=np.int64)[None, :]
        return self._tokens[idx]

    def extend(self, tokens: np.ndarray) -> None:
        """Append fresh tokens (e.g. from the server's /data); keep the last ``max_tokens``."""
        arr = _as_tokens(tokens)
        if arr.size == 0:
            return
        joined = np.concatenate([self._tokens, arr])
        # copy the kept tail so the dropped head's memory is actually released
        self._tokens = joined[-self.max_tokens:].copy() if joined.size > self.max_tokens \
            else joined
