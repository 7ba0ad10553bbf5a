"""Pure tests of the step protocol: several StepMachines on an in-process message bus.

Messages go through the real wire codec; delivery is FIFO per ordered pair of peers
(like a data channel) with the interleaving across pairs chosen by a seeded RNG, so
the protocol is exercised under many orderings. Every test that trains to the end
checks the peers' hashes against the single-process replay oracle.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from daisyweb.optim import AdamConfig, DaisyAdam, weight_hash
from daisyweb.protocol import wire
from daisyweb.protocol.codec import F32, Codec
from daisyweb.protocol.ledger import Archive
from daisyweb.protocol.sync import (
    Commit,
    Compute,
    CutOff,
    Excluded,
    Finish,
    Phase,
    Send,
    SendSnapshot,
    StepMachine,
    Stopped,
)
from daisyweb.training.replay import replay, replay_hashes

SIZE = 37
ADAM = AdamConfig(lr=1e-2)
GOOD_PROBE = "aa" * 16
BAD_PROBE = "bb" * 16


def initial_params(size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(123).standard_normal(size).astype(np.float32)


def grad_for(peer: str, step: int, size: int = SIZE) -> np.ndarray:
    seed = (sum(peer.encode()) * 1000 + step) % (2**32)
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


class FakeReplica:
    """Params + DaisyAdam, like train.TrainState, with backup/restore for rollback."""

    def __init__(self, size: int = SIZE) -> None:
        self.params = initial_params(size)
        self.opt = DaisyAdam(ADAM, size)
        self.applied: list[np.ndarray] = []

    @property
    def step(self) -> int:
        return self.opt.step_count

    @property
    def inner_steps(self) -> int:  # lockstep: one optimizer step a step
        return self.opt.step_count

    @property
    def size(self) -> int:
        return self.params.size

    def apply(self, average: np.ndarray, *, owned: bool = False) -> None:
        self.opt.step(self.params, average)
        self.applied.append(average.copy())

    def weight_hash(self) -> str:
        return weight_hash(self.params, self.opt)

    def backup(self) -> Any:
        return self.params.copy(), self.opt.state_dict(), len(self.applied)

    def restore(self, token: Any) -> None:
        params, state, n = token
        self.params = params.copy()
        self.opt.load_state_dict(state)
        del self.applied[n:]


class Bus:
    """Runs machines to quiescence; records commits, stops, finishes per peer."""

    def __init__(
        self,
        peers: list[str],
        steps: int,
        seed: int = 0,
        probes: dict[str, str] | None = None,
        grad: Callable[[str, int], np.ndarray] = grad_for,
        drop: Callable[[str, str, wire.Message], bool] | None = None,
        repair_after: float = 1.0,
        late: tuple[str, ...] = (),
        codec: Codec = F32,
        archive: Archive | None = None,
        size: int = SIZE,
        exchange: str = "all",
    ) -> None:
        self.rng = random.Random(seed)
        self.grad = grad
        self.drop = drop
        self.now = 0.0
        self.replicas = {p: FakeReplica(size) for p in peers}
        probes = probes if probes is not None else {}
        self.machines: dict[str, StepMachine] = {
            p: StepMachine(
                p,
                self.replicas[p],
                steps,
                (lambda q=p: probes.get(q, GOOD_PROBE)),
                leader=peers[0],
                members=[q for q in peers if q not in late] if p == peers[0] else (),
                repair_after=repair_after,
                codec=codec,
                archive=archive,
                exchange=exchange,
            )
            for p in peers
        }
        self.queues: dict[tuple[str, str], deque[bytes]] = {}
        self.computes: deque[tuple[str, int]] = deque()
        self.commits: dict[str, list[Commit]] = {p: [] for p in peers}
        self.stopped: dict[str, Stopped] = {}
        self.finished: dict[str, Finish] = {}
        self.excluded: list[Excluded] = []
        self.snapshots: list[SendSnapshot] = []
        self.dead: set[str] = set()
        self.used: dict[int, tuple[tuple[str, ...], dict[str, np.ndarray]]] = {}
        self.sent_grads: dict[tuple[str, int], np.ndarray] = {}
        self.hold_compute: set[str] = set()  # peers whose gradient is computed on demand

    def live(self) -> list[str]:
        return [p for p in self.machines if p not in self.dead]

    def handle(self, peer: str, actions: list) -> None:
        for a in actions:
            if isinstance(a, Send):
                to = a.to if a.to is not None else [q for q in self.machines if q != peer]
                data = wire.encode(a.message)
                for q in to:
                    if self.drop is not None and self.drop(peer, q, a.message):
                        continue
                    self.queues.setdefault((peer, q), deque()).append(data)
            elif isinstance(a, Compute):
                self.computes.append((peer, a.step))
            elif isinstance(a, Commit):
                self.commits[peer].append(a)
            elif isinstance(a, Stopped):
                self.stopped[peer] = a
            elif isinstance(a, Finish):
                self.finished[peer] = a
            elif isinstance(a, Excluded):
                self.excluded.append(a)
            elif isinstance(a, SendSnapshot):
                self.snapshots.append(a)

    def start(self) -> None:
        for p, m in self.machines.items():
            self.handle(p, m.start(self.now))

    def step_once(self) -> bool:
        ready = [k for k, q in self.queues.items() if q and k[0] not in self.dead]
        # a message to a peer whose machine is not started yet (a joiner) waits for it
        ready = [k for k in ready if k[1] not in self.dead and k[1] in self.machines]
        computes = [c for c in self.computes if c[0] not in self.dead]
        computes = [c for c in computes if c[0] not in self.hold_compute]
        if not ready and not computes:
            return False
        if computes and (not ready or self.rng.random() < 0.3):
            peer, step = computes[0]
            self.computes.remove((peer, step))
            g = self.grad(peer, step)
            self.sent_grads[(peer, step)] = g
            self.handle(peer, self.machines[peer].local_contribution(step, 1.0, g, self.now))
            return True
        src, dst = self.rng.choice(sorted(ready))
        msg = wire.decode(self.queues[(src, dst)].popleft())
        self.handle(dst, self.machines[dst].message(src, msg, self.now))
        return True

    def run(self, max_events: int = 100000) -> None:
        for _ in range(max_events):
            if not self.step_once():
                return
        raise AssertionError("bus did not settle")

    def advance(self, dt: float) -> None:
        self.now += dt
        for p in self.live():
            self.handle(p, self.machines[p].tick(self.now))
        self.run()

    def kill(self, peer: str) -> None:
        """SIGKILL: queued messages from and to it vanish; survivors see it down."""
        self.dead.add(peer)
        for k in list(self.queues):
            if peer in k:
                del self.queues[k]
        for p in self.live():
            self.handle(p, self.machines[p].peer_down(peer, self.now))

    def oracle_steps(self, peer: str) -> list[tuple[tuple[str, ...], dict[str, np.ndarray]]]:
        """(roster, gradients) of every step ``peer`` committed (latest commit wins)."""
        by_step: dict[int, Commit] = {}
        for c in self.commits[peer]:
            by_step[c.step] = c
        return [
            (by_step[s].roster, {q: self.sent_grads[(q, s)] for q in by_step[s].roster})
            for s in sorted(by_step)
        ]


def _final_hashes(bus: Bus, peers: list[str]) -> set[str]:
    return {bus.replicas[p].weight_hash() for p in peers}


# --------------------------------------------------------------------------- part 1


@pytest.mark.parametrize("seed", range(6))
def test_three_peers_train_to_the_end_equal_to_replay(seed: int) -> None:
    peers = ["a", "b", "c"]
    bus = Bus(peers, steps=5, seed=seed)
    bus.start()
    bus.run()
    assert set(bus.finished) == set(peers) and not bus.stopped
    for p in peers:
        assert [c.step for c in bus.commits[p]] == [0, 1, 2, 3, 4]
        assert all(c.roster == ("a", "b", "c") for c in bus.commits[p])
    # identical hashes at every step on every peer, equal to the replay oracle
    per_step = [{bus.commits[p][s].weight_hash for p in peers} for s in range(5)]
    assert all(len(h) == 1 for h in per_step)
    oracle = replay_hashes(initial_params(), ADAM, bus.oracle_steps("a"))
    assert [h.pop() for h in per_step] == oracle
    assert _final_hashes(bus, peers) == {oracle[-1]}


def test_roster_order_matters_for_the_oracle() -> None:
    # The oracle is sensitive to roster order, so agreeing with it means something.
    g = {p: np.full(SIZE, v, np.float32) for p, v in (("a", 1e8), ("b", 1.0), ("c", -1e8))}
    h1 = replay(initial_params(), ADAM, [(("a", "b", "c"), g)])
    h2 = replay(initial_params(), ADAM, [(("a", "c", "b"), g)])
    assert h1 != h2


def test_single_peer_is_a_roster_of_one() -> None:
    bus = Bus(["solo"], steps=3)
    bus.start()
    bus.run()
    assert bus.finished["solo"].step == 3
    assert bus.replicas["solo"].weight_hash() == replay(
        initial_params(), ADAM, bus.oracle_steps("solo")
    )


def test_member_waits_for_exactly_the_roster() -> None:
    # c computes nothing: a and b must not commit step 0 without c's gradient.
    bus = Bus(["a", "b", "c"], steps=2)
    bus.hold_compute.add("c")
    bus.start()
    bus.run()
    assert all(not bus.commits[p] for p in "abc")
    assert all(bus.replicas[p].step == 0 for p in "abc")
    bus.hold_compute.clear()
    bus.run()
    assert set(bus.finished) == {"a", "b", "c"}


def _bad_grad(bad: str, at: int, kind: str) -> Callable[[str, int], np.ndarray]:
    def grad(peer: str, step: int) -> np.ndarray:
        g = grad_for(peer, step)
        if peer == bad and step == at:
            if kind == "nan":
                g[3] = np.nan
            elif kind == "inf":
                g[0] = -np.inf
            else:
                g = g[:-1]
        return g

    return grad


@pytest.mark.parametrize("kind", ["nan", "inf", "short"])
def test_bad_local_gradient_halts_with_state_untouched(kind: str) -> None:
    bus = Bus(["a", "b", "c"], steps=5, grad=_bad_grad("b", 2, kind))
    bus.start()
    bus.run()
    assert set(bus.stopped) == {"a", "b", "c"} and not bus.finished
    assert all(s.step == 2 for s in bus.stopped.values())
    assert "b" in bus.stopped["b"].reason
    for p in "abc":
        # halted at step 2: two steps committed, the third never applied
        assert bus.replicas[p].step == 2
        assert bus.replicas[p].weight_hash() == bus.commits[p][-1].weight_hash


@pytest.mark.parametrize("kind", ["nan", "short"])
def test_bad_gradient_on_the_wire_is_refused(kind: str) -> None:
    # The sender's own copy is fine; the receivers must refuse what arrives.
    def corrupt(src: str, dst: str, msg: wire.Message) -> bool:
        return False

    bus = Bus(["a", "b", "c"], steps=4, drop=corrupt)
    orig = bus.handle

    def handle(peer: str, actions: list) -> None:
        fixed = []
        for a in actions:
            m = a.message if isinstance(a, Send) else None
            if isinstance(m, wire.Contribution) and m.sender == "c" and m.step == 1:
                p = bytearray(m.payload)
                if kind == "nan":
                    p[0:4] = np.float32(np.nan).tobytes()
                else:
                    del p[-4:]
                a = Send(a.to, wire.Contribution(m.step, m.sender, bytes(p)))
            fixed.append(a)
        orig(peer, fixed)

    bus.handle = handle  # type: ignore[method-assign]
    bus.start()
    bus.run()
    assert set(bus.stopped) == {"a", "b", "c"}
    reasons = {bus.stopped[p].reason for p in "ab"}
    assert all("gradient from c" in r for r in reasons)
    expect = "NaN/Inf" if kind == "nan" else "expected"
    assert all(expect in r for r in reasons)
    for p in "ab":
        assert bus.replicas[p].step == 1
    # c holds the honest gradients and may have committed step 1 before the Halt
    # reached it: still a valid state, one step ahead, never a partial average.
    assert bus.replicas["c"].step in (1, 2)


def test_weight_fork_halts_every_peer_naming_who_diverged() -> None:
    bus = Bus(["a", "b", "c"], steps=6)
    bus.start()
    # let two steps go by, then flip one weight on c
    while min(bus.replicas[p].step for p in "abc") < 2:
        assert bus.step_once()
    fork_at = bus.replicas["c"].step
    bus.replicas["c"].params[0] += np.float32(1.0)
    bus.run()
    assert set(bus.stopped) == {"a", "b", "c"} and not bus.finished
    assert all("c" in s.reason for s in bus.stopped.values())
    assert all(s.step <= fork_at + 1 for s in bus.stopped.values())
    # a and b still agree with each other
    assert len(_final_hashes(bus, ["a", "b"])) == 1


def test_leader_names_the_minority_of_a_fork() -> None:
    bus = Bus(["a", "b", "c", "d"], steps=3)
    bus.replicas["d"].params[5] = np.float32(7.0)  # d diverged before the start
    bus.start()
    bus.run()
    assert "a" in bus.stopped
    assert "d differ from the majority" in bus.stopped["a"].reason
    assert all(bus.replicas[p].step == 0 for p in "abcd")


def test_bad_probe_is_excluded_before_its_gradient_is_used() -> None:
    bus = Bus(["a", "b", "c"], steps=4, probes={"b": BAD_PROBE})
    bus.start()
    bus.run()
    assert "b" in bus.stopped and "probe" in bus.stopped["b"].reason
    assert [e.peer for e in bus.excluded] == ["b"]
    assert set(bus.finished) == {"a", "c"}
    for p in "ac":
        assert all(c.roster == ("a", "c") for c in bus.commits[p])
    # b's gradient was never used: the oracle over a and c only matches
    assert not any(k[0] == "b" for k in bus.sent_grads)
    assert _final_hashes(bus, ["a", "c"]) == {
        replay(initial_params(), ADAM, bus.oracle_steps("a"))
    }


def test_probe_breaking_mid_run_is_excluded_at_the_next_boundary() -> None:
    probes: dict[str, str] = {}
    bus = Bus(["a", "b", "c"], steps=5, probes=probes)
    bus.start()
    while bus.replicas["a"].step < 1:
        assert bus.step_once()
    probes["c"] = BAD_PROBE  # read at c's next boundary
    bus.run()
    assert "c" in bus.stopped and set(bus.finished) == {"a", "b"}
    rosters = [c.roster for c in bus.commits["a"]]
    assert rosters[0] == ("a", "b", "c") and rosters[-1] == ("a", "b")
    assert _final_hashes(bus, ["a", "b"]) == {
        replay(initial_params(), ADAM, bus.oracle_steps("a"))
    }


def test_probe_tie_halts() -> None:
    bus = Bus(["a", "b"], steps=3, probes={"b": BAD_PROBE})
    bus.start()
    bus.run()
    assert set(bus.stopped) == {"a", "b"}
    assert "no majority" in bus.stopped["a"].reason


def test_leader_with_the_odd_probe_halts_everyone_naming_itself() -> None:
    # The leader cannot exclude itself: if its own kernel is the odd one out the whole
    # run stops, before any gradient (computed on that kernel) is used.
    bus = Bus(["a", "b", "c"], steps=3, probes={"a": BAD_PROBE})
    bus.start()
    bus.run()
    assert set(bus.stopped) == {"a", "b", "c"}
    for p in "abc":
        assert "leader a's kernel probe differs from the majority" in bus.stopped[p].reason
        assert bus.stopped[p].step == 0
        assert bus.replicas[p].step == 0 and not bus.commits[p]
    assert not bus.excluded and not bus.finished and not bus.sent_grads


def test_only_the_leader_names_rosters() -> None:
    bus = Bus(["a", "b", "c"], steps=3)
    bus.start()
    bus.run()
    m = bus.machines["b"]
    before = m.replica.step
    assert m.message("c", wire.Roster(before, ["c"]), 0.0) == []


def test_relayed_gradient_from_non_leader_is_ignored() -> None:
    bus = Bus(["a", "b", "c"], steps=3)
    bus.hold_compute.update("abc")
    bus.start()
    bus.run()
    m = bus.machines["b"]
    # c relays a forged gradient claiming to be a's: ignored (only the leader repairs)
    forged = wire.Contribution(0, "a", np.full(SIZE, np.nan, np.float32).tobytes())
    assert m.message("c", forged, 0.0) == []
    assert not m.done


# --------------------------------------------------------------------------- part 2


@pytest.mark.parametrize("dst_of_drop", ["c", "a"])
def test_dropped_gradient_is_repaired_bit_exact(dst_of_drop: str) -> None:
    dropped: list[wire.Message] = []

    def drop(src: str, dst: str, msg: wire.Message) -> bool:
        if isinstance(msg, wire.Contribution) and (src, dst, msg.step) == ("b", dst_of_drop, 2):
            if not dropped:
                dropped.append(msg)
                return True
        return False

    bus = Bus(["a", "b", "c"], steps=5, drop=drop)
    bus.start()
    bus.run()
    assert dropped and not bus.finished
    # the receiver waits, never a partial average
    assert bus.replicas[dst_of_drop].step == 2
    # repair timer: c asks the leader a, which resends b's bytes; a asks b itself
    bus.advance(1.5)
    assert set(bus.finished) == {"a", "b", "c"}
    assert all(c.roster == ("a", "b", "c") for c in bus.commits[dst_of_drop])
    assert _final_hashes(bus, ["a", "b", "c"]) == {
        replay(initial_params(), ADAM, bus.oracle_steps("a"))
    }


def test_dead_follower_mid_step_is_amended_and_dropped() -> None:
    bus = Bus(["a", "b", "c"], steps=5)
    bus.start()
    while bus.replicas["a"].step < 2:
        assert bus.step_once()
    bus.hold_compute.add("c")  # c dies before sending step 2's gradient
    bus.run()
    bus.kill("c")
    bus.run()
    assert set(bus.finished) == {"a", "b"}
    rosters = [c.roster for c in bus.commits["a"]]
    assert rosters == [("a", "b", "c")] * 2 + [("a", "b")] * 3
    assert {c.peer for c in bus.excluded} == {"c"}
    assert _final_hashes(bus, ["a", "b"]) == {
        replay(initial_params(), ADAM, bus.oracle_steps("a"))
    }


def test_amendment_rolls_back_a_member_that_already_committed() -> None:
    # c's step-1 gradient reaches b but not a, then c dies: a amends step 1 to (a, b);
    # b, which committed with c's gradient, must roll back and recommit.
    def drop(src: str, dst: str, msg: wire.Message) -> bool:
        return isinstance(msg, wire.Contribution) and (src, dst, msg.step) == ("c", "a", 1)

    bus = Bus(["a", "b", "c"], steps=4, drop=drop)
    bus.start()
    bus.run()
    assert bus.replicas["b"].step == 2 and bus.replicas["a"].step == 1
    bus.kill("c")
    bus.run()
    assert set(bus.finished) == {"a", "b"} and not bus.stopped
    assert any(c.rollback for c in bus.commits["b"])
    for p in "ab":
        assert [r for r, _ in bus.oracle_steps(p)][1] == ("a", "b")
    assert _final_hashes(bus, ["a", "b"]) == {
        replay(initial_params(), ADAM, bus.oracle_steps("a"))
    }


@pytest.mark.parametrize("seed", range(4))
def test_leader_killed_mid_step_successor_finishes(seed: int) -> None:
    bus = Bus(["a", "b", "c", "d"], steps=6, seed=seed)
    bus.start()
    while bus.replicas["b"].step < 3:
        assert bus.step_once()
    bus.kill("a")
    bus.run()
    survivors = ["b", "c", "d"]
    assert all(bus.machines[p].leader == "b" for p in survivors)  # no split brain
    assert set(bus.finished) == set(survivors), bus.stopped
    assert len(_final_hashes(bus, survivors)) == 1
    oracle = replay(initial_params(), ADAM, bus.oracle_steps("b"))
    assert _final_hashes(bus, survivors) == {oracle}
    assert [c.step for c in bus.commits["b"] if not c.rollback][-1] == 5  # no step lost


def test_join_gets_a_snapshot_at_a_boundary() -> None:
    bus = Bus(["a", "b", "c", "d"], steps=6, late=("d",))
    d = bus.machines.pop("d")
    bus.start()
    while bus.replicas["a"].step < 2:
        assert bus.step_once()
    bus.handle("a", bus.machines["a"].peer_up("d", bus.now))
    bus.run()
    assert bus.snapshots and bus.snapshots[0].peer == "d"
    assert bus.snapshots[0].holders == ("a", "b", "c")  # every member serves pieces
    b = bus.snapshots[0].step
    # the driver ships the leader's state; d loads it and starts at that boundary
    src = bus.replicas["a"]
    bus.replicas["d"].params = src.params.copy()
    bus.replicas["d"].opt.load_state_dict(src.opt.state_dict())
    assert bus.replicas["d"].step == b
    bus.machines["d"] = d
    bus.handle("d", d.start(bus.now))
    bus.run()
    assert set(bus.finished) == {"a", "b", "c", "d"}, bus.stopped
    assert [c.step for c in bus.commits["d"]] == list(range(b, 6))
    assert all("d" in c.roster for c in bus.commits["a"] if c.step >= b)
    assert len(_final_hashes(bus, ["a", "b", "c", "d"])) == 1
    assert _final_hashes(bus, ["a"]) == {replay(initial_params(), ADAM, bus.oracle_steps("a"))}


def test_join_with_a_bad_snapshot_is_excluded() -> None:
    bus = Bus(["a", "b", "c"], steps=4, late=("c",))
    c = bus.machines.pop("c")
    bus.start()
    bus.handle("a", bus.machines["a"].peer_up("c", bus.now))
    bus.run()
    assert bus.snapshots
    bus.replicas["c"].params[0] += np.float32(3.0)  # not the leader's state
    bus.machines["c"] = c
    bus.handle("c", c.start(bus.now))
    bus.run()
    assert "c" in bus.stopped and "snapshot" in bus.stopped["c"].reason
    assert set(bus.finished) == {"a", "b"}


# --------------------------------------------------------------------------- guards


def _trained(steps: int = 3, upto: int = 1) -> Bus:
    bus = Bus(["a", "b", "c"], steps=steps)
    bus.start()
    while min(bus.replicas[p].step for p in "abc") < upto:
        assert bus.step_once()
    return bus


def test_hashes_are_only_compared_when_made_with_the_same_roster() -> None:
    bus = _trained(steps=5, upto=1)
    m = bus.machines["b"]
    b = m.boundary
    used = m.roster(b - 1)
    assert used is not None
    other = wire.roster_digest(("a", "b"))
    # a different hash made with another roster of the same step: stale, ignored
    assert not any(isinstance(x, Stopped) for x in
                   m.message("c", wire.StepHashes(b, "c", "ee" * 32, GOOD_PROBE, other)))
    assert not m.done
    same = wire.roster_digest(used)
    out = m.message("c", wire.StepHashes(b, "c", "ee" * 32, GOOD_PROBE, same))
    assert any(isinstance(x, Stopped) for x in out) and m.done


def test_hashes_must_come_from_their_sender() -> None:
    bus = _trained(steps=5, upto=1)
    m = bus.machines["b"]
    b = m.boundary
    rh = wire.roster_digest(m.roster(b - 1))
    assert m.message("a", wire.StepHashes(b, "c", "ee" * 32, GOOD_PROBE, rh)) == []
    assert not m.done


def test_halt_from_an_outsider_is_ignored() -> None:
    bus = _trained(steps=5, upto=1)
    m = bus.machines["b"]
    assert m.message("zz", wire.Halt(1, "stop")) == [] and not m.done
    out = m.message("c", wire.Halt(1, "stop"))
    assert [type(x) for x in out] == [Stopped] and "c: stop" in out[0].reason


def test_amendment_may_not_add_members() -> None:
    bus = Bus(["a", "b"], steps=3)
    bus.hold_compute.update("ab")
    bus.start()
    bus.run()
    m = bus.machines["b"]
    out = m.message("a", wire.Roster(0, ["a", "b", "x"]))
    assert any(isinstance(x, Stopped) and "add members" in x.reason for x in out)


def test_gradient_for_another_step_is_ignored() -> None:
    bus = Bus(["a", "b"], steps=3)
    bus.hold_compute.update("ab")
    bus.start()
    bus.run()
    m = bus.machines["b"]
    nan = np.full(SIZE, np.nan, np.float32).tobytes()
    assert m.message("a", wire.Contribution(1, "a", nan)) == [] and not m.done
    out = m.message("a", wire.Contribution(0, "a", nan))  # the current step: checked, refused
    assert any(isinstance(x, Stopped) for x in out)


def test_joiner_that_never_confirms_is_dropped_after_the_timeout() -> None:
    bus = Bus(["a", "b"], steps=4)
    bus.machines["a"].join_timeout = 5.0
    bus.start()
    bus.handle("a", bus.machines["a"].peer_up("ghost", bus.now))
    bus.run()
    assert [s.peer for s in bus.snapshots] == ["ghost"]
    assert bus.replicas["a"].step == 0  # the roster waits for the joiner...
    bus.advance(6.0)
    assert any(e.peer == "ghost" for e in bus.excluded)  # ...but not for ever
    assert set(bus.finished) == {"a", "b"}


def test_leader_lost_before_the_first_roster_sends_followers_back_without_split_brain(
) -> None:
    bus = Bus(["a", "b", "c"], steps=3)
    cut: dict[str, CutOff] = {}
    for p in "bc":
        bus.handle(p, bus.machines[p].start(bus.now))  # a never names a roster
    bus.run()
    bus.dead.add("a")
    for p in "bc":
        out = bus.machines[p].peer_down("a", bus.now)
        for x in out:
            if isinstance(x, CutOff):
                cut[p] = x
        bus.handle(p, out)
    bus.run()
    assert set(cut) == {"b", "c"} and not bus.stopped  # they rejoin: a snapshot again
    assert all("before the first roster" in cut[p].reason for p in "bc")
    assert not any(bus.machines[p].is_leader for p in "bc")
    assert all(bus.machines[p].phase is Phase.CUT_OFF for p in "bc")



def test_halt_broadcasts_and_stops_once() -> None:
    bus = _trained(steps=5, upto=1)
    m = bus.machines["b"]
    before = bus.replicas["b"].weight_hash()
    out = m.halt(m.boundary, "gradient computation failed")
    halts = [a for a in out if isinstance(a, Send) and isinstance(a.message, wire.Halt)]
    assert len(halts) == 1 and halts[0].message.reason == "gradient computation failed"
    assert [a.reason for a in out if isinstance(a, Stopped)] == ["gradient computation failed"]
    assert m.done and m.halt(m.boundary, "again") == []
    assert bus.replicas["b"].weight_hash() == before


# --------------------------------------------------------------------------- versions


def _hello_first(bus: Bus, src: str, version: int, to: str = "") -> None:
    """Queue ``src``'s Hello ahead of everything else on its links (as the driver does)."""
    for dst in [to] if to else [q for q in bus.machines if q != src]:
        q = bus.queues.setdefault((src, dst), deque())
        q.appendleft(wire.encode(wire.Hello(src, version)))


