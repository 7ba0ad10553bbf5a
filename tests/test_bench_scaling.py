import math
import statistics

import pytest

from bench.scaling import median_interval

# Fourteen trials of 2026-12-06 (docs/limits.md section 2, aiortc).
RATIOS = [0.93, 1.03, 1.04, 0.81, 0.71, 0.57, 0.58, 0.48, 0.78, 0.77, 0.81, 0.80, 0.88, 0.81]


def test_the_interval_holds_the_median_and_stays_within_the_trials() -> None:
    low, high = median_interval(RATIOS)
    assert min(RATIOS) <= low <= statistics.median(RATIOS) <= high <= max(RATIOS)
    assert low < high


def test_the_same_trials_give_the_same_interval() -> None:
    assert median_interval(RATIOS) == median_interval(list(RATIOS))


def test_a_wider_spread_gives_a_wider_interval_and_none_gives_a_point() -> None:
    narrow = [0.78 + 0.01 * (i % 3) for i in range(14)]
    lo_n, hi_n = median_interval(narrow)
    lo_w, hi_w = median_interval(RATIOS)
    assert hi_w - lo_w > hi_n - lo_n
    assert median_interval([0.8] * 9) == (0.8, 0.8)


def test_a_trial_that_never_reached_the_target_counts_as_slowest() -> None:
    low, high = median_interval([0.7, 0.75, math.inf])
    assert low == 0.7 and high == math.inf
    with pytest.raises(ValueError, match="no trials"):
        median_interval([])
