"""``daisyweb-eval``: a checkpoint's held-out loss, and one clear line for every bad input."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from daisyweb.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from daisyweb.cli import demo
from daisyweb.cli import eval as eval_cli
from daisyweb.data import default_tokenizer
from daisyweb.training.config import run_config
from daisyweb.training.evaluate import DEFAULT_BATCH, heldout_batches, heldout_loss, max_batches
from daisyweb.training.state import TrainState

TINY = {"width": 16, "layers": 1, "heads": 2, "seq": 16, "batch": 4}
TINY_FLAGS = [x for k, v in TINY.items() for x in (f"--{k}", str(v))]
STEPS = 40
LINE = re.compile(r"^(?P<file>.+): step (?P<step>\d+), held-out loss (?P<loss>\d+\.\d{6}), "
                  r"perplexity (?P<ppl>\d+\.\d{2}) \((?P<tokens>\d+) tokens: (?P<n>\d+) batches "
                  r"of (?P<b>\d+) x (?P<seq>\d+)\)$")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(untrained start, the same run after STEPS steps), written by the training code."""
    d = tmp_path_factory.mktemp("eval")
    trained = d / "trained.pt"
    assert demo.main(["--peers", "1", "--steps", str(STEPS), "--lr", "1e-2",
                      "--save", str(trained), *TINY_FLAGS]) == 0
    tok = default_tokenizer()
    run = run_config(tok.vocab_size, steps=STEPS, lr=1e-2, **TINY)
    start = d / "start.pt"
    from daisyweb.checkpoints.checkpoint import TokenizerInfo

    save_checkpoint(start, TrainState.fresh(run).checkpoint(
        TokenizerInfo(tok.vocab_size, tok.file_hash)))
    return start, trained


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daisyweb.cli.eval", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_prints_the_heldout_loss_of_a_real_checkpoint(checkpoints) -> None:
    _, trained = checkpoints
    proc = _cli(str(trained), "--batches", "5")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    m = LINE.match(proc.stdout.rstrip("\n"))
    assert m, proc.stdout
    ckpt = load_checkpoint(trained)
    assert int(m["step"]) == STEPS == ckpt.step
    assert (int(m["n"]), int(m["b"]), int(m["seq"])) == (5, DEFAULT_BATCH, 16)
    assert int(m["tokens"]) == 5 * DEFAULT_BATCH * 16
    # the same number heldout_loss gives in this process
    expect = heldout_loss(ckpt.model, ckpt.params, heldout_batches(16, batches=5))
    assert m["loss"] == f"{expect:.6f}"
    assert abs(float(m["ppl"]) - 2.718281828459045 ** expect) < 0.01
    assert _cli(str(trained), "--batches", "5").stdout == proc.stdout  # fixed batches


def test_in_process_result_equals_heldout_loss_exactly(checkpoints, capsys) -> None:
    _, trained = checkpoints
    ckpt = load_checkpoint(trained)
    ev = eval_cli.evaluate_checkpoint(ckpt, 3)
    assert ev.loss == heldout_loss(ckpt.model, ckpt.params, heldout_batches(16, batches=3))
    assert eval_cli.main([str(trained), "--batches", "3"]) == 0
    assert f"held-out loss {ev.loss:.6f}," in capsys.readouterr().out


def test_training_lowers_the_heldout_loss(checkpoints, capsys) -> None:
    start, trained = checkpoints
    losses = []
    for path in (start, trained):
        assert eval_cli.main([str(path), "--batches", "20"]) == 0
        m = LINE.match(capsys.readouterr().out.rstrip("\n"))
        assert m
        losses.append(float(m["loss"]))
    assert load_checkpoint(start).step == 0
    assert losses[1] < losses[0] - 0.3, losses  # 40 steps on the training part help


def test_missing_file(tmp_path) -> None:
    proc = _cli(str(tmp_path / "nope.pt"))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == f"daisyweb-eval: no such file: {tmp_path / 'nope.pt'}"


def test_bad_files(tmp_path, checkpoints) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    cut = tmp_path / "cut.pt"
    cut.write_bytes(checkpoints[1].read_bytes()[:1000])
    for path in (bad, cut, tmp_path):  # a directory is not a file either
        proc = _cli(str(path))
        assert proc.returncode == 1 and proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[0].startswith(("daisyweb-eval: cannot use", "daisyweb-eval: no such file"))


def test_checkpoint_of_another_tokenizer_is_refused(tmp_path) -> None:
    from daisyweb.checkpoints.checkpoint import TokenizerInfo

    run = run_config(default_tokenizer().vocab_size, steps=1, **TINY)
    other = tmp_path / "other.pt"
    save_checkpoint(other, TrainState.fresh(run).checkpoint(
        TokenizerInfo(default_tokenizer().vocab_size, "0" * 64)))
    proc = _cli(str(other))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"daisyweb-eval: cannot use {other}:")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value", ["0", "-3", "x", "1.5", "10001"])
def test_bad_batches_flag(value, checkpoints) -> None:
    proc = _cli(str(checkpoints[1]), "--batches", value)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert "daisyweb-eval: error:" in proc.stderr and "--batches" in proc.stderr


def test_more_batches_than_the_heldout_text_holds(checkpoints) -> None:
    fit = max_batches(16, DEFAULT_BATCH)
    proc = _cli(str(checkpoints[1]), "--batches", str(fit + 1))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"daisyweb-eval: --batches {fit + 1} is more than the held-out text holds at seq 16: "
        f"at most {fit} batches of {DEFAULT_BATCH} windows (58017 tokens)"]
    assert _cli(str(checkpoints[1]), "--batches", str(fit)).returncode == 0


def test_script_is_installed_by_pyproject() -> None:
    text = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    assert 'daisyweb-eval = "daisyweb.cli.eval:main"' in text


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_damaged_weights_are_one_line_not_a_traceback(tmp_path, command) -> None:
    """Finite but absurd weights (what a poisoned group once saved: max |w| 1.5e36) make
    the forward pass overflow: both commands say so in one line, exit 1."""
    from daisyweb.checkpoints.checkpoint import TokenizerInfo

    tok = default_tokenizer()
    state = TrainState.fresh(run_config(tok.vocab_size, steps=4, lr=1e-2, **TINY))
    state.params[:] = 1.5e36
    bad = tmp_path / "damaged.pt"
    save_checkpoint(bad, state.checkpoint(TokenizerInfo(tok.vocab_size, tok.file_hash)))
    extra = ["--prompt", "And", "--tokens", "3"] if command == "generate" else []
    p = subprocess.run([sys.executable, "-m", f"daisyweb.cli.{command}", str(bad), *extra],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert "forward pass overflows" in p.stderr and "1.5e+36" in p.stderr
