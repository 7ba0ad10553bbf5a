"""Churn: a training group under one fault every 30 s, and how big groups start (issue 36).

    python -m bench.churn           # 20 minutes of faults, start-ups of 8..32 (about an hour)
    python -m bench.churn --quick   # 2 minutes, a fault every 15 s, a 1-minute fault-free
                                    # run scaled by time, one start-up of 8; nothing written
    python -m bench.churn --quick --skip-startup --minutes 1

A signaling server and ``daisyweb-peer`` processes on 127.0.0.1 (aiortc, loopback ICE
only, as ``bench._group`` starts them), unpinned on this machine's cores, train a small
model (width 32, 1 layer, 2 heads, seq 32, batch 2; the default rounds mode).

1. **Fault-free run.** ``--peers`` peers train for ``--baseline-minutes`` (default: as
   long as the faulty run) from their first commit; the rounds they commit are the
   reference for goodput (scaled by time when the run is shorter) and size the faulty
   run's step budget (10% over), so that the faulty group ends on its own, exit 0.
2. **Faulty run.** The same group; from its first commit, one fault every
   ``--fault-every`` seconds, in turn: a follower SIGKILLed, the leader SIGKILLed, a
   joiner, a follower SIGSTOPped for 10 s, one for 30 s, the leader for 10 s (a follower
   victim: one in the last roster, hit least often so far, then the youngest). A killed
   peer is replaced by a new joiner at once, and the joiner comes after a follower left
   with SIGTERM (the group stays at ``--peers``, the fault-free run's size); a stopped peer
   is SIGCONTed after its pause and then rejoins or exits (which is recorded, with its
   exit code and last log line). After ``--minutes`` the faults stop and the group trains
   to its budget. Per fault: time to the next commit, to the first roster without the
   victim (or with the joiner), who led, whether anyone forked or halted. In all: rounds
   committed against the fault-free run, the distinct final weight hashes among peers that
   exited 0 (must be 1), and every long-lived peer's resident memory (VmRSS every 5 s).
3. **Start-up.** Groups of ``--startup-sizes`` peers (a leader with ``--wait-peers N``
   and N - 1 followers started at once): time from the leader's start to the first commit
   with all N in the roster, and how often a start lost members (a first roster short of
   N, a peer that exited, or no full roster in time).

Commit times are the records' own ``time`` field where the peer writes one, else when
this script read the record (it polls every 0.2 s). Who leads comes from the peers' log
lines (``leading: ...``, ``leading now ...``). Everything this script starts it stops,
also on an error or Ctrl-C (a stopped peer is SIGCONTed first); the logs and metrics stay
in ``--out`` (default ``out/churn-<time>``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from bench._group import ENV as GROUP_ENV
from bench._group import signaling_server
from bench._results import machine, write_section
from daisyweb.rules import DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
# bench._group's environment (aiortc, one BLAS thread, loopback only) and ICE host
# candidates on 127.0.0.1 alone, whatever a peer's flags say.
ENV = dict(GROUP_ENV, DAISYWEB_ICE_HOSTS="127.0.0.1")
MODEL = ["--width", "32", "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "2"]
H = int(DEFAULTS["sync_every"])  # optimizer steps per round (the default mode)
UNBOUNDED_STEPS = H * 10**6  # a budget no run here reaches: the fault-free run is stopped
FAULTS: dict[str, str] = {
    "follower-kill": "follower SIGKILL",
    "leader-kill": "leader SIGKILL",
    "joiner": "a joiner",
    "follower-stop-10": "follower SIGSTOP 10 s",
    "follower-stop-30": "follower SIGSTOP 30 s",
    "leader-stop-10": "leader SIGSTOP 10 s",
}
MAX_GROUP = 8
POLL_S = 0.2
RSS_EVERY_S = 5.0
JOIN_TIMEOUT_S = 60.0  # daisyweb-peer's default
BUDGET_HEADROOM = 1.1  # the faulty run's budget over the fault-free run's rounds
STOP_WAIT_S = 30.0  # for a peer to end after SIGINT/SIGTERM before it is killed
RECENT_S = 5.0  # a follower victim committed with the group this recently
MB = 1e6


# ----------------------------------------------------------------------------- peers


@dataclass(frozen=True)
class Commit:
    """The fields of one metrics record this script uses (the rest is dropped: a long
    run writes thousands of records per peer)."""

    t: float  # wall clock
    round: int
    step: int
    hash: str
    roster: tuple[str, ...]


@dataclass
class Peer:
    """One ``daisyweb-peer`` process and what it wrote so far."""

    name: str
    proc: subprocess.Popen[bytes]
    metrics: Path
    log: Path
    born: float
    id: str = ""  # the mesh id it printed ("joined as ...")
    commits: list[Commit] = field(default_factory=list)
    end: dict | None = None  # the metrics end record
    lines: list[tuple[float, str]] = field(default_factory=list)  # but progress lines
    last_line: str = ""  # the last log line but the kernel report
    rss: list[tuple[float, int]] = field(default_factory=list)  # (time, VmRSS bytes)
    # member, paused, killed (SIGKILL), retired (SIGTERM to make room), exited (on its own)
    fate: str = "member"
    gone_at: float | None = None  # when it was killed or seen to exit
    code: int | None = None
    _files: dict[Path, tuple[int, bytes]] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def read_lines(self, path: Path) -> list[str]:
        """Whole lines appended to ``path`` since the last call."""
        offset, partial = self._files.get(path, (0, b""))
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return []
        *lines, rest = (partial + data).split(b"\n")
        self._files[path] = (offset + len(data), rest)
        return [line.decode(errors="replace") for line in lines]

    def commits_after(self, t: float) -> Iterator[Commit]:
        return (c for c in self.commits if c.t > t)


def vm_rss(pid: int) -> int | None:
    """VmRSS of ``pid`` in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Group:
    """The peers of one room on one signaling server, polled from one thread: their
    metrics, log lines, exits and memory, and timers (a SIGCONT due) fired in between."""

    def __init__(self, server: str, room: str, out: Path, steps: int,
                 join_timeout: float = JOIN_TIMEOUT_S) -> None:
        self.server, self.room, self.out, self.steps = server, room, out, steps
        self.join_timeout = join_timeout
        out.mkdir(parents=True, exist_ok=True)
        self.peers: list[Peer] = []
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.leads: list[tuple[float, Peer]] = []  # "leading" log lines
        self.halts: list[tuple[float, Peer, str]] = []  # "halted at" log lines
        self.cutoffs: list[tuple[float, Peer, str]] = []  # "cut off at" log lines
        self.on_exit: Callable[[Peer], None] | None = None  # a member exited on its own
        self._next_rss = 0.0

    # ------------------------------------------------------------------ processes
    def spawn(self, lead: bool = False, wait_peers: int = 1) -> Peer:
        name = f"p{len(self.peers):02d}"
        metrics, log = self.out / f"{name}.jsonl", self.out / f"{name}.log"
        cmd = [sys.executable, "-m", "daisyweb.cli.peer", "--server", self.server,
               "--room", self.room, "--name", name, "--ice-host", "127.0.0.1",
               "--approve", "auto", "--metrics", str(metrics),
               "--join-timeout", f"{self.join_timeout:g}"]
        if lead:
            # rounds of exactly H: the budget and the tables count rounds
            cmd += ["--start", *MODEL, "--steps", str(self.steps), "--sync-max", str(H),
                    "--wait-peers", str(wait_peers)]
        with open(log, "wb") as f:
            # A session of its own: a Ctrl-C on the terminal reaches this script only,
            # which then stops every peer itself (SIGCONT first for a stopped one).
            proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL,
                                    stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        peer = Peer(name, proc, metrics, log, time.time())
        self.peers.append(peer)
        return peer

    def send(self, peer: Peer, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            peer.proc.send_signal(sig)

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.timers.append((time.time() + delay, action))

    def stop_all(self, sig: signal.Signals = signal.SIGINT, timeout: float = STOP_WAIT_S
                 ) -> None:
        """End every peer still running: SIGCONT, then ``sig`` (a clean end with an end
        record), SIGKILL for any still running after ``timeout``."""
        self.on_exit = None  # an exit now is the end asked for: no replacement
        self.timers.clear()
        for p in self.peers:
            if p.running:
                self.send(p, signal.SIGCONT)
                self.send(p, sig)
        deadline = time.time() + timeout
        try:
            while any(p.running for p in self.peers) and time.time() < deadline:
                self.poll()
                time.sleep(POLL_S)
        finally:  # a second Ctrl-C while they end still kills them
            self.kill_all()
        self.poll()

    def kill_all(self) -> None:
        for p in self.peers:
            if p.running:
                self.send(p, signal.SIGCONT)
                self.send(p, signal.SIGKILL)
        for p in self.peers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=10)

    # ------------------------------------------------------------------ reading
    def poll(self) -> None:
        now = time.time()
        sample = now >= self._next_rss
        if sample:
            self._next_rss = now + RSS_EVERY_S
        for p in list(self.peers):  # on_exit may start a joiner meanwhile
            self._read(p, now)
            code = p.proc.poll()
            if code is not None and p.code is None:
                p.code = code
                self._read(p, now)  # what it wrote before it ended
                if p.fate in ("member", "paused"):
                    p.fate, p.gone_at = "exited", now
                    if self.on_exit is not None:
                        self.on_exit(p)
            elif code is None and sample:
                rss = vm_rss(p.proc.pid)
                if rss is not None:
                    p.rss.append((now, rss))
        for due, action in [t for t in self.timers if t[0] <= now]:
            self.timers.remove((due, action))
            action()

    def _read(self, p: Peer, now: float) -> None:
        for line in p.read_lines(p.metrics):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "end" in r:
                p.end = r
            elif "round" in r:
                p.commits.append(Commit(float(r.get("time", now)), int(r["round"]),
                                        int(r["step"]), str(r["weight_hash"]),
                                        tuple(r["roster"])))
        for line in p.read_lines(p.log):
            text = line.removeprefix("daisyweb-peer: ").strip()
            if not text or text.startswith("step "):
                continue  # progress lines
            if not text.startswith("kernels:"):
                p.last_line = text
            p.lines.append((now, text))
            if text.startswith("joined as ") and not p.id:
                p.id = text.split()[2]
            elif text.startswith("leading"):
                self.leads.append((now, p))
            elif text.startswith("halted at"):
                self.halts.append((now, p, text))
            elif text.startswith("cut off at"):
                self.cutoffs.append((now, p, text))

    def wait(self, until: float, done: Callable[[], bool] = lambda: False) -> None:
        """Poll (and fire timers) until wall time ``until`` or ``done()``."""
        while time.time() < until:
            self.poll()
            if done():
                return
            time.sleep(min(POLL_S, max(0.0, until - time.time())))
        self.poll()

    # ------------------------------------------------------------------ the group
    def by_id(self) -> dict[str, Peer]:
        return {p.id: p for p in self.peers if p.id}

    def label(self, peer_id: str) -> str:
        p = self.by_id().get(peer_id)
        return p.name if p else peer_id[:8]

    def members(self) -> list[Peer]:
        """Peers of the group now: running, not killed or retired (a paused one too)."""
        return [p for p in self.peers if p.fate in ("member", "paused") and p.running]

    def leader_at(self, t: float) -> Peer | None:
        """The peer whose "leading" line is the latest by ``t`` among those not gone then."""
        for tl, p in reversed(self.leads):
            if tl <= t and (p.gone_at is None or p.gone_at > t):
                return p
        return None

    def first_commit(self) -> float | None:
        times = [p.commits[0].t for p in self.peers if p.commits]
        return min(times) if times else None

    def commits_after(self, t: float, but: Peer | None = None) -> list[tuple[Commit, Peer]]:
        out = [(c, p) for p in self.peers if p is not but for c in p.commits_after(t)]
        return sorted(out, key=lambda cp: cp[0].t)

    def hashes(self) -> dict[int, Counter[str]]:
        """Per round, how many peers committed each weight hash (a peer's last record of
        a round counts: a rolled-back round is replaced by its recommit)."""
        out: dict[int, Counter[str]] = {}
        for p in self.peers:
            last: dict[int, str] = {}
            for c in p.commits:
                last[c.round] = c.hash
            for r, h in last.items():
                out.setdefault(r, Counter())[h] += 1
        return out

    def main_hashes(self) -> dict[int, str]:
        """Each round's most common weight hash: the group's."""
        return {r: c.most_common(1)[0][0] for r, c in self.hashes().items()}

    def forks(self, t0: float = -math.inf, t1: float = math.inf) -> list[tuple[int, Peer]]:
        """(round, peer) for each peer whose last record of a round has a hash other than
        the round's most common one, the record written in [t0, t1)."""
        main = self.main_hashes()
        out = []
        for p in self.peers:
            last: dict[int, Commit] = {}
            for c in p.commits:
                last[c.round] = c
            for r, c in sorted(last.items()):
                if c.hash != main[r] and t0 <= c.t < t1:
                    out.append((r, p))
                    break  # its first forked round is enough
        return out

    def round_at(self, t: float) -> int:
        """The last round the group committed by ``t`` (a forked record does not count)."""
        main = self.main_hashes()
        rounds = [c.round for p in self.peers for c in p.commits
                  if c.t <= t and c.hash == main[c.round]]
        return max(rounds, default=0)

    def contributions(self, upto: int) -> int:
        """Member-rounds: the sum of roster sizes over rounds 1..upto (the main records)."""
        main = self.main_hashes()
        size: dict[int, int] = {}
        for p in self.peers:
            for c in p.commits:
                if c.round <= upto and c.hash == main[c.round]:
                    size[c.round] = len(c.roster)
        return sum(size.values())


