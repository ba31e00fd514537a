"""The strided NHD dataflow on CPU (sdpa back-end, comfy-kitchen eager norm+rope)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels.backends.base import YES, AttentionBackend, Prepared
from comfyui_sage_strided_nhd.kernels.backends.sdpa import SdpaBackend
from devkit.rope import make_rope_table


def fused_inputs(seq, heads, head_dim, rot_dim, gen, dtype=torch.bfloat16):
    qkv = torch.randn(seq, 3 * heads * head_dim, generator=gen).to(dtype)
    table = make_rope_table(seq, rot_dim, dtype=dtype, generator=gen)
    qw = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    kw = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype)
    return qkv, table, qw, kw


def run(qkv, heads, head_dim, layout, table=None, qw=None, kw=None, *, q_norm=None, k_norm=None, inplace=True,
        **kw_args):
    """One call on the sdpa chain with a fresh QKNorm (one is applied at most once)."""
    chain = kernels.BackendChain.for_choice("sdpa")
    if table is not None:
        norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5, inplace=inplace)
    else:
        norm = kernels.QKNorm(q_norm=q_norm, k_norm=k_norm)
    return kernels.attention_from_fused_qkv(qkv, heads, head_dim, chain=chain, layout=layout, norm=norm, **kw_args)


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
    q, k, v = kernels.dataflow.split_fused_qkv(qkv, heads, head_dim)
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
    q, k, _ = kernels.dataflow.split_fused_qkv(qkv, heads, head_dim)
    q2, k2 = kernels.qk_transform.norm_rope(q, k, table, qw, kw, 1e-5)
    assert q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr()
    inner = heads * head_dim
    assert not torch.equal(qkv[:, :inner], before[:, :inner])
    assert not torch.equal(qkv[:, inner:2 * inner], before[:, inner:2 * inner])
    assert torch.equal(qkv[:, 2 * inner:], before[:, 2 * inner:]), "V must stay untouched"


def test_strided_nhd_output_is_a_view_of_the_kernel_output(gen, monkeypatch):
    heads, head_dim, seq = 4, 32, 33
    qkv, table, qw, kw = fused_inputs(seq, heads, head_dim, 16, gen)
    seen = {}

    class Spy(kernels.BackendChain):
        def run_handed(self, *args, **kwargs):
            out, rec = super().run_handed(*args, **kwargs)
            seen["out"] = out
            return out, rec

    chain = Spy("sdpa", kernels.BackendChain.for_choice("sdpa").backends)
    flat, rec = kernels.attention_from_fused_qkv(
        qkv, heads, head_dim, chain=chain, norm=kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5))
    assert seen["out"].is_contiguous(), "sdpa on NHD views should hand back token-major memory"
    assert flat.data_ptr() == seen["out"].data_ptr()
    assert flat.untyped_storage().data_ptr() == seen["out"].untyped_storage().data_ptr()
    assert rec.copies == 0


def test_hnd_baseline_counts_its_layout_copies(gen):
    qkv, table, qw, kw = fused_inputs(16, 2, 32, 16, gen)
    _, rec = run(qkv, 2, 32, "hnd", table, qw, kw)
    assert rec.copies >= 3 and rec.layout == "hnd"


def test_token_major_attention_views_and_matches_reference(gen):
    """Token-major [B, S, H*D] q/k/v as [B, S, H, D] views through attention_nhd, back through token_major."""
    b, s, heads, d = 2, 20, 4, 16
    q, k, v = (torch.randn(b, s, heads * d, generator=gen) for _ in range(3))
    chain = kernels.BackendChain.for_choice("auto")
    qn, kn, vn = (t.view(b, s, heads, d) for t in (q, k, v))
    out, rec = kernels.attention_nhd(qn, kn, vn, chain=chain)
    flat, copies = kernels.token_major(out)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).reshape(b, s, heads * d)
    assert flat.view(b, s, heads * d).shape == (b, s, heads * d)
    assert torch.equal(flat.view(b, s, heads * d), ref)
    assert rec.backend == "sdpa" and rec.layout == "strided_nhd"
    assert copies == 0 and flat.data_ptr() == out.data_ptr(), "sdpa's NHD output is token-major already"


def test_token_major_copies_only_what_is_not_token_major(gen):
    out = torch.randn(2, 4, 5, 3, generator=gen)
    flat, copies = kernels.token_major(out)
    assert copies == 0 and flat.shape == (8, 15) and flat.data_ptr() == out.data_ptr()
    head_major = torch.randn(2, 5, 4, 3, generator=gen).transpose(1, 2)  # [B, S, H, D] view of [B, H, S, D]
    flat, copies = kernels.token_major(head_major)
    assert copies == 1 and flat.is_contiguous() and torch.equal(flat, head_major.reshape(8, 15))


def test_training_mode_rope_leaves_the_fused_buffer_alone(gen):
    heads, head_dim = 2, 32
    qkv, table, qw, kw = fused_inputs(24, heads, head_dim, 16, gen)
    before = qkv.clone()
    out_training, _ = run(qkv, heads, head_dim, "strided_nhd", table, qw, kw, inplace=False)
    assert torch.equal(qkv, before)
    out_inference, _ = run(qkv.clone(), heads, head_dim, "strided_nhd", table, qw, kw)
    assert torch.equal(out_training, out_inference)


class FakePrepared(AttentionBackend):
    """A CPU back-end with a prepared path: ``prepare`` stashes copies of the normalised views; ``attend``
    runs SDPA on them and calls ``on_attend``."""

    name = "fake_prepared"
    needs_cuda = False
    prepared_modes = ("exact", "rotated")

    def __init__(self, on_attend=None):
        self.modes, self.calls, self.on_attend = [], 0, on_attend

    def _check_available(self):
        return YES

    def prepared_verdict(self, q, k, v):
        return YES

    def prepare(self, q, k, v, *, mode, scale):
        self.modes.append(mode)
        _, s, h, d = q.shape
        return Prepared(self.name, mode, {"q": q.clone(), "k": k.clone(), "v": v.clone()}, 0.25, q.dtype, s, h, d)

    def attend(self, prepared):
        if self.on_attend:
            self.on_attend()
        p = prepared.operands
        return SdpaBackend()(p["q"], p["k"], p["v"], layout="NHD", scale=prepared.sm_scale).contiguous()

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        self.calls += 1
        return SdpaBackend()(q, k, v, layout=layout, scale=scale)


@pytest.mark.parametrize("layout,inplace,asked", [("strided_nhd", True, ["rotated"]), ("hnd", True, []),
                                                  ("strided_nhd", False, [])])
def test_the_prepared_path_is_asked_for_on_strided_nhd_with_an_in_place_norm_only(layout, inplace, asked, gen):
    heads, head_dim = 2, 32
    qkv, table, qw, kw = fused_inputs(24, heads, head_dim, 16, gen, torch.float32)
    expect, _ = run(qkv.clone(), heads, head_dim, "strided_nhd", table, qw, kw, scale=0.25)
    fake = FakePrepared()
    norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5, inplace=inplace)
    out, rec = kernels.attention_from_fused_qkv(qkv, heads, head_dim, chain=kernels.BackendChain("x", (fake,)),
                                                norm=norm, layout=layout, scale=0.25, prepared_mode="rotated")
    assert fake.modes == asked
    assert rec.prepared == ("rotated" if asked else "") and rec.layout == layout
    assert fake.calls == (0 if asked else 1)
    assert norm.applied
    assert torch.equal(out, expect)  # applied once, whichever path ran


def test_a_handed_buffer_is_freed_before_the_prepared_kernel_runs(gen):
    heads, head_dim = 2, 32
    qkv = torch.randn(24, 3 * heads * head_dim, generator=gen)
    expect, _ = run(qkv.clone(), heads, head_dim, "strided_nhd", q_norm=lambda x: x, k_norm=lambda x: x,
                    scale=0.25)
    buffer = weakref.ref(qkv)
    alive_at_attend = []
    fake = FakePrepared(on_attend=lambda: (gc.collect(), alive_at_attend.append(buffer() is not None)))
    handed = [qkv]
    del qkv
    out, rec = kernels.attention_from_fused_qkv(handed, heads, head_dim, chain=kernels.BackendChain("x", (fake,)),
                                                norm=kernels.QKNorm(q_norm=lambda x: x, k_norm=lambda x: x),
                                                scale=0.25, prepared_mode="exact")
    assert handed == [] and rec.prepared == "exact"
    assert alive_at_attend == [False], "the handed qkv buffer must be freed before the prepared kernel runs"
    assert torch.equal(out, expect)


# --- a projection taken by token chunks ------------------------------------------------------------------


class FakeProjected(FakePrepared):
    """``FakePrepared`` that also takes a projection by token chunks: each chunk normalised by rows,
    Q rows stashed, K/V rows gathered in the caller's buffer; ``raises`` fails before any row."""

    prepares_projected = True

    def __init__(self, on_attend=None, raises=False):
        super().__init__(on_attend)
        self.raises, self.projection, self.released_at_attend = raises, None, None
        self.kv, self.kv_alive_at_attend = None, None

    def prepare_projected(self, projection, kv, *, heads, mode, scale, norm, chunk):
        if self.raises == "after_release":
            projection.release()
        if self.raises:
            raise RuntimeError("projected preparation failed in this test")
        self.modes.append(f"projected {mode}")
        d = kv.shape[1] // (2 * heads)
        qs, chunks = [], [(a, min(a + chunk, projection.seq)) for a in range(0, projection.seq, chunk)]
        for a, b in chunks:
            rows = projection.rows(a, b)
            q, k, _ = rows.unflatten(1, (3, heads, d)).unsqueeze(0).unbind(2)
            norm.apply_rows(q, k, a)
            qs.append(q.clone())
            kv[a:b].copy_(rows[:, heads * d:])
        projection.release()
        norm.mark_applied()
        self.projection, self.kv = projection, weakref.ref(kv)
        k, v = kv.unflatten(1, (2, heads, d)).unsqueeze(0).unbind(2)
        return Prepared(self.name, "exact", {"q": torch.cat(qs, 1), "k": k.clone(), "v": v.clone()}, 0.25,
                        kv.dtype, projection.seq, heads, d, projected_chunks=len(chunks))

    def attend(self, prepared):
        self.released_at_attend = self.projection is not None and self.projection.released
        if self.kv is not None:
            gc.collect()
            self.kv_alive_at_attend = self.kv() is not None
        return super().attend(prepared)


