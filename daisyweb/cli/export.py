"""``daisyweb-export FILE.pt -o kit.html``: the offline inference kit of a checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from daisyweb.cli.common import open_checkpoint
from daisyweb.data import default_tokenizer
from daisyweb.kit.build import build_kit


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="daisyweb-export",
        description="Write one self-contained HTML file that generates text from a "
                    "checkpoint offline, in any browser (no network, no outside files).")
    p.add_argument("checkpoint", help="a .pt file written by daisyweb-demo/daisyweb-peer")
    p.add_argument("-o", "--output", help="the HTML file to write (default: FILE.html)")
    p.add_argument("--prompt", default="And God said", help="the prompt box's initial text")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.output) if args.output else Path(args.checkpoint).with_suffix(".html")
    ckpt = open_checkpoint("daisyweb-export", args.checkpoint)
    if ckpt is None:
        return 1
    html = build_kit(ckpt, default_tokenizer(), prompt=args.prompt).encode("utf-8")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(html)
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        print(f"daisyweb-export: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    m = ckpt.model
    print(f"daisyweb-export: wrote {out} ({len(html):,} bytes): width {m.width}, "
          f"{m.layers} layers, {m.heads} heads, context {m.seq}, step {ckpt.step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
