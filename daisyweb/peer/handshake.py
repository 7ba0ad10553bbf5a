"""The start handshake: the leader's starting state and its wait for ``--wait-peers``;
a follower's wait for ``Config`` + ``SnapshotPlan``, its download and their validation.

The leader (``--start``) sends ``Config`` then a ``SnapshotPlan`` of the current
boundary to each peer that connects; a follower validates the config (the wire decoder
and ``RunConfig``), downloads the state in pieces from every holder the plan names at
once, each piece checked as it comes, and checks the whole against the group's hash
(``daisyweb.peer.pieces``) before its state machine starts. Mid-run joins use the same
path at a step boundary.

Version handshake: the first message to every newly connected peer is
``Hello(self, version)``, then ``Following(leader)``: who the sender follows (the leader
names itself, a peer not started yet names nobody). A follower refuses a leader of
another version (one line, exit 1); the leader excludes a follower of another version
(``sync.StepMachine``). A joiner takes the config and snapshot only from the leader a
majority of the group's other members name (:func:`agreed_leader`), never from whoever
sends one first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from daisyweb.checkpoints.checkpoint import (
    CheckpointError,
    TokenizerInfo,
    load_checkpoint,
)
from daisyweb.data import Tokenizer, default_tokenizer
from daisyweb.net import PeerDown, PeerUp, Received
from daisyweb.peer.exchange import make_trainer
from daisyweb.peer.items import Interrupt, Item, MeshItem
from daisyweb.peer.options import PeerError, PeerOptions, log
from daisyweb.peer.pieces import Download, PieceError, PlanStale
from daisyweb.protocol import wire
from daisyweb.tasks import run_fields
from daisyweb.training.config import RunConfig, run_config
from daisyweb.training.state import TrainState

__all__ = ["BUFFER_BEFORE_START", "FollowerStart", "SignalingGone", "agreed_leader",
           "await_snapshot",
           "leader_state", "tokenizer_info", "wait_for_peers"]

BUFFER_BEFORE_START = 512  # messages kept while a follower waits for its snapshot


def tokenizer_info() -> tuple[Tokenizer, TokenizerInfo]:
    tok = default_tokenizer()
    return tok, TokenizerInfo(tok.vocab_size, tok.file_hash)


# What a --resume takes from the checkpoint; a flag that contradicts it is refused.
# The step budget (--steps) and the saving flags stay the user's.
_FROM_CHECKPOINT = ("width", "layers", "heads", "seq", "batch", "lr", "seed", "sync_every",
                    "sync_max", "codec", "outer_lr", "overlap", "compute")


def leader_state(opts: PeerOptions, tokinfo: TokenizerInfo) -> TrainState:
    """The leader's starting TrainState: fresh from flags or resumed from --resume."""
    if opts.resume:
        return _resumed_state(opts, tokinfo)
    m = opts.model or {}
    try:
        task = run_fields(opts.task, opts.task_config)
        run = run_config(tokinfo.vocab_size, **m, batch=opts.batch, steps=opts.steps,
                         lr=opts.lr, seed=opts.seed, data="server",
                         sync_every=opts.sync_every, codec=opts.codec, outer_lr=opts.outer_lr,
                         overlap=opts.overlap, compute=opts.compute, sync_max=opts.sync_max,
                         **task)
        state = TrainState.fresh(run)
    except (TypeError, ValueError) as exc:  # tasks.TaskError is a ValueError
        reason = str(exc).removeprefix("bad run config: ")
        raise PeerError(2, f"bad run config: {reason}") from None
    return state


