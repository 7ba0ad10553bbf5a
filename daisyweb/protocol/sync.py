"""The group step protocol as a pure state machine (no asyncio, no sockets, no clock).

One :class:`StepMachine` per peer. The driver (``daisyweb.peer``) feeds it events --
a message from a peer, a peer going down or coming up, the local contribution being
ready, a timer tick -- and carries out the actions it returns (``daisyweb.protocol.actions``:
:class:`Send`, :class:`Compute`, :class:`Commit`, :class:`SendSnapshot`,
:class:`Excluded`, :class:`Finish`, :class:`Stopped`). Every event method takes ``now``
(seconds, any monotonic origin) so timeouts are deterministic in tests.

The machine is in one :class:`Phase` at a time (``machine.phase``): ``WAITING`` for the
boundary's hashes (leader) or roster (follower), ``COMPUTING`` its own contribution,
``COLLECTING`` the roster's other contributions, then (the step committed) ``WAITING`` at
the next boundary; ``FINISHED`` and ``HALTED`` are final. The pieces it owns: who is in
the group (``membership.Membership``), the hashes (``hashes.HashCheck``), the leader's
sync guard (``judge.judge``) and the contribution codec (``codec.Codec``, ``F32`` unless
the driver gives the run's), used both to accept a payload and to decode it for the
roster-order sum, so every member sums the decoded values of the same bytes, its own
included.

Steps and boundaries
--------------------
One step of the machine is one exchange: a round of local steps in the default mode (a
member's contribution is its round delta), one optimizer step in lockstep (a member's
contribution is its gradient). ``replica.step`` is the number of committed updates: the
*boundary* ``b``. Step ``b`` is the update that takes the weights from boundary ``b`` to
``b + 1``. Per step:

1. At boundary ``b`` every participant publishes ``StepHashes(b, weight_hash,
   probe_hash)`` to everyone. The probe is run *before* the peer's next contribution is
   computed, so a broken kernel is caught before that contribution can be used.
2. The leader waits for the hashes of every live participant (and of peers joining at
   this boundary). Any weight-hash mismatch halts the run, naming the peers that differ
   from the majority. A probe hash that differs from the majority gets that peer
   excluded (it is told with a ``Halt`` addressed to it alone). Then the leader names
   the roster: ``Roster(b, members)``, members in a fixed order (the order of joining).
3. Each member computes its contribution and sends ``Contribution(b, self, payload)`` to
   every other member. A member waits for *exactly* the roster's contributions; a wrong
   length or any NaN/Inf halts the run at step ``b`` with the replica untouched. When all
   are present they are summed in roster order (``average_parts_in_roster_order``) and
   applied: the step is committed only then. Never a partial average.
   A roster that names ``owners`` runs the owner exchange instead
   (``daisyweb.protocol.owner_exchange``): each member sends each part of its
   contribution to the part's owner only, each owner reduces its part once and sends the
   encoded mean to every member, and a member commits when it holds every part's mean.
4. Followers check every hash published by a member of the last roster against their
   own; any mismatch halts (each peer independently, so a fork stops everyone even if
   the leader's ``Halt`` is lost).

Failures -- repair, amendment, a dead follower, leader loss, joins, protocol versions --
are described in ``daisyweb.protocol.leading``, where most of their handling lives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import numpy as np

from daisyweb.protocol import wire
from daisyweb.protocol.actions import (
    Action,
    Commit,
    Compute,
    CutOff,
    Excluded,
    Finish,
    Leading,
    Replica,
    Send,
    SendSnapshot,
    Stopped,
)
from daisyweb.protocol.averaging import GradientError, average_parts_in_roster_order
from daisyweb.protocol.codec import F32, Codec, check_payload, decode_parts
from daisyweb.protocol.election import RUNOFF_S, Leadership, reachable, strict_majority
from daisyweb.protocol.hashes import HashCheck
from daisyweb.protocol.influence import clip_factors, squared_norm
from daisyweb.protocol.leading import Leader
from daisyweb.protocol.ledger import Archive, InFlight, StepLedger
from daisyweb.protocol.membership import Membership, successor
from daisyweb.protocol.owner_exchange import EXCHANGES, OWNER_FROM, OwnerExchange
from daisyweb.protocol.pace import LOCKSTEP, NOT_NAMED, Bounds, Pace

__all__ = [
    "Replica",
    "Action",
    "Send",
    "Compute",
    "Commit",
    "SendSnapshot",
    "Excluded",
    "Finish",
    "Stopped",
    "CutOff",
    "Leading",
    "Phase",
    "StepMachine",
    "successor",
]

HISTORY = 8  # steps of contributions the leader keeps for repair
ROSTER_WINDOW = 2  # rosters kept this many steps past our boundary (a new leader's)


class Phase(Enum):
    """Where one peer's machine is in the step at its boundary."""

    WAITING = "waiting"  # for the boundary's hashes (leader) or its roster (follower)
    COMPUTING = "computing"  # our own contribution to the boundary's step
    COLLECTING = "collecting"  # own contribution in; the roster's others still missing
    FINISHED = "finished"  # the last step committed with every member's hashes agreeing
    HALTED = "halted"  # stopped; the replica is a valid (last committed) state
    CUT_OFF = "cut off"  # cut off from the majority: the peer rejoins as a joiner


