"""Suite-wide safety net: every WebRTC peer a test starts gathers 127.0.0.1 only.

Tests pass ``--ice-host 127.0.0.1`` / ``ice_hosts=[...]`` themselves; this makes a test
that forgets it (and every peer subprocess, which inherits the environment) still keep
its traffic on loopback.
"""

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from daisyweb.net import ice

os.environ[ice.ENV_VAR] = "127.0.0.1"
# libwebrtc gathers every interface's address: peers that do not ask for a transport use
# aiortc, and a libwebrtc peer refuses to start outside a loopback-only network namespace
# (tests/netns.py runs those scenarios under ``unshare --net``).
os.environ["DAISYWEB_TRANSPORT"] = "aiortc"
os.environ["DAISYWEB_LOOPBACK_ONLY"] = "1"



CHROMIUM = Path("/usr/bin/chromium")
# Headless, and nothing that would open a connection beyond 127.0.0.1 on its own.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def chromium(tmp_path: Path) -> Callable[[Any, dict[str, int]], Awaitable[Any]]:
    """``await chromium(playwright, viewport)``: Debian's Chromium in a fresh profile.

    Fails (never skips) when Chromium is not installed.
    """
    if not CHROMIUM.is_file():
        pytest.fail(
            f"{CHROMIUM} is missing: the dashboard test needs Debian's chromium package "
            "(run: bash scripts/install-system.sh, or apt-get install chromium)"
        )

    async def launch(pw: Any, viewport: dict[str, int]) -> Any:
        return await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # fresh user-data-dir
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport=viewport,
        )

    return launch
