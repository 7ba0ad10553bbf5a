"""What the checkpoint commands share: open a checkpoint file, or say in one line why not."""

from __future__ import annotations

import sys
from pathlib import Path

from daisyweb.checkpoints.checkpoint import (
    Checkpoint,
    CheckpointError,
    TokenizerInfo,
    load_checkpoint,
)
from daisyweb.data import default_tokenizer

__all__ = ["open_checkpoint"]


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