# ----------------------------------------------------------------------------- runs


@dataclass
class Fault:
    kind: str
    at: float
    victim: Peer | None = None
    leader_before: Peer | None = None
    joiner: Peer | None = None  # the peer that came (a replacement or the joiner)
    cont_at: float | None = None  # SIGCONT of a stopped victim
    note: str = ""


@dataclass
class RunResult:
    """What one group run gives the report."""

    group: Group
    t0: float  # its first commit
    t_end: float  # the end of the measured span (t0 + minutes)
    rounds: int  # rounds committed by t_end
    contributions: int  # member-rounds by t_end
    faults: list[Fault] = field(default_factory=list)
    finished_at: float | None = None  # every member ended (the faulty run)


@dataclass
class StartTrial:
    peers: int
    full_s: float | None  # leader start to the first commit with all N in the roster
    first_roster: int  # members in the first commit's roster (0: none)
    lost: str  # "" or what went wrong
    stall_s: float | None = None  # the longest event-loop stall of any of its peers


@dataclass
class ChurnReport:
    """Everything the tables are made of (``main`` returns it; the test reads it)."""

    baseline: RunResult | None
    faulty: RunResult | None  # None: --startup-only
    rows: list[dict[str, str]]  # per fault, as printed
    final_hashes: dict[str, list[str]]  # weight hash -> peers that exited 0 with it
    forked: list[str]  # "pNN at round R"
    halted: list[str]
    startup: list[StartTrial]
    markdown: str


