"""Rounds of local steps (``--sync-every H``): what a member contributes and how it is applied.

Lockstep (H = 1) exchanges a gradient every step and every member takes the same
DaisyAdam step on the roster's average (:class:`LockstepTrainer`, the protocol as it has
always been, bit for bit). Over links of a few MB/s that costs far more than the step,
so with H > 1 (:class:`RoundTrainer`) a round is:

1. every member starts from the same shared weights, the *anchor* ``a``;
2. it takes H local DaisyAdam steps on its own batches (its inner Adam moments stay
   local: they never cross the wire and are not part of the shared hash);
3. it contributes its round delta ``d_i = a - w_i`` (elementwise float32);
4. every member decodes the roster's contributions from the same bytes, averages them in
   roster order (``average_in_roster_order``) and applies the outer step
   ``a' = a - f32(outer_lr) * mean(d)`` (for ``outer_lr == 1`` a single subtraction),
   then resets its local weights to ``a'``.

All replicas are bit-identical at every round boundary: the anchor and the round count
are what :meth:`RoundTrainer.weight_hash` covers. Inner moments differ between members
by design (each saw its own batches); a checkpoint holds the saving peer's moments, and a
joiner starts its inner state from the snapshot's (the leader's) moments.

The outer step is plain averaging with learning rate 1 and no momentum by default: on
this project's runs of a few hundred steps it reached a given held-out loss soonest
(``python -m bench.scaling``; numbers in ``docs/limits.md``). ``outer_lr`` stays a run
setting for longer runs, where DiLoCo's larger outer steps may pay off.

Overlap (``--overlap K``): a member that has sent round ``r``'s delta does not wait for
round ``r``'s anchor to start round ``r + 1``: :meth:`RoundTrainer.head_start` takes its
first K steps from the member's own end-of-round weights ``w`` (and inner moments). When
the anchor ``a'`` arrives, :meth:`RoundTrainer.contribute` goes on from
``a' - (w - w_K)`` -- the head start's progress moved onto the anchor -- for the rest of
the round, and the delta is measured from ``a'`` as always. Only what a member computes
changes; the shared state still comes from the decoded bytes alone.

Threads: :meth:`contribute` runs in a worker thread while the event loop may roll the
replica back (an amended roster), so it works on copies and touches no shared state;
the new inner state is handed over with :meth:`stage` and adopted only when the round
commits (:meth:`apply`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from daisyweb.model import loss_and_grad
from daisyweb.optim import DaisyAdam
from daisyweb.protocol.averaging import check_gradient
from daisyweb.training.state import TrainState

__all__ = [
    "Contribution",
    "HeadStart",
    "LockstepTrainer",
    "RoundTrainer",
    "round_count",
    "round_length",
    "outer_step",
    "shared_hash",
]

_SHARED_MAGIC = b"daisyweb-round-state-v1\x00"

BatchFn = Callable[[int], np.ndarray]  # inner step index (0-based) -> [batch, seq+1] tokens


@dataclass(frozen=True)
class Contribution:
    """What one member computed for one step or round.

    ``vector`` is what goes on the wire (a gradient or a round delta); ``inner`` is the
    member's new local optimizer state (rounds only) to :meth:`RoundTrainer.stage`.
    """

    index: int
    loss: float
    vector: np.ndarray
    inner: dict[str, Any] | None = None
    local: np.ndarray | None = None  # rounds: the member's weights at the round's end
    head_steps: int = 0  # rounds: steps taken as a head start (``--overlap``)


@dataclass(frozen=True)
class HeadStart:
    """The first ``steps`` inner steps of round ``index``, taken while the previous
    round's exchange is still in flight (``--overlap``).

    They start from this member's own weights at the end of the previous round
    (``base``), since the new anchor is not known yet. When it is, the round goes on
    from ``anchor - (base - local)``: the head start's progress moved onto the anchor.
    """

    index: int
    steps: int
    loss_sum: float
    base: np.ndarray
    local: np.ndarray
    inner: dict[str, Any]


def round_count(total_steps: int, sync_every: int) -> int:
    """Rounds in a run of ``total_steps`` inner steps (the last round may be shorter)."""
    return -(-total_steps // sync_every)


def round_length(round_index: int, total_steps: int, sync_every: int) -> int:
    """Inner steps in round ``round_index``."""
    return max(0, min(sync_every, total_steps - round_index * sync_every))


def outer_step(anchor: np.ndarray, mean_delta: np.ndarray, outer_lr: float) -> np.ndarray:
    """``anchor - f32(outer_lr) * mean_delta`` as new float32 array, elementwise in that order."""
    if outer_lr == 1.0:
        return np.subtract(anchor, mean_delta, dtype=np.float32)
    scaled = np.multiply(mean_delta, np.float32(outer_lr), dtype=np.float32)
    return np.subtract(anchor, scaled, dtype=np.float32)


def shared_hash(anchor: np.ndarray, rounds_done: int, inner_steps: int) -> str:
    """blake2b-256 over what every member of a round group must share bit for bit."""
    h = hashlib.blake2b(digest_size=32)
    h.update(_SHARED_MAGIC)
    h.update(struct.pack("<QQQ", anchor.size, rounds_done, inner_steps))
    h.update(np.ascontiguousarray(anchor, dtype="<f4").tobytes())
    return h.hexdigest()


class LockstepTrainer:
    """H = 1: contribute the step's gradient; every member takes the same Adam step.

    A :class:`daisyweb.protocol.sync.Replica` (``step`` counts committed steps).
    """

    sync_every = 1

    def __init__(self, state: TrainState) -> None:
        self.state = state

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def size(self) -> int:
        return self.state.size

    @property
    def inner_steps(self) -> int:
        """Optimizer steps taken so far (what progress and checkpoints count)."""
        return self.state.step

    def steps_in(self, index: int) -> int:
        return 1

    def contribute(self, index: int, batch: BatchFn) -> Contribution:
        loss, grad = self.state.gradient(batch(index))
        return Contribution(index, loss, grad)

    def stage(self, contribution: Contribution) -> None:
        """Nothing to keep: a gradient leaves the local state untouched."""

    def apply(self, average: np.ndarray) -> None:
        self.state.apply(average)

    def weight_hash(self) -> str:
        return self.state.weight_hash()

    def backup(self) -> Any:
        return self.state.backup()

    def restore(self, token: Any) -> None:
        self.state.restore(token)


class RoundTrainer:
    """H > 1: rounds of local DaisyAdam steps, then one outer step on the averaged delta.

    A :class:`daisyweb.protocol.sync.Replica` whose ``step`` counts committed rounds.
    ``state.params`` is the anchor at every boundary; ``state.optimizer`` holds this
    member's inner moments.
    """

    def __init__(self, state: TrainState, sync_every: int, outer_lr: float = 1.0) -> None:
        if sync_every < 2:
            raise ValueError(f"rounds need sync_every >= 2, got {sync_every}")
        total = state.run.steps
        if state.step % sync_every and state.step != total:
            raise ValueError(f"step {state.step} is not a round boundary of "
                             f"--sync-every {sync_every}")
        self.state = state
        self.sync_every = sync_every
        self.outer_lr = float(outer_lr)
        self.total_steps = total
        self.rounds_done = round_count(state.step, sync_every)
        self._staged: dict[int, dict[str, Any]] = {}

    @property
    def step(self) -> int:
        return self.rounds_done

    @property
    def size(self) -> int:
        return self.state.size

    @property
    def inner_steps(self) -> int:
        return self.state.step

    def steps_in(self, index: int) -> int:
        return round_length(index, self.total_steps, self.sync_every)

    def contribute(self, index: int, batch: BatchFn,
                   head: HeadStart | None = None) -> Contribution:
        """Round ``index`` from the current anchor, on copies (see module docstring).

        With a ``head`` start of this round, its steps are not taken again: the round
        goes on from the anchor moved by the head start's progress, with its moments.
        """
        state = self.state
        anchor = state.params
        optimizer = DaisyAdam(state.optimizer.config, state.size)
        if head is not None and head.index == index:
            progress = np.subtract(head.base, head.local, dtype=np.float32)
            local = np.subtract(anchor, progress, dtype=np.float32)
            optimizer.load_state_dict(head.inner)
            done, total_loss = head.steps, head.loss_sum
        else:
            local = anchor.copy()
            optimizer.load_state_dict(state.optimizer.state_dict())
            done, total_loss = 0, 0.0
        n = self.steps_in(index)
        total_loss += self._local_steps(local, optimizer, index, range(done, n), batch)
        delta = np.subtract(anchor, local, dtype=np.float32)
        return Contribution(index, total_loss / max(n, 1), delta, optimizer.state_dict(),
                            local, done)

    def head_start(self, index: int, batch: BatchFn, previous: Contribution,
                   steps: int) -> HeadStart | None:
        """Up to ``steps`` inner steps of round ``index`` from ``previous`` (this member's
        contribution to round ``index - 1``): its end weights and inner moments. At
        least one step of the round is left for after the anchor arrives; None when the
        round does not exist or there is nothing to start."""
        n = self.steps_in(index)
        k = min(steps, n - 1)
        if k <= 0 or previous.index != index - 1 or previous.local is None \
                or previous.inner is None:
            return None
        local = previous.local.copy()
        optimizer = DaisyAdam(self.state.optimizer.config, self.state.size)
        optimizer.load_state_dict(previous.inner)
        loss_sum = self._local_steps(local, optimizer, index, range(k), batch)
        return HeadStart(index, k, loss_sum, previous.local, local, optimizer.state_dict())

    def _local_steps(self, local: np.ndarray, optimizer: DaisyAdam, index: int,
                     steps: range, batch: BatchFn) -> float:
        """Inner steps ``steps`` of round ``index`` on ``local`` in place; the loss sum."""
        state = self.state
        first = index * self.sync_every
        total = 0.0
        for j in steps:
            loss, grad = loss_and_grad(state.run.model, local, batch(first + j))
            optimizer.step(local, check_gradient(grad, state.size, "local gradient"))
            total += float(loss)
        return total

    def stage(self, contribution: Contribution) -> None:
        """Keep this member's inner state of a round until the round commits."""
        if contribution.inner is None:
            raise ValueError("a round contribution carries its inner state")
        self._staged[contribution.index] = contribution.inner
        for old in [k for k in self._staged if k < contribution.index - 2]:
            del self._staged[old]

    def apply(self, average: np.ndarray) -> None:
        """Outer step with the roster's mean delta; adopt this member's inner state."""
        r = self.rounds_done
        inner = self._staged.get(r)
        if inner is None:
            raise ValueError(f"round {r} committed without this member's inner state")
        mean = check_gradient(average, self.size, "mean round delta")
        new_anchor = outer_step(self.state.params, mean, self.outer_lr)
        self.state.optimizer.load_state_dict(inner)
        self.state.params = new_anchor
        self.rounds_done = r + 1

    def weight_hash(self) -> str:
        return shared_hash(self.state.params, self.rounds_done, self.state.step)

    def backup(self) -> Any:
        return self.state.backup(), self.rounds_done

    def restore(self, token: Any) -> None:
        state_token, rounds = token
        self.state.restore(state_token)
        self.rounds_done = rounds