def test_leader_excludes_a_follower_of_another_protocol_version() -> None:
    bus = Bus(["a", "b", "c"], steps=3)
    _hello_first(bus, "c", 999)
    bus.start()
    bus.run()
    why = f"c speaks protocol version 999, a speaks {wire.PROTOCOL_VERSION}"
    assert [(e.peer, e.reason) for e in bus.excluded if e.reason == why] == [("c", why)]
    assert "c" in bus.stopped and why in bus.stopped["c"].reason  # told by the leader
    assert set(bus.finished) == {"a", "b"}, bus.stopped
    for p in "ab":
        assert all(c.roster == ("a", "b") for c in bus.commits[p])
    assert not any(k[0] == "c" for k in bus.sent_grads)
    assert _final_hashes(bus, ["a", "b"]) == {
        replay(initial_params(), ADAM, bus.oracle_steps("a"))
    }


def test_follower_refuses_a_leader_of_another_protocol_version() -> None:
    bus = Bus(["a", "b", "c"], steps=3)
    _hello_first(bus, "a", 999, to="b")
    bus.start()
    bus.run()
    why = f"refused the leader: a speaks protocol version 999, b speaks {wire.PROTOCOL_VERSION}"
    assert bus.stopped["b"].reason == why
    assert not bus.commits["b"] and bus.replicas["b"].step == 0
    bus.kill("b")  # the driver exits non-zero; the others go on without it
    bus.run()
    assert set(bus.finished) == {"a", "c"}, bus.stopped
    assert bus.commits["a"][-1].roster == ("a", "c")


