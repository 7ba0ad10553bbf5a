"""Peer-to-peer wire protocol: typed messages and their one validating msgpack codec.

Messages
--------
Every message is a frozen dataclass with a class-level ``type`` string. On the wire
it is a msgpack map ``{"type": <type>, <field>: <value>, ...}``. :func:`encode`
turns a message into bytes, :func:`decode` is the *only* way back: it checks the
map's keys (no missing, no extra), every field's type and range, and raises
:class:`WireError` (a ``ValueError``) with a clear message on anything wrong.
Constructing a message validates it too, so an invalid message is never sent.

Framing (cutting an encoded message into data channel frames) lives in
:mod:`daisyweb.protocol.framing`.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

from daisyweb import rules
from daisyweb.protocol.pace import Pace

__all__ = [
    "encode_parts",
    "Part",
    "PROTOCOL_VERSION",
    "WireError",
    "Hello",
    "Following",
    "Config",
    "SnapshotPlan",
    "PieceRequest",
    "Piece",
    "Roster",
    "Contribution",
    "StepHashes",
    "RepairRequest",
    "OwnedPart",
    "MeanPart",
    "PartRequest",
    "MeanRequest",
    "NO_ROSTER",
    "roster_digest",
    "cut_digest",
    "Heartbeat",
    "Halt",
    "Message",
    "MESSAGE_TYPES",
    "encode",
    "decode",
]

# The messages below, as every peer of this version speaks them; a peer announcing another
# version in its Hello is never listened to (protocol.leading). It goes up with any change
# of a message's fields.
PROTOCOL_VERSION = 11

# Limits. Generous for the project's models, small enough that a hostile peer
# cannot make us allocate without bound.
MAX_ID_LEN = 128  # peer ids
MAX_TEXT_LEN = rules.MAX_DATA_LEN  # free text (halt reason, data source)
MAX_HASH_LEN = 128  # hex digests (512-bit max)
MAX_MEMBERS = 1024  # roster size
MAX_PAYLOAD = 1 << 30  # snapshot / contribution bytes
MAX_MESSAGE = MAX_PAYLOAD + (1 << 16)  # decode refuses larger inputs outright
MAX_U64 = rules.MAX_SEED
MAX_STEP = rules.MAX_STEP  # steps fit a signed 64-bit int everywhere
MAX_DIM = rules.MAX_DIM
MAX_SHARE = 1 << 20  # sequences one member may be given in one step
MAX_SPEED = 1e12  # sequences per second a member may report
DIGEST_BYTES = 16  # of a contribution's digest in StepHashes (collisions cost 2**64 work)


class WireError(ValueError):
    """Anything wrong with bytes received from (or about to go to) the wire."""


# ----------------------------------------------------------------------------
# Field checkers: each takes (type name, field name, value) and returns the
# normalised value or raises WireError.

Checker = Callable[[str, str, Any], Any]


def _fail(t: str, name: str, why: str) -> WireError:
    return WireError(f"{t}.{name}: {why}")


def _int(lo: int, hi: int) -> Checker:
    def check(t: str, name: str, v: Any) -> int:
        # bool is an int subclass; True as a step is a bug, not a value.
        if type(v) is not int:
            raise _fail(t, name, f"expected int, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise _fail(t, name, f"{v} out of range [{lo}, {hi}]")
        return v

    return check


def _float(lo: float, hi: float, lo_open: bool = False) -> Checker:
    def check(t: str, name: str, v: Any) -> float:
        if type(v) not in (int, float):
            raise _fail(t, name, f"expected float, got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f):
            raise _fail(t, name, f"{f} is not finite")
        if f < lo or f > hi or (lo_open and f == lo):
            lb = "(" if lo_open else "["
            raise _fail(t, name, f"{f} out of range {lb}{lo}, {hi}]")
        return f

    return check


_ID = re.compile(r"[0-9A-Za-z._:-]*")


def _rule(field: str) -> Checker:
    """The check of a run-config field, from its one rule (``daisyweb.rules.FIELD_RULES``)."""
    r = rules.FIELD_RULES[field]
    return _int(int(r.lo), int(r.hi)) if r.kind is int else _float(r.lo, r.hi, r.lo_open)


def _id(min_len: int = 1) -> Checker:
    """A peer id: letters, digits and ``._:-`` only (it is printed on every terminal)."""
    base = _str(MAX_ID_LEN, min_len)

    def check(t: str, name: str, v: Any) -> str:
        v = base(t, name, v)
        if not _ID.fullmatch(v):
            raise _fail(t, name, "a peer id has letters, digits and ._:- only")
        return v

    return check


def _str(max_len: int, min_len: int = 1) -> Checker:
    def check(t: str, name: str, v: Any) -> str:
        if type(v) is not str:
            raise _fail(t, name, f"expected str, got {type(v).__name__}")
        if len(v) < min_len:
            raise _fail(t, name, "empty string")
        if len(v) > max_len:
            raise _fail(t, name, f"string too long ({len(v)} > {max_len})")
        return v

    return check


def _hex(t: str, name: str, v: Any) -> str:
    v = _str(MAX_HASH_LEN, 2)(t, name, v)
    # Lowercase only, so two peers never disagree on the spelling of one hash.
    if len(v) % 2 or not rules.is_lower_hex(v):
        raise _fail(t, name, "expected lowercase hex digest of even length")
    return v


def _bytes(max_len: int, multiple: int = 1) -> Checker:
    def check(t: str, name: str, v: Any) -> bytes:
        if type(v) is not bytes:
            raise _fail(t, name, f"expected bytes, got {type(v).__name__}")
        if len(v) > max_len:
            raise _fail(t, name, f"payload too long ({len(v)} > {max_len})")
        if len(v) % multiple:
            raise _fail(t, name, f"payload length {len(v)} not a multiple of {multiple}")
        return v

    return check


def _choice(*allowed: str) -> Checker:
    def check(t: str, name: str, v: Any) -> str:
        if v not in allowed:
            raise _fail(t, name, f"must be one of {', '.join(allowed)}")
        return str(v)

    return check


def _task_config(t: str, name: str, v: Any) -> dict[str, int | float]:
    """A task's settings: a map of at most ``rules.MAX_TASK_FIELDS`` names to numbers
    (``rules.check_task`` checks the names and values with the task)."""
    if type(v) is not dict:
        raise _fail(t, name, f"expected map, got {type(v).__name__}")
    if len(v) > rules.MAX_TASK_FIELDS:
        raise _fail(t, name, f"at most {rules.MAX_TASK_FIELDS} settings")
    return dict(v)


def _members(t: str, name: str, v: Any) -> tuple[str, ...]:
    if type(v) not in (list, tuple):
        raise _fail(t, name, f"expected list of str, got {type(v).__name__}")
    if not 1 <= len(v) <= MAX_MEMBERS:
        raise _fail(t, name, f"needs 1..{MAX_MEMBERS} members, got {len(v)}")
    check_id = _id()
    out = tuple(check_id(t, f"{name}[{i}]", m) for i, m in enumerate(v))
    # Roster order defines the summation order; a repeated peer would double-count.
    if len(set(out)) != len(out):
        raise _fail(t, name, "duplicate member")
    return out


def _list_of(item: Checker, what: str) -> Checker:
    """A list (or tuple) of at most MAX_MEMBERS ``what``s, each checked by ``item``."""
    def check(t: str, name: str, v: Any) -> tuple[Any, ...]:
        if type(v) not in (list, tuple):
            raise _fail(t, name, f"expected list of {what}, got {type(v).__name__}")
        if len(v) > MAX_MEMBERS:
            raise _fail(t, name, f"at most {MAX_MEMBERS} {what}s, got {len(v)}")
        return tuple(item(t, f"{name}[{i}]", x) for i, x in enumerate(v))

    return check


_owners = _list_of(_id(), "owner")  # who reduces each part: one member may own several
_norms = _list_of(_float(0.0, 1e300), "norm")  # squared norms: finite, non-negative


_digests = _list_of(_hex, "digest")  # contribution digests, in roster order


def payload_digest(payload: bytes) -> str:
    """The short digest of a contribution's bytes that ``StepHashes.digests`` carries."""
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).hexdigest()


