"""Signaling protocol: message constants and one validating decoder."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_MESSAGE_BYTES = 64 * 1024
MAX_ERRORS = 20
ROOM_RE = re.compile(r"^[A-Za-z0-9_-]{4,64}$")
ID_RE = re.compile(r"^[0-9a-f]{1,32}$")
SIGNAL_KINDS = ("offer", "answer", "candidate")
# Optional status fields shown on the dashboard. "ok"/"bad" are the usual probe
# values; any short string (e.g. a probe hash prefix) is accepted too.
RUN_STATES = ("starting", "training", "halted", "done", "waiting")
MAX_PROBE_CHARS = 16


class ProtocolError(ValueError):
    """A client message was refused; ``code`` goes into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message}


def valid_room(code: str | None) -> bool:
    return code is None or bool(ROOM_RE.match(code))


def _field(msg: dict, name: str, types: tuple, what: str) -> Any:
    if name not in msg:
        raise ProtocolError("missing_field", f"field {name!r} is required")
    value = msg[name]
    if isinstance(value, bool) and bool not in types:
        raise ProtocolError("bad_field", f"field {name!r} must be {what}")
    if not isinstance(value, types):
        raise ProtocolError("bad_field", f"field {name!r} must be {what}")
    return value


def _peer_id(msg: dict, name: str) -> str:
    value = _field(msg, name, (str,), "a peer id string")
    if not ID_RE.match(value):
        raise ProtocolError("bad_field", f"field {name!r} is not a valid peer id")
    return value


def _status_extras(msg: dict) -> dict[str, Any]:
    """The optional dashboard fields of a status report; absent fields stay absent."""
    out: dict[str, Any] = {}
    if "tokens_per_s" in msg:
        tps = _field(msg, "tokens_per_s", (int, float), "a number")
        if not tps >= 0 or tps == float("inf"):  # `not >=` also catches NaN
            raise ProtocolError("bad_field", "tokens_per_s must be a finite number >= 0")
        out["tokens_per_s"] = float(tps)
    if "probe" in msg:
        probe = _field(msg, "probe", (str,), "a string")
        if len(probe) > MAX_PROBE_CHARS:
            raise ProtocolError("bad_field", f"probe must be at most {MAX_PROBE_CHARS} characters")
        out["probe"] = probe
    if "state" in msg:
        state = _field(msg, "state", (str,), "a string")
        if state not in RUN_STATES:
            raise ProtocolError("bad_field", "state must be one of " + ", ".join(RUN_STATES))
        out["state"] = state
    return out


def decode(raw: str | bytes) -> dict[str, Any]:
    """Parse and validate one client->server message; raise ProtocolError."""
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError("too_large", f"message exceeds {MAX_MESSAGE_BYTES} bytes")
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("bad_json", "message is not valid JSON") from None
    if not isinstance(msg, dict):
        raise ProtocolError("bad_message", "message must be a JSON object")
    kind = msg.get("type")
    if kind == "signal":
        to = _peer_id(msg, "to")
        skind = _field(msg, "kind", (str,), "a string")
        if skind not in SIGNAL_KINDS:
            raise ProtocolError("bad_field", "kind must be offer, answer or candidate")
        data = _field(msg, "data", (dict,), "an object")
        return {"type": "signal", "to": to, "kind": skind, "data": data}
    if kind in ("approve", "deny"):
        return {"type": kind, "id": _peer_id(msg, "id")}
    if kind == "status":
        step = _field(msg, "step", (int,), "an integer")
        loss = _field(msg, "loss", (int, float), "a number")
        hsh = _field(msg, "hash", (str,), "a string")
        peers = _field(msg, "peers", (int,), "an integer")
        if len(hsh) > 16:
            raise ProtocolError("bad_field", "hash must be at most 16 characters")
        if step < 0 or peers < 0 or loss != loss or abs(loss) == float("inf"):
            raise ProtocolError("bad_field", "step/peers must be >= 0, loss finite")
        out = {"type": "status", "step": step, "loss": float(loss), "hash": hsh, "peers": peers}
        return out | _status_extras(msg)
    if isinstance(kind, str):
        raise ProtocolError("unknown_type", f"unknown message type {kind[:32]!r}")
    raise ProtocolError("bad_message", "field 'type' must be a string")
