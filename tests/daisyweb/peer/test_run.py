"""Integration: a real signaling server, real aiortc, separate peer processes on 127.0.0.1.

Tiny model (width 16, 1 layer, seq 16, batch 2) and few steps, so the cost is process
start-up and ICE, not training. Every peer dumps the gradients it computed
(``DAISYWEB_TEST_DUMP_GRADS``) and writes ``--metrics``; the replay oracle re-runs each
committed step from those gradients in the recorded roster and must reproduce every
peer's per-step weight hash.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from daisyweb.checkpoints.checkpoint import Checkpoint, load_checkpoint
from daisyweb.model import init_params
from daisyweb.net import MeshError, PeerDown, PeerUp, Received
from daisyweb.peer import PeerError, PeerOptions, report, run_peer
from daisyweb.protocol import budget, framing, wire
from daisyweb.protocol.codec import codec_by_name
from daisyweb.training.config import RunConfig
from daisyweb.training.replay import (
    replay_hashes,
    replay_owned,
    replay_owned_rounds,
    replay_rounds,
)
from tests.fault_peer import Hooks, faulty

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--width", "16", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2",
        "--lr", "0.01", "--seed", "3"]
MODEL = [*TINY, "--sync-every", "1", "--codec", "f32"]  # lockstep: one gradient per step
# rounds of 2 local steps (the leader never lengthens them: --sync-max), int8
ROUNDS = [*TINY, "--sync-every", "2", "--sync-max", "2", "--codec", "int8"]
TIMEOUT = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "--host", "127.0.0.1", "--port", str(port),
         "--data", "builtin"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("signaling server did not start") from None
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@dataclass
class Peer:
    name: str
    proc: subprocess.Popen[str]
    metrics: Path
    log: Path

    def id(self) -> str:
        """The mesh id this peer printed when it joined."""
        for line in self.log.read_text().splitlines():
            if "joined as " in line:
                return line.split("joined as ", 1)[1].split()[0]
        raise AssertionError(f"{self.name} never joined:\n{self.log.read_text()}")

    def records(self) -> list[dict]:
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line]

    def steps(self) -> list[dict]:
        """Per-step records, a rolled-back step replaced by its recommit."""
        by_step: dict[int, dict] = {}
        for r in self.records():
            if "end" not in r:
                by_step[r["step"]] = r
        return [by_step[s] for s in sorted(by_step)]

    def end(self) -> dict:
        ends = [r for r in self.records() if "end" in r]
        assert ends, f"{self.name} wrote no end record:\n{self.log.read_text()}"
        return ends[-1]

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.name} hung:\n{self.log.read_text()}") from None


def _transports() -> Iterator[str | None]:
    """``$DAISYWEB_TEST_PEER_TRANSPORTS`` (comma-separated), cycled over the peers a group
    spawns in order (the leader first); unset: no flag, so the suite's aiortc. Set only
    inside a loopback-only network namespace (``tests/daisyweb/net/test_libwebrtc.py``)."""
    names = os.environ.get("DAISYWEB_TEST_PEER_TRANSPORTS")
    return itertools.cycle(names.split(",")) if names else itertools.repeat(None)


@dataclass
class Group:
    server: str
    tmp: Path
    room: str
    peers: list[Peer] = field(default_factory=list)
    transports: Iterator[str | None] = field(default_factory=_transports)

    @property
    def grads(self) -> Path:
        d = self.tmp / "grads"
        d.mkdir(exist_ok=True)
        return d

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None,
              module: tuple[str, ...] = ("tests.fault_peer",)) -> Peer:
        """A peer process: daisyweb-peer with the test faults of ``env``
        (``tests/fault_peer.py``); ``module``: what runs it instead (a hostile member:
        ``tests.hostile_peer`` and its attack)."""
        metrics = self.tmp / f"{name}.jsonl"
        log = self.tmp / f"{name}.log"
        cmd = [sys.executable, "-m", *module, "--server", self.server,
               "--room", self.room, "--name", name, "--ice-host", "127.0.0.1",
               "--approve", "auto", "--metrics", str(metrics), "--join-timeout", "60",
               *args]
        transport = next(self.transports)
        if transport is not None:
            cmd += ["--transport", transport]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1",
                        DAISYWEB_TEST_DUMP_GRADS=str(self.grads), **(env or {}))
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, text=True, env=full_env)
        p = Peer(name, proc, metrics, log)
        self.peers.append(p)
        return p

    def leader(self, *args: str, env: dict[str, str] | None = None) -> Peer:
        p = self.spawn("lead", "--start", *args, env=env)
        # The room's first peer is its host: let it in before the others.
        deadline = time.monotonic() + 30
        while "joined as" not in p.log.read_text():
            assert p.proc.poll() is None, p.log.read_text()
            assert time.monotonic() < deadline, p.log.read_text()
            time.sleep(0.05)
        return p

    def kill_all(self) -> None:
        for p in self.peers:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log.read_text()}" for p in self.peers)


@pytest.fixture
def group(server: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Group]:
    room = "t" + str(abs(hash(request.node.name)) % 10**10).zfill(10)
    g = Group(server, tmp_path, room)
    yield g
    g.kill_all()


def oracle(g: Group, peer: Peer, start: Checkpoint | None = None) -> list[str]:
    """Replay ``peer``'s committed steps from the dumped gradients (from ``start``)."""
    if any(r.get("owners") for r in peer.steps()):  # a group of three or more: owners
        owned = [(r["roster"], tuple(r.get("owners", ())),
                  {q: (g.grads / f"{q}-{r['step'] - 1}.bin").read_bytes() for q in r["roster"]},
                  r.get("shares", ())) for r in peer.steps()]
        if start is not None:
            return replay_owned(start.params, RunConfig.from_checkpoint(start).adam(), owned,
                                codec_by_name("f32"), start.adam)
        tiny = tiny_run()
        return replay_owned(init_params(tiny.model, tiny.seed), tiny.adam(), owned,
                            codec_by_name("f32"))
    spec = []
    for r in peer.steps():
        s = r["step"] - 1  # the record's step counts committed updates
        spec.append((r["roster"], {q: np.load(g.grads / f"{q}-{s}.npy") for q in r["roster"]},
                     r.get("shares", ())))
    if start is not None:
        return replay_hashes(start.params, RunConfig.from_checkpoint(start).adam(), spec,
                             start.adam)
    tiny = tiny_run()
    return replay_hashes(init_params(tiny.model, tiny.seed), tiny.adam(), spec)


def tiny_run() -> RunConfig:
    from daisyweb.data import default_tokenizer
    from daisyweb.model import ModelConfig

    vocab = default_tokenizer().vocab_size
    return RunConfig(model=ModelConfig(vocab=vocab, width=16, layers=1, heads=2, seq=16),
                     batch=2, steps=1, lr=0.01, seed=3)


def same_hashes(*peers: Peer) -> list[str]:
    """Per-step weight hashes, asserted identical on every given peer."""
    runs = [[(r["step"], r["weight_hash"]) for r in p.steps()] for p in peers]
    for p, r in zip(peers[1:], runs[1:], strict=True):
        common = dict(runs[0]).keys() & dict(r).keys()
        assert common, f"{p.name} has no step in common with {peers[0].name}"
        assert all(dict(runs[0])[s] == dict(r)[s] for s in common), p.name
    return [h for _, h in runs[0]]


# --------------------------------------------------------------- in-process driver
# The same driver (run_peer) over an in-memory mesh with the Mesh interface: fast
# checks of the driver's wiring (handshake, metrics, checkpoints) without ICE.


class FakeHub:
    def __init__(self) -> None:
        self.meshes: dict[str, FakeMesh] = {}
        self.all: list[FakeMesh] = []
        self.ids = iter(f"{i:04x}" for i in range(1, 1000))


