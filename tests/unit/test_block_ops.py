"""The block fast path's elementwise pass (kernels/h3_block.py) on the CPU.

``scale_shift_`` and ``gated_residual_`` run their Triton kernels under ``TRITON_INTERPRET=1`` in a subprocess (the flag must
be set before the kernel is decorated) and must equal stock's two in-place passes
(``h.mul_(scale1).add_(shift)``, ``x.addcmul_(other, gate)``) bit for bit, on row blocks that are views of a larger tensor, with
ragged edges, in bf16. Other dtypes and non-row-major inputs take stock's passes themselves.
"""

from __future__ import annotations

import pytest
import torch

from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels import h3_block
from devkit.interpreted import run_interpreted

INTERPRETED = r"""
    from comfyui_sage_strided_nhd.kernels import h3_block
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.bfloat16,):
        for rows, cols in ((5, 1030), (9, 64), (1, 3000)):
            full = (torch.randn(rows + 6, cols, generator=g) * 4).to(dtype)
            scale1 = (1.0 + torch.randn(cols, generator=g).to(dtype))
            shift = torch.randn(cols, generator=g).to(dtype)
            want = full.clone()
            want[3:3 + rows].mul_(scale1).add_(shift)
            got = full.clone()
            assert h3_block.fusable(got[3:3 + rows])
            h3_block.scale_shift_(got[3:3 + rows], scale1, shift)
            out[f"{dtype}-{rows}x{cols}"] = [bool(torch.equal(got, want)), int((got != want).sum())]
            # one parameter row per token (current ComfyUI under a partial denoise mask)
            table = (1.0 + torch.randn(3, cols, generator=g)).to(dtype), torch.randn(3, cols, generator=g).to(dtype)
            index = torch.randint(0, 3, (rows,), generator=g)
            want, got = full.clone(), full.clone()
            want[3:3 + rows].mul_(table[0][index]).add_(table[1][index])
            h3_block.scale_shift_(got[3:3 + rows], table[0][index], table[1][index])
            out[f"{dtype}-{rows}x{cols}-per-token"] = [bool(torch.equal(got, want)), int((got != want).sum())]
    # the gated residual: stock's x.addcmul_(other, gate), one gate row or one per token, on row views
    for rows, cols in ((5, 1030), (1, 3000)):
        full = (torch.randn(rows + 6, cols, generator=g) * 4).bfloat16()
        other = (torch.randn(rows + 2, cols, generator=g) * 3).bfloat16()[1:1 + rows]
        for kind, gate in (("row", torch.randn(cols, generator=g).bfloat16()),
                           ("per-token", torch.randn(rows, cols, generator=g).bfloat16())):
            want, got = full.clone(), full.clone()
            want[3:3 + rows].addcmul_(other, gate)
            h3_block.gated_residual_(got[3:3 + rows], other, gate)
            out[f"residual-{rows}x{cols}-{kind}"] = [bool(torch.equal(got, want)), int((got != want).sum())]
    # NaN and infinity pass through as stock's passes pass them (the integer rounding step would turn
    # the GPU's NaN, 0x7FFFFFFF, into -0.0)
    def same(a, b):
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    full = (torch.randn(4, 64, generator=g) * 4).bfloat16()
    nan = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32).bfloat16()  # NaN as the GPU makes it
    full[0, 3], full[1, 5], full[2, 7] = nan, float("inf"), float("-inf")
    scale1, shift = (1.0 + torch.randn(64, generator=g)).bfloat16(), torch.randn(64, generator=g).bfloat16()
    got = full.clone()
    h3_block.scale_shift_(got, scale1, shift)
    nonfinite = {"scale_shift": same(got, full.clone().mul_(scale1).add_(shift))}
    other, gate = torch.randn(4, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    got = full.clone()
    h3_block.gated_residual_(got, other, gate)
    nonfinite["residual"] = same(got, full.clone().addcmul_(other, gate))
    u = torch.cat([full, full], dim=1)
    nonfinite["swiglu"] = same(h3_block.swiglu(u).isnan(), torch.nn.functional.silu(full).mul_(full).isnan())
    # the rounding helper's integer form (the interpreter's; a GPU of compute capability 8.0 or later takes
    # its conversion instruction, tests/gpu) on fp32 NaNs as a GPU makes them (0x7FFFFFFF) and others
    import triton
    import triton.language as tl
    from comfyui_sage_strided_nhd.kernels.triton_support import round_bf16

    @triton.jit
    def rounded(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, round_bf16(tl.load(X + i), False))

    bits = torch.tensor([0x7FFFFFFF, 0x7F800001, 0xFFFFFFFF - 2**32, 0x7FC00000, 0x7F800000, 0x3F808000, 0x3F818000,
                         0x477FF000, 0x7F7FFFFF], dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits, torch.zeros(16 - bits.numel(), dtype=torch.int32)]).view(torch.float32)
    y = torch.empty_like(x)
    rounded[(1,)](x, y, N=16)
    nonfinite["round_bf16"] = same(y, x.bfloat16().float())
    out["nonfinite"] = nonfinite
    # SwiGLU in one pass: stock's two roundings (silu, then the product), on a strided fc1 output view.
    # The interpreter has no libdevice: its exp is numpy's, so the reference takes numpy's exp too
    # (the GPU test checks torch's CUDA bits).
    import numpy as np
    for rows, cols in ((7, 2 * 1030), (1, 2 * 64)):
        u = (torch.randn(rows, cols + 6, generator=g) * 4).bfloat16()[:, 3:3 + cols]
        gate, up = u.float().chunk(2, dim=-1)
        silu = torch.from_numpy(gate.numpy() / (np.float32(1) + np.exp(-gate.numpy()))).bfloat16()
        want = (silu.float() * up).bfloat16()
        got = h3_block.swiglu(u)
        stock = torch.nn.functional.silu(u.chunk(2, dim=-1)[0]).mul_(u.chunk(2, dim=-1)[1])
        out[f"swiglu-{rows}x{cols}"] = [bool(torch.equal(got, want)), int((got != want).sum()),
                                        int((got != stock).sum())]
    report(out)
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(INTERPRETED)


def test_nan_and_infinity_pass_through_as_in_stocks_passes(interpreted):
    assert interpreted["nonfinite"] == {"scale_shift": True, "residual": True, "swiglu": True, "round_bf16": True}


def test_scale_shift_kernel_gives_stock_bits(interpreted):
    cases = {k: v for k, v in interpreted.items() if not k.startswith(("swiglu", "residual", "nonfinite"))}
    assert len(cases) == 6
    for case, (equal, differing) in cases.items():
        assert equal, f"{case}: {differing} elements differ from h.mul_(scale1).add_(shift)"


def test_gated_residual_kernel_gives_stock_bits(interpreted):
    cases = {k: v for k, v in interpreted.items() if k.startswith("residual")}
    assert len(cases) == 4
    for case, (equal, differing) in cases.items():
        assert equal, f"{case}: {differing} elements differ from x.addcmul_(other, gate)"


def test_gated_residual_inputs_the_kernel_does_not_take_get_stocks_addcmul(gen):
    x = torch.randn(4, 8, generator=gen).bfloat16()
    other = torch.randn(4, 8, generator=gen).bfloat16()
    for gate in (torch.randn(8, generator=gen),                    # fp32 gate: torch promotes
                 torch.randn(8, generator=gen).bfloat16()):        # on the CPU outside the interpreter
        want = x.clone().addcmul_(other, gate)
        assert torch.equal(h3_block.gated_residual_(x.clone(), other, gate), want)
    with pytest.raises(ValueError, match="modulation parameters"):
        h3_block.gated_residual_(x.clone(), other, torch.randn(3, 8, generator=gen).bfloat16())


def test_swiglu_kernel_takes_stocks_steps(interpreted):
    cases = {k: v for k, v in interpreted.items() if k.startswith("swiglu")}
    assert len(cases) == 2
    for case, (equal, differing, from_torch_cpu) in cases.items():
        assert equal, f"{case}: {differing} elements differ from silu rounded to bf16, times up, rounded"
        print(f"{case}: {from_torch_cpu} elements differ from torch's CPU silu (its own exp)")


def test_swiglu_inputs_the_kernel_does_not_take_get_stocks_expression(gen):
    for u in (torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen).half(),
              torch.randn(8, 4, generator=gen).bfloat16().t()):  # fp32, fp16, rows not contiguous
        gate, up = u.chunk(2, dim=-1)
        assert torch.equal(h3_block.swiglu(u), torch.nn.functional.silu(gate).mul_(up))
    with pytest.raises(RuntimeError):  # an odd width has no halves: stock's expression raises, so does this
        h3_block.swiglu(torch.randn(4, 7, generator=gen).bfloat16())


def test_inputs_the_kernel_does_not_take_get_stocks_passes(gen):
    for h in (torch.randn(4, 8, generator=gen),                       # fp32: an FMA would change the bits
              torch.randn(4, 8, generator=gen).half(),
              torch.randn(8, 4, generator=gen).bfloat16().t()):      # rows not contiguous
        assert not h3_block.fusable(h)
        scale1, shift = torch.randn(h.shape[1], generator=gen).to(h.dtype), torch.randn(h.shape[1]).to(h.dtype)
        want = h.clone().mul_(scale1).add_(shift)
        assert torch.equal(h3_block.scale_shift_(h, scale1, shift), want)


def test_token_chunks_and_clipped_segments():
    assert kernels.token_chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert kernels.token_chunks(4, 8) == [(0, 4)]
    assert kernels.token_chunks(37810, 8192) == [(a, min(a + 7616, 37810)) for a in range(0, 37810, 7616)]
    assert kernels.token_chunks(16384, 8192) == [(0, 8192), (8192, 16384)]
    assert kernels.token_chunks(200, 128, align=128) == [(0, 128), (128, 200)]  # chunk starts stay aligned
    assert kernels.token_chunks(37810, 8192, align=128) == [(a, min(a + 7680, 37810)) for a in range(0, 37810, 7680)]
    with pytest.raises(ValueError, match="positive"):
        kernels.token_chunks(4, 0)
    segments = [(0, 3, 1), (3, 9, 2), (9, 10, 0)]
    assert h3_block.clip_segments(segments, 4, 8) == [(0, 4, 2)]
    assert h3_block.clip_segments(segments, 8, 10) == [(0, 1, 2), (1, 2, 0)]
    assert h3_block.clip_segments(segments, 0, 4) == [(0, 3, 1), (3, 4, 2)]
    per_token = torch.arange(10, 16)  # a segment whose rows each have their own modulation row
    clipped = h3_block.clip_segments([(0, 3, 1), (3, 9, per_token), (9, 10, 0)], 5, 10)
    assert [(a, b) for a, b, _ in clipped] == [(0, 4), (4, 5)] and clipped[1][2] == 0
    assert torch.equal(clipped[0][2], per_token[2:])


def test_modulation_rows_of_another_shape_are_refused(gen):
    h = torch.randn(4, 8, generator=gen).bfloat16()
    for scale1 in (torch.ones(3, 8), torch.ones(8, 4), torch.ones(1, 8)):
        with pytest.raises(ValueError, match="rows, cols"):
            h3_block.scale_shift_(h, scale1.bfloat16(), torch.zeros_like(scale1).bfloat16())


def test_a_pending_modulation_is_applied_once(gen):
    """Rows handed on with the modulation owed: ``apply`` gives stock's passes per segment, once however
    often it is asked (a consumer that falls back after another one could otherwise modulate twice)."""
    rows = torch.randn(7, 16, generator=gen).bfloat16()
    segments = [(0, 3, torch.randn(16, generator=gen).bfloat16(), torch.randn(16, generator=gen).bfloat16()),
                (3, 7, torch.randn(4, 16, generator=gen).bfloat16(), torch.randn(4, 16, generator=gen).bfloat16())]
    want = rows.clone()
    for a, b, scale1, shift in segments:
        want[a:b].mul_(scale1).add_(shift)
    pending = h3_block.PendingModulation(rows.clone(), segments)
    assert pending.foldable  # its segments tile the rows in order
    assert not h3_block.PendingModulation(rows, segments[1:]).foldable  # rows 0..2 owe nothing: a gap
    assert h3_block.settled(pending) is pending.rows and torch.equal(pending.rows, want)
    assert torch.equal(pending.apply(), want) and pending.applied and not pending.foldable
    assert h3_block.settled(want) is want  # a tensor as it is


def test_a_pending_residual_folds_only_one_gate_row_a_segment_and_is_added_once(gen):
    """A residual owed to a linear's output: foldable into a GEMM's epilogue only where each segment has one gate
    row of the residual's dtype and the segments tile its rows; ``apply`` gives stock's ``addcmul_`` per segment,
    and a second add is an error (it would change the output silently)."""
    x = torch.randn(7, 16, generator=gen).bfloat16()
    y = torch.randn(7, 16, generator=gen).bfloat16()
    rows = [(0, 3, torch.randn(16, generator=gen).bfloat16()), (3, 7, torch.randn(16, generator=gen).bfloat16())]
    assert h3_block.PendingResidual(x, rows).foldable
    assert not h3_block.PendingResidual(x, rows[1:]).foldable  # a gap
    per_token = [(0, 3, rows[0][2]), (3, 7, torch.randn(4, 16, generator=gen).bfloat16())]
    assert not h3_block.PendingResidual(x, per_token).foldable
    assert not h3_block.PendingResidual(x, [(a, b, g.float()) for a, b, g in rows]).foldable  # a wider gate
    want = x.clone()
    for a, b, gate in per_token:
        want[a:b].addcmul_(y[a:b], gate)
    pending = h3_block.PendingResidual(x.clone(), per_token)
    assert pending.apply(y) is pending.x and torch.equal(pending.x, want) and pending.applied
    with pytest.raises(RuntimeError, match="added twice"):
        pending.apply(y)
