"""The run config: one set of defaults, one set of rules, one factory.

:data:`DEFAULTS` is the run every entry point starts unless told otherwise
(``daisyweb-demo``, ``daisyweb-peer --start``, the model's own defaults); the bounds of
every field are :mod:`daisyweb.rules`. :func:`run_config` builds a :class:`RunConfig`
from optional values (``None`` means the default) and refuses a bad one with a one-line
``ValueError``. A :class:`RunConfig` converts to and from the wire ``Config`` message the
leader broadcasts and to and from a checkpoint's ``run`` metadata.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from daisyweb.checkpoints.checkpoint import Checkpoint
from daisyweb.model import ModelConfig
from daisyweb.optim import AdamConfig
from daisyweb.protocol import wire
from daisyweb.rules import (
    CHECKPOINT_COMPUTE,
    DEFAULTS,
    LOCKSTEP,
    check_compute,
    check_rounds,
    check_run,
    check_task,
    default_overlap,
    default_sync_max,
)

if TYPE_CHECKING:
    from daisyweb.tasks import Task

__all__ = ["DEFAULTS", "RunConfig", "run_config", "trained_quantized"]


@dataclass(frozen=True)
class RunConfig:
    """Everything the leader fixes for a run (what ``wire.Config`` carries)."""

    model: ModelConfig
    batch: int = int(DEFAULTS["batch"])
    steps: int = int(DEFAULTS["steps"])
    lr: float = float(DEFAULTS["lr"])
    seed: int = int(DEFAULTS["seed"])
    data: str = str(DEFAULTS["data"])
    # Lockstep (1) or rounds of H local steps; what members exchange and the outer step.
    sync_every: int = int(DEFAULTS["sync_every"])
    codec: str = str(DEFAULTS["codec"])
    outer_lr: float = float(DEFAULTS["outer_lr"])
    # Rounds: steps of each round taken while the previous round's exchange is in flight;
    # None: the default, within this run's rounds (0 in lockstep).
    overlap: int = None  # type: ignore[assignment]
    # The forward GEMMs: the int8 kernels, or plain float32 ("float").
    compute: str = str(DEFAULTS["compute"])
    # Rounds: the longest round the leader may name when a link needs it
    # (``protocol.pace``; ``sync_every`` is the shortest); None: the default.
    sync_max: int = None  # type: ignore[assignment]
    # What the group trains: "" is the built-in GPT (``model``); else ``module:Name``
    # (``daisyweb.tasks``), the hash of its module's source and its settings.
    task: str = ""
    task_hash: str = ""
    task_config: tuple[tuple[str, int | float], ...] = ()

    def __post_init__(self) -> None:
        if self.sync_max is None and type(self.sync_every) is int:
            object.__setattr__(self, "sync_max", default_sync_max(self.sync_every))
        if self.overlap is None and type(self.sync_max) is int:
            object.__setattr__(self, "overlap", default_overlap(self.sync_max))
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"bad run config: model must be a ModelConfig, "
                             f"got {type(self.model).__name__}")
        try:
            check_run(self.batch, self.steps, self.lr, self.seed, self.data)
            check_rounds(self.sync_every, self.codec, self.outer_lr, self.overlap,
                         self.sync_max)
            check_compute(self.compute)
            check_task(self.task, self.task_hash, self.task_config)
        except ValueError as exc:
            raise ValueError(f"bad run config: {exc}") from None

    @property
    def task_impl(self) -> Task:
        """The task this run trains, loaded once per run config (a named one: imported
        here, its code checked against ``task_hash``; ``tasks.TaskError`` saying why
        not)."""
        return _task_of(self)

    @property
    def quantized(self) -> bool:
        """Whether the forward GEMMs run through the int8 kernels."""
        return self.compute == "int8"

    def adam(self) -> AdamConfig:
        return AdamConfig(lr=self.lr)

    def to_wire(self) -> wire.Config:
        m = self.model
        return wire.Config.from_dict({
            "width": m.width, "layers": m.layers, "heads": m.heads, "seq": m.seq,
            "vocab": m.vocab, "batch": self.batch, "steps": self.steps, "lr": self.lr,
            "seed": self.seed, "data": self.data, "sync_every": self.sync_every,
            "codec": self.codec, "outer_lr": self.outer_lr, "overlap": self.overlap,
            "compute": self.compute, "sync_max": self.sync_max, "task": self.task,
            "task_hash": self.task_hash, "task_config": dict(self.task_config),
        })

    @classmethod
    def from_wire(cls, msg: wire.Config) -> RunConfig:
        model = ModelConfig(vocab=msg.vocab, width=msg.width, layers=msg.layers,
                            heads=msg.heads, seq=msg.seq)
        return cls(model=model, batch=msg.batch, steps=msg.steps, lr=msg.lr,
                   seed=msg.seed, data=msg.data, sync_every=msg.sync_every,
                   codec=msg.codec, outer_lr=msg.outer_lr, overlap=msg.overlap,
                   compute=msg.compute, sync_max=msg.sync_max, task=msg.task,
                   task_hash=msg.task_hash, task_config=tuple(sorted(msg.task_config.items())))

    def to_dict(self) -> dict[str, Any]:
        """Plain metadata for a checkpoint's ``run`` dict (the model goes separately)."""
        return {"batch": self.batch, "steps": self.steps, "lr": self.lr,
                "seed": self.seed, "data": self.data, "sync_every": self.sync_every,
                "codec": self.codec, "outer_lr": self.outer_lr, "overlap": self.overlap,
                "compute": self.compute, "sync_max": self.sync_max}

    @property
    def rounds(self) -> bool:
        """True when members train ``sync_every`` local steps between exchanges."""
        return self.sync_every > 1

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> RunConfig:
        run = ckpt.run
        try:
            # A checkpoint without these fields was trained without them (rules.LOCKSTEP).
            mode = {k: run.get(k, v) for k, v in LOCKSTEP.items()}
            # One that names no longest round had rounds of exactly sync_every.
            mode["sync_max"] = run.get("sync_max", mode["sync_every"])
            return cls(model=ckpt.model, batch=int(run["batch"]), steps=int(run["steps"]),
                       lr=float(run["lr"]), seed=int(run["seed"]), data=str(run["data"]),
                       sync_every=int(mode["sync_every"]), codec=str(mode["codec"]),
                       outer_lr=float(mode["outer_lr"]), overlap=int(mode["overlap"]),
                       compute=str(run.get("compute", CHECKPOINT_COMPUTE)),
                       sync_max=int(mode["sync_max"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint run metadata is incomplete: {exc}") from None


def run_config(
    vocab: int,
    *,
    width: int | None = None,
    layers: int | None = None,
    heads: int | None = None,
    seq: int | None = None,
    batch: int | None = None,
    steps: int | None = None,
    lr: float | None = None,
    seed: int | None = None,
    data: str = str(DEFAULTS["data"]),
    sync_every: int | None = None,
    codec: str | None = None,
    outer_lr: float | None = None,
    overlap: int | None = None,
    compute: str | None = None,
    sync_max: int | None = None,
    task: str = "",
    task_hash: str = "",
    task_config: tuple[tuple[str, int | float], ...] = (),
) -> RunConfig:
    """A validated :class:`RunConfig`; every ``None`` takes its value from :data:`DEFAULTS`.

    A bad value raises ``ValueError`` with a one-line message naming the field.
    """

    def pick(name: str, value: Any) -> Any:
        return DEFAULTS[name] if value is None else value

    model = ModelConfig(vocab=vocab, width=pick("width", width), layers=pick("layers", layers),
                        heads=pick("heads", heads), seq=pick("seq", seq))
    return RunConfig(model=model, batch=pick("batch", batch), steps=pick("steps", steps),
                     lr=pick("lr", lr), seed=pick("seed", seed), data=data,
                     sync_every=pick("sync_every", sync_every), codec=pick("codec", codec),
                     outer_lr=pick("outer_lr", outer_lr),
                     overlap=overlap, compute=pick("compute", compute), sync_max=sync_max,
                     task=task, task_hash=task_hash, task_config=task_config)


@functools.lru_cache(maxsize=8)
def _task_of(run: RunConfig) -> Task:
    if not run.task:
        from daisyweb.tasks.gpt import GPT

        return GPT(run.model, run.quantized)
    from daisyweb.tasks import TaskError, load_task, task_hash

    cls = load_task(run.task)
    here = task_hash(run.task)
    if here != run.task_hash:
        raise TaskError(f"task {run.task} differs here (code hash {here[:16]}, the run's "
                        f"{run.task_hash[:16]}): every member must run the same task code")
    return cls(dict(run.task_config), run.quantized)


def trained_quantized(ckpt: Checkpoint) -> bool:
    """Whether a checkpoint's run trained through the int8 forward (its ``compute``; one
    that names none did): what evaluating or sampling it must run through."""
    return ckpt.run.get("compute", CHECKPOINT_COMPUTE) != "float"
