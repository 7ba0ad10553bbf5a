"""aiohttp signaling server: groups, private rooms, relay, liveness.

A private room's policy outlives its host. Its approval mode is the first host's
(``policy`` message, ``daisyweb-peer --approve``): the server keeps it in
:attr:`Group.approve` and tells every later host, whose client applies it instead of its
own flag, so a handover neither loosens (``ask`` -> ``auto``) nor tightens the room. Who
the room already approved is its member set, which the server holds: members stay
admitted across a handover and the new host is never asked about them.

There is no allow-list of approved peer ids for peers that come back. Ids are drawn by
the server per connection (:meth:`Registry.new_id`, random, never chosen by a client), so
a peer whose socket closed rejoins under a new id that nobody approved: an id-based
allow-list could never match it, and a list keyed by anything a client states (its name)
would let anyone with the code claim someone else's approval. A returning peer therefore
knocks like any other: in an ``auto`` room it is admitted at once, in an ``ask`` room its
host is asked again.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import json
import logging
import re
import secrets
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus

from aiohttp import WSMsgType, web
from aiohttp.web_log import AccessLogger

from . import protocol
from .corpus import builtin_slice
from .guard import (
    GUARD,
    IDLE_TIMEOUT,
    MAX_CONNECTIONS_PER_ADDRESS,
    WRITE_TIMEOUT,
    ConnectionGuard,
    LogLimiter,
    connection_limit,
    write_deadline,
)

log = logging.getLogger("daisyweb.signal")


def find_static_dir(here: Path | None = None) -> Path:
    """The dashboard's files: ``signaling/static`` when packaged, else the repo's ``static/``.

    An editable install (and a source checkout) runs from the tree, where the page lives
    in the top-level ``static/``; a wheel can only carry files inside a package.
    """
    here = here or Path(__file__).resolve().parent
    for cand in (here / "static", here.parent / "static"):
        if (cand / "index.html").is_file():
            return cand
    return here.parent / "static"


STATIC_DIR = find_static_dir()
# Dashboard history: the last HISTORY_POINTS (step, loss) points per reporting peer.
HISTORY_POINTS = 500
RATE_PER_S = 50.0
RATE_BURST = 100.0
# Concurrent WebSocket connections from one address (daisyweb-signal --max-per-address).
MAX_PER_ADDRESS = 32
# Report fields a peer sends only now and then (held-out loss at --eval-every boundaries,
# the round fields not in the final report): a later report without them keeps the last.
STICKY_FIELDS = ("mode", "round", "round_steps", "exchange_steps", "comm_share",
                 "heldout_loss", "heldout_step", "transport")
# The pool fields a final report may leave out: kept like the above. Links are
# not: a report without them means no link is up.
POOL_STICKY_FIELDS = ("machine", "cpu", "cores", "ram_mb", "backend", "share",
                      "peer_tokens_per_s", "eta_s", "total_steps")
# The held-out loss curve: the last HELDOUT_POINTS (step, held-out loss) per peer.
HELDOUT_POINTS = 500
_order = itertools.count()
# WebSocket close codes with their reasons (a reason is at most 123 bytes).
CLOSE_POLICY = 1008


def keyed_group_id(secret: bytes, key: str) -> str:
    """The public id of a group: a hash keyed with the server's secret, so an id cannot
    be traced back to the address (or room code) it stands for by trying candidates."""
    return hashlib.blake2b(key.encode(), digest_size=6, key=secret).hexdigest()


@dataclass
class Peer:
    id: str
    name: str
    ws: web.WebSocketResponse
    address: str = ""
    order: int = field(default_factory=lambda: next(_order))
    approved: bool = False
    # Members only: the secret that shows its room on the dashboard (?member=KEY).
    member_key: str | None = None
    errors: int = 0
    tokens: float = RATE_BURST
    stamp: float = field(default_factory=time.monotonic)
    rate: float = RATE_PER_S  # token bucket: refill per second and capacity
    burst: float = RATE_BURST

    def take_token(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass
class Group:
    id: str
    private: bool
    members: dict[str, Peer] = field(default_factory=dict)
    waiting: dict[str, Peer] = field(default_factory=dict)
    host: str | None = None
    status: dict[str, Any] | None = None
    # Dashboard state, per current member: latest status report and a bounded loss history.
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    heldout: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    # Private rooms: the secret of the dashboard link, valid only for the peer in key_holder.
    host_key: str | None = None
    key_holder: str | None = None
    # Private rooms: the approval mode ("ask"/"auto") its first host set; every later host
    # is told it and applies it, whatever its own --approve says.
    approve: str | None = None
    # Private rooms: waiting peers whose dashboard decision went to the current host; a
    # second one (a replay, a second click) is refused, not forwarded.
    decided: set[str] = field(default_factory=set)

    def roster(self) -> list[dict[str, str]]:
        return [{"id": p.id, "name": p.name} for p in self.members.values()]

    def record(self, peer_id: str, report: dict[str, Any]) -> None:
        if "heldout_loss" in report:  # a peer resends its last one: it says its step
            report.setdefault("heldout_step", report["step"])
        previous = self.reports.get(peer_id, {})
        for name in (*STICKY_FIELDS, *POOL_STICKY_FIELDS):
            if name not in report and name in previous:
                report[name] = previous[name]
        self.reports[peer_id] = report
        hist = self.history.get(peer_id)
        if hist is None:
            hist = self.history[peer_id] = deque(maxlen=HISTORY_POINTS)
        hist.append((report["step"], report["loss"]))
        self._record_heldout(peer_id, report)

    def _record_heldout(self, peer_id: str, report: dict[str, Any]) -> None:
        """A held-out loss is resent with every report: one point per evaluated step."""
        if "heldout_loss" not in report:
            return
        points = self.heldout.setdefault(peer_id, deque(maxlen=HELDOUT_POINTS))
        point = (report["heldout_step"], report["heldout_loss"])
        if not points or points[-1][0] != point[0]:
            points.append(point)

    def forget(self, peer_id: str) -> None:
        self.reports.pop(peer_id, None)
        self.history.pop(peer_id, None)
        self.heldout.pop(peer_id, None)

    def admit(self, peer: Peer) -> None:
        """``peer`` becomes a member, with a fresh secret for its dashboard view."""
        self.waiting.pop(peer.id, None)
        peer.approved = True
        peer.member_key = secrets.token_urlsafe(24)
        self.members[peer.id] = peer

    def member_key_ok(self, key: object) -> bool:
        """True for the dashboard secret of a current member (constant time per member)."""
        if not isinstance(key, str) or not key:
            return False
        given = key.encode()
        return any(secrets.compare_digest(given, p.member_key.encode())
                   for p in self.members.values() if p.member_key is not None)


class Registry:
    def __init__(self, max_per_address: int = MAX_PER_ADDRESS) -> None:
        self.groups: dict[str, Group] = {}
        self.peers: dict[str, tuple[Peer, Group]] = {}
        self.secret = secrets.token_bytes(32)  # keys group ids; new at every start
        self.max_per_address = max_per_address
        self.connections: Counter[str] = Counter()  # open WebSockets per address
        self.capped: set[str] = set()  # addresses over the cap, logged once until under

    def group_id(self, key: str) -> str:
        return keyed_group_id(self.secret, key)

    def room(self, code: str) -> Group | None:
        group = self.groups.get(self.group_id("room:" + code))
        return group if group is not None and group.private else None

    def new_id(self) -> str:
        while True:
            pid = secrets.token_hex(4)
            if pid not in self.peers:
                return pid

    def connect(self, address: str) -> bool:
        """Count a new connection from ``address``; False (not counted) when over the cap."""
        if self.connections[address] >= self.max_per_address:
            return False
        self.connections[address] += 1
        return True

    def disconnect(self, address: str) -> None:
        self.connections[address] -= 1
        if self.connections[address] <= 0:
            del self.connections[address]
        if self.connections[address] < self.max_per_address:
            self.capped.discard(address)

    def join(self, key: str, private: bool, peer: Peer) -> Group:
        gid = self.group_id(key)
        group = self.groups.get(gid)
        if group is None:
            group = self.groups[gid] = Group(gid, private)
        if not private or not group.members:
            group.admit(peer)
            if private and group.host is None:
                group.host = peer.id
        else:
            group.waiting[peer.id] = peer
        self.peers[peer.id] = (peer, group)
        return group

    def leave(self, peer: Peer) -> Group | None:
        entry = self.peers.pop(peer.id, None)
        if entry is None:
            return None
        group = entry[1]
        group.members.pop(peer.id, None)
        group.waiting.pop(peer.id, None)
        group.forget(peer.id)
        if group.host == peer.id:
            nxt = min(group.members.values(), key=lambda p: p.order, default=None)
            group.host = nxt.id if nxt else None
        if not group.members and not group.waiting:
            self.groups.pop(group.id, None)
        return group

    def close_unattended(self, group: Group) -> list[Peer]:
        """A private room whose admitted members have all left closes: nobody is left who
        may admit anyone, and a waiting peer must never inherit the room (and its code).
        Returns the waiting peers, now out of the registry, for the caller to close."""
        if not group.private or group.members or not group.waiting:
            return []
        stranded = list(group.waiting.values())
        group.waiting.clear()
        for p in stranded:
            self.peers.pop(p.id, None)
        self.groups.pop(group.id, None)
        return stranded


# Typed application keys (aiohttp warns on plain string keys).
REGISTRY: web.AppKey[Registry] = web.AppKey("registry", Registry)
TRUST_PROXY = web.AppKey("trust_proxy", bool)
HEARTBEAT = web.AppKey("heartbeat", object)  # float seconds or None
RATE = web.AppKey("rate", tuple)
DATA_SOURCE = web.AppKey("data_source", str)
DATA_OPTIONS = web.AppKey("data_options", dict)
FINEWEB = web.AppKey("fineweb", object)  # FineWebReader or None
DATA_LAST = web.AppKey("data_last", list)  # [source of the newest /data slice or None]

ROOM_CLOSED = "every admitted member of this room has left; the room is closed"
TOO_MANY = "too many connections from your address"


async def _refuse(ws: web.WebSocketResponse, code: str, reason: str) -> None:
    """Tell a client why it is dropped (an error message, then the close reason)."""
    if ws.closed:
        return
    try:
        await ws.send_str(json.dumps(protocol.error(code, reason)))
    except (ConnectionError, RuntimeError):
        pass
    await ws.close(code=CLOSE_POLICY, message=reason.encode())


async def _send(peer: Peer, msg: dict[str, Any]) -> None:
    if peer.ws.closed:
        return
    try:
        await peer.ws.send_str(json.dumps(msg))
    except (ConnectionError, RuntimeError):
        pass


async def sync_host_key(group: Group) -> None:
    """Give a private room's host a fresh dashboard secret whenever hosting changes hands.

    Called from broadcast(), which runs after every membership change, so the key can
    never outlive the host it was issued to.
    """
    if not group.private or group.host == group.key_holder:
        return
    group.key_holder = group.host
    group.host_key = secrets.token_urlsafe(24) if group.host else None
    group.decided.clear()  # a new host has decided nothing: it may be asked again
    host = group.members.get(group.host) if group.host else None
    if host is None or group.host_key is None:
        return
    # The room's mode goes first: the new host knows how to admit before it hears that it
    # hosts (host_key, peers) and before the waiting list that broadcast() sends next.
    if group.approve is not None:
        await _send(host, {"type": "policy", "approve": group.approve})
    await _send(host, {"type": "host_key", "key": group.host_key})


# Query parameters that carry a dashboard secret: the host key and a member's key.
SECRET_PARAMS = frozenset({"key", "member"})
_QUERY_PARAM = re.compile(r"([?&;])([^=&;\s\"#]+)=([^&;\s\"#]*)")


def mask_secrets(text: str) -> str:
    """``text`` with the value of every ``key=``/``member=`` query parameter hidden,
    however its name is spelled (``k%65y=`` reaches the server as ``key``)."""
    def hide(m: re.Match[str]) -> str:
        if unquote_plus(m.group(2)).lower() in SECRET_PARAMS:
            return f"{m.group(1)}{m.group(2)}=<hidden>"
        return m.group(0)

    return _QUERY_PARAM.sub(hide, text)


class MaskedAccessLogger(AccessLogger):
    """aiohttp's access log without the dashboard secrets: the page polls
    ``/api/rooms/CODE?key=SECRET``, and a log is read by more people than the host."""

    def _format_line(self, request: Any, response: Any, time: float) -> Any:
        return [(k, mask_secrets(v) if isinstance(v, str) else v)
                for k, v in super()._format_line(request, response, time)]


def key_ok(group: Group, key: object) -> bool:
    if not isinstance(key, str) or group.host_key is None or group.host != group.key_holder:
        return False
    # bytes: compare_digest refuses non-ASCII str; constant time against guessing
    return secrets.compare_digest(key.encode(), group.host_key.encode())


async def broadcast(group: Group) -> None:
    await sync_host_key(group)
    msg = {"type": "peers", "peers": group.roster(), "host": group.host}
    for p in list(group.members.values()):
        await _send(p, msg)
    if group.host and group.host in group.members:
        await _send(
            group.members[group.host],
            {
                "type": "waiting",
                "peers": [{"id": p.id, "name": p.name} for p in group.waiting.values()],
            },
        )


def client_address(request: web.Request, trust_proxy: bool) -> str:
    if trust_proxy:
        fwd = request.headers.get("X-Forwarded-For", "")
        # a header is anyone's to write: bounded and cleaned before it is counted or logged
        first = protocol.clean_text(fwd.split(",")[0], 64)
        if first:
            return first
    return request.remote or "unknown"


def welcome(peer: Peer, group: Group) -> dict[str, Any]:
    """The first message. A waiting peer learns its own id and that it waits, nothing
    about the room: no group id, no host id (an id once opened the room's dashboard)."""
    if not peer.approved:
        return {"type": "welcome", "id": peer.id, "group": None, "host": None,
                "state": "waiting"}
    return {"type": "welcome", "id": peer.id, "group": group.id, "host": group.host,
            "state": "member", "member_key": peer.member_key}


async def ws_handler(request: web.Request) -> web.StreamResponse:
    app = request.app
    reg: Registry = app[REGISTRY]
    room = request.query.get("room")
    if room is not None and not protocol.valid_room(room):
        raise web.HTTPBadRequest(text=f"room code must be {protocol.ROOM_RULE}")
    name = protocol.clean_name(request.query.get("name"))
    address = client_address(request, app[TRUST_PROXY])
    ws = web.WebSocketResponse(
        heartbeat=app[HEARTBEAT], max_msg_size=protocol.MAX_MESSAGE_BYTES * 2
    )
    await ws.prepare(request)
    if not reg.connect(address):
        if address not in reg.capped:  # once per flood, not once per connection
            reg.capped.add(address)
            log.warning("refusing connections from %s: over %d at once",
                        address, reg.max_per_address)
        await _refuse(ws, "too_many_connections",
                      f"{TOO_MANY} (at most {reg.max_per_address} at once)")
        return ws
    try:
        await _serve(reg, app, ws, room, name, address)
    finally:
        reg.disconnect(address)
    return ws


async def _serve(reg: Registry, app: web.Application, ws: web.WebSocketResponse,
                 room: str | None, name: str, address: str) -> None:
    key = "room:" + room if room else "addr:" + address
    rate, burst = app[RATE]
    peer = Peer(reg.new_id(), name, ws, address, tokens=burst, rate=rate, burst=burst)
    group = reg.join(key, room is not None, peer)
    log.info("peer %s (%s) joined group %s as %s", peer.id, peer.name, group.id,
             "member" if peer.approved else "waiting")
    await _send(peer, welcome(peer, group))
    await broadcast(group)
    try:
        async for raw in ws:
            if raw.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                break
            if not peer.take_token():
                await _reply_error(peer, "rate_limited", "too many messages")
            else:
                try:
                    msg = protocol.decode(raw.data)
                except protocol.ProtocolError as exc:
                    await _reply_error(peer, exc.code, exc.message)
                else:
                    await handle(reg, peer, group, msg)
            if peer.errors > protocol.MAX_ERRORS:
                await ws.close(code=1008, message=b"too many errors")
                break
    finally:
        left = reg.leave(peer)
        if left is not None:
            log.info("peer %s (%s) left group %s", peer.id, peer.name, left.id)
            stranded = reg.close_unattended(left)
            if stranded:
                log.info("room %s closed: no member left, %d waiting peers sent away",
                         left.id, len(stranded))
            for p in stranded:
                await _refuse(p.ws, "room_closed", ROOM_CLOSED)
            if left.id in reg.groups:
                await broadcast(left)


async def _reply_error(peer: Peer, code: str, message: str) -> None:
    peer.errors += 1
    await _send(peer, protocol.error(code, message))


async def handle(reg: Registry, peer: Peer, group: Group, msg: dict[str, Any]) -> None:
    kind = msg["type"]
    if not peer.approved:
        await _reply_error(peer, "not_approved", "waiting for the host's approval")
        return
    if kind == "signal":
        target = group.members.get(msg["to"])
        if target is None or target is peer:
            await _reply_error(peer, "unknown_peer", "no such peer in your group")
            return
        await _send(
            target, {"type": "signal", "from": peer.id, "kind": msg["kind"], "data": msg["data"]}
        )
    elif kind in ("approve", "deny"):
        if group.host != peer.id:
            await _reply_error(peer, "not_host", "only the host may approve or deny")
            return
        other = group.waiting.pop(msg["id"], None)
        if other is None:
            await _reply_error(peer, "unknown_peer", "no such waiting peer")
            return
        if kind == "approve":
            group.admit(other)
            await _send(other, {"type": "approved", "group": group.id,
                                "member_key": other.member_key})
        else:
            reg.peers.pop(other.id, None)
            await _send(other, {"type": "denied"})
            await other.ws.close(code=1008, message=b"denied")
        await broadcast(group)
    elif kind == "policy":
        if group.host != peer.id:
            await _reply_error(peer, "not_host", "only the host sets the room's policy")
            return
        # The first host's mode is the room's for good; a later host's own flag is no
        # say in it. The answer is always the room's mode, for the host to apply.
        if group.approve is None:
            group.approve = msg["approve"]
            log.info("room %s admits with approve=%s", group.id, group.approve)
        await _send(peer, {"type": "policy", "approve": group.approve})
    elif kind == "status":
        group.status = {k: msg[k] for k in ("step", "loss", "hash", "peers")} | {"from": peer.id}
        report = {k: v for k, v in msg.items() if k != "type"} | {"t": time.time()}
        group.record(peer.id, report)


async def healthz(request: web.Request) -> web.Response:
    reg: Registry = request.app[REGISTRY]
    return web.json_response({"ok": True, "groups": len(reg.groups), "peers": len(reg.peers),
                              "data": data_info(request.app)})


def data_info(app: web.Application) -> dict[str, Any]:
    """What /data serves: the dataset (repo, config, split, column, shard count once
    listed), or only the built-in corpus; ``last`` is where the newest slice came from."""
    reader = app.get(FINEWEB)
    info: dict[str, Any] = {"source": "builtin" if reader is None else "hub",
                            "last": app[DATA_LAST][0]}
    if reader is not None:
        info.update(reader.describe())
    return info


def _may_view(group: Group, request: web.Request) -> tuple[bool, bool]:
    """(may see the group, holds the host key). A private room is shown only to the host
    key and to the dashboard secret of a current member; ids are no credentials."""
    host_view = key_ok(group, request.query.get("key"))
    member_view = group.member_key_ok(request.query.get("member"))
    return (not group.private or host_view or member_view), host_view


def _group_info(group: Group, host_view: bool = False) -> dict[str, Any]:
    """A group for the API; waiting peers' names only for the holder of the host key."""
    info: dict[str, Any] = {
        "id": group.id,
        "private": group.private,
        "members": group.roster(),
        "host": group.host,
        "waiting": len(group.waiting),
        "status": group.status,
        "now": time.time(),
        "reports": {pid: r for pid, r in group.reports.items() if pid in group.members},
        "history": {
            pid: [list(pt) for pt in h] for pid, h in group.history.items() if pid in group.members
        },
        "can_decide": host_view,
        "heldout_history": {
            pid: [list(pt) for pt in h] for pid, h in group.heldout.items() if pid in group.members
        },
    }
    if host_view:
        info["waiting_peers"] = [{"id": p.id, "name": p.name} for p in group.waiting.values()]
    return info


def _no_store(resp: web.Response) -> web.Response:
    resp.headers["Cache-Control"] = "no-store"  # room details and keys never hit a cache
    return resp


async def list_groups(request: web.Request) -> web.Response:
    reg: Registry = request.app[REGISTRY]
    groups = [
        {"id": g.id, "members": len(g.members), "status": g.status}
        for g in reg.groups.values()
        if not g.private
    ]
    return web.json_response({"groups": groups})


async def group_detail(request: web.Request) -> web.Response:
    reg: Registry = request.app[REGISTRY]
    group = reg.groups.get(request.match_info["gid"])
    if group is None:
        raise web.HTTPNotFound(text="no such group")
    allowed, host_view = _may_view(group, request)
    if not allowed:
        raise web.HTTPNotFound(text="no such group")
    return _no_store(web.json_response(_group_info(group, host_view)))


def _room(request: web.Request) -> Group | None:
    code = request.match_info["code"]
    if not protocol.valid_room(code):
        return None
    return request.app[REGISTRY].room(code)


async def room_detail(request: web.Request) -> web.Response:
    """A private room by code, for its host-key holder or a member's key (else 404).

    Knowing the code is not enough: anyone may knock with it, only members may look.
    """
    group = _room(request)
    if group is None:
        raise web.HTTPNotFound(text="no such room")
    allowed, host_view = _may_view(group, request)
    if not allowed:
        raise web.HTTPNotFound(text="no such room")
    return _no_store(web.json_response(_group_info(group, host_view)))


async def decide(request: web.Request) -> web.Response:
    """POST {key, id, approve}: forward the host's dashboard decision to the host peer.

    The server does not admit anyone itself; the host peer receives a `decision` message
    and acts with its own approve/deny, so the host stays the only one who admits peers.
    One decision per waiting peer goes to a host (409 for another): the host acts on the
    first, and a replayed request must not reach it again.
    """
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="body must be a JSON object {key, id, approve}")
    group = _room(request)
    # one answer for no room, no key and a wrong key: nothing to learn by probing
    if group is None or not key_ok(group, body.get("key")):
        raise web.HTTPForbidden(text="a valid host key is required")
    pid, approve = body.get("id"), body.get("approve")
    if not protocol.valid_peer_id(pid) or not isinstance(approve, bool):
        raise web.HTTPBadRequest(text="id must be a peer id and approve a boolean")
    if pid not in group.waiting:
        raise web.HTTPNotFound(text="no such waiting peer")
    group.decided &= group.waiting.keys()  # forget peers that are no longer waiting
    if pid in group.decided:
        raise web.HTTPConflict(text="a decision for this peer was already sent to the host")
    host = group.members.get(group.host or "")
    if host is None or host.ws.closed:
        raise web.HTTPServiceUnavailable(text="the host is not connected")
    group.decided.add(pid)
    await _send(host, {"type": "decision", "id": pid, "approve": approve})
    return _no_store(web.json_response({"ok": True, "forwarded": True}))


