"""Signaling protocol: message constants, one validating decoder, and the client side.

The server decodes every client message with :func:`decode`. A client builds what it
sends with :func:`signal`, :func:`decision`, :func:`policy` and :func:`status`, and reads
what the server sends with :func:`parse_server`, which returns one of the frozen
dataclasses below (``docs/protocol.md`` lists every message).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_MESSAGE_BYTES = 64 * 1024
MAX_ERRORS = 20
# Room codes and peer ids: the one definition, used by the server and by daisyweb-peer.
# Always matched with fullmatch: with match() and "$", "abcd\n" would pass as a room of its own.
ROOM_RE = re.compile(r"[A-Za-z0-9_-]{4,64}")
ROOM_RULE = "4-64 characters of A-Z a-z 0-9 _ -"
ID_RE = re.compile(r"[0-9a-f]{1,32}")
SIGNAL_KINDS = ("offer", "answer", "candidate")
# A private room's approval mode (daisyweb-peer --approve): its first host's, for good.
APPROVE_MODES = ("ask", "auto")
# Optional status fields shown on the dashboard. "ok"/"bad" are the usual probe
# values; any short string (e.g. a probe hash prefix) is accepted too.
RUN_STATES = ("starting", "training", "halted", "done", "waiting")
TRANSPORTS = ("aiortc", "libwebrtc")  # a status report's WebRTC implementation
MAX_NAME_CHARS = 64
MAX_HASH_CHARS = 16
MAX_PROBE_CHARS = 16
MAX_MODE_CHARS = 48  # "rounds H=1048576 int8" is 21
# Every number from the network is checked against a range before it is used or stored.
MAX_STEP = (1 << 63) - 1  # as daisyweb.rules.MAX_STEP: steps fit a signed 64-bit int
MAX_PEERS = 1 << 20
MAX_LOSS = 1e9  # far above any real cross-entropy, far below float overflow
MAX_TOKENS_PER_S = 1e12
# The pool fields of a status report (the dashboard's pool view): the machine, its share,
# its links.
MAX_CPU_CHARS = 64  # "Intel(R) Xeon(R) CPU E5-2690 v4 @ 2.60GHz" is 41
MACHINE_ID_CHARS = 16  # a keyed hash of the machine-id (daisyweb.peer.hardware)
_MACHINE_ID = re.compile(f"[0-9a-f]{{{MACHINE_ID_CHARS}}}")
MAX_BACKEND_CHARS = 16  # a kernel backend name: blas, blas64, mirror, lut
MAX_CORES = 1 << 16
MAX_RAM_MB = 1 << 30  # MiB: an exbibyte
MAX_ETA_S = 1e9  # about 32 years
MAX_LINKS = 256  # link entries in one report; a bigger group shows its first 256
MAX_RTT_MS = 60_000.0  # as daisyweb.net.link.MAX_RTT_S
# Text that must never reach a terminal, a log line or a page raw: ANSI escape and
# control sequences (7- and 8-bit), then every control, format (bidi overrides,
# zero-width), surrogate and line/paragraph separator character.
_ESCAPES = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves, screen clears
    r"|(?:\x1b[\]P^_X]|[\x90\x9d\x9e\x9f\x98])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC, DCS...
    r"|\x1b[ -/]*[0-~]"  # any other ESC sequence
)
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


class ProtocolError(ValueError):
    """A client message was refused; ``code`` goes into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error(code: str, message: str) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message}


def valid_room(code: str | None) -> bool:
    """No room (a public group), or a room code that matches ROOM_RULE in full."""
    return code is None or (isinstance(code, str) and ROOM_RE.fullmatch(code) is not None)


def valid_peer_id(value: object) -> bool:
    return isinstance(value, str) and ID_RE.fullmatch(value) is not None


def _shown(ch: str) -> bool:
    return unicodedata.category(ch) not in _HIDDEN_CATEGORIES


def clean_text(text: str, limit: int) -> str:
    """Peer-supplied ``text`` made safe to show anywhere: escape sequences and hidden or
    control characters removed, outer whitespace trimmed, at most ``limit`` characters."""
    text = _ESCAPES.sub("", text[: limit * 8])  # bounded work; more could never be shown
    return "".join(filter(_shown, text)).strip()[:limit].rstrip()


def clean_name(raw: str | None) -> str:
    """A display name as the server stores and shows it ("peer" when nothing is left)."""
    return clean_text(raw or "", MAX_NAME_CHARS) or "peer"


def is_clean(text: str) -> bool:
    """True when ``text`` holds nothing :func:`clean_text` would remove inside it."""
    return all(map(_shown, text))


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
    if not valid_peer_id(value):
        raise ProtocolError("bad_field", f"field {name!r} is not a valid peer id")
    return value


def _int_in(msg: dict, name: str, lo: int, hi: int) -> int:
    value = _field(msg, name, (int,), "an integer")
    if not lo <= value <= hi:
        raise ProtocolError("bad_field", f"field {name!r} must be an integer in {lo}..{hi}")
    return value