class FakeMesh:
    drop_outgoing = None

    def __init__(self, hub: FakeHub, server: str, **kw: object) -> None:
        self.hub = hub
        self.kw = kw
        self.self_id = ""
        self.events: asyncio.Queue[object] = asyncio.Queue()
        self.status: list[dict] = []
        self.closed = False
        hub.all.append(self)

    async def start(self) -> None:
        self.self_id = next(self.hub.ids)
        for other in self.hub.meshes.values():
            other.events.put_nowait(PeerUp(self.self_id))
            self.events.put_nowait(PeerUp(other.self_id))
        self.hub.meshes[self.self_id] = self

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self.hub.meshes)

    async def next_event(self) -> object:
        return await self.events.get()

    async def send(self, peer: str, message: wire.Message) -> None:
        if self.drop_outgoing is not None and self.drop_outgoing(peer, message):
            return
        target = self.hub.meshes.get(peer)
        if target is None:
            raise MeshError(f"peer {peer} is not connected")
        data = wire.encode(message)  # through the real codec and framing
        r = framing.Reassembler()
        out = [r.feed(f) for f in framing.frame(data, 1)][-1]
        target.events.put_nowait(Received(self.self_id, wire.decode(out)))

    async def report_status(self, **fields: object) -> None:
        self.status.append(fields)

    def limit_messages(self, max_message_bytes: int, max_reassembly_bytes: int) -> None:
        self.limits = (max_message_bytes, max_reassembly_bytes)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.hub.meshes.pop(self.self_id, None)
        for other in self.hub.meshes.values():
            other.events.put_nowait(PeerDown(self.self_id, "closed"))


def _opts(tmp: Path, server: str, name: str, **kw: object) -> PeerOptions:
    base: dict = dict(server=server, name=name, approve="auto",
                      metrics=str(tmp / f"{name}.jsonl"), join_timeout=20.0,
                      progress=False)
    if kw.get("start"):
        base.update(model={"width": 16, "layers": 1, "heads": 2, "seq": 16}, batch=2,
                    lr=0.01, seed=3, sync_every=1, codec="f32")  # lockstep
    base.update(kw)
    return PeerOptions(**base)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _group(tmp: Path, server: str, n: int, steps: int,
                 hooks: dict[str, Hooks] | None = None,
                 save: dict[str, str] | None = None,
                 hub: FakeHub | None = None, leader: dict | None = None) -> list[int]:
    hub = hub if hub is not None else FakeHub()
    hooks = hooks or {}
    save = save or {}

    async def one(i: int) -> int:
        name = f"p{i}"
        extra: dict = ({"start": True, "steps": steps, "wait_peers": n, **(leader or {})}
                       if i == 0 else {})
        if name in save:
            extra["save"] = save[name]
        await asyncio.sleep(0.05 * i)  # the leader first, like a room's host
        try:
            return await run_peer(
                _opts(tmp, server, name, **extra), driver_class=faulty(hooks.get(name, Hooks(
                    dump_grads=str(tmp)))), mesh_factory=lambda *a, **k: FakeMesh(hub, *a, **k))
        except PeerError as exc:
            return exc.code

    return list(await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 60))


def test_in_process_group_matches_replay(tmp_path: Path, server: str) -> None:
    hub = FakeHub()
    codes = asyncio.run(_group(tmp_path, server, 3, 4, hub=hub))
    assert codes == [0, 0, 0]
    for m in hub.all:  # dashboard status: every step, then the end state
        assert {"step", "loss", "hash", "peers", "tokens_per_s", "probe"} <= set(m.status[0])
        assert m.status[-1]["state"] == "done" and m.status[-1]["step"] == 4
        assert len(m.status[-1]["hash"]) == 16
    recs = [_records(tmp_path / f"p{i}.jsonl") for i in range(3)]
    steps = [[r for r in rs if "end" not in r] for rs in recs]
    assert all([r["step"] for r in s] == [1, 2, 3, 4] for s in steps)
    hashes = {tuple(r["weight_hash"] for r in s) for s in steps}
    assert len(hashes) == 1
    spec = [(r["roster"], {q: np.load(tmp_path / f"{q}-{r['step'] - 1}.npy")
                           for q in r["roster"]}, r.get("shares", ())) for r in steps[0]]
    assert len(spec[0][0]) == 3
    want = replay_hashes(init_params(tiny_run().model, 3), tiny_run().adam(), spec)
    assert list(hashes.pop()) == want
    assert all(rs[-1]["end"] == "done" for rs in recs)
    # every peer bounded its links by this run's largest message once it knew the run
    size = init_params(tiny_run().model, 3).size
    assert {m.limits for m in hub.all} == {(budget.largest_message(size),
                                            budget.link_budget(size))}


def test_in_process_eval_every_records_the_heldout_loss_of_the_shared_weights(
        tmp_path: Path, server: str) -> None:
    from daisyweb.training.evaluate import heldout_batches, heldout_loss

    ck = tmp_path / "p0.pt"
    codes = asyncio.run(_group(tmp_path, server, 2, 4, save={"p0": str(ck)},
                               leader={"eval_every": 3}))
    assert codes == [0, 0]
    lead = [r for r in _records(tmp_path / "p0.jsonl") if "end" not in r]
    assert [r["step"] for r in lead if "heldout_loss" in r] == [3, 4]  # and the last
    final = load_checkpoint(ck)
    want = heldout_loss(final.model, final.params, heldout_batches(final.model.seq))
    assert lead[-1]["heldout_loss"] == want and lead[-1]["eval_s"] >= 0
    follower = _records(tmp_path / "p1.jsonl")
    assert not any("heldout_loss" in r for r in follower)  # the flag is the leader's own


def test_in_process_nan_halts_with_a_valid_checkpoint(tmp_path: Path, server: str) -> None:
    bad = Hooks(corrupt_gradient=(1, "nan"))
    saves = {f"p{i}": str(tmp_path / f"p{i}.pt") for i in range(3)}
    # all-to-all: the switch corrupts whole contributions (owners get parts of them)
    codes = asyncio.run(_group(tmp_path, server, 3, 5, hooks={"p2": bad}, save=saves,
                               leader={"exchange": "all"}))
    assert codes[:2] == [1, 1]
    for i in range(2):
        rs = _records(tmp_path / f"p{i}.jsonl")
        assert "NaN" in rs[-1]["end"] and rs[-1]["step"] == 1
        ck = load_checkpoint(saves[f"p{i}"])
        assert ck.step == 1 and ck.weight_hash == rs[-2]["weight_hash"]


# --------------------------------------------------------------------------- part 1


def test_three_peers_train_with_identical_hashes_equal_to_replay(group: Group) -> None:
    lead = group.leader(*MODEL, "--steps", "6", "--wait-peers", "3")
    a = group.spawn("a")
    b = group.spawn("b")
    codes = [p.wait() for p in (lead, a, b)]
    assert codes == [0, 0, 0], group.logs()
    for p in (lead, a, b):
        assert [r["step"] for r in p.steps()] == [1, 2, 3, 4, 5, 6]
        assert all(len(r["roster"]) == 3 for r in p.steps())
        assert p.end()["end"] == "done"
        r = p.steps()[-1]
        assert set(r) >= {"step", "loss", "weight_hash", "probe_hash", "roster",
                          "tokens_per_s", "comm_s", "compute_s"}
    hashes = same_hashes(lead, a, b)
    assert hashes == oracle(group, lead)
    assert lead.end()["weight_hash"] == hashes[-1]


def test_broken_kernel_is_caught_by_the_probe_and_removed(group: Group) -> None:
    lead = group.leader(*MODEL, "--steps", "4", "--wait-peers", "3")
    a = group.spawn("a")
    bad = group.spawn("bad", env={"DAISYWEB_TEST_BREAK_KERNEL": "1"})
    assert bad.wait() == 1, group.logs()
    assert "probe" in bad.end()["end"]
    assert [lead.wait(), a.wait()] == [0, 0], group.logs()
    assert not bad.steps()  # excluded before its first gradient
    for p in (lead, a):
        assert [len(r["roster"]) for r in p.steps()] == [2, 2, 2, 2]
        assert len({r["probe_hash"] for r in p.steps()}) == 1
    assert "excluded" in lead.log.read_text()
    assert same_hashes(lead, a) == oracle(group, lead)