async def data_slice(app: web.Application) -> tuple[str, str]:
    """(text, source) for /data: a FineWeb-Edu slice, else the built-in corpus."""
    reader = app.get(FINEWEB)
    if reader is not None:
        piece = await reader.next_slice()
        if piece is not None:
            return piece.text, "hub"
    return builtin_slice(), "builtin"


async def data(request: web.Request) -> web.Response:
    text, source = await data_slice(request.app)
    request.app[DATA_LAST][0] = source
    return web.Response(
        text=text, content_type="text/plain", headers={"X-Daisyweb-Source": source}
    )


async def _close_fineweb(app: web.Application) -> None:
    reader = app.get(FINEWEB)
    if reader is not None:
        await reader.close()


async def index(request: web.Request) -> web.StreamResponse:
    path = STATIC_DIR / "index.html"
    if path.exists():
        # The page may carry a host key in its URL: load nothing from elsewhere, send no
        # referrer, and refuse framing.
        return web.FileResponse(
            path,
            headers={
                "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
                "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-store",
            },
        )
    return web.Response(text="daisyweb signaling server is up\n")


@functools.cache
def _tokenizer_json() -> bytes:
    # daisyweb's tokenizer as kit.js takes it: the dashboard's "try a checkpoint" needs it,
    # and only a checkpoint of this tokenizer is accepted there.
    from daisyweb.data import default_tokenizer
    from daisyweb.kit.tables import tokenizer_spec

    return json.dumps(tokenizer_spec(default_tokenizer()), separators=(",", ":")).encode()