def projection_inputs(seq, heads, head_dim, gen):
    """(x, project): a row-wise stand-in for qkv_proj (row chunks give its bits exactly) and its input."""
    x = torch.randn(seq, heads * head_dim, generator=gen).to(torch.bfloat16)
    calls = []

    def project(rows):
        calls.append(rows.shape[0])
        return torch.cat([rows * 0.5, rows * 2.0, rows - 1.0], dim=1)
    project.calls = calls
    return x, project


@pytest.mark.parametrize("backend,expect_chunks", [("projected", 3), ("plain_prepared", 0), ("sdpa", 0)])
def test_a_projection_by_chunks_gives_the_whole_projection_bits(backend, expect_chunks, gen):
    heads, head_dim, seq = 2, 32, 50
    x, project = projection_inputs(seq, heads, head_dim, gen)
    _, table, qw, kw = fused_inputs(seq, heads, head_dim, 16, gen)
    expect, _ = run(project(x), heads, head_dim, "strided_nhd", table, qw, kw, scale=0.25)
    project.calls.clear()
    fake = {"projected": FakeProjected(), "plain_prepared": FakePrepared(), "sdpa": SdpaBackend()}[backend]
    norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)
    projection = kernels.RowProjection(project, x)
    out, rec = kernels.attention_from_projection(projection, heads, head_dim, chunk=20, norm=norm, scale=0.25,
                                                 chain=kernels.BackendChain("x", (fake,)), prepared_mode="exact")
    assert torch.equal(out, expect) and norm.applied and projection.released
    assert rec.projected_chunks == expect_chunks
    assert project.calls == ([20, 20, 10] if expect_chunks else [seq])  # each row projected once
    if backend == "projected":
        assert fake.modes == ["projected exact"] and fake.released_at_attend  # x freed before the kernel
        assert fake.kv_alive_at_attend is False  # and the K/V buffer, now in the operands


