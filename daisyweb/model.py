"""GPT-style causal language model in numpy (config and parameter layout).

The parameters live in one flat float32 buffer; ``param_layout`` fixes the order,
names and shapes of the views, so a gradient or a weight hash is one contiguous array.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ModelConfig", "param_layout", "param_count"]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    width: int = 128
    layers: int = 4
    heads: int = 4
    seq: int = 64

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "layers", "heads", "seq"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"model {name} must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ModelConfig:
        if not isinstance(d, dict) or set(d) != {"vocab", "width", "layers", "heads", "seq"}:
            raise ValueError(f"model config must have vocab/width/layers/heads/seq, got {d!r}")
        return cls(**d)


def param_layout(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of every parameter, in buffer order."""
    w, v = cfg.width, cfg.vocab
    out: list[tuple[str, tuple[int, ...]]] = [("wte", (v, w)), ("wpe", (cfg.seq, w))]
    for i in range(cfg.layers):
        p = f"h{i}."
        out += [
            (p + "ln1.g", (w,)), (p + "ln1.b", (w,)),
            (p + "attn.w_qkv", (w, 3 * w)), (p + "attn.b_qkv", (3 * w,)),
            (p + "attn.w_out", (w, w)), (p + "attn.b_out", (w,)),
            (p + "ln2.g", (w,)), (p + "ln2.b", (w,)),
            (p + "mlp.w_in", (w, 4 * w)), (p + "mlp.b_in", (4 * w,)),
            (p + "mlp.w_out", (4 * w, w)), (p + "mlp.b_out", (w,)),
        ]
    out += [("lnf.g", (w,)), ("lnf.b", (w,)), ("head.w", (w, v))]
    return out


def param_count(cfg: ModelConfig) -> int:
    total = 0
    for _, shape in param_layout(cfg):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total