def _shares(t: str, name: str, v: Any) -> tuple[int, ...]:
    if type(v) not in (list, tuple):
        raise _fail(t, name, f"expected list of int, got {type(v).__name__}")
    check = _int(1, MAX_SHARE)
    return tuple(check(t, f"{name}[{i}]", n) for i, n in enumerate(v))


_step = _int(0, MAX_STEP)
_peer = _id()
_dim = _int(1, MAX_DIM)


# ----------------------------------------------------------------------------
# Messages


class _Msg:
    """Validating base: subclasses list a checker per field in ``_checks``."""

    type: ClassVar[str]
    _checks: ClassVar[dict[str, Checker]]

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            v = self._checks[f.name](self.type, f.name, getattr(self, f.name))
            # Frozen: normalise (int->float, list->tuple) behind the guard.
            object.__setattr__(self, f.name, v)
        self._check_cross()

    def _check_cross(self) -> None:
        """Cross-field checks; overridden where needed."""


@dataclass(frozen=True)
class Hello(_Msg):
    peer_id: str
    version: int = PROTOCOL_VERSION

    type: ClassVar[str] = "hello"
    _checks: ClassVar[dict[str, Checker]] = {
        "peer_id": _peer,
        "version": _int(0, (1 << 32) - 1),
    }