@pytest.mark.parametrize("layout", ["strided_nhd", "hnd"])
@pytest.mark.parametrize("backend", ["plain_prepared", "sdpa"])
def test_a_projection_by_columns_projects_every_column_once(backend, layout, gen):
    """K is projected as the projection is made; where no back-end takes it by chunks, Q and V are projected
    whole beside it: no column is projected twice and the fused product is never formed. Small
    integers keep every product exact, so the bits must equal the fused projection's. (The sage2
    projected path on a column form: tests/unit/test_sage2_quant.py.)"""
    heads, head_dim, seq = 2, 32, 50
    inner = heads * head_dim
    x = torch.randint(-3, 4, (seq, inner), generator=gen).float()
    w = torch.randint(-2, 3, (3 * inner, inner), generator=gen).float()
    _, table, qw, kw = fused_inputs(seq, heads, head_dim, 16, gen, torch.float32)
    expect, _ = run(x @ w.T, heads, head_dim, layout, table, qw, kw, scale=0.25)
    calls = []
    columns = (lambda rows: (calls.append(("q", rows.shape[0])), rows @ w[:inner].T)[1],
               lambda rows: (calls.append(("k", rows.shape[0])), rows @ w[inner:2 * inner].T)[1],
               lambda rows: (calls.append(("v", rows.shape[0])), rows @ w[2 * inner:].T)[1])
    projection = kernels.RowProjection(lambda rows: calls.append(("whole", rows.shape[0])), x, columns=columns)
    assert calls == [("k", seq)]  # at once, before the call is planned
    fake = {"plain_prepared": FakePrepared(), "sdpa": SdpaBackend()}[backend]
    norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)
    out, rec = kernels.attention_from_projection(projection, heads, head_dim, chunk=20, norm=norm, scale=0.25,
                                                 chain=kernels.BackendChain("x", (fake,)), layout=layout,
                                                 prepared_mode="exact")
    assert torch.equal(out, expect) and projection.released and projection.k is None
    assert ("whole", seq) not in calls and calls.count(("k", seq)) == calls.count(("v", seq)) == 1
    assert sum(n for what, n in calls if what == "q") == seq  # every Q row once


