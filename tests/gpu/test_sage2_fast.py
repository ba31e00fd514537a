"""GPU checks of the sage2 sm90 prepared path (H100/H200 with SageAttention 2 built; skipped elsewhere).

* the pack's operands equal SageAttention's own (per-thread int8 Q/K, per-channel fp8 V) bit for bit;
* exact mode: attend(prepare(q, k, v)) equals ``sageattn(q, k, v, tensor_layout="NHD")`` bit for
  bit at S = 127, 8,192 and 37,810 (56 heads, strided NHD views of one fused qkv buffer);
* rotated mode's operands equal the torch reference's (devkit/sage2_oracle.py) but for the division's
  rare last step;
* rotated mode: its error against fp32 attention, printed next to exact mode's;
* 120,000 / 210,000 / 320,000 tokens: head and tail rows match fp32 attention (no gray tail);

Measured numbers are appended to $OUT/sage2_fast_checks.jsonl (or ./sage2_fast_checks.jsonl).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from devkit import sage2_oracle
from devkit.inputs import fused_attention_inputs
from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels import sage2_quant
from comfyui_sage_strided_nhd.kernels.backends import BACKENDS


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs sm90 (H100/H200), got {torch.cuda.get_device_capability()}"
    available = BACKENDS["sage2"].available()
    if not available:
        return available.reason
    q = torch.empty(1, 128, 1, 128, dtype=torch.bfloat16, device="cuda")
    verdict = BACKENDS["sage2"].prepared_verdict(q, q, q)
    return None if verdict else verdict.reason


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

HEADS, D, ROT, EPS = 56, 128, 96, 1e-5
B = BACKENDS["sage2"]


def log_result(row):
    path = os.path.join(os.environ.get("OUT", "."), "sage2_fast_checks.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(row)


def fused_buffer(seq, seed, heads=HEADS):
    return fused_attention_inputs(seq, heads, D, ROT, seed=seed, table_dtype=torch.float32)


def views(qkv, heads=HEADS):
    return qkv.unflatten(1, (3, heads, D)).unsqueeze(0).unbind(2)


def fp32_rows(q, k, v, rows, heads):
    out = []
    for h in heads:
        qh = q[0, rows, h].float()[None, None]
        kh, vh = k[0, :, h].float()[None, None], v[0, :, h].float()[None, None]
        out.append(F.scaled_dot_product_attention(qh, kh, vh)[0, 0])
    return torch.stack(out, 1)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sage_reference_operands(q, k, v):
    """SageAttention's own preparation, as sageattn_qk_int8_pv_fp8_cuda_sm90 makes it."""
    from sageattention.quant import per_channel_fp8
    from sageattention.triton.quant_per_thread import per_thread_int8
    km = k.mean(dim=1, keepdim=True)
    qi, qs, ki, ks = per_thread_int8(q, k, km, tensor_layout="NHD", BLKQ=64, WARPQ=16, BLKK=128, WARPK=128)
    pad = (128 - v.shape[1] % 128) % 128
    vp = torch.cat([v, torch.zeros(1, pad, v.shape[2], D, dtype=v.dtype, device=v.device)], 1) if pad else v
    vf, vs, _ = per_channel_fp8(vp, tensor_layout="NHD", smooth_v=False)
    return {"q_int8": qi[0].permute(1, 0, 2), "q_scale": qs, "k_int8": ki[0].permute(1, 0, 2), "k_scale": ks,
            "v_fp8": vf[0].permute(1, 0, 2), "v_scale": vs}


mismatches = sage2_oracle.operand_mismatches


@pytest.mark.parametrize("seq", [127, 8192])
def test_operands_equal_sageattention_own(seq):
    qkv, *_ = fused_buffer(seq, 1)
    q, k, v = views(qkv)
    exp = sage_reference_operands(q, k, v)
    results = mismatches(sage2_quant.quantize_operands(q, k, v), exp)
    log_result({"check": "operands_vs_sageattention", "seq": seq, "mismatches": results})
    assert all(n == 0 for n in results.values()), results


@pytest.mark.parametrize("seq", [127, 8192, 37810])
def test_exact_mode_bit_identical_to_sageattn(seq):
    from sageattention import sageattn
    qkv, *_ = fused_buffer(seq, 2)
    q, k, v = views(qkv)
    assert B.prepared_verdict(q, k, v)
    ref = sageattn(q, k, v, tensor_layout="NHD")
    out = B.attend(B.prepare(q, k, v, mode="exact"))
    assert out.is_contiguous() and out.shape == (1, seq, HEADS, D)
    diff = (out.float() - ref.float()).abs()
    log_result({"check": "exact_vs_sageattn", "seq": seq, "bit_identical": bool(torch.equal(out, ref)),
                "max_abs": diff.max().item(), "n_diff": int((out != ref).sum().item())})
    assert torch.equal(out, ref)


