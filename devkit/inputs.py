"""Random inputs of one H3-style attention call: a fused qkv buffer, a rope table, norm weights."""

from __future__ import annotations

import torch


def fused_attention_inputs(seq: int, heads: int, head_dim: int = 128, rot_dim: int = 96, *, seed: int,
                           device="cuda", weight_mean: float = 2.0, weight_spread: float = 0.3,
                           table_dtype=torch.bfloat16):
    """(qkv [S, 3*H*D] bf16, rope table [1, S, 1, rot/2, 2, 2], q norm weight, k norm weight).

    Drawn on ``device`` from one seeded generator. Norm weights above 1 sharpen the softmax, so
    kernel errors are not averaged away.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(seq, 3 * heads * head_dim, device=device, generator=g, dtype=torch.bfloat16)
    angles = torch.rand(seq, rot_dim // 2, device=device, generator=g) * 6.283
    c, s = angles.cos(), angles.sin()
    table = torch.stack([c, -s, s, c], -1).reshape(1, seq, 1, rot_dim // 2, 2, 2).to(table_dtype)
    qw = (weight_mean + weight_spread * torch.randn(head_dim, device=device, generator=g)).to(torch.bfloat16)
    kw = (weight_mean + weight_spread * torch.randn(head_dim, device=device, generator=g)).to(torch.bfloat16)
    return qkv, table, qw, kw
