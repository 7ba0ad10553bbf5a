"""aiohttp signaling server: groups, private rooms, relay, liveness."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from . import protocol
from .corpus import builtin_slice

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
_order = itertools.count()


def group_id_for(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


@dataclass
class Peer:
    id: str
    name: str
    ws: web.WebSocketResponse
    order: int = field(default_factory=lambda: next(_order))
    approved: bool = False
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
    # Private rooms: the secret of the dashboard link, valid only for the peer in key_holder.
    host_key: str | None = None
    key_holder: str | None = None

    def roster(self) -> list[dict[str, str]]:
        return [{"id": p.id, "name": p.name} for p in self.members.values()]

    def record(self, peer_id: str, report: dict[str, Any]) -> None:
        self.reports[peer_id] = report
        hist = self.history.get(peer_id)
        if hist is None:
            hist = self.history[peer_id] = deque(maxlen=HISTORY_POINTS)
        hist.append((report["step"], report["loss"]))

    def forget(self, peer_id: str) -> None:
        self.reports.pop(peer_id, None)
        self.history.pop(peer_id, None)


class Registry:
    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.peers: dict[str, tuple[Peer, Group]] = {}

    def new_id(self) -> str:
        while True:
            pid = secrets.token_hex(4)
            if pid not in self.peers:
                return pid

    def join(self, key: str, private: bool, peer: Peer) -> Group:
        gid = group_id_for(key)
        group = self.groups.get(gid)
        if group is None:
            group = self.groups[gid] = Group(gid, private)
        if not private or not group.members:
            peer.approved = True
            group.members[peer.id] = peer
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
        if not group.members:
            group.status = None  # a later host (see promote_waiting) must not see old runs
        if not group.members and not group.waiting:
            self.groups.pop(group.id, None)
        return group



# Typed application keys (aiohttp warns on plain string keys).
REGISTRY: web.AppKey[Registry] = web.AppKey("registry", Registry)
TRUST_PROXY = web.AppKey("trust_proxy", bool)
HEARTBEAT = web.AppKey("heartbeat", object)  # float seconds or None
RATE = web.AppKey("rate", tuple)
DATA_SOURCE = web.AppKey("data_source", str)
DATA_OPTIONS = web.AppKey("data_options", dict)
FINEWEB = web.AppKey("fineweb", object)  # FineWebReader or None

async def promote_waiting(group: Group) -> None:
    """A private room whose last member left, with peers still waiting: the longest-waiting
    peer becomes an approved member and host, as if it had been first into a new room.

    Otherwise the waiting peers would be stranded: nobody is left who could approve them.
    The room is empty, so the new host learns nothing it could not by opening a new room.
    """
    if group.members or not group.waiting:
        return
    first = min(group.waiting.values(), key=lambda p: p.order)
    del group.waiting[first.id]
    first.approved = True
    group.members[first.id] = first
    group.host = first.id
    await _send(first, {"type": "approved"})


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
    host = group.members.get(group.host) if group.host else None
    if host is not None and group.host_key is not None:
        await _send(host, {"type": "host_key", "key": group.host_key})


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
        first = fwd.split(",")[0].strip()
        if first:
            return first
    return request.remote or "unknown"


async def ws_handler(request: web.Request) -> web.StreamResponse:
    app = request.app
    reg: Registry = app[REGISTRY]
    room = request.query.get("room")
    if room is not None and not protocol.valid_room(room):
        raise web.HTTPBadRequest(text="room code must be 4-64 letters, digits, - or _")
    name = request.query.get("name", "")[:64] or "peer"
    ws = web.WebSocketResponse(
        heartbeat=app[HEARTBEAT], max_msg_size=protocol.MAX_MESSAGE_BYTES * 2
    )
    await ws.prepare(request)
    key = "room:" + room if room else "addr:" + client_address(request, app[TRUST_PROXY])
    rate, burst = app[RATE]
    peer = Peer(reg.new_id(), name, ws, tokens=burst, rate=rate, burst=burst)
    group = reg.join(key, room is not None, peer)
    await _send(
        peer,
        {
            "type": "welcome",
            "id": peer.id,
            "group": group.id,
            "host": group.host,
            "state": "member" if peer.approved else "waiting",
        },
    )
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
        if left is not None and left.id in reg.groups:
            await promote_waiting(left)
            await broadcast(left)
    return ws


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
            other.approved = True
            group.members[other.id] = other
            await _send(other, {"type": "approved"})
        else:
            reg.peers.pop(other.id, None)
            await _send(other, {"type": "denied"})
            await other.ws.close(code=1008, message=b"denied")
        await broadcast(group)
    elif kind == "status":
        group.status = {k: msg[k] for k in ("step", "loss", "hash", "peers")} | {"from": peer.id}
        report = {k: v for k, v in msg.items() if k != "type"} | {"t": time.time()}
        group.record(peer.id, report)


async def healthz(request: web.Request) -> web.Response:
    reg: Registry = request.app[REGISTRY]
    return web.json_response({"ok": True, "groups": len(reg.groups), "peers": len(reg.peers)})


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
    host_view = key_ok(group, request.query.get("key"))
    if group.private and not host_view and request.query.get("peer") not in group.members:
        raise web.HTTPNotFound(text="no such group")
    return _no_store(web.json_response(_group_info(group, host_view)))


def _room(request: web.Request) -> Group | None:
    code = request.match_info["code"]
    if not protocol.valid_room(code):
        return None
    group = request.app[REGISTRY].groups.get(group_id_for("room:" + code))
    return group if group is not None and group.private else None


async def room_detail(request: web.Request) -> web.Response:
    """A private room by code, for its host-key holder or one of its members (else 404).

    Knowing the code is not enough: anyone may knock with it, only members may look.
    """
    group = _room(request)
    if group is None:
        raise web.HTTPNotFound(text="no such room")
    host_view = key_ok(group, request.query.get("key"))
    if not host_view and request.query.get("peer") not in group.members:
        raise web.HTTPNotFound(text="no such room")
    return _no_store(web.json_response(_group_info(group, host_view)))


async def decide(request: web.Request) -> web.Response:
    """POST {key, id, approve}: forward the host's dashboard decision to the host peer.

    The server does not admit anyone itself; the host peer receives a `decision` message
    and acts with its own approve/deny, so the host stays the only one who admits peers.
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
    if not isinstance(pid, str) or not protocol.ID_RE.match(pid) or not isinstance(approve, bool):
        raise web.HTTPBadRequest(text="id must be a peer id and approve a boolean")
    if pid not in group.waiting:
        raise web.HTTPNotFound(text="no such waiting peer")
    host = group.members.get(group.host or "")
    if host is None or host.ws.closed:
        raise web.HTTPServiceUnavailable(text="the host is not connected")
    await _send(host, {"type": "decision", "id": pid, "approve": approve})
    return _no_store(web.json_response({"ok": True, "forwarded": True}))


