"""Dataset text for ``GET /data``, read with HTTP range requests.

Which dataset: :mod:`signaling.hubdata` (``--dataset``, default FineWeb-Edu's
``sample-10BT``) lists the parquet shards of one config and split through
``huggingface_hub``. A slice is made like this: pick a random shard that is not backing
off, read its parquet footer (once per shard, then cached), pick a random row group and
fetch only that row group's text column chunk. The documents are cut into slices of at
most ``max_bytes`` (whole documents joined by blank lines) that later requests are served
from, so one fetch feeds several responses. A shard that fails is skipped for a while
(exponential backoff) and another is tried; when nothing works (or the Hub cannot be
asked for the shard list) the caller serves the built-in corpus and this module logs that
once per outage.

The URLs come from ``huggingface_hub.hf_hub_url`` against an explicit endpoint (tests and
mirrors pass ``--hf-endpoint``) at the commit the listing saw, the bytes from an fsspec
``HTTPFileSystem`` and pyarrow. All blocking work runs in a worker thread; at most one
fetch is in flight at a time. :meth:`FineWebReader.prepare` does the listing and reads
the first shard's footer up front, so that ``daisyweb-signal`` refuses a missing
dataset, config, split or column at start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .hubdata import (
    DEFAULT_DATASET,
    DatasetMissing,
    DatasetSpec,
    DatasetUnreachable,
    list_shards,
    quoted,
)

log = logging.getLogger("daisyweb.fineweb")

# FineWeb-Edu's sample/10BT: 14 shards, 000_00000.parquet .. 013_00000.parquet (~2.15 GB).
FINEWEB_SAMPLE = tuple(f"sample/10BT/{i:03d}_00000.parquet" for i in range(14))
DEFAULT_ENDPOINT = "https://huggingface.co"
MAX_SLICE_BYTES = 256 * 1024
# A real row group's text chunk is a few MB; refuse anything absurd instead of pulling it.
MAX_FETCH_BYTES = 64 * 1024 * 1024
# pyarrow reads the footer and each column chunk with one large read each, so no fsspec
# cache: a read costs exactly the bytes pyarrow asks for (read-ahead would add a block to
# every chunk). block_size must still be > 0, or fsspec streams the file instead.
BLOCK_SIZE = 64 * 1024
CACHE_TYPE = "none"
# Shards tried per fetch: bounds how long one /data request can spend on a dead network.
TRIES_PER_FETCH = 3
BACKOFF_S = 30.0
MAX_BACKOFF_S = 900.0
# A /data request waits this long for a fetch, then gets built-in text (the fetch goes on
# and its slices serve the next requests); below the peers' 20 s client timeout.
WAIT_S = 12.0
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0


class ShardError(Exception):
    """A shard cannot be used (no size, no range support, no text column, too big)."""


@dataclass(frozen=True)
class Slice:
    text: str
    shard: str
    row_group: int


@dataclass
class _Shard:
    name: str
    url: str
    size: int | None = None
    meta: Any = None  # pyarrow.parquet.FileMetaData once the footer was read
    failures: int = 0
    retry_at: float = 0.0


def resolve_endpoint(endpoint: str | None) -> str:
    """``endpoint``, else ``$HF_ENDPOINT`` (the Hub's mirror convention), else the Hub."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    """True when the user asked huggingface_hub to stay offline (``HF_HUB_OFFLINE``)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def file_url(repo: str, name: str, endpoint: str, revision: str = "main") -> str:
    """The resolve URL of one file of a dataset repo at ``revision``."""
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo, name, repo_type="dataset", revision=revision, endpoint=endpoint)


def _cut(text: str, max_bytes: int) -> str:
    raw = text.encode()
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode(errors="ignore")  # never split a UTF-8 sequence


def pack_documents(docs: list[str], max_bytes: int) -> list[str]:
    """Consecutive documents joined by blank lines, each slice at most ``max_bytes`` UTF-8.

    A document longer than a whole slice is cut to ``max_bytes``; empty ones are dropped.
    """
    slices: list[str] = []
    cur: list[str] = []
    used = 0
    for doc in docs:
        doc = _cut(doc.strip(), max_bytes - 1) if doc else ""
        if not doc:
            continue
        size = len(doc.encode()) + 2  # the blank line (or final newline) after it
        if cur and used + size > max_bytes:
            slices.append("\n\n".join(cur) + "\n")
            cur, used = [], 0
        cur.append(doc)
        used += size
    if cur:
        slices.append("\n\n".join(cur) + "\n")
    return slices


