"""The run's defaults and the value rules every layer shares: the bounds of each run-config
field, the spelling of a hex digest.

One place for them, so the model config, the run config, checkpoints and both command
lines default to the same run and refuse the same values with the same words. Pure Python
(no numpy, no daisyweb imports): anything may import it without a cycle. The public home
of the defaults is ``daisyweb.training.config`` (``DEFAULTS``, ``run_config``); they are
defined here only because ``daisyweb.model`` needs them too and sits below training.

The bounds are the ones the wire ``Config`` message enforces (``daisyweb.protocol.wire``):
``tests/daisyweb/test_rules.py`` checks that the two agree.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "DEFAULTS",
    "MAX_DIM",
    "MAX_STEP",
    "MAX_SEED",
    "MAX_LR",
    "MAX_DATA_LEN",
    "FieldRule",
    "FIELD_RULES",
    "MODEL_FIELDS",
    "RUN_FIELDS",
    "ROUND_FIELDS",
    "LOCKSTEP",
    "CODEC_NAMES",
    "CHECKPOINT_COMPUTE",
    "COMPUTE_NAMES",
    "check_compute",
    "MAX_SYNC_EVERY",
    "check_field",
    "check_heads",
    "check_model",
    "check_run",
    "check_rounds",
    "default_overlap",
    "default_sync_max",
    "overlap_fits",
    "rounds_fit",
    "is_lower_hex",
    "check_task",
    "parse_task_setting",
    "MAX_TASK_NAME",
    "TASK_SPEC",
    "TASK_FIELD",
    "MAX_TASK_FIELDS",
]

# The run every entry point starts unless told otherwise: daisyweb-demo, daisyweb-peer
# --start, the model's own defaults (sized for an old laptop: 1.3 M parameters).
DEFAULTS: MappingProxyType[str, int | float | str] = MappingProxyType({
    "width": 128, "layers": 4, "heads": 4, "seq": 64,
    # lr 5e-3: one peer's 300-step held-out loss is the same as at 3e-3 (5.516 vs 5.511),
    # and a group in rounds reaches it sooner (docs/limits.md, section 2).
    "batch": 8, "steps": 300, "lr": 5e-3, "seed": 0, "data": "builtin",
    # Rounds of 16 local steps (docs/limits.md section 2, python -m bench.scaling and
    # bench.rounds_sim) exchanging int2 deltas: with error feedback they train as well as
    # int4 at half its bytes (TEST_RESULTS.md, "codecs"). The group runs the next round's
    # first steps while a round's exchange is in flight, as many as the link needs and at
    # most the whole round (training.overlap): on a 1 MB/s uplink that makes two peers
    # 1.6x one machine where a fixed 2-step head start made them 1.1x (bench.links).
    "sync_every": 16, "codec": "int2", "outer_lr": 1.0,
    "overlap": 64,
    # The leader lengthens rounds up to this many steps when the slowest exchange takes
    # longer than a round's compute (protocol.pace); at most 4x the shortest by default.
    "sync_max": 64,
    # Every forward GEMM through the verified int8 kernels; "float": plain float32 GEMMs
    # (replicas stay identical either way: only the exchanged bytes must agree).
    "compute": "int8",
})
# The exchange of a checkpoint that names none: it was trained in lockstep, float32.
LOCKSTEP = MappingProxyType({"sync_every": 1, "codec": "f32", "outer_lr": 1.0, "overlap": 0,
                             "sync_max": 1})

EXCHANGES = ("auto", "all", "owner")
OWNER_FROM = 3
"""``--exchange auto`` runs the owner exchange (``protocol.owner_exchange``) from rosters
of this many members, all-to-all below: at two members the two send the same bytes, and
all-to-all takes one hop where owners take two; from three the owner exchange sends
fewer (1.35 against 2.01 contributions a round at three) for the same CPU and exchange
time (``python -m bench.scale``, TEST_RESULTS.md section "scale")."""
CODEC_NAMES = ("f32", "int8", "int4", "int2", "sparse")
COMPUTE_NAMES = ("int8", "float")
# The compute of a checkpoint that names none: every run before the choice was int8.
CHECKPOINT_COMPUTE = "int8"
MAX_SYNC_EVERY = 1 << 20

MAX_DIM = 1 << 31  # every model dimension and the batch size
MAX_STEP = (1 << 63) - 1  # steps fit a signed 64-bit int everywhere
MAX_SEED = (1 << 64) - 1
MAX_LR = 10.0  # the learning rate is in (0, MAX_LR]
MAX_DATA_LEN = 1024  # the data source's name


@dataclass(frozen=True)
class FieldRule:
    """One run-config field: its number type and closed bounds (``lo_open``: ``lo`` excluded).

    ``what`` names the accepted values for a message, e.g. "a positive integer".
    """

    kind: type
    lo: float
    hi: float
    what: str
    lo_open: bool = False

    def accepts(self, value: Any) -> bool:
        if self.kind is int:
            # bool is an int subclass; True as a width is a bug, not a value.
            if type(value) is not int:
                return False
        elif type(value) not in (int, float) or not math.isfinite(value):
            return False
        if self.lo_open and value == self.lo:
            return False
        return self.lo <= value <= self.hi


_DIM = FieldRule(int, 1, MAX_DIM, "a positive integer")

FIELD_RULES: MappingProxyType[str, FieldRule] = MappingProxyType({
    "vocab": _DIM,
    "width": _DIM,
    "layers": _DIM,
    "heads": _DIM,
    "seq": _DIM,
    "batch": _DIM,
    "steps": FieldRule(int, 1, MAX_STEP, "a positive integer"),
    "lr": FieldRule(float, 0.0, MAX_LR, f"a positive number up to {MAX_LR:g}", lo_open=True),
    "seed": FieldRule(int, 0, MAX_SEED, "an integer >= 0"),
    "sync_every": FieldRule(int, 1, MAX_SYNC_EVERY, "a positive integer"),
    "outer_lr": FieldRule(float, 0.0, MAX_LR, f"a positive number up to {MAX_LR:g}",
                          lo_open=True),
    "overlap": FieldRule(int, 0, MAX_SYNC_EVERY, "an integer >= 0"),
    "sync_max": FieldRule(int, 1, MAX_SYNC_EVERY, "a positive integer"),
})
MODEL_FIELDS = ("vocab", "width", "layers", "heads", "seq")
RUN_FIELDS = ("batch", "steps", "lr", "seed", "data")
ROUND_FIELDS = ("sync_every", "codec", "outer_lr", "overlap", "sync_max")


def check_field(name: str, value: Any, prefix: str = "") -> Any:
    """``value`` if the rule of field ``name`` accepts it, else ValueError naming the field.

    Messages read ``"<prefix><name> must be <what>, got <value>"``.
    """
    rule = FIELD_RULES[name]
    if not rule.accepts(value):
        # The float rule's `what` names its upper bound; an integer's is said when exceeded.
        too_big = rule.kind is int and type(value) is int and value > rule.hi
        limit = f" (at most {rule.hi})" if too_big else ""
        raise ValueError(f"{prefix}{name} must be {rule.what}{limit}, got {value!r}")
    return value


def check_model(vocab: Any, width: Any, layers: Any, heads: Any, seq: Any,
                prefix: str = "model ") -> None:
    """The model dimensions: each a positive integer, ``width`` divisible by ``heads``."""
    for name, value in zip(MODEL_FIELDS, (vocab, width, layers, heads, seq), strict=True):
        check_field(name, value, prefix)
    check_heads(width, heads)


def check_heads(width: int, heads: int) -> None:
    """Attention splits ``width`` into ``heads`` equal parts."""
    if width % heads:
        raise ValueError(f"width {width} is not divisible by heads {heads}")


def check_run(batch: Any, steps: Any, lr: Any, seed: Any, data: Any) -> None:
    """The run fields besides the model: batch, steps, learning rate, seed, data source."""
    for name, value in zip(RUN_FIELDS[:4], (batch, steps, lr, seed), strict=True):
        check_field(name, value)
    if type(data) is not str or not 1 <= len(data) <= MAX_DATA_LEN:
        raise ValueError(f"data must be a source name of 1..{MAX_DATA_LEN} characters, "
                         f"got {data!r:.80}")


def check_rounds(sync_every: Any, codec: Any, outer_lr: Any, overlap: Any = 0,
                 sync_max: Any = None) -> None:
    """How members exchange: every ``sync_every`` to ``sync_max`` steps (None: exactly
    ``sync_every``), through ``codec``, outer step size, and how many of a round's steps
    run while the previous exchange is in flight."""
    check_field("sync_every", sync_every)
    check_field("outer_lr", outer_lr)
    if codec not in CODEC_NAMES:
        raise ValueError(f"codec must be one of {', '.join(CODEC_NAMES)}, got {codec!r:.40}")
    longest = sync_every if sync_max is None else check_field("sync_max", sync_max)
    if not rounds_fit(sync_every, longest):
        raise ValueError(f"sync_max must be at least sync_every ({sync_every}) and 1 in "
                         f"lockstep, got {sync_max}")
    check_field("overlap", overlap)
    if not overlap_fits(longest, overlap):
        raise ValueError(f"overlap must be at most sync_max ({longest}) and 0 in "
                         f"lockstep, got {overlap}")


def check_compute(compute: Any) -> None:
    """How the forward GEMMs run: the int8 kernels or plain float32."""
    if compute not in COMPUTE_NAMES:
        raise ValueError(f"compute must be one of {', '.join(COMPUTE_NAMES)}, "
                         f"got {compute!r:.40}")


def rounds_fit(sync_every: int, sync_max: int) -> bool:
    """Rounds of ``sync_every`` to ``sync_max`` steps: the longest at least the shortest,
    and exactly one step in lockstep."""
    return sync_max == 1 if sync_every == 1 else sync_max >= sync_every


def overlap_fits(sync_max: int, overlap: int) -> bool:
    """A head start of ``overlap`` steps fits rounds of at most ``sync_max``: at most the
    longest round, and none in lockstep."""
    return not overlap or (overlap <= sync_max and sync_max > 1)


def default_sync_max(sync_every: int) -> int:
    """The longest round a run gets when it names none: four times its shortest (the
    leader lengthens rounds only when a link needs it, ``protocol.pace``); 1 in lockstep."""
    return min(4 * sync_every, MAX_SYNC_EVERY) if sync_every > 1 else 1


def default_overlap(sync_max: int) -> int:
    """The overlap a run gets when it names none: its longest round (the group runs ahead
    only as far as its link needs, ``training.overlap``); none in lockstep."""
    return sync_max if sync_max > 1 else 0


# A run's task (``daisyweb.tasks``): "" (the built-in GPT) or ``module:Name``, the hash of
# its code (64 lowercase hex digits) and its settings, by name (int or finite float).
MAX_TASK_NAME = 200
TASK_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
TASK_FIELD = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_TASK_FIELDS = 32


def check_task(task: Any, task_hash: Any, task_config: Any) -> None:
    """The task a run names, its code hash and its settings, as the wire carries them
    (a task's own bounds on its settings are its ``FIELDS``, checked where it loads)."""
    if task == "":
        if task_hash != "" or task_config:
            raise ValueError("task_hash and task_config belong to a named task")
        return
    if type(task) is not str or len(task) > MAX_TASK_NAME or not TASK_SPEC.fullmatch(task):
        raise ValueError(f"task must be module:Name, got {str(task)[:80]!r}")
    if type(task_hash) is not str or len(task_hash) != 64 or not is_lower_hex(task_hash):
        raise ValueError("task_hash must be 64 lowercase hex digits")
    items = task_config.items() if isinstance(task_config, dict) else task_config
    items = list(items)
    if len(items) > MAX_TASK_FIELDS:
        raise ValueError(f"task_config holds at most {MAX_TASK_FIELDS} settings")
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ValueError("task_config must map setting names to numbers")
        name, value = item
        if type(name) is not str or not TASK_FIELD.fullmatch(name):
            raise ValueError(f"task setting names are 1-32 of a-z 0-9 _, got {str(name)[:40]!r}")
        if type(value) not in (int, float) or (type(value) is float
                                                and not math.isfinite(value)):
            raise ValueError(f"task setting {name} must be a finite number")


def parse_task_setting(text: str) -> tuple[str, int | float]:
    """``NAME=VALUE`` of ``--task-set``: an integer, else a finite number (the task checks
    the name and bounds); ValueError saying why not."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return name, number


_LOWER_HEX = re.compile(r"[0-9a-f]+")


def is_lower_hex(text: Any) -> bool:
    """True for a non-empty string of lowercase hex digits (how every digest is spelled,
    so two peers never disagree on the spelling of one hash)."""
    return type(text) is str and _LOWER_HEX.fullmatch(text) is not None


# The size of a model, checked (by daisyweb.model.ModelConfig) before anything is allocated:
# a config from a file or the network can name a model far too big to build. 2**27
# parameters (float32 params, Adam m and v: a 1.5 GiB checkpoint) is the largest power of
# two whose checkpoint still loads within the reader's default 4 GiB budget.
MAX_LAYERS = 1024
MAX_PARAMS = 1 << 27
