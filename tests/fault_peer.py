"""The peer with test faults: daisyweb's own driver, wrapped, for the fault tests.

    python -m tests.fault_peer [daisyweb-peer arguments...]

runs ``daisyweb-peer`` with :class:`FaultyDriver` in place of the product's driver, its
faults chosen by ``DAISYWEB_TEST_*`` variables (read here only: no product code reads a
test variable). In-process tests pass ``driver_class=faulty(Hooks(...))`` to
``run_peer``. The switches:

``DAISYWEB_TEST_BREAK_KERNEL=1`` (an int8 GEMM that is off by one),
``DAISYWEB_TEST_DROP_GRADIENT=S`` (drop this peer's step-S contribution to one recipient),
``DAISYWEB_TEST_CORRUPT_GRADIENT=S:nan|short`` (corrupt the step-S contribution on the
wire), ``DAISYWEB_TEST_FORK_AT=S`` (perturb one weight after step S is applied),
``DAISYWEB_TEST_DUMP_GRADS=DIR`` (write what every member decodes from each of our
contributions to DIR, and its bytes, the replay oracle's input),
``DAISYWEB_TEST_STEP_DELAY=SECONDS``
(sleep before each contribution, to widen the window for kill tests),
``DAISYWEB_TEST_GRADIENT_RAISES=S`` (the step-S computation raises, as a kernel refusing
a non-finite activation would), ``DAISYWEB_TEST_CORRUPT_SNAPSHOT=byte|hash`` (flip one byte
of every snapshot piece this peer serves, or as leader announce a wrong weight hash in
every snapshot plan),
``DAISYWEB_TEST_PROTOCOL_VERSION=N`` (speak protocol version N),
``DAISYWEB_TEST_SLOW_FACTOR=F`` (each contribution takes F times its compute time, as on
a machine F times slower).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daisyweb.peer.driver import Driver
from daisyweb.peer.options import PeerError, log
from daisyweb.protocol import wire
from kernels import NonFiniteError, dispatch
from kernels.backends import MirrorBackend


@dataclass(frozen=True)
class Hooks:
    """The fault switches of one peer."""

    break_kernel: bool = False
    drop_gradient: int | None = None
    corrupt_gradient: tuple[int, str] | None = None
    fork_at: int | None = None
    dump_grads: str | None = None
    step_delay: float = 0.0
    gradient_raises: int | None = None
    corrupt_snapshot: str | None = None  # "byte" or "hash"
    protocol_version: int | None = None  # announce this instead of wire.PROTOCOL_VERSION
    slow_factor: float = 1.0  # contributions take this many times their compute time

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Hooks:
        env = dict(os.environ if env is None else env)

        def step_of(name: str) -> int | None:
            v = env.get(name)
            if not v:
                return None
            try:
                return int(v)
            except ValueError:
                raise PeerError(2, f"{name} must be a step number, got {v!r}") from None

        corrupt = None
        if env.get("DAISYWEB_TEST_CORRUPT_GRADIENT"):
            s, _, kind = env["DAISYWEB_TEST_CORRUPT_GRADIENT"].partition(":")
            if kind not in ("nan", "short") or not s.isdigit():
                raise PeerError(2, "DAISYWEB_TEST_CORRUPT_GRADIENT must be STEP:nan|short")
            corrupt = (int(s), kind)
        version = None
        if env.get("DAISYWEB_TEST_PROTOCOL_VERSION"):
            v = env["DAISYWEB_TEST_PROTOCOL_VERSION"]
            if not v.isdigit() or int(v) >= 1 << 32:
                raise PeerError(2, f"DAISYWEB_TEST_PROTOCOL_VERSION must be a version "
                                   f"number, got {v!r}")
            version = int(v)
        slow = 1.0
        if env.get("DAISYWEB_TEST_SLOW_FACTOR"):
            try:
                slow = float(env["DAISYWEB_TEST_SLOW_FACTOR"])
            except ValueError:
                slow = 0.0
            if not 1.0 <= slow <= 100.0:
                raise PeerError(2, "DAISYWEB_TEST_SLOW_FACTOR must be a number in 1..100, "
                                   f"got {env['DAISYWEB_TEST_SLOW_FACTOR']!r}")
        snap = env.get("DAISYWEB_TEST_CORRUPT_SNAPSHOT") or None
        if snap not in (None, "byte", "hash"):
            raise PeerError(2, "DAISYWEB_TEST_CORRUPT_SNAPSHOT must be byte|hash")
        return cls(
            break_kernel=env.get("DAISYWEB_TEST_BREAK_KERNEL") == "1",
            drop_gradient=step_of("DAISYWEB_TEST_DROP_GRADIENT"),
            corrupt_gradient=corrupt,
            fork_at=step_of("DAISYWEB_TEST_FORK_AT"),
            dump_grads=env.get("DAISYWEB_TEST_DUMP_GRADS") or None,
            step_delay=float(env.get("DAISYWEB_TEST_STEP_DELAY") or 0.0),
            gradient_raises=step_of("DAISYWEB_TEST_GRADIENT_RAISES"),
            corrupt_snapshot=snap,
            protocol_version=version,
            slow_factor=slow,
        )


def break_kernel() -> None:
    """Install an int8 GEMM that is wrong in one cell as the live backend.

    The mirror backend is the reference the audit trusts, so a broken mirror is what a
    miscompiled or faulty machine looks like from the inside: only the cross-machine
    probe can tell.
    """

    class _OffByOne(MirrorBackend):
        def gemm(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
            out = super().gemm(a, b)
            out.flat[0] += 1
            return out

    dispatch._instances["mirror"] = _OffByOne()
    dispatch._status["mirror"] = True
    dispatch.use_backend("mirror")


class FaultyDriver(Driver):
    """The product's driver with :attr:`hooks` applied around its parts."""

    hooks = Hooks()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.hooks.protocol_version is not None:
            self.version = self.hooks.protocol_version
        self._dropped_once = False
        self._own_payload: bytes | None = None

    # ---- the mesh: one contribution dropped to one recipient
    def _make_mesh(self) -> Any:
        mesh = super()._make_mesh()
        if self.hooks.drop_gradient is not None:
            mesh.drop_outgoing = self._drop
        return mesh

    def _drop(self, peer: str, msg: wire.Message) -> bool:
        m = self.machine
        if (isinstance(msg, wire.Contribution) and not self._dropped_once
                and msg.step == self.hooks.drop_gradient
                and m is not None and msg.sender == m.self_id and peer != m.leader):
            self._dropped_once = True
            log(f"test: dropped gradient of step {msg.step} to {peer}")
            return True
        return False

    # ---- what goes on the wire: a corrupted contribution or snapshot
    def _send(self, to: tuple[str, ...] | None, msg: wire.Message) -> None:
        super()._send(to, self._corrupted(msg))

    def _corrupted(self, msg: wire.Message) -> wire.Message:
        c = self.hooks.corrupt_gradient
        m = self.machine
        if (c is not None and isinstance(msg, wire.Contribution) and msg.step == c[0]
                and m is not None and msg.sender == m.self_id):
            data = bytearray(msg.payload)
            if c[1] == "nan":
                data[0:4] = np.float32(np.nan).tobytes()
            else:
                del data[-4:]
            return wire.Contribution(msg.step, msg.sender, bytes(data))
        snap = self.hooks.corrupt_snapshot
        if snap == "byte" and isinstance(msg, wire.Piece) and msg.payload:
            data = bytearray(msg.payload)  # one flipped byte, which the joiner must catch
            data[len(data) // 2] ^= 0x01
            return wire.Piece(msg.step, msg.piece, bytes(data))
        if snap == "hash" and isinstance(msg, wire.SnapshotPlan):
            h = msg.weight_hash
            return dataclasses.replace(msg, weight_hash=("0" if h[0] != "0" else "1") + h[1:])
        return msg

    # ---- the trainer: a computation that raises or is slow, a weight that forks
    def _make_replica(self, state: Any, boundary: int | None = None) -> None:
        super()._make_replica(state, boundary)
        trainer, hooks = self.trainer, self.hooks
        contribute, apply, encode = trainer.contribute, trainer.apply, self.encoder.encode

        def slowed(work: Any) -> Any:
            """``work`` taking F times as long, as on a machine F times slower."""
            if hooks.slow_factor <= 1.0:
                return work

            @functools.wraps(work)
            def slow(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                out = work(*args, **kwargs)
                time.sleep((hooks.slow_factor - 1.0) * (time.perf_counter() - t0))
                return out

            return slow

        contribute = slowed(contribute)
        if hasattr(trainer, "head_start"):  # a round's first steps (--overlap) too
            trainer.head_start = slowed(trainer.head_start)  # type: ignore[method-assign]

        @functools.wraps(contribute)
        def faulty_contribute(index: int, *args: Any, **kwargs: Any) -> Any:
            if hooks.gradient_raises == index:
                raise NonFiniteError("test: injected gradient failure")
            return contribute(index, *args, **kwargs)

        def faulty_apply(average: np.ndarray, *, owned: bool = False) -> None:
            apply(average, owned=owned)
            if hooks.fork_at is not None and trainer.step == hooks.fork_at:
                trainer.state.params[0] += np.float32(1e-3)  # a silent divergence

        def recording_encode(vector: np.ndarray) -> bytes:
            self._own_payload = encode(vector)
            return self._own_payload

        trainer.contribute = faulty_contribute  # type: ignore[method-assign]
        trainer.apply = faulty_apply  # type: ignore[method-assign]
        self.encoder.encode = recording_encode  # type: ignore[method-assign]

    async def _compute(self, step: int, length: int, sequences: int = 0) -> None:
        if self.hooks.step_delay:
            await asyncio.sleep(self.hooks.step_delay)
        await super()._compute(step, length, sequences)

    # ---- the replay oracle's input: what every member decodes from our bytes
    async def _contribution_ready(self, m: Any, item: Any, now: float) -> None:
        self._own_payload = None
        await super()._contribution_ready(m, item, now)
        if self.hooks.dump_grads and self._own_payload:
            decoded = self.encoder.decode(self._own_payload, m.replica.size)
            np.save(Path(self.hooks.dump_grads) / f"{m.self_id}-{item.step}.npy", decoded)
            # and the bytes themselves (the owner exchange's oracle cuts them into parts)
            (Path(self.hooks.dump_grads) / f"{m.self_id}-{item.step}.bin").write_bytes(
                bytes(self._own_payload))


def faulty(hooks: Hooks) -> type[FaultyDriver]:
    """A driver class with ``hooks`` (``run_peer(..., driver_class=faulty(hooks))``)."""
    return type("FaultyDriver", (FaultyDriver,), {"hooks": hooks})


def main(argv: list[str]) -> int:
    from daisyweb.cli import peer as cli
    from daisyweb.peer import run

    try:
        hooks = Hooks.from_env()
    except PeerError as exc:
        print(f"daisyweb-peer: {exc}", file=sys.stderr)
        return exc.code
    if hooks.break_kernel:
        break_kernel()
    run.Driver = faulty(hooks)  # type: ignore[misc]  # this process only
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
