"""The data feed: the batch sampler over the built-in corpus, topped up in the background.

The whole built-in training corpus is there from the first step (encoded once, about a
second): a peer that started on the head alone overfitted it, and trained a visibly
worse model than one peer on the whole corpus. Text slices fetched from the server's
``/data`` now and then are encoded off the event loop and handed to the sampler between
computations.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import numpy as np

from daisyweb.data import BatchSampler, Tokenizer, builtin_tokens
from daisyweb.peer.options import data_url, log
from daisyweb.training.config import RunConfig

__all__ = ["DATA_EVERY_S", "DATA_MAX_TOKENS", "DataFeed", "TaskFeed", "feed_for"]

DATA_EVERY_S = 30.0
DATA_MAX_TOKENS = 4_000_000


class DataFeed:
    """Sampler over the whole built-in training corpus, topped up with /data slices."""

    def __init__(self, tok: Tokenizer, run: RunConfig, peer: str, server: str) -> None:
        self.tok = tok
        self.run = run
        self.server = server
        self.sampler = BatchSampler(builtin_tokens(), batch=run.batch, seq=run.model.seq,
                                    seed=run.seed, peer=peer)
        self.pending_tokens: deque[np.ndarray] = deque()
        self.fetched_tokens = 0

    def start(self) -> list[asyncio.Task[None]]:
        """Start the background /data fetch; the caller owns (and cancels) the task."""
        if self.run.data == "builtin":
            return []
        return [asyncio.create_task(self._fetch_data())]

    async def _fetch_data(self) -> None:
        """Fetch text slices from /data now and then; failures just keep the corpus."""
        # Imported here: a peer on the built-in corpus never loads aiohttp (~9 MB resident).
        import aiohttp

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

    def batch(self, step: int, rows: int | None = None) -> np.ndarray:
        """The tokens of inner step ``step`` (0-based): ``[batch, seq + 1]``, or
        ``[rows, seq + 1]`` for a capacity-weighted share (the first ``batch`` rows are
        the same either way)."""
        # Called by the one compute in flight (in its worker thread) and nowhere else, so
        # the sampler is never used from two threads at once; the deque is thread-safe.
        while self.pending_tokens:
            self.sampler.extend(self.pending_tokens.popleft())
        return self.sampler.sample(step + 1, rows)

    def rows(self, n: int) -> Callable[[int], np.ndarray]:
        """The batch function of a share of ``n`` sequences per inner step."""
        return lambda step: self.batch(step, n)


class TaskFeed:
    """The batches of a named task (``--task``): drawn by the task itself, nothing
    fetched."""

    def __init__(self, run: RunConfig, peer: str) -> None:
        self.run = run
        self.peer = peer
        self.task = run.task_impl

    def start(self) -> list[asyncio.Task[None]]:
        return []

    def batch(self, step: int, rows: int | None = None) -> np.ndarray:
        return self.task.batch(self.run.seed, step, self.peer, rows or self.run.batch)

    def rows(self, n: int) -> Callable[[int], np.ndarray]:
        return lambda step: self.batch(step, n)


def feed_for(tok: Tokenizer, run: RunConfig, peer: str, server: str) -> DataFeed | TaskFeed:
    """The built-in GPT's corpus feed, or a named task's own batches."""
    return TaskFeed(run, peer) if run.task else DataFeed(tok, run, peer, server)