def wait_first_commit(g: Group, lead: Peer, timeout: float) -> float:
    deadline = time.time() + timeout
    g.wait(deadline, lambda: g.first_commit() is not None or not lead.running)
    t0 = g.first_commit()
    if t0 is None:
        raise SystemExit(f"no first commit within {timeout:g} s; the leader's log "
                         f"({lead.log}) ends: {lead.last_line}")
    return t0


class StartFailed(Exception):
    """A group's leader never joined its room."""


def start_group(g: Group, peers: int) -> Peer:
    """A leader waiting for ``peers`` in all, then the others (once it is in the room:
    the room's first peer is its host)."""
    lead = g.spawn(lead=True, wait_peers=peers)
    deadline = time.time() + 60
    g.wait(deadline, lambda: bool(lead.id) or not lead.running)
    if not lead.id:
        raise StartFailed(f"the leader did not join: {lead.last_line or lead.log}")
    for _ in range(peers - 1):
        g.spawn()
    return lead


def fault_free_run(server: str, out: Path, peers: int, minutes: float) -> RunResult:
    g = Group(server, "churnbase", out, UNBOUNDED_STEPS)
    try:
        lead = start_group(g, peers)
        t0 = wait_first_commit(g, lead, 180)
        t_end = t0 + minutes * 60
        g.wait(t_end, lambda: not lead.running)
        if not lead.running:
            raise SystemExit(f"the fault-free leader exited {lead.code}: {lead.last_line}")
        rounds = g.round_at(t_end)
        return RunResult(g, t0, t_end, rounds, g.contributions(rounds))
    finally:
        g.stop_all()


