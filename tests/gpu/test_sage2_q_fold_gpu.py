"""The sage2 exact preparation forming Q's RMSNorm+RoPE itself, compiled (needs CUDA and Triton only):
the pack's norm+rope pass on K alone, then the exact quantisation reading the raw Q
(``q_norm_rope``), against the pass on Q and K then the exact quantisation. Every operand bit for
bit, K in memory the same, Q left raw: at H3's shape (56 x 128 heads, rotation of the first 96 dims)
at 8,192 and 37,810 tokens with bf16 and fp32 tables, with no tail (rot 128) and 45 pairs (rot 90)
at a length no multiple of 64, and with Q by token chunks of 8,192. The two sequences' times are
printed and appended to $OUT/sage2_q_fold.jsonl (not asserted)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from devkit.inputs import fused_attention_inputs
from devkit.sage2_oracle import operand_mismatches
from comfyui_sage_strided_nhd.kernels import qk_transform, sage2_quant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, D, EPS = 56, 128, 1e-5


def views(buf, heads=HEADS):
    return buf.unflatten(1, (3, heads, D)).unsqueeze(0).unbind(2)


def inputs(seq, rot, table_dtype, seed):
    return fused_attention_inputs(seq, HEADS, D, rot, seed=seed, weight_mean=1.0, weight_spread=0.3,
                                  table_dtype=table_dtype)


def today(qkv, table, qw, kw):
    """The pass on Q and K in place, then the exact quantisation."""
    q, k, v = views(qkv)
    qk_transform.norm_rope_pass(q, k, table, qw, kw, EPS)
    return sage2_quant.quantize_operands(q, k, v, mode="exact")


def folded(qkv, table, qw, kw):
    """The pass on K alone, then the exact quantisation forming Q's values."""
    q, k, v = views(qkv)
    qk_transform.norm_rope_pass(q, k, table, qw, kw, EPS, do_q=False)
    return sage2_quant.quantize_operands(q, k, v, mode="exact", q_norm_rope=(table, qw, EPS))


@pytest.mark.parametrize("seq,rot,table_dtype", [(8192, 96, torch.bfloat16), (37810, 96, torch.bfloat16),
                                                 (8192, 96, torch.float32), (5000, 128, torch.float32),
                                                 (5000, 90, torch.bfloat16)])
def test_the_fold_gives_the_pass_then_exact_bits(seq, rot, table_dtype):
    qkv, table, qw, kw = inputs(seq, rot, table_dtype, seed=seq + rot)
    a, b = qkv.clone(), qkv.clone()
    want, got = today(a, table, qw, kw), folded(b, table, qw, kw)
    diffs = operand_mismatches(got, want)
    assert {k: n for k, n in diffs.items() if n != 0} == {}, diffs
    assert torch.equal(views(b)[1], views(a)[1]), "K in memory differs"
    assert torch.equal(views(b)[0], views(qkv)[0]), "Q was written"
    assert torch.equal(views(b)[2], views(qkv)[2]), "V was written"


def test_the_fold_by_token_chunks_gives_the_whole_bits():
    seq, step = 37810, 8192
    qkv, table, qw, kw = inputs(seq, 96, torch.bfloat16, seed=3)
    want = today(qkv.clone(), table, qw, kw)
    buf = qkv.clone()
    q, k, v = views(buf)
    rows = sage2_quant.RowOperands(seq, HEADS, buf.device)
    for r in range(0, seq, step):
        qk_transform.norm_rope_pass(q[:, r:r + step], k[:, r:r + step], table[:, r:r + step], qw, kw, EPS,
                                    do_q=False)
        rows.add_q_rows(q[:, r:r + step], (table, qw, EPS))
    diffs = operand_mismatches(rows.finish(k, v), want)
    assert {k: n for k, n in diffs.items() if n != 0} == {}, diffs


def _ms(fn, reps=30, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def test_the_folds_time_beside_todays():
    seq = 37810
    qkv, table, qw, kw = inputs(seq, 96, torch.bfloat16, seed=5)
    q, k, v = views(qkv)  # the bits do not matter here: both run on the same buffer again and again
    kmean, _, vrecp = sage2_quant._reduce_impl(k, v, None, None, 0.0, False)
    args = (q, k, v, kmean, vrecp)
    ms = {
        "norm_rope q+k": _ms(lambda: qk_transform.norm_rope_pass(q, k, table, qw, kw, EPS)),
        "norm_rope k": _ms(lambda: qk_transform.norm_rope_pass(q, k, table, qw, kw, EPS, do_q=False)),
        "quantize exact": _ms(lambda: sage2_quant._quantize_impl(*args, None, None, None, None, 0.0, False, False)),
        "quantize exact, q formed": _ms(lambda: sage2_quant._quantize_impl(*args, qw, None, None, table, EPS, False,
                                                                           False)),
        "reduce exact": _ms(lambda: sage2_quant._reduce_impl(k, v, None, None, 0.0, False)),
    }
    row = {"seq": seq, "device": torch.cuda.get_device_name(), "p50_ms": ms,
           "today_ms": ms["norm_rope q+k"] + ms["quantize exact"],
           "folded_ms": ms["norm_rope k"] + ms["quantize exact, q formed"]}
    with open(os.path.join(os.environ.get("OUT", "."), "sage2_q_fold.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(row)
