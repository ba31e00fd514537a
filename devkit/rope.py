"""H3-style rope tables: [1, S, 1, rot/2, 2, 2] rotation matrices, as comfy-kitchen's rms_rope reads them."""

from __future__ import annotations

import torch


def make_rope_table(seq: int, rot_dim: int, dtype=torch.float32, device="cpu", generator=None) -> torch.Tensor:
    """Rotation matrices [[cos, -sin], [sin, cos]] at random angles, one per (token, pair)."""
    angles = torch.rand(seq, rot_dim // 2, generator=generator, dtype=torch.float64) * 6.283
    c, s = angles.cos(), angles.sin()
    table = torch.stack([c, -s, s, c], dim=-1).reshape(1, seq, 1, rot_dim // 2, 2, 2)
    return table.to(dtype=dtype, device=device)
