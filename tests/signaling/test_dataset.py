"""``daisyweb-signal --dataset``: any parquet dataset a Hub (here a local fake one) lists.

The fake Hub runs in a thread on 127.0.0.1 (so ``main`` can run in the test's thread):
the dataset API ``huggingface_hub`` lists shards with, and resolve URLs honouring Range.
Its dataset ``someone/essays`` keeps its text in a column named ``body``.
"""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from signaling.cli import main, parse_args, prepared_reader
from signaling.hubdata import DatasetMissing, DatasetSpec, glob_match, select_files

ROOT = Path(__file__).resolve().parents[2]
REPO = "someone/essays"
SHA = "ab" * 20
CARD = {"configs": [
    {"config_name": "small", "default": True,
     "data_files": [{"split": "train", "path": "small/train-*.parquet"},
                    {"split": "test", "path": "small/test-*.parquet"}]},
    {"config_name": "all", "data_files": "**/*.parquet"},
]}


def _parquet(tag: str) -> bytes:
    body = [f"[{tag} {i}] " + "essay words " * 50 for i in range(30)]
    table = pa.table({"id": list(range(30)), "body": body})
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=10)
    return out.getvalue()


FILES = {
    "small/train-00000.parquet": _parquet("train0"),
    "small/train-00001.parquet": _parquet("train1"),
    "small/test-00000.parquet": _parquet("test0"),
    "README.md": b"---\nconfigs: ...\n---\n",
}


class FakeHub(BaseHTTPRequestHandler):
    log: list[str] = []

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?")[0]
        FakeHub.log.append(f"{self.command} {path}")
        if path.startswith("/api/datasets/"):
            repo = path.removeprefix("/api/datasets/").split("/revision/")[0]
            if repo != REPO:
                self._send(404, b'{"error": "Repository not found"}',
                           {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})
                return
            info = {"id": REPO, "sha": SHA, "cardData": CARD,
                    "siblings": [{"rfilename": f} for f in sorted(FILES)]}
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
            return
        m = re.fullmatch(rf"/datasets/{re.escape(REPO)}/resolve/{SHA}/(.+)", path)
        if m is None or m[1] not in FILES:
            self._send(404, b"not found", {})
            return
        data = FILES[m[1]]
        r = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if r is None:
            self._send(200, data, {"Accept-Ranges": "bytes"})
            return
        start, end = int(r[1]), min(int(r[2] or len(data) - 1), len(data) - 1)
        self._send(206, data[start:end + 1], {
            "Accept-Ranges": "bytes", "Content-Range": f"bytes {start}-{end}/{len(data)}"})


@pytest.fixture(scope="module")
def hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------- pure parts
def test_glob_follows_the_card_conventions() -> None:
    assert glob_match("sample/10BT/*", "sample/10BT/000_00000.parquet")
    assert not glob_match("data/*", "data/CC/000.parquet")  # * stays in one segment
    assert glob_match("data/*/*", "data/CC/000.parquet")
    assert glob_match("**/*.parquet", "a.parquet") and glob_match("**/*.parquet", "a/b/c.parquet")
    assert glob_match("./x-?.parquet", "x-1.parquet")
    assert not glob_match("x-?.parquet", "x-10.parquet")


def test_files_of_a_repo_without_configs_follow_the_split_names() -> None:
    files = ["data/train-0.parquet", "data/train-1.parquet", "data/test-0.parquet", "x.md"]
    assert select_files(DatasetSpec("a/b"), files, {}) == (
        "default", ["data/train-0.parquet", "data/train-1.parquet"])
    assert select_files(DatasetSpec("a/b", split="test"), files, None)[1] == [
        "data/test-0.parquet"]
    with pytest.raises(DatasetMissing, match=r"no split 'validation' \(its splits: 'test', "):
        select_files(DatasetSpec("a/b", split="validation"), files, {})
    with pytest.raises(DatasetMissing, match="declares no configs"):
        select_files(DatasetSpec("a/b", config="small"), files, {})
    # no split named anywhere: everything is train
    assert select_files(DatasetSpec("a/b"), ["p/0.parquet"], {})[1] == ["p/0.parquet"]
    with pytest.raises(DatasetMissing, match="no parquet files"):
        select_files(DatasetSpec("a/b"), ["data/train.jsonl"], {})


