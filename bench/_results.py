"""Write one benchmark's section into TEST_RESULTS.md between its own markers."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent.parent / "TEST_RESULTS.md"


def machine() -> str:
    import os

    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"numpy {np.__version__}, {platform.processor() or platform.platform()}")


def write_section(name: str, body: str) -> None:
    """Replace (or append) the block between <!-- bench:NAME --> markers."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else "# Test results\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else (
        text.rstrip() + "\n\n" + block + "\n")
    RESULTS.write_text(text)
