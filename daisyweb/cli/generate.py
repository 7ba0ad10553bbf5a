"""``daisyweb-generate FILE.pt --prompt TEXT``: sample text from a trained checkpoint."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

import numpy as np

from daisyweb.cli.common import damaged, open_checkpoint
from daisyweb.data import Tokenizer, default_tokenizer
from daisyweb.model import ModelConfig, forward
from daisyweb.training.config import trained_quantized
from kernels import NonFiniteError


def sample_tokens(model: ModelConfig, params: np.ndarray, prompt: np.ndarray, *,
                  tokens: int, temperature: float, seed: int,
                  quantized: bool = True) -> np.ndarray:
    """Autoregressive sampling; ``temperature`` 0 means greedy. Returns new ids only.
    ``quantized``: the int8 forward (else plain float32, for a ``--compute float`` run)."""
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in prompt]
    out: list[int] = []
    for _ in range(tokens):
        window = np.asarray(ids[-model.seq:], dtype=np.int32)[None, :]
        logits = forward(model, params, window, quantized=quantized)[0, -1].astype(np.float64)
        if temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            z = logits / temperature
            z -= z.max()
            p = np.exp(z)
            p /= p.sum()
            nxt = int(rng.choice(p.size, p=p))
        ids.append(nxt)
        out.append(nxt)
    return np.asarray(out, dtype=np.int32)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="daisyweb-generate", description="Generate text from a daisyweb checkpoint.")
    p.add_argument("checkpoint", help="a .pt file written by daisyweb-demo/daisyweb-peer")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--tokens", type=int, default=100, help="tokens to generate (default 100)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 = greedy (default 0.8)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.tokens > 100_000:
        parser.error("--tokens must be between 1 and 100000")
    if not 0 <= args.temperature <= 100:
        parser.error("--temperature must be between 0 and 100")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    ckpt = open_checkpoint("daisyweb-generate", args.checkpoint)
    if ckpt is None:
        return 1
    tok: Tokenizer = default_tokenizer()
    prompt = tok.encode(args.prompt) if args.prompt else np.zeros(0, np.int32)
    if prompt.size == 0:
        # An empty prompt still needs one token to condition on: a newline.
        prompt = tok.encode("\n")
    try:
        with warnings.catch_warnings():  # an overflow is refused below, in one line
            warnings.simplefilter("ignore", RuntimeWarning)
            new = sample_tokens(ckpt.model, ckpt.params, prompt, tokens=args.tokens,
                                temperature=args.temperature, seed=args.seed,
                                quantized=trained_quantized(ckpt))
    except (NonFiniteError, FloatingPointError) as exc:
        return damaged("daisyweb-generate", args.checkpoint, ckpt, exc)
    sys.stdout.write(args.prompt + tok.decode(new) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