def test_rotated_operands_match_the_reference_on_the_gpu():
    # The rotation is an exact integer product (int8 tensor cores), so what differs from the torch
    # reference can only be the int8 step's division (Triton's div.full.f32 against torch's IEEE
    # division), which exact mode shares: rare, one step at most.
    seq, heads = 8192, 8
    qkv, *_ = fused_buffer(seq, 4, heads=heads)
    q, k, v = views(qkv, heads)
    chans = torch.randperm(D, device="cuda")[:4]
    k[..., chans] *= 30  # outlier channels, where the rotation matters
    row = {"check": "rotated_operands_vs_reference", "seq": seq, "heads": heads}
    for mode in ("exact", "rotated"):
        got = sage2_quant.quantize_operands(q, k, v, mode=mode)
        exp = sage2_oracle.prepare_reference(q, k, v, mode=mode)
        row[mode] = {"mismatches": mismatches(got, exp),
                     "int8_max_step": max(int((got[n].int() - exp[n].int()).abs().max()) for n in ("q_int8", "k_int8")),
                     "scale_max_rel": max(((got[n] - exp[n]).abs() / exp[n]).max().item() for n in ("q_scale", "k_scale"))}
    log_result(row)
    r = row["rotated"]
    assert r["int8_max_step"] <= 1 and r["scale_max_rel"] < 2**-20, row
    assert r["mismatches"]["q_int8"] + r["mismatches"]["k_int8"] <= 1e-5 * 2 * q.numel(), row
    # V is untouched by the rotation: it differs from the reference (torch's IEEE division in V's
    # scale; the exact-mode test above pins V to SageAttention's own) exactly as exact mode's does
    assert r["mismatches"]["v_fp8"] == row["exact"]["mismatches"]["v_fp8"], row


def test_rotated_mode_error():
    seq = 8192
    qkv, table, qw, kw = fused_buffer(seq, 3)
    q, k, v = views(qkv)
    sage2_oracle.norm_rope_eager_(q, k, table, qw, kw, EPS)  # the prepared path's inputs: normed in place
    rows = torch.cat([torch.arange(256), torch.arange(seq - 256, seq)]).cuda()
    heads = [0, 17, 55]
    ref = fp32_rows(q, k, v, rows, heads)
    exact = B.attend(B.prepare(q, k, v, mode="exact"))
    rotated = B.attend(B.prepare(q, k, v, mode="rotated"))
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    sel = lambda o: o[0, rows][:, heads]  # noqa: E731
    row = {"check": "mode_errors", "seq": seq,
           "rel_err_vs_fp32": {name: rel(sel(o), ref) for name, o in
                               (("exact", exact), ("rotated", rotated), ("sdpa_bf16", sdpa))},
           "rotated_vs_exact_max_abs": (rotated.float() - exact.float()).abs().max().item()}
    log_result(row)
    errs = row["rel_err_vs_fp32"]
    assert errs["exact"] < 6e-2 and errs["rotated"] < 6e-2
    assert errs["sdpa_bf16"] < errs["exact"]


@pytest.mark.parametrize("seq", [120000, 210000, 320000])
def test_long_sequences_head_and_tail_rows(seq):
    qkv, *_ = fused_buffer(seq, 4)
    q, k, v = views(qkv)
    assert B.prepared_verdict(q, k, v)
    p = B.prepare(q, k, v, mode="exact")
    out = B.attend(p)
    rows = torch.cat([torch.arange(64), torch.arange(seq - 64, seq)]).cuda()
    heads = [0, 30, 55]
    ref = fp32_rows(q, k, v, rows, heads)
    got = out[0, rows][:, heads]
    tail = out[0, -64:]
    row = {"check": "long_sequence", "seq": seq, "head_chunks": list(p.head_chunks),
           "rel_err_head": rel(got[:64], ref[:64]), "rel_err_tail": rel(got[64:], ref[64:]),
           "max_abs_tail": (got[64:].float() - ref[64:]).abs().max().item(),
           "tail_all_finite": bool(torch.isfinite(tail).all()), "tail_zero_rows": int((tail.abs().amax(-1) == 0).sum())}
    log_result(row)
    assert row["tail_all_finite"] and row["tail_zero_rows"] == 0
    assert row["rel_err_head"] < 6e-2 and row["rel_err_tail"] < 6e-2


@pytest.mark.parametrize("how", ["rows", "columns"])
@pytest.mark.parametrize("seq,mode", [(37810, "exact"), (37810, "rotated"), (320000, "exact")])
def test_prepare_projected_gives_the_whole_preparation_bits(seq, mode, how):
    """The projection handed over by 8,192-token chunks of whole rows (K/V gathered in a buffer) or by columns (K
    of every row, Q by chunks, then V): the operands of ``prepare`` on the whole buffer, bit for bit; at 320,000
    tokens every buffer passes 2**31 elements."""
    qkv, table, qw, kw = fused_buffer(seq, 5)

    def norm():
        return kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=EPS)
    inner = HEADS * D
    if how == "rows":
        projection = kernels.RowProjection(lambda rows: rows.clone(), qkv.clone())
        kv = torch.empty(seq, 2 * inner, dtype=qkv.dtype, device=qkv.device)
    else:
        columns = tuple((lambda rows, a=a: rows[:, a:a + inner].clone()) for a in (0, inner, 2 * inner))
        projection, kv = kernels.RowProjection(None, qkv.clone(), columns=columns), None
    got = B.prepare_projected(projection, kv, heads=HEADS, mode=mode, norm=norm(), chunk=8192 if kv is not None
                              else -(-8192 // 3))
    del kv
    q, k, v = views(qkv)
    q, k = norm().apply(q, k)  # the whole buffer normalised in place by the same pass, then prepared
    want = B.prepare(q, k, v, mode=mode)
    results = mismatches(got.operands, want.operands)
    log_result({"check": "prepare_projected_vs_prepare", "seq": seq, "mode": mode, "how": how,
                "chunks": got.projected_chunks, "mismatches": results})
    assert got.projected_chunks == -(-seq // 8192) and projection.released and got.mode == want.mode
    assert all(n == 0 for n in results.values()), results
