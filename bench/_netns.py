"""Run a command inside a fresh network namespace that holds nothing but loopback.

libwebrtc (``wrtc``) gathers every interface's address, so every test or benchmark that
starts a libwebrtc peer runs its whole scenario (signaling server and every peer) in
one child process started by :func:`run_isolated`: ``unshare --net`` gives it a new
network namespace whose only interface is ``lo``, brought up before anything else runs.
Nothing in there can reach this machine's other addresses, let alone another machine.
Needs root (CI and the development machines run as root) and util-linux's ``unshare``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ROOT", "run_isolated", "unavailable"]

ROOT = Path(__file__).resolve().parents[1]  # the repository
_SCRIPT = 'ip link set lo up && exec "$@"'


def unavailable() -> str | None:
    """Why a loopback-only namespace cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root for unshare --net"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux / iproute2)"
    return None


def run_isolated(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 timeout: float, cwd: Path = ROOT,
                 capture: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a new loopback-only network namespace; output captured together
    (or passed through with ``capture=False``)."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"cannot make a loopback-only network namespace: {why}")
    full_env = dict(os.environ, DAISYWEB_LOOPBACK_ONLY="1", **(env or {}))
    return subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", _SCRIPT, "sh", *argv],
        cwd=cwd, env=full_env, stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL, check=False)
