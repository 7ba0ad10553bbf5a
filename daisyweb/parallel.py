"""Two cores for one training step, without changing a bit of what it computes.

The model splits every batch into two fixed halves (:func:`halves`, by the batch size
alone) and deals its whole-batch jobs to two lists (:func:`deal`); the optimizer splits
its buffer into two fixed ranges. With one core allowed the two parts run one after the
other; with two, the second runs on one helper thread while the caller runs the first,
the helper kept on one CPU of the process's set and the caller held on another while the
parts run (after both threads slept, Linux may wake them on one CPU). Either way each
part computes the same operations on the same data, so the result is the same bytes
whatever the core count.

The core count comes from ``DAISYWEB_THREADS``, else ``OPENBLAS_NUM_THREADS``, else
``OMP_NUM_THREADS``, else the CPUs this process may use, capped at 2; ``set_cores``
changes it. Whatever the count, OpenBLAS is asked for one thread per call: with two
cores its own workers would contend with the helper thread for them, with one it is
the one core asked for; and then no product's bits depend on how OpenBLAS splits a GEMM
over its threads (with the Zen kernel set, ``daisyweb.blascore``, some float GEMMs round
differently at one and at two BLAS threads).
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np

__all__ = ["Rows", "blas_core", "both", "cores", "deal", "halves", "in_halves",
           "set_cores"]

_T = TypeVar("_T")

_ENV = ("DAISYWEB_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")


def _env_cores() -> int:
    for var in _ENV:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) >= 1:
            return int(value)
    # The CPUs this process may run on (taskset, a container's cpuset), not the machine's.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _openblas_fn(*names: str) -> Any:
    """The first of ``names`` exported by numpy's bundled OpenBLAS, or None."""
    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in glob.glob(os.path.join(libs, "libscipy_openblas*.so*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                return fn
    return None


def _openblas_setter() -> Callable[[int], Any] | None:
    """numpy's bundled OpenBLAS ``set_num_threads``, or None (then BLAS is left alone)."""
    return _openblas_fn(  # type: ignore[no-any-return]
        "scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads")


def blas_core() -> str:
    """The kernel set ("core type") numpy's OpenBLAS loaded, or "?" (see
    ``daisyweb.blascore``)."""
    fn = _openblas_fn("scipy_openblas_get_corename64_", "scipy_openblas_get_corename")
    if fn is None:
        return "?"
    fn.restype = ctypes.c_char_p
    return (fn() or b"?").decode("ascii", "replace")


def _set_cpus(tid: int, cpus: set[int]) -> bool:
    """Thread ``tid`` (0: this one) may run only on ``cpus``; False if refused."""
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError:  # a cpuset changed from outside, say: the scheduler decides
        return False
    return True


class _Helper:
    """One helper thread that runs the second half of a ``both`` call.

    A hand-off is two plain locks (the caller releases ``go``, the helper releases
    ``done``): a ThreadPoolExecutor's futures and conditions hold the GIL several
    times longer per call, and a step makes a few of these calls. ``busy`` keeps a
    second caller (another thread) from sharing the helper: that one runs in turn.
    """

    def __init__(self) -> None:
        self.busy = threading.Lock()
        self.go = threading.Lock()
        self.done = threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.fn: Callable[[], Any] | None = None
        self.err: BaseException | None = None
        # Two CPUs to keep the halves apart on (see run); none if the process has fewer.
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
        self.places = (cpus[0], cpus[-1]) if len(cpus) >= 2 else None
        thread = threading.Thread(target=self._loop, name="daisyweb-half", daemon=True)
        thread.start()
        if self.places is not None and thread.native_id is not None:
            _set_cpus(thread.native_id, {self.places[1]})

    def _loop(self) -> None:
        _local.helper = True
        while True:
            self.go.acquire()
            try:
                assert self.fn is not None
                self.fn()
            except BaseException as e:  # handed to the caller, re-raised there
                self.err = e
            finally:
                self.done.release()

    def run(self, first: Callable[[], Any], second: Callable[[], Any]) -> None:
        """``first`` here and ``second`` on the helper; the caller holds ``busy``.

        While the halves run, the caller is held on the one CPU and the helper stays on
        the other: after both threads slept (a peer waiting on the network), Linux may
        wake them on one CPU, and the halves then run in turn until it moves one, at the
        speed of one core. The caller gets its own CPUs back after the call. Which CPU
        runs a thread changes no bit."""
        held = None
        if self.places is not None:
            held = os.sched_getaffinity(0)
            if not _set_cpus(0, {self.places[0]}):
                held = None
        self.fn, self.err = second, None
        self.go.release()
        try:
            first()
        finally:
            self.done.acquire()  # always wait: the second half may still write buffers
            err, self.fn, self.err = self.err, None, None
            if held is not None:
                _set_cpus(0, held)
        if err is not None:
            raise err


_lock = threading.Lock()
_cores = 0  # 0: not decided yet
_pool: _Helper | None = None
_blas_threads: Callable[[int], Any] | None = None


def set_cores(n: int) -> None:
    """Use ``n`` cores (1 or more; only 2 are ever used) for the model's steps."""
    global _cores, _pool, _blas_threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"cores must be a positive integer, got {n!r}")
    with _lock:
        _cores = min(2, n)
        if _cores == 2 and _pool is None:
            _pool = _Helper()
        if _blas_threads is None:
            _blas_threads = _openblas_setter()
        if _blas_threads is not None:
            _blas_threads(1)


def cores() -> int:
    """The number of cores the model's steps use now (1 or 2)."""
    if not _cores:
        set_cores(_env_cores())
    return _cores


_local = threading.local()


def _forget_after_fork() -> None:
    """A forked child has no helper thread: decide afresh on first use."""
    global _pool, _cores, _lock
    _pool, _cores, _lock = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def both(first: Callable[[], Any], second: Callable[[], Any]) -> None:
    """Run ``first`` and ``second`` (independent, each writing only its own data): in
    parallel on two cores, else in turn. Re-raises the first error either raised."""
    helper = _pool
    if (cores() < 2 or helper is None or getattr(_local, "helper", False)
            or not helper.busy.acquire(blocking=False)):
        first()  # (on the helper thread itself, or while another thread uses the
        second()  # helper: in turn, never wait on ourselves)
        return
    try:
        helper.run(first, second)
    finally:
        helper.busy.release()


class Rows:
    """One half's rows: ``b`` (batch rows), ``r`` (token rows of a [B*T] buffer) and
    ``size`` (how many batch rows)."""

    def __init__(self, rows: slice, t: int) -> None:
        self.b = rows
        self.r = slice(rows.start * t, rows.stop * t)
        self.size = rows.stop - rows.start


def halves(bsz: int) -> list[slice]:
    """The batch rows of each half a call is computed in: fixed by the batch size alone
    (never by the core count), so the bits do not depend on how many cores ran it."""
    if bsz < 2:
        return [slice(0, bsz)]
    mid = (bsz + 1) // 2
    return [slice(0, mid), slice(mid, bsz)]


def in_halves(bsz: int, t: int, body: Callable[[int, Rows], Any]) -> None:
    """``body(half index, Rows)`` for each half of a [bsz, t] batch, through :func:`both`
    when there are two."""
    parts = [Rows(rows, t) for rows in halves(bsz)]
    if len(parts) == 1:
        body(0, parts[0])
    else:
        both(lambda: body(0, parts[0]), lambda: body(1, parts[1]))


def deal(costed: Iterable[tuple[int, _T]]) -> tuple[list[_T], list[_T]]:
    """Items dealt in order to two lists of about equal total cost, one per core: each
    to the list with the smaller total so far, the first on a tie."""
    lists: tuple[list[_T], list[_T]] = ([], [])
    load = [0, 0]
    for cost, item in costed:
        k = 0 if load[0] <= load[1] else 1
        lists[k].append(item)
        load[k] += cost
    return lists
