"""The group step protocol as a pure state machine (no asyncio, no sockets, no clock).

One :class:`StepMachine` per peer. The driver (``daisyweb.peer.run``) feeds it events --
a message from a peer, a peer going down or coming up, the local gradient being ready,
a timer tick -- and carries out the actions it returns (:class:`Send`, :class:`Compute`,
:class:`Commit`, :class:`SendSnapshot`, :class:`Excluded`, :class:`Finish`,
:class:`Stopped`). Every event method takes ``now`` (seconds, any monotonic origin) so
timeouts are deterministic in tests.

Steps and boundaries
--------------------
``replica.step`` is the number of committed updates: the *boundary* ``b``. Step ``b`` is
the update that takes the weights from boundary ``b`` to ``b + 1``. Per step:

1. At boundary ``b`` every participant publishes ``StepHashes(b, weight_hash,
   probe_hash)`` to everyone. The probe is run *before* the peer's next gradient is
   computed, so a broken kernel is caught before that gradient can be used.
2. The leader waits for the hashes of every live participant (and of peers joining at
   this boundary). Any weight-hash mismatch halts the run, naming the peers that differ
   from the majority. A probe hash that differs from the majority gets that peer
   excluded (it is told with a ``Halt`` addressed to it alone). Then the leader names
   the roster: ``Roster(b, members)``, members in a fixed order (the order of joining).
3. Each member computes its gradient and sends ``Gradient(b, self, payload)`` to every
   other member. A member waits for *exactly* the roster's gradients; a wrong length or
   any NaN/Inf halts the run at step ``b`` with the replica untouched. When all are
   present they are summed in roster order (``average_in_roster_order``) and applied:
   the step is committed only then. Never a partial average.
4. Followers check every hash published by a member of the last roster against their
   own; any mismatch halts (each peer independently, so a fork stops everyone even if
   the leader's ``Halt`` is lost).

Failures (part 2)
-----------------
- Repair: a member missing a roster gradient ``repair_after`` seconds after it sent its
  own asks the leader (``RepairRequest``). The leader keeps the raw payloads of the last
  ``history`` steps and resends them bit-exact (a ``Gradient`` whose ``sender`` is the
  original sender, relayed by the leader -- the only relay accepted). A leader missing
  a live member's gradient asks that member, which resends its own.
- Amendment: if the leader lacks the gradient too and its sender is down, it re-issues
  ``Roster(b, members - {dead})``; everyone averages over the amended roster. A member
  that already committed step ``b`` with the old roster rolls back to its backup of
  boundary ``b`` (kept until the next roster confirms the step) and recommits.
- Dead follower: removed from the participants, so absent from the next roster; the
  step in flight is completed by amendment if its gradient never arrived.
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

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from daisyweb.protocol import wire
from daisyweb.protocol.averaging import GradientError, average_in_roster_order, check_gradient

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
    "StepMachine",
    "grad_to_payload",
    "payload_to_grad",
    "successor",
]

HISTORY = 8  # steps of gradients the leader keeps for repair


class Replica(Protocol):
    """What the machine needs of the training state (``train.TrainState`` fits).

    ``backup``/``restore`` are optional: without them an amendment of an already
    committed step halts instead of rolling back.
    """

    @property
    def step(self) -> int: ...

    @property
    def size(self) -> int: ...

    def apply(self, average: np.ndarray) -> None: ...

    def weight_hash(self) -> str: ...


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Send:
    """Send ``message`` to ``to`` (peer ids); ``to=None`` means every connected peer."""

    to: tuple[str, ...] | None
    message: wire.Message


@dataclass(frozen=True)
class Compute:
    """Compute the local gradient for ``step``; answer with ``local_gradient``."""

    step: int


@dataclass(frozen=True)
class Commit:
    """Step ``step`` was applied: the replica is now at boundary ``step + 1``.

    ``rollback`` is True when this commit replaces an earlier one of the same step
    (an amended roster); the driver should overwrite that step's record.
    """

    step: int
    roster: tuple[str, ...]
    loss: float | None
    weight_hash: str
    probe_hash: str
    rollback: bool = False


@dataclass(frozen=True)
class SendSnapshot:
    """Leader only: send config + snapshot of the current boundary ``step`` to ``peer``."""

    peer: str
    step: int


@dataclass(frozen=True)
class Excluded:
    """``peer`` was removed from the group (informational; already acted on)."""

    peer: str
    reason: str


@dataclass(frozen=True)
class Finish:
    """The run reached its last step with every member's hashes agreeing."""

    step: int


