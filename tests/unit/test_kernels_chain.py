"""Back-end choice, fallback reporting and the int32 offset rule, with small fakes of the limits."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels.backends.base import YES, AttentionBackend, no
from comfyui_sage_strided_nhd.kernels.backends.sdpa import SdpaBackend
from comfyui_sage_strided_nhd.kernels.chain import BackendChain
from comfyui_sage_strided_nhd.kernels.offsets import fits, largest_offset


class FakeInt32Backend(AttentionBackend):
    """sdpa behind a small offset limit that fails loudly if the chain ever exceeds it."""

    name = "fake_int32"
    needs_cuda = False
    row_block = 8

    def __init__(self, limit):
        self.max_element_offset = limit
        self.calls = []

    def _check_available(self):
        return YES

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        seq_dim = 1 if layout == "NHD" else 2
        assert fits((q, k, v), seq_dim, self.row_block, self.max_element_offset), "offset limit exceeded"
        self.calls.append(tuple(q.shape))
        return SdpaBackend()(q, k, v, layout=layout, scale=scale)


class Unavailable(AttentionBackend):
    name = "missing"

    def _check_available(self):
        return no("not installed in this test")


class Raising(AttentionBackend):
    name = "raising"
    needs_cuda = False

    def _check_available(self):
        return YES

    def __call__(self, q, k, v, **_):
        raise RuntimeError("kernel launch failed in this test")


def nhd_inputs(gen, b=1, s=50, h=6, d=16):
    qkv = torch.randn(b * s, 3 * h * d, generator=gen)
    return kernels.split_fused_qkv(qkv, h, d)


def sdpa_nhd(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def test_auto_on_cpu_runs_sdpa_and_says_why_the_others_were_skipped(gen):
    q, k, v = nhd_inputs(gen)
    out, rec = BackendChain.for_choice("auto", "cpu").run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa" and rec.requested == "auto"
    skipped = dict(rec.fallbacks)
    assert "sage2" in skipped and skipped["sage2"]
    assert torch.equal(out, sdpa_nhd(q, k, v))


@pytest.mark.parametrize("choice", ["sage2", "sage1", "comfy_kitchen_int8"])
def test_requested_gpu_backend_on_cpu_falls_back_with_a_reason(choice, gen, caplog):
    q, k, v = nhd_inputs(gen)
    with caplog.at_level(logging.WARNING, logger="sage_strided_nhd"):
        out, rec = BackendChain.for_choice(choice, "cpu").run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa"
    assert rec.fallbacks[0][0] == choice and rec.fallbacks[0][1]
    assert torch.equal(out, sdpa_nhd(q, k, v))


def test_a_backend_that_raises_falls_to_the_next_and_is_logged_once(gen, caplog):
    q, k, v = nhd_inputs(gen)
    chain = BackendChain("raising", [Raising(), SdpaBackend()])
    with caplog.at_level(logging.WARNING, logger="sage_strided_nhd"):
        for _ in range(3):
            out, rec = chain.run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa"
    assert rec.fallbacks == (("raising", "raised RuntimeError: kernel launch failed in this test"),)
    warnings = [r for r in caplog.records if "raising" in r.getMessage()]
    assert len(warnings) == 1


def test_no_backend_left_is_a_clear_error(gen):
    q, k, v = nhd_inputs(gen)
    with pytest.raises(kernels.NoBackendError, match="missing: not installed in this test.*raising: raised"):
        BackendChain("missing", [Unavailable(), Raising()]).run(q, k, v, layout="NHD")


def test_unknown_choice_and_layout_are_rejected(gen):
    with pytest.raises(ValueError, match="unknown attention back-end 'flash9'"):
        BackendChain.for_choice("flash9")
    q, k, v = nhd_inputs(gen)
    with pytest.raises(ValueError, match="layout must be"):
        BackendChain.for_choice("sdpa").run(q, k, v, layout="BHSD")
    with pytest.raises(ValueError, match="layout must be one of"):
        kernels.attention_from_fused_qkv(torch.zeros(4, 48), 1, 16, chain=BackendChain.for_choice("sdpa"),
                                         layout="nhd", q_norm=lambda x: x, k_norm=lambda x: x)


def test_bad_fused_qkv_shapes_are_rejected():
    with pytest.raises(ValueError, match="expected 3\\*4\\*16 = 192"):
        kernels.split_fused_qkv(torch.zeros(5, 190), 4, 16)
    with pytest.raises(ValueError, match="must be \\[S, 3\\*heads\\*head_dim\\]"):
        kernels.split_fused_qkv(torch.zeros(1, 5, 192), 4, 16)
    with pytest.raises(ValueError, match="contiguous last dim"):
        kernels.split_fused_qkv(torch.zeros(192, 5).t(), 4, 16)
    with pytest.raises(ValueError, match="incompatible q/k/v shapes"):
        BackendChain.for_choice("sdpa").run(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 3, 2, 8),
                                            layout="NHD")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_overflowing_offsets_are_split_into_compact_head_chunks(layout, gen):
    q, k, v = nhd_inputs(gen, s=50, h=6, d=16)
    if layout == "HND":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    # Fused NHD views reach offset ~ 56*288 here; a compact 2-head chunk is 56*2*16 = 1,792 elements.
    fake = FakeInt32Backend(limit=2_000)
    seq_dim = 1 if layout == "NHD" else 2
    assert not fits((q, k, v), seq_dim, fake.row_block, fake.max_element_offset)
    out, rec = BackendChain("fake_int32", [fake]).run(q, k, v, layout=layout)
    assert rec.backend == "fake_int32" and rec.head_chunks == 3 and rec.compacted and rec.copies == 12
    assert fake.calls == [(1, 50, 2, 16) if layout == "NHD" else (1, 2, 50, 16)] * 3
    ref = SdpaBackend()(q, k, v, layout=layout)
    assert out.is_contiguous()
    assert torch.equal(out, ref), f"max abs difference {(out - ref).abs().max().item()}"


def test_inputs_within_the_limit_are_not_chunked(gen):
    q, k, v = nhd_inputs(gen, s=50, h=6, d=16)
    fake = FakeInt32Backend(limit=10**9)
    _, rec = BackendChain("fake_int32", [fake]).run(q, k, v, layout="NHD")
    assert rec.head_chunks == 1 and not rec.compacted and rec.copies == 0


def test_a_sequence_too_long_for_even_one_head_falls_back(gen):
    q, k, v = nhd_inputs(gen, s=50, h=6, d=16)
    fake = FakeInt32Backend(limit=500)
    out, rec = BackendChain("fake_int32", [fake, SdpaBackend()]).run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa" and "one head exceeds" in rec.fallbacks[0][1]
    assert fake.calls == []


def fused_meta_views(seq, heads=56, head_dim=128):
    qkv = torch.empty(seq, 3 * heads * head_dim, device="meta", dtype=torch.bfloat16)
    return kernels.split_fused_qkv(qkv, heads, head_dim)


def test_h3_fused_buffer_offsets_cross_int32_near_100k_tokens():
    limit = 2**31 - 1
    assert fits(fused_meta_views(99_000), 1, 128, limit)
    assert not fits(fused_meta_views(100_000), 1, 128, limit)
    q = fused_meta_views(99_000)[0]
    assert largest_offset(q, 1, 1) == (99_000 - 1) * 21_504 + 55 * 128 + 127
    contiguous = torch.empty(1, 290_000, 56, 128, device="meta")
    assert fits((contiguous,), 1, 128, limit)
    assert not fits((torch.empty(1, 300_000, 56, 128, device="meta"),), 1, 128, limit)


def test_fused_views_past_the_limit_run_as_one_compact_chunk_when_it_fits(gen):
    q, k, v = nhd_inputs(gen, s=50, h=6, d=16)
    fake = FakeInt32Backend(limit=6_000)  # fused views reach ~16k, a compact copy of all heads 5,376
    out, rec = BackendChain("fake_int32", [fake]).run(q, k, v, layout="NHD")
    assert rec.head_chunks == 1 and rec.compacted and rec.copies == 4
    assert torch.equal(out, SdpaBackend()(q, k, v, layout="NHD"))


@pytest.mark.parametrize("capability,expected", [((9, 0), True), ((8, 7), False), ((10, 0), False), ((7, 5), False)])
def test_sage2_is_only_offered_on_arches_sageattn_dispatches(capability, expected, monkeypatch):
    import types

    from kernels.backends import sage2
    fake = types.SimpleNamespace(sageattn=lambda *a, **k: None, sageattn_qk_int8_pv_fp16_cuda=object())
    monkeypatch.setattr(sage2, "installed_sageattention", lambda: (fake, 2))
    monkeypatch.setattr(sage2, "cuda_capability", lambda: capability)
    verdict = sage2.Sage2Backend().available()
    assert verdict.ok is expected
    if not expected:
        assert f"{capability[0]}.{capability[1]}" in verdict.reason