def test_same_version_or_forged_hello_changes_nothing() -> None:
    bus = Bus(["a", "b", "c"], steps=3)
    for p in "abc":
        _hello_first(bus, p, wire.PROTOCOL_VERSION)
    # A Hello speaks only for its sender: b cannot get c excluded in c's name.
    bus.queues[("b", "a")].append(wire.encode(wire.Hello("c", 999)))
    bus.start()
    bus.run()
    assert set(bus.finished) == {"a", "b", "c"}, bus.stopped
    assert not bus.excluded
    assert all(len(c.roster) == 3 for c in bus.commits["a"])


# --------------------------------------------------------------------------- phases, codec


def test_phases_name_where_each_machine_is() -> None:
    bus = Bus(["a", "b"], steps=2)
    assert bus.machines["a"].phase is Phase.WAITING
    bus.hold_compute.add("b")
    bus.start()
    bus.run()
    a, b = bus.machines["a"], bus.machines["b"]
    assert (a.phase, b.phase) == (Phase.COLLECTING, Phase.COMPUTING)  # a waits for b's
    bus.hold_compute.clear()
    bus.run()
    assert a.phase is b.phase is Phase.FINISHED
    assert a.halt(a.boundary, "late") == [] and a.phase is Phase.FINISHED
    bus2 = _trained(steps=5, upto=1)
    m = bus2.machines["b"]
    m.halt(m.boundary, "stop")
    assert m.phase is Phase.HALTED and m.done


