"""The hardware this peer runs on, for the dashboard's pool view: CPU model, cores, RAM,
and which machine it is.

Read once at start from the operating system (``/proc/cpuinfo`` on Linux, ``platform``
elsewhere); anything that cannot be read is left out rather than guessed. The machine is
named by a keyed hash of its ``machine-id`` (never the id itself, which would name the
machine to other programs too): peers on one machine share it, and the pool counts the
machine once.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

from signaling.protocol import MAX_CPU_CHARS, MAX_RAM_MB, clean_text

__all__ = ["MACHINE_ID_FILES", "hardware_info"]

MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))
_MACHINE_KEY = b"daisyweb pool machine"


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


def _machine(files: tuple[Path, ...]) -> str | None:
    """16 hex digits naming this machine, from the first readable machine-id."""
    for f in files:
        try:
            ident = f.read_bytes().strip()
        except OSError:
            continue
        if ident:
            return hashlib.blake2b(ident, key=_MACHINE_KEY, digest_size=8).hexdigest()
    return None


def hardware_info(cpuinfo: Path = Path("/proc/cpuinfo"),
                  machine_ids: tuple[Path, ...] = MACHINE_ID_FILES) -> dict[str, str | int]:
    """``cpu``, ``cores``, ``ram_mb`` (MiB) and ``machine`` as far as they can be read, each
    within what the signaling server accepts in a status report."""
    out: dict[str, str | int] = {}
    machine = _machine(machine_ids)
    if machine:
        out["machine"] = machine
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
