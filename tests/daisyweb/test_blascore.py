"""daisyweb.blascore: which OpenBLAS kernels daisyweb asks for, and when it stays out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from daisyweb import blascore

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512vl

processor\t: 1
vendor_id\t: GenuineIntel
"""
ZEN3 = ZEN4.replace(" avx512f avx512bw avx512vl", "")
INTEL = ZEN4.replace("AuthenticAMD", "GenuineIntel").replace(": 25", ": 6")
ZEN5 = ZEN4.replace(": 25", ": 26")


def test_zen4_with_avx512_gets_the_zen_kernels_and_nothing_else_does() -> None:
    assert blascore.choose(ZEN4) == "ZEN"
    for other in (ZEN3, INTEL, ZEN5, "", "garbage without colons"):
        assert blascore.choose(other) is None


def test_apply_sets_the_variable_only_when_unset(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(ZEN4)
    env: dict[str, str] = {}
    assert blascore.apply(env, str(info)) == "ZEN" and env == {blascore.VAR: "ZEN"}
    mine = {blascore.VAR: "SKYLAKEX"}  # the user's choice wins
    assert blascore.apply(mine, str(info)) is None and mine == {blascore.VAR: "SKYLAKEX"}
    info.write_text(INTEL)
    env = {}
    assert blascore.apply(env, str(info)) is None and env == {}
    assert blascore.apply(env, str(tmp_path / "missing")) is None and env == {}


def test_importing_daisyweb_first_decides_before_numpy_loads() -> None:
    """In a fresh process, ``import daisyweb`` sets the variable (or not) exactly as
    ``apply`` decides for this machine, before numpy is imported."""
    code = ("import os, sys; import daisyweb; "
            "print(os.environ.get('OPENBLAS_CORETYPE', '-'), 'numpy' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != blascore.VAR}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout.split()
    want: dict[str, str] = {}
    blascore.apply(want)
    assert out == [want.get(blascore.VAR, "-"), "False"]
