"""libwebrtc (``wrtc``) peers, alone and mixed with aiortc peers, for real.

Each scenario re-runs existing tests (the mesh tests of ``test_mesh.py``, the group
tests of ``tests/daisyweb/peer/test_run.py``) in one child pytest inside a new network
namespace that holds nothing but loopback (``tests/netns.py``), with the transports the
scenario names: ``$DAISYWEB_TEST_MESH_TRANSPORTS`` / ``$DAISYWEB_TEST_PEER_TRANSPORTS``
are cycled over the meshes or peers a test makes, so ``libwebrtc,aiortc`` gives a
group whose leader is libwebrtc, its first follower aiortc, its second libwebrtc.
Outside a namespace the suite's own peers are aiortc, and a libwebrtc peer refuses to
start (``DAISYWEB_LOOPBACK_ONLY``, tests/conftest.py): the last test shows that.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import netns

RUN = "tests/daisyweb/peer/test_run.py::"
MESH = "tests/daisyweb/net/test_mesh.py"
MESH_VAR = "DAISYWEB_TEST_MESH_TRANSPORTS"
PEER_VAR = "DAISYWEB_TEST_PEER_TRANSPORTS"

SCENARIOS: dict[str, tuple[list[str], dict[str, str]]] = {
    # Heartbeats, backpressure, clean close, framing, bounds, candidates, TURN relay,
    # the reassembly budget: every mesh test.
    "mesh-libwebrtc": ([MESH], {MESH_VAR: "libwebrtc"}),
    "mesh-mixed": ([MESH], {MESH_VAR: "libwebrtc,aiortc"}),
    # The lockstep fault tests with every peer on libwebrtc.
    "group-libwebrtc": ([RUN + t for t in (
        "test_three_peers_train_with_identical_hashes_equal_to_replay",
        "test_dropped_gradient_is_repaired_bit_exact",
        "test_bad_gradient_halts_with_a_valid_checkpoint[nan]",
        "test_follower_sigkilled_mid_step_the_rest_finish",
        "test_leader_killed_mid_step_the_rest_finish",
    )], {PEER_VAR: "libwebrtc"}),
    # A group through a TURN server, and one whose hostile member overruns the budget.
    "group-libwebrtc-relay-budget": ([RUN + t for t in (
        "test_relayed_group_trains_through_a_real_turn_server",
        "test_peer_over_the_reassembly_budget_loses_its_links_and_the_group_trains_on",
    )], {PEER_VAR: "libwebrtc"}),
    # One group, both kinds: identical hashes every boundary, a follower killed, a joiner.
    "group-mixed": ([RUN + t for t in (
        "test_three_peers_train_with_identical_hashes_equal_to_replay",
        "test_follower_sigkilled_mid_step_the_rest_finish",
        "test_rounds_late_joiner_and_follower_killed_mid_round",
    )], {PEER_VAR: "libwebrtc,aiortc"}),
    # The owner exchange over both kinds: a member killed mid-round, a joiner.
    "group-mixed-owners": ([RUN + t for t in (
        "test_rounds_owner_exchange_member_killed_mid_round_and_a_late_joiner",
    )], {PEER_VAR: "libwebrtc,aiortc"}),
}


def _pytest_in_namespace(tests: list[str], env: dict[str, str],
                         timeout: float) -> subprocess.CompletedProcess[str]:
    return netns.run_isolated(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
         "-p", "no:randomly", *tests], env=env, timeout=timeout)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_libwebrtc_scenario_in_a_loopback_only_namespace(name: str) -> None:
    import webrtc  # noqa: F401 - the test extra installs wrtc; CI must run these

    tests, env = SCENARIOS[name]
    r = _pytest_in_namespace(tests, env, timeout=280)
    tail = r.stdout[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail


def test_libwebrtc_refuses_to_start_outside_a_loopback_only_namespace() -> None:
    # This process's namespace has the machine's interfaces (the suite sets
    # DAISYWEB_LOOPBACK_ONLY=1): the peer stops in one line before gathering anything.
    from daisyweb.net import transport_libwebrtc

    if not transport_libwebrtc.non_loopback_interfaces():
        pytest.fail("the suite itself runs in a loopback-only namespace: cannot show this")
    r = subprocess.run(
        [sys.executable, "-m", "daisyweb.cli.peer", "--server", "http://127.0.0.1:9",
         "--transport", "libwebrtc", "--ice-host", "127.0.0.1"],
        cwd=netns.ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "libwebrtc refused" in lines[0] and "unshare --net" in lines[0]
