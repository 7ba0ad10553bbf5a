"""bench.step's pieces on a tiny model: the phase split and the worker's CPU clock."""

from __future__ import annotations

import os

import pytest

from bench import step as bench_step
from daisyweb.model import ModelConfig

TINY = bench_step.Case("tiny", "tiny", ModelConfig(vocab=31, width=16, layers=2, heads=2,
                                                   seq=8), batch=4)


def test_phase_times_split_the_step_and_restore_the_functions() -> None:
    import daisyweb.model as model_mod
    import kernels.dispatch as dispatch
    from daisyweb.optim import DaisyAdam

    before = (dispatch.quantize_values, dispatch._run, model_mod._backward_rows,
              model_mod._weight_grads, DaisyAdam.step)
    ph = bench_step.phase_times(bench_step.numpy_step(TINY), 3)
    assert set(ph) == {*bench_step.PHASES, "total"}
    for name in bench_step.PHASES[:4]:
        assert ph[name] > 0, name  # every wrapped phase really ran
    assert sum(ph[k] for k in bench_step.PHASES) == pytest.approx(ph["total"])
    assert before == (dispatch.quantize_values, dispatch._run, model_mod._backward_rows,
                      model_mod._weight_grads, DaisyAdam.step)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux /proc")
def test_cpu_seconds_counts_this_process() -> None:
    a = bench_step._cpu_seconds(os.getpid())
    x = 0
    for i in range(3_000_000):
        x += i
    assert bench_step._cpu_seconds(os.getpid()) > a
