"""How many bytes a run's messages may take: the largest legal message and the receive
budget derived from it.

The largest message any member of a run ever sends is a float32 contribution (4 bytes
per parameter, lockstep ``--codec f32``) or its relayed copy; a joiner's snapshot comes
in pieces of at most 4P/64 bytes or 64 KiB (``daisyweb.peer.pieces``), int8 and int4
contributions are smaller (P + 4P/256, P/2 + 4P/64), and every other message is a few
KB at most. :func:`largest_message` bounds them with room to spare (4P + 1 MiB).

An honest link holds at most one message being reassembled at a time (a sender puts out
one message per link at a time; heartbeats are single frames), so a link's receive
budget is :data:`IN_FLIGHT` largest messages: a peer that starts more than that is
dropped (``net.link``), so no link holds more than that in partial messages.
"""

from __future__ import annotations

__all__ = ["IN_FLIGHT", "OVERHEAD", "largest_message", "link_budget"]

OVERHEAD = 1 << 20  # message envelope, with room to spare
IN_FLIGHT = 2  # largest messages one link may hold in reassembly at once


def largest_message(params: int) -> int:
    """An upper bound on the size of any message of a run of ``params`` parameters."""
    if params < 1:
        raise ValueError(f"params must be >= 1, got {params}")
    return 4 * params + OVERHEAD


def link_budget(params: int) -> int:
    """Bytes one link may hold in messages being reassembled, for this run."""
    return IN_FLIGHT * largest_message(params)
