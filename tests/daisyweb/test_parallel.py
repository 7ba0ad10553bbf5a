"""``daisyweb.parallel``: the two halves of a step run on two CPUs, even right after
both threads slept (Linux woke them on one CPU, and the halves ran in turn)."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from daisyweb import parallel

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs this process may use")


def _cpu() -> int:
    return int(ctypes.CDLL(None).sched_getcpu())


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_halves_run_on_two_cpus_after_both_threads_slept() -> None:
    before = parallel.cores()
    parallel.set_cores(2)
    mask = os.sched_getaffinity(0)
    seen: dict[str, int] = {}

    def first() -> None:
        _spin(0.02)  # long enough for both halves to be running at once
        seen["first"] = _cpu()

    def second() -> None:
        _spin(0.02)
        seen["second"] = _cpu()

    try:
        for _ in range(8):
            time.sleep(0.2)  # both threads idle, as a peer waiting on the network
            seen.clear()
            parallel.both(first, second)
            assert seen["first"] != seen["second"], seen
            # the caller gets its own CPUs back after the call
            assert os.sched_getaffinity(0) == mask
    finally:
        parallel.set_cores(before)


def test_one_core_runs_the_halves_in_turn_on_the_callers_thread() -> None:
    before = parallel.cores()
    parallel.set_cores(1)
    order: list[str] = []
    try:
        parallel.both(lambda: order.append("first"), lambda: order.append("second"))
    finally:
        parallel.set_cores(before)
    assert order == ["first", "second"]
