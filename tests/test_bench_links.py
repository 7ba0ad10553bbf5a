"""bench.links reads its numbers off the peers' own records and log lines."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import links
from daisyweb.rules import DEFAULTS

TOKENS_A_ROUND = 16 * int(DEFAULTS["batch"]) * int(DEFAULTS["seq"])  # one member's


def _peer(tmp: Path, name: str, recs: list[dict], lines: list[tuple[float, str]],
          started: float) -> links.Peer:
    metrics = tmp / f"{name}.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    proc = subprocess.Popen(["true"])
    proc.wait()
    return links.Peer(name, proc, metrics, started, lines)


def _round(i: int, n: int, t: float, sent: int, heldout: float | None = None,
           head: int = 0) -> dict:
    r = {"round": i, "step": 16 * i, "time": t, "roster": ["x"] * n, "wire_sent": sent,
         "head_steps": head, "round_steps": 16}
    if heldout is not None:
        r["heldout_loss"] = heldout
    return r


def test_a_two_peer_run_with_a_joiner_is_summarized_from_the_steady_rounds(
        tmp_path: Path) -> None:
    # The leader alone for rounds 1-2; both from round 3; rounds take 2 s but one 9 s
    # round (a dropped head start) that the median leaves out.
    times = [10.0, 11.0, 14.0, 16.0, 18.0, 27.0, 29.0, 31.0, 32.0]
    lead_recs = [_round(i + 1, 1 if i < 2 else 2, t, 1000 * (i + 1),
                        heldout=6.0 - 0.1 * i, head=3) for i, t in enumerate(times)]
    follower = [_round(i + 1, 2, t, 500 * (i + 1), head=5)
                for i, t in enumerate(times) if i >= 2]
    lead = _peer(tmp_path, "p0", lead_recs, [], started=5.0)
    joiner = _peer(tmp_path, "p1", follower,
                   [(12.0, "daisyweb-peer: joined as ab in room r\n"),
                    (13.5, "daisyweb-peer: took the state of boundary 2 (5 bytes, 1 s)\n")],
                   started=11.5)
    r = links.summarize("m", 1.0, 2, [lead, joiner], target=5.45, join=True)
    # steady: the full rounds 3..9 less the first two and the last: rounds 5..8, of
    # which the median round took 2 s
    assert r.tokens_per_s == pytest.approx(2 * TOKENS_A_ROUND / 2.0)
    assert r.round_steps == 16
    # bytes: rounds 5 to 8, the median of the two members' (3000 and 1500)
    assert r.bytes_per_token == pytest.approx(2250 / (3 * 2 * TOKENS_A_ROUND))
    assert r.to_target_s == pytest.approx(29.0 - 5.0)  # 6.0 - 0.1 x 6 = 5.4 at round 7
    assert r.join == (1.5, 14.0 - 12.0)  # admitted to state, to its first round
    assert r.head_steps == 3  # the median of their rounds after the first: eight 3s, six 5s
    assert r.heldout == pytest.approx(5.2)


def test_too_few_full_rounds_is_said(tmp_path: Path) -> None:
    recs = [_round(i + 1, 2, float(i), 0) for i in range(5)]
    with pytest.raises(SystemExit, match="fewer than 6 rounds"):
        links.summarize("m", 1.0, 2, [_peer(tmp_path, "p0", recs, [], 0.0)], 5.0, False)


def test_lockstep_sends_a_gradient_to_every_other_member_each_step() -> None:
    two, four = links.lockstep_bytes_per_token(2), links.lockstep_bytes_per_token(4)
    assert four == pytest.approx(two * 3 / 2)  # three others among four, one among two


def test_rounds_of_different_lengths_count_their_own_steps(tmp_path: Path) -> None:
    # Rounds of 16 steps in 2 s, then (lengthened by the leader) 32 steps in 4 s: the
    # same rate, 8 steps a second, and the median round of 24 steps.
    steps, times, t, s = [], [], 0.0, 0
    for i in range(8):
        n = 16 if i < 4 else 32
        s, t = s + n, t + n / 8
        steps.append(s)
        times.append(t)
    recs = [dict(_round(i + 1, 2, times[i], 100 * steps[i]), step=steps[i],
                 round_steps=steps[i] - (steps[i - 1] if i else 0)) for i in range(8)]
    r = links.summarize("m", 1.0, 2, [_peer(tmp_path, "p0", recs, [], 0.0)], 5.0, False)
    assert r.tokens_per_s == pytest.approx(8 * 2 * TOKENS_A_ROUND / 16)
    assert r.round_steps == 32  # rounds 4..7 after the first steady one: 16, 32, 32, 32
