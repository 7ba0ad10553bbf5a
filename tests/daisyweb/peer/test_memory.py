"""``peer.memory.tune_malloc``: big blocks are mapped (and unmapped when freed), even
after glibc would have moved its threshold."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from daisyweb.peer.memory import tune_malloc
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return hi - lo
    return 0
if sys.argv[1] == "tuned":
    assert tune_malloc()
big = bytearray(24 << 20)
del big  # glibc's own rule: the mmap threshold rises to 24 MiB
before = heap()
blocks = [bytearray(2 << 20) for _ in range(8)]  # 16 MiB: from the heap, or mapped?
print((heap() - before) >> 10)
"""


def _heap_growth_kib(mode: str) -> int:
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                       timeout=60, check=True)
    return int(r.stdout)


def test_tuned_malloc_keeps_big_blocks_off_the_heap() -> None:
    # Mapped blocks go back to the system when freed; heap space is kept and fragments.
    assert _heap_growth_kib("tuned") < 2 << 10
    assert _heap_growth_kib("default") >= 12 << 10  # what the peer would do untuned
