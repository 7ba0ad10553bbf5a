from __future__ import annotations

import math

import pytest

from daisyweb.training.overlap import FIRST_HEAD, MARGIN, OverlapGauge, head_steps


def test_before_any_measurement_the_first_head_start() -> None:
    assert head_steps(None, None, 16) == FIRST_HEAD == 2
    assert head_steps(0.5, None, 16) == 2
    assert head_steps(None, 0.1, 16) == 2
    assert head_steps(math.inf, 0.1, 16) == 2
    assert head_steps(None, None, 1) == 1  # never beyond the run's limit


def test_runs_ahead_as_far_as_the_exchange_took_and_a_margin() -> None:
    # 0.5 s of exchange at 0.125 s a step: 5 steps, and a quarter more
    assert head_steps(0.5, 0.1, 16) == math.ceil(MARGIN * 5) == 7
    assert head_steps(0.001, 0.1, 16) == 1  # a fast link: one step
    assert head_steps(0.0, 0.1, 16) == 1


@pytest.mark.parametrize(("limit", "expected"), [(64, 64), (4, 4), (0, 0)])
def test_never_beyond_the_runs_longest_round(limit: int, expected: int) -> None:
    assert head_steps(30.0, 0.1, limit) == expected  # a very slow link


def test_the_gauge_measures_each_rounds_exchange_and_looks_at_the_longer_of_two() -> None:
    g = OverlapGauge()
    assert g.steps(16) == 2
    g.ready(0, now=1.0, compute_s=2.0, steps=16)  # 0.125 s a step
    g.committed(0, now=1.5)  # waited 0.5 s: 4 steps
    assert g.steps(16) == math.ceil(MARGIN * 4)
    g.ready(1, now=3.5, compute_s=2.0, steps=16)
    g.committed(1, now=3.625)
    assert g.steps(16) == math.ceil(MARGIN * 4)  # the longer of the last two
    g.ready(2, now=5.625, compute_s=2.0, steps=16)
    g.committed(2, now=5.75)
    assert g.steps(16) == 2  # ceil(1.25 x 1)
    # A rollback's recommit has no ready time of its own: nothing is measured.
    g.committed(2, now=5.75)
    assert g.steps(16) == 2


def test_rounds_that_never_committed_here_are_forgotten() -> None:
    g = OverlapGauge()
    g.ready(3, now=40.0, compute_s=2.0, steps=16)  # then a rejoin at round 5
    g.ready(5, now=50.0, compute_s=2.0, steps=16)
    g.committed(5, now=50.25)
    assert g.ready_at == {}
