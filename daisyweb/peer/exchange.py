"""How this run exchanges contributions: the trainer (lockstep or rounds of local steps),
the codec with its error feedback, and the mode as users see it."""

from __future__ import annotations

import numpy as np

from daisyweb.protocol.averaging import Parts
from daisyweb.protocol.codec import Codec, check_payload, codec_by_name, decode_parts
from daisyweb.protocol.pace import LOCKSTEP, Bounds
from daisyweb.training.config import RunConfig
from daisyweb.training.rounds import LockstepTrainer, RoundTrainer
from daisyweb.training.state import TrainState

__all__ = ["RecordingEncoder", "Trainer", "bounds", "make_trainer", "mode", "unit"]

Trainer = LockstepTrainer | RoundTrainer


def make_trainer(state: TrainState, rounds_done: int | None = None) -> Trainer:
    """Lockstep for ``sync_every == 1``, rounds of local steps otherwise (``rounds_done``:
    the group's round count at the state, when it is known)."""
    run = state.run
    if run.sync_every == 1:
        return LockstepTrainer(state)
    return RoundTrainer(state, run.sync_every, run.outer_lr, rounds_done)


def bounds(run: RunConfig) -> Bounds:
    """The run's round lengths and head start, as the leader's rosters name them."""
    if run.sync_every == 1:
        return LOCKSTEP
    return Bounds(run.sync_every, run.sync_max, run.overlap)


class RecordingEncoder:
    """The run's codec with error feedback, counting the payload bytes it produced."""

    def __init__(self, name: str, size: int) -> None:
        codec = codec_by_name(name)
        self.name = codec.name
        self.codec = codec  # without error feedback: what receivers decode with
        self._encoder: Codec = codec.encoder(size)  # error feedback for int8 and int4
        self.bytes_sent = 0  # payload bytes of this member's own contributions so far

    def encode(self, vector: np.ndarray) -> bytes:
        payload = self._encoder.encode(vector)
        self.bytes_sent += len(payload)
        return payload

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray:
        return self.codec.decode(payload, size, who)

    def check(self, payload: bytes, size: int, who: str = "payload") -> None:
        check_payload(self.codec, payload, size, who)

    def decode_parts(self, payload: bytes, size: int, who: str = "payload") -> Parts:
        return decode_parts(self.codec, payload, size, who)


def mode(run: RunConfig) -> str:
    """The exchange mode as shown to users: ``lockstep f32``, ``rounds H=16 int8`` or,
    when the leader may lengthen rounds, ``rounds H=16-64 int2``."""
    if run.sync_every == 1:
        return f"lockstep {run.codec}"
    h = str(run.sync_every) if run.sync_max == run.sync_every \
        else f"{run.sync_every}-{run.sync_max}"
    return f"rounds H={h} {run.codec}"


def unit(run: RunConfig) -> str:
    """What one step of the step machine is, in words: ``step`` or ``round``."""
    return "step" if run.sync_every == 1 else "round"