class FailsAfterNormingK(FakeProjected):
    """A projected preparation that normalises the first chunk's K rows taken ahead in place, then fails."""

    def prepare_projected(self, projection, kv, *, heads, mode, scale, norm, chunk):
        d = projection.k.shape[1] // heads
        k = projection.k.view(1, projection.seq, heads, d)
        q = projection.q_rows(0, chunk).view(1, chunk, heads, d)
        norm.apply_rows(q, k[:, :chunk], 0)
        raise RuntimeError("projected preparation failed after touching K in this test")


def test_a_failing_preparation_leaves_no_half_normalised_k_behind(gen, caplog):
    """K taken ahead and normalised in part by a preparation that then failed is dropped: the
    fallback projects anew and normalises once (the bits of the fused projection's call)."""
    heads, head_dim, seq = 2, 32, 50
    inner = heads * head_dim
    x = torch.randint(-3, 4, (seq, inner), generator=gen).float()
    w = torch.randint(-2, 3, (3 * inner, inner), generator=gen).float()
    _, table, qw, kw = fused_inputs(seq, heads, head_dim, 16, gen, torch.float32)
    expect, _ = run(x @ w.T, heads, head_dim, "strided_nhd", table, qw, kw, scale=0.25)
    projection = kernels.RowProjection(lambda rows: rows @ w.T, x,
                                       columns=(lambda rows: rows @ w[:inner].T, lambda rows: rows @ w[inner:2 * inner].T,
                                                lambda rows: rows @ w[2 * inner:].T))
    norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)
    out, rec = kernels.attention_from_projection(projection, heads, head_dim, chunk=20, norm=norm, scale=0.25,
                                                 chain=kernels.BackendChain("x", (FailsAfterNormingK(),)),
                                                 prepared_mode="exact")
    assert torch.equal(out, expect) and rec.projected_chunks == 0
    assert any("failed after touching K" in r.getMessage() for r in caplog.records)


