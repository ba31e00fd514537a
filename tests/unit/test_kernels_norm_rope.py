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
    q, k, _ = kernels.dataflow.split_fused_qkv(qkv, heads, head_dim)
    q_ref = reference_norm_rope(q, table, qw, 1e-5)
    k_ref = reference_norm_rope(k, table, kw, 1e-5)
    kernels.qk_transform.norm_rope(q, k, table, qw, kw, 1e-5)
    for got, ref in ((q, q_ref), (k, k_ref)):
        rel = (got.double() - ref).norm() / ref.norm()
        assert rel < 1e-2, f"relative error {rel:.3e} above bf16 tolerance"


def test_rope_table_shape_is_checked(gen):
    qkv = torch.randn(10, 3 * 2 * 32, generator=gen)
    q, k, _ = kernels.dataflow.split_fused_qkv(qkv, 2, 32)
    w = torch.ones(32)
    with pytest.raises(ValueError, match="covers 9 tokens"):
        kernels.qk_transform.norm_rope(q, k, make_rope_table(9, 16), w, w, 1e-5)
    with pytest.raises(ValueError, match=r"\[1, S, 1, rot/2, 2, 2\]"):
        kernels.qk_transform.norm_rope(q, k, torch.zeros(10, 8, 2, 2), w, w, 1e-5)
    with pytest.raises(ValueError, match="rotates 48 dims"):
        kernels.qk_transform.norm_rope(q, k, make_rope_table(10, 48), w, w, 1e-5)


# --- QKNorm: the normalisation one call owes, applied at most once ---------------------------------------


class CountingNorm:
    """A q_norm/k_norm stand-in: scales its input, counts its calls, raises while ``fail`` is set."""

    def __init__(self, factor, fail=False):
        self.factor, self.fail, self.calls = factor, fail, 0

    def __call__(self, x):
        self.calls += 1
        if self.fail:
            raise RuntimeError("norm failed in this test")
        return x * self.factor


def rope_inputs(gen, seq=12, heads=2, head_dim=32, rot_dim=16):
    qkv = torch.randn(seq, 3 * heads * head_dim, generator=gen).to(torch.bfloat16)
    table = make_rope_table(seq, rot_dim, dtype=torch.bfloat16, generator=gen)
    qw = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16)
    kw = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16)
    return qkv, table, qw, kw


def test_qknorm_with_modules_is_applied_at_most_once(gen):
    norm = kernels.QKNorm(q_norm=CountingNorm(2.0), k_norm=CountingNorm(3.0))
    q, k, _ = kernels.dataflow.split_fused_qkv(torch.randn(10, 3 * 2 * 16, generator=gen), 2, 16)
    assert not norm.applied
    q2, k2 = norm.apply(q, k)
    assert norm.applied and torch.equal(q2, q * 2.0) and torch.equal(k2, k * 3.0)
    assert q2.shape == q.shape == (1, 10, 2, 16)
    q3, k3 = norm.apply(q2, k2)
    assert q3 is q2 and k3 is k2, "a second apply returns its inputs unchanged"
    assert norm.q_norm.calls == norm.k_norm.calls == 1


def test_qknorm_with_a_rope_table_normalises_the_fused_buffer_once(gen):
    qkv, table, qw, kw = rope_inputs(gen)
    once = qkv.clone()
    qo, ko, _ = kernels.dataflow.split_fused_qkv(once, 2, 32)
    kernels.qk_transform.norm_rope(qo, ko, table, qw, kw, 1e-5)
    norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)
    q, k, _ = kernels.dataflow.split_fused_qkv(qkv, 2, 32)
    q2, k2 = norm.apply(q, k)
    assert q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr(), "in place on the views"
    norm.apply(q, k)
    assert torch.equal(qkv, once), "applying twice must normalise only once"


def test_qknorm_that_raised_is_still_owed(gen):
    """``applied`` stays False when apply raises, so a fallback that applies it again is not skipped."""
    q_norm, k_norm = CountingNorm(2.0, fail=True), CountingNorm(3.0)
    norm = kernels.QKNorm(q_norm=q_norm, k_norm=k_norm)
    q, k, _ = kernels.dataflow.split_fused_qkv(torch.randn(10, 3 * 2 * 16, generator=gen), 2, 16)
    with pytest.raises(RuntimeError, match="norm failed in this test"):
        norm.apply(q, k)
    assert not norm.applied
    q_norm.fail = False
    q2, k2 = norm.apply(q, k)
    assert norm.applied and torch.equal(q2, q * 2.0) and torch.equal(k2, k * 3.0)
    assert q_norm.calls == 2


def test_qknorm_with_a_bad_rope_table_raises_and_stays_owed(gen):
    qkv, _, qw, kw = rope_inputs(gen)
    norm = kernels.QKNorm(rope_table=make_rope_table(9, 16), q_weight=qw, k_weight=kw, eps=1e-5)
    q, k, _ = kernels.dataflow.split_fused_qkv(qkv, 2, 32)
    with pytest.raises(ValueError, match="covers 9 tokens"):
        norm.check(q.shape[1], q.shape[-1])
    with pytest.raises(ValueError, match="covers 9 tokens"):
        norm.apply(q, k)
    assert not norm.applied and norm.by_rows


def test_qknorm_goes_by_rows_only_with_a_rope_table_in_place_and_not_yet_applied(gen):
    qkv, table, qw, kw = rope_inputs(gen)
    assert kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw).by_rows
    assert not kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, inplace=False).by_rows
    assert not kernels.QKNorm(q_norm=CountingNorm(1.0), k_norm=CountingNorm(1.0)).by_rows

    applied = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)
    applied.apply(*kernels.dataflow.split_fused_qkv(qkv, 2, 32)[:2])
    assert applied.applied and not applied.by_rows

    folded = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)
    folded.mark_applied()
    assert folded.applied and not folded.by_rows
    before = qkv.clone()
    q, k, _ = kernels.dataflow.split_fused_qkv(qkv, 2, 32)
    q2, k2 = folded.apply(q, k)
    assert q2 is q and k2 is k and torch.equal(qkv, before), "a folded norm is not applied again"


def test_qknorm_needs_its_parameters():
    with pytest.raises(ValueError, match="q_weight and k_weight are required with a rope table"):
        kernels.QKNorm(rope_table=make_rope_table(4, 16), q_weight=torch.ones(32))
    with pytest.raises(ValueError, match="q_norm and k_norm are required without a rope table"):
        kernels.QKNorm(q_norm=CountingNorm(1.0))