class TruncatingCodec:
    """A lossy codec for the test: keeps sign, exponent and 3 mantissa bits of each value."""

    name = "trunc12"

    def encode(self, vector: np.ndarray) -> bytes:
        bits = np.ascontiguousarray(vector, dtype="<f4").view("<u4") & np.uint32(0xFFF00000)
        return bits.tobytes()

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray:
        return F32.decode(payload, size, who)


def test_a_lossy_codec_keeps_members_equal_summing_the_decoded_bytes() -> None:
    peers = ["a", "b", "c"]
    codec = TruncatingCodec()
    bus = Bus(peers, steps=3, seed=2, codec=codec)
    bus.start()
    bus.run()
    assert set(bus.finished) == set(peers) and not bus.stopped
    # Every member (its own gradient included) sums what the bytes decode to.
    decoded = [(roster, {p: codec.decode(codec.encode(g), SIZE) for p, g in grads.items()})
               for roster, grads in bus.oracle_steps("a")]
    expect = replay(initial_params(), ADAM, decoded)
    assert _final_hashes(bus, peers) == {expect}
    assert expect != replay(initial_params(), ADAM, bus.oracle_steps("a"))  # it is lossy


# --------------------------------------------------------------------------- issue 14


def _nan() -> bytes:
    return np.full(SIZE, np.nan, np.float32).tobytes()