def test_injected_weight_fork_halts_every_peer(group: Group) -> None:
    lead = group.leader(*MODEL, "--steps", "6", "--wait-peers", "3")
    a = group.spawn("a")
    fork = group.spawn("fork", env={"DAISYWEB_TEST_FORK_AT": "2"})
    codes = [p.wait() for p in (lead, a, fork)]
    assert codes == [1, 1, 1], group.logs()
    for p in (lead, a, fork):
        end = p.end()
        # at the fork's boundary; a peer still finishing step 2 stops where it is
        assert end["step"] in (1, 2) and "step 2" in end["end"]
        assert "diverged" in end["end"] or "mismatch" in end["end"]
        assert fork.id() in end["end"]  # every peer names who diverged
    assert 2 in (lead.end()["step"], a.end()["step"])


@pytest.mark.parametrize("kind", ["nan", "short"])
def test_bad_gradient_halts_with_a_valid_checkpoint(group: Group, kind: str) -> None:
    # all-to-all: the switch corrupts whole contributions (owners get parts of them)
    lead = group.leader(*MODEL, "--steps", "6", "--wait-peers", "3", "--exchange", "all",
                        "--save", str(group.tmp / "lead.pt"))
    a = group.spawn("a", "--save", str(group.tmp / "a.pt"))
    bad = group.spawn("bad", env={"DAISYWEB_TEST_CORRUPT_GRADIENT": f"2:{kind}"})
    assert [lead.wait(), a.wait()] == [1, 1], group.logs()
    bad.wait()
    for p, ck in ((lead, "lead.pt"), (a, "a.pt")):
        end = p.end()
        assert end["step"] == 2 and "refused at step 2" in end["end"]
        assert ("NaN/Inf" if kind == "nan" else "expected") in end["end"]
        c = load_checkpoint(group.tmp / ck)
        # state untouched: the checkpoint is the last committed step
        assert c.step == 2 and c.weight_hash == p.steps()[-1]["weight_hash"]
    if kind == "nan":
        # Part 2: the halted run's checkpoint restores a new group from its step.
        start = load_checkpoint(group.tmp / "lead.pt")
        g2 = Group(group.server, group.tmp, group.room + "r")
        try:
            lead2 = g2.spawn("lead2", "--start", "--resume", str(group.tmp / "lead.pt"),
                             "--wait-peers", "2", "--steps", "8")
            b2 = g2.spawn("b2")
            assert [lead2.wait(), b2.wait()] == [0, 0], g2.logs()
        finally:
            g2.kill_all()
        assert "from step 2" in b2.log.read_text()
        assert start.weight_hash[:16] in b2.log.read_text()
        for p in (lead2, b2):  # --steps is the user's: the run's 6 steps become 8
            assert [r["step"] for r in p.steps()] == [3, 4, 5, 6, 7, 8]
        assert same_hashes(lead2, b2) == oracle(g2, lead2, start)


# --------------------------------------------------------------------------- part 2

SLOW = {"DAISYWEB_TEST_STEP_DELAY": "0.4"}  # room for a join or a kill mid-run


