"""The dataset reader against a local server laid out like the Hub (its file resolve
URLs honouring Range, and the dataset API huggingface_hub lists shards with)."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import socket
from pathlib import Path

import aiohttp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from signaling.fineweb import (
    FINEWEB_SAMPLE,
    MAX_SLICE_BYTES,
    FineWebReader,
    file_url,
    pack_documents,
    resolve_endpoint,
)
from signaling.server import FINEWEB, create_app
from tests.signaling.local_server import serving

ROW_GROUPS = 8
ROWS = 40
PREFIX = "/datasets/HuggingFaceFW/fineweb-edu/resolve/main/"
SHA = "5e" * 20  # the commit the fake Hub lists; resolve URLs carry it
FINEWEB_CARD = {"configs": [
    {"config_name": "default", "data_files": [{"split": "train", "path": "data/*/*"}]},
    {"config_name": "sample-10BT", "data_files": [{"split": "train",
                                                   "path": "sample/10BT/*"}]},
]}


def _sample(n: int) -> list[str]:
    return list(FINEWEB_SAMPLE[:n])
DOC_RE = re.compile(r"^\[rg(\d+) row(\d+)\] ")


def _doc(rng: random.Random, g: int, r: int) -> str:
    words = ("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
             for _ in range(700))
    return f"[rg{g} row{r}] " + " ".join(words)


@pytest.fixture(scope="module")
def shard_file(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """A few-MB parquet shard: 8 row groups of distinctive text plus a bulkier column."""
    rng = random.Random(7)
    path = tmp_path_factory.mktemp("fw") / "shard.parquet"
    schema = pa.schema([("text", pa.string()), ("id", pa.string()), ("filler", pa.binary())])
    docs: dict[str, int] = {}
    with pq.ParquetWriter(path, schema) as w:
        for g in range(ROW_GROUPS):
            texts = [_doc(rng, g, r) for r in range(ROWS)]
            docs.update((t, g) for t in texts)
            w.write_table(pa.table({
                "text": texts,
                "id": [f"<urn:{g}:{r}>" for r in range(ROWS)],
                "filler": [rng.randbytes(12_000) for _ in range(ROWS)],
            }, schema=schema))
    return path, docs


class Hub:
    """Serves shard names listed in ``files`` at the Hub's resolve layout (any revision)
    and the dataset API listing them with ``card``; others 404."""

    def __init__(self, data: bytes, files: set[str], delay: float = 0.0,
                 repo: str = "HuggingFaceFW/fineweb-edu", card: dict | None = None) -> None:
        self.data = data
        self.files = files
        self.delay = delay
        self.repo = repo
        self.card = FINEWEB_CARD if card is None else card
        self.listed = set(files)  # what the API lists (files may later vanish)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, name, range)
        self.api_calls = 0
        self.bytes_sent = 0
        self.ranges_ok = True

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/api/datasets/"):
            return self.api(request)
        m = re.fullmatch(rf"/datasets/{re.escape(self.repo)}/resolve/([^/]+)/(.+)",
                         request.path)
        name = m[2] if m else request.path
        rng = request.headers.get("Range")
        self.requests.append((request.method, name, rng))
        if self.delay:
            await asyncio.sleep(self.delay)
        if m is None or m[1] not in ("main", SHA) or name not in self.files:
            raise web.HTTPNotFound()
        size = len(self.data)
        headers = {"Accept-Ranges": "bytes" if self.ranges_ok else "none"}
        if request.method == "HEAD":
            return web.Response(headers=headers | {"Content-Length": str(size)})
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if m is None or not self.ranges_ok:
            self.bytes_sent += size
            return web.Response(body=self.data, headers=headers)
        start, end = int(m[1]), min(int(m[2] or size - 1), size - 1)
        body = self.data[start:end + 1]
        self.bytes_sent += len(body)
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return web.Response(status=206, body=body, headers=headers)

    def api(self, request: web.Request) -> web.Response:
        """GET /api/datasets/REPO: what huggingface_hub's dataset_info reads."""
        self.api_calls += 1
        repo = request.path.removeprefix("/api/datasets/").split("/revision/")[0]
        if repo != self.repo:
            # what the Hub sends for a repo that is not there (or private)
            return web.json_response({"error": "Repository not found"}, status=404,
                                     headers={"X-Error-Code": "RepoNotFound"})
        siblings = [{"rfilename": f} for f in sorted(self.listed | {"README.md"})]
        return web.json_response({"id": repo, "sha": SHA, "siblings": siblings,
                                  "cardData": self.card})

    def heads(self, name: str) -> int:
        return sum(1 for m, n, _ in self.requests if m == "HEAD" and n == name)

    def footer_reads(self, name: str) -> int:
        """GETs whose range reaches the file's last byte: the parquet footer."""
        last = len(self.data) - 1
        n = 0
        for m, nm, r in self.requests:
            g = re.fullmatch(r"bytes=(\d+)-(\d+)", r or "")
            if m == "GET" and nm == name and g and int(g[2]) >= last:
                n += 1
        return n