@pytest.mark.parametrize("who", ["leader", "follower"])
def test_gradient_from_outside_the_roster_cannot_halt(who: str) -> None:
    """Finding 8: a NaN gradient of the current step from a peer outside its roster (a
    connected stranger, a joiner that never confirmed its snapshot) is dropped unread."""
    bus = Bus(["a", "b"], steps=3)
    bus.machines["a"].join_timeout = 60.0
    bus.handle("a", bus.machines["a"].peer_up("ghost", bus.now))  # offered, unconfirmed
    bus.hold_compute.update("ab")
    bus.start()
    bus.run()
    peer = "a" if who == "leader" else "b"
    m = bus.machines[peer]
    for sender in ("ghost", "zz"):
        assert m.message(sender, wire.Contribution(0, sender, _nan())) == [] and not m.done
    bus.hold_compute.clear()
    bus.run()
    bus.advance(61.0)  # the joiner times out; the others finish
    assert not bus.stopped and {"a", "b"} <= set(bus.finished)


def test_gradient_before_the_roster_waits_unread_and_only_a_members_counts() -> None:
    """Before its roster, a follower keeps one gradient per sender unread; the roster then
    drops a non-member's (a NaN from it halts nobody) and checks the members'."""
    bus = Bus(["a", "b"], steps=2)
    bus.hold_compute.update("ab")
    m = bus.machines["b"]
    assert m.message("zz", wire.Contribution(0, "zz", _nan())) == [] and not m.done
    assert m.ledger.get(0).unchecked == {"zz"}
    bus.start()
    bus.run()  # a's roster of step 0 reaches b
    assert not m.done and "zz" not in m.ledger.get(0).payloads
    bus.hold_compute.clear()
    bus.run()
    assert set(bus.finished) == {"a", "b"} and not bus.stopped