@dataclass(frozen=True)
class Following(_Msg):
    """Who the sender follows as the group's leader, and in which term ("" before it has
    started or while it rejoins; the leader names itself). Sent after the Hello on every
    new link and again when the leader changes: a joiner follows the leader the group
    names, not whoever sends a snapshot first (``daisyweb.peer.handshake.agreed_leader``),
    and a new leader leads only once a majority of the last roster declared it for its
    term (``daisyweb.protocol.election``). A peer declares one leader per term."""

    leader: str
    term: int = 0

    type: ClassVar[str] = "following"
    _checks: ClassVar[dict[str, Checker]] = {"leader": _id(0),
                                             "term": _int(0, MAX_STEP)}


@dataclass(frozen=True)
class Config(_Msg):
    """The run config the leader broadcasts at start."""

    width: int
    layers: int
    heads: int
    seq: int
    vocab: int
    batch: int
    steps: int
    lr: float
    seed: int
    data: str
    sync_every: int
    codec: str
    outer_lr: float
    overlap: int
    sync_max: int  # the longest round the leader may name (``protocol.pace``)
    # the verified int8 kernels, or "float" (plain float32 GEMMs)
    compute: str = str(rules.DEFAULTS["compute"])
    # what the group trains (``daisyweb.tasks``): "" the built-in GPT, else module:Name,
    # the hash of its code every member must match, and its settings
    task: str = ""
    task_hash: str = ""
    task_config: dict[str, int | float] = field(default_factory=dict)

    type: ClassVar[str] = "config"
    # Every bound is the run's own rule (daisyweb.rules): one source for the CLI, the
    # run config, checkpoints and the wire.
    _checks: ClassVar[dict[str, Checker]] = {
        **{name: _rule(name) for name in rules.FIELD_RULES},
        "data": _str(rules.MAX_DATA_LEN),
        "codec": _choice(*rules.CODEC_NAMES),
        "compute": _choice(*rules.COMPUTE_NAMES),
        "task": _str(rules.MAX_TASK_NAME, 0),
        "task_hash": _str(64, 0),
        "task_config": _task_config,
    }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """Validate a plain run-config dict (e.g. from CLI/JSON) into a Config."""
        if not isinstance(d, dict):
            raise WireError(f"config must be a dict, got {type(d).__name__}")
        return _from_fields(cls, d)  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _check_cross(self) -> None:
        try:
            rules.check_heads(self.width, self.heads)
        except ValueError as exc:
            raise _fail(self.type, "heads", str(exc)) from None
        try:
            rules.check_rounds(self.sync_every, self.codec, self.outer_lr, self.overlap,
                               self.sync_max)
        except ValueError as exc:
            name = "sync_max" if str(exc).startswith("sync_max") else "overlap"
            raise _fail(self.type, name, str(exc)) from None
        try:
            rules.check_task(self.task, self.task_hash, self.task_config)
        except ValueError as exc:
            raise _fail(self.type, "task", str(exc)) from None