@dataclass(frozen=True)
class Stopped:
    """The run halted at ``step`` on this peer; the replica is a valid state."""

    step: int
    reason: str


Action = Send | Compute | Commit | SendSnapshot | Excluded | Finish | Stopped


# ----------------------------------------------------------------------------- helpers


def grad_to_payload(grad: np.ndarray) -> bytes:
    """float32 vector -> little-endian bytes (what ``wire.Gradient.payload`` holds)."""
    return np.ascontiguousarray(grad, dtype="<f4").tobytes()


def payload_to_grad(payload: bytes) -> np.ndarray:
    """Inverse of :func:`grad_to_payload` (a native float32 copy, writable)."""
    return np.frombuffer(payload, dtype="<f4").astype(np.float32)


def successor(roster: Sequence[str], old_leader: str, alive: Callable[[str], bool]) -> str | None:
    """Next live peer after ``old_leader`` in ``roster`` order (cyclic), or None."""
    members = list(roster)
    start = members.index(old_leader) + 1 if old_leader in members else 0
    for i in range(len(members)):
        p = members[(start + i) % len(members)]
        if p != old_leader and alive(p):
            return p
    return None


@dataclass
class _Step:
    """Everything known about one step in flight."""

    roster: tuple[str, ...] | None = None
    grads: dict[str, bytes] = field(default_factory=dict)
    own_sent_at: float | None = None
    requested: dict[str, float] = field(default_factory=dict)
    computing: bool = False


