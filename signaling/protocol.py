"""Signaling protocol: message constants, one validating decoder, and the client side.

The server decodes every client message with :func:`decode`. A client builds what it
sends with :func:`signal`, :func:`decision` and :func:`status`, and reads what the
server sends with :func:`parse_server`, which returns one of the frozen dataclasses
below (``docs/protocol.md`` lists every message).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
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


# ----------------------------------------------------------------------------
# Client side: messages a client sends (each passes :func:`decode`) ...


def signal(to: str, kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """Ask the server to relay WebRTC signaling ``data`` to member ``to``."""
    return {"type": "signal", "to": to, "kind": kind, "data": data}


def decision(peer_id: str, approve: bool) -> dict[str, Any]:
    """The host's ``approve`` or ``deny`` of a waiting peer."""
    return {"type": "approve" if approve else "deny", "id": peer_id}


def status(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A status report for the dashboard (fields as in ``docs/protocol.md``)."""
    return {"type": "status", **fields}


# ... and the messages it receives, parsed.


@dataclass(frozen=True)
class Welcome:
    """The first message after connecting: our id, and whether we are in yet."""

    id: str
    group: str | None
    host: str | None
    member: bool  # False: waiting for the host's approval


@dataclass(frozen=True)
class PeerList:
    """The approved members, in server order, as (id, display name); includes us."""

    peers: tuple[tuple[str, str], ...]
    host: str | None


@dataclass(frozen=True)
class Waiting:
    """To the host only: the peers waiting for approval, as (id, display name)."""

    peers: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Approved:
    """We were waiting and are now a member."""


@dataclass(frozen=True)
class Denied:
    """The host refused us; the server closes the socket."""


@dataclass(frozen=True)
class Relayed:
    """WebRTC signaling from another member."""

    sender: str
    kind: str
    data: dict[str, Any]


@dataclass(frozen=True)
class HostKey:
    """To the host of a private room: the secret of its dashboard link."""

    key: str


@dataclass(frozen=True)
class Decision:
    """To the host: a decision made on its dashboard page, for it to act on."""

    id: str
    approve: bool


@dataclass(frozen=True)
class Refused:
    """The server's ``error`` reply to something we sent."""

    code: str | None
    message: str | None


@dataclass(frozen=True)
class UnknownMessage:
    """A type this client does not know (a newer server); safe to ignore."""

    type: object


ServerMessage = (
    Welcome | PeerList | Waiting | Approved | Denied | Relayed | HostKey | Decision
    | Refused | UnknownMessage
)


def _req(msg: Mapping[str, Any], name: str) -> Any:
    if name not in msg:
        raise ProtocolError("missing_field", f"{msg.get('type')!r} message lacks {name!r}")
    return msg[name]


def _named_peers(msg: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    peers = _req(msg, "peers")
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise ProtocolError("bad_field", "'peers' must be a list of objects")
    return tuple((str(_req(p, "id")), str(p.get("name", ""))) for p in peers)


def parse_server(msg: Mapping[str, Any]) -> ServerMessage:
    """One server->client message (a decoded JSON object) as its dataclass.

    Raises ProtocolError (a ValueError) when a known type lacks a field it needs.
    """
    kind = msg.get("type")
    if kind == "welcome":
        return Welcome(str(_req(msg, "id")), msg.get("group"), msg.get("host"),
                       msg.get("state") == "member")
    if kind == "peers":
        return PeerList(_named_peers(msg), msg.get("host"))
    if kind == "waiting":
        return Waiting(_named_peers(msg))
    if kind == "approved":
        return Approved()
    if kind == "denied":
        return Denied()
    if kind == "signal":
        data = _req(msg, "data")
        if not isinstance(data, dict):
            raise ProtocolError("bad_field", "'data' must be an object")
        return Relayed(str(_req(msg, "from")), str(_req(msg, "kind")), data)
    if kind == "host_key":
        return HostKey(str(_req(msg, "key")))
    if kind == "decision":
        return Decision(str(_req(msg, "id")), bool(_req(msg, "approve")))
    if kind == "error":
        return Refused(msg.get("code"), msg.get("message"))
    return UnknownMessage(kind)
