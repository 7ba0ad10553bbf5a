"""A hostile member for the tests: daisyweb's own peer with one behaviour swapped.

    python -m tests.hostile_peer ATTACK [daisyweb-peer arguments...]

It is admitted like any peer, speaks the protocol, and lies in one way (issue 37):

- ``scale``: every contribution carries the largest scales the codec accepts (2**120)
  with every value at its maximum: valid, finite bytes;
- ``shift``: adds 0.7 to every value of its round delta, from round 2 to round 10;
- ``speed``: reports 1e12 sequences a second with every hash it publishes;
- ``withhold``: from round 4 on, heartbeats and publishes its hashes but never sends a
  contribution (nor answers a repair);
- ``equivocate``: sends the last member of each roster other bytes than the rest;
- ``escape``: at its third boundary, stops the group with a Halt whose reason is full of
  terminal escapes (a title, the clipboard, a clear screen, a forged "done" line).

Nothing here is imported by the product: the patches are made in this process only.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

ESCAPES = ("\x1b]0;pwned\x07\x1b]52;c;ZXZpbA==\x07\x1b[2J\r\n"
           "daisyweb-peer: done at step 9, weight hash 0000000000000000\u202e")


def _scale() -> None:
    from daisyweb.peer import exchange

    real = exchange.RecordingEncoder.encode

    def encode(self: Any, vector: np.ndarray) -> bytes:
        real(self, vector)  # keep the bookkeeping
        codec = self.codec
        if not hasattr(codec, "nblocks"):
            return real(self, vector)
        nb = codec.nblocks(vector.size)
        values = codec.encode(np.ones(vector.size, np.float32))[4 * nb:]
        return np.full(nb, 2.0 ** 120, "<f4").tobytes() + values

    exchange.RecordingEncoder.encode = encode  # type: ignore[method-assign]


def _shift() -> None:
    import dataclasses

    from daisyweb.training import rounds

    real = rounds.RoundTrainer.contribute

    def contribute(self: Any, index: int, batch: Any, steps: int, head: Any = None) -> Any:
        c = real(self, index, batch, steps, head)
        if 2 <= index <= 10:
            c = dataclasses.replace(c, vector=c.vector + np.float32(0.7))
        return c

    rounds.RoundTrainer.contribute = contribute  # type: ignore[method-assign]


def _speed() -> None:
    from daisyweb.protocol import sync

    real = sync.StepMachine._publish_hashes

    def publish(self: Any, out: list) -> None:
        self.speed = 1e12
        real(self, out)

    sync.StepMachine._publish_hashes = publish  # type: ignore[method-assign]


def _withhold() -> None:
    from daisyweb.protocol import sync

    real = sync.StepMachine.local_contribution

    def local_contribution(self: Any, step: int, loss: float, vector: np.ndarray,
                           now: float = 0.0) -> list:
        if step >= 4:
            return []  # computed, kept to itself
        return real(self, step, loss, vector, now)

    sync.StepMachine.local_contribution = local_contribution  # type: ignore[method-assign]


def _equivocate() -> None:
    from daisyweb.peer import driver
    from daisyweb.protocol import wire

    real = driver.Driver._send

    def send(self: Any, to: tuple[str, ...] | None, msg: Any) -> None:
        if isinstance(msg, wire.Contribution) and to and len(to) > 1:
            last = sorted(to)[-1]
            real(self, tuple(p for p in to if p != last), msg)
            other = bytearray(msg.payload)
            other[-1] = 0x11 if other[-1] == 0 else 0  # other values, still valid bytes
            real(self, (last,), wire.Contribution(msg.step, msg.sender, bytes(other)))
            return
        real(self, to, msg)

    driver.Driver._send = send  # type: ignore[method-assign]


def _escape() -> None:
    from daisyweb.protocol import sync, wire
    from daisyweb.protocol.actions import Send

    real = sync.StepMachine._publish_hashes

    def publish(self: Any, out: list) -> None:
        real(self, out)
        if self.boundary == 3:
            out.append(Send(None, wire.Halt(3, ESCAPES)))

    sync.StepMachine._publish_hashes = publish  # type: ignore[method-assign]


ATTACKS = {"scale": _scale, "shift": _shift, "speed": _speed, "withhold": _withhold,
           "equivocate": _equivocate, "escape": _escape}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ATTACKS:
        print(f"usage: python -m tests.hostile_peer {{{','.join(ATTACKS)}}} [peer args]",
              file=sys.stderr)
        return 2
    ATTACKS[argv[0]]()
    from tests import fault_peer  # the test switches (a step delay) apply as to any peer

    return fault_peer.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