def test_early_bad_gradient_of_a_member_halts_when_its_roster_arrives() -> None:
    bus = Bus(["a", "b", "c"], steps=2, seed=1)
    bus.hold_compute.update("abc")
    bus.start()
    m = bus.machines["b"]
    m.members.learn(["a", "b", "c"])  # b knows the group from an earlier roster
    assert m.message("c", wire.Contribution(0, "c", _nan())) == [] and not m.done
    out = m.message("a", wire.Roster(0, ("a", "b", "c")))
    assert any(isinstance(x, Stopped) and "refused" in x.reason for x in out)


def test_future_rosters_are_not_kept() -> None:
    """Finding 9: rosters for far-future steps, or from a non-participant, are not stored
    (a flood grew a peer by 588 MB and slowed every commit)."""
    bus = _trained(steps=5, upto=1)
    m = bus.machines["b"]
    m.leadership.term = 1  # the flood's term-0 rosters are stale: neither followed nor a fork
    b = m.boundary
    before = dict(m.ledger.rosters_seen)
    for step in range(b + 3, b + 2000):
        m.message("c", wire.Roster(step, ("c",)))
    m.message("zz", wire.Roster(b, ("zz",)))
    assert m.ledger.rosters_seen == before and not m.done
    m.message("c", wire.Roster(b + 1, ("c", "b")))  # near: kept for a failover
    assert m.ledger.rosters_seen[("c", b + 1)] == (("c", "b"), (), 0, ())


