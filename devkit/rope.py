"""H3-style rope tables: [1, S, 1, rot/2, 2, 2] rotation matrices, as comfy-kitchen's rms_rope reads them."""

from __future__ import annotations

import torch


def make_rope_table(seq: int, rot_dim: int, dtype=torch.float32, device="cpu", generator=None) -> torch.Tensor:
    """Rotation matrices [[cos, -sin], [sin, cos]] at random angles, one per (token, pair)."""
    angles = torch.rand(seq, rot_dim // 2, generator=generator, dtype=torch.float64) * 6.283
    c, s = angles.cos(), angles.sin()
    table = torch.stack([c, -s, s, c], dim=-1).reshape(1, seq, 1, rot_dim // 2, 2, 2)
    return table.to(dtype=dtype, device=device)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c with the product unrounded (fp64 holds it exactly), the sum rounded to fp64 and
    then to fp32: a fused multiply-add except in rare double-rounding cases (what the Triton
    interpreter's emulation computes too)."""
    return (a.double() * b.double() + c.double()).float()


def rounded_reciprocal_sqrt(v: torch.Tensor) -> torch.Tensor:
    """fp32 ``1 / sqrt(v)`` with the square root and the division each correctly rounded, as the Triton
    interpreter computes ``rsqrt`` (numpy). Both steps run in fp64 and are rounded to fp32 (exact for a
    square root and a quotient): torch's fp32 ``sqrt`` on the CPU is not correctly rounded on every CPU
    (on some it differs from numpy's in the last bit), so the plain fp32 form would differ by machine."""
    return (1.0 / torch.sqrt(v.double()).float().double()).float()


def kitchen_cuda_norm_rope(x: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                           reciprocal_sqrt=rounded_reciprocal_sqrt, fuse_first: bool = True) -> torch.Tensor:
    """comfy-kitchen's CUDA ``rms_rope_split_half`` steps on one of Q/K ([1, S, H, D] bf16), in torch:
    a warp per (token, head) row, lane l squaring elements l, l + 32, ... into its sum by fused
    multiply-adds, the 32 sums added by a shuffle-down butterfly, ``rsqrt(sum / D + eps)``, each value
    ``(x * rrms) * weight`` rounded to bf16, then the split-half rotation ``f00*a + f01*b`` (fused as
    ``fma(f00, a, f01*b)``) and ``f10*a + f11*b`` rounded to bf16; dims past the rotated prefix are
    only normed. ``reciprocal_sqrt``: the GPU's rsqrt is approximate, the interpreter's is 1/sqrt (correctly rounded).
    ``fuse_first=False``: the other contraction, ``fma(f01, b, f00*a)`` (for diagnosis)."""
    xf = x.float()
    d = xf.shape[-1]
    acc = torch.zeros(xf.shape[:-1] + (32,), dtype=torch.float32, device=x.device)
    for i in range(d // 32):
        v = xf[..., i * 32:(i + 1) * 32]
        acc = fma(v, v, acc)
    width = 16
    while width:
        acc = acc[..., :width] + acc[..., width:2 * width]
        width //= 2
    rrms = reciprocal_sqrt(acc / d + eps)
    n = ((xf * rrms) * weight.float()).bfloat16().float()
    half = table.shape[-3]
    f = table[0, :, 0].float()[None, :, None]  # [1, S, 1, half, 2, 2]
    a, b = n[..., :half], n[..., half:2 * half]
    out = n.clone()
    for rows, (g, h) in ((slice(0, half), (f[..., 0, 0], f[..., 0, 1])),
                         (slice(half, 2 * half), (f[..., 1, 0], f[..., 1, 1]))):
        out[..., rows] = fma(g, a, h * b) if fuse_first else fma(h, b, g * a)
    return out.bfloat16()
