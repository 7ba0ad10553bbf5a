import io
import json
import math

import numpy as np
import pytest

from daisyweb.checkpoints.checkpoint import TokenizerInfo, load_checkpoint
from daisyweb.model import ModelConfig
from daisyweb.protocol import wire
from daisyweb.protocol.averaging import GradientError
from daisyweb.training.config import RunConfig
from daisyweb.training.loop import StepRecord, train_local
from daisyweb.training.metrics import MetricsWriter, Progress
from daisyweb.training.state import TrainState

TINY = ModelConfig(vocab=40, width=16, layers=1, heads=2, seq=8)
TOK = TokenizerInfo(40, "ab" * 32)


def _run(steps: int = 20) -> RunConfig:
    return RunConfig(model=TINY, batch=4, steps=steps, lr=1e-2, seed=3)


def _fixed_batch(step: int) -> np.ndarray:
    # One repeated batch: a model that learns must drive its loss down.
    rng = np.random.default_rng(0)
    return rng.integers(0, TINY.vocab, size=(4, TINY.seq + 1)).astype(np.int32)


def test_run_config_round_trips_through_wire() -> None:
    run = _run()
    msg = wire.decode(wire.encode(run.to_wire()))
    assert isinstance(msg, wire.Config)
    assert RunConfig.from_wire(msg) == run


def test_compute_float_trains_with_float_gemms_and_travels_with_the_run(tmp_path) -> None:
    """``--compute float``: every gradient (lockstep and rounds) and the held-out loss
    use plain float32 GEMMs; the choice crosses the wire and lives in checkpoints, and a
    checkpoint that names none was int8."""
    import dataclasses

    from daisyweb.cli.eval import evaluate_checkpoint
    from daisyweb.data import default_tokenizer
    from daisyweb.model import loss_and_grad
    from daisyweb.training.rounds import RoundTrainer

    tok = default_tokenizer()
    model = dataclasses.replace(TINY, vocab=tok.vocab_size)  # the held-out text's ids
    int8 = RunConfig(model=model, batch=4, steps=2, lr=1e-2, seed=3, sync_every=1,
                     codec="f32")
    flt = dataclasses.replace(int8, compute="float")
    assert int8.compute == "int8" and int8.quantized and not flt.quantized
    batch = _fixed_batch(0)
    a, b = TrainState.fresh(int8), TrainState.fresh(flt)
    ga, gb = a.gradient(batch)[1], b.gradient(batch)[1]
    assert np.array_equal(gb, loss_and_grad(model, b.params, batch, quantized=False)[1])
    assert not np.array_equal(ga, gb)
    rounds = dataclasses.replace(flt, sync_every=2, codec="int8", overlap=0, sync_max=2)
    c = RoundTrainer(TrainState.fresh(rounds), 2).contribute(0, _fixed_batch, 2)
    w = TrainState.fresh(rounds)
    for j in range(2):  # the round written out with float gradients
        w.optimizer.step(w.params, loss_and_grad(model, w.params, _fixed_batch(j),
                                                 quantized=False)[1])
    assert np.array_equal(c.vector, TrainState.fresh(rounds).params - w.params)
    assert RunConfig.from_wire(wire.decode(wire.encode(flt.to_wire()))) == flt
    save = tmp_path / "f.pt"
    train_local(b, _fixed_batch, tokenizer=TokenizerInfo(tok.vocab_size, tok.file_hash),
                save=save)
    ckpt = load_checkpoint(save)
    assert ckpt.run["compute"] == "float" and RunConfig.from_checkpoint(ckpt) == flt
    old = dataclasses.replace(ckpt, run={k: v for k, v in ckpt.run.items() if k != "compute"})
    assert RunConfig.from_checkpoint(old).compute == "int8"
    # daisyweb-eval evaluates through the forward the run trained with
    assert evaluate_checkpoint(ckpt, batches=2).loss != evaluate_checkpoint(old, batches=2).loss


@pytest.mark.parametrize("bad", [{"batch": 0}, {"steps": 0}, {"lr": -1.0}, {"seed": -1}])
def test_run_config_refuses_bad_values(bad: dict) -> None:
    kwargs = {"model": TINY, "batch": 4, "steps": 5, "lr": 1e-3, "seed": 0} | bad
    with pytest.raises(ValueError, match="bad run config"):
        RunConfig(**kwargs)