class RecordingCodec:
    """F32, recording which of its decodings the machine uses: whole vectors
    (``decode``) or part by part (``decode_parts``)."""

    name = "f32"

    def __init__(self) -> None:
        self.whole = 0
        self.parted = 0

    def encode(self, vector: np.ndarray) -> bytes:
        return F32.encode(vector)

    def decode(self, payload: bytes, size: int, who: str = "payload") -> np.ndarray:
        self.whole += 1
        return F32.decode(payload, size, who)

    def check(self, payload: bytes, size: int, who: str = "payload") -> None:
        F32.check(payload, size, who)

    def decode_parts(self, payload: bytes, size: int, who: str = "payload") -> Any:
        self.parted += 1
        return F32.decode_parts(payload, size, who)


def test_a_commit_decodes_part_by_part_and_hands_over_its_mean() -> None:
    """A commit never makes a whole decoded vector besides the sum (each payload is
    decoded part by part as it is added), and the replica is given the mean as its own
    (``owned``: a round trainer takes its outer step in that buffer)."""
    codec = RecordingCodec()
    bus = Bus(["a", "b", "c"], steps=2, seed=4, codec=codec)
    handed: list[bool] = []
    for replica in bus.replicas.values():
        def apply(average: np.ndarray, *, owned: bool = False,
                  replica: FakeReplica = replica) -> None:
            handed.append(owned)
            FakeReplica.apply(replica, average)
        replica.apply = apply  # type: ignore[method-assign]
    bus.start()
    bus.run()
    assert set(bus.finished) == {"a", "b", "c"} and handed == [True] * 6
    # 3 members, 2 steps, 3 payloads, each decoded twice: its norm, then the average
    assert codec.whole == 0 and codec.parted == 6 * 3 * 2


