"""A Hub (or mirror) listing with file names that point outside the dataset repo.

``../../../../train/secret.parquet`` in a repo's listing used to be fetched as
``/datasets/train/secret.parquet`` from the endpoint (the resolve URL normalized), and
``//host/x.parquet`` names another host. Such names are refused: the reader uses the
repo's other shards and never asks the endpoint for anything outside the repo.
"""

from __future__ import annotations

import io
import json
import logging
import re
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from signaling.fineweb import FineWebReader
from signaling.hubdata import DatasetMissing, DatasetSpec, safe_file_name, select_files
from tests.signaling.test_dataset import FakeHub

REPO = "someone/tricky"
SHA = "cd" * 20
HOSTILE = ["../../../../train/secret.parquet", "/etc/abs.parquet", "//evil.example/x.parquet",
           "data/../../up.parquet", "data//double.parquet", "./data/dot.parquet",
           "data\\back.parquet", "data/ctl\x1b[2J.parquet"]
GOOD = "data/train-00000.parquet"


def _parquet() -> bytes:
    table = pa.table({"text": [f"row {i} " + "words " * 40 for i in range(20)]})
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=10)
    return out.getvalue()


class TrickyHub(FakeHub):
    """test_dataset's fake Hub (its quiet log, replies and HEAD), listing hostile names."""

    paths: list[str] = []
    data = _parquet()

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?")[0]
        TrickyHub.paths.append(path)
        if path.startswith(f"/api/datasets/{REPO}"):
            info = {"id": REPO, "sha": SHA, "cardData": {},
                    "siblings": [{"rfilename": f} for f in [*HOSTILE, GOOD]]}
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
            return
        if path != f"/datasets/{REPO}/resolve/{SHA}/{GOOD}":
            self._send(404, b"not found", {})
            return
        r = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        data = TrickyHub.data
        if r is None:
            self._send(200, data, {"Accept-Ranges": "bytes"})
            return
        start, end = int(r[1]), min(int(r[2] or len(data) - 1), len(data) - 1)
        self._send(206, data[start:end + 1], {
            "Accept-Ranges": "bytes", "Content-Range": f"bytes {start}-{end}/{len(data)}"})


@pytest.fixture
def hub() -> Iterator[str]:
    TrickyHub.paths = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), TrickyHub)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_names_that_leave_the_repo_are_not_files_of_it() -> None:
    for name in HOSTILE:
        assert not safe_file_name(name), name
    for name in (GOOD, "x.parquet", "a/b/c-0.parquet", "data/..hidden.parquet", "a.b/c"):
        assert safe_file_name(name), name


def test_select_files_leaves_them_out_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="daisyweb.signal"):
        assert select_files(DatasetSpec(REPO), [*HOSTILE, GOOD], {}) == ("default", [GOOD])
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"lists {len(HOSTILE)} file names that point outside it" in warning
    assert "\x1b" not in warning  # quoted: the escape is shown, not sent to a terminal
    with pytest.raises(DatasetMissing, match="has no parquet files"):
        select_files(DatasetSpec(REPO), HOSTILE, {})
    card = {"configs": [{"config_name": "all", "data_files": "**"}]}
    assert select_files(DatasetSpec(REPO), [*HOSTILE, GOOD], card)[1] == [GOOD]


async def test_the_reader_never_asks_the_endpoint_for_a_path_outside_the_repo(
        hub: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    reader = FineWebReader(hub, dataset=DatasetSpec(REPO))
    try:
        reader.prepare()  # lists, then reads the first shard's footer
        assert [s.name for s in reader.shards] == [GOOD]
        piece = await reader.next_slice()
        assert piece is not None and piece.shard == GOOD and piece.text.startswith("row ")
    finally:
        await reader.close()
    outside = [p for p in TrickyHub.paths
               if not (p.startswith(f"/api/datasets/{REPO}")
                       or p.startswith(f"/datasets/{REPO}/resolve/{SHA}/"))]
    assert not outside, outside
    assert f"/datasets/{REPO}/resolve/{SHA}/{GOOD}" in TrickyHub.paths
