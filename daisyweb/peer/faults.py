"""Test-only fault injection: the ``DAISYWEB_TEST_*`` switches and the one hook the driver calls.

Switches (environment only, read once at start; nothing on the wire can set them):
``DAISYWEB_TEST_BREAK_KERNEL=1`` (an int8 GEMM that is off by one),
``DAISYWEB_TEST_DROP_GRADIENT=S`` (drop this peer's step-S gradient to one recipient),
``DAISYWEB_TEST_CORRUPT_GRADIENT=S:nan|short`` (corrupt the step-S gradient on the wire),
``DAISYWEB_TEST_FORK_AT=S`` (perturb one weight after step S is applied),
``DAISYWEB_TEST_DUMP_GRADS=DIR`` (write each local gradient to DIR for the replay oracle),
``DAISYWEB_TEST_STEP_DELAY=SECONDS`` (sleep before each gradient, to widen the window for
kill tests), ``DAISYWEB_TEST_GRADIENT_RAISES=S`` (the step-S gradient computation raises,
as a kernel refusing a non-finite activation would),
``DAISYWEB_TEST_CORRUPT_SNAPSHOT=byte|hash`` (the leader flips one byte of every snapshot
payload it sends, or announces a wrong weight hash with it),
``DAISYWEB_TEST_PROTOCOL_VERSION=N`` (this peer speaks protocol version N instead of
``wire.PROTOCOL_VERSION``: it announces N in its Hello and refuses peers that do not),
``DAISYWEB_TEST_SLOW_FACTOR=F`` (each contribution takes F times its compute time, as on
a machine F times slower: the capacity-weighted batches test).

The driver sees only :class:`Faults` (and :class:`Replica`, which calls
:meth:`Faults.after_apply`); with no switch set every hook is the identity.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from daisyweb.peer.exchange import Trainer
from daisyweb.peer.options import PeerError, log
from daisyweb.protocol import sync, wire
from daisyweb.training.rounds import BatchFn, Contribution
from kernels import NonFiniteError, dispatch
from kernels.backends import MirrorBackend

__all__ = ["Faults", "Replica", "TestHooks", "break_kernel_for_tests"]

Contribute = Callable[[int, BatchFn], Contribution]


@dataclass(frozen=True)
class TestHooks:
    """Test-only fault switches, from the environment only (see module docstring)."""

    __test__ = False  # not a pytest test class, whatever its name

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
    def from_env(cls, env: dict[str, str] | None = None) -> TestHooks:
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


def break_kernel_for_tests() -> None:
    """Install an int8 GEMM that is wrong in one cell, as the live backend (tests only).

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


def _raising_contribution(index: int, batch: BatchFn) -> Contribution:
    """DAISYWEB_TEST_GRADIENT_RAISES: what a kernel refusing NaN looks like."""
    raise NonFiniteError("test: injected gradient failure")


class Faults:
    """The one hook object the driver calls; each method is the identity with no switch.

    ``machine`` is set by the driver once its step machine exists: the gradient faults
    touch only this peer's own gradients, and none before the machine starts.
    """

    def __init__(self, hooks: TestHooks) -> None:
        self.hooks = hooks
        self.machine: sync.StepMachine | None = None
        self._dropped_once = False

    @property
    def version(self) -> int:
        """The protocol version this peer speaks (and announces in its Hello)."""
        pv = self.hooks.protocol_version
        return wire.PROTOCOL_VERSION if pv is None else pv

    @property
    def step_delay(self) -> float:
        """Seconds to sleep before each gradient computation."""
        return self.hooks.step_delay

    async def slow_down(self, compute_s: float) -> float:
        """DAISYWEB_TEST_SLOW_FACTOR: wait so the contribution took F times as long;
        returns the seconds waited."""
        extra = (self.hooks.slow_factor - 1.0) * compute_s
        if extra > 0:
            await asyncio.sleep(extra)
        return max(extra, 0.0)

    @property
    def dumps(self) -> bool:
        """Whether decoded contributions are written for the replay oracle."""
        return bool(self.hooks.dump_grads)

    def drop_outgoing(self) -> Callable[[str, wire.Message], bool] | None:
        """The mesh's per-recipient drop hook, or None when nothing is dropped."""
        return self._drop if self.hooks.drop_gradient is not None else None

    def _drop(self, peer: str, msg: wire.Message) -> bool:
        """Drop this peer's gradient of one step to exactly one recipient."""
        m = self.machine
        if (isinstance(msg, wire.Gradient) and not self._dropped_once
                and msg.step == self.hooks.drop_gradient
                and m is not None and msg.sender == m.self_id and peer != m.leader):
            self._dropped_once = True
            log(f"test: dropped gradient of step {msg.step} to {peer}")
            return True
        return False

    def outgoing(self, msg: wire.Message) -> wire.Message:
        """The message as it goes on the wire: this peer's step-S gradient corrupted."""
        c = self.hooks.corrupt_gradient
        if c is None or not isinstance(msg, wire.Gradient) or msg.step != c[0]:
            return msg
        if self.machine is None or msg.sender != self.machine.self_id:
            return msg
        data = bytearray(msg.payload)
        if c[1] == "nan":
            data[0:4] = np.float32(np.nan).tobytes()
        else:
            del data[-4:]
        return wire.Gradient(msg.step, msg.sender, bytes(data))

    def contribution(self, step: int, contribute: Contribute) -> Contribute:
        """What computes the step's contribution: one that raises at the chosen step."""
        return _raising_contribution if self.hooks.gradient_raises == step else contribute

    def after_apply(self, trainer: Trainer) -> None:
        """After an average is applied: one weight perturbed at the fork step."""
        if self.hooks.fork_at is not None and trainer.step == self.hooks.fork_at:
            trainer.state.params[0] += np.float32(1e-3)  # a silent divergence

    def snapshot(self, payload: bytes | wire.SpooledBytes, announced: str
                 ) -> tuple[bytes | wire.SpooledBytes, str]:
        """A snapshot as the leader sends it: one byte flipped, or a wrong hash."""
        if self.hooks.corrupt_snapshot == "byte":
            # One flipped byte, which the follower must catch before using it.
            data = bytearray(bytes(payload))
            data[len(data) // 2] ^= 0x01
            payload = bytes(data)
        elif self.hooks.corrupt_snapshot == "hash":
            announced = ("0" if announced[0] != "0" else "1") + announced[1:]
        return payload, announced

    def dump(self, peer: str, step: int, decoded: np.ndarray) -> None:
        """What every member decodes from our bytes: the replay oracle's input."""
        assert self.hooks.dump_grads is not None
        np.save(Path(self.hooks.dump_grads) / f"{peer}-{step}.npy", decoded)


class Replica:
    """A lockstep or round trainer as a :class:`sync.Replica`, with the fork hook."""

    def __init__(self, trainer: Trainer, faults: Faults) -> None:
        self.trainer = trainer
        self.faults = faults

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def size(self) -> int:
        return self.trainer.size

    def apply(self, average: np.ndarray, *, owned: bool = False) -> None:
        self.trainer.apply(average, owned=owned)
        self.faults.after_apply(self.trainer)

    def weight_hash(self) -> str:
        return self.trainer.weight_hash()

    def backup(self) -> object:
        return self.trainer.backup()

    def restore(self, token: object) -> None:
        self.trainer.restore(token)
