"""The task interface: loading a task by name, its settings, its code hash, the
built-in GPT through it, and the teacher task's arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from daisyweb.model import ModelConfig, init_params, loss_and_grad, param_count
from daisyweb.protocol import wire
from daisyweb.tasks import TaskError, check_task_config, load_task, task_hash
from daisyweb.tasks.gpt import GPT
from daisyweb.tasks.teacher import Teacher
from daisyweb.training import config
from daisyweb.training.config import RunConfig, run_config
from daisyweb.training.state import TrainState

TEACHER = "daisyweb.tasks.teacher:Teacher"
MINIMAL = '''
import numpy as np
from daisyweb.tasks import FieldSpec, Task

class Line(Task):
    """y = a x: one parameter."""
    FIELDS = {"slope": FieldSpec(float, -10.0, 10.0, 2.0)}

    @property
    def size(self):
        return 1

    def init_params(self, seed):
        return np.zeros(1, dtype=np.float32)

    def batch(self, seed, step, member, rows):
        x = np.random.default_rng([seed, step]).standard_normal(rows).astype(np.float32)
        return np.stack([x, np.float32(self.config["slope"]) * x], axis=1)

    def loss_and_grad(self, params, batch, out=None):
        err = params[0] * batch[:, 0] - batch[:, 1]
        grad = np.empty(1, dtype=np.float32) if out is None else out
        grad[0] = np.mean(2 * err * batch[:, 0])
        return float(np.mean(err * err)), grad

    def heldout(self, params):
        return self.loss_and_grad(params, self.batch(0, 0, "", 64))[0]
'''


def _module(where: Path, name: str, source: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{name}.py").write_text(source)


def _teacher_run(**config: int | float) -> RunConfig:
    return run_config(100, steps=40, sync_every=1, codec="f32", task=TEACHER,
                      task_hash=task_hash(TEACHER), task_config=tuple(sorted(config.items())))


def test_the_teacher_gradient_is_the_derivative_of_its_loss() -> None:
    task = Teacher({"hidden": 6, "inputs": 5, "outputs": 3})
    params = task.init_params(3) + np.float32(0.1)
    batch = task.batch(3, 0, "a", 16)
    loss, grad = task.loss_and_grad(params, batch)
    assert grad.dtype == np.float32 and grad.shape == (task.size,)
    for i in range(0, task.size, 7):
        eps = 1e-2
        up, down = params.copy(), params.copy()
        up[i] += eps
        down[i] -= eps
        numeric = (task.loss_and_grad(up, batch)[0] - task.loss_and_grad(down, batch)[0]) / (
            2 * eps)
        assert grad[i] == pytest.approx(numeric, rel=2e-2, abs=2e-4), i
    out = np.full(task.size, np.nan, dtype=np.float32)
    assert task.loss_and_grad(params, batch, out=out)[1] is out and np.array_equal(out, grad)


def test_the_teacher_draws_the_same_bits_for_the_same_seed_step_and_member() -> None:
    task = Teacher({})
    assert task.init_params(1).tobytes() == Teacher({}).init_params(1).tobytes()
    assert task.init_params(1).tobytes() != task.init_params(2).tobytes()
    assert task.batch(1, 5, "a", 8).tobytes() == Teacher({}).batch(1, 5, "a", 8).tobytes()
    assert task.batch(1, 5, "a", 8).tobytes() != task.batch(1, 5, "b", 8).tobytes()
    assert task.batch(1, 5, "a", 8).tobytes() != task.batch(1, 6, "a", 8).tobytes()


def test_a_teacher_run_learns() -> None:
    run = _teacher_run(hidden=16)
    state = TrainState.fresh(run)
    task = run.task_impl
    before = task.heldout(state.params)
    for step in range(40):
        _, grad = state.gradient(task.batch(run.seed, step, "a", run.batch))
        state.apply(grad)
    assert task.heldout(state.params) < 0.5 * before


def test_settings_are_checked_against_the_tasks_fields() -> None:
    assert check_task_config(Teacher, {"hidden": 8}) == {
        "inputs": 16, "hidden": 8, "outputs": 4, "noise": 0.01, "teacher": 0,
        "teacher_hidden": 8}
    for bad, why in [({"width": 8}, "no setting 'width'"), ({"hidden": 0}, "hidden must be"),
                     ({"hidden": 2.5}, "hidden must be int"), ({"noise": float("nan")},
                                                                 "noise must be")]:
        with pytest.raises(TaskError, match=why):
            check_task_config(Teacher, bad)


@pytest.mark.parametrize(("spec", "why"), [
    ("teacher", "module:Name"), ("a b:C", "module:Name"),
    ("daisyweb.tasks.nosuch:X", "cannot import daisyweb.tasks.nosuch"),
    ("daisyweb.tasks.teacher:Nope", "no Task subclass Nope"),
    ("daisyweb.tasks.base:Task", "no Task subclass Task"),
    ("daisyweb.tasks.teacher:np", "no Task subclass np"),
])
def test_a_task_that_cannot_be_loaded_is_said(spec: str, why: str) -> None:
    with pytest.raises(TaskError, match=why):
        load_task(spec)


def test_a_member_with_other_task_code_refuses_the_run(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path / "v1", "linetask", MINIMAL)
    _module(tmp_path / "v2", "linetask", MINIMAL.replace("2.0)}", "3.0)}"))
    monkeypatch.syspath_prepend(str(tmp_path / "v1"))
    spec = "linetask:Line"
    leaders = task_hash(spec)
    run = run_config(100, steps=4, sync_every=1, codec="f32", task=spec, task_hash=leaders)
    assert run.task_impl.config == {"slope": 2.0}
    # the same config on a member whose linetask.py differs (another process: nothing
    # loaded yet)
    sys.modules.pop("linetask")
    config._task_of.cache_clear()
    monkeypatch.syspath_prepend(str(tmp_path / "v2"))
    assert task_hash(spec) != leaders
    there = RunConfig.from_wire(run.to_wire())
    with pytest.raises(TaskError, match="task linetask:Line differs here"):
        there.task_impl  # noqa: B018
    sys.modules.pop("linetask", None)


def test_the_run_config_carries_the_task_over_the_wire() -> None:
    run = _teacher_run(hidden=8, noise=0.5)
    msg = wire.decode(wire.encode(run.to_wire()))
    assert (msg.task, msg.task_hash, msg.task_config) == (  # type: ignore[union-attr]
        TEACHER, task_hash(TEACHER), {"hidden": 8, "noise": 0.5})
    again = RunConfig.from_wire(msg)  # type: ignore[arg-type]
    assert again == run and again.task_impl.size == run.task_impl.size
    d = run.to_wire().to_dict()
    for bad in [{"task_hash": "ab"}, {"task": "no name"}, {"task_config": {"Bad": 1}},
                {"task_config": {"x": "1"}}, {"task": "", "task_config": {"x": 1}},
                {"task_config": {f"f{i}": i for i in range(33)}}]:
        with pytest.raises(wire.WireError, match="task"):
            wire.Config.from_dict({**d, **bad})


def test_the_built_in_gpt_is_a_task() -> None:
    model = ModelConfig(vocab=64, width=16, layers=1, heads=2, seq=8)
    gpt = GPT(model, quantized=False)
    assert gpt.size == param_count(model)
    assert gpt.init_params(3).tobytes() == init_params(model, 3).tobytes()
    batch = gpt.batch(3, 0, "a", 2) % 64
    loss, grad = gpt.loss_and_grad(gpt.init_params(3), batch)
    ref = loss_and_grad(model, init_params(model, 3), batch, quantized=False)
    assert loss == ref[0] and np.array_equal(grad, ref[1])
    run = run_config(64, width=16, layers=1, heads=2, seq=8, sync_every=1, codec="f32")
    assert isinstance(run.task_impl, GPT) and run.task_impl.ROW_TOKENS == 8


def test_a_named_tasks_run_has_no_checkpoint() -> None:
    state = TrainState.fresh(_teacher_run())
    with pytest.raises(ValueError, match="checkpoints hold the built-in GPT"):
        state.checkpoint(None)  # type: ignore[arg-type]


def test_the_template_in_examples_is_a_task_that_learns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[3] / "examples"))
    spec = "task_template:Polynomial"
    cls = load_task(spec)
    run = run_config(100, steps=200, sync_every=1, codec="f32", lr=0.05, task=spec,
                     task_hash=task_hash(spec), task_config=(("degree", 5),))
    assert cls is type(run.task_impl) and run.task_impl.size == 6
    state = TrainState.fresh(run)
    task = run.task_impl
    before = task.heldout(state.params)
    for step in range(200):
        _, grad = state.gradient(task.batch(run.seed, step, "a", 16))
        state.apply(grad)
    assert task.heldout(state.params) < 0.2 * before
    sys.modules.pop("task_template", None)