class Churn:
    """The faulty run: the schedule, the victims, the replacements."""

    def __init__(self, g: Group, peers: int) -> None:
        self.g = g
        self.target = peers
        self.replace = True  # keep the group at its size (until the faults stop)
        self.faults: list[Fault] = []
        self.hits: Counter[str] = Counter()  # faults per peer so far
        g.on_exit = self._exited

    def _exited(self, peer: Peer) -> None:
        if peer.code == 0:
            self.replace = False  # the group reached its budget: nothing left to join
        if self.replace:
            self.top_up()

    def top_up(self) -> list[Peer]:
        """New joiners until the group has ``target`` members again."""
        return [self.g.spawn() for _ in range(self.target - len(self.g.members()))]

    def leader(self) -> Peer | None:
        p = self.g.leader_at(time.time())
        return p if p is not None and p.fate == "member" and p.running else None

    def follower(self) -> Peer | None:
        """A member that committed a round with itself in the roster in the last
        ``RECENT_S`` (a joiner still starting, or a peer just SIGCONTed, is not the fault
        asked for): the one hit least often so far, then the youngest, so that the
        longest-lived peers stay for the memory figures as long as they can."""
        lead, now = self.leader(), time.time()
        ok = [p for p in self.g.members() if p.fate == "member" and p is not lead and p.id
              and p.commits and p.commits[-1].t >= now - RECENT_S
              and p.id in p.commits[-1].roster]
        return min(ok, key=lambda p: (self.hits[p.name], -p.born), default=None)

    def inject(self, kind: str) -> Fault:
        g = self.g
        f = Fault(kind, time.time(), leader_before=self.leader())
        self.faults.append(f)
        if kind == "joiner":
            if len(g.members()) >= self.target:
                # Room for the joiner: a follower leaves cleanly, so that the group keeps
                # its size and the fault-free run of that size stays the reference.
                old = self.follower()
                if old is not None:
                    old.fate, old.gone_at = "retired", time.time()
                    g.send(old, signal.SIGTERM)
                    f.note = f"{old.name} left first (SIGTERM)"
            f.joiner = g.spawn()
            return f
        victim = f.leader_before if kind.startswith("leader") else self.follower()
        if victim is None:
            f.note = "skipped: no " + ("leader" if kind.startswith("leader") else
                                       "follower in the roster")
            return f
        f.victim = victim
        self.hits[victim.name] += 1
        if kind.endswith("kill"):
            victim.fate, victim.gone_at = "killed", time.time()
            g.send(victim, signal.SIGKILL)
            f.joiner = g.spawn()  # its replacement, at once
            return f
        pause = float(kind.rsplit("-", 1)[1])
        victim.fate = "paused"
        g.send(victim, signal.SIGSTOP)

        def resume() -> None:
            g.send(victim, signal.SIGCONT)
            f.cont_at = time.time()
            if victim.fate == "paused":
                victim.fate = "member"

        g.after(pause, resume)
        return f

    def run(self, lead: Peer, minutes: float, every: float, kinds: Sequence[str],
            drain: float) -> RunResult:
        g = self.g
        t0 = wait_first_commit(g, lead, 180)
        t_end = t0 + minutes * 60

        def over() -> bool:  # the group reached its budget: every member ended
            return not g.members()

        k, next_at = 0, t0 + every
        while next_at < t_end:
            g.wait(next_at, over)
            if over():
                break
            self.inject(kinds[k % len(kinds)])
            k += 1
            next_at += every
        g.wait(t_end, over)
        self.replace = False
        rounds = g.round_at(t_end)
        g.wait(max(t_end, time.time()) + drain, lambda: over() and not g.timers)
        finished = None if g.members() else max(
            (p.gone_at or 0.0 for p in g.peers), default=None)
        return RunResult(g, t0, t_end, rounds, g.contributions(rounds), self.faults,
                         finished)


