"""The fault launcher of the tests (``tests/fault_peer.py``): its switches come from the
environment of the test's own process, touch only their case, and no product module
reads a test variable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from daisyweb.peer import PeerError
from daisyweb.protocol import wire
from tests.fault_peer import FaultyDriver, Hooks, faulty

ROOT = Path(__file__).resolve().parents[1]
GRAD = wire.Contribution(2, "me", np.arange(4, dtype=np.float32).tobytes())


def test_no_product_module_reads_a_test_variable() -> None:
    product = [*ROOT.glob("daisyweb/**/*.py"), *ROOT.glob("signaling/**/*.py"),
               *ROOT.glob("kernels/**/*.py")]
    assert product
    readers = [str(p.relative_to(ROOT)) for p in product if "DAISYWEB_TEST_" in p.read_text()]
    assert readers == []


def test_switches_come_from_the_environment() -> None:
    assert Hooks.from_env({}) == Hooks()
    h = Hooks.from_env({
        "DAISYWEB_TEST_BREAK_KERNEL": "1", "DAISYWEB_TEST_DROP_GRADIENT": "3",
        "DAISYWEB_TEST_CORRUPT_GRADIENT": "2:nan", "DAISYWEB_TEST_FORK_AT": "4",
        "DAISYWEB_TEST_GRADIENT_RAISES": "3", "DAISYWEB_TEST_SLOW_FACTOR": "3",
        "DAISYWEB_TEST_CORRUPT_SNAPSHOT": "hash", "DAISYWEB_TEST_PROTOCOL_VERSION": "999"})
    assert h.break_kernel and h.drop_gradient == 3 and h.gradient_raises == 3
    assert h.corrupt_gradient == (2, "nan") and h.fork_at == 4 and h.slow_factor == 3.0
    assert h.corrupt_snapshot == "hash" and h.protocol_version == 999
    assert not Hooks.from_env({"DAISYWEB_TEST_BREAK_KERNEL": "0"}).break_kernel
    for env in ({"DAISYWEB_TEST_CORRUPT_GRADIENT": "2:zero"}, {"DAISYWEB_TEST_FORK_AT": "soon"},
                {"DAISYWEB_TEST_GRADIENT_RAISES": "soon"}, {"DAISYWEB_TEST_SLOW_FACTOR": "0.5"},
                {"DAISYWEB_TEST_SLOW_FACTOR": "nan"}, {"DAISYWEB_TEST_CORRUPT_SNAPSHOT": "zero"},
                {"DAISYWEB_TEST_PROTOCOL_VERSION": "-1"},
                {"DAISYWEB_TEST_PROTOCOL_VERSION": str(1 << 32)}):
        with pytest.raises(PeerError) as exc:
            Hooks.from_env(env)
        assert exc.value.code == 2 and next(iter(env)) in str(exc.value)


def _bare(hooks: Hooks) -> FaultyDriver:
    d = faulty(hooks).__new__(faulty(hooks))
    d._dropped_once = False
    d.machine = SimpleNamespace(self_id="me", leader="lead")  # type: ignore[assignment]
    return d


def test_each_switch_touches_only_its_case() -> None:
    d = _bare(Hooks(drop_gradient=2, corrupt_gradient=(2, "short"), corrupt_snapshot="hash"))
    assert not d._drop("lead", GRAD)  # never to the leader, which repairs it
    assert not d._drop("x", wire.Contribution(1, "me", GRAD.payload))
    assert d._drop("x", GRAD) and not d._drop("y", GRAD)  # once
    assert len(d._corrupted(GRAD).payload) == len(GRAD.payload) - 4
    other = wire.Contribution(2, "you", GRAD.payload)
    assert d._corrupted(other) is other
    plan = wire.SnapshotPlan(0, "0f" * 32, 0, 9, "ab" * 16, ("cd" * 16,), ("me",))
    bad = d._corrupted(plan)
    assert bad.digests == plan.digests and bad.weight_hash != plan.weight_hash
    piece = wire.Piece(0, 0, b"abcd")
    assert d._corrupted(piece) is piece  # "hash" flips the plan's hash only
    flipped = _bare(Hooks(corrupt_snapshot="byte"))._corrupted(piece)
    assert flipped.payload != piece.payload and len(flipped.payload) == 4
    plain = _bare(Hooks())
    assert plain._corrupted(GRAD) is GRAD and plain._corrupted(plan) is plan


def test_broken_kernel_switch_changes_the_probe() -> None:
    # In a child process: the switch replaces the live backend for the whole process.
    code = ("import kernels\nfrom tests.fault_peer import break_kernel\n"
            "good = kernels.probe_hash()\nbreak_kernel()\n"
            "print(good != kernels.probe_hash(), kernels.active_backend())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "mirror"]
