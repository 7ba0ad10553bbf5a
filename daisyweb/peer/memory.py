"""Keep a long-running peer's resident memory close to what it really holds.

glibc's malloc raises its mmap threshold each time a big block is freed (up to 32 MiB),
so after the first snapshot or round the peer's multi-megabyte arrays and messages would
come from the heap, where freed space is kept and fragments: a follower's resident memory
would settle ~30 MB above what it holds at the demo default (``TEST_RESULTS.md``,
bench:memory). :func:`tune_malloc` fixes the threshold, so big blocks always go back to
the system when freed, and caps the per-thread arenas (the compute worker thread and the
WebRTC threads would each get one of their own). Nothing happens where there is no glibc.

A fixed threshold of 256 KiB costs speed, though: a training step's own temporaries
(activations, logits: up to 4 MiB at the demo default) would be mapped, zeroed by the
kernel and unmapped again every step, ~28,000 page faults a second and 7% of a one-core
peer in the kernel (group tokens/s 10% lower, ``bench.scaling``). So once the run is known,
:func:`keep_step_buffers` raises the threshold to just below one parameter vector:
whatever is smaller than that comes from the heap and is reused step after step (int8
payloads too, a quarter of a vector), while vectors and anything bigger (float32
payloads, snapshots) still go back to the system when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

__all__ = ["keep_step_buffers", "step_threshold", "tune_malloc"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 256 << 10  # blocks from 256 KiB up are mapped, and unmapped when freed
ARENA_MAX = 2
MAX_THRESHOLD = 32 << 20  # glibc's own ceiling for its moving threshold
TRIM_THRESHOLD = 32 << 20  # free heap kept at its top before it is returned


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where there is none (not Linux, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt  # type: ignore[no-any-return]


def tune_malloc() -> bool:
    """Set glibc's mmap threshold and arena count; False where that is not glibc."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_ARENA_MAX, ARENA_MAX))


def step_threshold(params: int) -> int:
    """The mmap threshold for a model of ``params`` parameters: just below one float32
    vector of them, within [MMAP_THRESHOLD, MAX_THRESHOLD]."""
    return max(MMAP_THRESHOLD, min(4 * params - 1, MAX_THRESHOLD))


def keep_step_buffers(params: int) -> bool:
    """Blocks below one parameter vector come from the heap from now on (see the module
    docstring); False where that is not glibc."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, step_threshold(params))) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