# ----------------------------------------------------------------------------- start-up


def startup_trial(server: str, out: Path, n: int, trial: int, timeout: float) -> StartTrial:
    g = Group(server, f"churnstart{n}x{trial}", out, UNBOUNDED_STEPS, join_timeout=timeout)
    try:
        try:
            lead = start_group(g, n)
        except StartFailed as exc:  # one trial's failure, not the bench's
            return StartTrial(n, None, 0, str(exc))
        t_start = lead.born

        def full() -> bool:
            return any(len(c.roster) == n for c in lead.commits)

        g.wait(t_start + timeout, lambda: full() or not lead.running)
        first = lead.commits[0] if lead.commits else None
        done = next((c for c in lead.commits if len(c.roster) == n), None)
        quit_early = [p for p in g.peers if p.code is not None]
        lost = []
        if first is not None and len(first.roster) < n:
            lost.append(f"first roster {len(first.roster)} of {n}")
        for p in quit_early:
            lost.append(f"{p.name} exited {p.code}: {p.last_line}")
        if done is None:
            lost.append(f"no commit with all {n} within {timeout:g} s"
                        if lead.running else f"leader ended: {lead.last_line}")
        trial_result = StartTrial(n, None if done is None else done.t - t_start,
                                  len(first.roster) if first else 0, "; ".join(lost))
    finally:
        g.stop_all()
    stalls = [p.end["loop_stall_max_s"] for p in g.peers
              if p.end is not None and "loop_stall_max_s" in p.end]
    trial_result.stall_s = max(stalls, default=None)
    return trial_result


# ----------------------------------------------------------------------------- report


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _cell(text: str) -> str:
    """A log line as a table cell: its own pipes must not split the row."""
    return text.replace("|", "\\|")


def after_sigcont(g: Group, f: Fault) -> str:
    """What a stopped victim did once it was SIGCONTed: rejoined (committed a round the
    group committed after the SIGCONT, with the group's hash), exited, or neither."""
    v = f.victim
    assert v is not None
    if f.cont_at is None:
        return "still stopped at the end"
    cut = next((line for t, p, line in g.cutoffs if p is v and t >= f.cont_at), None)
    main = g.main_hashes()
    since = g.round_at(f.cont_at)
    back = next((c for c in v.commits_after(f.cont_at) if c.round > since
                 and c.hash == main.get(c.round) and len(c.roster) > 1), None)
    said = f" ({cut.split(':', 1)[0]})" if cut else ""
    if back is not None:
        return f"rejoined, commit +{back.t - f.cont_at:.1f} s{said}"
    if v.code is not None and v.fate == "exited" and (v.gone_at or 0) >= f.cont_at:
        return f"exited {v.code}: {v.last_line[:120]}"
    if v.code is not None:
        return f"ended {v.code} ({v.fate}): {v.last_line[:120]}"
    return f"running, no commit with the group by the end{said}: {v.last_line[:120]}"


def fault_rows(run: RunResult) -> list[dict[str, str]]:
    g = run.group
    rows = []
    for i, f in enumerate(run.faults):
        nxt = run.faults[i + 1].at if i + 1 < len(run.faults) else max(run.t_end, f.at + 1)
        after = g.commits_after(f.at, but=f.victim)
        first = after[0][0].t - f.at if after else None
        changed = None
        if f.victim is not None and f.victim.id:
            changed = next((c.t - f.at for c, _ in after if f.victim.id not in c.roster), None)
        elif f.kind == "joiner" and f.joiner is not None:
            jid = f.joiner.id
            changed = next((c.t - f.at for c, _ in after if jid and jid in c.roster), None)
        lead_after = g.leader_at(nxt - 1e-3)
        leaders = [p for t, p in g.leads if f.at <= t < nxt]
        led = (f"{f.leader_before.name if f.leader_before else '?'} -> "
               f"{lead_after.name if lead_after else '?'}")
        if len(set(map(id, leaders))) > 1:
            led += " (leading lines: " + ", ".join(p.name for p in leaders) + ")"
        forks = g.forks(f.at, nxt)
        halts = [f"{p.name}: {line[:100]}" for t, p, line in g.halts if f.at <= t < nxt]
        halts += [f"{p.name} exited {p.code}" for p in g.peers if p.fate == "exited"
                  and p.code and f.at <= (p.gone_at or 0) < nxt]
        if f.kind.endswith("kill") or f.kind == "joiner":
            outcome = f"{f.joiner.name} joined" if f.joiner else ""
        else:
            outcome = after_sigcont(g, f) if f.victim else ""
        if f.note:
            outcome = f"{outcome}; {f.note}" if outcome else f.note
        rows.append({
            "n": str(i + 1), "at": f"{f.at - run.t0:.0f}", "fault": FAULTS[f.kind],
            "victim": f.victim.name if f.victim else (f.joiner.name if f.joiner else "-"),
            "next": _s(first), "roster": _s(changed), "led": led, "outcome": outcome or "-",
            "forked": ", ".join(f"{p.name} at round {r}" for r, p in forks) or "no",
            "halted": "; ".join(halts) or "no",
        })
    return rows


