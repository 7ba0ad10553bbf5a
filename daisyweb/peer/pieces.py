"""A joiner's snapshot, downloaded in pieces from every member at once.

At a boundary every member holds the same shared state: in lockstep the weights and both
Adam moments, in rounds the anchor and the step counts. So a joiner need not take it from
the leader alone, whose uplink would carry it for every joiner while the group waits. The
leader offers a :class:`wire.SnapshotPlan` instead: the boundary, the group's hash, the
optimizer's step count, a digest of every piece, and the holders (the members whose hash
at the boundary is the leader's own). The joiner asks holder ``k mod n`` for piece ``k``,
checks each against its digest as it comes, asks the leader for any piece a holder
refused, sent wrong, or stalled on (:data:`STALL_S`), and checks the assembled state
against the group's hash before it starts.

In rounds a joiner takes the anchor alone, 4 bytes a parameter (not 12): every member's
inner moments are its own, never hashed nor exchanged, and a joiner starts its inner
optimizer from zero moments at the group's step count. Measured (``python -m
bench.join``, TEST_RESULTS.md section "join"): against a joiner given the leader's
moments, the held-out loss one round later is 0.024 higher and at the end of the run the
same within the seeds' spread. Every piece a joiner takes is thus checked against a digest.

A run's first boundary needs no piece: it is the run's seed, so a joiner makes it itself
and checks its hash (a start of 32 peers costs the leader one plan each). A leader resumed
from a checkpoint is at another state: its joiners download as above.

Pieces are at least :data:`MIN_PIECE_FLOATS` long and at most :data:`PIECES_PER_ARRAY`
per array; both ends derive the layout from the parameter count and the mode alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from daisyweb.optim import DaisyAdam, powers_for
from daisyweb.peer.exchange import make_trainer
from daisyweb.protocol import wire
from daisyweb.training.config import RunConfig
from daisyweb.training.state import TrainState

__all__ = ["ARRAYS", "Download", "Layout", "PieceError", "PieceServer", "PlanStale",
           "STALL_S", "piece_bytes", "plan_for"]

ARRAYS = ("params", "m", "v")  # the state's arrays, in piece order (rounds: params only)
MIN_PIECE_FLOATS = 1 << 14  # 64 KiB: a piece's request costs next to nothing
PIECES_PER_ARRAY = 64
STALL_S = 10.0  # a holder that sent nothing this long while owing pieces: ask the leader


class PieceError(ValueError):
    """The download cannot go on: the leader's plan or one of its own pieces is wrong."""


class PlanStale(PieceError):
    """The leader refused a piece of its own plan: it went on to another boundary (the
    group did not wait any longer for this joiner); a new plan is to be asked for."""