class StepMachine:
    """One peer's view of the step protocol (see module docstring). Its collaborators own
    their state: ``leading`` (:class:`leading.Leader`) what only a leader does and keeps,
    ``hash_check`` (:class:`hashes.HashCheck`) the hashes and fork checks, ``ledger``
    (:class:`ledger.StepLedger`) the steps in flight and committed, ``members``
    (:class:`membership.Membership`) and ``leadership`` (:class:`election.Leadership`)."""

    def __init__(
        self,
        self_id: str,
        replica: Replica,
        total_steps: int,
        probe: Callable[[], str],
        leader: str,
        members: Sequence[str] = (),
        *,
        repair_after: float = 2.0,
        join_timeout: float = 30.0,
        history: int = HISTORY,
        version: int = wire.PROTOCOL_VERSION,
        codec: Codec = F32,
        capacity: bool = False,
        batch: int = 1,
        archive: Archive | None = None,
        term: int = 0,
        election_timeout: float = 10.0,
        unit: str = "step",
        bounds: Bounds = LOCKSTEP,
        exchange: str = "all",
    ) -> None:
        self.self_id = self_id
        self.unit = unit  # what one of our steps is, in the lines we write: step or round
        # The run's round lengths and head start (``protocol.pace``): lockstep's are 1.
        self.bounds = bounds
        self.version = version  # what this peer speaks (a test hook may change it)
        self.replica = replica
        self.total_steps = total_steps  # the run's optimizer steps (``replica.inner_steps``)
        self.probe = probe
        # Who leads, in which term, confirmed by whom (``election``). The leader a peer
        # starts with is confirmed: the run's starter, or the one a joiner's majority named.
        self.leadership = Leadership(self_id, leader, term)
        # The boundary a run's starter names its first roster at: nobody ran ahead into it.
        self.started_at = replica.step if leader == self_id else None
        # A new leader that no majority declared (and that names us no roster) within
        # this many seconds: this peer is cut off and rejoins.
        self.election_timeout = election_timeout
        self.repair_after = repair_after
        self.join_timeout = join_timeout
        self.history = history
        self.codec = codec
        # How a roster this peer names exchanges contributions (``owner_exchange``): every
        # member's whole to every other ("all"), each part reduced by its owner ("owner"),
        # or the owner exchange from OWNER_FROM members on ("auto"). Members follow the
        # roster they are sent, whatever their own setting.
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
        self.exchange = exchange
        # Capacity-weighted batches (``capacity``): the leader gives each member a share of
        # the roster's ``batch * len(roster)`` sequences by its reported speed; a follower
        # learns the mode from the rosters it is sent (and keeps it if it takes over).
        self.capacity = capacity
        self.batch = batch
        self.speed = 0.0  # the driver's measurement of our last contribution
        # Steps of a round this member's last exchange took (the driver's measurement,
        # published with our hashes); leading, the next roster's pace follows the most
        # any member of it needs (``protocol.pace``).
        self.ahead = 0
        self.members = Membership(self_id, members)
        self._end: Phase | None = None  # FINISHED or HALTED: every later event is ignored
        # A leader keeps ``history`` steps of payloads for repair: the last HOT_STEPS in
        # memory, older ones in ``archive`` if given (the peer's file), else in memory too.
        self.ledger = StepLedger(archive)
        self.hash_check = HashCheck(self_id, unit)
        self.leading = Leader(self)  # what only a leader does, and keeps
        self.owned = OwnerExchange(self, getattr(codec, "codec", codec))
        self._recommit: int | None = None  # a step rolled back, to be committed again
        self._losses: dict[int, float] = {}
        self._last_roster: tuple[str, ...] = tuple(self.members.participants)
        self._had_roster = False  # a follower knows the group's order only from a roster
        self._backup: tuple[int, Any] | None = None  # (boundary, replica.backup())
        self._unlinked: set[str] = set()  # peers whose links are down (peer_down, peer_up)
        # Members that said they left (interrupted, or cut off and rejoining), until a
        # roster names them again.
        self._left: set[str] = set()
        # The furthest boundary each member of the electorate published hashes for, when
        # two or more past ours (``_ahead``).
        self._beyond: dict[str, int] = {}

    # ------------------------------------------------------------------ properties
    @property
    def leader(self) -> str:
        return self.leadership.leader

    @property
    def term(self) -> int:
        return self.leadership.term

    @property
    def is_leader(self) -> bool:
        """This peer leads, confirmed by a majority (or it started the run)."""
        return self.leadership.leading

    def electorate(self) -> tuple[str, ...]:
        """The roster that produced our boundary (the last committed one), else the last
        roster we knew, less the members that said they left (they declare no leader any
        more, so two majorities still overlap): leadership and reachability need a strict
        majority of it."""
        roster = self.ledger.committed_roster(self.boundary - 1) or self._last_roster
        return tuple(p for p in roster if p not in self._left)

    @property
    def boundary(self) -> int:
        return self.replica.step

    @property
    def remaining(self) -> int:
        """The run's optimizer steps left from our boundary."""
        return max(0, self.total_steps - self.replica.inner_steps)

    @property
    def run_over(self) -> bool:
        """Our boundary is the run's last: every optimizer step of it is committed."""
        return self.remaining == 0

    @property
    def done(self) -> bool:
        """Finished or halted."""
        return self._end is not None

    @property
    def phase(self) -> Phase:
        if self._end is not None:
            return self._end
        st = self.ledger.get(self.boundary)
        if st is None or st.roster is None:
            return Phase.WAITING
        return Phase.COMPUTING if st.computing else Phase.COLLECTING

    def roster(self, step: int) -> tuple[str, ...] | None:
        return self.ledger.roster(step)

    def owners_for(self, members: tuple[str, ...]) -> tuple[str, ...]:
        """The parts' owners of a new roster of ``members`` (empty: all-to-all)."""
        owner = self.exchange == "owner" or (self.exchange == "auto"
                                              and len(members) >= OWNER_FROM)
        return members if owner and len(members) > 1 else ()

    # ------------------------------------------------------------------ events
    def start(self, now: float = 0.0) -> list[Action]:
        """The replica is ready (fresh, resumed or loaded from a snapshot)."""
        out: list[Action] = []
        self._publish_hashes(out)
        self._progress(out, now)
        return out

    def local_contribution(
        self, step: int, loss: float, vector: np.ndarray, now: float = 0.0
    ) -> list[Action]:
        """The driver finished a :class:`Compute` for ``step``: ``vector`` is this
        member's contribution (its round delta, or its gradient in lockstep)."""
        out: list[Action] = []
        if step != self.boundary or self.phase is not Phase.COMPUTING:
            return out  # stale (e.g. the step was rolled forward by an amendment)
        st = self.ledger.steps[step]
        st.computing = False
        payload = self.codec.encode(vector)
        self._losses[step] = float(loss)
        # Our own contribution goes through the same checks as everyone else's: a local
        # NaN halts here before anything leaves the machine.
        if not self._accept_contribution(out, step, self.self_id, payload):
            return out
        st.own_sent_at = now
        st.arrived.setdefault(self.self_id, now)
        if st.owners:
            self.owned.contribute(out, step, st)
        else:
            others = tuple(p for p in st.roster or () if p != self.self_id)
            if others:
                out.append(Send(others, wire.Contribution(step, self.self_id, payload)))
        self._progress(out, now)
        return out

    def message(self, peer: str, msg: wire.Message, now: float = 0.0) -> list[Action]:
        """A decoded message from ``peer``."""
        out: list[Action] = []
        if self.done or peer in self.members.excluded:
            return out
        if isinstance(msg, wire.Hello):
            self._on_hello(out, peer, msg)
        elif isinstance(msg, wire.StepHashes):
            self._on_hashes(out, peer, msg)
        elif isinstance(msg, wire.Following):
            self._on_following(out, peer, msg, now)
        elif isinstance(msg, wire.Roster):
            # Kept only from participants (a possible next leader) and only near our
            # boundary: a flood of future rosters must not grow the state.
            b = self.boundary
            if peer in self.members.participants and b - 1 <= msg.step <= b + ROSTER_WINDOW:
                self.ledger.saw_roster(peer, msg.step, msg.members, msg.shares, msg.term,
                                       msg.owners)
            self._roster_from(out, peer, msg, now)
        elif isinstance(msg, wire.Contribution):
            self._on_contribution(out, peer, msg, now)
        elif isinstance(msg, wire.OwnedPart):
            self.owned.on_part(out, peer, msg, now)
        elif isinstance(msg, wire.MeanPart):
            self.owned.on_mean(out, peer, msg, now)
        elif isinstance(msg, wire.PartRequest):
            self.owned.on_part_request(out, peer, msg, now)
        elif isinstance(msg, wire.MeanRequest):
            self.owned.on_mean_request(out, peer, msg, now)
        elif isinstance(msg, wire.RepairRequest):
            self._on_repair_request(out, peer, msg, now)
        elif isinstance(msg, wire.Halt):
            # Any participant may stop the group: one that refused a contribution is the
            # only one that knows (the sender's own copy may be fine). Joiners may not.
            if peer == self.leader or peer in self.members.participants:
                self.stop_run(out, msg.step, f"{peer}: {msg.reason}", broadcast=False)
        if not self.done:
            self._progress(out, now)
        return out

    def stood_still(self, seconds: float) -> list[Action]:
        """This peer did nothing for ``seconds``, longer than the others wait for a silent
        link (it was paused, or starved of CPU): they have dropped it, and whatever it
        would decide now (a deadline, an amendment, a commit as a deposed leader) could
        fork the group. It is cut off before it acts, and rejoins."""
        out: list[Action] = []
        self._cut_off(out, f"this peer stood still {seconds:.1f} s (paused or starved of "
                           f"CPU), longer than the group waits for a silent member")
        return out

    def halt(self, step: int, reason: str) -> list[Action]:
        """This peer cannot go on (e.g. computing its contribution failed): tell the group
        and stop at ``step`` with the state untouched."""
        out: list[Action] = []
        self.stop_run(out, step, reason, broadcast=True)
        return out

    def peer_down(self, peer: str, now: float = 0.0) -> list[Action]:
        """The mesh lost ``peer`` (heartbeat timeout or closed channel)."""
        out: list[Action] = []
        if self.done or peer in self.members.down or peer == self.self_id:
            return out
        self.members.went_down(peer)
        self._unlinked.add(peer)
        self._lost(out, peer, now)
        self._progress(out, now)
        return out

    def peer_up(self, peer: str, now: float = 0.0) -> list[Action]:
        """A peer is connected (again). The leader offers an admitted one a snapshot."""
        out: list[Action] = []
        if self.done or peer == self.self_id:
            return out
        self._unlinked.discard(peer)  # reachable again (the majority count)
        if not self.is_leader:
            self.members.down.discard(peer)
            return out
        if peer in self.members.participants or peer in self.members.excluded:
            return out
        self.members.came_up(peer, now)
        self._progress(out, now)
        return out

    def tick(self, now: float) -> list[Action]:
        """Timers: repair requests, join timeouts, a leader not confirmed in time."""
        out: list[Action] = []
        if self.done:
            return out
        lead = self.leadership
        if not lead.confirmed and now - lead.leaderless_since >= self.election_timeout:
            who = "this peer" if lead.leader == self.self_id else lead.leader
            self._cut_off(out, f"no majority of the last roster confirmed {who} as leader "
                               f"of term {lead.term} within {self.election_timeout:g} s")
            return out
        if not lead.confirmed and now - lead.since >= RUNOFF_S:
            choice = lead.runoff(self.electorate())
            if choice is not None:
                self._follow(out, *choice, now)
        st = self.ledger.get(self.boundary)
        if st is not None and st.roster is not None and st.own_sent_at is not None:
            if now - st.own_sent_at >= self.repair_after:
                self._request_repairs(out, st, now)
        if self.is_leader:
            self.leading.enforce_deadline(out, now)
        for p in self.members.expire_joiners(now, self.join_timeout):
            # A joiner that never confirmed its snapshot must not block the group.
            out.append(Excluded(p, f"{p} did not confirm its snapshot in time"))
        self._progress(out, now)
        return out

    # ------------------------------------------------------------------ repair
    def _request_repairs(self, out: list[Action], st: InFlight, now: float) -> None:
        """Ask for each roster member's contribution still missing (at most once per
        ``repair_after``)."""
        if st.owners:
            self.owned.request_repairs(out, st, now)
            return
        for p in st.roster or ():
            if p in st.payloads:
                continue
            last = st.requested.get(p)
            if last is not None and now - last < self.repair_after:
                continue
            st.requested[p] = now
            if self.leadership.candidate:
                continue  # nobody to ask until a majority confirms a leader
            if self.is_leader:
                if not self.members.alive(p):
                    self.leading.amend(out, self.boundary, p, now)
                else:
                    # Nobody to ask but the sender itself.
                    out.append(Send((p,), wire.RepairRequest(self.boundary, p)))
            else:
                out.append(Send((self.leader,), wire.RepairRequest(self.boundary, p)))

    def _on_repair_request(
        self, out: list[Action], peer: str, msg: wire.RepairRequest, now: float
    ) -> None:
        st = self.ledger.get(msg.step)
        if not self.is_leader:
            # A follower only resends its own contribution (the leader asks when it lacks
            # it).
            own = st.payloads.get(self.self_id) if st else None
            if msg.sender_of_missing == self.self_id and peer == self.leader and own:
                out.append(Send((peer,), wire.Contribution(msg.step, self.self_id, own)))
            return
        payload = self.ledger.payload(msg.step, msg.sender_of_missing)
        if payload is not None:
            out.append(Send((peer,), wire.Contribution(msg.step, msg.sender_of_missing,
                                                       payload)))
        elif msg.step == self.boundary and not self.members.alive(msg.sender_of_missing):
            self.leading.amend(out, msg.step, msg.sender_of_missing, now)

    # ------------------------------------------------------------------ hashes
    def _publish_hashes(self, out: list[Action]) -> None:
        b = self.boundary
        hashes = (self.replica.weight_hash(), self.probe())
        out.append(Send(None, self.hash_check.publish(b, hashes, self.ledger.digest_before(b),
                                                      self.speed, self.ahead)))
        for peer in self.hash_check.book.peers_at(b):
            self._check_fork(out, b, peer)

    def valid_hashes(self, b: int) -> dict[str, tuple[str, str]]:
        """Hashes at ``b`` comparable with ours: made with the roster we applied."""
        mine = self.ledger.digest_before(b)
        return self.hash_check.book.comparable(b, mine, self.members.offered.get)

    def _on_hashes(self, out: list[Action], peer: str, msg: wire.StepHashes) -> None:
        if msg.sender != peer:
            return  # hashes are never relayed
        if msg.step > self.boundary + 1:
            self._ahead(out, peer, msg.step)
            return
        if msg.step < self.boundary - 1:
            return
        self.hash_check.record(msg)
        self._check_fork(out, msg.step, peer)

    def _ahead(self, out: list[Action], peer: str, step: int) -> None:
        """``peer`` published hashes two boundaries or more past ours. A member cannot be
        that far behind the group it is in (every round needs its contribution): once a
        majority of our electorate is, the group went on without us (left out of a round,
        or following a leader that no longer names us rosters). Cut off, and rejoin."""
        # A joiner never named in a roster knows only the leader it took its snapshot
        # from: that leader going on without it is enough.
        left_out = not self._had_roster and peer == self.leader
        electorate = self.electorate()
        if peer not in electorate and not left_out:
            return
        self._beyond[peer] = max(step, self._beyond.get(peer, 0))
        ahead = [p for p in electorate if self._beyond.get(p, 0) > self.boundary + 1]
        if left_out or strict_majority(len(ahead), len(electorate)):
            self._cut_off(out, f"the group is at {self.unit} {max(self._beyond.values())}, "
                               f"this peer at {self.boundary}: it went on without this peer")

    def _check_fork(self, out: list[Action], b: int, peer: str) -> None:
        """Each peer judges the members of the step that produced our boundary itself."""
        roster = self.ledger.committed_roster(b - 1)
        if b != self.boundary or peer not in roster:
            return
        reason = self.hash_check.fork(b, peer, roster, self.valid_hashes(b).get(peer),
                                      self.ledger.committed_owners.get(b - 1, ()))
        if reason is not None:
            self.stop_run(out, b, reason, broadcast=True)

    def _majority_ended_with_us(self, b: int, electorate: tuple[str, ...]) -> bool:
        """A strict majority of ``electorate`` (us included) published our weight hash
        at the run's last boundary ``b``, made with the roster we applied."""
        own = self.hash_check.book.own.get(b)
        if own is None:
            return False
        have = self.valid_hashes(b)
        same = sum(1 for p in electorate if p in have and have[p][0] == own[0])
        return strict_majority(same, len(electorate))

    def _maybe_finish(self, out: list[Action], b: int) -> None:
        have = self.valid_hashes(b)
        prev = self.ledger.committed_roster(b - 1)
        if all(p in have or not self.members.alive(p) for p in prev):
            self.finish_run(out, b)

    # ------------------------------------------------------------------ internals
    def stop_run(self, out: list[Action], step: int, reason: str, broadcast: bool) -> None:
        if self.done:
            return
        self._end = Phase.HALTED
        if broadcast:
            out.append(Send(None, wire.Halt(step, reason[: wire.MAX_TEXT_LEN])))
        out.append(Stopped(step, reason))

    def finish_run(self, out: list[Action], b: int) -> None:
        self._end = Phase.FINISHED
        out.append(Finish(b))

    def _cut_off(self, out: list[Action], reason: str) -> None:
        """Stop training here and rejoin as a joiner (the replica stays a valid state)."""
        if self.done:
            return
        self._end = Phase.CUT_OFF
        self.leadership.leader, self.leadership.confirmed = "", False  # follows nobody
        out.append(Send(None, wire.Following("", 0)))  # the group sees us leave
        out.append(CutOff(self.boundary, reason))

    # ------------------------------------------------------------------ leadership
    def _follow(self, out: list[Action], leader: str, term: int, now: float) -> None:
        """Follow ``leader`` in ``term`` and declare it to everyone."""
        out.append(Send(None, self.leadership.follow(leader, term, now)))
        if leader == self.self_id:
            self._check_elected(out, now)
            return
        seen = self.ledger.rosters_seen.get((leader, self.boundary))
        if seen is not None and seen[2] == term:
            # The new leader's roster came before we saw the old one go.
            self.leadership.confirmed = True
            self._on_roster(out, self.boundary, seen[0], now, seen[1], seen[3])

    def _lost(self, out: list[Action], peer: str, now: float) -> None:
        """``peer`` left (its links are down, or it rejoins): if it led, declare the
        successor for the next term."""
        if peer != self.leader:
            return
        if not self._had_roster:
            # No roster yet, so no agreed order to pick a successor from: every
            # follower would pick itself (split brain). Rejoin instead, and take a
            # snapshot again from the leader the group names (a starved follower's link
            # to a live leader drops during a big start); nothing is lost.
            self._cut_off(out, f"the leader {peer} left before the first roster")
            return
        roster = self.roster(self.boundary) or self.electorate()
        new = successor(roster, peer, self.members.alive)
        if new is None:
            new = next(iter(self.members.live_participants()), self.self_id)
        self._follow(out, new, self.term + 1, now)

    def _on_following(self, out: list[Action], peer: str, msg: wire.Following,
                      now: float) -> None:
        if not msg.leader:
            # The peer follows nobody: it rejoins (cut off) and is a joiner from now on.
            self.leadership.record(peer, "", 0)
            self._left.add(peer)
            if peer in self.members.pending and self.is_leader:
                if self.leading.snapshot_went_stale(peer):
                    # The group went on without the joiner: offer it a new snapshot.
                    self.members.forget_joiner(peer)
                    self.members.came_up(peer, now)
                # else its snapshot is on the way: this Following("") left before it
                # arrived (every joiner sends one when its link comes up).
                return
            if peer in self.members.participants or peer == self.leader:
                self.members.went_down(peer)
                self._lost(out, peer, now)
                if self.is_leader:
                    self.leading.lost(out, self.boundary, peer, now)
                    if peer not in self.members.excluded:
                        self.members.came_up(peer, now)  # a joiner from now on
            elif self.is_leader and self.members.alive(peer):
                # A member left out of the group (a missed deadline) asks to come back.
                self.members.came_up(peer, now)
            return
        self.leadership.record(peer, msg.leader, msg.term)
        self._check_elected(out, now)

    def _check_elected(self, out: list[Action], now: float) -> None:
        """Act on a strict majority of the electorate declaring one leader for a term."""
        if self.done:
            return
        electorate = self.electorate()
        choice = self.leadership.elected(electorate)
        if choice is None:
            return
        leader, term = choice
        lead = self.leadership
        if (leader, term) == (lead.leader, lead.term):
            if lead.candidate:
                lead.confirmed = True
                # Re-issue what the old leader may not have finished issuing.
                self.leading.reissue(self.boundary)
                out.append(Leading(self.boundary, term, lead.votes(leader, term, electorate),
                                   len(electorate)))
            lead.confirmed = True  # a follower's new leader too: a majority stands behind it
            return
        if term == lead.term and lead.confirmed:
            return  # we follow this term's confirmed leader; a roster would be the evidence
        if lead.leading:
            self._cut_off(out, f"{leader} leads term {term} now (a majority declared it)")
            return
        self._follow(out, leader, term, now)

    def _roster_from(self, out: list[Action], peer: str, msg: wire.Roster,
                     now: float) -> None:
        """A roster from ``peer``: taken from our leader in its term; a newer term's leader
        is followed; an older term's sender is told; two leaders of one term halt."""
        if peer == self.self_id:
            return
        lead = self.leadership
        if msg.term < lead.term:
            out.append(Send((peer,), wire.Following(lead.leader, lead.term)))
            return
        if msg.term == lead.term and peer == lead.leader:
            if not lead.leading:
                lead.confirmed = True
                self._on_roster(out, msg.step, msg.members, now, msg.shares, msg.owners,
                                msg.pace)
            return
        if msg.term == lead.term and lead.confirmed:
            other = self.self_id if lead.leading else lead.leader
            self.stop_run(out, self.boundary, f"two leaders of term {msg.term}: {peer} and "
                                           f"{other} both named rosters", broadcast=True)
            return
        if lead.leading:
            self._cut_off(out, f"{peer} leads term {msg.term} now")
            return
        # A leader a majority confirmed in a term we have not seen (or beat our own
        # candidate to it): follow it.
        self._follow(out, peer, msg.term, now)
        lead.confirmed = True
        self._on_roster(out, msg.step, msg.members, now, msg.shares, msg.owners, msg.pace)

    def _on_hello(self, out: list[Action], peer: str, msg: wire.Hello) -> None:
        if msg.peer_id != peer or msg.version == self.version:
            return  # a Hello speaks only for its sender; same version: nothing to do
        reason = (f"{peer} speaks protocol version {msg.version}, "
                  f"{self.self_id} speaks {self.version}")
        if peer == self.leader and not self.is_leader:
            self.stop_run(out, self.boundary, f"refused the leader: {reason}", broadcast=False)
            return
        self.members.forget_joiner(peer)
        if self.is_leader:
            self.leading.exclude(out, self.boundary, peer, reason)
            return
        # A follower cannot take anyone out of the roster, but never uses its messages
        # (and never picks it as the next leader); the leader excludes it too.
        self.members.exclude(peer)
        out.append(Excluded(peer, reason))

    def _on_roster(
        self, out: list[Action], step: int, members: tuple[str, ...], now: float,
        shares: tuple[int, ...] = (), owners: tuple[str, ...] = (), pace: Pace = NOT_NAMED,
    ) -> None:
        b = self.boundary
        self.members.learn(members)
        self._left.difference_update(members)
        self._last_roster = members
        self._had_roster = True
        self.capacity = bool(shares)  # the leader's mode, kept if we take over
        committed = self.ledger.committed.get(step)
        if step == b - 1 and committed is not None and (
                committed != members or self.ledger.committed_shares.get(step, ()) != shares
                or self.ledger.committed_owners.get(step, ()) != owners):
            self._rollback(out, step, members, now, shares, owners)
            return
        if step > b:
            # The leader names only a step whose hashes every member published: the
            # group went on without us (we were dropped while we could not answer).
            self._cut_off(out, f"the group is at {self.unit} {step}, this peer at {b}")
            return
        if step != b:
            return
        if self.self_id not in members:
            self._cut_off(out, f"the group went on without {self.self_id} at {self.unit} {b}")
            return
        if pace.length and not self.bounds.shortest <= pace.length <= self.bounds.longest \
                and pace.length != self.remaining:
            self.stop_run(out, step, f"the roster of {self.unit} {step} names {pace.length} "
                                     f"steps, outside the run's {self.bounds.shortest}.."
                                     f"{self.bounds.longest}", True)
            return
        self.set_roster(out, step, members, now, shares, owners, pace)

    def set_roster(
        self, out: list[Action], step: int, members: tuple[str, ...], now: float,
        shares: tuple[int, ...] = (), owners: tuple[str, ...] = (), pace: Pace = NOT_NAMED,
    ) -> None:
        st = self.ledger.open(step)
        old = st.roster
        if old is not None and old != members:
            # Amendment: only removal of senders is allowed; keep what we have.
            if not set(members) <= set(old):
                self.stop_run(out, step, f"roster of {self.unit} {step} changed to add members",
                              True)
                return
            st.payloads = {p: g for p, g in st.payloads.items() if p in members}
        old_owners = st.owners
        if old is not None and len(owners) != len(old_owners):
            # Another cut of the step (a new leader's roster, or the other exchange): what
            # was sent under the old one is void, and our contribution goes out again.
            old_owners = ()
            st.parts, st.means, st.reduced, st.checked = {}, {}, {}, set()
            if not owners and self.self_id in st.payloads:
                others = tuple(p for p in members if p != self.self_id)
                out.append(Send(others, wire.Contribution(step, self.self_id,
                                                          st.payloads[self.self_id])))
        st.roster = members
        st.shares = shares
        st.owners = owners
        st.pace = pace
        if st.named_at is None:
            st.named_at = now
        self._last_roster = members
        self._had_roster = True
        self._left.difference_update(members)  # named again: members again
        if owners:
            self.owned.roster_named(out, step, st, old_owners, now)
            if self.done:
                return
        # Contributions received before the roster from non-members are dropped now; the
        # members' are checked now (a bad one from a member halts, as it would later).
        st.payloads = {p: g for p, g in st.payloads.items() if p in members}
        for p in [p for p in st.unchecked if p in st.payloads]:
            payload = st.payloads.pop(p)
            if not self._accept_contribution(out, step, p, payload):
                return
        st.unchecked.clear()
        if self.self_id in members and self.self_id not in st.payloads and not st.computing:
            st.computing = True
            mine = shares[members.index(self.self_id)] if shares else 0
            out.append(Compute(step, mine, pace.ahead, self.bounds.length(pace.length,
                                                                          self.remaining)))

    def _on_contribution(self, out: list[Action], peer: str, msg: wire.Contribution,
                         now: float = 0.0) -> None:
        relayed = msg.sender != peer
        if relayed and peer != self.leader:
            return  # only the leader repairs
        s = msg.step
        if s != self.boundary:
            return  # too old (committed) or too new (cannot happen on ordered channels)
        st = self.ledger.open(s)
        if msg.sender in st.payloads or msg.sender == self.self_id or st.owners:
            return  # (the owner exchange sends parts, never a whole contribution)
        if st.roster is None:
            # No roster yet: the contribution waits, unchecked, for it (one per sender, and a
            # sender is the peer on the link unless the leader relays). Then a member's
            # is checked and anyone else's (a joiner that never confirmed its snapshot,
            # a stranger) is dropped unread, so it cannot halt the group.
            st.payloads[msg.sender] = msg.payload
            st.unchecked.add(msg.sender)
            return
        if msg.sender not in st.roster:
            return
        if self._accept_contribution(out, s, msg.sender, msg.payload) and not relayed:
            st.arrived.setdefault(msg.sender, now)

    def _accept_contribution(self, out: list[Action], step: int, sender: str,
                             payload: bytes) -> bool:
        """Validate (decode) and store one contribution; halt (state untouched) if it is
        bad."""
        try:
            # Checked on its bytes (no vector made): decoded only when averaged.
            check_payload(self.codec, payload, self.replica.size, f"gradient from {sender}")
        except GradientError as exc:
            self.stop_run(out, step, f"refused at {self.unit} {step}: {exc}", broadcast=True)
            return False
        self.ledger.open(step).payloads[sender] = payload
        return True

    def _rollback(self, out: list[Action], step: int, members: tuple[str, ...], now: float,
                  shares: tuple[int, ...] = (), owners: tuple[str, ...] = ()) -> None:
        restore = getattr(self.replica, "restore", None)
        if self._backup is None or self._backup[0] != step or restore is None:
            self.stop_run(out, step, f"roster of committed {self.unit} {step} was amended", True)
            return
        st = self.ledger.get(step)
        if st is None or st.roster is None or not set(members) <= set(st.roster) or (
                not st.owners and not owners and not set(members) <= set(st.payloads)):
            self.stop_run(out, step, f"amended roster of {self.unit} {step} cannot be rebuilt",
                          True)
            return
        if shares and st.shares and any(
                shares[members.index(p)] != st.shares[st.roster.index(p)]
                for p in members if st.roster is not None and p in st.roster):
            # Contributions were computed over the shares first named: never reweighted.
            self.stop_run(out, step, f"amended roster of {self.unit} {step} changes shares", True)
            return
        restore(self._backup[1])
        self.ledger.uncommit(step)
        self.owned.rolled_back(step)
        self._recommit = step  # committed again once the amended roster's step is whole
        self.set_roster(out, step, members, now, shares, owners)

    def _try_commit(self, out: list[Action], step: int, rollback: bool = False) -> bool:
        st = self.ledger.get(step)
        if st is None or st.roster is None or step != self.boundary:
            return False
        if st.owners:
            return self._try_commit_owned(out, step, st)
        if any(p not in st.payloads for p in st.roster):
            return False  # exactly the roster's contributions, never a partial average
        rollback = rollback or self._recommit == step
        # The decoded values of the very bytes every member holds (its own included),
        # decoded part by part as the average adds them (all were validated on arrival).
        size = self.replica.size
        # Bounded influence: each contribution's norm against the round's median, from
        # the decoded values (a first pass over the bytes), the same on every member.
        norms2 = [squared_norm(decode_parts(self.codec, st.payloads[p], size, f"from {p}"))
                  for p in st.roster]
        factors = clip_factors(norms2)
        clipped = tuple(p for p, f in zip(st.roster, factors, strict=True) if f is not None)
        parts = [decode_parts(self.codec, st.payloads[p], size, f"gradient from {p}")
                 for p in st.roster]
        # The mean is ours alone: the replica may keep its buffer (the outer step's).
        mean = average_parts_in_roster_order(parts, size, st.shares, factors)
        bad = int(mean.size - np.count_nonzero(np.isfinite(mean)))
        if bad:
            self.stop_run(out, step, f"the mean of {self.unit} {step} has {bad} values that are "
                                  f"not finite (contributions of {', '.join(st.roster)})", True)
            return False
        digests = tuple(wire.payload_digest(st.payloads[p]) for p in st.roster)
        return self._apply(out, step, st, mean, digests, clipped, rollback)

    def _try_commit_owned(self, out: list[Action], step: int, st: InFlight) -> bool:
        """The owner exchange: commit once every part's mean over the roster is in."""
        got = self.owned.mean(out, step, st)
        if got is None:
            return False
        mean, digests = got
        clipped = self.owned.committed(step, st)
        return self._apply(out, step, st, mean, digests, clipped, self._recommit == step)

    def _apply(self, out: list[Action], step: int, st: InFlight, mean: np.ndarray,
               digests: tuple[str, ...], clipped: tuple[str, ...], rollback: bool) -> bool:
        """Apply the step's mean and commit it (``digests``: of the bytes it came from)."""
        assert st.roster is not None
        length = self.bounds.length(st.pace.length, self.remaining)
        backup = getattr(self.replica, "backup", None)
        if backup is not None:
            self._backup = (step, backup())
        try:
            self.replica.apply(mean, owned=True)
        except (GradientError, ValueError) as exc:  # refused before any change
            self.stop_run(out, step, f"refused the mean of {self.unit} {step}: {exc}", True)
            return False
        self._recommit = None
        self.ledger.commit(step, st.roster, st.shares, st.owners)
        self.hash_check.averaged_at(step + 1, digests)
        if self.is_leader:
            self.leading.measure_round(st, length)
        self.ledger.forget_before(step, self.history, keep_payloads=self.is_leader)
        self._publish_hashes(out)
        wh, ph = self.hash_check.own(self.boundary)
        out.append(Commit(step, st.roster, self._losses.pop(step, None), wh, ph, rollback,
                          st.shares, clipped, st.owners, length, st.pace.ahead))
        return True

    def _progress(self, out: list[Action], now: float) -> None:
        """Advance as far as the known facts allow."""
        while not self.done:
            b = self.boundary
            if self._try_commit(out, b):
                continue
            electorate = self.electorate() if self._had_roster else ()
            reach = reachable(electorate, self.self_id, self._unlinked)
            if self._had_roster and not strict_majority(reach, len(electorate)):
                if self.run_over and self._majority_ended_with_us(b, electorate):
                    # The members that finished first and left are no partition: the run
                    # is over, and a majority published the weights we end with.
                    self.finish_run(out, b)
                    return
                self._cut_off(out, f"cut off from the group: {reach} of the last roster's "
                                   f"{len(electorate)} members reachable, no majority")
                return
            if self.is_leader:
                self.leading.lead(out, b, now)
            elif self.leadership.candidate:
                pass  # leads once a majority declared it (_check_elected)
            elif self.run_over:
                self._maybe_finish(out, b)
            return

