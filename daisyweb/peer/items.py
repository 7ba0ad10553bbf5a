"""What the driver's queue carries: one dataclass per kind of item, dispatched by type."""

from __future__ import annotations

from dataclasses import dataclass

from daisyweb.net import MeshEvent, Received
from daisyweb.protocol import wire
from daisyweb.training.rounds import Contribution

__all__ = ["ContributionFailed", "ContributionReady", "Interrupt", "Item", "MeshItem", "Tick",
           "is_hello"]


@dataclass(frozen=True)
class ContributionReady:
    """The worker computed our contribution of ``step`` in ``secs`` seconds."""

    step: int
    contribution: Contribution
    secs: float
    sequences: int = 0  # sequences it computed over, all its inner steps together
    generation: int = 0  # the driver's machine it was computed for (a rejoin starts anew)


@dataclass(frozen=True)
class ContributionFailed:
    """The worker's computation of ``step`` raised ``error``."""

    step: int
    error: Exception
    generation: int = 0


@dataclass(frozen=True)
class Tick:
    """Time passed (timeouts, heartbeat-driven repair)."""


@dataclass(frozen=True)
class Interrupt:
    """SIGINT or SIGTERM: end the run cleanly."""


@dataclass(frozen=True)
class MeshItem:
    """One event from the mesh."""

    event: MeshEvent


Item = ContributionReady | ContributionFailed | Tick | Interrupt | MeshItem


def is_hello(item: Item) -> bool:
    """Whether ``item`` is a Hello received from a peer."""
    return (isinstance(item, MeshItem) and isinstance(item.event, Received)
            and isinstance(item.event.message, wire.Hello))
