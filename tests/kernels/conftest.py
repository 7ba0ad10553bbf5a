from __future__ import annotations

from collections.abc import Iterator

import pytest

from kernels import audit, dispatch


@pytest.fixture(autouse=True)
def _fresh_kernel_state() -> Iterator[None]:
    """Each test starts and ends with re-gated backends, no forced backend, default audit."""
    dispatch.reset()
    yield
    dispatch.reset()
    dispatch._forced = None
    audit.configure(enabled=True, budget=audit.DEFAULT_BUDGET, stratified=True)

