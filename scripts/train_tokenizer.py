"""Train the shipped byte-level BPE tokenizer (daisyweb/data/tokenizer.json).

Trains on the built-in corpus (daisyweb/data/corpus.txt.gz, see scripts/build_corpus.py),
or its first ``--max-bytes`` bytes, to a vocabulary of 2048 ids: 256 bytes + 1792 merges,
no special tokens. Pure Python; the whole corpus takes well under a minute on one core.
It prints the vocabulary size, the file's sha256 (what checkpoints carry) and the
compression of the corpus in bytes per token.

Run: python scripts/train_tokenizer.py [--vocab 2048] [--max-bytes N] [--out PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from daisyweb.data.corpus import full_corpus_text  # noqa: E402
from daisyweb.data.tokenizer import Tokenizer, train_bpe  # noqa: E402

OUT = ROOT / "daisyweb" / "data" / "tokenizer.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-bytes", type=int, default=0, help="train on a prefix (0 = all)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    text = full_corpus_text()
    if args.max_bytes:
        text = text.encode("utf-8")[: args.max_bytes].decode("utf-8", errors="ignore")
    t0 = time.perf_counter()
    merges = train_bpe(text, args.vocab)
    train_s = time.perf_counter() - t0
    tok = Tokenizer(merges)
    corpus_sha = hashlib.sha256(full_corpus_text().encode("utf-8")).hexdigest()
    args.out.write_text(
        tok.to_json(trained_on="daisyweb/data/corpus.txt.gz", trained_bytes=len(text.encode()),
                    corpus_sha256=corpus_sha, special_tokens={}),
        encoding="utf-8",
    )
    tok = Tokenizer.from_file(args.out)
    t0 = time.perf_counter()
    ids = tok.encode(full_corpus_text())
    enc_s = time.perf_counter() - t0
    nbytes = len(full_corpus_text().encode("utf-8"))
    print(f"trained {len(merges)} merges on {len(text.encode())} bytes in {train_s:.1f} s")
    print(f"{args.out}: vocab_size {tok.vocab_size}, sha256 {tok.file_hash}")
    print(f"corpus: {nbytes} bytes -> {ids.size} tokens, {nbytes / ids.size:.2f} bytes/token, "
          f"encoded in {enc_s:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