@dataclass(frozen=True)
class SnapshotPlan(_Msg):
    """The leader's offer of boundary ``step`` to a joiner, which downloads the state in
    pieces from every holder at once (``daisyweb.peer.pieces``). ``weight_hash`` is the
    group's hash at the boundary (what every member published); ``inner_step`` is the
    optimizer's step count (its beta powers follow from it); ``digests`` are the pieces'
    digests (:func:`payload_digest`), in piece order; ``holders`` are the members
    that hold the boundary's state (the leader among them): piece k is asked of holder
    k mod n."""

    step: int
    weight_hash: str
    inner_step: int
    vocab_size: int
    tokenizer_hash: str
    digests: tuple[str, ...]
    holders: tuple[str, ...]

    type: ClassVar[str] = "snapshot_plan"
    _checks: ClassVar[dict[str, Checker]] = {
        "step": _step,
        "weight_hash": _hex,
        "inner_step": _step,
        "vocab_size": _dim,
        "tokenizer_hash": _hex,
        "digests": _digests,
        "holders": _members,
    }


@dataclass(frozen=True)
class PieceRequest(_Msg):
    """A joiner asks a holder for piece ``piece`` of the state at boundary ``step``."""

    step: int
    piece: int

    type: ClassVar[str] = "piece_request"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step,
                                             "piece": _int(0, MAX_MEMBERS - 1)}


@dataclass(frozen=True)
class Piece(_Msg):
    """Piece ``piece`` of the state at boundary ``step`` (little-endian float32); empty:
    the sender does not hold that boundary (any more) or will not serve it again."""

    step: int
    piece: int
    payload: bytes

    type: ClassVar[str] = "piece"
    _checks: ClassVar[dict[str, Checker]] = {
        "step": _step,
        "piece": _int(0, MAX_MEMBERS - 1),
        "payload": _bytes(MAX_PAYLOAD, multiple=4),
    }


@dataclass(frozen=True)
class Roster(_Msg):
    """The members of step ``step`` in summation order. ``shares`` (capacity-weighted
    batches) gives each member's number of sequences, in the same order; empty: every
    member takes the run's batch and the contributions are averaged plainly. ``term``
    is the sender's leadership term: a member takes rosters only from the leader it
    follows in that term."""

    step: int
    members: tuple[str, ...]  # a list is accepted and stored as a tuple (frozen)
    shares: tuple[int, ...] = ()
    term: int = 0
    # The owner exchange (``protocol.owners``): the member that reduces each part of the
    # mean, in part order (as many parts as the step's first roster had members; an
    # amendment hands a lost owner's parts to its successor). Empty: all-to-all.
    owners: tuple[str, ...] = ()
    # Rounds (``protocol.pace``): how many steps of the next round every member takes
    # while this round's exchange is in flight (at most the run's ``overlap``, which a
    # member applies whatever this says). One number for the group: members that ran
    # ahead by different lengths would send at different times, and the leader's view
    # of their speeds (``capacity.bounded_speeds``) would favour the longer head start.
    ahead: int = 0
    # Rounds: this round's inner steps, within the run's bounds (0: the shortest).
    length: int = 0

    type: ClassVar[str] = "roster"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "members": _members,
                                             "shares": _shares, "term": _int(0, MAX_STEP),
                                             "owners": _owners,
                                             "ahead": _int(0, rules.MAX_SYNC_EVERY),
                                             "length": _int(0, rules.MAX_SYNC_EVERY)}

    @property
    def pace(self) -> Pace:
        return Pace(self.length, self.ahead)

    def _check_cross(self) -> None:
        if self.shares and len(self.shares) != len(self.members):
            raise _fail(self.type, "shares", f"{len(self.shares)} shares for "
                                             f"{len(self.members)} members")
        strangers = set(self.owners) - set(self.members)
        if strangers:
            raise _fail(self.type, "owners", "an owner that is not a member: "
                                             f"{sorted(strangers)[0]}")


