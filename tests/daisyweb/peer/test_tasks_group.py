"""A group trains a task that is not the built-in GPT (``--task``, ``daisyweb.tasks``):
real peers, identical at every boundary and equal to the replay oracle; a member whose
task code differs refuses the run in one line."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from daisyweb.tasks.teacher import Teacher
from daisyweb.training.replay import replay_rounds
from tests.daisyweb.peer.test_run import Group, group, paced, same_hashes, server
from tests.daisyweb.tasks.test_tasks import MINIMAL

__all__ = ["group", "server"]  # the fixtures, shared with test_run

TEACHER = "daisyweb.tasks.teacher:Teacher"


def test_a_group_trains_the_teacher_task_identical_at_every_boundary(group: Group) -> None:
    run = ["--task", TEACHER, "--task-set", "hidden=16", "--batch", "8", "--seed", "3",
           "--sync-every", "4", "--sync-max", "4", "--codec", "int8", "--steps", "40",
           "--lr", "0.02", "--eval-every", "20", "--wait-peers", "2"]
    lead = group.leader(*run)
    a = group.spawn("a")
    assert [lead.wait(), a.wait()] == [0, 0], group.logs()
    assert f"task {TEACHER}" in lead.log.read_text()
    assert [r["step"] for r in lead.steps()] == list(range(4, 41, 4))
    hashes = same_hashes(lead, a)
    spec = [(r["roster"], {q: np.load(group.grads / f"{q}-{r['round'] - 1}.npy")
                           for q in r["roster"]}, r.get("shares", ())) for r in lead.steps()]
    start = Teacher({"hidden": 16}).init_params(3)
    assert hashes == replay_rounds(start, spec, **paced(lead.steps()))
    heldout = [r["heldout_loss"] for r in lead.steps() if "heldout_loss" in r]
    assert len(heldout) == 2 and heldout[-1] < 0.5 * Teacher({"hidden": 16}).heldout(start)


def test_a_member_whose_task_code_differs_refuses_the_run(group: Group,
                                                          tmp_path: Path) -> None:
    for version, slope in (("v1", "2.0"), ("v2", "3.0")):
        where = tmp_path / version
        where.mkdir()
        (where / "linetask.py").write_text(MINIMAL.replace("2.0)}", f"{slope})}}"))
    path = os.environ.get("PYTHONPATH", "")
    # --wait-peers 2: the other peer is offered the state before step 0 and refuses it
    lead = group.leader("--task", "linetask:Line", "--sync-every", "1", "--codec", "f32",
                        "--steps", "6", "--batch", "2", "--wait-peers", "2",
                        env={"PYTHONPATH": f"{tmp_path / 'v1'}{os.pathsep}{path}"})
    other = group.spawn("other", env={"PYTHONPATH": f"{tmp_path / 'v2'}{os.pathsep}{path}"})
    assert other.wait() == 1, group.logs()
    assert "task linetask:Line differs here" in other.log.read_text()
    assert "every member must run the same task code" in other.log.read_text()
    assert lead.wait() == 0, group.logs()
    assert all(r["roster"] == [lead.id()] for r in lead.steps())
