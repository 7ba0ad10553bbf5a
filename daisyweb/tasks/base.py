"""The task interface: what daisyweb needs of a model to train it in a group.

A task gives the initial flat float32 parameters for a seed (the same bits on every
machine: the group hashes them), a batch for (seed, step, member, rows), the loss and
its gradient into a buffer, and a held-out loss. Everything else -- rounds, the codecs,
the averaging, hashes, joins, repair -- is daisyweb's and the same for every task: only
the exchanged bytes must agree, so a task's own arithmetic may use any BLAS.

A run names its task as ``module:Name`` (``--task``); every member imports the same name
and must hold the same code: the run config carries a hash of the task's module source
(:func:`task_hash`), and a member whose hash differs, or that cannot import the task,
refuses the run with a line saying which. A task's own settings (``FIELDS``: type,
bounds, default) travel in the run config as ``task_config`` and are checked on every
member (:func:`check_task_config`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np

from daisyweb.rules import MAX_TASK_FIELDS, MAX_TASK_NAME, TASK_FIELD, TASK_SPEC

__all__ = ["MAX_TASK_FIELDS", "FieldSpec", "Task", "TaskError", "check_task_config",
           "load_task", "run_fields", "task_hash"]



class TaskError(ValueError):
    """A task that cannot be loaded or used as named (a user's error: said in one line)."""


class FieldSpec(NamedTuple):
    """One setting of a task: its type (int or float), bounds and default."""

    kind: type
    lo: float
    hi: float
    default: int | float


class Task(ABC):
    """What a group trains. Subclasses set ``FIELDS`` and implement the five methods;
    ``config`` holds the run's values of ``FIELDS`` (checked, defaults filled) and
    ``quantized`` whether the run's forward goes through the int8 kernels (``--compute``;
    a task may ignore it)."""

    FIELDS: ClassVar[Mapping[str, FieldSpec]] = {}
    ROW_TOKENS: ClassVar[int] = 1  # what one row of a batch counts in the tokens/s shown

    def __init__(self, config: Mapping[str, int | float], quantized: bool = True) -> None:
        self.config = check_task_config(type(self), config)
        self.quantized = quantized

    @property
    @abstractmethod
    def size(self) -> int:
        """The number of parameters (the length of the flat vector)."""

    @abstractmethod
    def init_params(self, seed: int) -> np.ndarray:
        """Float32 ``[size]``: the same bits for the same seed on every machine."""

    @abstractmethod
    def batch(self, seed: int, step: int, member: str, rows: int) -> np.ndarray:
        """The ``rows`` examples ``member`` trains on at inner step ``step``."""

    @abstractmethod
    def loss_and_grad(self, params: np.ndarray, batch: np.ndarray,
                      out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        """The mean loss of ``batch`` and its float32 gradient (into ``out`` if given,
        every element written)."""

    @abstractmethod
    def heldout(self, params: np.ndarray) -> float:
        """The loss on examples no run trains on (the same ones on every machine)."""


def check_task_config(cls: type[Task], given: Mapping[str, Any]) -> dict[str, int | float]:
    """``given`` checked against ``cls.FIELDS`` (a name it has not, a value of the wrong
    type or out of bounds: TaskError naming it), the defaults filled in."""
    if not isinstance(given, Mapping):
        raise TaskError(f"task settings must be a mapping, got {type(given).__name__}")
    unknown = sorted(set(given) - set(cls.FIELDS))
    if unknown:
        known = ", ".join(cls.FIELDS) or "none"
        raise TaskError(f"task {cls.__name__} has no setting {unknown[0]!r} (it has: {known})")
    out: dict[str, int | float] = {}
    for name, spec in cls.FIELDS.items():
        value = given.get(name, spec.default)
        if spec.kind is int:
            ok = type(value) is int and spec.lo <= value <= spec.hi
        else:
            ok = type(value) in (int, float) and math.isfinite(value) \
                and spec.lo <= value <= spec.hi
            value = float(value) if ok else value
        if not ok:
            raise TaskError(f"task setting {name} must be {spec.kind.__name__} in "
                            f"{spec.lo:g}..{spec.hi:g}, got {value!r:.40}")
        out[name] = value
    return out


def load_task(spec: str) -> type[Task]:
    """The task class named ``module:Name`` (imported here; TaskError saying why not)."""
    if not isinstance(spec, str) or len(spec) > MAX_TASK_NAME or not TASK_SPEC.fullmatch(spec):
        raise TaskError(f"a task is named module:Name (e.g. daisyweb.tasks.teacher:Teacher), "
                        f"got {str(spec)[:80]!r}")
    module_name, name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a task module's own import error is the user's to see
        raise TaskError(f"task {spec}: cannot import {module_name} here "
                        f"({type(exc).__name__}: {exc})") from None
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)) or cls is Task:
        raise TaskError(f"task {spec}: {module_name} has no Task subclass {name}")
    for field in cls.FIELDS:
        if not TASK_FIELD.fullmatch(field):
            raise TaskError(f"task {spec}: setting name {field!r} must be 1-32 of a-z 0-9 _")
    if len(cls.FIELDS) > MAX_TASK_FIELDS:
        raise TaskError(f"task {spec}: at most {MAX_TASK_FIELDS} settings")
    return cls


def task_hash(spec: str) -> str:
    """blake2b-256 of the task's name and its module's source bytes: what every member of
    a run must have the same of."""
    module_name = spec.split(":")[0]
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    try:
        with open(str(origin), "rb") as f:
            source = f.read()
    except (OSError, TypeError):
        raise TaskError(f"task {spec}: its source file cannot be read here") from None
    h = hashlib.blake2b(digest_size=32)
    h.update(spec.encode() + b"\x00" + source)
    return h.hexdigest()


def run_fields(spec: str | None, settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run config's task fields for ``--task spec`` and its ``--task-set`` values
    (none: the built-in GPT, no fields): the task loaded here, its code hashed, its
    settings checked (TaskError saying why not)."""
    if not spec:
        return {}
    cls = load_task(spec)
    checked = check_task_config(cls, settings or {})
    return {"task": spec, "task_hash": task_hash(spec),
            "task_config": tuple(sorted(checked.items()))}
