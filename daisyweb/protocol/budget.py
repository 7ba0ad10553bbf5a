"""How many bytes a run's messages may take: the largest legal message and the receive
budget derived from it.

The largest message any member of a run ever sends is a ``Snapshot``: the checkpoint of
the weights and both Adam moments (12 bytes per parameter) plus the ``.pt`` container
and the message envelope (measured: 12.00P + 18 KB at the demo default and the 5.8 M
model). :func:`largest_message` bounds it with room to spare (13P + 1 MiB); contributions
(4P f32, P + 4P/256 int8, P/2 + 4P/64 int4) and every other message are smaller.

An honest link holds at most one message being reassembled at a time (a sender puts out
one message per link at a time; heartbeats are single frames), so a link's receive
budget is :data:`IN_FLIGHT` largest messages: a peer that starts more than that is
dropped (``net.link``), so no link holds more than that in partial messages.
"""

from __future__ import annotations

__all__ = ["IN_FLIGHT", "OVERHEAD", "largest_message", "link_budget"]

OVERHEAD = 1 << 20  # .pt container, pickle, run config and message envelope
IN_FLIGHT = 2  # largest messages one link may hold in reassembly at once


def largest_message(params: int) -> int:
    """An upper bound on the size of any message of a run of ``params`` parameters."""
    if params < 1:
        raise ValueError(f"params must be >= 1, got {params}")
    return 13 * params + OVERHEAD


def link_budget(params: int) -> int:
    """Bytes one link may hold in messages being reassembled, for this run."""
    return IN_FLIGHT * largest_message(params)
