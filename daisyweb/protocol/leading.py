"""The leader's half of the step machine, and the failure handling of the step protocol.

:class:`Leader` is the collaborator of ``daisyweb.protocol.sync.StepMachine`` that does
what only a leader does, and keeps what only a leader keeps (the rosters it issued, the
round deadline, the speeds it observed). At each boundary the leader waits for every
live participant's hashes, offers joiners a snapshot, runs the sync guard
(``judge.judge``) and names the roster; in flight it amends a dead member away. Repair
requests, which every member sends, are the machine's own.

Failures
--------
- Repair: a member missing a roster member's contribution ``repair_after`` seconds after
  it sent its own asks the leader (``RepairRequest``). The leader keeps the raw payloads
  of the last ``history`` steps and resends them bit-exact (a ``Contribution`` whose
  ``sender`` is the original sender, relayed by the leader -- the only relay accepted).
  A leader missing a live member's contribution asks that member, which resends its own.
- Amendment: if the leader lacks the contribution too and its sender is down, it re-issues
  ``Roster(b, members - {dead})``; everyone averages over the amended roster. A member
  that already committed step ``b`` with the old roster rolls back to its backup of
  boundary ``b`` (kept until the next roster confirms the step) and recommits.
- Dead follower: removed from the participants, so absent from the next roster; the
  step in flight is completed by amendment if its contribution never arrived.
- Leader loss: every survivor picks the same successor -- the first live peer after the
  old leader in the last roster's order (cyclic) -- and that peer carries on from its
  last committed step, re-issuing the roster of the step in flight (amended if needed).
- Join: a peer announced with :meth:`StepMachine.peer_up` is sent a snapshot at the next
  boundary (the driver builds it: :class:`SendSnapshot`); once its ``StepHashes`` for
  that boundary match, it is a member from that step on.
- Protocol version: each peer's first message on a new link is ``Hello(self, version)``.
  A peer announcing another version is never listened to again: the leader excludes it
  (it never enters a roster), a follower stops if it is the leader, and otherwise
  ignores it. Messages that arrive before a Hello are handled as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from daisyweb.protocol import wire
from daisyweb.protocol.actions import Action, Excluded, Send, SendSnapshot
from daisyweb.protocol.capacity import bounded_speeds, capacity_shares
from daisyweb.protocol.deadline import Deadline
from daisyweb.protocol.judge import HaltRun, judge
from daisyweb.protocol.ledger import InFlight
from daisyweb.protocol.owner_exchange import hand_over
from daisyweb.protocol.pace import Pace

if TYPE_CHECKING:
    from daisyweb.protocol.sync import StepMachine

__all__ = ["Leader", "SNAPSHOT_WAIT_FLOOR_S"]

SNAPSHOT_WAIT_FLOOR_S = 10.0
"""The least the group waits for a joiner to confirm its snapshot: three times the
longest confirmation seen, never less than this, times the snapshots offered at once."""


class Leader:
    """The leader's duties in one step machine (``machine``), and the state only a leader
    keeps: which boundaries' rosters it issued, the round deadline, the members' speeds
    as it observed them, and how long joiners take to confirm a snapshot."""

    def __init__(self, machine: StepMachine) -> None:
        self.machine = machine
        self.published: set[int] = set()  # boundaries whose roster we issued
        self.deadline = Deadline()  # round times, late members
        self.observed: dict[str, float] = {}  # member -> speed seen (sequences/s)
        self.confirm_s = 0.0  # the longest a joiner took to confirm its snapshot

    def reissue(self, boundary: int) -> None:
        """A new term: issue again the rosters of ``boundary`` on (the old leader may not
        have finished issuing them)."""
        self.published = {b for b in self.published if b < boundary}

    def amend(self, out: list[Action], step: int, dead: str, now: float,
               why: str = "") -> None:
        """Name ``step``'s roster again without ``dead`` (left, or late: ``why``)."""
        m = self.machine
        st = m.ledger.get(step)
        if st is None or st.roster is None or dead not in st.roster or (
                not st.owners and dead in st.payloads):
            return
        members = tuple(p for p in st.roster if p != dead)
        if not members:
            return
        shares = _kept_shares(st, members)
        owners = hand_over(st.owners, dead, members) if st.owners else ()
        out.append(Excluded(dead, why or f"{dead} left before its contribution of "
                                         f"{m.unit} {step} arrived"))
        roster = _roster(step, members, shares, m.term, owners, st.pace)
        out.append(Send(m.members.others(members), roster))
        m.set_roster(out, step, members, now, shares, owners, st.pace)

    def waits_for(self, st: InFlight, peer: str) -> bool:
        """The step in flight still needs something from ``peer`` that only it has: its
        contribution (all-to-all), or its part of ours or its parts' means (owners)."""
        if st.owners:
            return self.machine.owned.waits_for(st, peer)
        return peer not in st.payloads

    def lost(self, out: list[Action], step: int, peer: str, now: float) -> None:
        """``peer`` left: amended away from ``step`` if the step still waits for it."""
        st = self.machine.ledger.get(step)
        if st is not None and st.roster is not None and self.waits_for(st, peer):
            self.amend(out, step, peer, now)

    def enforce_deadline(self, out: list[Action], now: float) -> None:
        """Leader: leave out of the round in flight each live member whose contribution
        is later than the deadline (``deadline``); drop one that keeps missing it. In the
        owner exchange a contribution is late when its part of ours is, and an owner whose
        part's mean is missing twice the deadline after the part was its to reduce is left
        out too (it withholds the mean, or a member withholds its part from it: once the
        parts come to us, we find that member ourselves)."""
        m = self.machine
        b = m.boundary
        st = m.ledger.get(b)
        if st is None or st.roster is None or st.named_at is None:
            return
        limit = self.deadline.seconds(m.bounds.length(st.pace.length, m.remaining))
        if now - st.named_at < limit:
            return
        for p in [p for p in st.roster if p != m.self_id and m.members.alive(p)
                  and self._late(st, p)]:
            self._left_out(out, b, p, now, f"{p} missed the deadline of {m.unit} {b} "
                                           f"({limit:.1f} s); left out of it")
        if not st.owners or st.roster is None:
            return
        rh = m.owned.roster_hash(st)
        for j, owner in enumerate(st.owners):
            if (owner == m.self_id or not m.members.alive(owner)
                    or st.mean_of(j, rh) is not None):
                continue
            if now - st.handed.get(j, st.named_at) >= 2 * limit:
                self._left_out(out, b, owner, now, f"{owner} sent no mean of part {j} of "
                                                   f"{m.unit} {b} within {2 * limit:.1f} s; "
                                                   "left out of it")
                return  # its parts have a new owner, and its time

    def _late(self, st: InFlight, peer: str) -> bool:
        """``peer``'s contribution (in the owner exchange: its part of ours) is not in."""
        if st.owners:
            me = self.machine.self_id
            return any(peer not in st.parts.get(j, {}) for j in st.reduces(me))
        return peer not in st.payloads

    def _left_out(self, out: list[Action], b: int, p: str, now: float, why: str) -> None:
        m = self.machine
        self.amend(out, b, p, now, why)
        if self.deadline.missed(p):
            self.exclude(out, b, p, f"{p} missed the deadline of "
                                     f"{self.deadline.misses[p]} {m.unit}s in a row")
        else:
            # Nor is it waited for at the next boundary: it comes back as a joiner
            # (it finds the group gone on without it, or wakes cut off).
            m.members.leave(p)

    def snapshot_went_stale(self, joiner: str) -> bool:
        """Whether the group went on without ``joiner``'s snapshot: a roster of its
        boundary leaves it out, or the group is past that boundary."""
        m = self.machine
        b = m.members.offered.get(joiner)
        if b is None:
            return False  # not offered one yet: it gets one at the next boundary
        roster = m.roster(b)
        return b < m.boundary or (roster is not None and joiner not in roster)

    def lead(self, out: list[Action], b: int, now: float) -> None:
        m = self.machine
        st = m.ledger.get(b)
        if b in self.published:
            # Step in flight: a member that died before sending is amended away.
            if st is not None and st.roster is not None:
                for p in st.roster:
                    if not m.members.alive(p) and self.waits_for(st, p):
                        self.amend(out, b, p, now)
                        return
            return
        if st is not None and st.roster is not None:
            # We took over mid-step: re-issue the roster we were working on.
            self.published.add(b)
            members = tuple(p for p in st.roster
                            if m.members.alive(p) or not self.waits_for(st, p))
            shares = _kept_shares(st, members)
            owners = st.owners
            for gone in [p for p in st.roster if p not in members]:  # in roster order
                owners = hand_over(owners, gone, members) if owners else ()
            roster = _roster(b, members, shares, m.term, owners, st.pace)
            out.append(Send(m.members.others(members), roster))
            m.set_roster(out, b, members, now, shares, owners, st.pace)
            self.lead(out, b, now)
            return
        have = m.valid_hashes(b)
        expected = m.members.live_participants()
        if any(p not in have for p in expected):
            return
        if not m.run_over:
            # Joiners get a snapshot of this boundary before its roster is named.
            # Every member whose hash is ours holds the boundary: each serves a share of
            # the pieces.
            own = have.get(m.self_id, ("",))[0]
            holders = tuple(dict.fromkeys([*(p for p in expected if have[p][0] == own),
                                           m.self_id]))
            out.extend(SendSnapshot(p, b, holders)
                       for p in m.members.offer_snapshots(b, now))
            # The group waits for a joiner's confirmation no longer than its snapshot
            # takes (measured per snapshot; the snapshots of one boundary share the
            # leader's uplink, so as many times longer); a later one finds the group
            # gone on and asks again (rejoins).
            offered = m.members.offered_at(b)
            wait = max(SNAPSHOT_WAIT_FLOOR_S, 3.0 * self.confirm_s) * max(len(offered), 1)
            if any(p not in have and now - m.members.pending.get(p, now) < wait
                   for p in offered):
                return
        offered = m.members.offered_at(b)
        joiners = [p for p in offered if p in have]
        for p in joiners:  # how long one snapshot took, offer to confirmation
            took = now - m.members.pending.get(p, now)
            self.confirm_s = max(self.confirm_s, took / len(offered))
        if not self._judge(out, b, have, expected, joiners):
            return
        m.members.admit(joiners)
        if m.run_over:
            m.finish_run(out, b)
            return
        members = tuple(m.members.live_participants())
        self.published.add(b)
        shares: tuple[int, ...] = ()
        if m.capacity:
            last = m.ledger.committed_shares.get(b - 1, ())
            previous = last if m.ledger.committed.get(b - 1) == members else ()
            speeds = bounded_speeds(m.hash_check.book.speeds.get(b, {}), self.observed)
            shares = capacity_shares(members, speeds, m.batch, previous)
        owners = m.owners_for(members)
        pace = self.pace(b, members)
        out.append(Send(m.members.others(members),
                        _roster(b, members, shares, m.term, owners, pace)))
        m.set_roster(out, b, members, now, shares, owners, pace)

    def pace(self, b: int, members: tuple[str, ...]) -> Pace:
        """Round ``b``'s length and the next one's head start (``protocol.pace``): from the
        most steps any member's last exchange took, never shorter than the head start
        the last roster had members take of it."""
        m = self.machine
        needs = m.hash_check.book.ahead.get(b, {})
        need = max([m.ahead, *(needs.get(p, 0) for p in members)])
        last = m.ledger.get(b - 1)
        if b == m.started_at:
            named = 0  # the run's first round: nothing ran ahead into it
        elif last is not None and last.roster is not None:
            named = last.pace.ahead
        else:  # unknown (we joined at b and lead now): as long as any head start may be
            named = m.bounds.overlap
        started = m.bounds.head_start(named, m.remaining)
        return m.bounds.choose(need, started, m.remaining)

    def _judge(
        self,
        out: list[Action],
        b: int,
        have: dict[str, tuple[str, str]],
        expected: list[str],
        joiners: list[str],
    ) -> bool:
        """Leader's sync guard at boundary ``b`` (``judge.judge``); False if the run stopped."""
        m = self.machine
        for ruling in judge(b, m.self_id, have, expected, joiners, m.members.excluded,
                            m.unit):
            if isinstance(ruling, HaltRun):
                m.stop_run(out, b, self._attributed(b, have, expected) or ruling.reason, True)
                return False
            self.exclude(out, b, ruling.peer, ruling.reason)
        return True

    def _attributed(self, b: int, have: dict[str, tuple[str, str]],
                    expected: list[str]) -> str | None:
        """A fork at ``b`` that a member's two different contributions explain: why."""
        m = self.machine
        own = have[m.self_id][0]
        owners = m.ledger.committed_owners.get(b - 1, ())
        for p in expected:
            roster = owners or m.ledger.committed_roster(b - 1)
            reason = (m.hash_check.equivocation(b, p, roster, bool(owners))
                      if have[p][0] != own else None)
            if reason is not None:
                return reason
        return None

    def measure_round(self, st: InFlight, length: int) -> None:
        """At a commit of a round of ``length`` inner steps: its time (naming the roster
        to the last arrival: the deadline's sample) and each member's sequences per
        second as we saw it, network included: what capacity shares may believe of a
        member's own report (``capacity.bounded_speeds``)."""
        m = self.machine
        if st.roster is None or st.named_at is None:
            return
        arrivals = [st.arrived[p] for p in st.roster if p in st.arrived]
        if len(arrivals) == len(st.roster):
            self.deadline.record(max(arrivals) - st.named_at, length)
        for i, p in enumerate(st.roster):
            self.deadline.made_it(p)
            arrived = st.arrived.get(p)
            if arrived is None:
                continue  # repaired or relayed: no fact about its speed
            sequences = (st.shares[i] if st.shares else m.batch) * length
            self.observed[p] = sequences / max(arrived - st.named_at, 1e-3)

    def exclude(self, out: list[Action], b: int, peer: str, reason: str) -> None:
        m = self.machine
        m.members.exclude(peer)
        out.append(Send((peer,), wire.Halt(b, f"excluded: {reason}")))
        out.append(Excluded(peer, reason))


def _kept_shares(st: InFlight, members: tuple[str, ...]) -> tuple[int, ...]:
    """The shares of ``members`` as the step's roster first named them: contributions
    already computed over them are never reweighted."""
    if not st.shares or st.roster is None:
        return ()
    return tuple(st.shares[st.roster.index(p)] for p in members)


def _roster(step: int, members: tuple[str, ...], shares: tuple[int, ...], term: int,
            owners: tuple[str, ...], pace: Pace) -> wire.Roster:
    return wire.Roster(step, members, shares, term, owners, pace.ahead, pace.length)