def _resumed_state(opts: PeerOptions, tokinfo: TokenizerInfo) -> TrainState:
    """The checkpoint decides the model, tokenizer, optimizer state and seed; ``--steps``
    sets the budget, so a finished run trains on."""
    assert opts.resume is not None
    where = f"--resume {opts.resume}"
    if not Path(opts.resume).is_file():
        raise PeerError(2, f"--resume: no such file {opts.resume}")
    try:
        ckpt = load_checkpoint(opts.resume, expect_tokenizer=tokinfo)
        run = RunConfig.from_checkpoint(ckpt)
    except (CheckpointError, ValueError, OSError) as exc:
        raise PeerError(2, f"{where}: {exc}") from None
    given: dict[str, object] = dict(opts.model or {})
    for k in _FROM_CHECKPOINT:
        if k not in given and getattr(opts, k, None) is not None:
            given[k] = getattr(opts, k)
    have = {**ckpt.model.to_dict(), **run.to_dict()}
    conflicts = [f"--{k.replace('_', '-')} {v} (the file has {have[k]})"
                 for k, v in given.items() if k in _FROM_CHECKPOINT and have.get(k) != v]
    if conflicts:
        raise PeerError(2, f"{where}: the checkpoint decides the model, optimizer and "
                           f"seed, and contradicts " + ", ".join(conflicts))
    step = ckpt.step
    if opts.steps is not None:
        if opts.steps <= step:
            raise PeerError(2, f"{where}: --steps {opts.steps} is not beyond the "
                               f"checkpoint's step {step}")
        run = dataclasses.replace(run, steps=opts.steps)
    elif step >= run.steps:
        raise PeerError(2, f"{where}: already at step {step} of {run.steps} "
                           f"(--steps N above {step} trains on)")
    try:
        state = TrainState.from_checkpoint(ckpt, run, copy=False)  # ckpt is dropped
        make_trainer(state)
    except ValueError as exc:
        raise PeerError(2, f"{where}: {exc}") from None
    return state


async def wait_for_peers(queue: asyncio.Queue[Item], on_up: Callable[[str], None],
                         hello_from: set[str], wait_peers: int,
                         join_timeout: float) -> tuple[list[str], list[Item]]:
    """Wait until ``wait_peers`` peers (this one included) are up and said Hello.

    Returns the peers whose links came up and every other item that arrived meanwhile,
    in order, for the driver to handle once its state machine exists.
    """
    deadline = time.monotonic() + join_timeout
    ups: list[str] = []
    held: list[Item] = []
    # A peer counts once its link is up and its Hello arrived (a peer of another
    # version counts too: it is excluded as soon as the machine starts).
    while len(ready := [p for p in ups if p in hello_from]) + 1 < wait_peers:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerError(3, f"only {len(ready) + 1} of {wait_peers} peers "
                               f"joined within {join_timeout:g} s")
        try:
            item = await asyncio.wait_for(queue.get(), left)
        except TimeoutError:
            continue
        if isinstance(item, MeshItem):
            ev = item.event
            if isinstance(ev, PeerUp):
                on_up(ev.peer)
                ups.append(ev.peer)
                # The new link supersedes a drop held from before it: replayed once the
                # machine starts, that drop would mark a connected peer down for good
                # (in a 32-peer start a follower whose first link timed out connecting
                # was never offered its snapshot again).
                held[:] = [h for h in held if not (isinstance(h, MeshItem) and isinstance(
                    h.event, PeerDown) and h.event.peer == ev.peer)]
                continue
            if isinstance(ev, PeerDown) and ev.peer in ups:
                ups.remove(ev.peer)
                hello_from.discard(ev.peer)
            if (isinstance(ev, Received) and isinstance(ev.message, wire.Hello)
                    and ev.message.peer_id == ev.peer):
                hello_from.add(ev.peer)
        held.append(item)
    return ups, held


def agreed_leader(claims: Mapping[str, str], members: Sequence[str],
                  self_id: str) -> str | None:
    """The leader this joiner follows: the one a strict majority of the other members
    name, provided it names itself; None while that is not (yet) so.

    ``claims`` is each peer's last ``Following`` (``""``: not started, or rejoining);
    ``members`` is the signaling server's member list. The majority is of every other
    member but those that said they follow nobody, spoken or not: a peer that reaches
    us first cannot pass itself off as the leader (with the real leader and one
    follower naming it, a third peer naming itself is outvoted, and a tie -- one peer
    against the leader alone -- is never resolved in anyone's favour), and a member
    that cannot speak (paused, or far behind) does not hold a joiner back when the
    others are a majority.
    """
    voters = [m for m in members if m != self_id and claims.get(m) != ""]
    named = Counter(claims[v] for v in voters if claims.get(v))
    if not named:
        return None  # nobody has started yet
    top, votes = named.most_common(1)[0]
    if 2 * votes <= len(voters) or claims.get(top) != top or top not in voters:
        return None
    return top