class FineWebReader:
    """Random slices of a Hub dataset over range requests; ``None`` when no shard works.

    ``files`` (with ``revision``) skips the listing: tests and :meth:`prepare` pass the
    shards; without them the first fetch lists ``dataset``'s shards.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        dataset: DatasetSpec = DEFAULT_DATASET,
        files: Sequence[str] | None = None,
        revision: str = "main",
        max_bytes: int = MAX_SLICE_BYTES,
        max_fetch_bytes: int = MAX_FETCH_BYTES,
        backoff: float = BACKOFF_S,
        max_backoff: float = MAX_BACKOFF_S,
        wait: float = WAIT_S,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        read_timeout: float = READ_TIMEOUT_S,
        block_size: int = BLOCK_SIZE,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (files is not None and not files) or max_bytes < 64 or block_size < 1:
            raise ValueError("files (if given) non-empty, max_bytes >= 64 and "
                             "block_size >= 1 required")
        self.endpoint = resolve_endpoint(endpoint)
        self.offline = hub_offline()
        self.dataset = dataset
        self.shards: list[_Shard] = []
        self._listed = False
        self._list_failures = 0
        self._list_retry_at = 0.0
        if files is not None:
            self._use(dataset, revision, files)
        self.max_bytes = max_bytes
        self.max_fetch_bytes = max_fetch_bytes
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.wait = wait
        self.block_size = block_size
        self.rng = rng or random.Random()
        self.clock = clock
        self._timeouts = (connect_timeout, read_timeout)
        self._fs: Any = None
        self._pending: deque[Slice] = deque()
        self._fill_task: asyncio.Task[bool] | None = None
        self._down = False  # in an outage that was already logged
        self.fetches = 0  # row groups read, for tests and the log

    # ------------------------------------------------------------------ async API
    async def next_slice(self) -> Slice | None:
        """A slice of FineWeb-Edu text, or ``None``: serve the built-in corpus instead."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while not self._pending:
            if self.offline:
                self._note_down("HF_HUB_OFFLINE is set")
                return None
            if not self._available():
                self._note_down("every shard failed recently")
                return None
            task = self._fill_task
            if task is None or task.done():
                task = self._fill_task = asyncio.create_task(self._fill())
            remaining = deadline - loop.time()
            try:
                # shield: a request that gives up must not cancel a fetch others share
                ok = await asyncio.wait_for(asyncio.shield(task), max(remaining, 0.0))
            except asyncio.TimeoutError:
                log.debug("fineweb fetch still running after %.1f s; built-in for now",
                          self.wait)
                return None
            except Exception:  # a bug here must cost one response its source, not a 500
                log.exception("fineweb fetch crashed; serving the built-in corpus")
                return None
            if not ok and not self._pending and self._listed:
                self._note_down(f"no shard answered at {self.endpoint}")
                return None
        return self._pending.popleft()

    async def close(self) -> None:
        task, self._fill_task = self._fill_task, None
        if task is not None and not task.done():
            task.cancel()
        fs, self._fs = self._fs, None
        if fs is not None and getattr(fs, "_session", None) is not None:
            from fsspec.implementations.http import HTTPFileSystem

            await asyncio.to_thread(HTTPFileSystem.close_session, fs.loop, fs._session)

    def describe(self) -> dict[str, Any]:
        """What this reader serves, for /healthz and the dashboard."""
        return {**self.dataset.describe(),
                "shards": len(self.shards) if self._listed else None}

    def _use(self, dataset: DatasetSpec, revision: str, files: Sequence[str]) -> None:
        self.dataset = dataset
        self.shards = [_Shard(f, file_url(dataset.repo, f, self.endpoint, revision))
                       for f in files]
        self._listed = True

    def _available(self) -> bool:
        now = self.clock()
        if not self._listed:
            return self._list_retry_at <= now
        return any(s.retry_at <= now for s in self.shards)

    def _note_down(self, why: str) -> None:
        if not self._down:
            self._down = True
            log.warning("/data: %s unavailable (%s); serving the built-in corpus",
                        self.dataset.repo, why)

    # ------------------------------------------------------------------ listing
    def _list(self) -> None:
        """List the dataset's shards (blocking); a failure backs the listing off."""
        try:
            listing = list_shards(self.dataset, self.endpoint, sum(self._timeouts))
        except (DatasetMissing, DatasetUnreachable) as exc:
            self._list_failures += 1
            delay = min(self.max_backoff, self.backoff * 2 ** (self._list_failures - 1))
            self._list_retry_at = self.clock() + delay
            log.debug("listing %s failed (%s); retry in %.0f s", self.dataset.repo, exc, delay)
            raise
        self._use(listing.spec, listing.revision, listing.files)

    def prepare(self) -> None:
        """List the shards and check the text column in the first one's footer (blocking).

        For ``daisyweb-signal`` at start: raises :class:`DatasetMissing` for a dataset,
        config, split or column that is not there (a refusal), and
        :class:`DatasetUnreachable` when the Hub cannot be asked (the server starts
        anyway and /data retries).
        """
        if not self._listed:
            self._list()
        shard = self.shards[0]
        try:
            self._footer(shard)
        except DatasetMissing:
            raise
        except Exception as exc:  # noqa: BLE001 - the network, not the dataset
            raise DatasetUnreachable(f"cannot read {shard.name}: {type(exc).__name__}: "
                                     f"{str(exc)[:200]}") from None

    async def _fill(self) -> bool:
        """Read one row group of one working shard into the pending slices."""
        if not self._listed:
            try:
                await asyncio.to_thread(self._list)
            except (DatasetMissing, DatasetUnreachable) as exc:
                self._note_down(str(exc))
                return False
        now = self.clock()
        ready = [s for s in self.shards if s.retry_at <= now]
        self.rng.shuffle(ready)
        for shard in ready[:TRIES_PER_FETCH]:
            try:
                rg, slices = await asyncio.to_thread(self._read, shard)
            except Exception as exc:  # noqa: BLE001 - any failure just skips the shard
                self._failed(shard, exc)
                continue
            shard.failures, shard.retry_at = 0, 0.0
            if self._down:
                self._down = False
                log.info("/data: %s reachable again (%s)", self.dataset.repo, shard.name)
            self.fetches += 1
            self._pending.extend(Slice(t, shard.name, rg) for t in slices)
            if self._pending:
                return True
        return False

    def _failed(self, shard: _Shard, exc: BaseException) -> None:
        shard.failures += 1
        delay = min(self.max_backoff, self.backoff * 2 ** (shard.failures - 1))
        shard.retry_at = self.clock() + delay
        log.debug("fineweb shard %s failed (%s: %s); retry in %.0f s",
                  shard.name, type(exc).__name__, exc, delay)

    # ------------------------------------------------------------------ blocking part
    def _filesystem(self) -> Any:
        if self._fs is None:
            import aiohttp
            from fsspec.implementations.http import HTTPFileSystem

            connect, total = self._timeouts
            self._fs = HTTPFileSystem(
                skip_instance_cache=True,  # our own session and timeouts, not a shared one
                block_size=self.block_size,
                cache_type=CACHE_TYPE,
                client_kwargs={
                    "timeout": aiohttp.ClientTimeout(total=total, sock_connect=connect),
                    "trust_env": False,  # only the endpoint we were given, no proxy detour
                },
            )
        return self._fs

    def _open(self, shard: _Shard) -> Any:
        # size= known: fsspec skips its HEAD and returns a range-reading HTTPFile
        return self._filesystem().open(
            shard.url, "rb", size=shard.size, block_size=self.block_size, cache_type=CACHE_TYPE
        )

    def _footer(self, shard: _Shard) -> Any:
        """The shard's parquet metadata, read once (HEAD + one footer range)."""
        import pyarrow.parquet as pq

        if shard.meta is None:
            info = self._filesystem().info(shard.url)
            size = info.get("size")
            if not size:
                raise ShardError("the server sent no size")
            if info.get("partial") is False:
                # fsspec would stream the whole multi-GB file instead of ranges
                raise ShardError("the server refuses range requests")
            shard.size = int(size)
            with self._open(shard) as f:
                meta = pq.ParquetFile(f).metadata
            self._check_column(shard, meta)
            if meta.num_row_groups < 1:
                raise ShardError("no row groups")
            shard.meta = meta
        return shard.meta

    def _check_column(self, shard: _Shard, meta: Any) -> None:
        import pyarrow as pa

        col = self.dataset.text_column
        schema = meta.schema.to_arrow_schema()
        if col not in schema.names:
            raise DatasetMissing(
                f"dataset {self.dataset.repo} has no column {quoted(col)} in {shard.name} "
                f"(its columns: {', '.join(quoted(n, 40) for n in schema.names[:20])}); "
                "pass --text-column")
        kind = schema.field(col).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DatasetMissing(f"column {quoted(col)} of dataset {self.dataset.repo} holds "
                                 f"{kind}, not text; pass --text-column")

    def _read(self, shard: _Shard) -> tuple[int, list[str]]:
        import pyarrow.parquet as pq

        meta = self._footer(shard)
        col = self.dataset.text_column
        rg = self.rng.randrange(meta.num_row_groups)
        group = meta.row_group(rg)
        chunks = [group.column(i) for i in range(group.num_columns)
                  if group.column(i).path_in_schema == col]
        if not chunks:
            raise ShardError(f"row group {rg} has no {quoted(col)} column chunk")
        cost = chunks[0].total_compressed_size
        if cost > self.max_fetch_bytes:
            raise ShardError(f"row group {rg} text is {cost} bytes (> {self.max_fetch_bytes})")
        with self._open(shard) as f:
            table = pq.ParquetFile(f, metadata=meta).read_row_group(rg, columns=[col])
        docs = [d for d in table.column(col).to_pylist() if isinstance(d, str)]
        return rg, pack_documents(docs, self.max_bytes)
