"""Partitions, with whole peers (``run_peer``: driver, step machine, trainer, saves) in
one process over the in-memory mesh of ``test_run``, whose links between two sides are
cut: every message between them is dropped and each side sees the other go down, as a
heartbeat timeout would show it. The processes stay up; only their links are blocked.

Two against two: neither half is a majority, so nobody commits after the cut and every
peer says it is cut off (then, finding no leader to rejoin, exits 3 with one line).
Three against two: the three go on and finish with one hash, the two stop.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from daisyweb.net import PeerDown
from daisyweb.peer import PeerError, run_peer
from daisyweb.protocol import wire
from tests.daisyweb.peer.test_run import FakeHub, FakeMesh, _opts, server
from tests.fault_peer import Hooks, faulty

__all__ = ["server"]  # the fixture, shared with test_run


class CuttableHub(FakeHub):
    def __init__(self) -> None:
        super().__init__()
        self.cut: set[frozenset[str]] = set()
        self.names: dict[str, str] = {}  # mesh id -> peer name

    def split(self, side: list[str], other: list[str]) -> None:
        """Cut every link between the named peers of ``side`` and ``other``."""
        ids = {name: pid for pid, name in self.names.items()}
        for p in side:
            for q in other:
                a, b = ids[p], ids[q]
                self.cut.add(frozenset((a, b)))
                self.meshes[a].events.put_nowait(PeerDown(b, "heartbeat timeout"))
                self.meshes[b].events.put_nowait(PeerDown(a, "heartbeat timeout"))


class CuttableMesh(FakeMesh):
    hub: CuttableHub

    async def start(self) -> None:
        await super().start()
        self.hub.names[self.self_id] = str(self.kw.get("name", ""))

    async def send(self, peer: str, message: wire.Message) -> None:
        if frozenset((self.self_id, peer)) in self.hub.cut:
            return  # the link is gone: nothing arrives
        await super().send(peer, message)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x]


async def _partitioned(tmp: Path, server: str, n: int, cut_at: int,
                       side: list[str]) -> dict[str, int]:
    hub = CuttableHub()
    names = [f"p{i}" for i in range(n)]

    async def one(i: int) -> int:
        name = names[i]
        extra: dict = ({"start": True, "steps": 60, "wait_peers": n} if i == 0 else {})
        await asyncio.sleep(0.05 * i)
        try:
            return await run_peer(
                _opts(tmp, server, name, join_timeout=10.0, **extra),
                driver_class=faulty(Hooks(step_delay=0.05)),
                mesh_factory=lambda *a, **k: CuttableMesh(hub, *a, **k))
        except PeerError as exc:
            print(f"daisyweb-peer: {exc}", file=sys.stderr)  # as the command prints it
            return exc.code

    async def cut() -> None:
        while len([r for r in _records(tmp / "p0.jsonl") if "end" not in r]) < cut_at:
            await asyncio.sleep(0.02)
        hub.split(side, [p for p in names if p not in side])

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await cut()
    codes = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    return dict(zip(names, codes, strict=True))


def test_two_against_two_nobody_commits_and_every_peer_says_so(
        tmp_path: Path, server: str, capsys: pytest.CaptureFixture[str]) -> None:
    codes = asyncio.run(_partitioned(tmp_path, server, 4, 3, ["p0", "p1"]))
    err = capsys.readouterr().err
    assert codes == {"p0": 3, "p1": 3, "p2": 3, "p3": 3}, err
    assert err.count("no majority; rejoining the group as a joiner") == 4, err
    assert err.count("cut off from its group, this peer could not rejoin") == 4, err
    last = {p: _records(tmp_path / f"{p}.jsonl")[-1]["step"] for p in codes}
    # nobody committed past the cut: every peer ends within a step of where it stood
    assert max(last.values()) - min(last.values()) <= 1 and max(last.values()) <= 5, last


def test_three_against_two_the_three_finish_and_the_two_stop(
        tmp_path: Path, server: str, capsys: pytest.CaptureFixture[str]) -> None:
    codes = asyncio.run(_partitioned(tmp_path, server, 5, 3, ["p3", "p4"]))
    err = capsys.readouterr().err
    assert codes == {"p0": 0, "p1": 0, "p2": 0, "p3": 3, "p4": 3}, err
    ends = {p: [r for r in _records(tmp_path / f"{p}.jsonl") if "end" in r] for p in codes}
    assert len({ends[p][-1]["weight_hash"] for p in ("p0", "p1", "p2")}) == 1
    assert all(ends[p][-1]["step"] == 60 for p in ("p0", "p1", "p2"))
    for p in ("p3", "p4"):
        steps = [r["step"] for r in _records(tmp_path / f"{p}.jsonl") if "end" not in r]
        assert max(steps) <= 5, (p, steps)  # the minority committed nothing after the cut