def _disagreement(claims: Mapping[str, str], members: Sequence[str], self_id: str) -> str:
    said = [f"{m} follows {claims[m] or 'nobody yet'}" for m in members
            if m != self_id and m in claims]
    silent = [m for m in members if m != self_id and m not in claims]
    parts = said + [f"{m} has not said" for m in silent]
    return "; ".join(parts)[:400] or "no member has said who leads"


class SignalingGone(Exception):
    """The signaling server dropped this peer while it waited for a snapshot: nobody can
    connect to it any more; it must join the room again."""


@dataclass
class FollowerStart:
    """What a follower starts from: the leader's validated config and snapshot."""

    leader: str
    run: RunConfig
    state: TrainState
    weight_hash: str  # the snapshot's announced (and verified) weight hash
    held: deque[Item]  # everything else that arrived meanwhile, in order
    term: int = 0  # the term the leader declared itself for
    boundary: int = 0  # the group's step machine boundary (rounds committed) of the state


Send = Callable[[tuple[str, ...], wire.Message], None]


async def await_snapshot(queue: asyncio.Queue[Item], on_up: Callable[[str], None],
                         on_down: Callable[[str], None], version: int,
                         tokinfo: TokenizerInfo, join_timeout: float,
                         self_id: str = "",
                         members: Callable[[], Sequence[str]] = tuple,
                         rejoining: bool = False,
                         signaling_up: Callable[[], bool] = lambda: True,
                         send: Send = lambda _to, _msg: None,
                         connected: Callable[[], Collection[str]] = tuple,
                         ) -> FollowerStart:
    """Wait for Config + SnapshotPlan from the group's leader (:func:`agreed_leader`),
    download the plan's pieces (asking with ``send`` the holders among ``connected()``),
    and buffer everything else meanwhile. ``rejoining``: this peer was cut off from its
    group and joins it again (only the lines that say what went wrong differ).
    :class:`SignalingGone` when ``signaling_up()`` turns False meanwhile (checked at
    least at every item: the driver's ticks come five times a second)."""
    deadline = time.monotonic() + join_timeout
    held: deque[Item] = deque(maxlen=BUFFER_BEFORE_START)
    configs: dict[str, wire.Config] = {}
    plans: dict[str, wire.SnapshotPlan] = {}  # the last one per sender, used if chosen
    versions: dict[str, int] = {}  # peers whose Hello announced another version
    claims: dict[str, str] = {}  # peer -> the leader it follows ("" not started)
    terms: dict[str, int] = {}  # peer -> the term of the leader it follows
    download: Download | None = None
    tokenizer = (tokinfo.vocab_size, tokinfo.file_hash)

    def ask(requests: list[tuple[str, wire.PieceRequest]]) -> None:
        for peer, request in requests:
            send((peer,), request)

    while True:
        if not signaling_up():
            raise SignalingGone
        group = tuple(members())  # the signaling server's members, as of now
        leader = agreed_leader(claims, group, self_id)
        now = time.monotonic()
        if leader is not None and leader in plans and leader in configs and (
                download is None or download.plan is not plans[leader]):
            try:
                run = RunConfig.from_wire(configs[leader])
                download = Download(leader, run, plans[leader], tokenizer,
                                    set(connected()), now)
            except (PieceError, ValueError, wire.WireError) as exc:
                raise _refused(leader, exc) from None
            ask(download.requests())
        if download is not None:
            if leader is not None and download.leader != leader:
                download = None  # the group names another leader now: its plan is awaited
            elif download.done:
                return _checked_start(download, held, terms.get(leader, 0))
            else:
                ask(_refusing(download, download.tick, now))
        left = deadline - now
        if left <= 0:
            cut = "cut off from its group, this peer could not rejoin: " if rejoining else ""
            if plans:
                raise PeerError(3, f"{cut}no snapshot from a leader the group agrees on "
                                   f"within {join_timeout:g} s: "
                                   + _disagreement(claims, group, self_id))
            if rejoining:
                raise PeerError(3, f"{cut}no leader the group agrees on sent a snapshot "
                                   f"within {join_timeout:g} s: "
                                   + _disagreement(claims, group, self_id))
            raise PeerError(3, f"no leader sent a run within {join_timeout:g} s "
                               "(start one peer with --start)")
        try:
            item = await asyncio.wait_for(queue.get(), min(left, 1.0))
        except TimeoutError:
            continue
        if isinstance(item, Interrupt):
            raise PeerError(130, "interrupted while waiting for a snapshot")
        if not isinstance(item, MeshItem):
            continue
        ev = item.event
        if isinstance(ev, PeerUp):
            on_up(ev.peer)
            continue
        if isinstance(ev, PeerDown):
            on_down(ev.peer)
            for known in (configs, plans, claims):
                known.pop(ev.peer, None)
            if download is not None and ev.peer == download.leader:
                download = None  # the group's next leader offers another plan
            elif download is not None:
                ask(_refusing(download, functools.partial(download.peer_down, ev.peer),
                              time.monotonic()))
            continue
        if not isinstance(ev, Received):
            continue
        msg = ev.message
        if isinstance(msg, wire.Hello):
            if msg.peer_id == ev.peer and msg.version != version:
                versions[ev.peer] = msg.version
                claims.setdefault(ev.peer, "")  # it is excluded; it has no say
            held.append(item)  # the state machine refuses a non-leader one later
            continue
        if ev.peer in versions and isinstance(msg, (wire.Config, wire.SnapshotPlan,
                                                    wire.Halt)):
            # Only a leader sends these (a Halt: it excluded us for our version).
            raise PeerError(1, f"refused the leader {ev.peer}: it speaks protocol "
                               f"version {versions[ev.peer]}, this peer speaks "
                               f"{version}")
        if isinstance(msg, wire.Following):
            if ev.peer not in versions:
                claims[ev.peer] = msg.leader
                terms[ev.peer] = msg.term
            continue
        if isinstance(msg, wire.Config):
            configs[ev.peer] = msg
            continue
        if isinstance(msg, wire.SnapshotPlan) and ev.peer in configs:
            plans[ev.peer] = msg
            continue
        if isinstance(msg, wire.Piece):
            if download is not None:
                try:
                    ask(download.received(ev.peer, msg, time.monotonic()))
                except PlanStale:
                    # The leader went on without us: it offers another plan when it
                    # hears that we still wait for one.
                    log(f"the snapshot of {download.plan.step} went stale; asking "
                        f"{download.leader} again")
                    send((download.leader,), wire.Following(""))
                    plans.pop(download.leader, None)
                    download = None
                except PieceError as exc:
                    raise _refused(download.leader, exc) from None
            continue
        held.append(item)


