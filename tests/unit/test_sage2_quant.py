"""The sage2 fast path's operand preparation on CPU.

The Triton kernels run under ``TRITON_INTERPRET=1`` in a subprocess (the flag must be set before
the kernels are decorated, and other tests in this process must keep compiled Triton), on small
shapes, and must equal the pure-PyTorch reference (kernels/sage2_quant_ref.py) bit for bit in
every mode. The rest runs here: the rotation is an orthogonal Hadamard matrix, bad inputs give
clear errors, the back-end says why the fast path is off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from comfyui_sage_strided_nhd.kernels import sage2_quant, sage2_quant_ref as ref
from comfyui_sage_strided_nhd.kernels.backends import BACKENDS

ROOT = Path(__file__).resolve().parents[2]

INTERPRETED_CHECKS = textwrap.dedent(r"""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from devkit.pack import import_pack
    import_pack()
    import torch
    import triton
    import triton.language as tl
    from comfyui_sage_strided_nhd.kernels import sage2_quant as sq, sage2_quant_ref as ref

    results = {"operands": {}, "fp8": None, "bf16": None, "compile": None}
    for seq, heads, seed in ((200, 2, 0), (129, 1, 1), (144, 1, 3)):
        g = torch.Generator().manual_seed(seed)
        qkv = torch.randn(seq, 3 * heads * 128, generator=g) * 1.5
        if seed == 3:  # the rotation's edge cases: outlier channels, rows from 2^-100 to 2^40, zero rows
            qkv[:, torch.randperm(3 * 128, generator=g)[:12]] *= 100
            qkv *= torch.exp2(torch.randint(-100, 40, (seq, 1), generator=g).float())
            qkv[5] = 0
            qkv[70:72] = 0
        qkv = qkv.to(torch.bfloat16)
        q, k, v = qkv.unflatten(1, (3, heads, 128)).unsqueeze(0).unbind(2)
        ang = torch.rand(seq, 48, generator=g, dtype=torch.float64) * 6.283
        c, s = ang.cos(), ang.sin()
        table = torch.stack([c, -s, s, c], -1).reshape(1, seq, 1, 48, 2, 2).float()
        qw = (1 + 0.3 * torch.randn(128, generator=g)).to(torch.bfloat16)
        kw = (1 + 0.3 * torch.randn(128, generator=g)).to(torch.bfloat16)
        for mode in ref.MODES:
            if seed == 3 and mode.startswith("fused"):
                continue  # rows under 2^-20 sit where RMSNorm's eps dominates: a rotation case, not a norm case
            extra = dict(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5) if mode.startswith("fused") else {}
            got = sq.quantize_operands(q, k, v, mode=mode, **extra)
            exp = ref.prepare_reference(q, k, v, mode=mode, **extra)
            diffs = {}
            for key, e in exp.items():
                a = got[key]
                if a.dtype == torch.float8_e4m3fn:
                    a, e = a.view(torch.uint8), e.view(torch.uint8)
                diffs[key] = int((a != e).sum()) if a.shape == e.shape else f"shape {list(a.shape)} vs {list(e.shape)}"
            results["operands"][f"{mode}/S={seq}/H={heads}"] = diffs

    @triton.jit
    def convert(X, Y8, Y16, N: tl.constexpr):
        i = tl.arange(0, N)
        x = tl.load(X + i)
        tl.store(Y8 + i, sq._e4m3(x, True))
        tl.store(Y16 + i, sq._round_like(x, tl.bfloat16, True))

    g = torch.Generator().manual_seed(2)
    grid = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2  # exact ties
    x = torch.cat([grid, mids, torch.randn(4096, generator=g) * 30, torch.randn(1024, generator=g) * 0.01,
                   torch.tensor([448.0, 449.0, 463.9, -448.5, 0.0, -0.0, 1e-30, -1e-30])])
    n = 1 << (x.numel() - 1).bit_length()
    x = torch.cat([x, torch.zeros(n - x.numel())]).contiguous()
    y8 = torch.empty(n, dtype=torch.float8_e4m3fn)
    y16 = torch.empty(n, dtype=torch.float32)
    convert[(1,)](x, y8, y16, N=n)
    expect8 = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    results["fp8"] = int((y8.view(torch.uint8) != expect8.view(torch.uint8)).sum())
    results["bf16"] = int((y16 != x.to(torch.bfloat16).float()).sum())

    # torch.compile traces the custom ops (dynamo, no inductor: fullgraph means no graph breaks).
    qkv = torch.randn(130, 3 * 128, generator=g).to(torch.bfloat16)
    q, k, v = qkv.unflatten(1, (3, 1, 128)).unsqueeze(0).unbind(2)
    def f(q, k, v):
        ops = sq.quantize_operands(q, k, v, mode="rotated")
        return ops["q_int8"], ops["k_scale"], ops["v_fp8"].view(torch.uint8)
    try:
        eager = f(q, k, v)
        traced = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
        results["compile"] = all(bool(torch.equal(a, b)) for a, b in zip(eager, traced))
    except Exception as exc:
        results["compile"] = f"{type(exc).__name__}: {exc}"
    print("RESULTS " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", INTERPRETED_CHECKS, str(ROOT)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.skipif(sage2_quant.TRITON_ERROR is not None, reason=sage2_quant.TRITON_ERROR or "")
@pytest.mark.parametrize("mode", ref.MODES)
def test_triton_kernels_match_the_reference_bit_for_bit(interpreted, mode):
    rows = {name: d for name, d in interpreted["operands"].items() if name.startswith(mode + "/")}
    assert rows, interpreted["operands"]
    bad = {name: {k: n for k, n in d.items() if n != 0} for name, d in rows.items()}
    assert not any(bad.values()), f"elements differing from the reference: {bad}"


@pytest.mark.skipif(sage2_quant.TRITON_ERROR is not None, reason=sage2_quant.TRITON_ERROR or "")
def test_interpreter_roundings_match_torch(interpreted):
    assert interpreted["fp8"] == 0, f"{interpreted['fp8']} fp8 conversions differ from torch's e4m3fn"
    assert interpreted["bf16"] == 0, f"{interpreted['bf16']} bf16 roundings differ from torch's"


@pytest.mark.skipif(sage2_quant.TRITON_ERROR is not None, reason=sage2_quant.TRITON_ERROR or "")
def test_torch_compile_traces_the_custom_ops_without_graph_breaks(interpreted):
    assert interpreted["compile"] is True, interpreted["compile"]


def sylvester(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_rotation_is_the_normalised_sylvester_hadamard_matrix():
    m = ref.hadamard_rows(torch.eye(128))  # row i = H e_i
    assert torch.allclose(m, sylvester(128) / 128**0.5, atol=1e-7, rtol=0)
    assert torch.allclose(m @ m.T, torch.eye(128), atol=1e-6, rtol=0)


def test_sylvester_matrix_is_the_recursive_construction():
    assert torch.equal(ref.sylvester_hadamard(128).float(), sylvester(128))


def test_fixed_point_rotation_error_is_below_its_bound(gen):
    # Truncation to 14 bits under s <= 2 absmax leaves < 2^-13 absmax per element; the rotation is
    # orthogonal, so a row's error norm stays below sqrt(128) 2^-13 absmax (+ the final fp32 rounding).
    x = torch.randn(300, 128, generator=gen, dtype=torch.float64)
    x[:, :5] *= 1000
    x *= torch.exp2(torch.randint(-90, 90, (300, 1), generator=gen).double())
    x[7] = 0
    x = x.float()
    exact = x.double() @ sylvester(128).double() / 128**0.5
    got = ref.hadamard_rows(x)
    err = (got.double() - exact).norm(dim=-1)
    bound = 128**0.5 * 2.0**-13 * x.double().abs().amax(-1) + 2.0**-23 * exact.norm(dim=-1)
    assert got.dtype == torch.float32 and torch.equal(got[7], torch.zeros(128))
    assert (err <= bound).all(), (err / bound).max()
    assert (err[bound > 0] / bound[bound > 0]).max() > 0.1  # the bound is near what truncation does


def test_rotation_preserves_scores_to_bf16_rounding(gen):
    q = torch.randn(64, 128, generator=gen).to(torch.bfloat16).float()
    k = torch.randn(96, 128, generator=gen).to(torch.bfloat16).float()
    k[:, :4] *= 50  # a few outlier channels
    scores = q @ k.T
    rotated = ref.hadamard_rows(q) @ ref.hadamard_rows(k).T
    assert ((rotated - scores).abs().max() / scores.abs().max()) < 2**-8


def test_rotation_spreads_outlier_channels(gen):
    k = torch.randn(256, 128, generator=gen)
    k[:, 3] *= 100
    ratio = lambda x: (x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean()  # noqa: E731
    assert ratio(ref.hadamard_rows(k)) < ratio(k) / 3


def test_reference_layout_round_trips_to_attention(gen):
    seq, heads = 200, 2
    qkv = torch.randn(seq, 3 * heads * 128, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.unflatten(1, (3, heads, 128)).unsqueeze(0).unbind(2)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2)).transpose(1, 2)
    for mode in ("exact", "rotated"):
        got = ref.dequant_attention_reference(ref.prepare_reference(q, k, v, mode=mode), 128**-0.5)
        err = (got - expect).norm() / expect.norm()
        assert err < 0.05, f"{mode}: relative error {err:.4f}"


def test_v_permutation_is_sageattentions():
    pos = ref.v_permutation(16).tolist()
    assert pos == [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]


def _views(seq=64, heads=2, head_dim=128, dtype=torch.bfloat16):
    qkv = torch.zeros(seq, 3 * heads * head_dim, dtype=dtype)
    return qkv.unflatten(1, (3, heads, head_dim)).unsqueeze(0).unbind(2)


@pytest.mark.parametrize("case, message", [
    ("head_dim", "head_dim must be 128"),
    ("batch", "batch size 1"),
    ("strides", "last dim must be contiguous"),
    ("shapes", "shapes differ"),
    ("dtype", "dtype must be bfloat16 or float16"),
    ("weights", "need q_weight, k_weight and eps"),
])
def test_bad_inputs_give_clear_errors(case, message):
    q, k, v = _views()
    kw = {}
    if case == "head_dim":
        q, k, v = _views(head_dim=64)
    elif case == "batch":
        q = k = v = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)
    elif case == "strides":
        q = torch.zeros(1, 64, 128, 2, dtype=torch.bfloat16).transpose(2, 3)
    elif case == "shapes":
        k = torch.zeros(1, 65, 2, 128, dtype=torch.bfloat16)
    elif case == "dtype":
        q, k, v = _views(dtype=torch.float32)
    elif case == "weights":
        kw = {"fused": True}
    with pytest.raises(ValueError, match=message):
        sage2_quant.check_inputs(q, k, v, **kw)


def test_unknown_mode_is_refused():
    q, k, v = _views()
    with pytest.raises(ValueError, match="unknown sage2 fast-path mode"):
        sage2_quant.quantize_operands(q, k, v, mode="fast")


def test_backend_fast_path_says_why_it_is_off_on_this_machine():
    q, k, v = _views()
    verdict = BACKENDS["sage2"].fast_path_verdict(q, k, v, layout="NHD")
    assert not verdict and verdict.reason


def test_prepare_fused_without_norm_parameters_is_refused():
    q, k, v = _views()
    with pytest.raises(ValueError, match="rope_table, q_weight"):
        BACKENDS["sage2"].prepare(q, k, v, mode="fused")


def test_head_chunks_keep_every_span_below_2_31():
    from comfyui_sage_strided_nhd.kernels.backends.sage2 import head_chunks
    for seq in (127, 37810, 210000, 320000, 1_000_000):
        chunks = head_chunks(seq, 56)
        assert chunks[0][0] == 0 and chunks[-1][1] == 56
        assert all(a1 == b0 for (_, a1), (b0, _) in zip(chunks, chunks[1:]))
        assert all((h1 - h0) * 128 * ref.padded_len(seq) < 2**31 for h0, h1 in chunks)
    assert len(head_chunks(210000, 56)) == 1 and len(head_chunks(320000, 56)) == 2
