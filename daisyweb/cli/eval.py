"""``daisyweb-eval FILE.pt [--batches N]``: a checkpoint's loss on the held-out text.

The held-out text is the last 5% of the built-in corpus (Colossians to Revelation), which
no run trains on. The batches are fixed (``daisyweb.training.evaluate``), so two
checkpoints evaluated with the same ``--batches`` are compared on the same tokens.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from daisyweb.checkpoints.checkpoint import (
    Checkpoint,
)
from daisyweb.cli.common import damaged, open_checkpoint
from daisyweb.data import heldout_tokens
from daisyweb.training.config import trained_quantized
from daisyweb.training.evaluate import (
    DEFAULT_BATCH,
    DEFAULT_BATCHES,
    heldout_batches,
    heldout_loss,
    max_batches,
)
from kernels import NonFiniteError

MAX_BATCHES = 10_000


@dataclass(frozen=True)
class Evaluation:
    step: int
    loss: float
    batches: int
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        """Predicted (target) tokens: every window of seq + 1 tokens predicts seq of them."""
        return self.batches * self.batch * self.seq

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def evaluate_checkpoint(ckpt: Checkpoint, batches: int = DEFAULT_BATCHES) -> Evaluation:
    """Held-out loss of a loaded checkpoint on ``batches`` fixed batches, through the
    forward it was trained with (its run's ``compute``; int8 when it names none)."""
    data = heldout_batches(ckpt.model.seq, batches=batches, batch=DEFAULT_BATCH)
    loss = heldout_loss(ckpt.model, ckpt.params, data, trained_quantized(ckpt))
    return Evaluation(ckpt.step, loss, batches, DEFAULT_BATCH, ckpt.model.seq)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="daisyweb-eval",
        description="Print a daisyweb checkpoint's loss and perplexity on the held-out text "
                    "(the last 5%% of the built-in corpus, never trained on).")
    p.add_argument("checkpoint", help="a .pt file written by daisyweb-demo/daisyweb-peer")
    p.add_argument("--batches", type=int, default=DEFAULT_BATCHES,
                   help=f"fixed batches of {DEFAULT_BATCH} windows to evaluate "
                        f"(default {DEFAULT_BATCHES})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 1 <= args.batches <= MAX_BATCHES:
        parser.error(f"--batches must be between 1 and {MAX_BATCHES}")
    ckpt = open_checkpoint("daisyweb-eval", args.checkpoint)
    if ckpt is None:
        return 1
    fit = max_batches(ckpt.model.seq, DEFAULT_BATCH)
    if args.batches > fit:
        print(f"daisyweb-eval: --batches {args.batches} is more than the held-out text holds "
              f"at seq {ckpt.model.seq}: at most {fit} batches of {DEFAULT_BATCH} windows "
              f"({heldout_tokens().size} tokens)", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings():  # an overflow is refused below, in one line
            warnings.simplefilter("ignore", RuntimeWarning)
            ev = evaluate_checkpoint(ckpt, args.batches)
    except (NonFiniteError, FloatingPointError) as exc:
        return damaged("daisyweb-eval", args.checkpoint, ckpt, exc)
    print(f"{args.checkpoint}: step {ev.step}, held-out loss {ev.loss:.6f}, "
          f"perplexity {ev.perplexity:.2f} ({ev.tokens} tokens: {ev.batches} batches of "
          f"{ev.batch} x {ev.seq})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
