"""The data feed: the batch sampler over the built-in corpus, topped up in the background.

The head of the built-in corpus is encoded up front, so the first step never waits; the
rest of it, and text slices fetched from the server's ``/data`` now and then, are
encoded off the event loop and handed to the sampler between computations.
"""

from __future__ import annotations

import asyncio
from collections import deque

import aiohttp
import numpy as np

from daisyweb.data import BatchSampler, Tokenizer, builtin_text
from daisyweb.peer.options import data_url, log
from daisyweb.training.config import RunConfig

__all__ = ["DATA_EVERY_S", "DATA_MAX_TOKENS", "START_TEXT_CHARS", "DataFeed"]

DATA_EVERY_S = 30.0
START_TEXT_CHARS = 1 << 18  # built-in text encoded before the first step
DATA_MAX_TOKENS = 4_000_000


class DataFeed:
    """Sampler over the head of the built-in corpus now; then /data slices in the
    background, or the rest of the built-in corpus if /data is not there (encoding
    all of it takes a second or two, so it is not done up front)."""

    def __init__(self, tok: Tokenizer, run: RunConfig, peer: str, server: str) -> None:
        self.tok = tok
        self.run = run
        self.server = server
        head = tok.encode(builtin_text()[:START_TEXT_CHARS])
        self.sampler = BatchSampler(head, batch=run.batch, seq=run.model.seq,
                                    seed=run.seed, peer=peer)
        self.pending_tokens: deque[np.ndarray] = deque()
        self.fetched_tokens = 0
        self.builtin_loaded = False

    def start(self) -> list[asyncio.Task[None]]:
        """Start the background loads; the caller owns (and cancels) the tasks."""
        # The whole built-in corpus always loads: training on the head alone (or on a
        # few /data slices) overfits it within a few dozen steps.
        tasks = [asyncio.create_task(self._load_builtin())]
        if self.run.data != "builtin":
            tasks.append(asyncio.create_task(self._fetch_data()))
        return tasks

    async def _load_builtin(self) -> None:
        if self.builtin_loaded:
            return
        self.builtin_loaded = True
        loop = asyncio.get_running_loop()
        rest = await loop.run_in_executor(
            None, self.tok.encode, builtin_text()[START_TEXT_CHARS:])
        self.pending_tokens.append(np.asarray(rest))

    async def _fetch_data(self) -> None:
        """Fetch text slices from /data now and then; failures just keep the corpus."""
        url = data_url(self.server)
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while self.fetched_tokens < DATA_MAX_TOKENS:
                try:
                    async with session.get(url) as resp:
                        text = await resp.text() if resp.status == 200 else ""
                        source = resp.headers.get("X-Daisyweb-Source", "?")
                except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
                    log(f"/data unavailable ({type(exc).__name__}); using the built-in corpus")
                    text, source = "", "-"
                if source == "builtin":
                    text = ""  # the server's built-in corpus is ours, already loaded
                if text:
                    loop = asyncio.get_running_loop()
                    ids = await loop.run_in_executor(None, self.tok.encode, text)
                    arr = np.asarray(ids, dtype=np.int64)
                    if arr.size:
                        self.pending_tokens.append(arr)
                        self.fetched_tokens += int(arr.size)
                        log(f"/data: {arr.size:,} tokens ({source})")
                await asyncio.sleep(DATA_EVERY_S)

    def batch(self, step: int) -> np.ndarray:
        """The tokens of inner step ``step`` (0-based): ``[batch, seq + 1]``."""
        # Called by the one compute in flight (in its worker thread) and nowhere else, so
        # the sampler is never used from two threads at once; the deque is thread-safe.
        while self.pending_tokens:
            self.sampler.extend(self.pending_tokens.popleft())
        return self.sampler.sample(step + 1)
