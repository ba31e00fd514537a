"""GPU correctness of every installed back-end (runs on a CUDA machine; skipped elsewhere).

For S from 127 to 320,000 tokens at H3's 56x128 heads: strided NHD and the HND
baseline agree bit for bit on the same kernel, both match an fp32 reference on
head and tail rows (no zero or garbage tail past the int32 limit), and forced
head chunking gives the same bits as a direct call. Measured differences are
appended to $OUT/gpu_kernel_checks.jsonl (or ./gpu_kernel_checks.jsonl).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from benchmarks.measure import max_abs_difference
from devkit.inputs import fused_attention_inputs
from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels.backends import BACKENDS
from comfyui_sage_strided_nhd.kernels.offsets import fits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, HEAD_DIM, ROT = 56, 128, 96
SEQS = [127, 8192, 37810, 120000, 320000]
# Relative L2 error against fp32 on the checked rows: bf16 SDPA vs the 8-bit kernels.
TOLERANCE = {"sdpa": 1e-2, "sage2": 6e-2, "sage1": 6e-2, "comfy_kitchen_int8": 6e-2}


def log_result(row):
    path = os.path.join(os.environ.get("OUT", "."), "gpu_kernel_checks.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(row)


def inputs(seq, seed):
    return fused_attention_inputs(seq, HEADS, HEAD_DIM, ROT, seed=seed)


def reference_rows(qkv, table, qw, kw, rows, heads):
    """fp32 attention for the given query rows and heads. The norm and RoPE (per head) are applied to
    copies of those heads only, so the check holds no second full-size buffer at long lengths."""
    q, k, v = kernels.dataflow.split_fused_qkv(qkv, HEADS, HEAD_DIM)
    qh, kh = kernels.qk_transform.norm_rope(q[:, :, heads], k[:, :, heads], table, qw, kw, 1e-5, inplace=False)
    out = []
    for i, h in enumerate(heads):
        qi = qh[0, rows, i].float()[None, None]
        ki, vi = kh[0, :, i].float()[None, None], v[0, :, h].float()[None, None]
        out.append(F.scaled_dot_product_attention(qi, ki, vi)[0, 0])
    return torch.stack(out, 1)  # [rows, heads, D]


def needs_memory_or_skip(seq):
    """The layouts check at ``seq`` holds the inputs, one working copy, a back-end's own copies (HND's
    head-major Q/K/V at most) and both outputs: about four buffers of the qkv projection's size."""
    need = 4 * seq * 3 * HEADS * HEAD_DIM * 2
    _, total = torch.cuda.mem_get_info()
    if need > total:
        pytest.skip(f"{seq} tokens need about {need / 2**30:.1f} GiB; this card has {total / 2**30:.1f} GiB")


def norm(table, qw, kw):
    """A fresh QKNorm per call (one is applied at most once)."""
    return kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)


def skipped(rec):
    return [(s.backend, s.reason) for s in rec.skipped]


def available_or_skip(name):
    verdict = BACKENDS[name].available()
    if not verdict:
        pytest.skip(f"{name} not available here: {verdict.reason}")


@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("name", ["sage2", "sdpa", "comfy_kitchen_int8", "sage1"])
def test_backend_layouts_agree_and_match_fp32(name, seq):
    available_or_skip(name)
    needs_memory_or_skip(seq)
    qkv, table, qw, kw = inputs(seq, seed=seq)
    rows = torch.cat([torch.arange(min(256, seq)), torch.arange(max(0, seq - 256), seq)]).unique().cuda()
    heads = [0, HEADS // 2, HEADS - 1]
    ref = reference_rows(qkv, table, qw, kw, rows, heads)
    needs_chunks = not fits(kernels.dataflow.split_fused_qkv(qkv, HEADS, HEAD_DIM), 1, 128, 2**31 - 1)
    chain = kernels.BackendChain.for_choice(name)
    outs, recs = {}, {}
    layouts = ("strided_nhd", "hnd")
    for layout in layouts:
        # handed over (a one-item list), so the call may free its input before the kernel; the last
        # layout takes the inputs themselves: no third full-size buffer
        last = layout == layouts[-1]
        handed = [qkv if last else qkv.clone()]
        if last:
            del qkv
        out, rec = kernels.attention_from_fused_qkv(handed, HEADS, HEAD_DIM, chain=chain, layout=layout,
                                                    norm=norm(table, qw, kw))
        assert rec.backend == name, skipped(rec)
        outs[layout], recs[layout] = out, rec
    diff = max_abs_difference(outs["strided_nhd"], outs["hnd"])
    row = {"backend": name, "seq": seq, "nhd_vs_hnd_max_abs": diff["max_abs_difference"],
           "nhd_vs_hnd_mean_abs": diff["mean_abs_difference"],
           "chunks": recs["strided_nhd"].head_chunks, "compacted": recs["strided_nhd"].compacted,
           "nhd_copies": recs["strided_nhd"].copies, "hnd_copies": recs["hnd"].copies,
           "nhd_prepared": recs["strided_nhd"].prepared}
    for layout, out in outs.items():
        got = out.view(seq, HEADS, HEAD_DIM)[rows][:, heads].float()
        rel = ((got - ref).norm() / ref.norm()).item()
        tail = out.view(seq, HEADS, HEAD_DIM)[-64:].float()
        row[f"{layout}_rel_err_vs_fp32"] = rel
        assert torch.isfinite(out).all(), f"{layout}: non-finite output"
        assert tail.abs().amax(dim=-1).min() > 0, f"{layout}: zero rows in the tail"
        assert rel < TOLERANCE[name], f"{layout}: relative error {rel:.3e} vs fp32"
    log_result(row)
    assert torch.equal(outs["strided_nhd"], outs["hnd"]), f"max abs difference {row['nhd_vs_hnd_max_abs']}"
    if BACKENDS[name].max_element_offset is not None:
        if recs["strided_nhd"].prepared:
            # the sage2 prepared path writes its own compact head-major operands: nothing to compact
            assert not recs["strided_nhd"].compacted
        else:
            assert recs["strided_nhd"].compacted == needs_chunks


@pytest.mark.parametrize("name", ["sage2", "comfy_kitchen_int8", "sage1"])
def test_forced_head_chunking_gives_the_same_bits(name, monkeypatch):
    available_or_skip(name)
    # the chain's int32 head chunking of the plain call (the sage2 prepared path chunks by itself:
    # tests/gpu/test_sage2_fast.py), so the chain runs with every prepared path switched off
    seq = 8192
    qkv, table, qw, kw = inputs(seq, seed=7)
    chain = kernels.BackendChain.for_choice(name, prepared=False)

    def run():
        work = qkv.clone()
        return kernels.attention_from_fused_qkv(work, HEADS, HEAD_DIM, chain=chain, norm=norm(table, qw, kw))

    direct, rec_direct = run()
    monkeypatch.setattr(BACKENDS[name], "max_element_offset", seq * 8 * HEAD_DIM + 10**6)
    chunked, rec_chunked = run()
    assert rec_direct.backend == rec_chunked.backend == name, (skipped(rec_direct), skipped(rec_chunked))
    assert rec_direct.prepared == rec_chunked.prepared == ""
    assert rec_direct.head_chunks == 1 and rec_chunked.head_chunks > 1
    diff = (direct.float() - chunked.float()).abs().max().item()
    log_result({"backend": name, "check": "forced_chunking", "seq": seq, "chunks": rec_chunked.head_chunks,
                "max_abs": diff})
    assert torch.equal(direct, chunked), f"max abs difference {diff}"