def test_configs_and_the_default_config() -> None:
    files = sorted(FILES)
    assert select_files(DatasetSpec(REPO, None), files, CARD) == (
        "small", ["small/train-00000.parquet", "small/train-00001.parquet"])
    assert select_files(DatasetSpec(REPO, "all"), files, CARD)[1] == [
        f for f in files if f.endswith(".parquet")]
    two = {"configs": [{"config_name": "a", "data_files": "a/*"},
                       {"config_name": "b", "data_files": "b/*"}]}
    with pytest.raises(DatasetMissing, match="none is the default; pass --config"):
        select_files(DatasetSpec(REPO), ["a/x.parquet"], two)
    with pytest.raises(DatasetMissing, match=r"no config 'c' \(its configs: 'a', 'b'\)"):
        select_files(DatasetSpec(REPO, "c"), ["a/x.parquet"], two)
    with pytest.raises(DatasetMissing, match="has no split 'dev'"):
        select_files(DatasetSpec(REPO, "small", split="dev"), files, CARD)
    hostile = {"configs": [{"config_name": "x\x1b[31m" * 40, "data_files": "a/*"}]}
    with pytest.raises(DatasetMissing) as exc:
        select_files(DatasetSpec(REPO, "y"), [], hostile)
    assert "\x1b" not in str(exc.value) and len(str(exc.value)) < 300


# ---------------------------------------------------------------------- the command
def test_another_dataset_and_column_served_by_a_real_server(hub: str) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "--host", "127.0.0.1", "--port", str(port),
         "--dataset", REPO, "--text-column", "body", "--hf-endpoint", hub],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
                    health = json.load(r)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
                time.sleep(0.1)
        # listed and checked at start: the card's default config, its train split
        assert health["data"] == {"source": "hub", "last": None, "dataset": REPO,
                                  "config": "small", "split": "train",
                                  "text_column": "body", "shards": 2}
        with urllib.request.urlopen(base + "/data", timeout=20) as r:
            source, text = r.headers["X-Daisyweb-Source"], r.read().decode()
        assert source == "hub"
        docs = text.rstrip("\n").split("\n\n")
        assert len(docs) == 10 and all(re.match(r"\[train[01] \d+\] essay", d) for d in docs)
        with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
            assert json.load(r)["data"]["last"] == "hub"
    finally:
        proc.terminate()
        out = proc.communicate(timeout=10)[0]
    assert f"/data serves {REPO} (small, split train, column body): 2 parquet shards" in out


@pytest.mark.parametrize(("flags", "says"), [
    (["--dataset", "someone/nothing"], "no dataset someone/nothing at "),
    (["--dataset", REPO, "--config", "big"],
     "dataset someone/essays has no config 'big' (its configs: 'small', 'all')"),
    (["--dataset", REPO, "--split", "validation"],
     "config 'small' of dataset someone/essays has no split 'validation' "
     "(its splits: 'train', 'test')"),
    (["--dataset", REPO], "dataset someone/essays has no column 'text' in "
                          "small/train-00000.parquet (its columns: 'id', 'body'); "
                          "pass --text-column"),
    (["--dataset", REPO, "--text-column", "id"],
     "column 'id' of dataset someone/essays holds int64, not text"),
])
def test_a_missing_repo_config_split_or_column_is_refused_at_start(
        hub: str, flags: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--host", "127.0.0.1", "--port", str(_free_port()), "--hf-endpoint", hub,
                 *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("daisyweb-signal: --dataset: ") and says in err, err
    assert "\n" not in err


@pytest.mark.parametrize(("flags", "says"), [
    (["--dataset", "not a repo"], "--dataset must be a Hub repo id"),
    (["--data", "builtin", "--dataset", REPO], "--dataset needs a Hub dataset"),
    (["--data", "builtin", "--text-column", "body"], "--text-column needs a Hub dataset"),
    (["--config", ""], "--config must be 1-200 printable characters"),
    (["--split", "a\tb"], "--split must be 1-200 printable characters"),
])
def test_bad_dataset_flags_are_one_line(flags: list[str], says: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(flags)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and says in err and "\n" not in err


def test_default_dataset_is_fineweb_edu_sample() -> None:
    spec = parse_args([]).dataset_spec
    assert spec == DatasetSpec("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", "text")
    # another repo without --config takes its card's default config
    assert parse_args(["--dataset", REPO]).dataset_spec.config is None


def test_an_unreachable_hub_at_start_is_no_refusal(caplog: pytest.LogCaptureFixture) -> None:
    port = _free_port()  # nobody listens
    args = parse_args(["--dataset", REPO, "--hf-endpoint", f"http://127.0.0.1:{port}"])
    caplog.set_level("WARNING", logger="daisyweb.signal")
    reader = prepared_reader(args)
    assert reader.describe()["shards"] is None  # the first /data lists again
    assert any("not checked at start" in r.getMessage() for r in caplog.records)