def rss_rows(g: Group, t0: float, t_end: float) -> list[str]:
    """Peers that lived through at least half the faulty span, their VmRSS over it from
    their first commit (a joiner's start-up is not growth)."""
    rows = []
    span = t_end - t0
    for p in g.peers:
        since = max(t0, p.commits[0].t if p.commits else math.inf)
        samples = [(t, r) for t, r in p.rss if since <= t <= t_end]
        if len(samples) < 3 or samples[-1][0] - samples[0][0] < span / 2:
            continue
        (ta, first), (tb, last) = samples[0], samples[-1]
        quarters = [samples[min(len(samples) - 1, round(q * (len(samples) - 1)))][1]
                    for q in (0.25, 0.5, 0.75)]
        slope = (last - first) / MB / max((tb - ta) / 60, 1e-9)
        rows.append(f"| {p.name} | {(ta - t0) / 60:.1f}-{(tb - t0) / 60:.1f} | "
                    f"{first / MB:.0f} | " + " | ".join(f"{q / MB:.0f}" for q in quarters)
                    + f" | {last / MB:.0f} | {max(r for _, r in samples) / MB:.0f} | "
                    f"{slope:+.2f} |")
    return rows


def write_rss_csv(g: Group, t0: float, path: Path) -> None:
    with open(path, "w") as f:
        f.write("peer,seconds,vmrss_bytes\n")
        for p in g.peers:
            for t, r in p.rss:
                f.write(f"{p.name},{t - t0:.1f},{r}\n")


def startup_rows(trials: list[StartTrial]) -> list[str]:
    rows = []
    for n in sorted({t.peers for t in trials}):
        ts = [t for t in trials if t.peers == n]
        times = [t.full_s for t in ts if t.full_s is not None]
        lost = [t for t in ts if t.lost]
        stalls = [t.stall_s for t in ts if t.stall_s is not None]
        rows.append(f"| {n} | {len(ts)} | "
                    + (f"{statistics.median(times):.1f} | {max(times):.1f}" if times
                       else "- | -")
                    + f" | {_s(max(stalls, default=None))}"
                    + f" | {len(lost)} of {len(ts)} | "
                    + (_cell("; ".join(f"trial {ts.index(t) + 1}: {t.lost[:200]}"
                                       for t in lost)) or "-") + " |")
    return rows


def startup_section(args: argparse.Namespace, startup: list[StartTrial]) -> list[str]:
    return [f"Start-up: a leader with `--wait-peers N` and N - 1 followers started at "
            f"once ({_trials_text(args.startup_sizes)}; a trial and every peer's "
            f"`--join-timeout`: {args.startup_timeout:g} s + 8 s per peer). Time from "
            "the leader's start to the first commit with all N in the roster; a start "
            "lost members when its first roster was short, a peer exited, or no full "
            "roster came. The longest stall is the most any peer's event loop was "
            "late (`loop_stall_max_s`, from its end record): what the link timeouts "
            "must allow for.", "",
            "| peers | trials | full roster s (median) | max s | longest loop stall s "
            "| starts that lost members | what |", "|---:|---:|---:|---:|---:|---|---|",
            *startup_rows(startup), ""]