def test_training_lowers_loss_and_writes_metrics(tmp_path) -> None:
    state = TrainState.fresh(_run(30))
    metrics_path = tmp_path / "m.jsonl"
    save = tmp_path / "c.pt"
    losses: list[float] = []
    train_local(state, _fixed_batch, tokenizer=TOK, save=save, save_every=10,
                metrics=MetricsWriter(metrics_path), on_step=lambda r: losses.append(r.loss))
    assert state.step == 30
    assert losses[-1] < 0.5 * losses[0]
    lines = [json.loads(x) for x in metrics_path.read_text().splitlines()]
    assert [x["step"] for x in lines[:-1]] == list(range(1, 31))
    assert {"step", "loss", "tokens_per_s", "compute_s"} <= set(lines[0])
    # Hashed where a group of this run hashes (H = 16), at saves (every 10) and the end.
    assert [x["step"] for x in lines[:-1] if "weight_hash" in x] == [10, 16, 20, 30]
    assert lines[-1]["end"] == "done" and lines[-1]["weight_hash"] == state.weight_hash()
    assert lines[-2]["weight_hash"] == state.weight_hash()
    ckpt = load_checkpoint(save, expect_model=TINY, expect_tokenizer=TOK)
    assert ckpt.step == 30 and ckpt.weight_hash == state.weight_hash()


def test_resumed_state_continues_bit_identically(tmp_path) -> None:
    straight = TrainState.fresh(_run(6))
    train_local(straight, _fixed_batch, tokenizer=TOK)

    first = TrainState.fresh(_run(3))
    save = tmp_path / "half.pt"
    train_local(first, _fixed_batch, tokenizer=TOK, save=save)
    resumed = TrainState.from_checkpoint(load_checkpoint(save), run=_run(6))
    assert resumed.step == 3
    train_local(resumed, _fixed_batch, tokenizer=TOK)
    assert resumed.weight_hash() == straight.weight_hash()


def test_apply_refuses_bad_average_and_leaves_state_untouched() -> None:
    state = TrainState.fresh(_run())
    before = state.weight_hash()
    bad = np.zeros(state.size, np.float32)
    bad[7] = np.nan
    with pytest.raises(GradientError, match="1 NaN/Inf"):
        state.apply(bad)
    with pytest.raises(GradientError, match="expected"):
        state.apply(np.zeros(state.size - 1, np.float32))
    assert state.weight_hash() == before and state.step == 0


def test_failed_step_still_saves_last_committed_state(tmp_path) -> None:
    state = TrainState.fresh(_run(10))
    save = tmp_path / "c.pt"

    def sample(step: int) -> np.ndarray:
        if step == 4:
            raise RuntimeError("data source vanished")
        return _fixed_batch(step)

    with pytest.raises(RuntimeError):
        train_local(state, sample, tokenizer=TOK, save=save)
    ckpt = load_checkpoint(save)
    assert ckpt.step == 3 and ckpt.weight_hash == state.weight_hash()


def test_progress_line_reports_rate_and_eta() -> None:
    now = [100.0]
    out = io.StringIO()
    prog = Progress(10, stream=out, every=0.0, clock=lambda: now[0])
    prog.start(0)
    for step in (1, 2):
        now[0] += 2.0
        rate = prog.update(step, 3.25, tokens=500)
    assert rate == pytest.approx(250.0)
    last = out.getvalue().splitlines()[-1]
    assert "step 2/10" in last and "loss 3.2500" in last and "250 tok/s" in last
    assert "eta 16s" in last  # 8 steps left at 2 s per step
    now[0] += 2.0
    prog.update(3, math.nan, tokens=500)  # no loss of its own in this commit
    assert "loss -  " in out.getvalue().splitlines()[-1] and "nan" not in out.getvalue()


