"""The leader's half of the step machine, and the failure handling of the step protocol.

:class:`LeaderDuties` is a mixin of ``daisyweb.protocol.sync.StepMachine``: the state is
the machine's, this module holds its leader-only and repair methods. At each boundary the
leader waits for every live participant's hashes, offers joiners a snapshot, runs the
sync guard (``judge.judge``) and names the roster; in flight it amends a dead member away.

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

from collections.abc import Callable
from typing import TYPE_CHECKING

from daisyweb.protocol import wire
from daisyweb.protocol.actions import Action, Excluded, Send, SendSnapshot
from daisyweb.protocol.capacity import bounded_speeds, capacity_shares
from daisyweb.protocol.deadline import Deadline
from daisyweb.protocol.election import Leadership
from daisyweb.protocol.judge import HaltRun, judge
from daisyweb.protocol.ledger import InFlight, StepLedger
from daisyweb.protocol.membership import Membership

if TYPE_CHECKING:
    from daisyweb.protocol.hashes import HashCheck

__all__ = ["LeaderDuties", "SNAPSHOT_WAIT_FLOOR_S"]

SNAPSHOT_WAIT_FLOOR_S = 10.0
"""The least the group waits for a joiner to confirm its snapshot: three times the
longest confirmation seen, never less than this."""


class LeaderDuties:
    """Leader and repair methods of ``StepMachine`` (see the module docstring)."""

    self_id: str
    total_steps: int
    repair_after: float
    members: Membership
    _ledger: StepLedger
    _published: set[int]

    if TYPE_CHECKING:  # provided by StepMachine
        boundary: int
        is_leader: bool
        leader: str
        term: int
        leadership: Leadership
        unit: str
        _observed: dict[str, float]
        _confirm_s: float
        deadline: Deadline
        _stop: Callable[[list[Action], int, str, bool], None]
        _finish: Callable[[list[Action], int], None]
        _set_roster: Callable[..., None]
        capacity: bool
        batch: int
        hash_check: HashCheck
        _valid_hashes: Callable[[int], dict[str, tuple[str, str]]]

    def _request_repairs(self, out: list[Action], st: InFlight, now: float) -> None:
        """Ask for each roster member's contribution still missing (at most once per
        ``repair_after``)."""
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
                    self._amend(out, self.boundary, p, now)
                else:
                    # Nobody to ask but the sender itself.
                    out.append(Send((p,), wire.RepairRequest(self.boundary, p)))
            else:
                out.append(Send((self.leader,), wire.RepairRequest(self.boundary, p)))

    def _on_repair_request(
        self, out: list[Action], peer: str, msg: wire.RepairRequest, now: float
    ) -> None:
        st = self._ledger.get(msg.step)
        if not self.is_leader:
            # A follower only resends its own contribution (the leader asks when it lacks
            # it).
            own = st.payloads.get(self.self_id) if st else None
            if msg.sender_of_missing == self.self_id and peer == self.leader and own:
                out.append(Send((peer,), wire.Contribution(msg.step, self.self_id, own)))
            return
        payload = self._ledger.payload(msg.step, msg.sender_of_missing)
        if payload is not None:
            out.append(Send((peer,), wire.Contribution(msg.step, msg.sender_of_missing,
                                                       payload)))
        elif msg.step == self.boundary and not self.members.alive(msg.sender_of_missing):
            self._amend(out, msg.step, msg.sender_of_missing, now)

    def _amend(self, out: list[Action], step: int, dead: str, now: float,
               why: str = "") -> None:
        """Name ``step``'s roster again without ``dead`` (left, or late: ``why``)."""
        st = self._ledger.get(step)
        if st is None or st.roster is None or dead not in st.roster or dead in st.payloads:
            return
        members = tuple(p for p in st.roster if p != dead)
        if not members:
            return
        shares = _kept_shares(st, members)
        out.append(Excluded(dead, why or f"{dead} left before its contribution of "
                                         f"{self.unit} {step} arrived"))
        roster = wire.Roster(step, members, shares, self.term)
        out.append(Send(self.members.others(members), roster))
        self._set_roster(out, step, members, now, shares)

    def _enforce_deadline(self, out: list[Action], now: float) -> None:
        """Leader: leave out of the round in flight each live member whose contribution
        is later than the deadline (``deadline``); drop one that keeps missing it."""
        b = self.boundary
        st = self._ledger.get(b)
        if st is None or st.roster is None or st.named_at is None:
            return
        limit = self.deadline.seconds()
        if now - st.named_at < limit:
            return
        for p in [p for p in st.roster if p not in st.payloads and self.members.alive(p)]:
            if p == self.self_id:
                continue  # our own comes when it comes: we are the one who waits
            self._amend(out, b, p, now, f"{p} missed the deadline of {self.unit} {b} "
                                        f"({limit:.1f} s); left out of it")
            if self.deadline.missed(p):
                self._exclude(out, b, p, f"{p} missed the deadline of "
                                         f"{self.deadline.misses[p]} {self.unit}s in a row")
            else:
                # Nor is it waited for at the next boundary: it comes back as a joiner
                # (it finds the group gone on without it, or wakes cut off).
                self.members.leave(p)

    def _lead(self, out: list[Action], b: int, now: float) -> None:
        st = self._ledger.get(b)
        if b in self._published:
            # Step in flight: a member that died before sending is amended away.
            if st is not None and st.roster is not None:
                for p in st.roster:
                    if not self.members.alive(p) and p not in st.payloads:
                        self._amend(out, b, p, now)
                        return
            return
        if st is not None and st.roster is not None:
            # We took over mid-step: re-issue the roster we were working on.
            self._published.add(b)
            members = tuple(p for p in st.roster if self.members.alive(p) or p in st.payloads)
            shares = _kept_shares(st, members)
            roster = wire.Roster(b, members, shares, self.term)
            out.append(Send(self.members.others(members), roster))
            self._set_roster(out, b, members, now, shares)
            self._lead(out, b, now)
            return
        have = self._valid_hashes(b)
        expected = self.members.live_participants()
        if any(p not in have for p in expected):
            return
        if b < self.total_steps:
            # Joiners get a snapshot of this boundary before its roster is named.
            out.extend(SendSnapshot(p, b) for p in self.members.offer_snapshots(b, now))
            # The group waits for a joiner's confirmation no longer than a snapshot takes
            # (measured); a later one finds the group gone on and asks again (rejoins).
            wait = max(SNAPSHOT_WAIT_FLOOR_S, 3.0 * self._confirm_s)
            if any(p not in have and now - self.members.pending.get(p, now) < wait
                   for p in self.members.offered_at(b)):
                return
        joiners = [p for p in self.members.offered_at(b) if p in have]
        for p in joiners:  # how long a snapshot took, offer to confirmation
            self._confirm_s = max(self._confirm_s, now - self.members.pending.get(p, now))
        if not self._judge(out, b, have, expected, joiners):
            return
        self.members.admit(joiners)
        if b >= self.total_steps:
            self._finish(out, b)
            return
        members = tuple(self.members.live_participants())
        self._published.add(b)
        shares: tuple[int, ...] = ()
        if self.capacity:
            last = self._ledger.committed_shares.get(b - 1, ())
            previous = last if self._ledger.committed.get(b - 1) == members else ()
            speeds = bounded_speeds(self.hash_check.book.speeds.get(b, {}), self._observed)
            shares = capacity_shares(members, speeds, self.batch, previous)
        out.append(Send(self.members.others(members), wire.Roster(b, members, shares, self.term)))
        self._set_roster(out, b, members, now, shares)

    def _judge(
        self,
        out: list[Action],
        b: int,
        have: dict[str, tuple[str, str]],
        expected: list[str],
        joiners: list[str],
    ) -> bool:
        """Leader's sync guard at boundary ``b`` (``judge.judge``); False if the run stopped."""
        for ruling in judge(b, self.self_id, have, expected, joiners, self.members.excluded,
                            self.unit):
            if isinstance(ruling, HaltRun):
                self._stop(out, b, self._attributed(b, have, expected) or ruling.reason, True)
                return False
            self._exclude(out, b, ruling.peer, ruling.reason)
        return True

    def _attributed(self, b: int, have: dict[str, tuple[str, str]],
                    expected: list[str]) -> str | None:
        """A fork at ``b`` that a member's two different contributions explain: why."""
        own = have[self.self_id][0]
        for p in expected:
            roster = self._ledger.committed_roster(b - 1)
            reason = (self.hash_check.equivocation(b, p, roster) if have[p][0] != own
                      else None)
            if reason is not None:
                return reason
        return None

    def _exclude(self, out: list[Action], b: int, peer: str, reason: str) -> None:
        self.members.exclude(peer)
        out.append(Send((peer,), wire.Halt(b, f"excluded: {reason}")))
        out.append(Excluded(peer, reason))


def _kept_shares(st: InFlight, members: tuple[str, ...]) -> tuple[int, ...]:
    """The shares of ``members`` as the step's roster first named them: contributions
    already computed over them are never reweighted."""
    if not st.shares or st.roster is None:
        return ()
    return tuple(st.shares[st.roster.index(p)] for p in members)