class StepMachine:
    """One peer's view of the step protocol (see module docstring)."""

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
    ) -> None:
        self.self_id = self_id
        self.version = version  # what this peer speaks (a test hook may change it)
        self.replica = replica
        self.total_steps = total_steps
        self.probe = probe
        self.leader = leader
        self.repair_after = repair_after
        self.join_timeout = join_timeout
        self.history = history
        # Participants in join order: who the leader puts in the next roster. Followers
        # keep it too (learned from rosters) so they can pick the same successor.
        self.participants: list[str] = list(dict.fromkeys([*members, self_id]))
        self.down: set[str] = set()
        self.done = False  # finished or halted: every later event is ignored
        self._steps: dict[int, _Step] = {}
        # boundary -> peer -> (weight hash, probe hash, roster hash), latest message wins
        self._hashes: dict[int, dict[str, tuple[str, str, str]]] = {}
        self._own_hashes: dict[int, tuple[str, str]] = {}
        self._losses: dict[int, float] = {}
        self._last_roster: tuple[str, ...] = tuple(self.participants)
        self._had_roster = False  # a follower knows the group's order only from a roster
        self._rosters_seen: dict[tuple[str, int], tuple[str, ...]] = {}  # (from, step)
        self._committed: dict[int, tuple[str, ...]] = {}  # step -> roster used
        self._backup: tuple[int, Any] | None = None  # (boundary, replica.backup())
        self._published: set[int] = set()  # boundaries whose roster the leader issued
        self._pending: dict[str, float] = {}  # joiner -> time announced
        self._offered: dict[str, int] = {}  # joiner -> boundary its snapshot is for
        self._excluded: set[str] = set()

    # ------------------------------------------------------------------ properties
    @property
    def is_leader(self) -> bool:
        return self.leader == self.self_id

    @property
    def boundary(self) -> int:
        return self.replica.step

    def roster(self, step: int) -> tuple[str, ...] | None:
        s = self._steps.get(step)
        return s.roster if s else self._committed.get(step)

    # ------------------------------------------------------------------ events
    def start(self, now: float = 0.0) -> list[Action]:
        """The replica is ready (fresh, resumed or loaded from a snapshot)."""
        out: list[Action] = []
        self._publish_hashes(out)
        self._progress(out, now)
        return out

    def local_gradient(
        self, step: int, loss: float, grad: np.ndarray, now: float = 0.0
    ) -> list[Action]:
        """The driver finished a :class:`Compute` for ``step``."""
        out: list[Action] = []
        st = self._steps.get(step)
        if self.done or st is None or step != self.boundary or not st.computing:
            return out  # stale (e.g. the step was rolled forward by an amendment)
        st.computing = False
        payload = grad_to_payload(grad)
        self._losses[step] = float(loss)
        # Our own gradient goes through the same checks as everyone else's: a local
        # NaN halts here before anything leaves the machine.
        if not self._accept_gradient(out, step, self.self_id, payload):
            return out
        st.own_sent_at = now
        others = tuple(p for p in st.roster or () if p != self.self_id)
        if others:
            out.append(Send(others, wire.Gradient(step, self.self_id, payload)))
        self._progress(out, now)
        return out

    def message(self, peer: str, msg: wire.Message, now: float = 0.0) -> list[Action]:
        """A decoded message from ``peer``."""
        out: list[Action] = []
        if self.done or peer in self._excluded:
            return out
        if isinstance(msg, wire.Hello):
            self._on_hello(out, peer, msg)
        elif isinstance(msg, wire.StepHashes):
            self._on_hashes(out, peer, msg)
        elif isinstance(msg, wire.Roster):
            self._rosters_seen[(peer, msg.step)] = msg.members
            if peer == self.leader and not self.is_leader:
                self._on_roster(out, msg.step, msg.members, now)
        elif isinstance(msg, wire.Gradient):
            self._on_gradient(out, peer, msg)
        elif isinstance(msg, wire.RepairRequest):
            self._on_repair_request(out, peer, msg, now)
        elif isinstance(msg, wire.Halt):
            # Any participant may stop the group: one that refused a gradient is the
            # only one that knows (the sender's own copy may be fine). Joiners may not.
            if peer == self.leader or peer in self.participants:
                self._stop(out, msg.step, f"{peer}: {msg.reason}", broadcast=False)
        if not self.done:
            self._progress(out, now)
        return out

    def halt(self, step: int, reason: str) -> list[Action]:
        """This peer cannot go on (e.g. its gradient computation failed): tell the group
        and stop at ``step`` with the state untouched."""
        out: list[Action] = []
        self._stop(out, step, reason, broadcast=True)
        return out

    def peer_down(self, peer: str, now: float = 0.0) -> list[Action]:
        """The mesh lost ``peer`` (heartbeat timeout or closed channel)."""
        out: list[Action] = []
        if self.done or peer in self.down or peer == self.self_id:
            return out
        self.down.add(peer)
        self._pending.pop(peer, None)
        self._offered.pop(peer, None)
        if peer in self.participants:
            self.participants.remove(peer)
        if peer == self.leader and not self._had_roster:
            # No roster yet, so no agreed order to pick a successor from: every
            # follower would pick itself (split brain). Stop instead; nothing is lost.
            self._stop(out, self.boundary, f"the leader {peer} left before the first roster",
                       broadcast=False)
            return out
        if peer == self.leader:
            roster = self.roster(self.boundary) or self._last_roster
            new = successor(roster, peer, self._alive)
            if new is None:
                new = next((p for p in self.participants if self._alive(p)), self.self_id)
            self.leader = new
            if self.is_leader:
                # Re-issue what the old leader may not have finished issuing.
                self._published = {b for b in self._published if b < self.boundary}
            else:
                seen = self._rosters_seen.get((new, self.boundary))
                if seen is not None:
                    self._on_roster(out, self.boundary, seen, now)
        self._progress(out, now)
        return out

    def peer_up(self, peer: str, now: float = 0.0) -> list[Action]:
        """Leader: an admitted peer is connected and waits for a snapshot."""
        out: list[Action] = []
        if self.done or not self.is_leader or peer == self.self_id:
            return out
        if peer in self.participants or peer in self._excluded:
            return out
        self.down.discard(peer)
        self._pending.setdefault(peer, now)
        self._progress(out, now)
        return out

    def tick(self, now: float) -> list[Action]:
        """Timers: repair requests and join timeouts."""
        out: list[Action] = []
        if self.done:
            return out
        st = self._steps.get(self.boundary)
        if st is not None and st.roster is not None and st.own_sent_at is not None:
            if now - st.own_sent_at >= self.repair_after:
                for p in st.roster:
                    if p in st.grads:
                        continue
                    last = st.requested.get(p)
                    if last is not None and now - last < self.repair_after:
                        continue
                    st.requested[p] = now
                    if self.is_leader:
                        if not self._alive(p):
                            self._amend(out, self.boundary, p, now)
                        else:
                            # Nobody to ask but the sender itself.
                            out.append(Send((p,), wire.RepairRequest(self.boundary, p)))
                    else:
                        out.append(Send((self.leader,), wire.RepairRequest(self.boundary, p)))
        for p, t0 in list(self._pending.items()):
            if p in self._offered and now - t0 >= self.join_timeout:
                # A joiner that never confirmed its snapshot must not block the group.
                self._pending.pop(p)
                self._offered.pop(p)
                self._excluded.add(p)
                out.append(Excluded(p, f"{p} did not confirm its snapshot in time"))
        self._progress(out, now)
        return out

    # ------------------------------------------------------------------ internals
    def _alive(self, peer: str) -> bool:
        return peer not in self.down and peer not in self._excluded

    def _stop(self, out: list[Action], step: int, reason: str, broadcast: bool) -> None:
        if self.done:
            return
        self.done = True
        if broadcast:
            out.append(Send(None, wire.Halt(step, reason[: wire.MAX_TEXT_LEN])))
        out.append(Stopped(step, reason))

    def _publish_hashes(self, out: list[Action]) -> None:
        b = self.boundary
        rh = wire.roster_digest(self._committed.get(b - 1))
        hashes = (self.replica.weight_hash(), self.probe())
        self._own_hashes[b] = hashes
        self._hashes.setdefault(b, {})[self.self_id] = (*hashes, rh)
        for old in [k for k in self._own_hashes if k < b - 1]:
            del self._own_hashes[old]
        for old in [k for k in self._hashes if k < b - 1]:
            del self._hashes[old]
        out.append(Send(None, wire.StepHashes(b, self.self_id, *hashes, rh)))
        for peer in list(self._hashes[b]):
            self._check_fork(out, b, peer)

    def _valid_hashes(self, b: int) -> dict[str, tuple[str, str]]:
        """Hashes at ``b`` comparable with ours: made with the roster we applied.

        A hash made with another roster of the same step (an amendment raced it) is
        stale; its sender republishes after recommitting. Joiners publish NO_ROSTER.
        """
        mine = wire.roster_digest(self._committed.get(b - 1))
        return {
            p: (w, pr)
            for p, (w, pr, rh) in self._hashes.get(b, {}).items()
            if rh == mine or (rh == wire.NO_ROSTER and self._offered.get(p) == b)
        }

    def _on_hello(self, out: list[Action], peer: str, msg: wire.Hello) -> None:
        if msg.peer_id != peer or msg.version == self.version:
            return  # a Hello speaks only for its sender; same version: nothing to do
        reason = (f"{peer} speaks protocol version {msg.version}, "
                  f"{self.self_id} speaks {self.version}")
        if peer == self.leader and not self.is_leader:
            self._stop(out, self.boundary, f"refused the leader: {reason}", broadcast=False)
            return
        self._pending.pop(peer, None)
        self._offered.pop(peer, None)
        if self.is_leader:
            self._exclude(out, self.boundary, peer, reason)
            return
        # A follower cannot take anyone out of the roster, but never uses its messages
        # (and never picks it as the next leader); the leader excludes it too.
        self._excluded.add(peer)
        if peer in self.participants:
            self.participants.remove(peer)
        out.append(Excluded(peer, reason))

    def _on_hashes(self, out: list[Action], peer: str, msg: wire.StepHashes) -> None:
        if msg.sender != peer:
            return  # hashes are never relayed
        b = msg.step
        if b < self.boundary - 1 or b > self.boundary + 1:
            return
        self._hashes.setdefault(b, {})[peer] = (msg.weight_hash, msg.probe_hash, msg.roster_hash)
        self._check_fork(out, b, peer)

    def _check_fork(self, out: list[Action], b: int, peer: str) -> None:
        # Each peer judges the members of the step that produced boundary b itself, so
        # a fork stops everyone even if the leader's Halt is lost; joiners and excluded
        # peers are the leader's call.
        own = self._own_hashes.get(b)
        if own is None or peer == self.self_id or b != self.boundary:
            return
        if peer not in self._committed.get(b - 1, ()):
            return
        theirs = self._valid_hashes(b).get(peer)
        if theirs is not None and theirs[0] != own[0]:
            self._stop(
                out,
                b,
                f"weight hash mismatch at step {b}: {peer} has {theirs[0][:16]}, "
                f"{self.self_id} has {own[0][:16]}",
                broadcast=True,
            )

    def _on_roster(
        self, out: list[Action], step: int, members: tuple[str, ...], now: float
    ) -> None:
        b = self.boundary
        for p in members:
            if p not in self.participants:
                self.participants.append(p)
        self._last_roster = members
        self._had_roster = True
        if step == b - 1 and self._committed.get(step) not in (None, members):
            self._rollback(out, step, members, now)
            return
        if step != b:
            return
        if self.self_id not in members:
            self._stop(out, b, f"{self.self_id} is not in the roster of step {b}", False)
            return
        self._set_roster(out, step, members, now)

    def _set_roster(
        self, out: list[Action], step: int, members: tuple[str, ...], now: float
    ) -> None:
        st = self._steps.setdefault(step, _Step())
        old = st.roster
        if old is not None and old != members:
            # Amendment: only removal of senders is allowed; keep what we have.
            if not set(members) <= set(old):
                self._stop(out, step, f"roster of step {step} changed to add members", True)
                return
            st.grads = {p: g for p, g in st.grads.items() if p in members}
        st.roster = members
        self._last_roster = members
        self._had_roster = True
        # Gradients received before the roster from non-members are dropped now.
        st.grads = {p: g for p, g in st.grads.items() if p in members}
        if self.self_id in members and self.self_id not in st.grads and not st.computing:
            st.computing = True
            out.append(Compute(step))

    def _on_gradient(self, out: list[Action], peer: str, msg: wire.Gradient) -> None:
        relayed = msg.sender != peer
        if relayed and peer != self.leader:
            return  # only the leader repairs
        s = msg.step
        if s != self.boundary:
            return  # too old (committed) or too new (cannot happen on ordered channels)
        st = self._steps.setdefault(s, _Step())
        if st.roster is not None and msg.sender not in st.roster:
            return
        if msg.sender in st.grads or msg.sender == self.self_id:
            return
        self._accept_gradient(out, s, msg.sender, msg.payload)

    def _accept_gradient(self, out: list[Action], step: int, sender: str, payload: bytes) -> bool:
        """Validate and store one gradient; halt (state untouched) if it is bad."""
        try:
            check_gradient(payload_to_grad(payload), self.replica.size, f"gradient from {sender}")
        except GradientError as exc:
            self._stop(out, step, f"refused at step {step}: {exc}", broadcast=True)
            return False
        self._steps.setdefault(step, _Step()).grads[sender] = payload
        return True

    def _on_repair_request(
        self, out: list[Action], peer: str, msg: wire.RepairRequest, now: float
    ) -> None:
        st = self._steps.get(msg.step)
        if not self.is_leader:
            # A follower only resends its own gradient (the leader asks when it lacks it).
            own = st.grads.get(self.self_id) if st else None
            if msg.sender_of_missing == self.self_id and peer == self.leader and own:
                out.append(Send((peer,), wire.Gradient(msg.step, self.self_id, own)))
            return
        payload = st.grads.get(msg.sender_of_missing) if st else None
        if payload is not None:
            out.append(Send((peer,), wire.Gradient(msg.step, msg.sender_of_missing, payload)))
        elif msg.step == self.boundary and not self._alive(msg.sender_of_missing):
            self._amend(out, msg.step, msg.sender_of_missing, now)

    def _amend(self, out: list[Action], step: int, dead: str, now: float) -> None:
        st = self._steps.get(step)
        if st is None or st.roster is None or dead not in st.roster or dead in st.grads:
            return
        members = tuple(p for p in st.roster if p != dead)
        if not members:
            return
        out.append(Excluded(dead, f"{dead} died before its gradient of step {step} arrived"))
        out.append(Send(self._others(members), wire.Roster(step, members)))
        self._set_roster(out, step, members, now)

    def _others(self, members: Sequence[str] = ()) -> tuple[str, ...]:
        peers = dict.fromkeys([*self.participants, *members])
        return tuple(p for p in peers if p != self.self_id and self._alive(p))

    def _rollback(self, out: list[Action], step: int, members: tuple[str, ...], now: float) -> None:
        restore = getattr(self.replica, "restore", None)
        if self._backup is None or self._backup[0] != step or restore is None:
            self._stop(out, step, f"roster of committed step {step} was amended", True)
            return
        st = self._steps.get(step)
        if st is None or not set(members) <= set(st.grads):
            self._stop(out, step, f"amended roster of step {step} cannot be rebuilt", True)
            return
        restore(self._backup[1])
        self._committed.pop(step, None)
        self._steps.pop(step + 1, None)
        st.roster = members
        st.grads = {p: g for p, g in st.grads.items() if p in members}
        self._try_commit(out, step, rollback=True)

    def _try_commit(self, out: list[Action], step: int, rollback: bool = False) -> bool:
        st = self._steps.get(step)
        if st is None or st.roster is None or step != self.boundary:
            return False
        if any(p not in st.grads for p in st.roster):
            return False  # exactly the roster's gradients, never a partial average
        grads = [payload_to_grad(st.grads[p]) for p in st.roster]
        backup = getattr(self.replica, "backup", None)
        if backup is not None:
            self._backup = (step, backup())
        self.replica.apply(average_in_roster_order(grads))
        self._committed[step] = st.roster
        for old in [k for k in self._committed if k < step - self.history]:
            del self._committed[old]
        for old in [k for k in self._steps if k < step - self.history + 1]:
            del self._steps[old]
        for key in [k for k in self._rosters_seen if k[1] < step]:
            del self._rosters_seen[key]
        if not self.is_leader:
            # Followers never resend; keep only the step for a possible rollback.
            for k, s in self._steps.items():
                if k < step:
                    s.grads = {}
        self._publish_hashes(out)
        wh, ph = self._own_hashes[self.boundary]
        out.append(Commit(step, st.roster, self._losses.pop(step, None), wh, ph, rollback))
        return True

    def _progress(self, out: list[Action], now: float) -> None:
        """Advance as far as the known facts allow."""
        while not self.done:
            b = self.boundary
            if self._try_commit(out, b):
                continue
            if self.is_leader:
                self._lead(out, b, now)
            elif b >= self.total_steps:
                self._maybe_finish(out, b)
            return

    def _maybe_finish(self, out: list[Action], b: int) -> None:
        have = self._valid_hashes(b)
        prev = self._committed.get(b - 1, ())
        if all(p in have or not self._alive(p) for p in prev):
            self.done = True
            out.append(Finish(b))

    def _lead(self, out: list[Action], b: int, now: float) -> None:
        st = self._steps.get(b)
        if b in self._published:
            # Step in flight: a member that died before sending is amended away.
            if st is not None and st.roster is not None:
                for p in st.roster:
                    if not self._alive(p) and p not in st.grads:
                        self._amend(out, b, p, now)
                        return
            return
        if st is not None and st.roster is not None:
            # We took over mid-step: re-issue the roster we were working on.
            self._published.add(b)
            members = tuple(p for p in st.roster if self._alive(p) or p in st.grads)
            out.append(Send(self._others(members), wire.Roster(b, members)))
            self._set_roster(out, b, members, now)
            self._lead(out, b, now)
            return
        have = self._valid_hashes(b)
        expected = [p for p in self.participants if self._alive(p)]
        if any(p not in have for p in expected):
            return
        if b < self.total_steps:
            # Joiners get a snapshot of this boundary before its roster is named.
            for p in self._pending:
                if p not in self._offered and self._alive(p):
                    self._offered[p] = b
                    self._pending[p] = now
                    out.append(SendSnapshot(p, b))
            waiting = [p for p, ob in self._offered.items() if ob == b and p not in have]
            if waiting:
                return
        joiners = [p for p, ob in self._offered.items() if ob == b and p in have]
        if not self._judge(out, b, have, expected, joiners):
            return
        for p in joiners:
            self._pending.pop(p, None)
            self._offered.pop(p, None)
            if p not in self._excluded and p not in self.participants:
                self.participants.append(p)
        if b >= self.total_steps:
            self.done = True
            out.append(Finish(b))
            return
        members = tuple(p for p in self.participants if self._alive(p))
        self._published.add(b)
        out.append(Send(self._others(members), wire.Roster(b, members)))
        self._set_roster(out, b, members, now)

    def _judge(
        self,
        out: list[Action],
        b: int,
        have: dict[str, tuple[str, str]],
        expected: list[str],
        joiners: list[str],
    ) -> bool:
        """Leader's sync guard at boundary ``b``; False if the run stopped."""
        own_w = have[self.self_id][0]
        # Weights: members must agree exactly. Name the minority when there is a
        # strict majority, otherwise everyone's hash.
        weights = Counter(have[p][0] for p in expected)
        if len(weights) > 1:
            top, n = weights.most_common(1)[0]
            if n * 2 > len(expected):
                bad = [p for p in expected if have[p][0] != top]
                reason = f"weights diverged at step {b}: {', '.join(bad)} differ from the majority"
            else:
                listing = ", ".join(f"{p}={have[p][0][:12]}" for p in expected)
                reason = f"weights diverged at step {b} with no majority: {listing}"
            self._stop(out, b, reason, broadcast=True)
            return False
        for p in joiners:
            if have[p][0] != own_w:
                self._exclude(out, b, p, f"{p}: snapshot weight hash does not match at step {b}")
        # Probes: the majority over everyone judged at this boundary wins.
        judged = expected + [p for p in joiners if p not in self._excluded]
        probes = Counter(have[p][1] for p in judged)
        top, n = probes.most_common(1)[0]
        if n * 2 <= len(judged) and len(probes) > 1:
            listing = ", ".join(f"{p}={have[p][1][:12]}" for p in judged)
            self._stop(out, b, f"kernel probes disagree with no majority: {listing}", True)
            return False
        for p in judged:
            if have[p][1] != top:
                if p == self.self_id:
                    self._stop(out, b, f"leader {p}'s kernel probe differs from the majority", True)
                    return False
                self._exclude(out, b, p, f"{p}: kernel probe hash differs from the majority")
        return True

    def _exclude(self, out: list[Action], b: int, peer: str, reason: str) -> None:
        self._excluded.add(peer)
        if peer in self.participants:
            self.participants.remove(peer)
        out.append(Send((peer,), wire.Halt(b, f"excluded: {reason}")))
        out.append(Excluded(peer, reason))
