"""fa4 (FlashAttention-4) on a CUDA GPU: skipped with the reason where CUDA or flash-attn-4 is absent.

At H3's 56x128 heads: strided NHD views of the fused qkv buffer and the HND baseline give the
same bits; the error against fp32 (head and tail rows, a few heads) is within SDPA's own bf16
error on the same rows; long sequences (past the fused buffer's int32 offsets at 99,864
tokens) stay correct; the JIT compile happens once, not per sequence length or call site.
Measured numbers are appended to $OUT/fa4_gpu_checks.jsonl (or ./fa4_gpu_checks.jsonl).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from benchmarks.measure import peak_extra_bytes
from devkit.inputs import fused_attention_inputs
from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels.backends import BACKENDS
from comfyui_sage_strided_nhd.kernels.offsets import fits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, HEAD_DIM, ROT = 56, 128, 96
CHECK_HEADS = [0, HEADS // 2, HEADS - 1]
SDPA_TOLERANCE = 1e-2  # tests/gpu/test_kernels_gpu.py: bf16 SDPA vs fp32 on the checked rows


def log_result(row):
    path = os.path.join(os.environ.get("OUT", "."), "fa4_gpu_checks.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(row)


@pytest.fixture(scope="module")
def fa4():
    backend = BACKENDS["fa4"]
    verdict = backend.available()
    if not verdict:
        pytest.skip(f"fa4 not available here: {verdict.reason}")
    return backend


def inputs(seq, seed):
    return fused_attention_inputs(seq, HEADS, HEAD_DIM, ROT, seed=seed)


def normed(qkv, table, qw, kw):
    out = qkv.clone()
    q, k, _ = kernels.dataflow.split_fused_qkv(out, HEADS, HEAD_DIM)
    kernels.qk_transform.norm_rope(q, k, table, qw, kw, 1e-5)
    return out


def check_rows(seq):
    return torch.cat([torch.arange(min(256, seq)), torch.arange(max(0, seq - 256), seq)]).unique().cuda()


def references(qkv_normed, rows):
    """fp32 attention and bf16 SDPA (the pack's sdpa back-end) for the given query rows, per checked head."""
    q, k, v = kernels.dataflow.split_fused_qkv(qkv_normed, HEADS, HEAD_DIM)
    ref, sdpa = [], []
    for h in CHECK_HEADS:
        qh = q[0, rows, h][None, None]
        kh, vh = k[0, :, h][None, None], v[0, :, h][None, None]
        ref.append(F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float())[0, 0])
        sdpa.append(BACKENDS["sdpa"](qh, kh, vh, layout="HND")[0, 0].float())
    return torch.stack(ref, 1), torch.stack(sdpa, 1)  # [rows, heads, D]


def rel(got, ref):
    return ((got.float() - ref).norm() / ref.norm()).item()


def skipped(rec):
    return [(s.backend, s.reason) for s in rec.skipped]


def run(qkv, table, qw, kw, layout, chain):
    work = qkv.clone()
    norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)  # one per call
    return kernels.attention_from_fused_qkv(work, HEADS, HEAD_DIM, chain=chain, layout=layout, norm=norm)


def check_against_fp32(out, seq, rows, ref, sdpa_err, label):
    got = out.view(seq, HEADS, HEAD_DIM)[rows][:, CHECK_HEADS]
    err = rel(got, ref)
    tail = out.view(seq, HEADS, HEAD_DIM)[-64:].float()
    assert torch.isfinite(out).all(), f"{label}: non-finite output"
    assert tail.abs().amax(dim=-1).min() > 0, f"{label}: zero rows in the tail"
    assert err < SDPA_TOLERANCE, f"{label}: relative error {err:.3e} vs fp32"
    assert err <= 1.5 * sdpa_err + 1e-4, f"{label}: relative error {err:.3e} vs SDPA's {sdpa_err:.3e}"
    return err


@pytest.mark.parametrize("seq", [127, 8192, 37810])
def test_strided_nhd_and_hnd_agree_bit_for_bit_within_sdpa_error(fa4, seq):
    qkv, table, qw, kw = inputs(seq, seed=seq)
    chain = kernels.BackendChain.for_choice("fa4")
    outs, recs = {}, {}
    for layout in ("strided_nhd", "hnd"):
        torch.cuda.synchronize()
        outs[layout], recs[layout] = run(qkv, table, qw, kw, layout, chain)
        assert recs[layout].backend == "fa4", skipped(recs[layout])
    rows = check_rows(seq)
    ref, sdpa = references(normed(qkv, table, qw, kw), rows)
    sdpa_err = rel(sdpa, ref)
    row = {"backend": "fa4", "seq": seq, "sdpa_rel_err_vs_fp32": sdpa_err,
           "nhd_vs_hnd_max_abs": (outs["strided_nhd"].float() - outs["hnd"].float()).abs().max().item(),
           "nhd_copies": recs["strided_nhd"].copies, "hnd_copies": recs["hnd"].copies,
           "chunks": recs["strided_nhd"].head_chunks, "compacted": recs["strided_nhd"].compacted}
    for layout, out in outs.items():
        row[f"{layout}_rel_err_vs_fp32"] = check_against_fp32(out, seq, rows, ref, sdpa_err, layout)
    log_result(row)
    assert torch.equal(outs["strided_nhd"], outs["hnd"]), f"max abs difference {row['nhd_vs_hnd_max_abs']}"
    assert recs["strided_nhd"].copies == 0 and not recs["strided_nhd"].compacted