@dataclass(frozen=True)
class Layout:
    """How a state of ``size`` parameters splits into pieces: each array a joiner takes
    (lockstep: all of :data:`ARRAYS`; rounds: the anchor) in ``per_array`` slices of
    ``piece_floats`` (the last one shorter)."""

    size: int
    lockstep: bool  # the moments are shared (and hashed) too, so a joiner takes them

    @classmethod
    def of(cls, run: RunConfig) -> Layout:
        """The layout of ``run``'s state: both ends derive it from the run alone."""
        return cls(run.task_impl.size, run.sync_every == 1)

    @property
    def piece_floats(self) -> int:
        return max(MIN_PIECE_FLOATS, -(-self.size // PIECES_PER_ARRAY))

    @property
    def per_array(self) -> int:
        return -(-self.size // self.piece_floats)

    @property
    def count(self) -> int:
        return (len(ARRAYS) if self.lockstep else 1) * self.per_array

    def where(self, piece: int) -> tuple[int, int, int]:
        """(array index, start, stop) of ``piece``."""
        if not 0 <= piece < self.count:
            raise IndexError(f"piece {piece} of {self.count}")
        array, k = divmod(piece, self.per_array)
        start = k * self.piece_floats
        return array, start, min(start + self.piece_floats, self.size)


def _arrays(state: TrainState) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    opt = state.optimizer
    return state.params, opt.m, opt.v


def piece_bytes(state: TrainState, layout: Layout, piece: int) -> bytes:
    """Piece ``piece`` of ``state``, little-endian float32."""
    array, start, stop = layout.where(piece)
    return np.ascontiguousarray(_arrays(state)[array][start:stop], dtype="<f4").tobytes()


def plan_for(state: TrainState, step: int, group_hash: str, holders: tuple[str, ...],
             tokenizer: tuple[int, str]) -> wire.SnapshotPlan:
    """The leader's offer of boundary ``step`` (``state`` is at it; ``group_hash`` is what
    its replica publishes there)."""
    layout = Layout.of(state.run)
    digests = tuple(wire.payload_digest(piece_bytes(state, layout, k))
                    for k in range(layout.count))
    return wire.SnapshotPlan(step, group_hash, state.optimizer.step_count, tokenizer[0],
                             tokenizer[1], digests, holders)


class PieceServer:
    """A member's side: each piece of a boundary is served once per asker, so a peer that
    asks again and again costs no more than one download."""

    def __init__(self) -> None:
        self._served: set[tuple[str, int, int]] = set()

    def serve(self, peer: str, msg: wire.PieceRequest, state: TrainState | None,
              boundary: int) -> wire.Piece:
        """What to answer ``peer``'s request, our replica being at ``boundary``: the
        piece, or an empty one (not at that boundary, no such piece, or asked before)."""
        self._served = {s for s in self._served if s[1] == boundary}
        refused = wire.Piece(msg.step, msg.piece, b"")
        if state is None or msg.step != boundary:
            return refused
        layout = Layout.of(state.run)
        key = (peer, msg.step, msg.piece)
        if msg.piece >= layout.count or key in self._served:
            return refused
        self._served.add(key)
        return wire.Piece(msg.step, msg.piece, piece_bytes(state, layout, msg.piece))


Request = tuple[str, wire.PieceRequest]


@dataclass
class _Holder:
    owed: set[int] = field(default_factory=set)
    heard: float = 0.0  # when it last sent a piece (or was first asked)


class Download:
    """A joiner's side of one plan: what to ask whom, each piece checked as it comes, and
    the assembled state. Pure: the caller sends the requests it returns and feeds it what
    arrives, with the time."""

    def __init__(self, leader: str, run: RunConfig, plan: wire.SnapshotPlan,
                 tokenizer: tuple[int, str], connected: set[str], now: float) -> None:
        self.leader = leader
        self.run = run
        self.plan = plan
        self.layout = layout = Layout.of(run)
        size = layout.size
        if (plan.vocab_size, plan.tokenizer_hash) != tokenizer:
            raise PieceError(f"the run uses tokenizer {plan.vocab_size}/"
                             f"{plan.tokenizer_hash[:16]} but this peer has "
                             f"{tokenizer[0]}/{tokenizer[1][:16]}")
        if len(plan.digests) != layout.count:
            raise PieceError(f"its plan has {len(plan.digests)} piece digests for "
                             f"{layout.count} pieces")
        if leader not in plan.holders:
            raise PieceError("its plan does not name itself a holder")
        if plan.inner_step > run.steps:
            raise PieceError(f"its plan is at step {plan.inner_step} of a run of "
                             f"{run.steps}")
        self.holders: dict[str, _Holder] = {}
        self.served_by: dict[str, int] = {}  # holder -> pieces it served that passed
        self.bytes = 0  # of the pieces that passed
        self.started = now
        self._asked: list[Request] = []
        # A run's first boundary is the run's seed: a joiner makes it itself (a start
        # of N peers costs the leader nothing) unless the leader resumed elsewhere.
        self.fresh = TrainState.fresh(run) if plan.inner_step == 0 else None
        if self.fresh is not None and self._matches(self.fresh):
            self.arrays = _arrays(self.fresh)
            self.missing: set[int] = set()
            return
        self.fresh = None
        # rounds: the inner moments start at zero (only the anchor is downloaded)
        self.arrays = (np.empty(size, dtype=np.float32),
                       *((np.empty if layout.lockstep else np.zeros)(size, dtype=np.float32)
                         for _ in ARRAYS[1:]))
        self.missing = set(range(layout.count))
        for k in range(layout.count):
            holder = plan.holders[k % len(plan.holders)]
            self._ask(holder if holder in connected else leader, k, now)

    def requests(self) -> list[Request]:
        """The first requests, every piece of them once."""
        asked, self._asked = self._asked, []
        return asked

    @property
    def done(self) -> bool:
        return not self.missing

    def _ask(self, holder: str, piece: int, now: float) -> None:
        h = self.holders.setdefault(holder, _Holder(heard=now))
        if not h.owed:
            h.heard = now
        h.owed.add(piece)
        self._asked.append((holder, wire.PieceRequest(self.plan.step, piece)))

    def _fall_back(self, holder: str, pieces: set[int], why: str, now: float) -> list[Request]:
        """Ask the leader for ``pieces`` that ``holder`` did not serve; if the leader is
        the holder, the download fails."""
        if holder == self.leader:
            raise PieceError(f"the leader's piece {min(pieces)} {why}")
        for k in sorted(pieces):
            self._ask(self.leader, k, now)
        return self.requests()

    def received(self, sender: str, msg: wire.Piece, now: float) -> list[Request]:
        """``sender``'s piece: kept if it checks, else asked of the leader (returned)."""
        h = self.holders.get(sender)
        if msg.step != self.plan.step or h is None or msg.piece not in h.owed:
            return []  # not asked of it (a stale or unasked piece): ignored
        h.owed.discard(msg.piece)
        h.heard = now
        why = self._check(msg.piece, msg.payload)
        if why is not None and sender == self.leader and not msg.payload:
            raise PlanStale(f"the leader no longer serves boundary {self.plan.step}")
        if why is not None:
            return self._fall_back(sender, {msg.piece}, why, now)
        array, start, stop = self.layout.where(msg.piece)
        self.arrays[array][start:stop] = np.frombuffer(msg.payload, dtype="<f4")
        self.missing.discard(msg.piece)
        self.served_by[sender] = self.served_by.get(sender, 0) + 1
        self.bytes += len(msg.payload)
        return []

    def _check(self, piece: int, payload: bytes) -> str | None:
        if not payload:
            return "was refused"
        _, start, stop = self.layout.where(piece)
        if len(payload) != 4 * (stop - start):
            return f"has {len(payload)} bytes, not {4 * (stop - start)}"
        if wire.payload_digest(payload) != self.plan.digests[piece]:
            return "does not match its digest"
        return None

    def peer_down(self, peer: str, now: float) -> list[Request]:
        """``peer``'s link went down: what it owed is asked of the leader."""
        h = self.holders.get(peer)
        if h is None or not h.owed:
            return []
        owed, h.owed = h.owed, set()
        return self._fall_back(peer, owed, "was lost with its link", now)

    def tick(self, now: float) -> list[Request]:
        """Holders that sent nothing for :data:`STALL_S` while owing pieces: their pieces
        are asked of the leader (which is waited for: its link is the join's own)."""
        out: list[Request] = []
        for peer, h in self.holders.items():
            if peer != self.leader and h.owed and now - h.heard > STALL_S:
                owed, h.owed = h.owed, set()
                out.extend(self._fall_back(peer, owed, "stalled", now))
        return out

    def _matches(self, state: TrainState) -> bool:
        # the plan's boundary is the group's round count (rounds vary in length)
        trainer = make_trainer(state, self.plan.step)
        return trainer.step == self.plan.step and trainer.weight_hash() == self.plan.weight_hash

    def state(self) -> TrainState:
        """The assembled state, checked against the group's hash (PieceError if not)."""
        assert self.done
        if self.fresh is not None:
            return self.fresh  # checked when it was made
        params, m, v = self.arrays
        plan = self.plan
        config = self.run.adam()
        p1, p2 = powers_for(config, plan.inner_step)
        optimizer = DaisyAdam(config, params.size,
                              {"config": config.to_dict(), "size": params.size,
                               "step": plan.inner_step, "beta1_power": p1,
                               "beta2_power": p2, "m": m, "v": v}, copy=False)
        state = TrainState(self.run, params, optimizer)
        if not self._matches(state):
            raise PieceError("its weight hash or step does not match what it announced")
        return state
