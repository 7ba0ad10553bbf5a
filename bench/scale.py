"""``python -m bench.scale``: what a round of the exchange costs each peer as the group grows,
all-to-all against the owner exchange (``daisyweb.protocol.owner_exchange``).

A tiny model (so the exchange is what is measured), rounds of 8 local steps, int4, equal
shares. For each group size and exchange, a real group of ``daisyweb-peer`` processes
(aiortc) trains ``--rounds`` rounds; from each peer's own records, over the steady rounds
(the second to the second-to-last):

* bytes sent and received per round (``wire_sent`` / ``wire_received``: the frames of all
  its links, heartbeats included), in contributions (one int4 payload of the model);
* CPU seconds per round (the process's user + system time), and beyond the CPU of the same
  rounds in a group of one (the exchange's share: sending, receiving, decoding, reducing);

Then with ``--shaped-sizes`` the same groups with every peer in a network namespace of its
own, joined through a bridge (``bench._bridge``), its upload shaped to ``--rate`` MB/s with
``tc tbf``: the round's exchange time (the peers' ``exchange_s``: own contribution ready to
round committed) and the interfaces' byte counters against the peers' own.

Last, a projection (labelled so) for machines that compute the default model: the group's
speed over one machine on links of 5, 25 and 100 MB/s, from a measured step time of the
default model and the measured bytes per round per peer (in contributions) at each size.
The table goes to stdout and into TEST_RESULTS.md (section ``bench:scale``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import _bridge
from bench._group import ENV, ROOT, free_port, records, signaling_server
from bench._results import machine, write_section
from daisyweb.model import ModelConfig, init_params
from daisyweb.protocol.codec import codec_by_name
from daisyweb.rules import DEFAULTS

H = 8
TINY = ["--width", "32", "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "2",
        "--lr", "0.01", "--seed", "3", "--sync-every", str(H), "--codec", "int4",
        "--capacity", "off", "--overlap", "0", "--sync-max", str(H)]
CLK_TCK = 100  # os.sysconf("SC_CLK_TCK") on Linux


def rounds_for(n: int, rounds: int) -> int:
    """Fewer rounds for big groups: all their peers share this machine's cores (a
    32-peer all-to-all round takes about 30 s here)."""
    return max(6, min(rounds, 240 // n))


def tiny_size() -> int:
    from daisyweb.data import default_tokenizer

    vocab = default_tokenizer().vocab_size
    return init_params(ModelConfig(vocab=vocab, width=32, layers=1, heads=2, seq=32), 3).size


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class PeerRun:
    records: list[dict]
    first: tuple[int, float] | None = None  # (round, CPU s) when its first record appeared
    cpu_end: float | None = None  # CPU s of the whole process (at exit)
    tx: tuple[int, int] | None = None  # interface bytes sent at ``first`` and at the end
    tx_end: int | None = None


@dataclass
class Row:
    n: int
    exchange: str
    shaped: bool
    sent: float  # bytes per peer per round (median over peers)
    received: float
    cpu_s: float  # CPU seconds per peer per round
    exchange_s: float  # median over peers and rounds
    iface_tx: float | None  # interface bytes sent per round over the peers' wire_sent
    owners: bool  # the rounds ran the owner exchange
    failed: list[str] = field(default_factory=list)  # why earlier attempts of it failed


def run_group(n: int, exchange: str, rounds: int, out: Path, server: str,
              prefix: Callable[[int], list[str]], ice: Callable[[int], str],
              # (every member's address: a peer takes only candidates on its list)
              counters: _bridge.Bridge | None = None, timeout: float = 1800.0,
              model: Sequence[str] = TINY, h: int = H) -> list[PeerRun]:
    """One group of ``n`` peers for ``rounds`` rounds; each peer's records and its CPU
    time (and interface counters) sampled as each of its round records appeared."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("p*.jsonl"):
        old.unlink()  # a peer appends to its metrics file: an earlier run's would count
    room = f"s{n}{exchange}{int(time.time() * 1000) % 10**6}"
    procs: list[subprocess.Popen[bytes]] = []
    paths: list[Path] = []
    runs = [PeerRun([]) for _ in range(n)]
    try:
        for i in range(n):
            metrics = out / f"p{i:02d}.jsonl"
            paths.append(metrics)
            hosts = [a for h in dict.fromkeys(ice(j) for j in range(n))
                     for a in ("--ice-host", h)]
            cmd = [*prefix(i), sys.executable, "-m", "daisyweb.cli.peer", "--server", server,
                   "--room", room, "--name", f"p{i:02d}", *hosts,
                   "--approve", "auto", "--join-timeout", "300", "--metrics", str(metrics),
                   "--exchange", exchange]
            if i == 0:
                cmd += ["--start", *model, "--steps", str(h * rounds), "--wait-peers", str(n)]
            with open(out / f"p{i:02d}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log,
                                              stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL))
            if i == 0:
                time.sleep(1.0)  # the room's first peer is its host
        deadline = time.monotonic() + timeout
        while any(p.returncode is None for p in procs):
            if time.monotonic() > deadline:
                raise SystemExit(f"{n} peers ({exchange}): no end within {timeout:g} s")
            for i, (p, path) in enumerate(zip(procs, paths, strict=True)):
                _sample(runs[i], p, path, counters, i)
            time.sleep(0.05)
        for i, p in enumerate(procs):
            if p.returncode != 0:
                log = (out / f"p{i:02d}.log").read_text(errors="replace")[-1500:]
                raise SystemExit(f"{n} peers ({exchange}): p{i:02d} failed:\n{log}")
            runs[i].records = [r for r in records(paths[i]) if "end" not in r]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return runs


