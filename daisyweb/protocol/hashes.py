"""The ``StepHashes`` one step machine has seen: every peer's, near its boundary, and its own.

Each entry is (weight hash, probe hash, roster hash) per peer per boundary, the latest
message winning. Only boundaries ``b - 1 .. b + 1`` around the machine's own are kept.
"""

from __future__ import annotations

from collections.abc import Callable

from daisyweb.protocol import wire

__all__ = ["HashBook"]

Hashes = tuple[str, str]  # (weight hash, probe hash)


class HashBook:
    def __init__(self) -> None:
        # boundary -> peer -> (weight hash, probe hash, roster hash), latest message wins
        self.seen: dict[int, dict[str, tuple[str, str, str]]] = {}
        self.own: dict[int, Hashes] = {}

    def record(self, b: int, peer: str, weight: str, probe: str, roster_hash: str) -> None:
        self.seen.setdefault(b, {})[peer] = (weight, probe, roster_hash)

    def publish_own(self, b: int, self_id: str, hashes: Hashes, roster_hash: str) -> None:
        """Our hashes at boundary ``b``; older boundaries than ``b - 1`` are forgotten."""
        self.own[b] = hashes
        self.seen.setdefault(b, {})[self_id] = (*hashes, roster_hash)
        for old in [k for k in self.own if k < b - 1]:
            del self.own[old]
        for old in [k for k in self.seen if k < b - 1]:
            del self.seen[old]

    def peers_at(self, b: int) -> list[str]:
        return list(self.seen.get(b, {}))

    def comparable(self, b: int, roster_hash: str,
                   snapshot_of: Callable[[str], int | None]) -> dict[str, Hashes]:
        """Hashes at ``b`` made with the roster whose digest is ``roster_hash``.

        A hash made with another roster of the same step (an amendment raced it) is
        stale; its sender republishes after recommitting. Joiners publish NO_ROSTER and
        count when ``snapshot_of(peer)`` (the boundary they were offered) is ``b``.
        """
        return {
            p: (w, pr)
            for p, (w, pr, rh) in self.seen.get(b, {}).items()
            if rh == roster_hash or (rh == wire.NO_ROSTER and snapshot_of(p) == b)
        }
