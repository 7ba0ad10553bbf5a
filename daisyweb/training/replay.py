"""Replay oracle: what a single process computes from the same gradients and rosters.

Every replica in a group must end bit-identical to this: start from the initial
parameters and a fresh DaisyAdam, and for each committed step average exactly the
roster's gradients in roster order (``average_in_roster_order``) and take one step.
Tests feed it the per-peer gradients the peers actually used and compare its hash with
every peer's final weight hash.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash
from daisyweb.protocol.averaging import average_in_roster_order, check_gradient

__all__ = ["replay", "replay_hashes"]

StepSpec = tuple[Sequence[str], Mapping[str, np.ndarray]]


def replay_hashes(
    initial_params: np.ndarray,
    adam_config: AdamConfig,
    steps: Sequence[StepSpec],
    optimizer_state: dict[str, Any] | None = None,
) -> list[str]:
    """Weight hash after every step (``[0]`` is after the first step)."""
    params = np.array(initial_params, dtype=np.float32, copy=True)
    opt = DaisyAdam(adam_config, params.size)
    if optimizer_state is not None:
        opt.load_state_dict(optimizer_state)
    out: list[str] = []
    for i, (roster, grads) in enumerate(steps):
        missing = [p for p in roster if p not in grads]
        if missing:
            raise ValueError(f"replay step {i}: no gradient for {', '.join(missing)}")
        ordered = [check_gradient(grads[p], params.size, f"step {i} {p}") for p in roster]
        opt.step(params, average_in_roster_order(ordered))
        out.append(weight_hash(params, opt))
    return out


def replay(
    initial_params: np.ndarray,
    adam_config: AdamConfig,
    steps: Sequence[StepSpec],
    optimizer_state: dict[str, Any] | None = None,
) -> str:
    """Final weight hash of the replayed run (the initial hash if ``steps`` is empty)."""
    if not steps:
        params = np.array(initial_params, dtype=np.float32, copy=True)
        opt = DaisyAdam(adam_config, params.size)
        if optimizer_state is not None:
            opt.load_state_dict(optimizer_state)
        return weight_hash(params, opt)
    return replay_hashes(initial_params, adam_config, steps, optimizer_state)[-1]
