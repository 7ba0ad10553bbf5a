"""The daisyweb model written independently in PyTorch float32: the reference the model
tests compare against and the baseline ``bench.step`` times. Never imported by the product.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from daisyweb.model import ModelConfig


def torch_loss(cfg: ModelConfig, p: dict[str, torch.Tensor], inp: torch.Tensor,
               tgt: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``p`` maps ``param_layout`` names to tensors,
    ``inp`` is [B, T] token ids, ``tgt`` the [B, T] (or flat) targets."""
    b, t = inp.shape
    c, h = cfg.width, cfg.heads
    d = c // h
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    x = p["wte"][inp] + p["wpe"][:t]
    for i in range(cfg.layers):
        q_ = f"h{i}."
        y = F.layer_norm(x, (c,), p[q_ + "ln1.g"], p[q_ + "ln1.b"], eps=1e-5)
        qkv = y @ p[q_ + "attn.w_qkv"] + p[q_ + "attn.b_qkv"]
        q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in qkv.split(c, dim=-1))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        att = att.masked_fill(causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + y @ p[q_ + "attn.w_out"] + p[q_ + "attn.b_out"]
        y = F.layer_norm(x, (c,), p[q_ + "ln2.g"], p[q_ + "ln2.b"], eps=1e-5)
        y = F.gelu(y @ p[q_ + "mlp.w_in"] + p[q_ + "mlp.b_in"], approximate="tanh")
        x = x + y @ p[q_ + "mlp.w_out"] + p[q_ + "mlp.b_out"]
    x = F.layer_norm(x, (c,), p["lnf.g"], p["lnf.b"], eps=1e-5)
    logits = x @ p["head.w"]
    return F.cross_entropy(logits.reshape(-1, cfg.vocab), tgt.reshape(-1))