def _refused(leader: str, why: Exception) -> PeerError:
    """The one line (exit 1) a follower ends with when its leader's offer is wrong."""
    return PeerError(1, f"refused the snapshot from {leader}: {why}")


def _refusing(download: Download,
              step: Callable[[float], list[tuple[str, wire.PieceRequest]]],
              now: float) -> list[tuple[str, wire.PieceRequest]]:
    """``step(now)`` of ``download``; a failure is the leader's: refused, exit 1."""
    try:
        return step(now)
    except PieceError as exc:
        raise _refused(download.leader, exc) from None


def _checked_start(download: Download, held: deque[Item], term: int) -> FollowerStart:
    """The downloaded state, checked against the group's hash (refused: exit 1)."""
    try:
        state = download.state()
    except (PieceError, ValueError) as exc:
        raise _refused(download.leader, exc) from None
    if download.fresh is not None:
        log(f"made the state of boundary {download.plan.step} from the run's seed "
            "(its hash is the group's)")
    else:
        served = ", ".join(f"{download.served_by[p]} from {p}"
                           for p in download.plan.holders if p in download.served_by)
        took = time.monotonic() - download.started
        log(f"took the state of boundary {download.plan.step} ({download.bytes:,} bytes, "
            f"{took:.1f} s) in {download.layout.count} pieces: {served}")
    return FollowerStart(download.leader, download.run, state, download.plan.weight_hash,
                         held, term, download.plan.step)
