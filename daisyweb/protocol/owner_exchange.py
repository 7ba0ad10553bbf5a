"""The owner exchange in the step machine: who sends which part where, who reduces, who
commits on what, and how a lost part is found again.

The math is ``protocol.owners``; this is its protocol, a collaborator of
``sync.StepMachine`` as ``leading.Leader`` is. A roster that names ``owners`` (one per
part, as many parts as the step's first roster had members) runs a step this way:

1. Each member sends part ``j`` of its encoded contribution (``wire.OwnedPart``) to
   ``owners[j]`` and keeps its whole payload (to send a part again).
2. The owner of part ``j`` waits for exactly the roster's parts, reduces them in roster
   order (each clipped against the part's median norm) and sends the encoded mean
   (``wire.MeanPart``, tagged with the roster it was reduced over) to every member.
3. A member commits when it holds, for every part, the mean from the part's owner
   reduced over the current roster: it decodes those bytes (its own parts' too) into the
   mean it applies, so every member applies the same values.

Repair, in the shape of all-to-all's (``protocol.leading``): an owner that lacks a part
asks its sender (``wire.PartRequest``, a copy to the leader); a member that lacks a mean
asks the leader (``wire.MeanRequest``), which relays the mean it holds. A member the
leader still waits for that is gone (its part to the leader's parts, or the mean of a
part it owns) is amended away: out of the roster, its parts handed to the next owner in
part order that is alive (``membership.successor``). Every member sends that owner its
part again; owners whose roster changed reduce again (from the same residual: the
owner's error feedback moves only at a commit, ``owners.MeanEncoder``); a member that
already committed the step rolls back and commits the amended roster's means.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from daisyweb.protocol import wire
from daisyweb.protocol.actions import Action, Send
from daisyweb.protocol.averaging import GradientError
from daisyweb.protocol.codec import Codec, check_payload
from daisyweb.protocol.ledger import InFlight
from daisyweb.protocol.membership import successor
from daisyweb.protocol.owners import (
    MeanEncoder,
    assemble_mean,
    mean_out_of_bounds,
    part_bounds,
    part_norms,
    part_payload,
    reduce_part,
)
from daisyweb.rules import EXCHANGES, OWNER_FROM

if TYPE_CHECKING:
    from daisyweb.protocol.sync import StepMachine

__all__ = ["EXCHANGES", "OWNER_FROM", "OwnerExchange", "hand_over"]  # (the first two: rules)

EARLY_PER_SENDER = 8
"""Parts a member keeps from one sender before they are its to reduce (an honest sender
sends a member the parts it owns: one, and a lost owner's now and then)."""


@lru_cache(maxsize=64)
def _bounds(size: int, parts: int) -> tuple[slice, ...]:
    return tuple(part_bounds(size, parts))


def hand_over(owners: tuple[str, ...], gone: str, members: tuple[str, ...]) -> tuple[str, ...]:
    """``owners`` with ``gone``'s parts handed to the next owner after it (in part order,
    cyclic) that is one of ``members``: every member picks the same."""
    heir = successor(owners, gone, lambda p: p in members and p != gone)
    if heir is None:
        heir = members[0]
    return tuple(heir if o == gone else o for o in owners)


class OwnerExchange:
    """The owner exchange's half of one step machine (module docstring)."""

    def __init__(self, machine: StepMachine, codec: Codec) -> None:
        self.machine = machine
        self.codec = codec  # the run's codec without a sender's error feedback
        self.encoder = MeanEncoder(codec, machine.replica.size)
        self.clipped: dict[int, set[str]] = {}  # step -> members clipped in parts we reduced

    # ------------------------------------------------------------------ helpers
    def _bounds(self, st: InFlight) -> tuple[slice, ...]:
        return _bounds(self.machine.replica.size, len(st.owners))

    @staticmethod
    def roster_hash(st: InFlight) -> str:
        """What a mean of this step must have been reduced over: members, shares, cut."""
        return wire.cut_digest(st.roster or (), st.shares, len(st.owners))

    def waits_for(self, st: InFlight, peer: str) -> bool:
        """This member still lacks something only ``peer`` can give: its part of a part we
        reduce, or the mean of a part it owns (reduced over the current roster)."""
        me = self.machine.self_id
        if any(peer not in st.parts.get(j, {}) for j in st.reduces(me)):
            return True
        rh = self.roster_hash(st)
        return any(st.mean_of(j, rh) is None for j in st.reduces(peer))

    # ------------------------------------------------------------------ sending
    def contribute(self, out: list[Action], step: int, st: InFlight) -> None:
        """Our payload of ``step`` was accepted: each part to its owner."""
        self._send_parts(out, step, st, range(len(st.owners)))
        self.try_reduce(out, step)

    def _send_parts(self, out: list[Action], step: int, st: InFlight, which: range | list[int],
                    ) -> None:
        m = self.machine
        own = st.payloads.get(m.self_id)
        if own is None:
            return
        bounds = self._bounds(st)
        for j in which:
            piece = part_payload(self.codec, own, m.replica.size, bounds[j])
            if st.owners[j] == m.self_id:
                st.parts.setdefault(j, {})[m.self_id] = piece
            else:
                out.append(Send((st.owners[j],),
                                wire.OwnedPart(step, m.self_id, j, len(st.owners), piece)))

    def roster_named(self, out: list[Action], step: int, st: InFlight,
                     old_owners: tuple[str, ...], now: float) -> None:
        """``st``'s roster was (re)named: drop what its members no longer send, check the
        parts that came before it, send parts whose owner changed, reduce what we can."""
        members = st.roster or ()
        st.payloads = {p: g for p, g in st.payloads.items() if p == self.machine.self_id}
        st.unchecked.clear()
        for j in list(st.parts):
            if st.owners[j] != self.machine.self_id:
                del st.parts[j]  # handed over (we reduce it no longer)
            else:
                st.parts[j] = {p: g for p, g in st.parts[j].items() if p in members}
        named = (st.roster, st.owners)
        self._check_means(out, step, st, now)
        if self.machine.done or (st.roster, st.owners) != named:
            return  # (an owner refused: the roster was amended, and taken, meanwhile)
        early, st.early = st.early, {}
        for (sender, parts, j), payload in early.items():
            if parts == len(st.owners):
                self._take_part(out, step, st, sender, j, payload, None)
            elif self.machine.done:
                return
            else:
                _keep_early(st, sender, parts, j, payload)
        if self.machine.done:
            return
        # (none of ours yet at a first roster; all of them again on a new cut)
        moved = [j for j, o in enumerate(st.owners) if not old_owners or o != old_owners[j]]
        if old_owners:
            st.handed.update((j, now) for j in moved)
        self._send_parts(out, step, st, moved)
        self.try_reduce(out, step)

    # ------------------------------------------------------------------ receiving
    def on_part(self, out: list[Action], peer: str, msg: wire.OwnedPart, now: float) -> None:
        m = self.machine
        if msg.sender != peer or msg.step != m.boundary:
            return  # parts are never relayed; other steps' are stale
        st = m.ledger.open(msg.step)
        if st.roster is None or msg.parts != len(st.owners):
            # Cut by a roster that has not reached us: waits, unchecked, for it
            _keep_early(st, peer, msg.parts, msg.part, msg.payload)
            return
        self._take_part(out, msg.step, st, peer, msg.part, msg.payload, now)
        self.try_reduce(out, msg.step)

    def _take_part(self, out: list[Action], step: int, st: InFlight, sender: str, j: int,
                   payload: bytes, now: float | None) -> None:
        m = self.machine
        if (sender not in (st.roster or ()) or not st.owners or j >= len(st.owners)
                or sender in st.parts.get(j, {})):
            return  # not a member's, not a part, or a copy
        if st.owners[j] != m.self_id:
            # Sent after an amendment that has not reached us yet (it hands us the part)
            _keep_early(st, sender, len(st.owners), j, payload)
            return
        where = self._bounds(st)[j]
        try:
            check_payload(self.codec, payload, where.stop - where.start,
                          f"part {j} from {sender}")
        except GradientError as exc:
            m.stop_run(out, step, f"refused at {m.unit} {step}: {exc}", broadcast=True)
            return
        st.parts.setdefault(j, {})[sender] = payload
        if now is not None:
            st.arrived.setdefault(sender, now)

    def on_mean(self, out: list[Action], peer: str, msg: wire.MeanPart, now: float) -> None:
        m = self.machine
        if msg.owner != peer and peer != m.leader:
            return  # only the leader relays
        if msg.step not in (m.boundary, m.boundary - 1):
            return  # (the step before ours: an amendment may roll it back)
        st = m.ledger.open(msg.step)
        st.means[(msg.part, msg.owner)] = (msg.roster_hash, msg.norms, msg.payload)
        st.checked.discard((msg.part, msg.owner, msg.roster_hash))  # these bytes: unchecked
        if msg.step == m.boundary:
            self._check_means(out, msg.step, st, now)

    def _check_means(self, out: list[Action], step: int, st: InFlight, now: float) -> None:
        """Check each mean reduced over the current roster by its part's owner against its
        bound (``owners.mean_out_of_bounds``). One out of bounds is never applied: the
        leader amends its owner away and excludes it (it sent the same bytes to every
        member, or it equivocated: either way it is not honest); a member asks the leader
        for the leader's copy."""
        m = self.machine
        if st.roster is None or not st.owners:
            return
        rh = self.roster_hash(st)
        bounds = self._bounds(st)
        for (j, owner), (h, norms, payload) in list(st.means.items()):
            if (h != rh or j >= len(st.owners) or st.owners[j] != owner
                    or (j, owner, h) in st.checked):
                continue
            where = bounds[j]
            why = mean_out_of_bounds(self.codec, payload, where.stop - where.start, norms,
                                     len(st.roster))
            if why is None:
                st.checked.add((j, owner, h))
                continue
            del st.means[(j, owner)]
            reason = f"{owner}'s mean of part {j} of {m.unit} {step} refused: {why}"
            if m.is_leader:
                m.leading.amend(out, step, owner, now, reason)
                m.leading.exclude(out, step, owner, reason)
                return  # the amendment checked what is left
            out.append(Send((m.leader,), wire.MeanRequest(step, j)))

    def on_part_request(self, out: list[Action], peer: str, msg: wire.PartRequest,
                        now: float) -> None:
        m = self.machine
        st = m.ledger.get(msg.step)
        if st is None or st.roster is None or msg.part >= len(st.owners):
            return
        if msg.sender == m.self_id:
            if st.owners[msg.part] == peer:
                self._send_parts(out, msg.step, st, [msg.part])
            return
        if m.is_leader and msg.step == m.boundary and not m.members.alive(msg.sender):
            m.leading.amend(out, msg.step, msg.sender, now)

    def on_mean_request(self, out: list[Action], peer: str, msg: wire.MeanRequest,
                        now: float) -> None:
        m = self.machine
        st = m.ledger.get(msg.step)
        if not m.is_leader or st is None or st.roster is None or msg.part >= len(st.owners):
            return
        rh = self.roster_hash(st)
        owner = st.owners[msg.part]
        payload = st.mean_of(msg.part, rh)
        if payload is not None:
            norms = st.means[(msg.part, owner)][1]
            out.append(Send((peer,), wire.MeanPart(msg.step, owner, msg.part, rh, norms,
                                                   payload)))
        elif msg.step == m.boundary and not m.members.alive(owner):
            m.leading.amend(out, msg.step, owner, now)

    # ------------------------------------------------------------------ reducing
    def try_reduce(self, out: list[Action], step: int) -> None:
        """Reduce each part we own whose parts are all in and whose mean over the current
        roster we have not sent yet, and send it to every member."""
        m = self.machine
        st = m.ledger.get(step)
        if st is None or st.roster is None or m.done:
            return
        rh = self.roster_hash(st)
        bounds = self._bounds(st)
        for j in st.reduces(m.self_id):
            got = st.parts.get(j, {})
            if st.reduced.get(j) == rh or any(p not in got for p in st.roster):
                continue
            where = bounds[j]
            payloads = [got[p] for p in st.roster]
            try:
                norms2 = part_norms(self.codec, payloads, where.stop - where.start, st.roster)
                mean, clipped = reduce_part(self.codec, payloads, where.stop - where.start,
                                            st.shares, True, st.roster, norms2)
            except GradientError as exc:
                m.stop_run(out, step, f"refused at {m.unit} {step}: {exc}", broadcast=True)
                return
            if not np.isfinite(mean).all():
                m.stop_run(out, step, f"the mean of part {j} of {m.unit} {step} is not "
                                      f"finite (parts of {', '.join(st.roster)})", True)
                return
            self.clipped.setdefault(step, set()).update(st.roster[i] for i in clipped)
            payload = self.encoder.offer(step, where, mean)
            st.reduced[j] = rh
            norms = tuple(norms2)
            st.means[(j, m.self_id)] = (rh, norms, payload)
            st.checked.add((j, m.self_id, rh))
            others = tuple(p for p in st.roster if p != m.self_id)
            if others:
                out.append(Send(others, wire.MeanPart(step, m.self_id, j, rh, norms, payload)))

    def mean(self, out: list[Action], step: int,
             st: InFlight) -> tuple[np.ndarray, tuple[str, ...]] | None:
        """The step's mean from the owners' bytes and the digests of those bytes (part
        order, for the boundary's hashes), once every part's mean is in (None until then,
        or if the run stopped on a bad one)."""
        m = self.machine
        rh = self.roster_hash(st)
        payloads = [st.mean_of(j, rh) for j in range(len(st.owners))]
        if any(p is None for p in payloads):
            return None
        try:
            mean = assemble_mean(self.codec, payloads, self._bounds(st), m.replica.size,
                                 st.owners)  # type: ignore[arg-type]
        except GradientError as exc:
            m.stop_run(out, step, f"refused the mean of {m.unit} {step}: {exc}", True)
            return None
        return mean, tuple(wire.payload_digest(p) for p in payloads)  # type: ignore[arg-type]

    def committed(self, step: int, st: InFlight) -> tuple[str, ...]:
        """``step`` committed: our parts' residuals move; who we clipped in them."""
        bounds = self._bounds(st)
        self.encoder.commit(step, [bounds[j].start for j in st.reduces(self.machine.self_id)])
        clipped = self.clipped.pop(step, set())
        self.clipped = {s: c for s, c in self.clipped.items() if s > step}
        return tuple(p for p in st.roster or () if p in clipped)

    def rolled_back(self, step: int) -> None:
        self.encoder.rollback(step)

    # ------------------------------------------------------------------ repair
    def request_repairs(self, out: list[Action], st: InFlight, now: float) -> None:
        """Ask for each part and each mean still missing (at most once per
        ``repair_after``): parts from their senders (and the leader), means from the
        leader; a leader amends away a member that is gone."""
        m = self.machine
        step = m.boundary
        roster = st.roster or ()
        for j in st.reduces(m.self_id):
            for p in roster:
                if p in st.parts.get(j, {}) or not _due(st.requested, p, now, m.repair_after):
                    continue
                if m.is_leader and not m.members.alive(p):
                    m.leading.amend(out, step, p, now)
                    return
                ask = wire.PartRequest(step, j, p)
                to = (p,) if m.is_leader or m.leadership.candidate else (p, m.leader)
                out.append(Send(to, ask))
        rh = self.roster_hash(st)
        for j, owner in enumerate(st.owners):
            if owner == m.self_id or st.mean_of(j, rh) is not None:
                continue
            if not _due(st.asked_means, j, now, m.repair_after) or m.leadership.candidate:
                continue
            if m.is_leader:
                if not m.members.alive(owner):
                    m.leading.amend(out, step, owner, now)
                    return
            else:
                out.append(Send((m.leader,), wire.MeanRequest(step, j)))


def _keep_early(st: InFlight, sender: str, parts: int, j: int, payload: bytes) -> None:
    """Keep a part that is not ours to reduce yet, at most EARLY_PER_SENDER per sender
    (the oldest goes)."""
    mine = [k for k in st.early if k[0] == sender]
    if len(mine) >= EARLY_PER_SENDER:
        del st.early[mine[0]]
    st.early[(sender, parts, j)] = payload


def _due(asked: dict, key: object, now: float, every: float) -> bool:
    """Whether to ask for ``key`` now (and note that we did)."""
    last = asked.get(key)
    if last is not None and now - last < every:
        return False
    asked[key] = now
    return True