def report(args: argparse.Namespace, command: str, load: float, base: RunResult | None,
           run: RunResult, startup: list[StartTrial], out: Path) -> ChurnReport:
    g = run.group
    rows = fault_rows(run)
    exit0 = [p for p in g.peers if p.code == 0]
    finals: dict[str, list[str]] = {}
    for p in exit0:
        h = (p.end or {}).get("weight_hash", "?")
        finals.setdefault(h, []).append(p.name)
    forked = [f"{p.name} at round {r}" for r, p in g.forks()]
    halted = [f"{p.name}: {line}" for _, p, line in g.halts]
    codes = Counter(p.code for p in g.peers)
    minutes = (run.t_end - run.t0) / 60
    last_lead = g.leader_at(run.t_end)
    who = f" (the leader then: {last_lead.name})" if last_lead else ""
    quit_on_own = [f"{p.name} exited {p.code}: {p.last_line[:120]}" for p in g.peers
                   if p.fate == "exited" and p.code]
    table = ["| # | at s | fault | victim | next commit s | roster without it (with a "
             "joiner) s | led before -> after | after the fault | forked | halted |",
             "|---:|---:|---|---|---:|---:|---|---|---|---|"]
    table += ["| " + " | ".join(_cell(r[k]) for k in ("n", "at", "fault", "victim", "next",
                                                      "roster", "led", "outcome", "forked",
                                                      "halted")) + " |" for r in rows]
    if base is not None:
        scale = minutes / ((base.t_end - base.t0) / 60)
        b_rounds, b_contrib = base.rounds * scale, base.contributions * scale
        scaled = "" if abs(scale - 1) < 1e-6 else (
            f" (its {(base.t_end - base.t0) / 60:g} minutes scaled by {scale:.2f})")
        goodput = [
            f"| rounds committed in {minutes:g} min{who} | {run.rounds} | "
            f"{b_rounds:.0f}{scaled} | "
            f"{run.rounds / b_rounds:.2f} |",
            f"| member-rounds (roster sizes summed) | {run.contributions} | "
            f"{b_contrib:.0f} | {run.contributions / b_contrib:.2f} |",
        ]
    else:
        goodput = [f"| rounds committed in {minutes:g} min{who} | {run.rounds} | not run | - |"]
    drain = ("the group did not finish its budget in the time allowed"
             if run.finished_at is None else
             f"the group finished its budget {(run.finished_at - run.t_end) / 60:+.1f} min "
             "after the faults stopped")
    verdict = "yes" if len(finals) == 1 and not forked else "**no**"
    summary = [
        "| | faulty run | fault-free run | faulty / fault-free |", "|---|---:|---:|---:|",
        *goodput,
        f"| distinct final weight hashes among the {len(exit0)} peers that exited 0 (must "
        f"be 1) | {len(finals)} | | |",
    ]
    rss = rss_rows(g, run.t0, run.t_end)
    write_rss_csv(g, run.t0, out / "rss.csv")
    md = [
        f"## Churn: a group under one fault every {args.fault_every:g} s, and big starts "
        "(issue 36)",
        "",
        f"Command: `{command}`. Machine: {machine()}; load average {load:.1f} at the start. "
        f"Signaling server and peers on 127.0.0.1 (aiortc), unpinned on the 2 cores; model "
        f"`{' '.join(MODEL)}`, rounds of {H} steps, {DEFAULTS['codec']}.",
        "",
        f"{args.peers} peers trained for {minutes:g} min from their first commit with one "
        f"fault every {args.fault_every:g} s in turn ({', '.join(FAULTS[k] for k in args.kinds)})"
        + ("; killed peers replaced by joiners at once" if any(
            k.endswith("kill") for k in args.kinds) else "")
        + ". Times are from the fault: to the next "
        "commit by any other peer, and to the first commit whose roster leaves the victim "
        "out (for a joiner: has it in). \"Forked\": a peer's record of a round with another "
        "hash than the round's majority; \"halted\": a `halted at` line or an exit on its "
        "own with a non-zero code.",
        "",
        *table,
        "",
        *summary,
        "",
        f"One group, one model: {verdict} ({len(finals)} final hash"
        f"{'es' if len(finals) != 1 else ''}"
        + (": " + "; ".join(f"{h[:16]} on {', '.join(ps)}" for h, ps in finals.items())
           if finals else "") + f"; forks: {', '.join(forked) or 'none'}; halts: "
        f"{len(halted)}). Peers started: {len(g.peers)}; exit codes "
        + ", ".join(f"{c}: {n}" for c, n in sorted(codes.items(), key=lambda x: str(x[0])))
        + f". After the faults {drain}."
        + (" Exited on their own: " + "; ".join(quit_on_own) + "." if quit_on_own else ""),
        "",
    ]
    if rss:
        md += ["VmRSS (MB) of the peers that lived through at least half the faulty run, "
               "sampled every 5 s from their first commit (all samples: `rss.csv` in the "
               "run's directory):", "",
               "| peer | sampled min | first | 1/4 | 1/2 | 3/4 | last | max | MB/min |",
               "|---|---|---:|---:|---:|---:|---:|---:|---:|", *rss, ""]
    if startup:
        md += startup_section(args, startup)
    return ChurnReport(base, run, rows, finals, forked, halted, startup,
                       "\n".join(md).rstrip() + "\n")


# ----------------------------------------------------------------------------- main


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.churn",
                                 description="a training group under churn (issue 36)")
    ap.add_argument("--minutes", type=float, help="faulty span (default 20; --quick 2)")
    ap.add_argument("--peers", type=int, default=6, help="group size, 3..8 (default 6)")
    ap.add_argument("--fault-every", type=float, help="seconds (default 30; --quick 15)")
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help="the fault cycle, comma-separated from: " + ", ".join(FAULTS))
    ap.add_argument("--baseline-minutes", type=float,
                    help="fault-free run (default: --minutes; --quick 1); 0 skips it "
                         "(then --rounds is needed)")
    ap.add_argument("--rounds", type=int, help="the faulty run's budget in rounds "
                    "(default: the fault-free run's rounds, scaled, plus 10%%)")
    ap.add_argument("--drain-minutes", type=float,
                    help="after the faults, how long the group may take to finish "
                         "(default: half of --minutes, at least 1)")
    ap.add_argument("--startup-sizes", help="default 8,16,24,32 (--quick 8); SIZExTRIALS "
                    "(32x10) gives one size its own number of trials")
    ap.add_argument("--startup-trials", type=int, help="per size: default 3 (--quick 1)")
    ap.add_argument("--startup-timeout", type=float, default=60.0,
                    help="seconds per trial, plus 8 s per peer (default 60)")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--startup-only", action="store_true",
                    help="only the start-up table (its own section of TEST_RESULTS.md)")
    ap.add_argument("--out", type=Path, help="logs and metrics (default out/churn-<time>)")
    ap.add_argument("--quick", action="store_true", help="a 2-minute form; nothing written")
    args = ap.parse_args(argv)
    quick = args.quick
    args.minutes = args.minutes if args.minutes is not None else (2.0 if quick else 20.0)
    args.fault_every = args.fault_every or (15.0 if quick else 30.0)
    if args.baseline_minutes is None:
        args.baseline_minutes = 1.0 if quick else args.minutes
    if args.drain_minutes is None:
        args.drain_minutes = max(1.0, args.minutes / 2)
    args.startup_trials = args.startup_trials or (1 if quick else 3)
    try:
        args.startup_sizes = [_size_trials(x, args.startup_trials) for x in (
            args.startup_sizes or ("8" if quick else "8,16,24,32")).split(",")]
    except ValueError:
        ap.error("--startup-sizes takes sizes, each with an optional xTRIALS: 8,16,32x10")
    args.kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    bad = [k for k in args.kinds if k not in FAULTS]
    if bad or not args.kinds:
        ap.error(f"unknown fault(s) {bad}; choose from {', '.join(FAULTS)}")
    if not 2 <= args.peers <= MAX_GROUP:
        ap.error(f"--peers must be 2..{MAX_GROUP}")
    if args.baseline_minutes <= 0 and not args.rounds:
        ap.error("without a fault-free run (--baseline-minutes 0) give --rounds")
    args.out = args.out or ROOT / "out" / time.strftime("churn-%Y%m%d-%H%M%S")
    return args