@dataclass(frozen=True)
class Contribution(_Msg):
    """``sender``'s contribution to step ``step`` of the step machine (a round's weight
    change by default, a gradient in lockstep): ``payload`` is the run's codec's bytes
    (``daisyweb.protocol.codec``: f32, int8, int4 or int2; its length is the codec's to
    check), checked against the run when it arrives. On the wire its ``type`` is
    ``"gradient"`` and its fields are ``step``, ``sender`` and ``payload``: names kept as
    they are because other names would be other bytes (``docs/protocol.md``)."""

    step: int
    sender: str
    payload: bytes

    type: ClassVar[str] = "gradient"
    _checks: ClassVar[dict[str, Checker]] = {
        "step": _step,
        "sender": _peer,
        "payload": _bytes(MAX_PAYLOAD),
    }


@dataclass(frozen=True)
class StepHashes(_Msg):
    """Hashes a peer publishes at boundary ``step`` (after ``step`` committed updates).

    ``roster_hash`` is :func:`roster_digest` of the roster whose average produced this
    boundary (``NO_ROSTER`` at a start or snapshot boundary): two peers' weight hashes
    are only comparable when they applied the same roster, which matters when a roster
    is amended and a peer recommits.
    """

    step: int
    sender: str
    weight_hash: str
    probe_hash: str
    roster_hash: str = "00"
    # Sequences per second of the sender's last contribution (0: not measured yet): the
    # leader sets the next roster's shares from it (capacity-weighted batches).
    speed: float = 0.0
    # payload_digest of each roster member's contribution the sender averaged to reach
    # this boundary, in roster order (empty at a start or snapshot boundary): when two
    # members' weights differ, the member whose digests differ sent them different bytes.
    digests: tuple[str, ...] = ()
    # Rounds: the steps of a round the sender's last exchange took at its own speed
    # (``training.overlap``): the leader's next roster runs ahead as far as the slowest
    # member's exchange needs (``Roster.ahead``, within the run's overlap).
    ahead: int = 0

    type: ClassVar[str] = "step_hashes"
    _checks: ClassVar[dict[str, Checker]] = {
        "step": _step,
        "sender": _peer,
        "weight_hash": _hex,
        "probe_hash": _hex,
        "roster_hash": _hex,
        "speed": _float(0.0, MAX_SPEED),
        "digests": _digests,
        "ahead": _int(0, rules.MAX_SYNC_EVERY),
    }


NO_ROSTER = "00"


def roster_digest(members: tuple[str, ...] | list[str] | None,
                  shares: tuple[int, ...] = (), owners: tuple[str, ...] = ()) -> str:
    """Short hex digest of an ordered roster, its shares and its parts' owners
    (``NO_ROSTER`` for None); without shares and owners, of the members alone."""
    if members is None:
        return NO_ROSTER
    h = hashlib.blake2b(digest_size=8)
    for m in members:
        h.update(_counted(m))
    if shares:
        h.update(b"\x00shares" + struct.pack(f"<{len(shares)}Q", *shares))
    if owners:
        h.update(b"\x00owners" + b"".join(_counted(o) for o in owners))
    return h.hexdigest()


def cut_digest(members: tuple[str, ...], shares: tuple[int, ...], parts: int) -> str:
    """What a mean of the owner exchange was reduced over: the roster's members and
    shares, cut into ``parts`` parts."""
    h = hashlib.blake2b(digest_size=8)
    h.update(roster_digest(members, shares).encode() + struct.pack("<Q", parts))
    return h.hexdigest()


