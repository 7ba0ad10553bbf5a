"""No raw escape byte from another peer reaches a terminal (``daisyweb.text``): every
string field of every wire message is either refused by the decoder (peer ids) or
cleaned on every path the peer prints through (``options.log``, the logging handler,
the command's last line)."""

from __future__ import annotations

import dataclasses
import logging
import re

import msgpack
import pytest

from daisyweb.cli import peer as peer_cli
from daisyweb.peer.options import log
from daisyweb.protocol import wire
from daisyweb.protocol.sync import StepMachine, Stopped
from daisyweb.text import clean
from tests.daisyweb.protocol.test_sync import FakeReplica

# A title, the clipboard (OSC 52), a clear screen, a forged line, a bidi override, C1 CSI
HOSTILE = ("\x1b]0;pwned\x07\x1b]52;c;ZXZpbA==\x07\x1b[2J\r\ndaisyweb-peer: done at step 9"
           "\u202egnp.exe\x9b31m\x00")
RAW = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e]")


def test_clean_escapes_controls_and_keeps_text() -> None:
    out = clean(HOSTILE)
    assert not RAW.search(out) and "\\x1b]52;c;" in out and "\\u202e" in out
    assert clean("héllo 日本 — ok") == "héllo 日本 — ok"
    assert clean("x" * 10, limit=4) == "xxxx..."


def _fields() -> list[tuple[type, str]]:
    return [(cls, f.name) for cls in wire.MESSAGE_TYPES.values()
            for f in dataclasses.fields(cls) if f.type in ("str", str)]


def _valid(cls: type) -> dict:
    """A valid instance's map, from the examples of test_wire."""
    from tests.daisyweb.protocol.test_wire import SAMPLES

    msg = next(m for m in SAMPLES if type(m) is cls)
    return {"type": cls.type, **{f.name: (list(v) if isinstance(v := getattr(msg, f.name),
                                                              tuple) else v)
                                 for f in dataclasses.fields(cls)}}


@pytest.mark.parametrize(("cls", "name"), _fields(), ids=lambda x: getattr(x, "__name__", x))
def test_every_string_field_is_refused_or_printed_clean(cls: type, name: str,
                                                        capsys: pytest.CaptureFixture[str],
                                                        ) -> None:
    d = _valid(cls)
    d[name] = HOSTILE
    try:
        msg = wire.decode(msgpack.packb(d, use_bin_type=True))
    except wire.WireError:
        return  # ids, hashes, codec names: refused at the door
    log(f"{name}: {getattr(msg, name)}")  # the peer's line, whatever it quotes
    err = capsys.readouterr().err
    assert not RAW.search(err.rstrip("\n")), err


def test_a_halt_reason_reaches_the_terminal_clean(capsys: pytest.CaptureFixture[str]) -> None:
    m = StepMachine("b", FakeReplica(), 3, lambda: "aa" * 16, leader="a")
    (stopped,) = [a for a in m.message("a", wire.Halt(0, HOSTILE), 0.0)
                  if isinstance(a, Stopped)]
    log(f"halted at step {stopped.step}: {stopped.reason}")  # what the driver prints
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not RAW.search(err.rstrip("\n"))


def test_library_warnings_are_the_peers_lines_and_clean(capsys: pytest.CaptureFixture[str],
                                                         ) -> None:
    handler = peer_cli._CleanLines(logging.WARNING)
    logger = logging.getLogger("daisyweb.net.test")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("bad answer from %s: %s", "peer", HOSTILE)
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.startswith("daisyweb-peer: bad answer from peer: ")
    assert err.count("\n") == 1 and not RAW.search(err.rstrip("\n"))


def test_peer_ids_with_control_characters_are_refused() -> None:
    for d in ({"type": "hello", "peer_id": "a\x1bb", "version": 1},
              {"type": "following", "leader": "\x1b[2J", "term": 0},
              {"type": "roster", "step": 0, "members": ["a", "b\n"], "shares": [], "term": 0,
               "owners": [], "ahead": 0, "length": 0},
              {"type": "repair_request", "step": 0, "sender_of_missing": "x\u202e"}):
        with pytest.raises(wire.WireError, match="peer id"):
            wire.decode(msgpack.packb(d, use_bin_type=True))
    with pytest.raises(wire.WireError, match="peer id"):
        wire.Hello("a\x1bb")  # nor can this peer build one
