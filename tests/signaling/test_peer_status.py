"""The peer's own status reports (``daisyweb.peer.report``) pass the server's decoder and
carry issue 13's dashboard fields: mode, round, comm share and, after an evaluation, the
held-out loss. A report the server refused would count toward the 20 errors after which
it drops the peer's signaling connection, so every value must stay in the server's range.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

from daisyweb.data import default_tokenizer
from daisyweb.model import ModelConfig
from daisyweb.peer.options import PeerOptions
from daisyweb.peer.report import Report, round_note
from daisyweb.protocol.actions import Commit
from daisyweb.training.config import RunConfig
from daisyweb.training.state import TrainState
from signaling import protocol


class Sink:
    """A stand-in for the mesh: what reaches the server is what decode() makes of it."""

    def __init__(self) -> None:
        self.decoded: list[dict] = []

    async def report_status(self, **fields: object) -> None:
        self.decoded.append(protocol.decode(json.dumps(protocol.status(fields))))


def _state(sync_every: int, steps: int = 64) -> TrainState:
    model = ModelConfig(vocab=default_tokenizer().vocab_size, width=16, layers=1, heads=2,
                        seq=16)
    run = RunConfig(model=model, batch=2, steps=steps, lr=0.01, seed=3, sync_every=sync_every,
                    codec="int8" if sync_every > 1 else "f32", sync_max=sync_every)
    return TrainState.fresh(run)


def _report(tmp: Path, eval_every: int = 0) -> Report:
    opts = PeerOptions(server="http://127.0.0.1:1", metrics=str(tmp / "m.jsonl"),
                       progress=False, eval_every=eval_every)
    return Report(opts, tokinfo=None)  # type: ignore[arg-type]  # no save, no tokenizer


async def _commit(report: Report, state: TrainState, index: int, inner: int,
                  sink: Sink) -> None:
    trainer = SimpleNamespace(inner_steps=(index + 1) * inner)
    c = Commit(index, ("0a", "0b"), 3.25, "ab" * 32, "cd" * 32, length=inner, need=inner // 2)
    await report.commit(c, trainer, state, SimpleNamespace(bytes_sent=0), sink)


async def test_round_reports_carry_mode_round_comm_share_and_heldout(tmp_path: Path) -> None:
    state = _state(sync_every=32)
    report = _report(tmp_path, eval_every=32)
    report.begin(state)
    sink = Sink()
    report.computing(0)
    report.contribution_ready(0, 0.01, time.monotonic())
    await _commit(report, state, 0, 32, sink)  # optimizer step 32: an evaluation is due
    await _commit(report, state, 1, 32, sink)  # step 64: again
    first, second = sink.decoded
    assert (first["mode"], first["round"], first["step"]) == ("rounds H=32 int8", 1, 32)
    assert second["round"] == 2 and 0.0 <= first["comm_share"] <= 1.0
    # the round's length and the exchange the leader chose it for (protocol.pace)
    assert (first["round_steps"], first["exchange_steps"]) == (32, 16)
    assert first["heldout_loss"] > 0 and second["heldout_loss"] > 0  # evaluated, in range
    assert first["state"] == "training"
    await report.finish((0, "done"), state, "ef" * 32, sink)
    assert sink.decoded[-1]["state"] == "done" and sink.decoded[-1]["mode"] == "rounds H=32 int8"
    report.close()


async def test_lockstep_report_without_evaluation_has_no_heldout(tmp_path: Path) -> None:
    state = _state(sync_every=1)
    report = _report(tmp_path)
    report.begin(state)
    sink = Sink()
    # a gradient "ready" before its step started would give a share above 1: clamped
    report.computing(0)
    report.contribution_ready(0, 0.0, time.monotonic() - 10.0)
    await _commit(report, state, 0, 1, sink)
    (msg,) = sink.decoded
    assert (msg["mode"], msg["round"], msg["comm_share"]) == ("lockstep f32", 1, 1.0)
    assert "heldout_loss" not in msg and "round_steps" not in msg
    report.close()


async def test_heldout_loss_is_resent_with_its_step(tmp_path: Path) -> None:
    """Reports coalesce (the latest wins), so the held-out loss rides on every later
    report, labelled with the step it was evaluated at, not the report's own step."""
    state = _state(sync_every=32, steps=128)  # step 96 is not the last: no evaluation
    report = _report(tmp_path, eval_every=64)
    report.begin(state)
    sink = Sink()
    await _commit(report, state, 0, 32, sink)  # step 32: no evaluation yet
    await _commit(report, state, 1, 32, sink)  # step 64: evaluated
    await _commit(report, state, 2, 32, sink)  # step 96: not evaluated, still carried
    first, evaluated, later = sink.decoded
    assert "heldout_loss" not in first
    assert evaluated["heldout_step"] == 64 and evaluated["heldout_loss"] > 0
    assert later["step"] == 96
    assert (later["heldout_loss"], later["heldout_step"]) == (
        evaluated["heldout_loss"], 64)
    report.close()