def _wait_step(p: Peer, step: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not p.steps() or p.steps()[-1]["step"] < step:
        assert p.proc.poll() is None, p.log.read_text()
        assert time.monotonic() < deadline, p.log.read_text()
        time.sleep(0.05)


def test_dropped_gradient_is_repaired_bit_exact(group: Group) -> None:
    # all-to-all: the switch drops a whole contribution (the owner exchange's parts are
    # repaired in test_owner_exchange)
    lead = group.leader(*MODEL, "--steps", "4", "--wait-peers", "3", "--exchange", "all")
    a = group.spawn("a")
    b = group.spawn("b", env={"DAISYWEB_TEST_DROP_GRADIENT": "1"})
    assert [p.wait() for p in (lead, a, b)] == [0, 0, 0], group.logs()
    assert "dropped gradient of step 1" in b.log.read_text()
    for p in (lead, a, b):
        assert all(len(r["roster"]) == 3 for r in p.steps())  # repaired, not amended
    assert same_hashes(lead, a, b) == oracle(group, lead)


def test_fourth_peer_joins_a_running_group_in_pieces_from_its_members(group: Group) -> None:
    # b serves every piece with one byte flipped: the joiner asks the leader for those
    lead = group.leader(*MODEL, "--steps", "8", "--wait-peers", "3", env=SLOW)
    a = group.spawn("a", env=SLOW)
    b = group.spawn("b", env={**SLOW, "DAISYWEB_TEST_CORRUPT_SNAPSHOT": "byte"})
    _wait_step(lead, 2)
    late = group.spawn("late", env=SLOW)
    assert [p.wait() for p in (lead, a, b, late)] == [0, 0, 0, 0], group.logs()
    took = [ln for ln in late.log.read_text().splitlines() if "took the state" in ln]
    assert len(took) == 1 and "in 15 pieces: " in took[0], took
    assert f"({12 * init_params(tiny_run().model, 3).size:,} bytes, " in took[0], took
    assert sorted(took[0].split(": ")[-1].split(", ")) == sorted(
        [f"5 from {a.id()}", f"10 from {lead.id()}"]), took
    offered = [ln for ln in lead.log.read_text().splitlines()
               if f"to {late.id()} in pieces" in ln]
    assert len(offered) == 1 and offered[0].endswith("from 3 members"), offered
    first = late.steps()[0]["step"]
    assert first > 2 and [r["step"] for r in late.steps()] == list(range(first, 9))
    assert all(len(r["roster"]) == 4 for r in late.steps())  # contributes from its first step
    assert late.id() in lead.steps()[-1]["roster"]
    assert same_hashes(lead, a, b, late) == oracle(group, lead)


def test_follower_sigkilled_mid_step_the_rest_finish(group: Group) -> None:
    lead = group.leader(*MODEL, "--steps", "7", "--wait-peers", "3", env=SLOW)
    a = group.spawn("a", env=SLOW)
    victim = group.spawn("victim", "--save", str(group.tmp / "victim.pt"), "--save-every", "1",
                         env=SLOW)
    _wait_step(lead, 2)
    victim.proc.send_signal(signal.SIGKILL)
    assert [lead.wait(), a.wait()] == [0, 0], group.logs()
    # --save-every wrote atomically: whatever the kill interrupted, the file is whole
    saved = load_checkpoint(group.tmp / "victim.pt")
    assert saved.step >= 1
    assert saved.weight_hash == {r["step"]: r["weight_hash"] for r in lead.steps()}[saved.step]
    rosters = [len(r["roster"]) for r in lead.steps()]
    assert rosters[0] == 3 and rosters[-1] == 2
    assert [r["step"] for r in lead.steps()] == list(range(1, 8))
    assert same_hashes(lead, a) == oracle(group, lead)


def test_leader_killed_mid_step_the_rest_finish(group: Group) -> None:
    lead = group.leader(*MODEL, "--steps", "7", "--wait-peers", "3", env=SLOW)
    a = group.spawn("a", env=SLOW)
    b = group.spawn("b", env=SLOW)
    _wait_step(a, 2)
    lead.proc.send_signal(signal.SIGKILL)
    assert [a.wait(), b.wait()] == [0, 0], group.logs()
    for p in (a, b):
        assert [r["step"] for r in p.steps()] == list(range(1, 8))  # no step lost
        assert p.steps()[-1]["roster"] == p.steps()[-1]["roster"]
    assert "leading now" in a.log.read_text() + b.log.read_text()
    assert same_hashes(a, b) == oracle(group, a)


# --------------------------------------------------------------------------- admission


async def _join_against_host(server: str, room: str, *args: str) -> tuple[int, str]:
    """A raw signaling client hosts ``room`` and never decides; a peer tries to join."""
    import aiohttp

    ws_url = server.replace("http://", "ws://") + "/ws"
    async with aiohttp.ClientSession() as s, s.ws_connect(
            ws_url, params={"room": room, "name": "host"}) as ws:
        await ws.receive(timeout=10)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "daisyweb.cli.peer", "--server", server, "--room", room,
            "--ice-host", "127.0.0.1", *args, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        return int(proc.returncode or 0), err.decode()


def test_not_admitted_within_join_timeout_exits_non_zero(server: str) -> None:
    code, err = asyncio.run(_join_against_host(server, "waitroom1", "--join-timeout", "1.5"))
    assert code == 3
    # The first line says the transport (issue 17); then one line says why, and no more.
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[0].startswith("daisyweb-peer: transport: ")
    assert lines[1:] == [lines[-1]] and "not admitted" in lines[-1] and "Traceback" not in err


def _decide_on_dashboard(link: str, approve: bool, timeout: float = 30) -> None:
    """Act as the host's browser: find the waiting peer, then POST the decision."""
    import urllib.request
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(link)
    room, key = parse_qs(parts.query)["room"][0], parse_qs(parts.query)["key"][0]
    base = f"{parts.scheme}://{parts.netloc}/api/rooms/{room}"
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{base}?key={key}", timeout=5) as resp:
            waiting = json.loads(resp.read()).get("waiting_peers") or []
        if waiting:
            break
        assert time.monotonic() < deadline, "no waiting peer showed up"
        time.sleep(0.1)
    body = json.dumps({"key": key, "id": waiting[0]["id"], "approve": approve}).encode()
    req = urllib.request.Request(f"{base}/decide", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200
    assert re.fullmatch(r"[A-Za-z0-9_-]{16,}", key)


@pytest.mark.parametrize("approve", [False, True])
def test_approve_ask_without_a_terminal_waits_for_the_dashboard(
        server: str, tmp_path: Path, approve: bool) -> None:
    room = f"askroom{int(approve)}"
    g = Group(server, tmp_path, room)
    try:
        # --wait-peers 2 keeps the host (and so the room) waiting for the joiner
        host = g.spawn("host", "--start", *MODEL, "--steps", "2", "--approve", "ask",
                       "--wait-peers", "2")
        deadline = time.monotonic() + 30
        while "dashboard with Accept/Deny" not in host.log.read_text():
            assert time.monotonic() < deadline and host.proc.poll() is None
            time.sleep(0.05)
        # The host link (with the key), not the member link it may print first.
        link = host.log.read_text().split("Accept/Deny (keep it private): ")[1].split()[0]
        cmd = [sys.executable, "-m", "daisyweb.cli.peer", "--server", server, "--room",
               room, "--ice-host", "127.0.0.1", "--join-timeout", "40"]
        joiner = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # As the host's user would: read the hint, then decide. (Deciding before the
            # host has asked is fine for the product, but then it never needs the hint.)
            deadline = time.monotonic() + 30
            while "accept or deny on the dashboard" not in host.log.read_text():
                assert time.monotonic() < deadline and host.proc.poll() is None
                time.sleep(0.05)
            _decide_on_dashboard(link, approve)
            _, err = joiner.communicate(timeout=60)
        finally:
            if joiner.poll() is None:
                joiner.kill()
        if approve:
            assert joiner.returncode == 0, err
            assert host.proc.wait(timeout=60) == 0
            assert "done at step 2" in err
            assert f"dashboard of this room (keep it private): {server}/?room={room}&member=" in err
        else:
            assert joiner.returncode == 3 and "denied" in err, err
    finally:
        g.kill_all()


def test_interrupt_ends_cleanly_with_a_checkpoint(group: Group) -> None:
    lead = group.leader(*MODEL, "--steps", "5", "--wait-peers", "2", env=SLOW)
    a = group.spawn("a", "--save", str(group.tmp / "a.pt"), env=SLOW)
    _wait_step(a, 2)
    a.proc.send_signal(signal.SIGINT)
    assert a.wait() == 130, a.log.read_text()
    assert a.end()["end"] == "interrupted" and "Traceback" not in a.log.read_text()
    saved = load_checkpoint(group.tmp / "a.pt")
    assert saved.step == a.end()["step"] and saved.weight_hash == a.end()["weight_hash"]
    assert lead.wait() == 0, lead.log.read_text()  # the leader finishes on its own
    assert [r["step"] for r in lead.steps()] == [1, 2, 3, 4, 5]
    assert same_hashes(lead) == oracle(group, lead)


# ------------------------------------------------- gradient failures, saves, kernel report


def test_in_process_gradient_exception_halts_the_group(tmp_path: Path, server: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    bad = Hooks(dump_grads=str(tmp_path), gradient_raises=1)
    saves = {f"p{i}": str(tmp_path / f"p{i}.pt") for i in range(3)}
    hub = FakeHub()
    codes = asyncio.run(_group(tmp_path, server, 3, 5, hooks={"p1": bad}, save=saves,
                               hub=hub))
    assert codes == [1, 1, 1]  # every peer stops, none stalls
    bad_id = hub.all[1].self_id
    why = (f"gradient computation failed on {bad_id} at step 1: "
           "NonFiniteError: test: injected gradient failure")
    for i in range(3):
        rs = _records(tmp_path / f"p{i}.jsonl")
        assert why in rs[-1]["end"] and rs[-1]["step"] == 1
        ck = load_checkpoint(saves[f"p{i}"])  # state untouched: the last committed step
        assert ck.step == 1 and ck.weight_hash == rs[-2]["weight_hash"]
    assert f"daisyweb-peer: halted at step 1: {why}" in capsys.readouterr().err


def test_in_process_save_failures_warn_then_fail_the_end(
        tmp_path: Path, server: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    save = out / "lead.pt"
    real = report.save_checkpoint
    calls = [0]

    def save_then_vanish(path: object, ckpt: Checkpoint) -> None:
        calls[0] += 1
        real(path, ckpt)
        if calls[0] == 1:  # the directory disappears after the first periodic save
            save.unlink()
            out.rmdir()

    monkeypatch.setattr(report, "save_checkpoint", save_then_vanish)
    opts = _opts(tmp_path, server, "lead", start=True, steps=3, save=str(save), save_every=1)
    code = asyncio.run(run_peer(opts, driver_class=faulty(Hooks()),
                                    mesh_factory=lambda *a, **k: FakeMesh(FakeHub(), *a, **k)))
    assert code == 1  # trained to the end, but the final checkpoint is lost
    rs = _records(tmp_path / "lead.jsonl")
    assert [r["step"] for r in rs[:-1]] == [1, 2, 3]  # a failed periodic save goes on
    assert rs[-1]["end"] == "done" and "cannot create a temp file" in rs[-1]["save_error"]
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "daisyweb-peer: could not save the checkpoint of step 2 (training goes on): " in err
    assert "daisyweb-peer: could not save the final checkpoint of step 3: " in err


def test_in_process_end_record_carries_kernel_counts(tmp_path: Path, server: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    import kernels

    codes = asyncio.run(_group(tmp_path, server, 2, 2))
    assert codes == [0, 0]
    for i in range(2):
        k = _records(tmp_path / f"p{i}.jsonl")[-1]["kernels"]
        assert k["backend"] == kernels.active_backend()
        assert k["macs"][k["backend"]] > 0 and k["demotions"] == kernels.demotions()
    err = capsys.readouterr().err
    assert f"daisyweb-peer: kernels: backend {kernels.active_backend()}, demotions: " in err


def test_gradient_exception_in_a_real_peer_halts_every_peer(group: Group) -> None:
    lead = group.leader(*MODEL, "--steps", "6", "--wait-peers", "2",
                        "--save", str(group.tmp / "lead.pt"))
    bad = group.spawn("bad", env={"DAISYWEB_TEST_GRADIENT_RAISES": "2"})
    assert [lead.wait(), bad.wait()] == [1, 1], group.logs()
    why = (f"gradient computation failed on {bad.id()} at step 2: "
           "NonFiniteError: test: injected gradient failure")
    for p in (lead, bad):
        end = p.end()
        assert end["step"] == 2 and why in end["end"], p.log.read_text()
        assert "Traceback" not in p.log.read_text()
        # A fresh process: these MACs are this run's own, on the backend it reports.
        assert end["kernels"]["macs"][end["kernels"]["backend"]] > 0
    assert f"halted at step 2: {bad.id()}: {why}" in lead.log.read_text()
    c = load_checkpoint(group.tmp / "lead.pt")
    assert c.step == 2 and c.weight_hash == lead.steps()[-1]["weight_hash"]


@pytest.mark.parametrize("kind", ["byte", "hash"])
def test_follower_refuses_a_bad_snapshot_from_a_real_leader(group: Group, kind: str) -> None:
    # The leader (a test switch only it reads) serves damaged pieces or announces a
    # wrong weight hash; the follower joining mid-run (the first boundary it would make
    # from the seed) must refuse before its state machine starts.
    lead = group.leader(*MODEL, "--steps", "6",
                        env={**SLOW, "DAISYWEB_TEST_CORRUPT_SNAPSHOT": kind})
    _wait_step(lead, 1)
    f = group.spawn("f")
    assert f.wait() == 1, group.logs()
    log = f.log.read_text()
    lines = [ln for ln in log.splitlines() if "refused the snapshot from" in ln]
    assert len(lines) == 1, log
    assert lines[0].startswith(f"daisyweb-peer: refused the snapshot from {lead.id()}: ")
    assert ("weight hash or step does not match" if kind == "hash"
            else "does not match its digest") in lines[0]
    assert "Traceback" not in log
    # Its state is never used: no step, no end record, no machine started.
    assert f.records() == [] and "following" not in log
    assert lead.wait() == 0, group.logs()
    assert [r["roster"] for r in lead.steps()] == [[lead.id()]] * 6
    assert f"to {f.id()} in pieces from 1 member" in lead.log.read_text()


@pytest.mark.parametrize("who", ["follower", "leader"])
def test_peers_of_another_protocol_version_are_refused(group: Group, who: str) -> None:
    # One side speaks version 999 (a test switch); each side refuses the other with one
    # line naming both versions, and the leader trains on without the follower.
    v999 = {"DAISYWEB_TEST_PROTOCOL_VERSION": "999"}
    lead = group.leader(*MODEL, "--steps", "3", "--wait-peers", "2",
                        env=v999 if who == "leader" else None)
    f = group.spawn("f", env=v999 if who == "follower" else None)
    assert f.wait() == 1, group.logs()
    assert lead.wait() == 0, group.logs()
    v = wire.PROTOCOL_VERSION
    lv, fv = (999, v) if who == "leader" else (v, 999)
    flog, llog = f.log.read_text(), lead.log.read_text()
    want = (f"daisyweb-peer: refused the leader {lead.id()}: it speaks protocol version "
            f"{lv}, this peer speaks {fv}")
    assert [ln for ln in flog.splitlines() if "refused" in ln] == [want], flog
    assert (f"excluded {f.id()}: {f.id()} speaks protocol version {fv}, "
            f"{lead.id()} speaks {lv}") in llog
    for log in (flog, llog):
        assert "Traceback" not in log
    # Nothing of the other version was used: no snapshot, no roster, no state.
    assert f.records() == [] and "following" not in flog
    assert "offered step" not in llog
    assert [r["roster"] for r in lead.steps()] == [[lead.id()]] * 3


def test_snapshot_and_version_switches_come_from_the_environment_only() -> None:
    h = Hooks.from_env({"DAISYWEB_TEST_CORRUPT_SNAPSHOT": "hash",
                                "DAISYWEB_TEST_PROTOCOL_VERSION": "999"})
    assert (h.corrupt_snapshot, h.protocol_version) == ("hash", 999)
    assert Hooks.from_env({}).protocol_version is None
    for env in ({"DAISYWEB_TEST_CORRUPT_SNAPSHOT": "zero"},
                {"DAISYWEB_TEST_PROTOCOL_VERSION": "-1"},
                {"DAISYWEB_TEST_PROTOCOL_VERSION": str(1 << 32)}):
        with pytest.raises(PeerError) as exc:
            Hooks.from_env(env)
        assert exc.value.code == 2 and next(iter(env)) in str(exc.value)


# --------------------------------------------------------------------------- rounds
# The lockstep fault tests again with rounds of 2 local steps exchanging int8 deltas:
# every boundary's shared hash identical on every survivor and equal to the replay
# oracle fed the decoded round deltas.


def round_oracle(g: Group, peer: Peer, start: Checkpoint | None = None) -> list[str]:
    if any(r.get("owners") for r in peer.steps()):  # a group of three or more: owners
        return owned_round_oracle(g, peer, start)
    spec = []
    for r in peer.steps():
        i = r["round"] - 1
        spec.append((r["roster"], {q: np.load(g.grads / f"{q}-{i}.npy") for q in r["roster"]},
                     r.get("shares", ())))
    params = start.params if start is not None else init_params(tiny_run().model,
                                                                 tiny_run().seed)
    return replay_rounds(params, spec, **paced(peer.steps()))


def paced(records: list[dict]) -> dict[str, Any]:
    """Where a peer's recorded rounds start and how long each was, as the leader named
    them (``protocol.pace``): the replay oracle's ``first_round``, ``first_step`` and
    ``lengths``."""
    first = records[0]
    return {"first_round": first["round"] - 1, "first_step": first["step"] - first["round_steps"],
            "lengths": [r["round_steps"] for r in records]}


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "sparse"])
def test_rounds_three_peers_identical_at_every_boundary_equal_to_replay(group: Group,
                                                                        codec: str) -> None:
    # Equal shares: a share moved by a noisy speed would drop a head start this counts.
    lead = group.leader(*ROUNDS[:-1], codec, "--steps", "7", "--wait-peers", "3",
                        "--capacity", "off", "--overlap", "1")
    a = group.spawn("a")
    # one peer on numpy's baseline instructions, as on an old CPU
    b = group.spawn("b", env={"NPY_DISABLE_CPU_FEATURES":
                              "X86_V3 X86_V4 AVX512_SKX AVX512_ICL"})
    assert [p.wait() for p in (lead, a, b)] == [0, 0, 0], group.logs()
    for p in (lead, a, b):
        # rounds of 2, the last one short; records count optimizer steps
        assert [(r["round"], r["step"]) for r in p.steps()] == [(1, 2), (2, 4), (3, 6), (4, 7)]
        assert all(r["mode"] == f"rounds H=2 {codec}" for r in p.steps())
        assert p.end()["end"] == "done"
        # --overlap 1: every round after the first (the last one, of one step, whole)
        # began while the previous exchange was in flight.
        assert [r["head_steps"] for r in p.steps()] == [0, 1, 1, 1]
        # the progress line says so (the last one is always printed: 1 of the 1 step)
        assert "round 4/4" in p.log.read_text() and "ahead 1/1" in p.log.read_text()
        assert all(r["comm_s"] <= r["exchange_s"] for r in p.steps())
    assert all(r["owners"] for r in lead.steps())  # three members: the owner exchange
    hashes = same_hashes(lead, a, b)
    assert hashes == round_oracle(group, lead)
    assert {p.end()["weight_hash"] for p in (lead, a, b)} == {hashes[-1]}
    # 4 rounds' payloads: int8 about a quarter of float32, int4 an eighth, int2 a 13th,
    # sparse a 23rd
    size = init_params(tiny_run().model, 3).size
    payload = codec_by_name(codec).payload_size(size)
    assert payload < 4 * size * {"int8": 0.26, "int4": 0.15, "int2": 0.08,
                                 "sparse": 0.045}[codec]
    assert lead.steps()[-1]["bytes_sent"] == 4 * payload


def test_rounds_the_leader_lengthens_for_the_exchange_stay_identical_and_replay(
        group: Group) -> None:
    """--sync-every 2 --sync-max 8: on loopback a tiny model's step takes far less than an
    exchange, so the leader names longer rounds (``protocol.pace``). Every member trains
    the lengths named, the boundaries agree, and the oracle fed those lengths gives the
    group's hashes."""
    paced_run = [*TINY, "--sync-every", "2", "--sync-max", "8", "--codec", "int8"]
    lead = group.leader(*paced_run, "--steps", "40", "--wait-peers", "2")
    a = group.spawn("a")
    assert [p.wait() for p in (lead, a)] == [0, 0], group.logs()
    lengths = [r["round_steps"] for r in lead.steps()]
    assert lengths[0] == 2 and max(lengths) > 2 and all(n <= 8 for n in lengths), lengths
    assert sum(lengths) == 40 and [r["round_steps"] for r in a.steps()] == lengths
    assert all(r["mode"] == "rounds H=2-8 int8" for r in lead.steps())
    # (the progress line's note on a lengthened round: test_peer_status, round_note; the
    # line itself is printed about once a second, so a given round's may not be)
    assert "rounds H=2-8 int8" in lead.log.read_text()
    hashes = same_hashes(lead, a)
    assert hashes == round_oracle(group, lead)
    assert {p.end()["weight_hash"] for p in (lead, a)} == {hashes[-1]}


def test_rounds_float_compute_group_identical_at_every_boundary_equal_to_replay(
        group: Group) -> None:
    """--compute float: plain float32 GEMMs in every member's steps; the members still
    agree at every boundary (only the exchanged bytes must) and equal the oracle."""
    ck = group.tmp / "lead.pt"
    lead = group.leader(*ROUNDS, "--steps", "6", "--wait-peers", "2", "--compute", "float",
                        "--save", str(ck))
    a = group.spawn("a")
    assert [p.wait() for p in (lead, a)] == [0, 0], group.logs()
    assert same_hashes(lead, a) == round_oracle(group, lead)
    assert load_checkpoint(ck).run["compute"] == "float"


def test_rounds_dropped_contribution_is_repaired_bit_exact(group: Group) -> None:
    lead = group.leader(*ROUNDS, "--steps", "6", "--wait-peers", "3", "--exchange", "all")
    a = group.spawn("a")
    b = group.spawn("b", env={"DAISYWEB_TEST_DROP_GRADIENT": "1"})
    assert [p.wait() for p in (lead, a, b)] == [0, 0, 0], group.logs()
    assert "dropped gradient of step 1" in b.log.read_text()
    for p in (lead, a, b):
        assert all(len(r["roster"]) == 3 for r in p.steps())
    assert same_hashes(lead, a, b) == round_oracle(group, lead)


@pytest.mark.parametrize("kind", ["nan", "short"])
def test_rounds_bad_contribution_halts_with_a_valid_checkpoint(group: Group, kind: str) -> None:
    lead = group.leader(*ROUNDS, "--steps", "8", "--wait-peers", "2",
                        "--save", str(group.tmp / "lead.pt"))
    bad = group.spawn("bad", env={"DAISYWEB_TEST_CORRUPT_GRADIENT": f"1:{kind}"})
    assert lead.wait() == 1, group.logs()
    bad.wait()
    end = lead.end()
    assert end["step"] == 2 and "refused at round 1" in end["end"]
    c = load_checkpoint(group.tmp / "lead.pt")
    assert c.step == 2  # the last committed boundary, untouched by the refused round


def test_rounds_fork_halts_every_peer(group: Group) -> None:
    lead = group.leader(*ROUNDS, "--steps", "8", "--wait-peers", "3")
    a = group.spawn("a")
    fork = group.spawn("fork", env={"DAISYWEB_TEST_FORK_AT": "2"})
    assert [p.wait() for p in (lead, a, fork)] == [1, 1, 1], group.logs()
    for p in (lead, a, fork):
        assert fork.id() in p.end()["end"]


def test_rounds_late_joiner_and_follower_killed_mid_round(group: Group) -> None:
    # 10 rounds of at least 0.4 s: room for a joiner's start-up, then for a kill
    lead = group.leader(*ROUNDS, "--steps", "20", "--wait-peers", "3", env=SLOW)
    a = group.spawn("a", env=SLOW)
    victim = group.spawn("victim", env=SLOW)
    _wait_step(lead, 2)
    late = group.spawn("late", env=SLOW)
    _wait_step(late, 2)  # its first round as a member is committed
    victim.proc.send_signal(signal.SIGKILL)
    assert [lead.wait(), a.wait(), late.wait()] == [0, 0, 0], group.logs()
    rosters = [len(r["roster"]) for r in lead.steps()]
    assert 4 in rosters and rosters[-1] == 3, rosters
    assert [r["step"] for r in lead.steps()] == list(range(2, 21, 2))  # no round lost
    assert same_hashes(lead, a, late) == round_oracle(group, lead)


def owned_round_oracle(g: Group, peer: Peer, start: Checkpoint | None = None) -> list[str]:
    """:func:`round_oracle` for the owner exchange, from the members' dumped bytes."""
    spec = []
    for r in peer.steps():
        i = r["round"] - 1
        payloads = {q: (g.grads / f"{q}-{i}.bin").read_bytes() for q in r["roster"]}
        spec.append((r["roster"], tuple(r.get("owners", ())), payloads, r.get("shares", ())))
    codec = codec_by_name(peer.steps()[0]["codec"])
    params = start.params if start is not None else init_params(tiny_run().model,
                                                                 tiny_run().seed)
    return replay_owned_rounds(params, spec, codec, **paced(peer.steps()))


def test_rounds_eight_peers_on_the_owner_exchange_equal_to_replay(group: Group) -> None:
    lead = group.leader(*ROUNDS[:-1], "int4", "--steps", "8", "--wait-peers", "8",
                        "--capacity", "off", "--exchange", "owner")
    others = [group.spawn(f"p{i}") for i in range(7)]
    peers = [lead, *others]
    assert [p.wait() for p in peers] == [0] * 8, group.logs()
    for p in peers:
        assert [r["step"] for r in p.steps()] == [2, 4, 6, 8]
        assert all(r["owners"] == r["roster"] and len(r["roster"]) == 8 for r in p.steps())
    hashes = same_hashes(*peers)
    assert hashes == owned_round_oracle(group, lead)
    # A member sends each round its parts to 7 owners and its part's mean to 7 members:
    # about two contributions, where all-to-all sends seven.
    size = init_params(tiny_run().model, 3).size
    payload = codec_by_name("int4").payload_size(size)
    for p in others:
        first, last = p.steps()[0], p.steps()[-1]
        per_round = (last["wire_sent"] - first["wire_sent"]) / (len(p.steps()) - 1)
        assert per_round < 3 * payload, (p.name, per_round, payload)


def test_rounds_owner_exchange_member_killed_mid_round_and_a_late_joiner(group: Group) -> None:
    lead = group.leader(*ROUNDS, "--steps", "20", "--wait-peers", "4", "--exchange", "owner",
                        env=SLOW)
    a = group.spawn("a", env=SLOW)
    b = group.spawn("b", env=SLOW)
    victim = group.spawn("victim", env=SLOW)
    _wait_step(lead, 2)
    late = group.spawn("late", env=SLOW)
    _wait_step(late, 2)  # its first round as a member is committed
    victim.proc.send_signal(signal.SIGKILL)  # an owner of a part, and a contributor
    assert [p.wait() for p in (lead, a, b, late)] == [0] * 4, group.logs()
    rosters = [len(r["roster"]) for r in lead.steps()]
    assert 5 in rosters and rosters[-1] == 4, rosters
    assert [r["step"] for r in lead.steps()] == list(range(2, 21, 2))  # no round lost
    assert all(r["owners"] for r in lead.steps())
    assert same_hashes(lead, a, b, late) == owned_round_oracle(group, lead)


def test_rounds_leader_killed_mid_round(group: Group) -> None:
    lead = group.leader(*ROUNDS, "--steps", "10", "--wait-peers", "3", env=SLOW)
    a = group.spawn("a", "--save", str(group.tmp / "a.pt"), env=SLOW)
    b = group.spawn("b", env=SLOW)
    _wait_step(a, 4)
    lead.proc.send_signal(signal.SIGKILL)
    assert [a.wait(), b.wait()] == [0, 0], group.logs()
    for p in (a, b):
        assert [r["step"] for r in p.steps()] == [2, 4, 6, 8, 10]
    assert "leading now" in a.log.read_text() + b.log.read_text()
    assert same_hashes(a, b) == round_oracle(group, a)
    saved = load_checkpoint(group.tmp / "a.pt")
    assert saved.step == 10 and saved.run["sync_every"] == 2 and saved.run["codec"] == "int8"


def test_rounds_resume_from_a_boundary_checkpoint(group: Group) -> None:
    ck = group.tmp / "lead.pt"
    lead = group.leader(*ROUNDS, "--steps", "8", "--wait-peers", "2", "--save", str(ck),
                        "--save-every", "4", env=SLOW)
    group.spawn("a", env=SLOW)
    _wait_step(lead, 4)
    deadline = time.monotonic() + 30
    while not ck.exists():
        assert time.monotonic() < deadline, group.logs()
        time.sleep(0.05)
    group.kill_all()
    start = load_checkpoint(ck)
    assert start.step in (4, 6)  # a round boundary (saved at 4; 6 if it raced the kill)
    g2 = Group(group.server, group.tmp, group.room + "r")
    try:
        lead2 = g2.spawn("lead2", "--start", "--resume", str(ck), "--wait-peers", "2")
        b2 = g2.spawn("b2")
        assert [lead2.wait(), b2.wait()] == [0, 0], g2.logs()
    finally:
        g2.kill_all()
    assert [r["step"] for r in lead2.steps()] == list(range(start.step + 2, 9, 2))
    assert same_hashes(lead2, b2) == round_oracle(g2, lead2, start)


def test_rounds_finished_run_trains_on_to_a_larger_steps(group: Group) -> None:
    # Rounds of 2 over 5 steps end with a short round (steps 4..5); resumed with
    # --steps 9 the group goes on from step 5 in rounds of 2 (5..7, 7..9), numbered on
    # from the 3 rounds the checkpoint's steps make (rounds.rounds_before).
    ck, more = group.tmp / "done.pt", group.tmp / "more.pt"
    lead = group.leader(*ROUNDS, "--steps", "5", "--wait-peers", "2", "--save", str(ck))
    a = group.spawn("a")
    assert [lead.wait(), a.wait()] == [0, 0], group.logs()
    start = load_checkpoint(ck)
    assert start.step == 5 and start.run["steps"] == 5
    g2 = Group(group.server, group.tmp, group.room + "r")
    try:
        # the run's own flags may be repeated; only --steps and the saving flags change
        lead2 = g2.spawn("lead2", "--start", "--resume", str(ck), *ROUNDS, "--steps", "9",
                         "--wait-peers", "2", "--save", str(more))
        b2 = g2.spawn("b2")
        assert [lead2.wait(), b2.wait()] == [0, 0], g2.logs()
    finally:
        g2.kill_all()
    for p in (lead2, b2):
        assert [(r["round"], r["step"]) for r in p.steps()] == [(4, 7), (5, 9)]
        assert all(len(r["roster"]) == 2 for r in p.steps())
    spec = [(r["roster"], {q: np.load(g2.grads / f"{q}-{r['round'] - 1}.npy")
                           for q in r["roster"]}, r.get("shares", ())) for r in lead2.steps()]
    hashes = same_hashes(lead2, b2)
    assert hashes == replay_rounds(start.params, spec, **paced(lead2.steps()))
    assert paced(lead2.steps()) == {"first_round": 3, "first_step": 5, "lengths": [2, 2]}
    assert {p.end()["weight_hash"] for p in (lead2, b2)} == {hashes[-1]}
    saved = load_checkpoint(more)
    assert saved.step == 9 and saved.run["steps"] == 9 and saved.run["seed"] == 3


# ------------------------------------------------------ capacity-weighted batches
# The leader gives each member a share of the round's sequences by its measured speed;
# the contributions are weighted by those counts in roster order. The pool view's link
# round-trip times come from the same real peers.

CAPACITY = [*TINY[:8], "--batch", "4", *TINY[10:], "--sync-every", "4", "--sync-max", "4",
            "--codec", "int8"]


def _room_view(leader: Peer) -> dict:
    """The group detail through the host's dashboard link the leader printed."""
    import urllib.request
    from urllib.parse import parse_qs, urlsplit

    m = re.search(r"dashboard with Accept/Deny \(keep it private\): (\S+)",
                  leader.log.read_text())
    assert m, leader.log.read_text()
    parts = urlsplit(m[1])
    q = parse_qs(parts.query)
    url = f"{parts.scheme}://{parts.netloc}/api/rooms/{q['room'][0]}?key={q['key'][0]}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def test_capacity_gives_a_slowed_peer_a_smaller_share(group: Group) -> None:
    lead = group.leader(*CAPACITY, "--steps", "32", "--wait-peers", "2", env=SLOW)
    slow = group.spawn("slow", env={**SLOW, "DAISYWEB_TEST_SLOW_FACTOR": "4"})
    # While it runs: both reports carry machine, share and a measured link to the other.
    links: dict = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and lead.proc.poll() is None:
        try:
            reports = _room_view(lead)["reports"]
        except (AssertionError, OSError):
            time.sleep(0.2)
            continue
        links = {p: r.get("links", {}) for p, r in reports.items()}
        if len(links) == 2 and all(isinstance(v, float) for lk in links.values()
                                   for v in lk.values()) and all(links.values()):
            assert all(r["cores"] >= 1 and r["ram_mb"] >= 1 and r["cpu"] and
                       0 < r["share"] < 1 and r["backend"] for r in reports.values())
            break
        time.sleep(0.2)
    assert [lead.wait(), slow.wait()] == [0, 0], group.logs()
    a, b = lead.id(), slow.id()
    assert set(links) == {a, b} and set(links[a]) == {b} and set(links[b]) == {a}, links
    assert all(0.0 <= rtt < 1000.0 for lk in links.values() for rtt in lk.values())
    steps = lead.steps()
    assert [r["step"] for r in steps] == list(range(4, 33, 4))
    # round 1: nobody measured yet, equal shares; then by speed
    assert steps[0]["shares"] == [4, 4]
    later = [dict(zip(r["roster"], r["shares"], strict=True)) for r in steps[1:]]
    assert all(sum(s.values()) == 8 for s in later)
    smaller = sum(s[b] < s[a] for s in later)
    assert smaller > len(later) // 2 and not any(s[b] > s[a] for s in later), later
    assert sum(s[b] for s in later) < sum(s[a] for s in later)
    # identical replicas, equal to the replay oracle fed the same shares
    hashes = same_hashes(lead, slow)
    spec = [(r["roster"], {q: np.load(group.grads / f"{q}-{r['round'] - 1}.npy")
                           for q in r["roster"]}, r["shares"]) for r in steps]
    start = init_params(tiny_run().model, 3)
    assert hashes == replay_rounds(start, spec, lengths=[4] * 8)
    assert {lead.end()["weight_hash"], slow.end()["weight_hash"]} == {hashes[-1]}
    # ...and not to one that averages them plainly: the weights mattered
    plain = [(roster, deltas) for roster, deltas, _ in spec]
    assert replay_rounds(start, plain, lengths=[4] * 8)[-1] != hashes[-1]
    # each peer's own records say its share
    mine = {r["step"]: r["share"] for r in slow.steps()}
    assert any(mine[r["step"]] < 0.5 for r in steps[1:])


@pytest.mark.parametrize("capacity", [True, False])
def test_in_process_capacity_on_and_off(tmp_path: Path, server: str, capacity: bool) -> None:
    hooks = {"p0": Hooks(dump_grads=str(tmp_path)),
             "p1": Hooks(dump_grads=str(tmp_path), slow_factor=6.0)}
    codes = asyncio.run(_group(tmp_path, server, 2, 8, hooks=hooks,
                               leader={"capacity": capacity, "batch": 4}))
    assert codes == [0, 0]
    recs = [[r for r in _records(tmp_path / f"p{i}.jsonl") if "end" not in r] for i in (0, 1)]
    assert [r["weight_hash"] for r in recs[0]] == [r["weight_hash"] for r in recs[1]]
    if not capacity:  # --capacity off: equal shares, the plain average, as ever
        assert not any("shares" in r for r in recs[0])
        assert {r["share"] for rs in recs for r in rs} == {0.5}
    else:
        slow_id = recs[0][0]["roster"][1]  # p1 joined second
        shares = [dict(zip(r["roster"], r["shares"], strict=True)) for r in recs[0]]
        assert shares[0] == {recs[0][0]["roster"][0]: 4, slow_id: 4}
        assert sum(s[slow_id] for s in shares[1:]) < 4 * len(shares[1:]), shares
    spec = [(r["roster"], {q: np.load(tmp_path / f"{q}-{r['step'] - 1}.npy")
                           for q in r["roster"]}, r.get("shares", ())) for r in recs[0]]
    tiny = tiny_run()
    assert replay_hashes(init_params(tiny.model, 3), tiny.adam(), spec) == [
        r["weight_hash"] for r in recs[0]]


async def test_a_head_start_over_another_share_is_dropped() -> None:
    """--overlap with capacity: a head start drawn with the last share is used only if
    the roster names the same share again (else its sequences would be weighted
    wrongly); it is waited for either way (it holds the sampler)."""
    from daisyweb.peer.driver import Driver, PendingHead

    driver = Driver.__new__(Driver)
    loop = asyncio.get_running_loop()
    for rows, want in ((4, "head"), (3, None)):
        future = loop.create_future()
        future.set_result("head")
        driver.head = PendingHead(7, future, 4)
        assert await driver._take_head(7, rows) == want
        assert driver.head is None


async def test_a_head_start_runs_ahead_as_far_as_the_roster_says_within_the_runs_overlap(
        ) -> None:
    """Every member runs the next round's first steps ahead as far as the last roster
    named (the leader's measurement, ``protocol.pace``), at most the run's overlap and
    the steps the run has left after the round before; a roster of another round names
    none."""
    from types import SimpleNamespace

    from daisyweb.peer.driver import Driver
    from daisyweb.protocol.pace import Bounds
    from daisyweb.training.overlap import OverlapGauge
    from daisyweb.training.rounds import RoundTrainer

    asked: list[int] = []
    trainer = RoundTrainer.__new__(RoundTrainer)
    trainer.head_start = lambda index, batch, previous, steps: asked.append(steps)  # type: ignore[method-assign]
    driver = Driver.__new__(Driver)
    driver.state = SimpleNamespace(run=SimpleNamespace(overlap=6, sync_every=8, sync_max=32,
                                                       steps=40))
    driver.trainer, driver.rows = trainer, 4
    driver.feed = SimpleNamespace(run=SimpleNamespace(batch=4), batch=lambda i: None)
    driver.report = SimpleNamespace(head_started=lambda i: None,
                                    head_finished=lambda *a: None)
    machine = SimpleNamespace(bounds=Bounds(8, 32, 6))
    for named, ended, want in (((4, 3), 16, [3]), ((4, 7), 16, [6]), ((3, 3), 16, []),
                               ((4, 0), 16, []), ((4, 9), 37, [3]), ((4, 9), 40, [])):
        asked.clear()
        driver.head, driver.ahead = None, named
        previous = SimpleNamespace(inner={"step": ended})  # round 4 ended at step `ended`
        driver._start_head(machine, 5, previous)
        if driver.head is not None:
            await driver.head.future
        assert asked == want, (named, ended)
    # What this member publishes follows its measured exchange, up to the longest round.
    driver.overlap = OverlapGauge()
    driver.machine = SimpleNamespace(ahead=0)
    driver.overlap.ready(3, now=1.0, compute_s=1.0, steps=8)  # 0.125 s a step
    driver._measure_overlap(3, now=1.25)  # a 0.25 s exchange: 2 steps, and a quarter
    assert driver.machine.ahead == 3
    driver.overlap.ready(4, now=2.0, compute_s=1.0, steps=8)
    driver._measure_overlap(4, now=7.0)  # a 5 s exchange: 40 steps, and a quarter; at most 32
    assert driver.machine.ahead == 32


# --------------------------------------------------------------------------- TURN


def test_relayed_group_trains_through_a_real_turn_server(group: Group) -> None:
    # Every peer forced to relayed candidates (--relay): the gradients all go through
    # coturn on 127.0.0.1, which counts them.
    from tests.turn import coturn

    with coturn(group.tmp) as turn:
        lead = group.leader(*MODEL, "--steps", "4", "--wait-peers", "2", *turn.flags())
        a = group.spawn("a", *turn.flags())
        assert [lead.wait(), a.wait()] == [0, 0], group.logs()
    assert same_hashes(lead, a) == oracle(group, lead)
    size = init_params(tiny_run().model, 3).size
    # coturn logs a session's bytes every 1024 packets: of the 2 x 4 float32 gradients
    # (8 x 276 KB), at least each session's first 1024 packets are on record
    assert turn.relayed_bytes() >= 4 * 4 * size, turn.log.read_text()[-2000:]


# --------------------------------------------------------------------------- budget


def test_peer_over_the_reassembly_budget_loses_its_links_and_the_group_trains_on(
        group: Group) -> None:
    # A hostile member (a mesh in this process) starts three messages of the run's largest
    # legal size on each link and never finishes them: each peer drops that link in one
    # line and the two real peers train to the end with identical hashes.
    import asyncio as aio

    from daisyweb.net import Mesh

    # 16 slow steps (over 6 s): the flood lands mid-run even on a loaded machine (with 6,
    # a run once ended before the hostile mesh was up and no budget line was written).
    lead = group.leader(*MODEL, "--steps", "16", "--wait-peers", "2", env=SLOW)
    a = group.spawn("a", env=SLOW)
    _wait_step(lead, 1)
    size = init_params(tiny_run().model, 3).size
    largest = budget.largest_message(size)
    count = -(-largest // framing.CHUNK)

    async def flood() -> list[str]:
        m = Mesh(group.server, room=group.room, name="hostile", ice_hosts=["127.0.0.1"])
        await m.start()
        try:
            want = {lead.id(), a.id()}
            up: set[str] = set()
            while up != want:
                e = await aio.wait_for(m.next_event(), 30)
                if isinstance(e, PeerUp) and e.peer in want:
                    up.add(e.peer)
            for peer in sorted(want):
                channel = m._links[peer].channel  # raw frames: what no honest peer sends
                for msg_id in (1, 2, 3):
                    header = struct.pack("<4sQIII8s", b"DWF1", msg_id, 0, count, largest,
                                         bytes(8))
                    channel.send(header + bytes(framing.CHUNK))
            down: set[str] = set()
            while down != want:
                e = await aio.wait_for(m.next_event(), 30)
                if isinstance(e, PeerDown):
                    down.add(e.peer)
            return sorted(down)
        finally:
            await m.close()

    assert asyncio.run(flood()) == sorted({lead.id(), a.id()})
    assert [lead.wait(), a.wait()] == [0, 0], group.logs()
    for p in (lead, a):
        lines = [ln for ln in p.log.read_text().splitlines() if "reassembly budget" in ln]
        assert len(lines) == 1 and "down (reassembly budget exceeded: " in lines[0], lines
        assert f"over the budget of {2 * largest:,}" in lines[0]
        assert [r["step"] for r in p.steps()] == list(range(1, 17))
        assert all(len(r["roster"]) == 2 for r in p.steps())
    assert same_hashes(lead, a) == oracle(group, lead)


def test_in_process_a_start_costs_the_leader_one_plan_and_no_piece(
        tmp_path: Path, server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four peers start at once: the leader makes the plan of boundary 0 once for its
    three joiners (a 24-peer start made 23 copies on a starved event loop), and each
    joiner makes that boundary from the run's seed: no piece crosses the wire."""
    from daisyweb.peer import driver
    from daisyweb.peer.pieces import PieceServer

    plans: list[int] = []
    served: list[int] = []
    real_plan, real_serve = driver.plan_for, PieceServer.serve

    def counting_plan(*args, **kwargs):  # type: ignore[no-untyped-def]
        plans.append(1)
        return real_plan(*args, **kwargs)

    def counting_serve(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        served.append(1)
        return real_serve(self, *args, **kwargs)

    monkeypatch.setattr(driver, "plan_for", counting_plan)
    monkeypatch.setattr(PieceServer, "serve", counting_serve)
    assert asyncio.run(_group(tmp_path, server, 4, 2)) == [0, 0, 0, 0]
    assert (len(plans), len(served)) == (1, 0)