async def data_slice(app: web.Application) -> tuple[str, str]:
    """(text, source) for /data: a FineWeb-Edu slice, else the built-in corpus."""
    reader = app.get(FINEWEB)
    if reader is not None:
        piece = await reader.next_slice()
        if piece is not None:
            return piece.text, "fineweb"
    return builtin_slice(), "builtin"


async def data(request: web.Request) -> web.Response:
    text, source = await data_slice(request.app)
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
    rate_per_s: float = RATE_PER_S,
    rate_burst: float = RATE_BURST,
    **kw: Any,
) -> web.Application:
    """``heartbeat``: ping interval in seconds (None: no pings); ``rate_per_s``/``rate_burst``:
    each connection's message token bucket. ``data_source="fineweb"``: /data reads
    FineWeb-Edu from ``hf_endpoint`` (default the Hub's), falling back to the built-in
    corpus; ``fineweb`` injects a ready reader (tests).
    """
    if data_source not in ("fineweb", "builtin"):
        raise ValueError(f"data_source must be 'fineweb' or 'builtin', not {data_source!r}")
    if not (rate_per_s > 0 and rate_burst >= 1):
        raise ValueError("rate_per_s must be > 0 and rate_burst >= 1")
    app = web.Application()
    app[REGISTRY] = Registry()
    app[TRUST_PROXY] = trust_proxy
    app[HEARTBEAT] = heartbeat
    app[RATE] = (float(rate_per_s), float(rate_burst))
    app[DATA_SOURCE] = data_source
    app[DATA_OPTIONS] = kw
    if data_source == "fineweb" and fineweb is None:
        from .fineweb import FineWebReader  # pyarrow/fsspec only when FineWeb is wanted

        fineweb = FineWebReader(hf_endpoint)
    app[FINEWEB] = fineweb if data_source == "fineweb" else None
    app.on_cleanup.append(_close_fineweb)
    app.router.add_get("/ws", ws_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/groups", list_groups)
    app.router.add_get("/api/groups/{gid}", group_detail)
    app.router.add_get("/api/rooms/{code}", room_detail)
    app.router.add_post("/api/rooms/{code}/decide", decide)
    app.router.add_get("/data", data)
    app.router.add_get("/", index)
    if STATIC_DIR.is_dir():
        app.router.add_static("/static/", STATIC_DIR)
    app.on_shutdown.append(_close_all)
    return app