def _hashes_of(src: str, dst: str, step: int) -> Callable[[str, str, wire.Message], bool]:
    return lambda s, d, m: isinstance(m, wire.StepHashes) and (s, d, m.step) == (
        src, dst, step)


def test_a_leader_whose_members_finished_and_left_finishes_too() -> None:
    """At the last boundary the members that had every hash finish and leave; a leader
    still waiting for a slow member's hash is then without a majority: it finishes (a
    majority published its weights), it is not cut off."""
    peers = ["a", "b", "c", "d", "e"]
    bus = Bus(peers, 2, drop=_hashes_of("e", "a", 2))
    bus.start()
    bus.run()
    assert set(bus.finished) == {"b", "c", "d", "e"} and "a" not in bus.finished
    for p in ("b", "c", "d"):
        bus.kill(p)
    assert "a" in bus.finished and bus.machines["a"].phase is Phase.FINISHED


def test_a_member_left_alone_at_the_end_without_a_majority_of_its_hash_is_cut_off() -> None:
    peers = ["a", "b", "c", "d", "e"]
    def drop(s: str, d: str, m: wire.Message) -> bool:  # the leader hears b's hash only
        return (isinstance(m, wire.StepHashes) and m.step == 2 and d == "a"
                and s in ("c", "d", "e"))

    bus = Bus(peers, 2, drop=drop)
    bus.start()
    bus.run()
    for p in ("b", "c", "d"):
        bus.kill(p)
    assert "a" not in bus.finished  # only b's hash (and its own) agree: 2 of 5
    assert bus.machines["a"].phase is Phase.CUT_OFF
