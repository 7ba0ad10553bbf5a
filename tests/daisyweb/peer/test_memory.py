"""``peer.memory``: big blocks are mapped (and unmapped when freed), even after glibc
would have moved its threshold; once the run is known, blocks below one parameter vector
(a step's temporaries) come from the heap."""

from __future__ import annotations

import subprocess
import sys

from daisyweb.peer.memory import MAX_THRESHOLD, MMAP_THRESHOLD, step_threshold

PROBE = """
import sys
from daisyweb.peer.memory import keep_step_buffers, tune_malloc
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return hi - lo
    return 0
if sys.argv[1] != "default":
    assert tune_malloc()
if sys.argv[1] == "run known":
    assert keep_step_buffers(int(sys.argv[3]))
big = bytearray(24 << 20)
del big  # glibc's own rule: the mmap threshold rises to 24 MiB
before = heap()
blocks = [bytearray(int(sys.argv[2]) << 20) for _ in range(8)]  # from the heap, or mapped?
print((heap() - before) >> 10)
"""


def _heap_growth_kib(mode: str, block_mib: int = 2, params: int = 0) -> int:
    r = subprocess.run([sys.executable, "-c", PROBE, mode, str(block_mib), str(params)],
                       capture_output=True, text=True, timeout=60, check=True)
    return int(r.stdout)


def test_tuned_malloc_keeps_big_blocks_off_the_heap() -> None:
    # Mapped blocks go back to the system when freed; heap space is kept and fragments.
    assert _heap_growth_kib("tuned") < 2 << 10
    assert _heap_growth_kib("default") >= 12 << 10  # what the peer would do untuned


def test_once_the_run_is_known_blocks_below_a_parameter_vector_stay_on_the_heap() -> None:
    # A 4 MiB parameter vector (2**20 float32): a step's 2 MiB temporaries are reused
    # from the heap instead of being mapped and zeroed again every step ...
    assert _heap_growth_kib("run known", 2, 1 << 20) >= 12 << 10
    # ... while vector-sized blocks and bigger are still mapped, and go back when freed.
    assert _heap_growth_kib("run known", 5, 1 << 20) < 2 << 10


def test_step_threshold_is_just_below_one_vector_within_bounds() -> None:
    assert step_threshold(1 << 20) == (4 << 20) - 1
    assert step_threshold(10) == MMAP_THRESHOLD  # a tiny model keeps the floor
    assert step_threshold(10**9) == MAX_THRESHOLD  # glibc's own ceiling
