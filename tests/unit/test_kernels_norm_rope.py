"""comfy-kitchen's in-place RMSNorm + split-half partial RoPE against an fp64 reference."""

from __future__ import annotations

import pytest
import torch

from comfyui_sage_strided_nhd import kernels
from devkit.rope import make_rope_table


def reference_norm_rope(x, table, weight, eps):
    """fp64: RMSNorm over the whole head, then rotate pairs (i, i + rot/2) for i < rot/2."""
    x = x.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    rot = table.shape[-3] * 2
    half = rot // 2
    r = table[0, :, 0].double()  # [S, half, 2, 2]
    a, b = y[..., :half], y[..., half:rot]  # [1, S, H, half]
    r = r[None, :, None]  # [1, S, 1, half, 2, 2]
    out = y.clone()
    out[..., :half] = r[..., 0, 0] * a + r[..., 0, 1] * b
    out[..., half:rot] = r[..., 1, 0] * a + r[..., 1, 1] * b
    return out


@pytest.mark.parametrize("head_dim,rot_dim", [(128, 96), (64, 64), (32, 16)])
def test_in_place_norm_rope_on_strided_views_matches_fp64_reference(head_dim, rot_dim, gen):
    heads, seq = 3, 40
    qkv = (3 * torch.randn(seq, 3 * heads * head_dim, generator=gen)).to(torch.bfloat16)
    table = make_rope_table(seq, rot_dim, dtype=torch.bfloat16, generator=gen)
    qw = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16)
    kw = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16)
    q, k, _ = kernels.split_fused_qkv(qkv, heads, head_dim)
    q_ref = reference_norm_rope(q, table, qw, 1e-5)
    k_ref = reference_norm_rope(k, table, kw, 1e-5)
    kernels.norm_rope(q, k, table, qw, kw, 1e-5)
    for got, ref in ((q, q_ref), (k, k_ref)):
        rel = (got.double() - ref).norm() / ref.norm()
        assert rel < 1e-2, f"relative error {rel:.3e} above bf16 tolerance"


def test_rope_table_shape_is_checked(gen):
    qkv = torch.randn(10, 3 * 2 * 32, generator=gen)
    q, k, _ = kernels.split_fused_qkv(qkv, 2, 32)
    w = torch.ones(32)
    with pytest.raises(ValueError, match="covers 9 tokens"):
        kernels.norm_rope(q, k, make_rope_table(9, 16), w, w, 1e-5)
    with pytest.raises(ValueError, match=r"\[1, S, 1, rot/2, 2, 2\]"):
        kernels.norm_rope(q, k, torch.zeros(10, 8, 2, 2), w, w, 1e-5)
    with pytest.raises(ValueError, match="rotates 48 dims"):
        kernels.norm_rope(q, k, make_rope_table(10, 48), w, w, 1e-5)