def _counted(name: str) -> bytes:
    """``name`` length-prefixed: a list of them has one reading."""
    b = name.encode("utf-8")
    return struct.pack("<I", len(b)) + b


@dataclass(frozen=True)
class OwnedPart(_Msg):
    """``sender``'s bytes of part ``part`` of its contribution to step ``step``, sent to
    the member that reduces that part (the owner exchange, ``protocol.owners``): a slice
    of the whole payload, itself the codec's payload of the part's values."""

    step: int
    sender: str
    part: int
    parts: int  # of the cut the part is of: the step's first roster's size
    payload: bytes

    type: ClassVar[str] = "owned_part"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "sender": _peer,
                                             "part": _int(0, MAX_MEMBERS - 1),
                                             "parts": _int(1, MAX_MEMBERS),
                                             "payload": _bytes(MAX_PAYLOAD)}

    def _check_cross(self) -> None:
        if self.part >= self.parts:
            raise _fail(self.type, "part", f"part {self.part} of {self.parts}")


@dataclass(frozen=True)
class MeanPart(_Msg):
    """The mean of part ``part`` of step ``step`` as ``owner`` reduced it over the roster
    whose :func:`cut_digest` (members, shares, parts) is ``roster_hash``: the codec's bytes
    that every member, the owner included, decodes and applies. Sent by the owner, or
    relayed by the leader (a repair): the only relay accepted."""

    step: int
    owner: str
    part: int
    roster_hash: str
    # the squared norm of each member's part as the owner decoded it, in roster order:
    # what bounds the mean (``owner_exchange``)
    norms: tuple[float, ...]
    payload: bytes

    type: ClassVar[str] = "mean_part"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "owner": _peer,
                                             "part": _int(0, MAX_MEMBERS - 1),
                                             "roster_hash": _hex, "norms": _norms,
                                             "payload": _bytes(MAX_PAYLOAD)}


@dataclass(frozen=True)
class PartRequest(_Msg):
    """The owner of part ``part`` lacks ``sender``'s bytes of it: sent to the sender
    (which resends them) and to the leader (which amends a sender that is gone)."""

    step: int
    part: int
    sender: str

    type: ClassVar[str] = "part_request"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "part": _int(0, MAX_MEMBERS - 1),
                                             "sender": _peer}


@dataclass(frozen=True)
class MeanRequest(_Msg):
    """The sender lacks the mean of part ``part`` of step ``step``: the leader relays it,
    or hands the part of an owner that is gone to its successor."""

    step: int
    part: int

    type: ClassVar[str] = "mean_request"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "part": _int(0, MAX_MEMBERS - 1)}


@dataclass(frozen=True)
class RepairRequest(_Msg):
    step: int
    sender_of_missing: str

    type: ClassVar[str] = "repair_request"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "sender_of_missing": _peer}


@dataclass(frozen=True)
class Heartbeat(_Msg):
    """Liveness on a link, once a second. ``echo`` 0 is a beat, which the receiver
    answers at once with ``echo`` = the beat's ``t``; the beat's sender then has the
    link's round-trip time on its own clock (``net.link.Link.rtt``)."""

    t: float
    echo: float = 0.0

    type: ClassVar[str] = "heartbeat"
    _checks: ClassVar[dict[str, Checker]] = {"t": _float(0.0, 1e12), "echo": _float(0.0, 1e12)}


@dataclass(frozen=True)
class Halt(_Msg):
    step: int
    reason: str

    type: ClassVar[str] = "halt"
    _checks: ClassVar[dict[str, Checker]] = {"step": _step, "reason": _str(MAX_TEXT_LEN, 0)}


Message = (
    Hello | Following | Config | SnapshotPlan | PieceRequest | Piece | Roster
    | Contribution | StepHashes | RepairRequest | OwnedPart | MeanPart | PartRequest
    | MeanRequest | Heartbeat | Halt
)

