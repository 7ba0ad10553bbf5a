"""Fewer bytes per token: held-out loss at equal tokens for each lossy codec.

    python -m bench.codecs            # writes the "codecs" section of TEST_RESULTS.md

``bench.rounds_sim`` at the demo default (two peers, rounds of 16, overlap 2, 300
steps, the product's own trainers, codecs with error feedback and averaging), once per
codec and seed: the group's held-out loss at the end, and the bytes a member sends per
trained token against lockstep float32 (one 4P-byte gradient per step).
"""

from __future__ import annotations

import argparse
import statistics

from bench._results import machine, write_section
from bench.rounds_sim import simulate
from daisyweb.protocol.codec import codec_by_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default="int4,int2")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=16, help="H, local steps a round")
    a = ap.parse_args()
    h = a.sync_every
    names = a.codecs.split(",")
    finals: dict[str, list[float]] = {n: [] for n in names}
    size = _size()
    for seed in range(a.seeds):
        for name in names:  # interleaved: a slow moment of the machine hits all alike
            res = simulate(2, a.steps, h, name, overlap=2, seed=seed, eval_every=a.steps)
            finals[name].append(res.final)
            print(f"seed {seed} {name}: final held-out {res.final:.4f}", flush=True)
    base = statistics.mean(finals[names[0]])
    rows = ["| codec | payload bytes per round | fewer bytes per trained token than "
            "lockstep f32 | final held-out (mean) | against " + names[0] + " | per seed |",
            "|---|---:|---:|---:|---:|---|"]
    for name in names:
        payload = codec_by_name(name).payload_size(size)
        mean = statistics.mean(finals[name])
        rows.append(f"| {name} | {payload:,} | {4 * size * h / payload:.0f}x | {mean:.4f} | "
                    f"{mean - base:+.4f} | " + ", ".join(f"{x:.4f}" for x in finals[name])
                    + " |")
    section = [
        f"## Codecs at rounds of {h}: bytes per token against held-out loss (bench.codecs)",
        "",
        f"`python -m bench.codecs --codecs {a.codecs} --seeds {a.seeds} --steps {a.steps} "
        f"--sync-every {h}` -- {machine()}. `bench.rounds_sim` at the demo default "
        f"({size:,} parameters, 2 peers, rounds of {h}, overlap 2, {a.steps} steps, "
        f"seeds 0-{a.seeds - 1}, error feedback): held-out loss of the group's anchor at "
        "the end, same tokens in every row. Lockstep f32 sends one 4P-byte gradient a step.",
        "",
        *rows,
    ]
    write_section("codecs" if h == 16 else f"codecs-h{h}", "\n".join(section))
    print("\n".join(section))


def _size() -> int:
    from daisyweb.data import default_tokenizer
    from daisyweb.model import ModelConfig, param_count

    return param_count(ModelConfig(vocab=default_tokenizer().vocab_size))


if __name__ == "__main__":
    main()
