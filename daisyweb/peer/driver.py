"""The asyncio driver of one peer: Mesh events -> :class:`sync.StepMachine` -> actions.

Everything the protocol decides lives in ``daisyweb.protocol.sync``; this module only moves
bytes and time: it joins the mesh, runs the start handshake (``handshake``), runs each
contribution in a worker thread (so heartbeats and messages keep flowing during a step),
sends each peer's messages from its own ordered outbox (``daisyweb.net.outbox``: a slow
peer never blocks the loop), feeds batches (``datafeed``) and hands every commit and the
end to ``report``. Its parts are made by methods a test's subclass may wrap
(``tests/fault_peer.py``); nothing here knows of tests.

Queue items (``items``) are dataclasses, mesh events and errors are matched by type.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from daisyweb.checkpoints.checkpoint import TokenizerInfo
from daisyweb.data import Tokenizer, builtin_tokens
from daisyweb.net import (
    BadMessage,
    JoinDenied,
    JoinTimeout,
    Mesh,
    MeshError,
    PeerDown,
    PeerUp,
    Received,
)
from daisyweb.net.outbox import Outboxes
from daisyweb.peer import handshake
from daisyweb.peer.approve import approve_callback
from daisyweb.peer.datafeed import DataFeed, TaskFeed, feed_for
from daisyweb.peer.exchange import (
    RecordingEncoder,
    Trainer,
    bounds,
    make_trainer,
    mode,
    unit,
)
from daisyweb.peer.items import (
    ContributionFailed,
    ContributionReady,
    Interrupt,
    Item,
    MeshItem,
    Tick,
    is_hello,
)
from daisyweb.peer.memory import keep_step_buffers
from daisyweb.peer.options import PeerError, PeerOptions, log, mesh_transport_options
from daisyweb.peer.pieces import PieceServer, plan_for
from daisyweb.peer.report import Report
from daisyweb.peer.spill import SpillArchive
from daisyweb.protocol import budget, sync, wire
from daisyweb.protocol.influence import CLIP_FACTOR
from daisyweb.training.overlap import OverlapGauge
from daisyweb.training.rounds import BatchFn, Contribution, HeadStart, RoundTrainer
from daisyweb.training.state import TrainState, probe_hash

__all__ = ["TICK_S", "Driver", "MeshFactory"]

TICK_S = 0.2
_NO_VECTOR = np.zeros(0, np.float32)

MeshFactory = Callable[..., Mesh]


@dataclass(frozen=True)
class PendingHead:
    """The head start of round ``index`` (``--overlap``), computing in a worker thread
    while the previous round's exchange is in flight."""

    index: int
    future: asyncio.Future[HeadStart | None]
    rows: int  # sequences per inner step it drew (capacity-weighted batches)