def test_a_projection_within_one_chunk_or_a_failing_preparation_is_taken_whole(gen, caplog):
    heads, head_dim, seq = 2, 32, 40
    x, project = projection_inputs(seq, heads, head_dim, gen)
    _, table, qw, kw = fused_inputs(seq, heads, head_dim, 16, gen)
    expect, _ = run(project(x), heads, head_dim, "strided_nhd", table, qw, kw, scale=0.25)
    for chunk, fake in ((64, FakeProjected()), (16, FakeProjected(raises=True))):
        project.calls.clear()
        norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)
        out, rec = kernels.attention_from_projection(kernels.RowProjection(project, x), heads, head_dim, chunk=chunk,
                                                     norm=norm, scale=0.25, chain=kernels.BackendChain("x", (fake,)),
                                                     prepared_mode="exact")
        assert torch.equal(out, expect) and rec.projected_chunks == 0 and rec.prepared == "exact"
        assert project.calls == [seq] and fake.modes == ["exact"]  # whole, then the plain prepared path
    assert any("projected preparation failed in this test" in r.getMessage() for r in caplog.records)


def test_a_norm_that_cannot_go_by_rows_is_refused_and_the_projection_is_taken_whole(gen):
    heads, head_dim, seq = 2, 32, 40
    x, project = projection_inputs(seq, heads, head_dim, gen)
    norm = kernels.QKNorm(q_norm=lambda t: t * 2, k_norm=lambda t: t * 0.5)
    assert not norm.by_rows
    with pytest.raises(RuntimeError, match="cannot be applied by rows"):
        norm.apply_rows(x.view(1, seq, heads, head_dim), x.view(1, seq, heads, head_dim), 0)
    out, rec = kernels.attention_from_projection(kernels.RowProjection(project, x), heads, head_dim, chunk=16,
                                                 norm=norm, scale=0.25, prepared_mode="exact",
                                                 chain=kernels.BackendChain("x", (FakeProjected(),)))
    assert project.calls == [seq] and rec.projected_chunks == 0 and rec.prepared == "exact"


def test_a_preparation_failing_after_the_input_was_released_is_raised_not_hidden(gen):
    """With the projection's input gone nothing can be made whole again: the error surfaces."""
    heads, head_dim, seq = 2, 32, 40
    x, project = projection_inputs(seq, heads, head_dim, gen)
    _, table, qw, kw = fused_inputs(seq, heads, head_dim, 16, gen)
    norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)
    with pytest.raises(RuntimeError, match="projected preparation failed in this test"):
        kernels.attention_from_projection(kernels.RowProjection(project, x), heads, head_dim, chunk=16, norm=norm,
                                          scale=0.25, prepared_mode="exact",
                                          chain=kernels.BackendChain("x", (FakeProjected(raises="after_release"),)))