async def test_reports_name_the_transport_once_resolved(tmp_path: Path) -> None:
    state = _state(sync_every=1)
    for transport, want in (("libwebrtc", "libwebrtc"), ("aiortc", "aiortc"), ("auto", None)):
        report = _report(tmp_path)
        report.opts.transport = transport
        report.begin(state)
        sink = Sink()
        await _commit(report, state, 0, 1, sink)
        await report.finish((0, "done"), state, "ef" * 32, sink)
        assert [d.get("transport") for d in sink.decoded] == [want, want]
        report.close()
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])["transport"] == (
        "libwebrtc")  # the metrics record too


class LinkedSink(Sink):
    """A mesh with three links: measured, not yet measured, and absurdly slow."""

    def link_rtts(self) -> dict[str, float | None]:
        return {"0b": 0.0123, "0c": None, "0d": 1e6}


async def test_reports_carry_the_pool_fields(tmp_path: Path) -> None:
    from daisyweb.peer.hardware import hardware_info

    state = _state(sync_every=32)
    report = _report(tmp_path)
    report.begin(state)
    sink = LinkedSink()
    report.computing(0)
    report.contribution_ready(0, 0.5, time.monotonic())
    await _commit(report, state, 0, 32, sink)
    (msg,) = sink.decoded
    mine = hardware_info()
    assert mine["cores"] >= 1 and mine["ram_mb"] >= 1 and mine["cpu"]
    assert {k: msg[k] for k in mine} == mine
    assert msg["backend"] in ("blas", "blas64", "mirror", "lut")
    assert msg["share"] == 0.5  # two peers in the roster, equal shares
    # own tokens: batch 2 x seq 16 x 32 inner steps, computed in 0.5 s
    assert msg["peer_tokens_per_s"] == 2 * 16 * 32 / 0.5
    assert msg["total_steps"] == 64 and msg["eta_s"] >= 0
    assert msg["links"] == {"0b": 12.3, "0c": None, "0d": protocol.MAX_RTT_MS}
    await report.finish((0, "done"), state, "ef" * 32, sink)
    end = sink.decoded[-1]
    assert end["cpu"] == mine["cpu"] and end["share"] == 0.5 and "links" not in end
    report.close()


def test_hardware_info_names_the_machine_by_a_keyed_hash_of_its_id(tmp_path: Path) -> None:
    from daisyweb.peer.hardware import hardware_info

    ident = tmp_path / "machine-id"
    ident.write_text("4f1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e\n")
    other = tmp_path / "other-id"
    other.write_text("00000000000000000000000000000001\n")
    mine = hardware_info(machine_ids=(tmp_path / "missing", ident))["machine"]
    assert len(mine) == protocol.MACHINE_ID_CHARS and "4f1c2d" not in mine  # not the id
    assert protocol.decode(json.dumps({"type": "status", "step": 1, "loss": 2.0,
                                       "hash": "ab", "peers": 1, "machine": mine}))
    assert hardware_info(machine_ids=(ident,))["machine"] == mine  # the same every start
    assert hardware_info(machine_ids=(other,))["machine"] != mine
    assert "machine" not in hardware_info(machine_ids=(tmp_path / "missing",))


def test_hardware_info_reads_the_cpu_model_and_cleans_it(tmp_path: Path) -> None:
    from daisyweb.peer.hardware import hardware_info

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Old \x1b[31mBox\u202e CPU @ 1.2GHz\n")
    assert hardware_info(info)["cpu"] == "Old Box CPU @ 1.2GHz"
    info.write_text("processor\t: 0\nmodel name\t: " + "x" * 500 + "\n")
    assert len(hardware_info(info)["cpu"]) == protocol.MAX_CPU_CHARS


def test_the_progress_line_says_how_long_a_round_is_and_why() -> None:
    def note(step: int, length: int, need: int, remaining: int) -> str:
        c = Commit(step, ("0a",), 1.0, "ab" * 32, "cd" * 32, length=length, need=need)
        return round_note(c, remaining, 16)

    assert note(0, 16, 3, 48) == "round 1/4"  # the shortest round: nothing to explain
    assert note(4, 40, 37, 80) == "round 5/7  40 steps (exchange 37)"
    assert note(6, 7, 2, 0) == "round 7/7"  # the run's short last round
