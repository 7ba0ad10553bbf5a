"""``python -m bench.links``: a group on slow uplinks against one machine.

Every peer runs ``daisyweb-peer`` (aiortc) in a network namespace of its own, joined to
the others through a bridge (``bench._bridge``), its upload shaped with ``tc tbf`` to
``--rates`` MB/s, pinned to core ``i mod 2`` with one BLAS thread (on this 2-core machine
four peers share two cores, two to a core: say so when reading their rows). The default
model, the built-in corpus, 300 steps, held-out loss evaluated every third round.

For each mode (``--modes``: today's default and the new one, the flags below) and rate:

* two peers: the leader starts alone, the second peer joins after the leader's second
  round; its join time runs from its admission (its ``joined as`` line) to the state
  taken (``took`` / ``made the state``) and to its first committed round;
* ``--sizes`` peers started together (the leader waits for all);

and one peer alone on core 0 (unshaped, nothing to send): its tokens/s and its held-out
loss at 300 steps. Reported per group: tokens/s over the rounds in which every member
trained (from the second such round on, the leader's records: tokens of a round over the
median wall time between commits, leaving out the first two and the last) against one
peer's, the time from the leader's start to
the group's first held-out loss at or below one peer's at 300 steps (and one peer's own
time to it), and bytes each member sent per token the group trained (its frames on every
link, heartbeats included) against lockstep float32 (4 bytes a parameter a step, the
gradient to each other member).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import _bridge
from bench._group import ENV, ROOT, free_port, records, signaling_server
from bench._results import machine, write_section
from daisyweb.rules import DEFAULTS

MODES = {
    "int4, 2 ahead (two defaults ago)": ["--codec", "int4", "--overlap", "2", "--sync-max", "16"],
    "rounds of 16 (the last default)": ["--sync-max", "16"],  # int2, up to 16 ahead
    # int2, rounds of 16 to 64 steps as the link needs, as far ahead as it needs
    "default": [],
}
STEPS = 300
EVAL_EVERY = 48  # every third round: an evaluation holds the event loop ~0.2 s
TOKENS_PER_SEQUENCE = int(DEFAULTS["seq"])
_JOINED = re.compile(r"joined as ")
_STATE = re.compile(r"(took|made) the state of boundary")


@dataclass
class Peer:
    name: str
    proc: subprocess.Popen[bytes]
    metrics: Path
    started: float  # wall clock
    lines: list[tuple[float, str]] = field(default_factory=list)  # (wall clock, line)

    def first(self, pattern: re.Pattern[str]) -> float | None:
        return next((t for t, line in self.lines if pattern.search(line)), None)


@dataclass
class Result:
    mode: str
    rate: float | None  # MB/s a peer's upload, None: unshaped
    n: int
    tokens_per_s: float
    to_target_s: float | None  # leader start to held-out <= one peer's at 300 steps
    bytes_per_token: float  # a member's bytes sent per token the group trained
    heldout: float  # the group's held-out at the end
    join: tuple[float, float] | None = None  # admitted -> state taken, -> first commit
    head_steps: float = 0.0  # median head start of a member's rounds
    round_steps: float = 0.0  # median length of the steady rounds


def _spawn(name: str, cmd: list[str], prefix: list[str], core: int, out: Path,
           env: dict[str, str]) -> Peer:
    metrics = out / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    full = [*prefix, "taskset", "-c", str(core), *cmd, "--metrics", str(metrics)]
    proc = subprocess.Popen(full, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    peer = Peer(name, proc, metrics, time.time())

    def read() -> None:
        assert proc.stderr is not None
        with (out / f"{name}.log").open("w") as log:
            for raw in proc.stderr:
                line = raw.decode(errors="replace")
                peer.lines.append((time.time(), line))
                log.write(line)

    threading.Thread(target=read, daemon=True).start()
    return peer


def _peer_cmd(server: str, room: str, name: str, hosts: Sequence[str]) -> list[str]:
    ice = [a for h in hosts for a in ("--ice-host", h)]
    return [sys.executable, "-m", "daisyweb.cli.peer", "--server", server, "--room", room,
            "--name", name, *ice, "--approve", "auto", "--join-timeout", "300"]


def _leader_flags(mode: Sequence[str], wait: int) -> list[str]:
    return ["--start", *mode, "--steps", str(STEPS), "--eval-every", str(EVAL_EVERY),
            "--wait-peers", str(wait)]


def _wait(peers: list[Peer], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    for p in peers:
        try:
            p.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{what}: {p.name} did not end within {timeout:g} s") from None
        if p.proc.returncode != 0:
            tail = "".join(line for _, line in p.lines[-15:])
            raise SystemExit(f"{what}: {p.name} exited {p.proc.returncode}:\n{tail}")


def run_group(n: int, mode: Sequence[str], server: str, prefix: Sequence[list[str]],
              hosts: Sequence[str], out: Path, join: bool, env: dict[str, str]) -> list[Peer]:
    """``n`` peers; with ``join`` the leader starts alone and the others join after its
    second round."""
    out.mkdir(parents=True, exist_ok=True)
    room = f"l{n}{int(time.time() * 1000) % 10**6}"
    peers: list[Peer] = []
    try:
        lead = _spawn("p0", [*_peer_cmd(server, room, "p0", hosts),
                             *_leader_flags(mode, 1 if join else n)], prefix[0], 0, out,
                      env)
        peers.append(lead)
        time.sleep(1.0)  # the room's first peer is its host
        if join:
            deadline = time.monotonic() + 300
            while len([r for r in _records(lead) if "round" in r]) < 2:
                if lead.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the leader ended or stalled before its second round")
                time.sleep(0.05)
        for i in range(1, n):
            peers.append(_spawn(f"p{i}", _peer_cmd(server, room, f"p{i}", hosts),
                                prefix[i], i % 2, out, env))
        _wait(peers, 1800, f"{n} peers")
    finally:
        for p in peers:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
    return peers


def _records(p: Peer) -> list[dict]:
    return records(p.metrics) if p.metrics.exists() else []


def _steady(rounds: list[dict], what: str) -> tuple[list[dict], float]:
    """The steady rounds (not the first two: the start, a join; nor the short last) and
    the median of their rates in optimizer steps a second (each round's steps over the
    time from the commit before it to its own; rounds differ in length when the leader
    lengthens them): a round that recomputed a dropped head start does not set it."""
    steady = rounds[2:-1]
    if len(steady) < 3:
        raise SystemExit(f"{what}: fewer than 6 rounds with every member")
    rates = [(b["step"] - a["step"]) / max(b["time"] - a["time"], 1e-9)
             for a, b in zip(steady, steady[1:], strict=False)]
    return steady, statistics.median(rates)


def summarize(mode: str, rate: float | None, n: int, peers: list[Peer], target: float,
              join: bool) -> Result:
    lead = [r for r in _records(peers[0]) if "round" in r]
    steady, steps_per_s = _steady([r for r in lead if len(r["roster"]) == n],
                                  f"{mode} {n} peers")
    batch = int(DEFAULTS["batch"])
    tokens = (steady[-1]["step"] - steady[0]["step"]) * batch * TOKENS_PER_SEQUENCE * n
    tps = steps_per_s * batch * TOKENS_PER_SEQUENCE * n
    reached = next((r["time"] for r in lead if r.get("heldout_loss", 99.0) <= target), None)
    sent = []
    for p in peers:
        recs = {r["round"]: r for r in _records(p) if "round" in r}
        a, b = recs.get(steady[0]["round"]), recs.get(steady[-1]["round"])
        if a is not None and b is not None:
            sent.append(b["wire_sent"] - a["wire_sent"])
    per_token = statistics.median(sent) / tokens
    # each member's rounds after its first (which no head start can precede)
    heads = [r["head_steps"] for p in peers
             for r in [x for x in _records(p) if "round" in x][1:]]
    res = Result(mode, rate, n, tps, None if reached is None else reached - peers[0].started,
                 per_token, lead[-1].get("heldout_loss", float("nan")),
                 head_steps=statistics.median(heads) if heads else 0.0,
                 round_steps=statistics.median(r["round_steps"] for r in steady[1:]))
    if join:
        joiner = peers[1]
        admitted, state = joiner.first(_JOINED), joiner.first(_STATE)
        mine = [r for r in _records(joiner) if "round" in r]
        if admitted is not None and state is not None and mine:
            res.join = (state - admitted, mine[0]["time"] - admitted)
    return res


def one_peer(out: Path) -> tuple[float, float, float]:
    """One peer alone on core 0: tokens/s over its rounds after the first, its held-out
    loss at 300 steps and the seconds from its start to it."""
    with signaling_server(out) as server:
        # Alone nothing is exchanged, so nothing to hide: no head start (whose length
        # would follow this machine's timing) keeps the baseline the same every run.
        [p] = run_group(1, ["--overlap", "0", "--sync-max", "16"], server, [[]],
                        ["127.0.0.1"], out / "one", join=False, env=ENV)
    recs = [r for r in _records(p) if "round" in r]
    _, steps_per_s = _steady(recs, "one peer")
    tokens_per_s = steps_per_s * int(DEFAULTS["batch"]) * TOKENS_PER_SEQUENCE
    return tokens_per_s, recs[-1]["heldout_loss"], recs[-1]["time"] - p.started


def shaped(n: int, mode: str, rate: float | None, out: Path, target: float,
           join: bool, transport: str) -> Result:
    # The namespaces hold nothing but their veth and lo: libwebrtc may gather them all.
    env = dict(ENV, DAISYWEB_TRANSPORT=transport, DAISYWEB_LOOPBACK_ONLY="0")
    with _bridge.bridge(n, None if rate is None else rate * 8) as b:
        port = free_port()
        server = subprocess.Popen(
            [*b.run_in_hub(), sys.executable, "-m", "signaling.cli", "--host",
             b.hub_address, "--port", str(port), "--data", "builtin"],
            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            time.sleep(2.0)
            peers = run_group(n, MODES[mode], f"http://{b.hub_address}:{port}",
                              [b.run_in(i) for i in range(n)],
                              [b.address(i) for i in range(n)], out, join, env)
        finally:
            server.terminate()
            server.wait(timeout=10)
    return summarize(mode, rate, n, peers, target, join)


def lockstep_bytes_per_token(n: int) -> float:
    """Lockstep float32, all-to-all: a member sends its 4P-byte gradient to each of the
    other n - 1 every step, in which the group trains n x batch x seq tokens."""
    from daisyweb.data import default_tokenizer
    from daisyweb.model import ModelConfig, param_count

    size = param_count(ModelConfig(vocab=default_tokenizer().vocab_size))
    return 4 * size * (n - 1) / (n * int(DEFAULTS["batch"]) * TOKENS_PER_SEQUENCE)


def table(rows: list[Result], one: tuple[float, float, float]) -> list[str]:
    tps1, target, t1 = one
    out = ["| mode | uplink | peers | tokens/s (x one peer) | to one peer's 300-step "
           "held-out | bytes sent per token (x fewer than lockstep f32) | median round "
           "/ head start | join: state / first round | held-out at 300 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    out.append(f"| one peer | - | 1 | {tps1:,.0f} (1.00x) | {t1:.1f} s | - | - | - | "
               f"{target:.3f} |")
    for r in rows:
        link = "unshaped" if r.rate is None else f"{r.rate:g} MB/s"
        reach = "not reached" if r.to_target_s is None else f"{r.to_target_s:.1f} s"
        join = "-" if r.join is None else f"{r.join[0]:.1f} s / {r.join[1]:.1f} s"
        out.append(
            f"| {r.mode} | {link} | {r.n} | {r.tokens_per_s:,.0f} ({r.tokens_per_s / tps1:.2f}x)"
            f" | {reach} | {r.bytes_per_token:.1f} "
            f"({lockstep_bytes_per_token(r.n) / r.bytes_per_token:.0f}x) | "
            f"{r.round_steps:g} / {r.head_steps:g} | "
            f"{join} | {r.heldout:.3f} |")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.links", description=__doc__)
    ap.add_argument("--rates", default="1,2.5,10", help="MB/s per peer upload")
    ap.add_argument("--sizes", default="4", help="groups started together (besides the "
                    "two-peer group with a joiner)")
    ap.add_argument("--modes", default="|".join(MODES), help="|-separated")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-links"))
    ap.add_argument("--transport", choices=("aiortc", "libwebrtc"), default="aiortc")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    why = _bridge.unavailable()
    if why is not None:
        raise SystemExit(f"bench.links {why}")
    rates = [float(x) for x in a.rates.split(",") if x]
    sizes = [int(x) for x in a.sizes.split(",") if x]
    modes = [m for m in a.modes.split("|") if m]
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    one = one_peer(a.out)
    print(f"one peer: {one[0]:,.0f} tokens/s, held-out {one[1]:.4f} at {STEPS} steps "
          f"after {one[2]:.1f} s", flush=True)
    rows: list[Result] = []
    for rate in rates:
        for mode in modes:  # interleaved: a slow moment of the machine hits both alike
            for n, join in [(2, True), *((s, False) for s in sizes)]:
                out = a.out / f"{list(MODES).index(mode)}-{rate:g}-{n}"
                r = shaped(n, mode, rate, out, one[1], join, a.transport)
                rows.append(r)
                print(table([r], one)[-1], flush=True)
    lines = table(rows, one)
    modes_text = "; ".join(
        f"{m}: `{' '.join(MODES[m])}`" if MODES[m] else
        f"{m}: no flags (`--sync-every {DEFAULTS['sync_every']} --sync-max "
        f"{DEFAULTS['sync_max']} --codec {DEFAULTS['codec']} --overlap {DEFAULTS['overlap']}`)"
        for m in modes)
    section = [
        "## A group on slow uplinks against one machine (bench.links)",
        "",
        f"`python -m bench.links --rates {a.rates} --sizes {a.sizes} --transport "
        f"{a.transport}` -- {machine()}; {time.time() - t0:.0f} s. The default model and "
        f"run ({STEPS} steps, rounds of {DEFAULTS['sync_every']}), {a.transport}, each peer "
        "in its own network namespace with "
        "its upload shaped by `tc tbf` (burst 64 kB), pinned to core i mod 2 (four peers: "
        "two to a core, each at about half a core), held-out evaluated every third round "
        f"(its time included). Modes: {modes_text}. Two-peer rows: the second peer joins "
        "after the leader's second round (join: admitted to state taken / to its first "
        "committed round). Tokens/s: the median over the rounds with every member (not "
        "the first two nor the last) of a round's tokens over the time from the commit "
        "before it to its own; "
        "bytes: a member's frames sent on all links over the same rounds per token the "
        "group trained.",
        "",
        *lines,
    ]
    print("\n".join(section))
    if not a.no_write:
        write_section("links", "\n".join(section))


if __name__ == "__main__":
    main()
