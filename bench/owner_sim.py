"""The owner exchange against all-to-all, in simulation (issue 39's math, no network).

For each group size, ``bench.rounds_sim`` trains the same group twice at the demo
default (rounds of 16, int4, the product's trainers, codecs, clip and averaging): once
all-to-all (every member averages every contribution) and once with the owner exchange
(``protocol.owners``: each part's mean reduced by its owner, clipped per part, encoded
again with the owner's error feedback, and assembled from those bytes). It reports the
payload bytes the first member sends per round (every message it would send, counted
from the encoded bytes) and the held-out loss at equal tokens, so the second
quantization's cost is measured, not assumed. Real peers do not run the owner exchange
yet: this is the math alone.

    python -m bench.owner_sim --peers 4,8,16 --steps 320
"""

from __future__ import annotations

import argparse
import time

from bench._results import machine, write_section
from bench.rounds_sim import simulate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="4,8,16", help="group sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=320, help="inner steps per peer")
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.peers.split(",")]
    rounds = -(-a.steps // a.sync_every)
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M")
    for n in sizes:
        got = {ex: simulate(n, a.steps, a.sync_every, a.codec, seed=a.seed,
                            eval_every=a.steps, overlap=2, exchange=ex)
               for ex in ("all", "owner")}
        whole = got["all"].bytes_per_peer / rounds  # one encoded contribution
        row = (n, whole, got["all"].sent_by_first / rounds, got["owner"].sent_by_first / rounds,
               got["all"].final, got["owner"].final, got["all"].clipped, got["owner"].clipped)
        rows.append(row)
        print(f"{n} peers: all-to-all {row[2] / whole:.2f} contributions sent a round, "
              f"owner {row[3] / whole:.2f}; held-out {row[4]:.4f} vs {row[5]:.4f}", flush=True)
    md = ["## Owner exchange in simulation (bench.owner_sim, issue 39)", "",
          f"`python -m bench.owner_sim --peers {a.peers} --steps {a.steps}` on {machine()}, "
          f"{started}. Each group trained twice in one process (`bench.rounds_sim`: the "
          f"product's trainers, codec, clip and averaging; rounds of {a.sync_every}, "
          f"{a.codec}, overlap 2, seed {a.seed}, {a.steps} inner steps per peer, so equal "
          "tokens). Bytes: the encoded payloads the first member sends per round, every "
          "message counted (all-to-all: its contribution to each other member; owner: "
          "its part of its contribution to each other owner, and the mean of its own part "
          "to every other member). Held-out: `daisyweb-eval`'s fixed batches after the "
          "last round. Clipped: contributions (all-to-all) or contribution parts (owner) "
          "the bounded-influence clip scaled down. No network: real peers do not run the "
          "owner exchange yet.", "",
          "| peers | contribution bytes | all-to-all sent/round | owner sent/round | "
          "in contributions | held-out all-to-all | held-out owner | clipped |",
          "|---:|---:|---:|---:|---|---:|---:|---|"]
    for n, whole, every, owner, h_all, h_owner, c_all, c_owner in rows:
        md.append(f"| {n} | {whole:,.0f} | {every:,.0f} | {owner:,.0f} | "
                  f"{every / whole:.2f} vs {owner / whole:.2f} | {h_all:.4f} | {h_owner:.4f} | "
                  f"{c_all} vs {c_owner} |")
    text = "\n".join(md)
    print(text)
    if not a.no_write:
        write_section("owner-sim", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
