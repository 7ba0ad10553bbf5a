"""The fault hook: the identity with no switch set, each switch touching only its case."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from daisyweb.peer.faults import Faults, TestHooks
from daisyweb.protocol import wire
from kernels import NonFiniteError

GRAD = wire.Gradient(2, "me", np.arange(4, dtype=np.float32).tobytes())


def _bound(hooks: TestHooks) -> Faults:
    f = Faults(hooks)
    f.machine = SimpleNamespace(self_id="me", leader="lead")  # type: ignore[assignment]
    return f


def test_hooks_are_the_identity_with_no_switch() -> None:
    f = _bound(TestHooks())
    assert f.version == wire.PROTOCOL_VERSION and f.step_delay == 0.0 and not f.dumps
    assert f.drop_outgoing() is None
    assert f.outgoing(GRAD) is GRAD
    contribute = object()
    assert f.contribution(2, contribute) is contribute  # type: ignore[arg-type]
    assert f.snapshot(b"abc", "0f" * 32) == (b"abc", "0f" * 32)
    trainer = SimpleNamespace(step=3, state=SimpleNamespace(params=np.zeros(2, np.float32)))
    f.after_apply(trainer)  # type: ignore[arg-type]
    assert not trainer.state.params.any()


def test_hooks_touch_only_their_step_and_this_peer() -> None:
    f = _bound(TestHooks(drop_gradient=2, corrupt_gradient=(2, "short"), gradient_raises=2,
                         fork_at=3, corrupt_snapshot="hash", protocol_version=7))
    assert f.version == 7
    drop = f.drop_outgoing()
    assert drop is not None
    assert not drop("lead", GRAD)  # never to the leader, which repairs it
    assert not drop("x", wire.Gradient(1, "me", GRAD.payload))
    assert drop("x", GRAD) and not drop("y", GRAD)  # once
    assert len(f.outgoing(GRAD).payload) == len(GRAD.payload) - 4
    other = wire.Gradient(2, "you", GRAD.payload)
    assert f.outgoing(other) is other
    with pytest.raises(NonFiniteError):
        f.contribution(2, None)(2, lambda i: np.zeros(1))  # type: ignore[arg-type]
    trainer = SimpleNamespace(step=3, state=SimpleNamespace(params=np.zeros(2, np.float32)))
    f.after_apply(trainer)  # type: ignore[arg-type]
    assert trainer.state.params[0] == np.float32(1e-3)
    payload, announced = f.snapshot(b"abc", "0f" * 32)
    assert payload == b"abc" and announced != "0f" * 32 and len(announced) == 64
