from __future__ import annotations

import pytest

bench = pytest.importorskip("bench.kernels")


def test_bench_row_and_table_on_a_tiny_shape() -> None:
    rates: dict[str, float] = {}
    row = bench.run_shape(32, 48, 40, rounds=1, slow_rate=rates)
    for key in ("gemm", "f32", "mm", "i32", "lut"):
        assert row[key] > 0
    assert 0 <= row["audit_pct"] and row["audit_us"] > 0
    # a slow baseline predicted to exceed the limit is skipped, and the table says so
    rates["lut"] = 1.0  # 1 FLOP/s: anything would take "forever"
    row2 = bench.run_shape(32, 48, 40, rounds=1, slow_rate=rates)
    assert row2["lut"] is None
    md = bench.table([row, row2])
    assert md.count("\n") == 3 and "skipped" in md and "32x48x40" in md