def _number_in(msg: dict, name: str, lo: float, hi: float) -> float:
    value = _field(msg, name, (int, float), "a number")
    # Compared before float(): a 400-digit int overflows float() but compares exactly,
    # and NaN and the infinities fail the comparison.
    if not lo <= value <= hi:
        raise ProtocolError(
            "bad_field", f"field {name!r} must be a finite number in {lo:g}..{hi:g}")
    return float(value)


def _text(msg: dict, name: str, limit: int) -> str:
    value = _field(msg, name, (str,), "a string")
    if len(value) > limit or not is_clean(value):
        raise ProtocolError(
            "bad_field", f"field {name!r} must be at most {limit} printable characters")
    return value


def _status_extras(msg: dict) -> dict[str, Any]:
    """The optional dashboard fields of a status report; absent fields stay absent."""
    out: dict[str, Any] = {}
    if "tokens_per_s" in msg:
        out["tokens_per_s"] = _number_in(msg, "tokens_per_s", 0.0, MAX_TOKENS_PER_S)
    if "probe" in msg:
        out["probe"] = _text(msg, "probe", MAX_PROBE_CHARS)
    if "state" in msg:
        state = _field(msg, "state", (str,), "a string")
        if state not in RUN_STATES:
            raise ProtocolError("bad_field", "state must be one of " + ", ".join(RUN_STATES))
        out["state"] = state
    if "mode" in msg:  # e.g. "rounds H=32 int8" or "lockstep f32"
        out["mode"] = _text(msg, "mode", MAX_MODE_CHARS)
    if "round" in msg:
        out["round"] = _int_in(msg, "round", 0, MAX_STEP)
    # the inner steps of the last round, and the most a member's exchange took: why the
    # leader made it that long (daisyweb.protocol.pace)
    for name in ("round_steps", "exchange_steps"):
        if name in msg:
            out[name] = _int_in(msg, name, 0, MAX_STEP)
    if "transport" in msg:  # the peer's WebRTC implementation
        transport = _field(msg, "transport", (str,), "a string")
        if transport not in TRANSPORTS:
            raise ProtocolError("bad_field",
                                "field 'transport' must be one of " + ", ".join(TRANSPORTS))
        out["transport"] = transport
    if "comm_share" in msg:  # the share of the round's wall time spent communicating
        out["comm_share"] = _number_in(msg, "comm_share", 0.0, 1.0)
    if "heldout_loss" in msg:
        out["heldout_loss"] = _number_in(msg, "heldout_loss", 0.0, MAX_LOSS)
    if "heldout_step" in msg:  # the step the held-out loss was evaluated at
        out["heldout_step"] = _int_in(msg, "heldout_step", 0, MAX_STEP)
    return out | _pool_extras(msg)


def _pool_extras(msg: dict) -> dict[str, Any]:
    """The pool fields (the dashboard's pool view): this peer's machine and kernel
    backend, its share of the batch and its own speed, the run's ETA and step budget, and
    its links' round-trip times by peer id (``null``: connected, not yet measured)."""
    out: dict[str, Any] = {}
    if "machine" in msg:  # peers on one machine say the same: the pool counts it once
        machine = _field(msg, "machine", (str,), f"{MACHINE_ID_CHARS} lowercase hex digits")
        if not _MACHINE_ID.fullmatch(machine):
            raise ProtocolError("bad_field", f"field 'machine' must be {MACHINE_ID_CHARS} "
                                             "lowercase hex digits")
        out["machine"] = machine
    if "cpu" in msg:
        out["cpu"] = _text(msg, "cpu", MAX_CPU_CHARS)
    if "cores" in msg:
        out["cores"] = _int_in(msg, "cores", 1, MAX_CORES)
    if "ram_mb" in msg:
        out["ram_mb"] = _int_in(msg, "ram_mb", 1, MAX_RAM_MB)
    if "backend" in msg:
        out["backend"] = _text(msg, "backend", MAX_BACKEND_CHARS)
    if "share" in msg:  # this peer's share of the step's (or round's) sequences
        out["share"] = _number_in(msg, "share", 0.0, 1.0)
    if "peer_tokens_per_s" in msg:  # this machine's own compute speed
        out["peer_tokens_per_s"] = _number_in(msg, "peer_tokens_per_s", 0.0, MAX_TOKENS_PER_S)
    if "eta_s" in msg:
        out["eta_s"] = _number_in(msg, "eta_s", 0.0, MAX_ETA_S)
    if "total_steps" in msg:
        out["total_steps"] = _int_in(msg, "total_steps", 0, MAX_STEP)
    if "links" in msg:
        out["links"] = _links(msg)
    return out