MESSAGE_TYPES: dict[str, type[_Msg]] = {
    cls.type: cls
    for cls in (
        Hello,
        Following,
        Config,
        SnapshotPlan,
        PieceRequest,
        Piece,
        Roster,
        Contribution,
        StepHashes,
        RepairRequest,
        OwnedPart,
        MeanPart,
        PartRequest,
        MeanRequest,
        Heartbeat,
        Halt,
    )
}


def _as_map(msg: Message) -> dict[str, Any]:
    cls = MESSAGE_TYPES.get(getattr(type(msg), "type", None))  # type: ignore[arg-type]
    if cls is None or type(msg) is not cls:
        raise WireError(f"not a wire message: {type(msg).__name__}")
    d: dict[str, Any] = {"type": cls.type}
    for f in fields(msg):
        v = getattr(msg, f.name)
        d[f.name] = list(v) if isinstance(v, tuple) else v
    return d


def encode(msg: Message) -> bytes:
    """Message -> msgpack bytes (a map with ``type`` plus every field)."""
    return msgpack.packb(_as_map(msg), use_bin_type=True)


_BIG_FIELD = 1 << 16  # a trailing bytes field from this size on is sent from its own buffer


Part = bytes | memoryview


def encode_parts(msg: Message) -> tuple[Part, ...]:
    """``encode(msg)`` as parts whose concatenation is exactly those bytes: a big bytes
    field at the end (a contribution's payload) is a part of its own, a view of the
    message's buffer, so sending it never copies the whole message once more."""
    d = _as_map(msg)
    last = next(reversed(d))  # msgpack packs a map in this order: the last field last
    big = d[last]
    if not isinstance(big, bytes) or len(big) < _BIG_FIELD:
        return (msgpack.packb(d, use_bin_type=True),)
    d[last] = b""
    head = msgpack.packb(d, use_bin_type=True)  # ends in a bin8 of length 0
    if not head.endswith(b"\xc4\x00"):  # another layout: the plain way
        d[last] = bytes(big)
        return (msgpack.packb(d, use_bin_type=True),)
    n = len(big)
    # msgpack's own choice of bin header: the shortest that holds n
    size = (b"\xc4" + struct.pack(">B", n) if n < 1 << 8 else
            b"\xc5" + struct.pack(">H", n) if n < 1 << 16 else b"\xc6" + struct.pack(">I", n))
    return head[:-2] + size, memoryview(big)


def decode(data: bytes, max_len: int = MAX_MESSAGE) -> Message:
    """Bytes -> Message, refusing anything not exactly a valid message."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_len:
        raise WireError(f"message too long ({len(data)} > {max_len} bytes)")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            # Bound container sizes so garbage cannot request huge allocations.
            max_array_len=MAX_MEMBERS,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types on garbage; all mean "not msgpack"
        raise WireError(f"not a msgpack message: {type(e).__name__}: {e}") from None
    if type(obj) is not dict:
        raise WireError(f"message must be a msgpack map, got {type(obj).__name__}")
    t = obj.get("type")
    if type(t) is not str:
        raise WireError("message has no string 'type' field")
    cls = MESSAGE_TYPES.get(t)
    if cls is None:
        raise WireError(f"unknown message type {t[:40]!r}")
    return _from_fields(cls, {k: v for k, v in obj.items() if k != "type"})  # type: ignore


def _from_fields(cls: type[_Msg], obj: dict[str, Any]) -> _Msg:
    """Build ``cls`` from a field dict, refusing missing and extra keys."""
    t = cls.type
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    keys = set(obj)
    missing = [n for n in names if n not in keys]
    if missing:
        raise WireError(f"{t}: missing field(s) {', '.join(missing)}")
    extra = sorted(str(k)[:40] for k in keys - set(names))
    if extra:
        raise WireError(f"{t}: unexpected field(s) {', '.join(extra)}")
    return cls(**{n: obj[n] for n in names})
