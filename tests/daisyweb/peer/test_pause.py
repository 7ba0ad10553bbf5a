"""A paused peer (SIGSTOP: a closed lid, swapping) in a real group of four processes on
127.0.0.1: it is dropped, wakes cut off from the majority, and rejoins as a joiner; it
never leads a second group, every peer that exits 0 ends on one weight hash, and the
group's commits do not stall for long."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daisyweb.peer.test_run import (
    ROOT,
    TINY,
    Group,
    Peer,
    _free_port,
    _wait_step,
    group,
    server,
)

__all__ = ["group", "server"]  # the fixtures, shared with test_run

# Rounds of 2 local steps, each slowed so the run outlasts a 10 s pause and a rejoin.
RUN = [*TINY, "--sync-every", "2", "--sync-max", "2", "--codec", "int8", "--steps", "100",
       "--wait-peers", "4"]
SLOW = {"DAISYWEB_TEST_STEP_DELAY": "0.3"}
PAUSE_S = 10.0


def _pause(p: Peer, secs: float) -> None:
    p.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(secs)
    finally:
        p.proc.send_signal(signal.SIGCONT)


def _longest_gap(p: Peer) -> float:
    times = [r["time"] for r in p.records() if "end" not in r]
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


@pytest.mark.parametrize("who", ["follower", "leader"])
def test_a_peer_paused_10_s_rejoins_and_the_group_keeps_one_model(group: Group,
                                                                  who: str) -> None:
    lead = group.leader(*RUN, env=SLOW)
    others = [group.spawn(n, env=SLOW) for n in ("a", "b", "c")]
    _wait_step(lead, 10)
    paused = lead if who == "leader" else others[-1]
    _pause(paused, PAUSE_S)
    peers = [lead, *others]
    codes = {p.name: p.wait() for p in peers}
    logs = group.logs()
    text = paused.log.read_text()
    assert "cut off" in text and "rejoining the group as a joiner" in text, logs
    # on waking it acts on nothing it held: it knows it stood still past the timeout
    assert "this peer stood still" in text, logs
    assert "leading now" not in text, logs  # it never led a second group
    ended = [p for p in peers if codes[p.name] == 0]
    assert len(ended) >= 3, (codes, logs)
    assert len({p.end()["weight_hash"] for p in ended}) == 1, logs
    if codes[paused.name] == 0:
        assert "following" in text.split("rejoining the group", 1)[1], logs
    else:  # it may not make it back before the run ends: then it says why
        assert codes[paused.name] != 0 and "could not rejoin" in text, logs
    survivors = [p for p in peers if p is not paused]
    # every line counts in the unit it names: the leader's snapshots are of rounds
    assert any("offered round" in p.log.read_text() for p in survivors), logs
    if who == "leader":
        assert any("leading now" in p.log.read_text() for p in survivors), logs
    # the group goes on: its longest wait for a commit is the pause's detection, not more
    gap = max(_longest_gap(p) for p in survivors if codes[p.name] == 0)
    assert gap <= 20.0, (gap, logs)


@pytest.fixture
def impatient_server() -> Iterator[str]:
    """A signaling server that pings every 3 s: a peer paused 10 s is dropped from it."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "signaling.cli", "--host", "127.0.0.1", "--port", str(port),
         "--data", "builtin", "--heartbeat", "3"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with __import__("socket").create_connection(("127.0.0.1", port), 0.5):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_peer_the_server_dropped_while_paused_joins_the_room_again(
        impatient_server: str, tmp_path: Path) -> None:
    g = Group(impatient_server, tmp_path, "tpaused01")
    try:
        lead = g.leader(*RUN, env=SLOW)
        others = [g.spawn(n, env=SLOW) for n in ("a", "b", "c")]
        _wait_step(lead, 10)
        paused = others[-1]
        first_id = paused.id()
        _pause(paused, PAUSE_S)
        peers = [lead, *others]
        codes = [p.wait() for p in peers]
        logs = g.logs()
        text = paused.log.read_text()
        assert "joining the room again" in text, logs
        assert text.count("joined as ") == 2 and first_id in text, logs
        assert codes == [0, 0, 0, 0], logs
        assert len({p.end()["weight_hash"] for p in peers}) == 1, logs
    finally:
        g.kill_all()
