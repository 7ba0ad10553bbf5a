"""Which kernel set numpy's OpenBLAS uses, chosen before numpy loads it.

OpenBLAS (``DYNAMIC_ARCH``) picks its kernels, its "core type", once, when the library
loads: from the CPU, or from ``OPENBLAS_CORETYPE``. On AMD Zen 4 (family 25 with
AVX-512) it picks the SkylakeX AVX-512 kernels, but Zen 4 runs AVX-512 as two 256-bit
halves, and the model's float32 GEMMs (M 256-512, K and N 128-2048) run 5-15% faster
on its Zen (AVX2) kernels; GEMMs are about two thirds of a training step.

So importing daisyweb sets ``OPENBLAS_CORETYPE=ZEN`` on such a CPU unless the variable
is already set (the user's choice wins). It takes effect for an OpenBLAS loaded after
that: this process's if numpy is not imported yet (the ``daisyweb-*`` commands import
daisyweb first), and child processes'. Nothing exact depends on it: the int8 GEMMs are
gated and audited on whichever kernels load, and the float backward may use any BLAS.
This module imports nothing heavy (it must run before numpy).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["VAR", "apply", "choose"]

VAR = "OPENBLAS_CORETYPE"


def _first_cpu(cpuinfo: str) -> dict[str, str]:
    """The ``key: value`` lines of the first processor block of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def choose(cpuinfo: str) -> str | None:
    """The core type to ask OpenBLAS for on the CPU ``cpuinfo`` describes, or None to
    leave its own choice (every CPU but AMD family 25 with AVX-512)."""
    cpu = _first_cpu(cpuinfo)
    flags = cpu.get("flags", "").split()
    if (cpu.get("vendor_id") == "AuthenticAMD" and cpu.get("cpu family") == "25"
            and "avx512f" in flags):
        return "ZEN"
    return None


def apply(environ: MutableMapping[str, str] | None = None,
          cpuinfo_path: str = "/proc/cpuinfo") -> str | None:
    """Set ``OPENBLAS_CORETYPE`` in ``environ`` (default ``os.environ``) if it is unset
    and :func:`choose` names a core type; returns what was set, else None."""
    env = os.environ if environ is None else environ
    if env.get(VAR):
        return None
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            core = choose(f.read(1 << 16))
    except OSError:  # not Linux, or no /proc: leave OpenBLAS's own choice
        return None
    if core is not None:
        env[VAR] = core
    return core