def _command(argv: Sequence[str]) -> str:
    return " ".join(["python -m bench.churn", *argv])


def _size_trials(text: str, trials: int) -> tuple[int, int]:
    """``"32"`` -> (32, trials); ``"32x10"`` -> (32, 10)."""
    size, _, own = text.strip().partition("x")
    n, k = int(size), int(own) if own else trials
    if n < 2 or k < 1:
        raise ValueError(text)
    return n, k


def _trials_text(sizes: Sequence[tuple[int, int]]) -> str:
    counts = Counter(k for _, k in sizes)
    if len(counts) == 1:
        return f"{sizes[0][1]} trial(s) per size"
    return "trials per size: " + ", ".join(f"{n}: {k}" for n, k in sizes)


def run_startups(server: str, args: argparse.Namespace, out: Path) -> list[StartTrial]:
    startup: list[StartTrial] = []
    for n, trials in args.startup_sizes:
        for k in range(trials):
            t = startup_trial(server, out / f"startup-{n}-{k + 1}", n, k + 1,
                              args.startup_timeout + 8 * n)
            print(f"start-up of {n}: full roster after {_s(t.full_s)} s"
                  + (f"; lost: {t.lost}" if t.lost else ""), flush=True)
            startup.append(t)
    return startup


def main(argv: Sequence[str] | None = None) -> ChurnReport:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]

    def terminated(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # the finally blocks stop every peer

    previous = signal.signal(signal.SIGTERM, terminated)
    if args.startup_only:
        try:
            with signaling_server(ROOT, out / "signal.log") as server:
                startup = run_startups(server, args, out)
        finally:
            signal.signal(signal.SIGTERM, previous)
        md = ["## Start-up of big groups (bench.churn --startup-only, issue 36)", "",
              f"Command: `{_command(argv)}`. Machine: {machine()}; load average {load:.1f} "
              "at the start. Signaling server and peers on 127.0.0.1 (aiortc), unpinned on "
              "the machine's cores.", "", *startup_section(args, startup)]
        print("\n".join(md))
        if not args.quick:
            write_section("churn-startup", "\n".join(md))
        return ChurnReport(None, None, [], {}, [], [], startup, "\n".join(md))
    try:
        with signaling_server(ROOT, out / "signal.log") as server:
            base = None
            if args.baseline_minutes > 0:
                print(f"fault-free run: {args.peers} peers, {args.baseline_minutes:g} min",
                      flush=True)
                base = fault_free_run(server, out / "baseline", args.peers,
                                      args.baseline_minutes)
                print(f"  {base.rounds} rounds in {args.baseline_minutes:g} min", flush=True)
            budget = args.rounds or math.ceil(
                base.rounds * args.minutes / args.baseline_minutes * BUDGET_HEADROOM)
            print(f"faulty run: {args.peers} peers, {args.minutes:g} min, budget {budget} "
                  f"rounds, a fault every {args.fault_every:g} s", flush=True)
            g = Group(server, "churnrun", out / "churn", budget * H)
            try:
                churn = Churn(g, args.peers)
                lead = start_group(g, args.peers)
                run = churn.run(lead, args.minutes, args.fault_every, args.kinds,
                                args.drain_minutes * 60)
            finally:
                g.stop_all()
            startup = [] if args.skip_startup else run_startups(server, args, out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    rep = report(args, _command(argv), load, base, run, startup, out)
    print(rep.markdown)
    print(f"logs and metrics: {out}")
    if not args.quick:
        write_section("churn", rep.markdown)
    return rep


if __name__ == "__main__":
    try:
        main()
    except StartFailed as exc:
        raise SystemExit(f"bench.churn: {exc}") from None
    except KeyboardInterrupt:
        print("bench.churn: interrupted; every peer and the signaling server it started "
              "are stopped", file=sys.stderr)
        raise SystemExit(130) from None
