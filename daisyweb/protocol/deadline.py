"""A round's deadline, fitted to the group's own round times.

The leader measures every committed round: the seconds from naming its roster to the
arrival of the last contribution, per inner step of the round (the leader names rounds
of different lengths, ``protocol.pace``). The deadline of the next round is its steps
times the larger of ``MEDIAN_FACTOR`` times the median of the last ``WINDOW`` rounds and
the median plus ``MAD_FACTOR`` median absolute deviations, never less than ``FLOOR_S``;
until ``MIN_SAMPLES`` rounds are measured it is ``FIRST_S`` (the first rounds warm up:
kernel gates, a joiner's start).
A member whose contribution has not arrived by then is left out of that round (the
roster is amended without it; it commits the others' mean like everyone); one that
misses ``MAX_MISSES`` rounds in a row is dropped from the group. A slow honest member
does not trip it: the deadline is measured on the slowest member of every round, and
capacity shares give a slow machine fewer sequences.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["Deadline", "FIRST_S", "FLOOR_S", "MAX_MISSES"]

FIRST_S = 120.0
FLOOR_S = 3.0
MEDIAN_FACTOR = 3.0
MAD_FACTOR = 6.0
WINDOW = 20
MIN_SAMPLES = 3
MAX_MISSES = 2


class Deadline:
    """The leader's round times and the deadline they imply."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=WINDOW)
        self.misses: dict[str, int] = {}  # member -> rounds missed in a row

    def record(self, seconds: float, steps: int = 1) -> None:
        """A round of ``steps`` inner steps committed ``seconds`` after its roster was
        named."""
        if seconds >= 0.0 and steps > 0:
            self._times.append(seconds / steps)

    def seconds(self, steps: int = 1) -> float:
        """The deadline of a round of ``steps`` inner steps."""
        if len(self._times) < MIN_SAMPLES:
            return FIRST_S
        median = statistics.median(self._times)
        mad = statistics.median(abs(t - median) for t in self._times)
        return max(FLOOR_S, max(steps, 1) * max(MEDIAN_FACTOR * median,
                                                median + MAD_FACTOR * mad))

    def missed(self, member: str) -> bool:
        """``member`` missed a round: True once it has missed ``MAX_MISSES`` in a row."""
        self.misses[member] = self.misses.get(member, 0) + 1
        return self.misses[member] >= MAX_MISSES

    def made_it(self, member: str) -> None:
        self.misses.pop(member, None)
