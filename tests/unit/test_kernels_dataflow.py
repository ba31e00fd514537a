"""The strided NHD dataflow on CPU (sdpa back-end, comfy-kitchen eager norm+rope)."""

from __future__ import annotations

import pytest
import torch

from comfyui_sage_strided_nhd import kernels
from devkit.rope import make_rope_table


def fused_inputs(seq, heads, head_dim, rot_dim, gen, dtype=torch.bfloat16):
    qkv = torch.randn(seq, 3 * heads * head_dim, generator=gen).to(dtype)
    table = make_rope_table(seq, rot_dim, dtype=dtype, generator=gen)
    qw = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    kw = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    return qkv, table, qw, kw


def run(qkv, heads, head_dim, layout, table=None, qw=None, kw=None, **kw_args):
    chain = kernels.BackendChain.for_choice("sdpa", "cpu")
    return kernels.attention_from_fused_qkv(qkv, heads, head_dim, chain=chain, layout=layout, rope_table=table,
                                            q_weight=qw, k_weight=kw, eps=1e-5, **kw_args)


@pytest.mark.parametrize("seq,heads,head_dim,rot_dim", [(1, 2, 32, 16), (37, 4, 64, 48), (130, 3, 128, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nhd_and_hnd_give_bit_identical_outputs_on_sdpa(seq, heads, head_dim, rot_dim, dtype, gen):
    qkv, table, qw, kw = fused_inputs(seq, heads, head_dim, rot_dim, gen, dtype)
    nhd, rec_nhd = run(qkv.clone(), heads, head_dim, "strided_nhd", table, qw, kw)
    hnd, rec_hnd = run(qkv.clone(), heads, head_dim, "hnd", table, qw, kw)
    assert rec_nhd.backend == rec_hnd.backend == "sdpa"
    assert nhd.shape == hnd.shape == (seq, heads * head_dim)
    diff = (nhd.float() - hnd.float()).abs().max().item()
    assert torch.equal(nhd, hnd), f"max abs difference {diff}"
    assert torch.isfinite(nhd).all()


def test_nhd_and_hnd_agree_without_rope_table(gen):
    heads, head_dim = 4, 32
    qkv = torch.randn(50, 3 * heads * head_dim, generator=gen).to(torch.bfloat16)
    norm = torch.nn.RMSNorm(head_dim, eps=1e-5, dtype=torch.bfloat16)
    a, _ = run(qkv.clone(), heads, head_dim, "strided_nhd", q_norm=norm, k_norm=norm)
    b, _ = run(qkv.clone(), heads, head_dim, "hnd", q_norm=norm, k_norm=norm)
    assert torch.equal(a, b)


def test_qkv_views_share_the_fused_buffer_without_copies(gen):
    heads, head_dim, seq = 4, 16, 10
    qkv = torch.randn(seq, 3 * heads * head_dim, generator=gen)
    q, k, v = kernels.split_fused_qkv(qkv, heads, head_dim)
    inner = heads * head_dim
    for i, t in enumerate((q, k, v)):
        assert t.shape == (1, seq, heads, head_dim)
        assert t.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
        assert t.data_ptr() == qkv.data_ptr() + i * inner * qkv.element_size()
        assert t.stride() == (seq * 3 * inner, 3 * inner, head_dim, 1)
        assert torch.equal(t[0].reshape(seq, inner), qkv[:, i * inner:(i + 1) * inner])


def test_norm_rope_writes_into_the_fused_buffer_in_place(gen):
    heads, head_dim, seq = 2, 32, 12
    qkv, table, qw, kw = fused_inputs(seq, heads, head_dim, 16, gen)
    before = qkv.clone()
    q, k, _ = kernels.split_fused_qkv(qkv, heads, head_dim)
    q2, k2 = kernels.norm_rope(q, k, table, qw, kw, 1e-5)
    assert q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr()
    inner = heads * head_dim
    assert not torch.equal(qkv[:, :inner], before[:, :inner])
    assert not torch.equal(qkv[:, inner:2 * inner], before[:, inner:2 * inner])
    assert torch.equal(qkv[:, 2 * inner:], before[:, 2 * inner:]), "V must stay untouched"


def test_strided_nhd_output_is_a_view_of_the_kernel_output(gen, monkeypatch):
    heads, head_dim, seq = 4, 32, 33
    qkv, table, qw, kw = fused_inputs(seq, heads, head_dim, 16, gen)
    chain = kernels.BackendChain.for_choice("sdpa", "cpu")
    seen = {}
    original = chain.run

    def spy(*args, **kwargs):
        out, rec = original(*args, **kwargs)
        seen["out"] = out
        return out, rec

    monkeypatch.setattr(chain, "run", spy)
    flat, rec = kernels.attention_from_fused_qkv(qkv, heads, head_dim, chain=chain, rope_table=table,
                                                 q_weight=qw, k_weight=kw, eps=1e-5)
    assert seen["out"].is_contiguous(), "sdpa on NHD views should hand back token-major memory"
    assert flat.data_ptr() == seen["out"].data_ptr()
    assert flat.untyped_storage().data_ptr() == seen["out"].untyped_storage().data_ptr()
    assert rec.copies == 0


def test_hnd_baseline_counts_its_layout_copies(gen):
    qkv, table, qw, kw = fused_inputs(16, 2, 32, 16, gen)
    _, rec = run(qkv, 2, 32, "hnd", table, qw, kw)
    assert rec.copies >= 3 and rec.layout == "hnd"


def test_token_major_attention_views_and_matches_reference(gen):
    b, s, heads, d = 2, 20, 4, 16
    q, k, v = (torch.randn(b, s, heads * d, generator=gen) for _ in range(3))
    chain = kernels.BackendChain.for_choice("auto", "cpu")
    out, rec = kernels.attention_token_major(q, k, v, heads, chain=chain)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).reshape(b, s, heads * d)
    assert out.shape == (b, s, heads * d)
    assert torch.equal(out, ref)
    assert rec.backend == "sdpa"


def test_training_mode_rope_leaves_the_fused_buffer_alone(gen):
    heads, head_dim = 2, 32
    qkv, table, qw, kw = fused_inputs(24, heads, head_dim, 16, gen)
    before = qkv.clone()
    out_training, _ = run(qkv, heads, head_dim, "strided_nhd", table, qw, kw, inplace=False)
    assert torch.equal(qkv, before)
    out_inference, _ = run(qkv.clone(), heads, head_dim, "strided_nhd", table, qw, kw)
    assert torch.equal(out_training, out_inference)