async def tokenizer(request: web.Request) -> web.Response:
    body = await asyncio.to_thread(_tokenizer_json)  # the first call scans Unicode (~0.4 s)
    return web.Response(body=body, content_type="application/json")


async def _close_all(app: web.Application) -> None:
    reg: Registry = app[REGISTRY]
    for peer, _ in list(reg.peers.values()):
        await peer.ws.close(code=1001, message=b"server shutdown")


def create_app(
    trust_proxy: bool = False,
    heartbeat: float | None = 20.0,
    data_source: str = "builtin",
    hf_endpoint: str | None = None,
    fineweb: Any = None,
    dataset: Any = None,
    rate_per_s: float = RATE_PER_S,
    rate_burst: float = RATE_BURST,
    max_per_address: int = MAX_PER_ADDRESS,
    max_connections: int | None = None,
    max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
    write_timeout: float = WRITE_TIMEOUT,
    idle_timeout: float = IDLE_TIMEOUT,
    **kw: Any,
) -> web.Application:
    """``heartbeat``: ping interval in seconds (None: no pings); ``rate_per_s``/``rate_burst``:
    each connection's message token bucket; ``max_per_address``: open WebSockets allowed
    per client address (more are closed at once). ``max_connections`` (default: 3/4 of
    the descriptor limit, ``guard.connection_limit``) and ``max_connections_per_address``:
    TCP connections of any kind the server holds, in all and per address (not per
    address behind a trusted proxy); ``write_timeout``: seconds a client may leave what
    the server sends unread; ``idle_timeout``: seconds a connection may wait without a
    request. The connection caps hold when the app is served by ``guard.Runner`` (the
    CLI's ``guard.run_app``). ``data_source="hub"`` (or its old name
    ``"fineweb"``): /data reads ``dataset`` (a ``hubdata.DatasetSpec``, default FineWeb-Edu)
    from ``hf_endpoint`` (default the Hub's), falling back to the built-in corpus;
    ``fineweb`` injects a ready reader (the CLI's, prepared at start; tests).
    """
    if data_source not in ("hub", "fineweb", "builtin"):
        raise ValueError(f"data_source must be 'hub' or 'builtin', not {data_source!r}")
    data_source = "hub" if data_source == "fineweb" else data_source
    if not (rate_per_s > 0 and rate_burst >= 1):
        raise ValueError("rate_per_s must be > 0 and rate_burst >= 1")
    if isinstance(max_per_address, bool) or not isinstance(max_per_address, int) or (
            max_per_address < 1):
        raise ValueError(f"max_per_address must be an integer >= 1, not {max_per_address!r}")
    if max_connections is None:
        max_connections = connection_limit()
    for name, value in (("max_connections", max_connections),
                        ("max_connections_per_address", max_connections_per_address)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
    if not (write_timeout > 0 and idle_timeout > 0):
        raise ValueError("write_timeout and idle_timeout must be > 0")
    guard = ConnectionGuard(max_connections, max_connections_per_address, write_timeout,
                            per_address=not trust_proxy)
    limiter = LogLimiter()
    app = web.Application(middlewares=[write_deadline(write_timeout)],
                          handler_args={"keepalive_timeout": idle_timeout,
                                        "access_log_class": MaskedAccessLogger})
    app[GUARD] = guard
    app.on_startup.append(guard.start)
    app.on_startup.append(limiter.install)
    app.on_cleanup.append(guard.stop)
    app.on_cleanup.append(limiter.remove)
    app[REGISTRY] = Registry(max_per_address)
    app[TRUST_PROXY] = trust_proxy
    app[HEARTBEAT] = heartbeat
    app[RATE] = (float(rate_per_s), float(rate_burst))
    app[DATA_SOURCE] = data_source
    app[DATA_OPTIONS] = kw
    app[DATA_LAST] = [None]
    if data_source == "hub" and fineweb is None:
        from .fineweb import FineWebReader  # pyarrow/fsspec only when a dataset is wanted
        from .hubdata import DEFAULT_DATASET

        fineweb = FineWebReader(hf_endpoint, dataset=dataset or DEFAULT_DATASET)
    app[FINEWEB] = fineweb if data_source == "hub" else None
    app.on_cleanup.append(_close_fineweb)
    app.router.add_get("/ws", ws_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/groups", list_groups)
    app.router.add_get("/api/groups/{gid}", group_detail)
    app.router.add_get("/api/rooms/{code}", room_detail)
    app.router.add_post("/api/rooms/{code}/decide", decide)
    app.router.add_get("/data", data)
    app.router.add_get("/api/tokenizer", tokenizer)
    app.router.add_get("/", index)
    if STATIC_DIR.is_dir():
        app.router.add_static("/static/", STATIC_DIR)
    app.on_shutdown.append(_close_all)
    return app