def test_failed_saves_keep_training_and_the_end_record(tmp_path) -> None:
    from daisyweb.checkpoints.checkpoint import CheckpointError

    missing = tmp_path / "gone" / "c.pt"  # every save fails: the directory is missing
    metrics_path = tmp_path / "m.jsonl"
    seen: list[tuple[int, bool]] = []
    state = TrainState.fresh(_run(4))
    metrics = MetricsWriter(metrics_path)
    train_local(state, _fixed_batch, tokenizer=TOK, save=missing, save_every=2,
                metrics=metrics, on_save_error=lambda exc, final: seen.append(
                    (state.step, final)))
    assert state.step == 4 and seen == [(2, False), (4, False), (4, True)]
    # Without the callback a failed save raises, but the end record is still written.
    state2 = TrainState.fresh(_run(2))
    with pytest.raises(CheckpointError, match="cannot create a temp file"):
        train_local(state2, _fixed_batch, tokenizer=TOK, save=missing, metrics=metrics)
    metrics.close()
    ends = [r for r in map(json.loads, metrics_path.read_text().splitlines()) if "end" in r]
    assert len(ends) == 2 and all("cannot create" in e["save_error"] for e in ends)
    assert ends[1]["end"] == "done" and ends[1]["step"] == 2
    assert ends[0]["kernels"]["macs"][ends[0]["kernels"]["backend"]] > 0


def test_kernel_line_lists_backend_demotions_and_counts() -> None:
    from daisyweb.training.metrics import kernel_line

    line = kernel_line({"backend": "blas64", "macs": {"blas": 0, "blas64": 1234567},
                        "demotions": [{"backend": "blas", "reason": "audit: cell (0, 0)"}]})
    assert line == ("kernels: backend blas64, demotions: blas (audit: cell (0, 0)), "
                    "multiply-accumulates: blas64 1,234,567")


def test_run_config_factory_fills_defaults_and_refuses_bad_values() -> None:
    from daisyweb.training.config import DEFAULTS, run_config

    run = run_config(40)
    assert (run.model.width, run.model.layers, run.model.heads, run.model.seq) == (
        DEFAULTS["width"], DEFAULTS["layers"], DEFAULTS["heads"], DEFAULTS["seq"])
    assert (run.batch, run.steps, run.lr, run.seed, run.data) == (
        DEFAULTS["batch"], 300, DEFAULTS["lr"], DEFAULTS["seed"], "builtin")
    assert run == RunConfig(model=ModelConfig(vocab=40))  # the dataclass agrees
    assert run_config(40, width=16, heads=2, steps=7, data="server").model.width == 16
    for bad, needle in [({"steps": 0}, "steps"), ({"width": 30}, "not divisible"),
                        ({"lr": 11.0}, "lr"), ({"seed": -1}, "seed"), ({"data": ""}, "data"),
                        ({"batch": True}, "batch")]:
        with pytest.raises(ValueError, match=needle) as exc:
            run_config(40, **bad)
        assert "\n" not in str(exc.value)


@pytest.mark.parametrize("sync_every", [1, 4])
def test_a_lone_run_hashes_where_a_group_would_and_each_hash_is_its_steps(
        sync_every: int) -> None:
    """Lockstep hashes every step; rounds of 4 every fourth and the last (10 is not a
    multiple). Each recorded hash is that of the state after its step: a run stopped
    there ends with the same one."""
    def run(steps: int) -> RunConfig:
        return RunConfig(model=TINY, batch=4, steps=steps, lr=1e-2, seed=3,
                         sync_every=sync_every)

    records: list[StepRecord] = []
    train_local(TrainState.fresh(run(10)), _fixed_batch, tokenizer=TOK,
                on_step=records.append)
    hashed = {r.step: r.weight_hash for r in records if r.weight_hash is not None}
    assert sorted(hashed) == (list(range(1, 11)) if sync_every == 1 else [4, 8, 10])
    for step in (4, 10):
        alone = TrainState.fresh(run(step))
        train_local(alone, _fixed_batch, tokenizer=TOK)
        assert hashed[step] == alone.weight_hash()


def test_a_checkpoint_naming_no_longest_round_had_rounds_of_exactly_sync_every() -> None:
    import dataclasses as dc

    from daisyweb.data import default_tokenizer
    from daisyweb.training.config import run_config

    tok = default_tokenizer()
    run = run_config(tok.vocab_size, width=16, layers=1, heads=2, seq=8, steps=8,
                     sync_every=4, overlap=4)
    assert run.sync_max == 16  # today's default: 4x
    ckpt = TrainState.fresh(run).checkpoint(TokenizerInfo(tok.vocab_size, tok.file_hash))
    assert RunConfig.from_checkpoint(ckpt) == run
    old = dc.replace(ckpt, run={k: v for k, v in ckpt.run.items() if k != "sync_max"})
    assert RunConfig.from_checkpoint(old).sync_max == 4
