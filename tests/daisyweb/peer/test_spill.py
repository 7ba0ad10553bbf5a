"""The leader's older repair payloads and its snapshots in spill files
(daisyweb.peer.spill)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daisyweb.peer.spill import SpillArchive, SpilledPayloads, spill_dir
from daisyweb.protocol import wire
from daisyweb.protocol.codec import F32
from daisyweb.protocol.ledger import HOT_STEPS
from daisyweb.protocol.sync import HISTORY, Send
from tests.daisyweb.protocol.test_sync import Bus

PAYLOADS = {"a": os.urandom(1000), "b": b"", "c": os.urandom(70001)}


def test_payloads_read_back_from_an_unlinked_file(tmp_path: Path) -> None:
    kept = SpillArchive(str(tmp_path)).keep(3, dict(PAYLOADS))
    assert isinstance(kept, SpilledPayloads)
    assert list(tmp_path.iterdir()) == []  # deleted from the directory at once
    assert dict(kept) == PAYLOADS and len(kept) == 3 and "c" in kept
    assert kept.get("zz") is None


def test_a_payload_that_does_not_read_back_intact_is_not_given(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kept = SpillArchive(str(tmp_path)).keep(3, dict(PAYLOADS))
    assert isinstance(kept, SpilledPayloads)
    os.pwrite(kept._file.fileno(), b"\x00", 1000 + 500)  # one byte of c's payload
    assert kept.get("c") is None
    assert "did not read back intact" in capsys.readouterr().err
    assert kept.get("a") == PAYLOADS["a"]
    kept.close()
    assert kept.get("a") is None  # a closed file gives nothing, and raises nothing


def test_without_a_usable_directory_payloads_stay_in_memory_said_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = SpillArchive(str(tmp_path / "missing"))
    assert archive.keep(1, dict(PAYLOADS)) == PAYLOADS
    assert archive.keep(2, {"a": b"x"}) == {"a": b"x"}
    err = capsys.readouterr().err
    assert err.count("keeping them in memory") == 1


def test_spill_files_go_to_tmpdir_if_set_else_var_tmp() -> None:
    assert spill_dir({"TMPDIR": "/somewhere"}) == "/somewhere"
    if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK):
        assert spill_dir({}) == "/var/tmp"


def test_a_leader_keeps_the_last_two_steps_in_memory_and_repairs_older_ones_from_its_file(
        tmp_path: Path) -> None:
    """Of the HISTORY steps a leader keeps for repair, only the last HOT_STEPS stay in
    memory; a member asking for an older one gets the very bytes back from the file."""
    bus = Bus(["a", "b", "c"], steps=14, seed=3, archive=SpillArchive(str(tmp_path)))
    leader = bus.machines["a"]
    bus.start()
    while bus.step_once():
        if leader.boundary >= 12:
            bus.hold_compute.add("c")  # the group waits at boundary 12
    assert leader.boundary == 12 and not bus.stopped
    ledger = leader.ledger
    committed = 11
    kept = range(committed - HISTORY + 1, committed + 1)
    assert sorted(ledger.archived) == list(range(kept[0], committed - HOT_STEPS + 1))
    in_memory = [k for k, s in ledger.steps.items() if s.payloads and k <= committed]
    assert in_memory == list(range(committed - HOT_STEPS + 1, committed + 1))
    for step in (kept[0], 7, committed):
        actions = leader.message("c", wire.RepairRequest(step, "b"), bus.now)
        sent = [a.message for a in actions if isinstance(a, Send)]
        assert sent == [wire.Contribution(step, "b", F32.encode(bus.sent_grads[("b", step)]))]
    assert leader.message("c", wire.RepairRequest(kept[0] - 1, "b"), bus.now) == []
