"""What the step machine (``daisyweb.protocol.sync``) asks of its driver, and of the replica.

The machine is sans-IO: each event method returns a list of these actions and the driver
carries them out in order. :class:`Replica` is what the machine needs of the training
state (``daisyweb.training.state.TrainState`` fits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from daisyweb.protocol import wire

__all__ = [
    "Replica",
    "Action",
    "Send",
    "Compute",
    "Commit",
    "SendSnapshot",
    "Excluded",
    "Finish",
    "Stopped",
    "CutOff",
    "Leading",
]


class Replica(Protocol):
    """What the machine needs of the training state (``TrainState`` fits).

    ``backup``/``restore`` are optional: without them an amendment of an already
    committed step halts instead of rolling back.
    """

    @property
    def step(self) -> int: ...

    @property
    def inner_steps(self) -> int:
        """Optimizer steps committed (``step`` in lockstep; a round counts its length)."""
        ...

    @property
    def size(self) -> int: ...

    def apply(self, average: np.ndarray, *, owned: bool = False) -> None:
        """Commit ``average``; with ``owned`` its buffer is the replica's to keep or write
        (the step machine's fresh mean), else the caller's, left as it is."""
        ...

    def weight_hash(self) -> str: ...


@dataclass(frozen=True)
class Send:
    """Send ``message`` to ``to`` (peer ids); ``to=None`` means every connected peer."""

    to: tuple[str, ...] | None
    message: wire.Message


@dataclass(frozen=True)
class Compute:
    """Compute this member's contribution to ``step``; answer with
    ``StepMachine.local_contribution``.

    ``sequences`` is this member's share of the step's sequences (0: the run's batch);
    ``length``: the round's inner steps (1 in lockstep); ``ahead``: the steps of the next
    round to take while this one's exchange is in flight (``protocol.pace``).
    """

    step: int
    sequences: int = 0
    ahead: int = 0
    length: int = 1


@dataclass(frozen=True)
class Commit:
    """Step ``step`` was applied: the replica is now at boundary ``step + 1``.

    ``rollback`` is True when this commit replaces an earlier one of the same step
    (an amended roster); the driver should overwrite that step's record.
    """

    step: int
    roster: tuple[str, ...]
    loss: float | None
    weight_hash: str
    probe_hash: str
    rollback: bool = False
    shares: tuple[int, ...] = ()  # sequences per roster member (empty: equal batches)
    clipped: tuple[str, ...] = ()  # members whose contribution was scaled to the bound
    owners: tuple[str, ...] = ()  # who reduced each part (the owner exchange; else empty)
    length: int = 1  # the round's inner steps (1 in lockstep)
    need: int = 0  # rounds: the most steps a member's exchange took (``protocol.pace``)


@dataclass(frozen=True)
class SendSnapshot:
    """Leader only: offer ``peer`` the state of the current boundary ``step``: the config
    and a plan of its pieces, each asked of one of ``holders`` (members whose hash at
    ``step`` is the leader's, the leader among them; ``daisyweb.peer.pieces``)."""

    peer: str
    step: int
    holders: tuple[str, ...] = ()


@dataclass(frozen=True)
class Excluded:
    """``peer`` was removed from the group (informational; already acted on)."""

    peer: str
    reason: str


@dataclass(frozen=True)
class Finish:
    """The run reached its last step with every member's hashes agreeing."""

    step: int


@dataclass(frozen=True)
class Stopped:
    """The run halted at ``step`` on this peer; the replica is a valid state."""

    step: int
    reason: str


@dataclass(frozen=True)
class CutOff:
    """This peer is cut off from the group's majority (or the group went on without it)
    at ``step``: it stops training and rejoins as a joiner, taking the group's state.
    The replica is a valid (last committed) state."""

    step: int
    reason: str


@dataclass(frozen=True)
class Leading:
    """This peer now leads, from ``step``, in ``term``: ``votes`` of the ``electorate``
    members of the last roster declared it."""

    step: int
    term: int
    votes: int
    electorate: int


Action = Send | Compute | Commit | SendSnapshot | Excluded | Finish | Stopped | CutOff | Leading
