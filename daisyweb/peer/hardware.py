"""The hardware this peer runs on, for the dashboard's pool view: CPU model, cores, RAM.

Read once at start from the operating system (``/proc/cpuinfo`` on Linux, ``platform``
elsewhere); anything that cannot be read is left out rather than guessed.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from signaling.protocol import MAX_CPU_CHARS, MAX_RAM_MB, clean_text

__all__ = ["hardware_info"]


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            # x86 says "model name"; arm64 kernels say nothing or "Hardware"/"Model".
            if key.strip() in ("model name", "Hardware", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int | None:
    # The cores this process may run on (a container or taskset gives fewer).
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or None
    return os.cpu_count()


def _ram_mb() -> int | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    if pages <= 0 or size <= 0:
        return None
    return min(pages * size // (1 << 20), MAX_RAM_MB) or None


def hardware_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str | int]:
    """``cpu``, ``cores`` and ``ram_mb`` (MiB) as far as they can be read, each within
    what the signaling server accepts in a status report."""
    out: dict[str, str | int] = {}
    cpu = clean_text(_cpu_model(cpuinfo), MAX_CPU_CHARS)
    if cpu:
        out["cpu"] = cpu
    cores = _cores()
    if cores:
        out["cores"] = cores
    ram = _ram_mb()
    if ram:
        out["ram_mb"] = ram
    return out
