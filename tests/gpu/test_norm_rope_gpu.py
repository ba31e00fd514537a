"""The pack's RMSNorm + split-half RoPE pass against comfy-kitchen's CUDA kernel, which stock H3 runs:
the same bits on H3's Q/K views (56 x 128 heads, rotation of the first 96 dims, bf16 table and
weights) at 8,192 and 37,810 tokens, with an fp32 table, and past 2**31 elements of the qkv buffer
(64-bit offsets). Also that ``kernels.norm_rope`` takes the pass exactly where comfy-kitchen picks
CUDA, and the pass's time beside comfy-kitchen's (printed, not asserted). Needs CUDA and
comfy-kitchen with its CUDA implementation."""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, HEAD_DIM, ROT = 56, 128, 96


@pytest.fixture(scope="module")
def pack(kitchen_pack):
    return kitchen_pack


def h3_inputs(seq, table_dtype=torch.bfloat16, seed=0):
    from devkit.rope import make_rope_table

    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = (3 * torch.randn(seq, 3 * HEADS * HEAD_DIM, generator=g, device="cuda")).bfloat16()
    table = make_rope_table(seq, ROT, dtype=table_dtype, device="cuda")
    qw = (1 + 0.3 * torch.randn(HEAD_DIM, generator=g, device="cuda")).bfloat16()
    kw = (1 + 0.3 * torch.randn(HEAD_DIM, generator=g, device="cuda")).bfloat16()
    return qkv, table, qw, kw


def views(qkv, seq):
    return [t.view(1, seq, HEADS, HEAD_DIM) for t in qkv.split(HEADS * HEAD_DIM, dim=-1)][:2]


def order_diagnosis(before, table, w, got):
    """On a mismatch: how far comfy-kitchen's output is from its steps emulated in fp64 with either
    contraction of the rotation (which one its compiler chose)."""
    from devkit.rope import kitchen_cuda_norm_rope

    counts = {first: int((kitchen_cuda_norm_rope(before, table, w, 1e-5, reciprocal_sqrt=torch.rsqrt,
                                                 fuse_first=first) != got).sum()) for first in (True, False)}
    return f"emulated steps differ from comfy-kitchen's in {counts[True]} (fma(f00, a, f01*b)) / {counts[False]} " \
           "(fma(f01, b, f00*a)) elements"


@pytest.mark.parametrize("seq,table_dtype", [(8192, torch.bfloat16), (37810, torch.bfloat16), (8192, torch.float32)])
def test_pass_gives_comfy_kitchens_cuda_bits(pack, seq, table_dtype):
    import comfy_kitchen as ck

    qkv, table, qw, kw = h3_inputs(seq, table_dtype)
    mine = qkv.clone()
    q, k = views(qkv, seq)
    assert pack.kernels.qk_transform.kitchen_backend(q, k, table, qw, kw, 1e-5, ROT) == "cuda"
    before = q.clone()
    ck.rms_rope_split_half_(q, k, table, qw, kw, epsilon=1e-5, rot_dim=ROT)
    mq, mk = views(mine, seq)
    pack.kernels.qk_transform.norm_rope_pass(mq, mk, table, qw, kw, 1e-5)
    differ = int((mine != qkv).sum())
    assert differ == 0, f"{differ} elements differ from comfy-kitchen's; " + order_diagnosis(before, table, qw, q)


def test_norm_rope_takes_the_pass_where_comfy_kitchen_picks_cuda(pack, monkeypatch):
    qkv, table, qw, kw = h3_inputs(256)
    q, k = views(qkv, 256)
    ran = []
    real = pack.kernels.qk_transform.norm_rope_pass
    monkeypatch.setattr(pack.kernels.qk_transform, "norm_rope_pass", lambda *a: ran.append(1) or real(*a))
    pack.kernels.qk_transform.norm_rope(q, k, table, qw, kw, 1e-5)
    assert ran == [1]
    pack.kernels.qk_transform.norm_rope(q.half(), k.half(), table, qw, kw, 1e-5)  # fp16: comfy-kitchen's own kernel
    assert ran == [1]


def test_pass_past_2_31_elements_gives_comfy_kitchens_bits(pack):
    """320,000 tokens: the qkv buffer holds 4.9e9 elements; compared on the first and last 4,096 rows."""
    import comfy_kitchen as ck

    seq = 320_000
    qkv, table, qw, kw = h3_inputs(seq, seed=3)
    mine = qkv.clone()
    ck.rms_rope_split_half_(*views(qkv, seq), table, qw, kw, epsilon=1e-5, rot_dim=ROT)
    pack.kernels.qk_transform.norm_rope_pass(*views(mine, seq), table, qw, kw, 1e-5)
    for rows in (slice(0, 4096), slice(seq - 4096, seq)):
        assert torch.equal(mine[rows], qkv[rows]), f"rows {rows} differ"
    assert torch.equal(mine, qkv)


def test_pass_time_beside_comfy_kitchens(pack):
    import comfy_kitchen as ck

    seq = 37810
    qkv, table, qw, kw = h3_inputs(seq)
    q, k = views(qkv, seq)
    runs = {"comfy-kitchen": lambda: ck.rms_rope_split_half_(q, k, table, qw, kw, epsilon=1e-5, rot_dim=ROT),
            "pack": lambda: pack.kernels.qk_transform.norm_rope_pass(q, k, table, qw, kw, 1e-5)}
    times = {n: [] for n in runs}
    for rep in range(12):
        for name, fn in runs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if rep >= 2:
                times[name].append(start.elapsed_time(end))
    p50 = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    print(f"norm+rope at {seq} tokens, p50 ms: " + ", ".join(f"{n} {v:.3f}" for n, v in p50.items())
          + f"; comfy-kitchen / pack {p50['comfy-kitchen'] / p50['pack']:.2f}x")
    assert all(v > 0 for v in p50.values())