def _links(msg: dict) -> dict[str, float | None]:
    links = _field(msg, "links", (dict,), "an object of peer id -> round-trip ms or null")
    if len(links) > MAX_LINKS:
        raise ProtocolError("bad_field", f"field 'links' holds more than {MAX_LINKS} entries")
    out: dict[str, float | None] = {}
    for peer, rtt in links.items():
        if not valid_peer_id(peer):
            raise ProtocolError("bad_field", "field 'links' has a key that is no peer id")
        if rtt is None:
            out[peer] = None
            continue
        if isinstance(rtt, bool) or not isinstance(rtt, (int, float)) or not (
                0.0 <= rtt <= MAX_RTT_MS):
            raise ProtocolError("bad_field", f"field 'links' needs round-trip times in "
                                             f"0..{MAX_RTT_MS:g} ms or null")
        out[peer] = float(rtt)
    return out


def _approve_mode(msg: Mapping[str, Any]) -> str:
    mode = _field(dict(msg), "approve", (str,), "a string")
    if mode not in APPROVE_MODES:
        raise ProtocolError("bad_field", "approve must be one of " + ", ".join(APPROVE_MODES))
    return str(mode)


def _status(msg: dict) -> dict[str, Any]:
    out = {
        "type": "status",
        "step": _int_in(msg, "step", 0, MAX_STEP),
        "loss": _number_in(msg, "loss", -MAX_LOSS, MAX_LOSS),
        "hash": _text(msg, "hash", MAX_HASH_CHARS),
        "peers": _int_in(msg, "peers", 0, MAX_PEERS),
    }
    return out | _status_extras(msg)


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
    if kind == "policy":
        return {"type": "policy", "approve": _approve_mode(msg)}
    if kind == "status":
        return _status(msg)
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


def policy(approve: str) -> dict[str, Any]:
    """The host's approval mode for its room (``ask`` or ``auto``); the server keeps the
    first host's and answers with the room's mode, which the host then applies."""
    return {"type": "policy", "approve": approve}


def status(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A status report for the dashboard (fields as in ``docs/protocol.md``)."""
    return {"type": "status", **fields}


# ... and the messages it receives, parsed.


@dataclass(frozen=True)
class Welcome:
    """The first message after connecting: our id, and whether we are in yet."""

    id: str
    group: str | None  # None while waiting for a private room's host
    host: str | None  # None while waiting: a waiting peer learns nothing of the room
    member: bool  # False: waiting for the host's approval
    member_key: str | None = None  # members only: the secret of their dashboard view


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

    group: str | None = None
    member_key: str | None = None  # the secret of our dashboard view of the room


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
class Policy:
    """To the host: the room's approval mode (``ask`` or ``auto``), which it applies
    whatever its own ``--approve`` says, so a handover neither loosens nor tightens it."""

    approve: str


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
    Welcome | PeerList | Waiting | Approved | Denied | Relayed | HostKey | Policy
    | Decision | Refused | UnknownMessage
)


def _req(msg: Mapping[str, Any], name: str) -> Any:
    if name not in msg:
        raise ProtocolError("missing_field", f"{msg.get('type')!r} message lacks {name!r}")
    return msg[name]


def _optional_str(msg: Mapping[str, Any], name: str) -> str | None:
    value = msg.get(name)
    return value if isinstance(value, str) else None


def _named_peers(msg: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    peers = _req(msg, "peers")
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise ProtocolError("bad_field", "'peers' must be a list of objects")
    # Names are cleaned again here: they end up on terminals (the host's approval prompt).
    return tuple((str(_req(p, "id")), clean_text(str(p.get("name", "")), MAX_NAME_CHARS))
                 for p in peers)


def parse_server(msg: Mapping[str, Any]) -> ServerMessage:
    """One server->client message (a decoded JSON object) as its dataclass.

    Raises ProtocolError (a ValueError) when a known type lacks a field it needs.
    """
    kind = msg.get("type")
    if kind == "welcome":
        return Welcome(str(_req(msg, "id")), msg.get("group"), msg.get("host"),
                       msg.get("state") == "member", _optional_str(msg, "member_key"))
    if kind == "peers":
        return PeerList(_named_peers(msg), msg.get("host"))
    if kind == "waiting":
        return Waiting(_named_peers(msg))
    if kind == "approved":
        return Approved(_optional_str(msg, "group"), _optional_str(msg, "member_key"))
    if kind == "denied":
        return Denied()
    if kind == "signal":
        data = _req(msg, "data")
        if not isinstance(data, dict):
            raise ProtocolError("bad_field", "'data' must be an object")
        return Relayed(str(_req(msg, "from")), str(_req(msg, "kind")), data)
    if kind == "host_key":
        return HostKey(str(_req(msg, "key")))
    if kind == "policy":
        return Policy(_approve_mode(msg))
    if kind == "decision":
        return Decision(str(_req(msg, "id")), bool(_req(msg, "approve")))
    if kind == "error":
        return Refused(msg.get("code"), msg.get("message"))
    return UnknownMessage(kind)
