"""Transition re-export: the old home of the training pieces.

They now live in ``daisyweb.training.config`` (:class:`RunConfig`, ``run_config``,
``DEFAULTS``), ``.state`` (:class:`TrainState`, ``probe_hash``), ``.loop``
(``train_local``, :class:`StepRecord`) and ``.metrics`` (:class:`MetricsWriter`,
:class:`Progress`, ``kernel_report``, ``kernel_line``). Import from those; this module
goes away once nothing imports it.
"""

from daisyweb.training.config import DEFAULTS, RunConfig, run_config
from daisyweb.training.loop import StepRecord, train_local
from daisyweb.training.metrics import MetricsWriter, Progress, kernel_line, kernel_report
from daisyweb.training.state import TrainState, probe_hash

__all__ = [
    "DEFAULTS",
    "RunConfig",
    "run_config",
    "TrainState",
    "probe_hash",
    "MetricsWriter",
    "Progress",
    "StepRecord",
    "train_local",
    "kernel_report",
    "kernel_line",
]
