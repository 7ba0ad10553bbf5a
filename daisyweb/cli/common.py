"""What the checkpoint commands share: open a checkpoint file, or say in one line why not."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from daisyweb.checkpoints.checkpoint import (
    Checkpoint,
    CheckpointError,
    TokenizerInfo,
    load_checkpoint,
)
from daisyweb.data import default_tokenizer

__all__ = ["open_checkpoint"]


def damaged(prog: str, path: str, ckpt: Checkpoint, exc: Exception) -> int:
    """One line for a checkpoint whose forward pass overflows (its weights are finite but
    absurd, as a poisoned group can leave them); exit code 1."""
    big = float(np.abs(ckpt.params).max()) if ckpt.params.size else 0.0
    print(f"{prog}: cannot use {path}: its forward pass overflows (largest |weight| "
          f"{big:.3g}: the weights are damaged): {exc}", file=sys.stderr)
    return 1


def open_checkpoint(prog: str, path: str) -> Checkpoint | None:
    """The checkpoint at ``path`` checked against the shipped tokenizer, or None after one
    line on stderr (a missing file, or what the checkpoint rules refused)."""
    if not Path(path).is_file():
        print(f"{prog}: no such file: {path}", file=sys.stderr)
        return None
    tok = default_tokenizer()
    try:
        return load_checkpoint(path, expect_tokenizer=TokenizerInfo(tok.vocab_size,
                                                                    tok.file_hash))
    except (CheckpointError, OSError) as exc:
        print(f"{prog}: cannot use {path}: {exc}", file=sys.stderr)
        return None
