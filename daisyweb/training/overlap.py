"""How many steps a member's exchange takes: what the group's head start and round length
follow (``--overlap K``, ``--sync-max``; the leader's choice is ``protocol.pace``).

A head start hides the exchange behind compute, but each step taken before the group's
update is known trains on staler weights (``python -m bench.overlap`` measures what that
costs in held-out loss). So the group runs ahead only as far as its exchange needs: each
member measures its wait from its contribution ready to the round committed (the others'
bytes arriving, and the commit's own work), counts it in steps at its own seconds per
step and a quarter more, at least one and at most the run's longest round, and publishes
the number with its hashes (``wire.StepHashes.ahead``). The leader's roster names the
most any member needs (``wire.Roster.ahead``), so every member runs ahead alike, at most
the run's ``overlap`` (which may be the whole round: then round ``r``'s update is
applied a round late), and makes the round long enough for it. Before anything is
measured it is ``FIRST_HEAD`` steps.

Every member's wait counts because it is the waiting members that a longer head start
helps: a member whose contribution is the last to be ready (a slower one, or the leader
with its own duties) waits hardly at all while the others wait for its bytes. The time
between two commits less the round's compute would count that too, but also the CPU a
peer spends on the exchange and on evaluations, which a head start on the same core
cannot hide.

What a member computes never changes the shared state, which comes from the exchanged
bytes only: the number is a matter of speed and loss, never of agreement.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["FIRST_HEAD", "MARGIN", "OverlapGauge", "head_steps"]

FIRST_HEAD = 2  # steps ahead before any exchange was measured
MARGIN = 1.25  # run ahead a quarter longer than the exchange took (links vary)
_KEPT = 2  # exchanges the estimate looks back on (the longer counts)


def head_steps(exchange_s: float | None, step_s: float | None, limit: int) -> int:
    """The steps of compute this member's exchange needs, at most ``limit``.

    ``exchange_s``: how long this member's last exchanges took (contribution ready to
    round committed); ``step_s``: its compute seconds per inner step; None: not measured
    yet, then ``FIRST_HEAD`` steps."""
    if limit <= 0:
        return 0
    if exchange_s is None or step_s is None or step_s <= 0.0 or not math.isfinite(exchange_s):
        return min(limit, FIRST_HEAD)
    return max(1, min(limit, math.ceil(MARGIN * max(exchange_s, 0.0) / step_s)))


@dataclass
class OverlapGauge:
    """What :func:`head_steps` needs, measured by a peer as its rounds go."""

    ready_at: dict[int, float] = field(default_factory=dict)  # round -> contribution ready
    exchanges: deque[float] = field(default_factory=lambda: deque(maxlen=_KEPT))
    step_s: float | None = None

    def ready(self, index: int, now: float, compute_s: float, steps: int) -> None:
        """Round ``index``'s contribution took ``compute_s`` over ``steps`` inner steps."""
        self.ready_at[index] = now
        if compute_s > 0.0 and steps > 0:
            self.step_s = compute_s / steps

    def committed(self, index: int, now: float) -> None:
        """Round ``index`` committed: its exchange took from ready to now."""
        ready = self.ready_at.pop(index, None)
        for old in [k for k in self.ready_at if k < index]:
            del self.ready_at[old]
        if ready is not None:
            self.exchanges.append(now - ready)

    def steps(self, limit: int) -> int:
        exchange = max(self.exchanges) if self.exchanges else None
        return head_steps(exchange, self.step_s, limit)
