"""What a run reports: one JSON object per step (:class:`MetricsWriter`), the terminal
progress line (:class:`Progress`) and the end-of-run kernel facts (:func:`kernel_report`,
:func:`kernel_line`)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import kernels

__all__ = ["MetricsWriter", "Progress", "kernel_report", "kernel_line"]


class MetricsWriter:
    """One JSON object per line, flushed each write so a crash loses at most one line."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self._file: IO[str] | None = open(path, "a", encoding="utf-8") if path else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds + 0.5)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


@dataclass
class Progress:
    """Prints ``step k/N  loss  tokens/s  ETA`` at most every ``every`` seconds."""

    total_steps: int
    stream: IO[str] | None = field(default_factory=lambda: sys.stderr)
    every: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _start: float = field(init=False, default=0.0)
    _start_step: int | None = field(init=False, default=None)
    _last_print: float = field(init=False, default=-math.inf)
    _tokens: int = field(init=False, default=0)
    last_step: int = field(init=False, default=0)  # the newest step update() was given

    def start(self, step: int) -> None:
        """Mark the clock before the first step (``step`` = steps already committed)."""
        self._start, self._start_step, self._tokens = self.clock(), step, 0

    def eta_s(self, step: int) -> float:
        """Seconds left at the rate since start (inf before the first step is done)."""
        now = self.clock()
        done = step - (self._start_step or 0)
        rate = done / (now - self._start) if now > self._start and done > 0 else 0.0
        return (self.total_steps - step) / rate if rate > 0 else math.inf

    def line(self, step: int, loss: float, tokens_per_s: float, note: str = "") -> str:
        eta = self.eta_s(step)
        # NaN: no loss of this peer's own in the commit (it did not compute that round,
        # or the round was committed again after an amended roster)
        shown = "-" if math.isnan(loss) else f"{loss:.4f}"
        return (f"step {step}/{self.total_steps}  loss {shown}  "
                f"{tokens_per_s:,.0f} tok/s  eta {_duration(eta)}"
                + (f"  {note}" if note else ""))

    def update(self, step: int, loss: float, tokens: int, note: str = "") -> float:
        """Record committed steps up to ``step`` (``tokens`` tokens in all, since the last
        update); return tokens/s so far. ``note`` (mode, round, ...) ends the line."""
        now = self.clock()
        if self._start_step is None:
            self._start, self._start_step = now, step - 1
        self.last_step = step
        self._tokens += tokens
        elapsed = now - self._start
        tokens_per_s = self._tokens / elapsed if elapsed > 0 else 0.0
        final = step >= self.total_steps
        if self.stream is not None and (final or now - self._last_print >= self.every):
            self._last_print = now
            print(self.line(step, loss, tokens_per_s, note), file=self.stream, flush=True)
        return tokens_per_s


def kernel_backend() -> str:
    """The kernel backend the GEMMs run on now (the dashboard's pool view)."""
    return kernels.active_backend()


def kernel_report() -> dict[str, Any]:
    """The end-of-run kernel facts: the backend the GEMMs run on now, every demotion so
    far (backend and reason), and the multiply-accumulates each backend ran since start."""
    return {"backend": kernels.active_backend(), "demotions": kernels.demotions(),
            "macs": kernels.counters()}


def kernel_line(report: dict[str, Any]) -> str:
    """``report`` as one line for the terminal."""
    macs = ", ".join(f"{name} {n:,}" for name, n in report["macs"].items() if n) or "none"
    demoted = "; ".join(f"{d['backend']} ({d['reason']})" for d in report["demotions"])
    return (f"kernels: backend {report['backend']}, demotions: {demoted or 'none'}, "
            f"multiply-accumulates: {macs}")