def _sample(run: PeerRun, proc: subprocess.Popen[bytes], path: Path,
            counters: _bridge.Bridge | None, i: int) -> None:
    """The CPU time (and interface bytes) of a peer at its first round record, and at its
    exit (``os.wait4``: the whole process's CPU, reaped here)."""
    if proc.returncode is not None:
        return
    if run.first is None and path.exists():
        seen = [r for r in records(path) if "round" in r and "end" not in r]
        cpu = cpu_seconds(proc.pid) if seen else None
        if cpu is not None:
            run.first = (seen[-1]["round"], cpu)
            if counters is not None:
                run.tx = (counters.tx_bytes(i), 0)
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        if counters is not None:
            run.tx_end = counters.tx_bytes(i)  # the last value before it ends
        return
    proc.returncode = os.waitstatus_to_exitcode(status)
    run.cpu_end = usage.ru_utime + usage.ru_stime


def summarize(n: int, exchange: str, runs: list[PeerRun], shaped: bool) -> Row:
    """Per peer per round over its steady rounds: from its second round's record to its
    last (bytes, exchange time), from its first record to its exit (CPU)."""
    sent, received, cpu, exch, iface = [], [], [], [], []
    for run in runs:
        by_round = {r["round"]: r for r in run.records}
        lo, hi = min(by_round) + 1, max(by_round)
        count = hi - lo
        a, b = by_round[lo], by_round[hi]
        sent.append((b["wire_sent"] - a["wire_sent"]) / count)
        received.append((b["wire_received"] - a["wire_received"]) / count)
        if run.first is not None and run.cpu_end is not None:
            cpu.append((run.cpu_end - run.first[1]) / max(hi - run.first[0], 1))
        exch.extend(by_round[k]["exchange_s"] for k in range(lo + 1, hi + 1))
        if run.tx is not None and run.tx_end is not None and run.first is not None:
            wire = b["wire_sent"] - by_round.get(run.first[0], a)["wire_sent"]
            iface.append((run.tx_end - run.tx[0]) / max(wire, 1))
    owners = all(r.get("owners") for run in runs for r in run.records) and n > 1
    return Row(n, exchange, shaped, statistics.median(sent), statistics.median(received),
               statistics.median(cpu) if cpu else float("nan"), statistics.median(exch),
               statistics.median(iface) if iface else None, owners)


