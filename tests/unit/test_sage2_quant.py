"""The sage2 prepared path's operand preparation on CPU.

The Triton kernels run under ``TRITON_INTERPRET=1`` in a subprocess (the flag must be set before
the kernels are decorated, and other tests in this process must keep compiled Triton), on small
shapes, and must equal the pure-PyTorch oracle (devkit/sage2_oracle.py) bit for bit in every
mode, directly and through ``Sage2Backend.prepare``. The rest runs here: the rotation is an
orthogonal Hadamard matrix, bad inputs give clear errors with a reason code, the back-end says
why the prepared path is off and which mode its preparation runs.
"""

from __future__ import annotations

import re

import pytest
import torch

from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels import sage2_quant
from comfyui_sage_strided_nhd.kernels.backends import BACKENDS, sage2
from comfyui_sage_strided_nhd.kernels.backends.base import REASON_CODES
from devkit import sage2_oracle as ref
from devkit.interpreted import run_interpreted

INTERPRETED_CHECKS = r"""
    import os
    import weakref
    import triton
    import triton.language as tl
    from comfyui_sage_strided_nhd import kernels
    from comfyui_sage_strided_nhd.kernels import sage2_quant as sq
    from comfyui_sage_strided_nhd.kernels.backends.sage2 import Sage2Backend
    from devkit import sage2_oracle as ref

    differing = ref.operand_mismatches

    results = {"operands": {}, "rows": {}, "row_errors": [], "prepare": {}, "fp8": None, "bf16": None}
    # (300, 9): V's absmax over two row splits and two channel blocks, the second part-empty
    for seq, heads, seed in ((200, 2, 0), (129, 1, 1), (144, 1, 3), (300, 9, 4)):
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
        for mode in sq.MODES:
            got = sq.quantize_operands(q, k, v, mode=mode)
            exp = ref.prepare_reference(q, k, v, mode=mode)
            results["operands"][f"{mode}/S={seq}/H={heads}"] = differing(got, exp)
            # the same operands with Q handed over 128 rows at a time (K and V whole, after it)
            by_rows = sq.RowOperands(seq, heads, q.device, mode=mode)
            for a in range(0, seq, 128):
                by_rows.add_q_rows(q[:, a:a + 128])
            by_rows.add_k(k)
            by_rows.add_v(v)
            results["rows"][f"{mode}/S={seq}/H={heads}"] = differing(by_rows.operands(), got)
        if seed == 1:  # heads not adjacent in memory ([S, H, 3, D]): every pass takes the head stride
            g2 = torch.Generator().manual_seed(7)
            mixed = (torch.randn(seq, 2, 3, 128, generator=g2) * 1.5).to(torch.bfloat16)
            qm, km, vm = mixed.unsqueeze(0).unbind(3)
            results["operands"][f"exact/S={seq}/H=2/interleaved-heads"] = differing(
                sq.quantize_operands(qm, km, vm, mode="exact"), ref.prepare_reference(qm, km, vm, mode="exact"))
        if seed == 0:
            # Sage2Backend.prepare on normalised Q/K, and prepare_projected normalising the projection's
            # rows itself, by whole rows or by columns: the same operands
            whole = qkv.clone()
            wq, wk, wv = whole.unflatten(1, (3, heads, 128)).unsqueeze(0).unbind(2)
            wq, wk = kernels.qk_transform.norm_rope(wq, wk, table, qw, kw, 1e-5)
            inner = heads * 128
            k_refs, k_alive_at_v = [], []  # K's rows must be freed before V is projected

            def project_k(x):
                k = x[:, inner:2 * inner].clone()
                k_refs.append(weakref.ref(k))
                return k

            def project_v(x):
                k_alive_at_v.append(k_refs[-1]() is not None)
                return x[:, 2 * inner:].clone()

            columns = (lambda rows: rows[:, :inner].clone(), project_k, project_v)
            for mode in sq.MODES:
                want = sq.quantize_operands(wq, wk, wv, mode=mode)
                p = Sage2Backend().prepare(wq, wk, wv, mode=mode, scale=0.1)
                results["prepare"][f"{mode}/views"] = {
                    "mode": p.mode, "sm_scale": p.sm_scale, "out_dtype": str(p.out_dtype),
                    "geometry": [p.seq, p.heads, p.head_dim, [list(c) for c in p.head_chunks]],
                    "diffs": differing(p.operands, ref.prepare_reference(wq, wk, wv, mode=mode))}
                taken = []  # rows per projection call: the whole [S, 3*H*D] must never be asked for
                row_form = kernels.RowProjection(lambda rows: (taken.append(rows.shape[0]), rows.clone())[1],
                                                 qkv.clone())
                for how, projection in (("projected", row_form),
                                        ("columns", kernels.RowProjection(None, qkv.clone(), columns=columns))):
                    norm = kernels.QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)
                    # rows: 150 rounded down to 128; columns: Q chunks of 3x the rows, 3 * 50 = 150, the same
                    p = Sage2Backend().prepare_projected(
                        projection, None if how == "columns" else torch.empty(seq, 2 * inner, dtype=qkv.dtype),
                        heads=heads, mode=mode, norm=norm, chunk=150 if how == "projected" else 50)
                    results["prepare"][f"{mode}/{how}"] = {
                        "mode": p.mode, "chunks": p.projected_chunks, "applied": norm.applied,
                        "released": projection.released, "diffs": differing(p.operands, want)}
                results["prepare"][f"{mode}/columns"]["k_alive_at_v"] = k_alive_at_v[-1:]
                results["prepare"][f"{mode}/projected"]["rows_taken"] = taken

    # Q rows out of order, or K/V before every Q row: clear errors, nothing written past the buffers
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(300, 3 * 128, generator=g).to(torch.bfloat16)
    q, k, v = qkv.unflatten(1, (3, 1, 128)).unsqueeze(0).unbind(2)
    for steps in ((q[:, :100], q[:, 100:]), (q[:, :256],), (q[:, :256], q[:, 256:], q[:, :128])):
        by_rows = sq.RowOperands(300, 1, q.device)
        try:
            for part in steps:
                by_rows.add_q_rows(part)
            by_rows.add_k(k)
            by_rows.add_v(v)
            by_rows.operands()
            results["row_errors"].append("no error")
        except ValueError as exc:
            results["row_errors"].append(str(exc))

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
    report(results)
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(INTERPRETED_CHECKS)


def _no_differences(results: dict, mode: str, against: str) -> None:
    rows = {name: d for name, d in results.items() if name.startswith(mode + "/")}
    assert rows, results
    bad = {name: {k: n for k, n in d.items() if n != 0} for name, d in rows.items()}
    assert not any(bad.values()), f"elements differing from {against}: {bad}"


@pytest.mark.skipif(sage2_quant.TRITON_ERROR is not None, reason=sage2_quant.TRITON_ERROR or "")
@pytest.mark.parametrize("mode", sage2_quant.MODES)
def test_triton_kernels_match_the_reference_bit_for_bit(interpreted, mode):
    _no_differences(interpreted["operands"], mode, "the reference")


@pytest.mark.skipif(sage2_quant.TRITON_ERROR is not None, reason=sage2_quant.TRITON_ERROR or "")
@pytest.mark.parametrize("mode", sage2_quant.MODES)
def test_q_by_token_chunks_gives_the_whole_pass_bits(interpreted, mode):
    _no_differences(interpreted["rows"], mode, "the whole pass")


@pytest.mark.skipif(sage2_quant.TRITON_ERROR is not None, reason=sage2_quant.TRITON_ERROR or "")
def test_q_rows_out_of_place_are_refused(interpreted):
    misaligned, short, past_end = interpreted["row_errors"]
    assert "must start at a multiple of 128" in misaligned
    assert "256 of 300 rows" in short
    assert "must start at a multiple of 128 within 300 rows" in past_end, past_end


@pytest.mark.skipif(sage2_quant.TRITON_ERROR is not None, reason=sage2_quant.TRITON_ERROR or "")
def test_interpreter_roundings_match_torch(interpreted):
    assert interpreted["fp8"] == 0, f"{interpreted['fp8']} fp8 conversions differ from torch's e4m3fn"
    assert interpreted["bf16"] == 0, f"{interpreted['bf16']} bf16 roundings differ from torch's"


@pytest.mark.skipif(sage2_quant.TRITON_ERROR is not None, reason=sage2_quant.TRITON_ERROR or "")
@pytest.mark.parametrize("mode", sage2_quant.MODES)
def test_backend_prepare_gives_the_reference_operands(interpreted, mode):
    got = interpreted["prepare"][f"{mode}/views"]
    assert {k: n for k, n in got["diffs"].items() if n != 0} == {}, got["diffs"]
    assert got["mode"] == mode and got["sm_scale"] == 0.1 and got["geometry"] == [200, 2, 128, [[0, 2]]]
    assert got["out_dtype"] == "torch.bfloat16"


@pytest.mark.skipif(sage2_quant.TRITON_ERROR is not None, reason=sage2_quant.TRITON_ERROR or "")
@pytest.mark.parametrize("mode", sage2_quant.MODES)
@pytest.mark.parametrize("how", ["projected", "columns"])
def test_backend_prepare_projected_gives_prepare_bits_on_the_whole_projection(interpreted, mode, how):
    """By rows (K/V copied from each chunk) or by columns (K of every row first, Q by rows, then V)."""
    got = interpreted["prepare"][f"{mode}/{how}"]
    assert {k: n for k, n in got["diffs"].items() if n != 0} == {}, got["diffs"]
    assert (got["mode"], got["chunks"], got["applied"]) == (mode, 2, True)
    assert got.get("released", True)
    if how == "columns":  # K's bf16 rows were freed (its operand made) before V was projected
        assert got["k_alive_at_v"] == [False]
    if "rows_taken" in got:  # 200 tokens in chunks of 128: never the whole projection at once
        assert got["rows_taken"] == [128, 72], got["rows_taken"]


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


def test_the_modes_and_constants_are_the_kernel_modules():
    assert kernels.PREPARED_MODES is sage2_quant.MODES is ref.MODES
    assert sage2_quant.MODES == {"exact": False, "rotated": True}
    assert BACKENDS["sage2"].prepared_modes == tuple(sage2_quant.MODES)
    assert (ref.Q_BLOCK, ref.K_BLOCK, ref.FP8_MAX, ref.ROT_MIN_EXPONENT) == (
        sage2_quant.Q_BLOCK, sage2_quant.K_BLOCK, sage2_quant.FP8_MAX, sage2_quant.ROT_MIN_EXPONENT)
    assert ref.rotates is sage2_quant.rotates and ref.padded_len is sage2_quant.padded_len
    assert [sage2_quant.padded_len(n) for n in (1, 128, 129, 256)] == [128, 128, 256, 256]


@pytest.mark.parametrize("case, code, message", [
    ("head_dim", "shape", r"needs q, k, v of one shape \[1, S, H, 128\], got \[1, 64, 2, 64\]"),
    ("batch", "shape", r"of one shape \[1, S, H, 128\], got \[2, 64, 2, 128\]"),
    ("strides", "strides", "needs a contiguous last dim"),
    ("shapes", "shape", r"got \[1, 64, 2, 128\], \[1, 65, 2, 128\], \[1, 64, 2, 128\]"),
    ("empty", "shape", "empty sequence"),
    ("tensor", "shape", "q, k and v must be tensors"),
    ("dtype", "dtype", "needs bfloat16 q/k/v, got torch.float32/torch.float32/torch.float32"),
    ("float16", "dtype", "needs bfloat16 q/k/v, got torch.float16/torch.float16/torch.float16"),
    ("mixed", "dtype", "needs bfloat16 q/k/v, got torch.bfloat16/torch.float16/torch.bfloat16"),
])
def test_bad_inputs_give_a_reason_code_and_a_clear_error(case, code, message):
    q, k, v = _views()
    if case == "head_dim":
        q, k, v = _views(head_dim=64)
    elif case == "batch":
        q = k = v = torch.zeros(2, 64, 2, 128, dtype=torch.bfloat16)
    elif case == "strides":
        q = torch.zeros(1, 64, 128, 2, dtype=torch.bfloat16).transpose(2, 3)
    elif case == "shapes":
        k = torch.zeros(1, 65, 2, 128, dtype=torch.bfloat16)
    elif case == "empty":
        q, k, v = _views(seq=0)
    elif case == "tensor":
        k = k.tolist()
    elif case == "dtype":
        q, k, v = _views(dtype=torch.float32)
    elif case == "float16":
        q, k, v = _views(dtype=torch.float16)
    elif case == "mixed":
        k = k.half()
    problem = sage2_quant.operand_problem(q, k, v)
    assert problem is not None and problem[0] == code and problem[0] in REASON_CODES
    assert re.search(message, problem[1]), problem[1]
    with pytest.raises(ValueError, match="^sage2 preparation: " + re.escape(problem[1]) + "$"):
        sage2_quant.quantize_operands(q, k, v, mode="exact")


def test_views_of_one_fused_buffer_have_no_problem():
    assert sage2_quant.operand_problem(*_views()) is None
    assert sage2_quant.operand_problem(*_views(seq=1, heads=3)) is None


def test_unknown_mode_is_refused():
    q, k, v = _views()
    with pytest.raises(ValueError, match="unknown sage2 preparation mode 'fast'"):
        sage2_quant.quantize_operands(q, k, v, mode="fast")
    with pytest.raises(ValueError, match="unknown sage2 preparation mode 'fast'"):
        BACKENDS["sage2"].prepare(q, k, v, mode="fast")


def test_backend_prepared_path_says_why_it_is_off_on_this_machine():
    q, k, v = _views()
    verdict = BACKENDS["sage2"].prepared_verdict(q, k, v)
    assert not verdict and verdict.reason and verdict.code in REASON_CODES


@pytest.mark.parametrize("capability, got", [(None, "no CUDA device"), ((8, 9), "8.9"), ((10, 0), "10.0")])
def test_the_prepared_path_needs_sm90(capability, got, monkeypatch):
    asked = []
    monkeypatch.setattr(sage2.gpu, "capability", lambda device: asked.append(device) or capability)
    q, k, v = _views()
    verdict = sage2.Sage2Backend().prepared_verdict(q, k, v)
    assert asked == [q.device]  # q's own device, not the current one
    assert not verdict and verdict.code == "gpu_arch"
    assert verdict.reason == f"prepared path needs sm90 (H100/H200), got {got}"


def test_the_prepared_path_needs_cuda_tensors(monkeypatch):
    monkeypatch.setattr(sage2.gpu, "capability", lambda device: (9, 0))
    verdict = sage2.Sage2Backend().prepared_verdict(*_views())
    assert not verdict and verdict.code == "no_cuda" and verdict.reason == "prepared path needs CUDA tensors"


@pytest.mark.parametrize("mode", sage2_quant.MODES)
def test_prepare_quantises_the_views_it_is_given(mode, monkeypatch):
    """The call only (the passes themselves are checked bit for bit under the interpreter above)."""
    calls = []

    def quantize(q, k, v, *, mode):
        calls.append(mode)
        return {"q_int8": "ops"}

    monkeypatch.setattr(sage2.sage2_quant, "quantize_operands", quantize)
    q, k, v = _views(seq=300, heads=3)
    p = sage2.Sage2Backend().prepare(q, k, v, mode=mode, scale=None)
    assert calls == [mode]
    assert p.mode == mode and p.backend == "sage2" and p.operands == {"q_int8": "ops"}
    assert (p.seq, p.heads, p.head_dim, p.out_dtype) == (300, 3, 128, torch.bfloat16)
    assert p.sm_scale == 128**-0.5 and p.head_chunks == sage2.head_chunks(300, 3, 128)


def test_head_chunks_keep_every_span_below_2_31():
    head_chunks = sage2.head_chunks
    for seq in (127, 37810, 210000, 320000, 1_000_000):
        chunks = head_chunks(seq, 56)
        assert chunks[0][0] == 0 and chunks[-1][1] == 56
        assert all(a1 == b0 for (_, a1), (b0, _) in zip(chunks, chunks[1:]))
        assert all((h1 - h0) * 128 * sage2_quant.padded_len(seq) < 2**31 for h0, h1 in chunks)
    assert len(head_chunks(210000, 56)) == 1 and len(head_chunks(320000, 56)) == 2


def test_long_sequences_launch_the_kernel_by_groups_of_heads_within_each_chunk():
    """From LAUNCH_SPLIT_TOKENS tokens each launch takes at most LAUNCH_HEADS heads (H3's 56: 4 x 14), every head
    once, in order, never across an int32 chunk; shorter sequences launch each chunk whole."""
    launches, head_chunks = sage2.launches, sage2.head_chunks
    assert launches(head_chunks(8192, 56), 8192) == [(0, 56)]
    assert launches(head_chunks(37809, 56), 37809) == [(0, 56)]
    assert launches(head_chunks(149936, 56), 149936) == [(0, 14), (14, 28), (28, 42), (42, 56)]
    chunks = head_chunks(320000, 56)  # two int32 chunks of 28 heads
    assert launches(chunks, 320000) == [(0, 14), (14, 28), (28, 42), (42, 56)]
    assert launches(((0, 20), (20, 40)), 200000) == [(0, 14), (14, 20), (20, 34), (34, 40)]


def test_when_the_passes_raise_after_a_module_norm_the_plain_call_still_gets_normalised_q_and_k(monkeypatch, gen):
    """The real back-end's policy in a chain on CPU: prepared path 'available', passes failing, plain call spied."""
    backend = sage2.Sage2Backend()
    seen = {}

    def plain(q, k, v, *, tensor_layout, is_causal, sm_scale):  # sageattn's keywords
        assert tensor_layout == "NHD" and not is_causal
        seen["q"], seen["k"] = q.clone(), k.clone()
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=sm_scale).transpose(1, 2)

    def failing(*a, **kw):
        raise RuntimeError("passes failed in this test")

    monkeypatch.setattr(backend, "_check_available", lambda: sage2.YES)
    monkeypatch.setattr(backend, "needs_cuda", False)
    monkeypatch.setattr(backend, "prepared_verdict", lambda q, k, v: sage2.YES)
    monkeypatch.setattr(backend, "_sageattn", plain, raising=False)
    monkeypatch.setattr(sage2.sage2_quant, "quantize_operands", failing)
    qkv = torch.randn(40, 3 * 128, generator=gen).to(torch.bfloat16)
    q, k, _ = kernels.dataflow.split_fused_qkv(qkv.clone(), 1, 128)
    norm = kernels.QKNorm(q_norm=lambda x: x * 2, k_norm=lambda x: x * 4)
    _, rec = kernels.attention_from_fused_qkv(qkv, 1, 128, chain=kernels.BackendChain("sage2", (backend,)), norm=norm,
                                              prepared_mode="exact")
    assert rec.backend == "sage2" and rec.prepared_skipped.code == "raised"
    assert torch.equal(seen["q"], q * 2) and torch.equal(seen["k"], k * 4)
