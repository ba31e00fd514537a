"""Back-end choice, fallback reporting, the prepared path and the int32 offset rule, with small fakes."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels.backends.base import REASON_CODES, YES, AttentionBackend, Prepared, no
from comfyui_sage_strided_nhd.kernels.backends.sdpa import SdpaBackend
from comfyui_sage_strided_nhd.kernels import chain as chain_module
from comfyui_sage_strided_nhd.kernels.chain import BackendChain, Skip
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
        return no("not_installed", "not installed in this test")


class Unsupported(AttentionBackend):
    name = "picky"
    needs_cuda = False

    def _check_available(self):
        return YES

    def _supports(self, q, k, v, *, layout, mask=None):
        return no("head_dim", "takes no head_dim in this test")


class Raising(AttentionBackend):
    name = "raising"
    needs_cuda = False

    def _check_available(self):
        return YES

    def __call__(self, q, k, v, **_):
        raise RuntimeError("kernel launch failed in this test")


def nhd_inputs(gen, b=1, s=50, h=6, d=16):
    qkv = torch.randn(b * s, 3 * h * d, generator=gen)
    return kernels.dataflow.split_fused_qkv(qkv, h, d)


def sdpa_nhd(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def test_auto_on_cpu_runs_sdpa_and_says_why_the_others_were_skipped(gen):
    q, k, v = nhd_inputs(gen)
    out, rec = BackendChain.for_choice("auto").run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa" and rec.requested == "auto"
    skipped = {s.backend: s for s in rec.skipped}
    assert "sage2" in skipped and skipped["sage2"].reason
    assert skipped["sage2"].code in REASON_CODES and skipped["sage2"].kind in ("unavailable", "unsupported")
    assert rec.prepared == "" and rec.prepared_skipped is None  # no prepared path was asked for
    assert torch.equal(out, sdpa_nhd(q, k, v))


@pytest.mark.parametrize("choice", ["sage2", "sage1", "comfy_kitchen_int8"])
def test_requested_gpu_backend_on_cpu_falls_back_with_a_reason(choice, gen, caplog, monkeypatch):
    monkeypatch.setattr(chain_module, "_logged", set())  # each distinct skip is logged once per process
    q, k, v = nhd_inputs(gen)
    with caplog.at_level(logging.WARNING, logger="sage_strided_nhd"):
        out, rec = BackendChain.for_choice(choice).run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa"
    first = rec.skipped[0]
    assert first.backend == choice and first.reason and first.code in REASON_CODES
    # on CPU a GPU back-end is either not there at all or cannot take CPU tensors
    assert (first.kind, first.code) in {("unavailable", c) for c in ("not_installed", "wrong_version", "no_cuda",
                                                                   "gpu_arch")} | {("unsupported", "no_cuda")}
    assert any(f"{choice} skipped ({first.reason})" in r.getMessage() for r in caplog.records)
    assert torch.equal(out, sdpa_nhd(q, k, v))


@pytest.mark.parametrize("choice", ["sage1", "comfy_kitchen_int8"])  # the node's, or a checkpoint's preference
def test_a_named_backend_alone_falls_back_the_others_were_only_passed_over(choice, gen, caplog, monkeypatch):
    """On the CPU nothing before sdpa runs: the back-end asked for fell back, the ones the chain tried on the way
    to sdpa (sage2, fa4) were never asked for and are no fallbacks; the log warns about the first only."""
    monkeypatch.setattr(chain_module, "_logged", set())
    q, k, v = nhd_inputs(gen)
    with caplog.at_level(logging.INFO, logger="sage_strided_nhd"):
        _, rec = BackendChain.for_choice(choice).run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa"
    fell_back = [s.backend for s in rec.skipped if rec.fell_back(s)]
    passed_over = [s.backend for s in rec.skipped if not rec.fell_back(s)]
    assert fell_back == [choice], rec.skipped
    assert passed_over == [b for b in ("sage2", "fa4") if b != choice], rec.skipped
    levels = {s.backend: r.levelno for r in caplog.records for s in rec.skipped
              if f" {s.backend} skipped" in r.getMessage()}
    assert levels == {choice: logging.WARNING, **{b: logging.INFO for b in passed_over}}, levels


def test_what_counts_as_a_fallback():
    unavailable = Skip("fa4", "not_installed", "r", "unavailable")
    unsupported = Skip("fa4", "head_dim", "r", "unsupported")
    raised = Skip("fa4", "raised", "r", "raised")
    # auto asks for the fastest back-end this machine has
    assert [chain_module.asked_for("auto", s) for s in (unavailable, unsupported, raised)] == [False, True, True]
    # a named back-end asks for itself alone, whatever kept the others from running
    assert [chain_module.asked_for("fa4", s) for s in (unavailable, unsupported, raised)] == [True, True, True]
    assert [chain_module.asked_for("sage1", s) for s in (unavailable, unsupported, raised)] == [False, False, False]


def test_a_backend_that_raises_falls_to_the_next_and_is_logged_once(gen, caplog, monkeypatch):
    monkeypatch.setattr(chain_module, "_logged", set())
    q, k, v = nhd_inputs(gen)
    chain = BackendChain("raising", (Raising(), SdpaBackend()))
    with caplog.at_level(logging.WARNING, logger="sage_strided_nhd"):
        for _ in range(3):
            out, rec = chain.run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa"
    assert rec.skipped == (
        Skip("raising", "raised", "raised RuntimeError: kernel launch failed in this test", "raised"),)
    assert [(s.backend, s.reason) for s in rec.skipped] == [
        ("raising", "raised RuntimeError: kernel launch failed in this test")]
    warnings = [r for r in caplog.records if "raising" in r.getMessage()]
    assert len(warnings) == 1


def test_no_backend_left_is_a_clear_error(gen):
    q, k, v = nhd_inputs(gen)
    with pytest.raises(kernels.NoBackendError, match="missing: not installed in this test.*raising: raised"):
        BackendChain("missing", (Unavailable(), Raising())).run(q, k, v, layout="NHD")


def test_no_backend_error_lists_every_backends_code_and_reason(gen):
    """One Skip per back-end with its code and kind, and every reason in the message (it once said "()")."""
    q, k, v = nhd_inputs(gen)
    with pytest.raises(kernels.NoBackendError) as info:
        BackendChain("missing", (Unavailable(), Unsupported(), Raising())).run(q, k, v, layout="NHD")
    err = info.value
    assert err.skipped == (
        Skip("missing", "not_installed", "not installed in this test", "unavailable"),
        Skip("picky", "head_dim", "takes no head_dim in this test", "unsupported"),
        Skip("raising", "raised", "raised RuntimeError: kernel launch failed in this test", "raised"),
    )
    message = str(err)
    for s in err.skipped:
        assert f"{s.backend}: {s.reason}" in message, message
    assert "()" not in message


def test_no_backend_error_from_the_real_chain_names_every_backend(gen):
    """Integer tensors: no back-end takes them, sdpa included; each one says why, in auto order."""
    q, k, v = (t.to(torch.int32) for t in nhd_inputs(gen))
    with pytest.raises(kernels.NoBackendError) as info:
        BackendChain.for_choice("sage2").run(q, k, v, layout="NHD")
    err = info.value
    assert [s.backend for s in err.skipped] == list(kernels.backends.AUTO_ORDER)
    assert all(s.code in REASON_CODES and s.reason for s in err.skipped)
    sdpa = next(s for s in err.skipped if s.backend == "sdpa")
    assert (sdpa.code, sdpa.kind) == ("dtype", "unsupported") and "torch.int32" in sdpa.reason
    for s in err.skipped:
        assert f"{s.backend}: {s.reason}" in str(err)


def test_unknown_choice_and_layout_are_rejected(gen):
    with pytest.raises(ValueError, match="unknown attention back-end 'flash9'"):
        BackendChain.for_choice("flash9")
    q, k, v = nhd_inputs(gen)
    with pytest.raises(ValueError, match="layout must be"):
        BackendChain.for_choice("sdpa").run(q, k, v, layout="BHSD")
    with pytest.raises(ValueError, match="layout must be one of"):
        kernels.attention_from_fused_qkv(torch.zeros(4, 48), 1, 16, chain=BackendChain.for_choice("sdpa"),
                                         layout="nhd", norm=kernels.QKNorm(q_norm=lambda x: x, k_norm=lambda x: x))


def test_bad_fused_qkv_shapes_are_rejected():
    with pytest.raises(ValueError, match="expected 3\\*4\\*16 = 192"):
        kernels.dataflow.split_fused_qkv(torch.zeros(5, 190), 4, 16)
    with pytest.raises(ValueError, match="must be \\[S, 3\\*heads\\*head_dim\\]"):
        kernels.dataflow.split_fused_qkv(torch.zeros(1, 5, 192), 4, 16)
    with pytest.raises(ValueError, match="contiguous last dim"):
        kernels.dataflow.split_fused_qkv(torch.zeros(192, 5).t(), 4, 16)
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
    out, rec = BackendChain("fake_int32", (fake,)).run(q, k, v, layout=layout)
    assert rec.backend == "fake_int32" and rec.head_chunks == 3 and rec.compacted and rec.copies == 12
    assert fake.calls == [(1, 50, 2, 16) if layout == "NHD" else (1, 2, 50, 16)] * 3
    ref = SdpaBackend()(q, k, v, layout=layout)
    assert out.is_contiguous()
    assert torch.equal(out, ref), f"max abs difference {(out - ref).abs().max().item()}"


def test_inputs_within_the_limit_are_not_chunked(gen):
    q, k, v = nhd_inputs(gen, s=50, h=6, d=16)
    fake = FakeInt32Backend(limit=10**9)
    _, rec = BackendChain("fake_int32", (fake,)).run(q, k, v, layout="NHD")
    assert rec.head_chunks == 1 and not rec.compacted and rec.copies == 0


def test_a_sequence_too_long_for_even_one_head_falls_back(gen):
    q, k, v = nhd_inputs(gen, s=50, h=6, d=16)
    fake = FakeInt32Backend(limit=500)
    out, rec = BackendChain("fake_int32", (fake, SdpaBackend())).run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa" and "one head exceeds" in rec.skipped[0].reason
    assert (rec.skipped[0].backend, rec.skipped[0].code, rec.skipped[0].kind) == ("fake_int32", "raised", "raised")
    assert fake.calls == []


def fused_meta_views(seq, heads=56, head_dim=128):
    qkv = torch.empty(seq, 3 * heads * head_dim, device="meta", dtype=torch.bfloat16)
    return kernels.dataflow.split_fused_qkv(qkv, heads, head_dim)


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
    out, rec = BackendChain("fake_int32", (fake,)).run(q, k, v, layout="NHD")
    assert rec.head_chunks == 1 and rec.compacted and rec.copies == 4
    assert torch.equal(out, SdpaBackend()(q, k, v, layout="NHD"))


@pytest.mark.parametrize("capability,expected", [((9, 0), True), ((8, 7), False), ((10, 0), False), ((7, 5), False)])
def test_sage2_is_only_offered_on_arches_sageattn_dispatches(capability, expected, monkeypatch):
    """Per device (its own capability), before the self-test; the process-wide verdict is the install only."""
    import types

    from kernels.backends import sage2
    fake = types.SimpleNamespace(sageattn=lambda *a, **k: None, sageattn_qk_int8_pv_fp16_cuda=object())
    monkeypatch.setattr(sage2, "installed_sageattention", lambda: (fake, 2))
    asked, tested = [], []
    monkeypatch.setattr(sage2.gpu, "capability", lambda device: asked.append(device) or capability)
    monkeypatch.setattr(sage2, "self_test", lambda backend, device: tested.append(device) or YES)
    backend, cuda1 = sage2.Sage2Backend(), torch.device("cuda", 1)
    assert backend.available()
    verdict = backend.available(cuda1)
    assert verdict.ok is expected and asked == [cuda1]
    assert tested == ([cuda1] if expected else [])  # no self-test where no kernel exists
    if not expected:
        assert verdict.reason == f"no SageAttention 2 kernel for compute capability {capability[0]}.{capability[1]}"
        assert verdict.code == "gpu_arch"


def test_sage2_is_not_offered_on_a_gpu_that_is_not_nvidias(monkeypatch):
    import types

    from kernels.backends import sage2
    fake = types.SimpleNamespace(sageattn=lambda *a, **k: None, sageattn_qk_int8_pv_fp16_cuda=object())
    monkeypatch.setattr(sage2, "installed_sageattention", lambda: (fake, 2))
    monkeypatch.setattr(sage2.gpu, "capability", lambda device: None)  # a ROCm build's "cuda" device
    monkeypatch.setattr(sage2, "self_test", lambda backend, device: YES)
    verdict = sage2.Sage2Backend().available(torch.device("cuda", 0))
    assert not verdict and verdict.code == "gpu_arch"
    assert verdict.reason == "no SageAttention 2 kernel for a GPU that is not NVIDIA's"


# --- the prepared path, through a CPU fake ----------------------------------------------------------------


class CountingNorm:
    """A q_norm/k_norm stand-in: scales its [S, H, D] input and counts its calls."""

    def __init__(self, factor):
        self.factor, self.calls = factor, 0

    def __call__(self, x):
        self.calls += 1
        return x * self.factor


def counting_norm():
    return kernels.QKNorm(q_norm=CountingNorm(2.0), k_norm=CountingNorm(0.5))


def rope_norm(q):
    from devkit.rope import make_rope_table

    g = torch.Generator().manual_seed(7)
    d = q.shape[-1]
    return kernels.QKNorm(rope_table=make_rope_table(q.shape[1], d // 2, generator=g),
                          q_weight=1 + 0.2 * torch.randn(d, generator=g),
                          k_weight=1 + 0.2 * torch.randn(d, generator=g), eps=1e-5)


class FakePrepared(AttentionBackend):
    """A CPU back-end with a prepared path: ``prepare`` stashes copies of the (normalised) q/k/v,
    ``attend`` runs SDPA on them. Every hook counts its calls; ``raises`` makes ``prepare`` fail."""

    name = "fake_prepared"
    needs_cuda = False
    prepared_modes = ("exact", "rotated")

    def __init__(self, verdict=YES, raises=None, watch=None):
        self.verdict, self.raises, self.watch = verdict, raises, watch
        self.counts = dict.fromkeys(("available", "supports", "prepared_verdict", "prepare", "attend", "call"), 0)
        self.views_left_at_attend = None
        self.plain_qk = None

    def _check_available(self):
        return YES

    def available(self):
        self.counts["available"] += 1
        return super().available()

    def supports(self, q, k, v, *, layout, mask=None):
        self.counts["supports"] += 1
        return super().supports(q, k, v, layout=layout, mask=mask)

    def prepared_verdict(self, q, k, v):
        self.counts["prepared_verdict"] += 1
        return self.verdict

    def prepare(self, q, k, v, *, mode, scale):
        self.counts["prepare"] += 1
        if self.raises:
            raise RuntimeError("preparation failed in this test")
        _, s, h, d = q.shape
        return Prepared(self.name, mode, {"q": q.clone(), "k": k.clone(), "v": v.clone()}, scale, q.dtype, s, h, d,
                        head_chunks=((0, h // 2), (h // 2, h)))

    def attend(self, prepared):
        self.counts["attend"] += 1
        self.views_left_at_attend = None if self.watch is None else len(self.watch)
        p = prepared.operands
        return SdpaBackend()(p["q"], p["k"], p["v"], layout="NHD", scale=prepared.sm_scale).contiguous()

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        self.counts["call"] += 1
        self.plain_qk = (q.clone(), k.clone())
        return SdpaBackend()(q, k, v, layout=layout, scale=scale)


SCALE = 0.25  # explicit, so the prepared and the plain call compute the very same SDPA


def normed_reference(q, k, v, norm_kind):
    """SDPA on what the call owes: q*2, k/2 (counting norm) or RMSNorm+RoPE (rope norm), out of place."""
    if norm_kind == "counting":
        qn, kn = q * 2.0, k * 0.5
    else:
        n = rope_norm(q)
        qn, kn = kernels.qk_transform.norm_rope(q, k, n.rope_table, n.q_weight, n.k_weight, n.eps, inplace=False)
    return SdpaBackend()(qn, kn, v, layout="NHD", scale=SCALE)


@pytest.mark.parametrize("asked,norm_kind", [("exact", "counting"), ("rotated", "rope"), ("exact", "rope")])
def test_the_prepared_path_runs_when_asked_and_the_verdict_says_yes(asked, norm_kind, gen):
    q, k, v = nhd_inputs(gen)
    expect = normed_reference(q, k, v, norm_kind)
    norm = counting_norm() if norm_kind == "counting" else rope_norm(q)
    fake = FakePrepared()
    out, rec = BackendChain("fake_prepared", (fake,)).run(q, k, v, layout="NHD", scale=SCALE, norm=norm,
                                                         prepared_mode=asked)
    assert rec.backend == "fake_prepared" and rec.prepared == asked
    assert rec.prepared_skipped is None and rec.skipped == ()
    assert rec.head_chunks == 2 and not rec.compacted and rec.copies == 0
    assert fake.counts["call"] == 0, "the plain call must not run when the prepared path did"
    assert fake.counts["prepared_verdict"] == fake.counts["prepare"] == fake.counts["attend"] == 1
    assert norm.applied
    if norm_kind == "counting":
        assert norm.q_norm.calls == norm.k_norm.calls == 1
    assert torch.equal(out, expect)


def test_a_chain_with_prepared_paths_switched_off_runs_the_plain_call(gen):
    assert BackendChain.for_choice("sage2").prepared is True
    assert BackendChain.for_choice("sage2", prepared=False).prepared is False
    q, k, v = nhd_inputs(gen)
    norm, fake = counting_norm(), FakePrepared()
    out, rec = BackendChain("fake_prepared", (fake,), prepared=False).run(
        q, k, v, layout="NHD", scale=SCALE, norm=norm, prepared_mode="exact")
    assert rec.backend == "fake_prepared" and rec.prepared == ""
    assert rec.prepared_skipped == Skip("fake_prepared", "switched_off", "fake_prepared prepared path switched off",
                                        "unsupported")
    assert fake.counts["prepared_verdict"] == fake.counts["prepare"] == 0 and fake.counts["call"] == 1
    assert norm.q_norm.calls == norm.k_norm.calls == 1
    assert torch.equal(out, normed_reference(q, k, v, "counting"))


def test_a_prepared_verdict_no_is_recorded_and_the_plain_call_runs(gen):
    q, k, v = nhd_inputs(gen)
    norm, fake = counting_norm(), FakePrepared(verdict=no("too_long", "too long for the prepared path in this test"))
    out, rec = BackendChain("fake_prepared", (fake,)).run(q, k, v, layout="NHD", scale=SCALE, norm=norm,
                                                         prepared_mode="exact")
    assert rec.backend == "fake_prepared" and rec.prepared == ""
    assert rec.prepared_skipped == Skip("fake_prepared", "too_long", "too long for the prepared path in this test",
                                        "unsupported")
    assert fake.counts["prepare"] == 0 and fake.counts["call"] == 1
    assert norm.q_norm.calls == norm.k_norm.calls == 1
    assert torch.equal(out, normed_reference(q, k, v, "counting"))


@pytest.mark.parametrize("layout,mask,prepared_mode", [("NHD", None, None), ("HND", None, "exact"),
                                                       ("NHD", "mask", "exact")])
def test_the_prepared_path_is_only_asked_for_unmasked_nhd_calls_that_request_it(layout, mask, prepared_mode, gen):
    q, k, v = nhd_inputs(gen)
    if layout == "HND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        mask = torch.zeros(q.shape[1], q.shape[1])  # additive: masks nothing

    class Masked(FakePrepared):
        takes_mask = True

    fake = Masked()
    _, rec = BackendChain("fake_prepared", (fake,)).run(q, k, v, layout=layout, mask=mask, scale=SCALE,
                                                       prepared_mode=prepared_mode)
    assert rec.prepared == "" and rec.prepared_skipped is None
    assert fake.counts["prepared_verdict"] == fake.counts["prepare"] == 0 and fake.counts["call"] == 1


def test_a_prepared_path_that_raises_falls_to_the_plain_call_and_the_norm_runs_once(gen, caplog, monkeypatch):
    monkeypatch.setattr(chain_module, "_logged", set())
    q, k, v = nhd_inputs(gen)
    norm, fake = counting_norm(), FakePrepared(raises=True)
    with caplog.at_level(logging.WARNING, logger="sage_strided_nhd"):
        out, rec = BackendChain("fake_prepared", (fake,)).run(q, k, v, layout="NHD", scale=SCALE, norm=norm,
                                                             prepared_mode="exact")
    reason = "prepared path raised RuntimeError: preparation failed in this test"
    assert rec.backend == "fake_prepared" and rec.prepared == "" and rec.skipped == ()
    assert rec.prepared_skipped == Skip("fake_prepared", "raised", reason, "raised")
    assert fake.counts["prepare"] == 1 and fake.counts["attend"] == 0 and fake.counts["call"] == 1
    assert norm.q_norm.calls == 1 and norm.k_norm.calls == 1, "the norm must run exactly once in total"
    assert norm.applied
    assert any(f"[Sage Strided NHD] attention back-end fake_prepared skipped ({reason})" in r.getMessage()
               for r in caplog.records)
    assert torch.equal(out, normed_reference(q, k, v, "counting"))


def test_after_a_prepared_path_raised_the_plain_call_gets_normalised_q_and_k(gen):
    q, k, v = nhd_inputs(gen)
    norm, fake = counting_norm(), FakePrepared(raises=True)
    out, _ = BackendChain("fake_prepared", (fake,)).run(q, k, v, layout="NHD", scale=SCALE, norm=norm,
                                                       prepared_mode="exact")
    assert torch.equal(fake.plain_qk[0], q * 2.0) and torch.equal(fake.plain_qk[1], k * 0.5)
    assert torch.equal(out, normed_reference(q, k, v, "counting"))


@pytest.mark.parametrize("prepared_mode", ["exact", None])
def test_run_handed_empties_the_views_list(prepared_mode, gen):
    q, k, v = nhd_inputs(gen)
    expect = normed_reference(q, k, v, "counting")
    views = [q, k, v]
    fake = FakePrepared(watch=views)
    out, rec = BackendChain("fake_prepared", (fake,)).run_handed(views, layout="NHD", scale=SCALE,
                                                                norm=counting_norm(), prepared_mode=prepared_mode)
    assert views == []
    if prepared_mode:
        assert rec.prepared == "exact"
        assert fake.views_left_at_attend == 0, "the views must be dropped before the prepared kernel runs"
    else:
        assert rec.prepared == "" and fake.counts["call"] == 1
    assert torch.equal(out, expect)


def test_one_scan_per_call_asks_each_backend_once(gen):
    class Counting:
        def __init__(self):
            self.counts = {"available": 0, "supports": 0}

        def available(self):
            self.counts["available"] += 1
            return super().available()

        def supports(self, *a, **kw):
            self.counts["supports"] += 1
            return super().supports(*a, **kw)

    class CountingUnavailable(Counting, Unavailable):
        pass

    class CountingUnsupported(Counting, Unsupported):
        pass

    missing, picky, fake = CountingUnavailable(), CountingUnsupported(), FakePrepared()
    chain = BackendChain("missing", (missing, picky, fake))
    q, k, v = nhd_inputs(gen)
    calls = 3
    for i in range(calls):
        _, rec = chain.run(q, k, v, layout="NHD", scale=SCALE, norm=counting_norm(),
                           prepared_mode="exact" if i % 2 == 0 else None)
        assert rec.backend == "fake_prepared"
        assert [(s.backend, s.code, s.kind) for s in rec.skipped] == [
            ("missing", "not_installed", "unavailable"), ("picky", "head_dim", "unsupported")]
    assert missing.counts == {"available": calls, "supports": 0}
    assert picky.counts == {"available": calls, "supports": calls}
    assert fake.counts["available"] == fake.counts["supports"] == calls
    assert fake.counts["prepared_verdict"] == 2  # the two calls that asked for a prepared path


def test_call_records_are_plain_dataclasses(gen):
    q, k, v = nhd_inputs(gen)
    _, rec = BackendChain("raising", (Raising(), FakePrepared())).run(q, k, v, layout="NHD", scale=SCALE,
                                                                      prepared_mode="exact")
    d = dataclasses.asdict(rec)
    assert d["backend"] == "fake_prepared" and d["prepared"] == "exact" and d["prepared_skipped"] is None
    assert d["skipped"] == ({"backend": "raising", "code": "raised", "kind": "raised",
                             "reason": "raised RuntimeError: kernel launch failed in this test"},)