def loopback(n: int, exchange: str, rounds: int, out: Path, attempts: int = 2) -> Row:
    """One group on loopback; a group that fails to form or finish is started again
    (``attempts`` in all), and the failure is kept for the report."""
    failed: list[str] = []
    for attempt in range(attempts):
        try:
            with signaling_server(out.parent) as server:
                runs = run_group(n, exchange, rounds, out / f"try{attempt}", server,
                                 lambda i: [], lambda i: "127.0.0.1")
        except SystemExit as exc:
            failed.append(_first_reason(str(exc), out / f"try{attempt}"))
            print(f"{n} peers ({exchange}) attempt {attempt + 1} failed: {failed[-1]}",
                  flush=True)
            continue
        row = summarize(n, exchange, runs, False)
        row.failed = failed
        return row
    raise SystemExit(f"{n} peers ({exchange}): {attempts} attempts failed: {failed}")


def _first_reason(why: str, out: Path) -> str:
    """The first "cut off" or "halted" line any peer of a failed group wrote, else ``why``."""
    for log in sorted(out.glob("p*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "cut off at" in line or "halted at" in line:
                return line.removeprefix("daisyweb-peer: ")[:200]
    return why.splitlines()[0][:200]


def shaped(n: int, exchange: str, rounds: int, out: Path, rate_mb: float) -> Row:
    with _bridge.bridge(n, rate_mb * 8) as b:
        port = free_port()
        server_cmd = [*b.run_in_hub(), sys.executable, "-m", "signaling.cli", "--host",
                      b.hub_address, "--port", str(port), "--data", "builtin"]
        server = subprocess.Popen(server_cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.STDOUT)
        try:
            time.sleep(2.0)
            runs = run_group(n, exchange, rounds, out, f"http://{b.hub_address}:{port}",
                             b.run_in, b.address, counters=b)
        finally:
            server.terminate()
            server.wait(timeout=10)
    return summarize(n, exchange, runs, True)


def default_step_seconds(out: Path) -> tuple[float, int]:
    """One peer's compute seconds per optimizer step at the default model (a group of
    one, two rounds), and that model's parameter count."""
    h = int(DEFAULTS["sync_every"])
    with signaling_server(out.parent) as server:
        runs = run_group(1, "all", 4, out, server, lambda i: [], lambda i: "127.0.0.1",
                         model=[], h=h)
    recs = runs[0].records
    steps = sum(r["compute_s"] for r in recs[1:]) / sum(int(DEFAULTS["sync_every"])
                                                        for _ in recs[1:])
    from daisyweb.data import default_tokenizer

    model = ModelConfig(vocab=default_tokenizer().vocab_size, width=int(DEFAULTS["width"]),
                        layers=int(DEFAULTS["layers"]), heads=int(DEFAULTS["heads"]),
                        seq=int(DEFAULTS["seq"]))
    return steps, init_params(model, 0).size


def projection(step_s: float, payload: int, per_round: dict[tuple[str, int], float],
               sizes: Sequence[int], overlap: int = int(DEFAULTS["overlap"])) -> list[str]:
    """Group speed over one machine: N x H x step / (H x step + exposed exchange), the
    exchange being a peer's measured bytes per round (in contributions) of the default
    model's payload over the link, less what ``overlap`` steps ahead hide (the default:
    up to the whole round)."""
    h = int(DEFAULTS["sync_every"])
    out = ["| exchange | link | " + " | ".join(f"N={n}" for n in sizes) + " |",
           "|---|---:|" + "---:|" * len(sizes)]
    for exchange in ("all", "owner"):
        for mbps in (5, 25, 100):
            cells = []
            for n in sizes:
                contributions = per_round.get((exchange, n))
                if contributions is None:
                    cells.append("-")
                    continue
                comm = contributions * payload / (mbps * 1e6)
                exposed = max(0.0, comm - overlap * step_s)
                cells.append(f"{n * h * step_s / (h * step_s + exposed):.1f}x")
            out.append(f"| {exchange} | {mbps} MB/s | " + " | ".join(cells) + " |")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    ap.add_argument("--sizes", default="2,4,8,16,32")
    ap.add_argument("--shaped-sizes", default="2,4,8")
    ap.add_argument("--rate", type=float, default=2.0, help="MB/s per peer upload (shaped)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-scale"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    shaped_sizes = [int(x) for x in args.shaped_sizes.split(",") if x]
    size = tiny_size()
    payload = codec_by_name("int4").payload_size(size)
    t0 = time.time()
    solo = loopback(1, "all", args.rounds, args.out / "solo")
    rows: list[Row] = []
    for n in sizes:
        for exchange in ("all", "owner"):
            rows.append(loopback(n, exchange, rounds_for(n, args.rounds),
                                 args.out / f"{exchange}{n}"))
            print(_line(rows[-1], payload, solo.cpu_s), flush=True)
    if shaped_sizes and _bridge.unavailable() is None:
        for n in shaped_sizes:
            for exchange in ("all", "owner"):
                rows.append(shaped(n, exchange, rounds_for(n, args.rounds),
                                   args.out / f"shaped-{exchange}{n}", args.rate))
                print(_line(rows[-1], payload, solo.cpu_s), flush=True)
    step_s, default_size = default_step_seconds(args.out / "default")
    default_payload = codec_by_name("int4").payload_size(default_size)
    per_round = {(r.exchange, r.n): r.sent / payload for r in rows if not r.shaped}
    lines = [
        "## Scale: all-to-all against the owner exchange (bench.scale, issue 39)", "",
        f"On {machine()}, {time.strftime('%Y-%m-%d')}. "
        f"Command: `python -m bench.scale --sizes {args.sizes} --shaped-sizes "
        f"{args.shaped_sizes} --rate {args.rate:g} --rounds {args.rounds}` "
        f"({time.time() - t0:.0f} s; groups of N run max(6, min({args.rounds}, 240 / N)) "
        "rounds).",
        f"Tiny model: {size:,} parameters, rounds of {H}, int4: one contribution is "
        f"{payload:,} bytes. Every peer on this machine's 2 cores (aiortc), so a big "
        "group's peers share them: bytes and CPU per round are what they are, wall times "
        "are not a real room's.",
        "",
        "| peers | exchange | sent / round | received / round | sent, contributions | "
        "CPU s / round | beyond a group of one | exchange s / round | link |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
        *(_table_row(r, payload, solo.cpu_s, args.rate) for r in rows),
        "",
        *(f"- {r.n} peers, {r.exchange}: attempt {k + 1} failed ({why}); the row is the "
          "next attempt's." for r in rows for k, why in enumerate(r.failed)),
        "",
        f"Group of one: {solo.cpu_s:.3f} CPU s per round. `sent` counts every frame of "
        "every link (heartbeats too); in shaped runs the interfaces sent "
        + ", ".join(f"{r.iface_tx:.2f}x" for r in rows if r.iface_tx is not None)
        + " the peers' own count (IP, UDP, DTLS and SCTP headers, acknowledgements).",
        "",
        f"Projection (not a measurement): the default model ({default_size:,} parameters, "
        f"int4 payload {default_payload:,} bytes, {step_s:.3f} s per step measured here, "
        f"rounds of {DEFAULTS['sync_every']}, overlap {DEFAULTS['overlap']}), each peer "
        "sending the contributions per round measured above:",
        "",
        *projection(step_s, default_payload, per_round, sizes),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("scale", text)


def _line(r: Row, payload: int, solo_cpu: float) -> str:
    return (f"{r.n:3d} {r.exchange:5s} {'shaped' if r.shaped else 'lo':6s} "
            f"sent {r.sent / payload:5.2f} contrib  recv {r.received / payload:5.2f}  "
            f"cpu {r.cpu_s:.3f} (+{r.cpu_s - solo_cpu:.3f})  exch {r.exchange_s:.2f} s")


def _table_row(r: Row, payload: int, solo_cpu: float, rate: float) -> str:
    mode = r.exchange + (" (ran owners)" if r.owners and r.exchange != "owner" else "")
    link = f"{rate:g} MB/s up, own namespace" if r.shaped else "loopback"
    return (f"| {r.n} | {mode} | {r.sent / 1e3:,.0f} KB | {r.received / 1e3:,.0f} KB | "
            f"{r.sent / payload:.2f} | {r.cpu_s:.3f} | {r.cpu_s - solo_cpu:+.3f} | "
            f"{r.exchange_s:.2f} | {link} |")


if __name__ == "__main__":
    main()