@pytest.fixture
def localhost_only(monkeypatch):
    """Fail the test if anything connects (or resolves) beyond 127.0.0.1."""
    seen: list[object] = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_gai = socket.getaddrinfo

    def check(addr: object) -> None:
        seen.append(addr)
        host = addr[0] if isinstance(addr, tuple) else addr
        assert host == "127.0.0.1", f"connection to {addr!r}"

    def connect(self, addr):
        check(addr)
        return real_connect(self, addr)

    def connect_ex(self, addr):
        check(addr)
        return real_connect_ex(self, addr)

    def gai(host, *a, **k):
        assert host in ("127.0.0.1", None), f"name lookup of {host!r}"
        return real_gai(host, *a, **k)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", gai)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield seen


@pytest.fixture
async def hub(shard_file, localhost_only):
    data = shard_file[0].read_bytes()
    h = Hub(data, {"sample/10BT/000_00000.parquet"})
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", h.handle)
    async with serving(app) as url:
        h.url = url
        yield h
    assert localhost_only, "the test made no connection at all"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
async def make_reader():
    readers: list[FineWebReader] = []

    def make(endpoint: str, **kw) -> FineWebReader:
        kw.setdefault("rng", random.Random(3))
        r = FineWebReader(endpoint, **kw)
        readers.append(r)
        return r

    yield make
    for r in readers:
        await r.close()


async def _get(app: web.Application) -> tuple[str, str]:
    async with serving(app) as url, aiohttp.ClientSession() as s, s.get(url + "/data") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        return await r.text(), r.headers["X-Daisyweb-Source"]


def _docs_of(text: str) -> list[str]:
    return text.rstrip("\n").split("\n\n")


