"""What one peer is asked to do: :class:`PeerOptions` from the command line, the one-line
failure :class:`PeerError`, the ``/data`` URL and the peer's stderr log line."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from daisyweb.net.ice import IceServer
from daisyweb.text import clean

__all__ = ["PeerError", "PeerOptions", "data_url", "log", "options_from_args",
           "mesh_transport_options"]


class PeerError(Exception):
    """A clear one-line failure with the process exit code to use."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class PeerOptions:
    server: str
    room: str | None = None
    name: str | None = None
    approve: str = "ask"
    start: bool = False
    model: dict[str, int] | None = None  # width/layers/heads/seq given on the command line
    batch: int | None = None
    steps: int | None = None
    lr: float | None = None
    seed: int | None = None
    sync_every: int | None = None
    sync_max: int | None = None
    task: str | None = None  # leader: module:Name (daisyweb.tasks); None: the built-in GPT
    task_config: dict[str, int | float] | None = None  # leader: the task's settings
    codec: str | None = None
    outer_lr: float | None = None
    overlap: int | None = None
    compute: str | None = None  # leader: "int8" or "float" forward GEMMs
    capacity: bool = True  # leader: capacity-weighted batches (shares by measured speed)
    exchange: str = "auto"  # as leader: all | owner | auto (protocol.owner_exchange)
    resume: str | None = None
    save: str | None = None
    save_every: int = 0
    eval_every: int = 0  # held-out loss every K optimizer steps (at the next boundary)
    metrics: str | None = None
    join_timeout: float = 60.0
    stun: list[str] = field(default_factory=list)
    ice_hosts: list[str] = field(default_factory=list)
    turn: list[str] = field(default_factory=list)  # turn:HOST:PORT URLs
    turn_user: str | None = None
    turn_credential: str | None = None
    relay: bool = False  # relayed candidates only (iceTransportPolicy "relay")
    transport: str = "auto"  # auto | aiortc | libwebrtc; run_peer resolves "auto"
    wait_peers: int = 1
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    repair_after: float = 2.0
    progress: bool = True


def options_from_args(args: argparse.Namespace) -> PeerOptions:
    model = None
    if args.start:
        model = {k: getattr(args, k) for k in ("width", "layers", "heads", "seq")
                 if getattr(args, k) is not None}
    return PeerOptions(
        server=args.server, room=args.room, name=args.name, approve=args.approve,
        start=args.start, model=model, batch=args.batch, steps=args.steps, lr=args.lr,
        seed=args.seed, sync_every=args.sync_every, sync_max=args.sync_max, codec=args.codec,
        outer_lr=args.outer_lr, task=args.task,
        task_config=dict(args.task_set) if args.task_set else None,
        overlap=args.overlap, compute=args.compute, capacity=args.capacity != "off",
        exchange=args.exchange,
        resume=args.resume, save=args.save, save_every=args.save_every,
        eval_every=args.eval_every,
        metrics=args.metrics, join_timeout=args.join_timeout, stun=list(args.stun),
        ice_hosts=list(args.ice_host), wait_peers=args.wait_peers,
        turn=list(args.turn), turn_user=args.turn_user, turn_credential=args.turn_credential,
        relay=args.relay, transport=args.transport,
    )


def data_url(server: str) -> str:
    """The server's ``/data`` URL (http or https) from the signaling URL the user gave."""
    u = urlsplit(server)
    scheme = {"ws": "http", "wss": "https"}.get(u.scheme, u.scheme)
    return urlunsplit((scheme, u.netloc, "/data", "", ""))


def log(msg: str) -> None:
    """One line on stderr, prefixed like every line the peer prints; whatever in it came
    from outside (a peer's halt reason, an id) cannot reach the terminal raw."""
    print(f"daisyweb-peer: {clean(msg)}", file=sys.stderr, flush=True)


def mesh_transport_options(opts: PeerOptions) -> dict[str, object]:
    """The Mesh keywords for the WebRTC implementation and TURN."""
    turn = [IceServer(u, opts.turn_user, opts.turn_credential) for u in opts.turn]
    return {"transport": opts.transport, "turn": turn, "relay_only": opts.relay}