def test_strided_views_go_in_without_copies(fa4):
    """The only allocation of a direct call is the output: fa4 took the fused views as they are."""
    seq = 37810
    qkv, *_ = inputs(seq, seed=3)
    q, k, v = kernels.dataflow.split_fused_qkv(qkv, HEADS, HEAD_DIM)
    out, _ = kernels.BackendChain.for_choice("fa4").run(q, k, v, layout="NHD")  # compiled and warm
    del out
    torch.cuda.empty_cache()
    peak, (out, rec) = peak_extra_bytes(
        lambda: kernels.BackendChain.for_choice("fa4").run(q, k, v, layout="NHD"), torch.device("cuda"))
    out_bytes = out.numel() * out.element_size()
    log_result({"backend": "fa4", "seq": seq, "peak_extra_bytes": peak, "output_bytes": out_bytes})
    assert rec.backend == "fa4" and out.is_contiguous() and out.shape == q.shape
    assert peak < out_bytes + 64 * 2**20, f"peak extra {peak} bytes for a {out_bytes}-byte output"


@pytest.mark.parametrize("seq", [120_000, 320_000])
def test_long_sequences_keep_head_and_tail_rows_correct(fa4, seq):
    qkv, table, qw, kw = inputs(seq, seed=seq)
    q, k, v = kernels.dataflow.split_fused_qkv(qkv, HEADS, HEAD_DIM)
    past_int32 = not fits((q, k, v), 1, 128, 2**31 - 1)
    assert past_int32  # both lengths are past the fused views' int32 offsets (99,864 tokens)
    chain = kernels.BackendChain.for_choice("fa4")
    out, rec = run(qkv, table, qw, kw, "strided_nhd", chain)
    assert rec.backend == "fa4", skipped(rec)
    if fa4.max_element_offset is None:
        assert rec.head_chunks == 1 and not rec.compacted  # 64-bit: the views go in whole
    else:
        assert rec.compacted
    rows = check_rows(seq)
    ref, sdpa = references(normed(qkv, table, qw, kw), rows)
    sdpa_err = rel(sdpa, ref)
    err = check_against_fp32(out, seq, rows, ref, sdpa_err, f"S={seq}")
    log_result({"backend": "fa4", "seq": seq, "strided_nhd_rel_err_vs_fp32": err, "sdpa_rel_err_vs_fp32": sdpa_err,
                "chunks": rec.head_chunks, "compacted": rec.compacted,
                "tail_rel_err_vs_fp32": rel(out.view(seq, HEADS, HEAD_DIM)[rows[-256:]][:, CHECK_HEADS],
                                            ref[-256:])})


def test_forced_head_chunking_gives_the_same_bits(fa4, monkeypatch):
    """The int32 path the chain takes on arches where 64-bit indexing is not verified."""
    seq = 8192
    qkv, table, qw, kw = inputs(seq, seed=7)
    chain = kernels.BackendChain.for_choice("fa4")
    direct, rec_direct = run(qkv, table, qw, kw, "strided_nhd", chain)
    monkeypatch.setattr(fa4, "max_element_offset", seq * 8 * HEAD_DIM + 10**6)
    chunked, rec_chunked = run(qkv, table, qw, kw, "strided_nhd", chain)
    assert rec_direct.head_chunks == 1 and rec_chunked.head_chunks == 7 and rec_chunked.compacted
    assert torch.equal(direct, chunked)


def test_the_compile_happens_once_not_per_sequence_length_or_call_site(fa4):
    chain = kernels.BackendChain.for_choice("fa4")
    qkv, table, qw, kw = inputs(512, seed=11)
    run(qkv, table, qw, kw, "strided_nhd", chain)  # compiles here if no earlier test did
    before = len(fa4.compile_events)
    for seq in (37810, 8192, 37900):
        qkv, table, qw, kw = inputs(seq, seed=seq + 1)
        for layout in ("strided_nhd", "hnd"):
            run(qkv, table, qw, kw, layout, chain)
    # Another call site: token-major q/k/v [B, S, H*D] through a new chain, as a non-H3 model calls
    # attention: NHD [B, S, H, D] views in, the token-major [B*S, H*D] view of the output out.
    x = torch.randn(1, 4096, 3 * HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(1, 4096, HEADS, HEAD_DIM) for t in x.split(HEADS * HEAD_DIM, dim=-1))
    out, rec = kernels.attention_nhd(q, k, v, chain=kernels.BackendChain.for_choice("fa4"))
    flat, _ = kernels.token_major(out)
    assert rec.backend == "fa4", skipped(rec)
    assert flat.shape == (4096, HEADS * HEAD_DIM)
    log_result({"backend": "fa4", "compile_events": fa4.compile_events,
                "new_events_after_first_call": fa4.compile_events[before:]})
    assert len(fa4.compile_events) >= 1
    assert fa4.compile_events[before:] == [], fa4.compile_events[before:]
