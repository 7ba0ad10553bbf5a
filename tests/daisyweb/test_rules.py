"""The shared value rules (daisyweb.rules) are what the wire Config message checks: the wire
derives its bounds from them (one source); this keeps the two from drifting if that changes."""

from __future__ import annotations

import contextlib

import pytest

from daisyweb import rules
from daisyweb.protocol import wire

NO_TASK = {"task": "", "task_hash": "", "task_config": {}}  # the built-in GPT's run

def test_bounds_are_the_wire_configs() -> None:
    assert rules.MAX_DIM == wire.MAX_DIM
    assert rules.MAX_STEP == wire.MAX_STEP
    assert rules.MAX_SEED == wire.MAX_U64
    assert rules.MAX_DATA_LEN == wire.MAX_TEXT_LEN
    base = {"width": 8, "layers": 1, "heads": 2, "seq": 4, "vocab": 9, "batch": 1,
            "steps": 1, "lr": 1e-3, "seed": 0, "data": "builtin", "sync_every": 1,
            "codec": "f32", "outer_lr": 1.0, "overlap": 0, "compute": "int8",
            "sync_max": 1, **NO_TASK}
    edges = {
        "width": [0, 1, rules.MAX_DIM, rules.MAX_DIM + 1, True],
        "batch": [0, 1, rules.MAX_DIM, rules.MAX_DIM + 1],
        "steps": [0, 1, rules.MAX_STEP, rules.MAX_STEP + 1],
        "lr": [0.0, 1e-9, rules.MAX_LR, rules.MAX_LR + 1e-6, float("nan"), 1],
        "seed": [-1, 0, rules.MAX_SEED, rules.MAX_SEED + 1],
        "sync_every": [0, 1, rules.MAX_SYNC_EVERY, rules.MAX_SYNC_EVERY + 1],
        "outer_lr": [0.0, 0.5, rules.MAX_LR, rules.MAX_LR + 1e-6, float("inf")],
        "overlap": [-1, 0, 1, rules.MAX_SYNC_EVERY, rules.MAX_SYNC_EVERY + 1, True],
        "sync_max": [0, 2, rules.MAX_SYNC_EVERY, rules.MAX_SYNC_EVERY + 1, True],
    }
    for name, values in edges.items():
        for value in values:
            d = base | {name: value} | ({"heads": 1} if name == "width" else {})
            if name == "sync_every":  # as long a longest round: the cross rule accepts
                d["sync_max"] = value
            if name in ("overlap", "sync_max"):  # rounds of 2 to the longest: the cross
                # rules are not what refuses
                d["sync_every"] = 2
                d.setdefault("sync_max", rules.MAX_SYNC_EVERY)
                if name == "overlap":
                    d["sync_max"] = rules.MAX_SYNC_EVERY
            try:
                wire.Config.from_dict(d)
                wire_ok = True
            except wire.WireError:
                wire_ok = False
            assert rules.FIELD_RULES[name].accepts(value) == wire_ok, (name, value)


def test_codec_names_are_the_wire_configs() -> None:
    base = rules.DEFAULTS | {"vocab": 9, "width": 8, "heads": 2, **NO_TASK}
    for name in (*rules.CODEC_NAMES, "int4", "", "F32"):
        try:
            wire.Config.from_dict(dict(base, codec=name))
            wire_ok = True
        except wire.WireError:
            wire_ok = False
        assert wire_ok == (name in rules.CODEC_NAMES), name
        if not wire_ok:
            with pytest.raises(ValueError, match="codec must be one of"):
                rules.check_rounds(1, name, 1.0)


def test_lower_hex() -> None:
    assert rules.is_lower_hex("00ff")
    assert not any(rules.is_lower_hex(v) for v in ("", "00FF", "0g", "ab\n", None, 12))


def test_check_field_says_the_rule() -> None:
    with pytest.raises(ValueError, match="^steps must be a positive integer, got 0$"):
        rules.check_field("steps", 0)
    with pytest.raises(ValueError, match="at most 2147483648"):
        rules.check_field("width", rules.MAX_DIM + 1)


@pytest.mark.parametrize("compute", ["int8", "float"])
def test_compute_is_int8_or_float_on_the_wire_and_in_the_rules(compute: str) -> None:
    base = dict(rules.DEFAULTS, vocab=9, width=8, heads=2, **NO_TASK)
    assert wire.Config.from_dict(dict(base, compute=compute)).compute == compute
    rules.check_compute(compute)
    for bad in ("float32", "INT8", "", 8, None):
        with pytest.raises(wire.WireError, match="compute"):
            wire.Config.from_dict(dict(base, compute=bad))
        with pytest.raises(ValueError, match="compute must be one of int8, float"):
            rules.check_compute(bad)
    without = {k: v for k, v in base.items() if k != "compute"}
    with pytest.raises(wire.WireError, match="compute"):  # every field is required
        wire.Config.from_dict(without)


def test_overlap_is_at_most_the_longest_round_and_none_in_lockstep() -> None:
    base = dict(rules.DEFAULTS, vocab=9, width=8, heads=2, **NO_TASK)
    for sync_every, sync_max, overlap, ok in [
            (32, 32, 31, True), (32, 32, 32, True), (32, 32, 33, False), (16, 64, 64, True),
            (16, 64, 65, False), (1, 1, 0, True), (1, 1, 1, False), (2, 2, 1, True),
            (2, 2, 2, True)]:
        d = dict(base, sync_every=sync_every, overlap=overlap, sync_max=sync_max)
        try:
            wire.Config.from_dict(d)
            wire_ok = True
        except wire.WireError:
            wire_ok = False
        assert wire_ok == ok, (sync_every, overlap)
        if ok:
            rules.check_rounds(sync_every, "int8", 1.0, overlap, sync_max)
        else:
            with pytest.raises(ValueError, match="overlap must be at most sync_max"):
                rules.check_rounds(sync_every, "int8", 1.0, overlap, sync_max)


def test_the_longest_round_is_at_least_the_shortest_and_one_in_lockstep() -> None:
    base = dict(rules.DEFAULTS, vocab=9, width=8, heads=2, overlap=0, **NO_TASK)
    for sync_every, sync_max, ok in [(16, 16, True), (16, 64, True), (16, 15, False),
                                     (1, 1, True), (1, 2, False), (2, 1, False)]:
        d = dict(base, sync_every=sync_every, sync_max=sync_max)
        with pytest.raises(wire.WireError, match="sync_max") if not ok \
                else contextlib.nullcontext():
            wire.Config.from_dict(d)
        if not ok:
            with pytest.raises(ValueError, match="sync_max must be at least sync_every"):
                rules.check_rounds(sync_every, "int8", 1.0, 0, sync_max)


def test_default_overlap_fits_every_round_length() -> None:
    assert rules.default_overlap(1) == 0
    assert rules.default_overlap(2) == 2
    assert rules.default_overlap(32) == 32
    assert rules.default_sync_max(1) == 1 and rules.default_sync_max(16) == 64
    assert rules.default_sync_max(int(rules.DEFAULTS["sync_every"])) == \
        rules.DEFAULTS["sync_max"]
    assert rules.default_overlap(int(rules.DEFAULTS["sync_max"])) == rules.DEFAULTS["overlap"]