class Driver:
    """One peer's run from joining the mesh to its exit code."""

    def __init__(self, opts: PeerOptions, tok: Tokenizer, tokinfo: TokenizerInfo,
                 state: TrainState | None, mesh_factory: MeshFactory | None) -> None:
        self.mesh_factory = mesh_factory
        self.opts = opts
        # The plan of the current boundary's pieces, made once for every joiner offered
        # one there (a 24-peer start offers 23 at boundary 0); a commit makes it stale.
        self.plan: wire.SnapshotPlan | None = None
        self.pieces = PieceServer()  # what this member serves joiners of the boundary
        self.version = wire.PROTOCOL_VERSION  # what this peer speaks and announces
        self.tok = tok
        self.tokinfo = tokinfo
        self.state = state
        self.report = Report(opts, tokinfo)  # opens --metrics (OSError: run_peer says so)
        self.replica: Trainer | None = None
        self.trainer: Trainer
        self.encoder: RecordingEncoder
        self.feed: DataFeed | TaskFeed
        self.machine: sync.StepMachine | None = None
        self.mesh: Mesh
        self.outboxes: Outboxes
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        # Peers whose Hello arrived on the current link: the leader offers a snapshot
        # only after it, so a peer of another version is refused before it gets one.
        self.hello_from: set[str] = set()
        self.tasks: list[asyncio.Task[None]] = []
        self.pump: asyncio.Task[None] | None = None  # mesh events into the queue
        self.head: PendingHead | None = None  # at most one, and never beside a compute
        self.overlap = OverlapGauge()  # how far ahead our exchange needs the group to run
        self.ahead = (0, 0)  # (round, steps of the next round its roster says to run ahead)
        self.corpus: asyncio.Future[object]  # the built-in corpus being encoded (main)
        self.rows = 0  # sequences per inner step of our last contribution (set by _compute)
        self.result: tuple[int, str] | None = None
        # Set when the machine is cut off from the group: the peer rejoins as a joiner.
        self.cut_off: sync.CutOff | None = None
        self.generation = 0  # the machine's; a rejoin's new machine ignores older work
        self.feed_tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ setup
    def _make_mesh(self) -> Mesh:
        factory = Mesh if self.mesh_factory is None else self.mesh_factory
        return factory(
            self.opts.server, room=self.opts.room, name=self.opts.name or "peer",
            approve=approve_callback(self.opts.approve, self._host_link),
            ice_hosts=self.opts.ice_hosts or None,
            stun=list(self.opts.stun), join_timeout=self.opts.join_timeout,
            **mesh_transport_options(self.opts),
            heartbeat_interval=self.opts.heartbeat_interval,
            heartbeat_timeout=self.opts.heartbeat_timeout,
        )

    def _host_link(self) -> str | None:
        # A test mesh may have no dashboard (and no host_link) at all.
        mesh = getattr(self, "mesh", None)
        link: str | None = getattr(mesh, "host_link", lambda: None)()
        return link

    async def main(self) -> int:
        # The built-in corpus is encoded (a second or more; cached) in a worker thread
        # while the peer joins: on the event loop it would stall the links' heartbeats
        # just after a follower takes its snapshot.
        self.corpus = asyncio.get_running_loop().run_in_executor(None, builtin_tokens)
        try:
            await self._join()
            self.tasks.append(asyncio.create_task(self._ticker()))
            self.tasks.append(asyncio.create_task(self._announce_host_link()))
            if self.opts.start:
                await self._start_leader()
            else:
                await self._start_follower()
            loop = asyncio.get_running_loop()
            # From here on an interrupt ends the run cleanly: end record, checkpoint.
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self.queue.put_nowait, Interrupt())
            await self._loop()
            code = await self._finish()
            await self.outboxes.drain()
            return code
        finally:
            pending = [*self.tasks, *self.outboxes.tasks(), *([self.pump] if self.pump else [])]
            for t in pending:
                t.cancel()
            for t in pending:
                with contextlib.suppress(BaseException):
                    await t
            with contextlib.suppress(Exception):
                await self.mesh.close()
            self.report.close()

    async def _join(self) -> None:
        """A new mesh, joined to the room (admitted), its events pumped into the queue."""
        self.mesh = self._make_mesh()
        self.outboxes = Outboxes(self.mesh.send, log)
        try:
            await self.mesh.start()
        # Checked first, as a JoinTimeout may well be an OSError too.
        except JoinTimeout as exc:
            raise PeerError(3, f"{exc}") from None
        except JoinDenied as exc:
            raise PeerError(3, f"the host denied this peer: {exc}") from None
        except (MeshError, OSError) as exc:
            raise PeerError(3, f"cannot join: {exc}") from None
        log(f"joined as {self.mesh.self_id}"
            + (f" in room {self.opts.room}" if self.opts.room else ""))
        self.pump = asyncio.create_task(self._pump_mesh())

    async def _join_again(self) -> None:
        """The signaling server dropped us (we could not answer its pings): leave the old
        mesh and join the room anew, under a new id the server gives."""
        log("the signaling server dropped this peer while it could not answer; "
            "joining the room again")
        old, pump = self.mesh, self.pump
        for t in [*self.outboxes.tasks(), *([pump] if pump else [])]:
            t.cancel()
        with contextlib.suppress(Exception):
            await old.close()
        self.hello_from.clear()
        await self._join()

    async def _pump_mesh(self) -> None:
        while True:
            ev = await self.mesh.next_event()
            await self.queue.put(MeshItem(ev))

    async def _announce_host_link(self) -> None:
        """Print the dashboard approval link whenever this peer gets (new) hosting, and
        a member's own dashboard link once (a private room shows only to its members)."""
        shown = None
        member_polls = 0  # polls that saw a member link (printed on the second)
        while True:
            link = self._host_link()
            if link is not None and link != shown:
                shown = link
                log(f"hosting this room; dashboard with Accept/Deny (keep it private): {link}")
            member = getattr(getattr(self, "mesh", None), "member_link", lambda: None)()
            if shown is None and member is not None:
                member_polls += 1
                # A host's key comes just after its welcome: one more poll, so a host
                # prints its host link only, never the member link first.
                if member_polls == 2:
                    log(f"dashboard of this room (keep it private): {member}")
            await asyncio.sleep(0.5)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self.queue.put(Tick())

    # ------------------------------------------------------------------ start
    def _machine(self, leader: str, term: int = 0) -> sync.StepMachine:
        assert self.state is not None and self.replica is not None
        self.machine = sync.StepMachine(
            self.mesh.self_id, self.replica, self.state.run.steps, probe_hash,
            leader=leader, repair_after=self.opts.repair_after,
            join_timeout=self.opts.join_timeout, version=self.version, codec=self.encoder,
            # Capacity-weighted batches are the leader's choice; a follower learns the
            # mode from the rosters it is sent.
            capacity=self.opts.start and self.opts.capacity, batch=self.state.run.batch,
            archive=SpillArchive(), term=term, unit=unit(self.state.run),
            bounds=bounds(self.state.run), exchange=self.opts.exchange)
        self._name_ahead()
        return self.machine

    async def _start_leader(self) -> None:
        assert self.state is not None
        run = self.state.run
        self._make_replica(self.state)
        await self._make_feed()
        ups, held = await handshake.wait_for_peers(
            self.queue, self._peer_connected, self.hello_from, self.opts.wait_peers,
            self.opts.join_timeout)
        machine = self._machine(self.mesh.self_id)
        task = f", task {run.task}" if run.task else ""
        log(f"leading: {self.state.size:,} parameters{task}, {run.steps} steps, "
            f"from step {self.state.step}, {mode(run)}")
        self.report.begin(self.state)
        # Hellos first: a peer of another version is excluded before it is offered a
        # snapshot or a place in the first roster.
        for item in held:
            if is_hello(item):
                await self._handle(item)
        now = time.monotonic()
        for p in ups:
            if p in self.hello_from:  # the others are announced when their Hello comes
                await self._do(machine.peer_up(p, now))
        await self._do(machine.start(now))
        for item in held:
            if not is_hello(item):
                await self._handle(item)

    async def _start_follower(self) -> None:
        start = await handshake.await_snapshot(
            self.queue, self._peer_connected, self._peer_gone, self.version, self.tokinfo,
            self.opts.join_timeout, self.mesh.self_id, lambda: self.mesh.members,
            rejoining=self.cut_off is not None, signaling_up=self._signaling_up,
            send=self._send, connected=lambda: self.outboxes.connected)
        self.state = state = start.state
        try:
            self._make_replica(state, start.boundary)
        except ValueError as exc:
            raise PeerError(1, f"refused the snapshot from {start.leader}: {exc}") from None
        await self._make_feed()
        machine = self._machine(start.leader, start.term)
        log(f"following {start.leader}: {state.size:,} parameters, from step {state.step} "
            f"of {start.run.steps} (snapshot {start.weight_hash[:16]} verified)")
        self.report.begin(state)
        await self._do(machine.start(time.monotonic()))
        for item in start.held:
            await self._handle(item)

    def _make_replica(self, state: TrainState, boundary: int | None = None) -> None:
        largest = budget.largest_message(state.size)  # the run is known: bound every link
        self.mesh.limit_messages(largest, budget.link_budget(state.size))
        keep_step_buffers(state.size)  # the step's temporaries stay on the heap
        self.trainer = make_trainer(state, boundary)
        self.replica = self.trainer  # a trainer is the step machine's replica
        self.encoder = RecordingEncoder(state.run.codec, state.size)

    async def _make_feed(self) -> None:
        assert self.state is not None
        await self.corpus  # DataFeed's builtin_tokens() is then the cached array
        for t in self.feed_tasks:  # a rejoin's new feed replaces the old one
            t.cancel()
        self.feed = feed_for(self.tok, self.state.run, self.mesh.self_id, self.opts.server)
        self.feed_tasks = self.feed.start()
        self.tasks.extend(self.feed_tasks)

    def _shared_hash(self) -> str:
        if self.replica is not None:
            return self.replica.weight_hash()
        assert self.state is not None
        return self.state.weight_hash()

    # ------------------------------------------------------------------ links
    def _peer_connected(self, peer: str) -> None:
        # The Hello goes out first on a new link, ahead of anything held for it; then
        # whom we follow, which a joiner needs to tell the real leader from a pretender.
        self.outboxes.up(peer, wire.Hello(self.mesh.self_id, self.version))
        self._send((peer,), self._following())

    def _following(self) -> wire.Following:
        """The leader this peer follows and its term: itself with --start, nobody ("")
        until a follower starts or while it rejoins."""
        m = self.machine
        if m is not None and not m.done:
            return wire.Following(m.leader, m.term)
        if m is None and self.opts.start and self.cut_off is None:
            return wire.Following(self.mesh.self_id, 0)
        return wire.Following("", 0)

    def _peer_gone(self, peer: str) -> None:
        self.hello_from.discard(peer)  # a new link starts with a new Hello
        self.outboxes.down(peer)

    def _send(self, to: tuple[str, ...] | None, msg: wire.Message) -> None:
        self.outboxes.put(to, msg)

    # ------------------------------------------------------------------ loop
    async def _loop(self) -> None:
        last = time.monotonic()  # when the loop last took an item (ticks come every TICK_S)
        while self.result is None:
            if self.cut_off is not None and self.machine is not None:
                await self._rejoin(self.cut_off)
                last = time.monotonic()
                continue
            item = await self.queue.get()
            now = time.monotonic()
            stood, last = now - last, now
            m = self.machine
            if stood > self.opts.heartbeat_timeout and m is not None and not m.done:
                # The others have dropped us meanwhile: act on nothing from before.
                await self._do(m.stood_still(stood))
                continue
            await self._handle(item)

    async def _rejoin(self, cut: sync.CutOff) -> None:
        """Cut off from the group: keep the last committed state on disk, drop this
        machine and its work, and join again like a new peer (a snapshot from the leader
        the group names). A paused or partitioned peer never leads a second group."""
        assert self.state is not None
        what = unit(self.state.run)
        log(f"cut off at {what} {cut.step}: {cut.reason}; rejoining the group as a joiner")
        self.report.save_now(self.state)
        self.machine = None
        self.generation += 1  # a contribution still computing is for the old machine
        self.head = None
        while True:
            if not self._signaling_up():
                await self._join_again()
            try:
                await self._start_follower()
                break
            except handshake.SignalingGone:
                continue  # dropped by the server while we waited: join anew
        self.cut_off = None

    def _signaling_up(self) -> bool:
        return bool(getattr(self.mesh, "signaling_up", True))  # a test mesh has no server

    async def _handle(self, item: Item) -> None:
        m = self.machine
        if m is None or self.result is not None:
            return
        now = time.monotonic()
        if isinstance(item, Interrupt):
            log(f"interrupted at {self._unit()} {m.boundary}")
            self.result = (130, "interrupted")
            # The group hears that we leave on purpose: it goes on without counting us.
            self._send(None, wire.Following("", 0))
        elif isinstance(item, Tick):
            await self._do(m.tick(now))
        elif isinstance(item, ContributionReady):
            if item.generation != self.generation:
                return  # computed for the machine before a rejoin
            await self._contribution_ready(m, item, now)
        elif isinstance(item, ContributionFailed):
            if m.done or item.step != m.boundary or item.generation != self.generation:
                return  # stale: the step was rolled forward while this one computed
            exc = item.error
            reason = (f"gradient computation failed on {m.self_id} at step {item.step}: "
                      f"{type(exc).__name__}: {exc}")
            await self._do(m.halt(item.step, reason))
        elif isinstance(item, MeshItem):
            await self._mesh_event(m, item, now)

    async def _contribution_ready(self, m: sync.StepMachine, item: ContributionReady,
                                  now: float) -> None:
        step, contribution = item.step, item.contribution
        self.report.contribution_ready(step, item.secs, now, contribution.head_steps)
        if item.secs > 0 and item.sequences:
            m.speed = item.sequences / item.secs  # published with our next hashes
        self.trainer.stage(contribution)
        self.overlap.ready(step, now, item.secs, contribution.steps)
        current = not m.done and step == m.boundary
        actions = m.local_contribution(step, contribution.loss, contribution.vector, now)
        await self._do(actions)
        if current and self.result is None:
            # The head start needs our end weights and moments, not the delta (sent and
            # kept as bytes now): without it, its 4P bytes are freed meanwhile.
            self._start_head(m, step + 1, dataclasses.replace(contribution, vector=_NO_VECTOR))

    def _start_head(self, m: sync.StepMachine, index: int, previous: Contribution) -> None:
        """Start round ``index``'s first steps while this exchange is in flight: as many as
        the last round's roster says (``wire.Roster.ahead``), within the run's overlap."""
        assert self.state is not None
        if not isinstance(self.trainer, RoundTrainer) or self.head is not None \
                or previous.inner is None:
            return
        trainer = self.trainer
        named = self.ahead[1] if self.ahead[0] == index - 1 else 0
        # round index starts where our contribution to the one before it ended
        remaining = self.state.run.steps - int(previous.inner["step"])
        steps = m.bounds.head_start(named, remaining)
        if steps <= 0:
            return
        t0 = time.perf_counter()

        def finished(_: object) -> None:
            self.report.head_finished(index, time.perf_counter() - t0, time.monotonic())

        # Drawn with this round's share: the next roster most likely names the same one
        # (speeds change slowly); if not, the head start is dropped (_take_head).
        rows = self.rows or self.feed.run.batch
        future = asyncio.get_running_loop().run_in_executor(
            None, trainer.head_start, index, self._batch_fn(rows), previous, steps)
        future.add_done_callback(finished)
        self.report.head_started(index)
        self.head = PendingHead(index, future, rows)

    def _measure_overlap(self, step: int, now: float) -> None:
        """Round ``step`` committed: how far ahead this member's exchange needs the group
        to run (``training.overlap``), published with its next hashes; the leader's roster
        names the most any member needs."""
        self.overlap.committed(step, now)
        self._name_ahead()

    def _name_ahead(self) -> None:
        run = self.state.run if self.state is not None else None
        if self.machine is not None and run is not None and run.sync_every > 1:
            self.machine.ahead = self.overlap.steps(run.sync_max)

    async def _take_head(self, step: int, rows: int) -> HeadStart | None:
        """The head start of round ``step`` if one was computed over ``rows`` sequences a
        step (a head start over another share would be weighted wrongly); any other one
        in flight is waited for (one computation at a time uses the sampler) and
        dropped."""
        pending, self.head = self.head, None
        if pending is None:
            return None
        try:
            head = await pending.future
        except Exception as exc:  # the whole round is computed again, which will say why
            log(f"head start of round {pending.index} failed ({type(exc).__name__}); "
                f"computing the round whole")
            return None
        return head if pending.index == step and pending.rows == rows else None

    async def _mesh_event(self, m: sync.StepMachine, item: MeshItem, now: float) -> None:
        ev = item.event
        if isinstance(ev, Received):
            msg = ev.message
            if isinstance(msg, wire.PieceRequest):
                assert self.state is not None
                self._send((ev.peer,), self.pieces.serve(ev.peer, msg, self.state,
                                                         self.trainer.step))
                return
            if isinstance(msg, (wire.Config, wire.SnapshotPlan, wire.Piece,
                                wire.Heartbeat)):
                return  # start handshake messages after the start: nothing to do
            if isinstance(msg, wire.Following) and not msg.leader:
                self._send((ev.peer,), self._following())  # a rejoining peer asks who leads
            await self._do(m.message(ev.peer, msg, now))
            if isinstance(msg, wire.Hello) and msg.peer_id == ev.peer:
                self.hello_from.add(ev.peer)
                if ev.peer in self.outboxes.connected:  # no-op unless leading (or excluded)
                    await self._do(m.peer_up(ev.peer, now))
        elif isinstance(ev, PeerUp):
            self._peer_connected(ev.peer)
            if ev.peer in self.hello_from:
                await self._do(m.peer_up(ev.peer, now))
        elif isinstance(ev, PeerDown):
            self._peer_gone(ev.peer)
            log(f"peer {ev.peer} down ({ev.reason})")
            await self._do(m.peer_down(ev.peer, now))
        elif isinstance(ev, BadMessage):
            log(f"refused a message from {ev.peer}: {ev.error}")

    async def _do(self, actions: Iterable[sync.Action]) -> None:
        for a in actions:
            if isinstance(a, sync.Send):
                self._send(a.to, a.message)
            elif isinstance(a, sync.Compute):
                self.report.computing(a.step)
                self.ahead = (a.step, a.ahead)  # the next round's head start, as named
                self.tasks.append(asyncio.create_task(self._compute(a.step, a.length,
                                                                    a.sequences)))
            elif isinstance(a, sync.Commit):
                self.plan = None  # the boundary moved (or a rollback recommitted)
                self._measure_overlap(a.step, time.monotonic())
                if a.clipped:
                    log(f"{self._unit()} {a.step}: held the contribution of "
                        f"{', '.join(a.clipped)} to {CLIP_FACTOR:g}x the median norm")
                assert self.state is not None and self.machine is not None
                await self.report.commit(a, self.trainer, self.state, self.encoder,
                                         self.mesh)
            elif isinstance(a, sync.SendSnapshot):
                self._send_snapshot(a.peer, a.step, a.holders)
            elif isinstance(a, sync.Excluded):
                log(f"excluded {a.peer}: {a.reason}")
            elif isinstance(a, sync.Finish):
                self.result = (0, "done")
            elif isinstance(a, sync.Stopped):
                log(f"halted at {self._unit()} {a.step}: {a.reason}")
                self.result = (1, a.reason)
            elif isinstance(a, sync.CutOff):
                self.cut_off = a
            elif isinstance(a, sync.Leading):
                await self._now_leading(a)
        self.tasks = [t for t in self.tasks if not t.done()]

    def _unit(self) -> str:
        return unit(self.state.run) if self.state is not None else "step"

    async def _now_leading(self, a: sync.Leading) -> None:
        m = self.machine
        assert m is not None
        log(f"leading now from {self._unit()} {a.step} (the leader was lost; term {a.term}, "
            f"declared by {a.votes} of the last roster's {a.electorate} members)")
        # Peers still waiting for a snapshot were announced to the old leader.
        now = time.monotonic()
        for p in list(self.outboxes.connected):
            if p in self.hello_from:
                await self._do(m.peer_up(p, now))

    async def _compute(self, step: int, length: int, sequences: int = 0) -> None:
        generation = self.generation
        loop = asyncio.get_running_loop()
        n = sequences or self.feed.run.batch  # our share of each inner step's sequences
        self.rows = n  # a head start of the next round draws as many (--overlap)
        head = await self._take_head(step, n)
        t0 = time.perf_counter()
        compute = functools.partial(self.trainer.contribute, steps=length)
        if head is not None:
            compute = functools.partial(compute, head=head)
        try:
            contribution = await loop.run_in_executor(None, compute, step,
                                                      self._batch_fn(n))
        except Exception as exc:
            # Any failure here (a kernel refusing a NaN activation, a bug) must halt the
            # group: a peer that silently never sends its contribution stalls everyone.
            await self.queue.put(ContributionFailed(step, exc, generation))
            return
        secs = time.perf_counter() - t0 + self.report.head_secs(step if head else None)
        # Sequences per second of this contribution: the leader's next shares use it.
        await self.queue.put(ContributionReady(step, contribution, secs,
                                               n * contribution.steps, generation))

    def _batch_fn(self, rows: int) -> BatchFn:
        """The batches of a share of ``rows`` sequences per inner step."""
        return self.feed.batch if rows == self.feed.run.batch else self.feed.rows(rows)

    def _send_snapshot(self, peer: str, step: int, holders: tuple[str, ...]) -> None:
        assert self.state is not None
        if self.trainer.step != step:  # cannot happen: the machine asks at its boundary
            log(f"not offering {self._unit()} {step} from {self.trainer.step}")
            return
        if self.plan is None or self.plan.step != step or self.plan.holders != holders:
            self.plan = plan_for(self.state, step, self.trainer.weight_hash(), holders,
                                 (self.tokinfo.vocab_size, self.tokinfo.file_hash))
        self._send((peer,), self.state.run.to_wire())
        self._send((peer,), self.plan)
        log(f"offered {self._unit()} {step} to {peer} in pieces from "
            f"{len(holders)} member{'s' if len(holders) != 1 else ''}")

    async def _finish(self) -> int:
        assert self.result is not None and self.state is not None
        return await self.report.finish(self.result, self.state, self._shared_hash(),
                                        self.mesh)
