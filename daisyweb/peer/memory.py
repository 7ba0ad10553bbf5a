"""Keep a long-running peer's resident memory close to what it really holds.

glibc's malloc raises its mmap threshold each time a big block is freed (up to 32 MiB),
so after the first snapshot or round the peer's multi-megabyte arrays and messages come
from the heap, where freed space is kept and fragments: a follower's resident memory
settled ~30 MB above what it held (measured at the demo default, ``TEST_RESULTS.md``,
bench:memory). :func:`tune_malloc` fixes the threshold, so big blocks always go back to
the system when freed, and caps the per-thread arenas (the compute worker thread and the
WebRTC threads each got one of their own). Nothing happens where there is no glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["tune_malloc"]

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 256 << 10  # blocks from 256 KiB up are mapped, and unmapped when freed
ARENA_MAX = 2


def tune_malloc() -> bool:
    """Set glibc's mmap threshold and arena count; False where that is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_ARENA_MAX, ARENA_MAX))