# ---------------------------------------------------------------------- pure parts
def test_urls_follow_the_hub_layout(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert len(FINEWEB_SAMPLE) == 14
    assert file_url("HuggingFaceFW/fineweb-edu", FINEWEB_SAMPLE[13],
                    resolve_endpoint(None)) == (
        "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/"
        "sample/10BT/013_00000.parquet")
    assert file_url("HuggingFaceFW/fineweb-edu", "x.parquet", "http://127.0.0.1:9").startswith(
        "http://127.0.0.1:9" + PREFIX)
    assert file_url("a/b", "d/x.parquet", "http://127.0.0.1:9", SHA) == (
        f"http://127.0.0.1:9/datasets/a/b/resolve/{SHA}/d/x.parquet")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:5/")
    assert resolve_endpoint(None) == "http://127.0.0.1:5"
    assert resolve_endpoint("http://127.0.0.1:6") == "http://127.0.0.1:6"  # flag wins


def test_pack_documents_whole_docs_bounded():
    docs = ["a" * 30, "", "b" * 30, "c" * 30, "é" * 100]
    out = pack_documents(docs, 70)
    assert out[0] == "a" * 30 + "\n\n" + "b" * 30 + "\n"
    assert out[1] == "c" * 30 + "\n"
    assert all(len(s.encode()) <= 70 for s in out)
    # the oversize document is cut on a character boundary, not dropped
    assert out[2].strip() and set(out[2].strip()) == {"é"}
    assert pack_documents(["x" * 10] * 100, MAX_SLICE_BYTES) == ["\n\n".join(["x" * 10] * 100)
                                                                 + "\n"]


# ---------------------------------------------------------------------- over HTTP
async def test_data_serves_a_row_group_from_the_shard(hub, shard_file, make_reader):
    path, docs = shard_file
    size = path.stat().st_size
    assert size > 3_000_000
    reader = make_reader(hub.url, files=_sample(1))
    text, source = await _get(create_app(data_source="fineweb", fineweb=reader))
    assert source == "hub"
    got = _docs_of(text)
    assert got and all(d in docs for d in got)
    assert len({docs[d] for d in got}) == 1  # one row group
    assert len(got) == ROWS
    assert len(text.encode()) <= MAX_SLICE_BYTES
    # the first slice pays HEAD + footer + one text chunk: a small fraction of the file
    first = hub.bytes_sent
    assert first < size / 8, (first, size)
    assert hub.footer_reads("sample/10BT/000_00000.parquet") == 1


async def test_footer_cached_and_each_slice_costs_one_text_chunk(hub, shard_file, make_reader):
    path, docs = shard_file
    size = path.stat().st_size
    name = "sample/10BT/000_00000.parquet"
    reader = make_reader(hub.url, files=_sample(1))
    seen_groups = set()
    costs = []
    for _ in range(6):
        before = hub.bytes_sent
        piece = await reader.next_slice()
        assert piece is not None and piece.shard == name
        costs.append(hub.bytes_sent - before)
        got = _docs_of(piece.text)
        assert {docs[d] for d in got} == {piece.row_group}
        seen_groups.add(piece.row_group)
    assert hub.heads(name) == 1 and hub.footer_reads(name) == 1
    assert len(seen_groups) > 1  # random row groups, not always the same one
    # footer cached: later slices fetch only the text chunk, not the bulky filler column
    assert max(costs[1:]) < size / 16, (costs, size)
    assert reader.fetches == 6


async def test_small_slices_come_from_one_fetch(hub, shard_file, make_reader):
    _, docs = shard_file
    reader = make_reader(hub.url, files=_sample(1), max_bytes=20_000)
    first = await reader.next_slice()
    assert first is not None
    after_first = len(hub.requests)
    rest = [await reader.next_slice() for _ in range(3)]
    assert len(hub.requests) == after_first  # served from the fetched row group
    for piece in [first, *rest]:
        assert len(piece.text.encode()) <= 20_000
        assert all(d in docs for d in _docs_of(piece.text))


async def test_404_shard_is_skipped_and_backs_off(hub, make_reader):
    hub.files = {"sample/10BT/002_00000.parquet"}
    clock = Clock()
    reader = make_reader(hub.url, files=_sample(3), clock=clock, backoff=30.0)
    for _ in range(8):
        piece = await reader.next_slice()
        assert piece is not None and piece.shard == "sample/10BT/002_00000.parquet"
    dead = ["sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"]
    # every dead shard was tried (tries per fetch >= shards) but only once: it backs off
    assert [hub.heads(n) for n in dead] == [1, 1]
    clock.t += 31
    for _ in range(4):
        assert await reader.next_slice() is not None
    assert [hub.heads(n) for n in dead] == [2, 2]  # retried after the backoff
    clock.t += 31  # second failure doubled the backoff: not retried yet
    for _ in range(4):
        assert await reader.next_slice() is not None
    assert [hub.heads(n) for n in dead] == [2, 2]


async def test_all_shards_failing_serves_builtin_and_logs_once(hub, make_reader, caplog):
    hub.files = set()
    clock = Clock()
    reader = make_reader(hub.url, files=_sample(2), clock=clock)
    app = create_app(data_source="fineweb", fineweb=reader)
    caplog.set_level(logging.INFO, logger="daisyweb.fineweb")
    texts = []
    for _ in range(3):
        text, source = await _get(app)
        assert source == "builtin"
        texts.append(text)
    assert all(t.strip() for t in texts)
    down = [r for r in caplog.records if "built-in" in r.getMessage()]
    assert len(down) == 1 and down[0].levelno == logging.WARNING
    # one look per shard (fsspec asks HEAD, then a GET for headers only); then both back
    # off and later requests cause no traffic
    assert hub.heads("sample/10BT/000_00000.parquet") == 1
    assert hub.heads("sample/10BT/001_00000.parquet") == 1
    assert len(hub.requests) == 4 and hub.bytes_sent == 0
    clock.t += 31
    assert await reader.next_slice() is None
    assert len(hub.requests) == 8
    assert len([r for r in caplog.records if "built-in" in r.getMessage()]) == 1
    # the Hub comes back: FineWeb again, and the log says so
    hub.files = {"sample/10BT/000_00000.parquet", "sample/10BT/001_00000.parquet"}
    clock.t += 200
    assert await reader.next_slice() is not None
    assert any("reachable again" in r.getMessage() for r in caplog.records)


async def test_connection_refused_falls_back(localhost_only, make_reader, caplog):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reader = make_reader(f"http://127.0.0.1:{port}", files=_sample(2))
    caplog.set_level(logging.WARNING, logger="daisyweb.fineweb")
    text, source = await _get(create_app(data_source="fineweb", fineweb=reader))
    assert source == "builtin" and text.strip()
    assert len(caplog.records) == 1


async def test_no_range_support_is_refused(hub, make_reader):
    hub.ranges_ok = False  # Accept-Ranges: none: fsspec would stream the whole file
    reader = make_reader(hub.url, files=_sample(1))
    assert await reader.next_slice() is None
    assert hub.bytes_sent == 0


async def test_oversize_row_group_is_refused(hub, make_reader):
    reader = make_reader(hub.url, files=_sample(1), max_fetch_bytes=10_000)
    assert await reader.next_slice() is None
    footer_only = hub.bytes_sent
    assert footer_only < 100_000  # the footer, never the row group


async def test_slow_hub_gives_builtin_now_fineweb_later(hub, make_reader):
    hub.delay = 0.3
    reader = make_reader(hub.url, files=_sample(1), wait=0.1, max_bytes=20_000)
    assert await reader.next_slice() is None  # request did not wait for the fetch
    for _ in range(60):
        await asyncio.sleep(0.1)
        if reader._pending:
            break
    piece = await reader.next_slice()
    assert piece is not None  # the fetch went on and now feeds requests


async def test_concurrent_requests_share_one_fetch(hub, make_reader):
    reader = make_reader(hub.url, files=_sample(1), max_bytes=20_000)
    pieces = await asyncio.gather(*(reader.next_slice() for _ in range(5)))
    assert all(p is not None for p in pieces)
    assert len({p.text for p in pieces}) == 5
    assert reader.fetches == 1 and hub.heads("sample/10BT/000_00000.parquet") == 1


async def test_hf_hub_offline_env_serves_builtin(localhost_only, monkeypatch, make_reader, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reader = make_reader("http://127.0.0.1:9", files=_sample(1))
    caplog.set_level(logging.WARNING, logger="daisyweb.fineweb")
    assert await reader.next_slice() is None
    assert await reader.next_slice() is None
    assert len(caplog.records) == 1 and "HF_HUB_OFFLINE" in caplog.records[0].getMessage()
    assert localhost_only == []  # nothing was contacted


async def test_builtin_source_never_builds_a_reader():
    app = create_app(data_source="builtin")
    assert app[FINEWEB] is None
    text, source = await _get(app)
    assert source == "builtin" and text.strip()
    with pytest.raises(ValueError):
        create_app(data_source="bogus")


async def test_cli_app_reads_from_hf_endpoint(hub, shard_file):
    from signaling.cli import build_app, parse_args

    _, docs = shard_file
    hub.files = hub.listed = set(FINEWEB_SAMPLE) | {"data/CC-MAIN-2024-10/000_00000.parquet"}
    app = build_app(parse_args(["--hf-endpoint", hub.url]))  # default --data hub
    text, source = await _get(app)
    assert source == "hub" and all(d in docs for d in _docs_of(text))
    # the shards came from the Hub's listing of the sample-10BT config, at its commit
    reader = app[FINEWEB]
    assert hub.api_calls == 1 and [s.name for s in reader.shards] == list(FINEWEB_SAMPLE)
    assert all(f"/resolve/{SHA}/sample/10BT/" in s.url for s in reader.shards)


async def test_a_crashing_fetch_still_answers_builtin(hub, make_reader, monkeypatch, caplog):
    reader = make_reader(hub.url, files=_sample(1))

    async def boom() -> bool:
        raise RuntimeError("bug")

    monkeypatch.setattr(reader, "_fill", boom)
    caplog.set_level(logging.ERROR, logger="daisyweb.fineweb")
    text, source = await _get(create_app(data_source="fineweb", fineweb=reader))
    assert source == "builtin" and text.strip()
    assert any("crashed" in r.getMessage() for r in caplog.records)
