"""bench.churn in a short form: 4 real peers on 127.0.0.1, one follower SIGSTOPped for 10 s.

About a minute of wall time: a 12-second fault-free run (the goodput reference, which
also sizes the faulty run's budget), then 30 seconds with the one fault at 16 s, then
the group trains to its budget and every peer exits on its own. The test checks the
bench's bookkeeping: the fault happened and was timed, records were parsed, the paused
peer's fate was found, the peers that exited 0 agree on one final hash, and a --quick
run leaves TEST_RESULTS.md alone.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench import churn
from bench._results import RESULTS


@pytest.mark.timeout(240)
def test_a_paused_follower_is_timed_and_the_group_ends_with_one_hash(tmp_path: Path) -> None:
    before = RESULTS.read_text() if RESULTS.exists() else None
    t0 = time.monotonic()
    rep = churn.main(["--quick", "--peers", "4", "--minutes", "0.5", "--fault-every", "16",
                      "--faults", "follower-stop-10", "--baseline-minutes", "0.1",
                      "--drain-minutes", "0.5", "--skip-startup", "--out", str(tmp_path)])
    wall = time.monotonic() - t0
    assert rep.faulty is not None
    g = rep.faulty.group

    # The fault-free reference ran and its records were read.
    assert rep.baseline is not None and rep.baseline.rounds > 0
    assert len(rep.baseline.group.peers) == 4

    # Exactly one fault, the one asked for, on a follower, SIGCONTed 10 s later.
    assert [f.kind for f in rep.faulty.faults] == ["follower-stop-10"]
    fault = rep.faulty.faults[0]
    assert fault.victim is not None and fault.leader_before is not None
    assert fault.victim is not fault.leader_before
    assert fault.cont_at is not None and fault.cont_at - fault.at == pytest.approx(10, abs=1)
    row = rep.rows[0]
    assert row["fault"] == "follower SIGSTOP 10 s" and row["victim"] == fault.victim.name
    # The others went on: a commit after the fault, and one without the paused peer
    # (it misses the 5 s heartbeat timeout) within the pause.
    assert row["next"] != "-" and float(row["next"]) < 10
    assert row["roster"] != "-" and float(row["roster"]) < 10
    assert row["halted"] == "no"

    # Records parsed: every peer joined, wrote commits with rosters and an end record;
    # a commit time never runs ahead of the parse.
    assert len(g.peers) >= 4  # a peer that exited on its own was replaced
    for p in g.peers:
        assert p.id and p.commits and p.end is not None, p.last_line
        assert all(c.roster and len(c.hash) == 64 for c in p.commits)
    assert rep.faulty.rounds > 0 and rep.faulty.contributions >= rep.faulty.rounds
    assert rep.faulty.finished_at is not None  # the group trained to its budget
    assert any(len(p.rss) >= 3 for p in g.peers)  # VmRSS sampled while they ran
    assert (tmp_path / "rss.csv").read_text().startswith("peer,seconds,vmrss_bytes")
    assert "| 1 | 16 | follower SIGSTOP 10 s |" in rep.markdown

    # The peers that were never stopped finish the run and exit 0.
    others = [p for p in g.peers if p is not fault.victim]
    assert all(p.code == 0 for p in others), [(p.name, p.code, p.last_line) for p in others]

    # NOTE (issue 36, the membership change in daisyweb/protocol and peer/driver.py): until
    # a paused peer can no longer lead a second group, the SIGCONTed follower may fork
    # (train on alone and finish with a different hash) instead of rejoining or exiting.
    # These three assertions are the ones that change meaning with that fix: it rejoins
    # or exits, nobody forks, and the peers that exited 0 hold one final hash.
    assert row["outcome"].startswith(("rejoined", "exited")), row["outcome"]
    assert rep.forked == [], rep.forked
    assert len(rep.final_hashes) == 1, rep.final_hashes

    # --quick writes nothing to TEST_RESULTS.md, and the whole form stays short.
    assert (RESULTS.read_text() if RESULTS.exists() else None) == before
    assert wall < 150, wall
    # Everything the bench started has ended.
    assert all(p.proc.poll() is not None for p in [*g.peers, *rep.baseline.group.peers])


def test_startup_sizes_may_give_one_size_its_own_trials() -> None:
    args = churn.parse(["--startup-sizes", "8,32x10", "--startup-trials", "2"])
    assert args.startup_sizes == [(8, 2), (32, 10)]
    with pytest.raises(SystemExit):
        churn.parse(["--startup-sizes", "8,32x0"])
