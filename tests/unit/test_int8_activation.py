"""The pack's int8 ConvRot activation quantiser (kernels/int8_activation.py) and the route that feeds
comfy-kitchen's int8 GEMM with it (kernels/int8_linear.py), on the CPU.

The kernel runs under ``TRITON_INTERPRET=1`` in a subprocess and must equal, bit for bit, the steps of
comfy-kitchen's CUDA ``quantize_int8_rowwise_convrot64`` written in torch (devkit/int8_oracle.py),
with and without the folded SwiGLU, on row slices of a wider buffer, with all-zero and outlier rows
and widths whose group count is no power of two. The oracle's rotation is tied to comfy-kitchen's
own definition (its eager Hadamard product). The GPU test compares the compiled kernel with
comfy-kitchen's CUDA kernel."""

from __future__ import annotations

import pytest
import torch

from devkit.interpreted import run_interpreted
from devkit.pack import submodule

INTERPRETED = r"""
    from comfyui_sage_strided_nhd.kernels import int8_activation
    from devkit import int8_oracle
    g = torch.Generator().manual_seed(0)
    out = {}
    # group counts: 1, 5 = 4 + 1, 15 = 8 + 4 + (3 padded to 4), 21 = 16 + 4 + 1 (H3's hidden 5,376),
    # 3, 8, 7 = 4 + 2 + 1; and many rows of few groups: many scales, each the exact max of its row
    for rows, width, act in ((5, 256, None), (3, 1280, None), (2, 3840, None), (2, 5376, None), (4, 768, "swiglu"),
                             (2, 2048, "swiglu"), (2, 1792, "swiglu"), (512, 256, None), (256, 512, "swiglu")):
        cols = width * (2 if act else 1)
        buf = (3 * torch.randn(rows, cols + 64, generator=g)).bfloat16()
        x = buf[:, 32:32 + cols]  # rows with a stride wider than the row
        x[0] = 0                    # an all-zero row: scale 1e-30, every value 0
        x[1, :5] = torch.tensor([300.0, -300.0, 1e-3, -1e4, 2.5]).bfloat16()  # outliers
        q, s = int8_activation.quantize_rows(x, act)
        want_q, want_s = int8_oracle.quantize_rows_convrot(x, act)
        out[f"{rows}x{width} {act}"] = [int((q != want_q).sum()), int((s != want_s).sum()), list(q.shape),
                                       list(s.shape), int(q[0].abs().sum()), int(q.abs().max())]
    # the block's modulation folded in, per segment of rows (one parameter row, or one a row): stock's mul_ and
    # add_ (two bf16 roundings), then the quantiser
    modulated = {}
    for rows, width, cut in ((6, 1280, 2), (5, 768, 4)):
        x = (3 * torch.randn(rows, width, generator=g)).bfloat16()
        params = lambda *shape: [(1 + 0.5 * torch.randn(*shape, generator=g)).bfloat16(),
                                 (0.5 * torch.randn(*shape, generator=g)).bfloat16()]
        segments = [(0, cut, *params(width)), (cut, rows, *params(rows - cut, width))]
        q, s = int8_activation.quantize_rows(x, modulation=segments)
        y = x.clone()
        for a, b, scale1, shift in segments:
            y[a:b].mul_(scale1).add_(shift)
        want_q, want_s = int8_oracle.quantize_rows_convrot(y)
        modulated[f"{rows}x{width} cut at {cut}"] = [int((q != want_q).sum()), int((s != want_s).sum())]
    report({"plain": out, "modulated": modulated})
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(INTERPRETED)


def test_quantiser_takes_comfy_kitchens_cuda_steps(interpreted):
    assert len(interpreted["plain"]) == 9
    for case, (q_differ, s_differ, q_shape, s_shape, zero_row, largest) in interpreted["plain"].items():
        assert (q_differ, s_differ) == (0, 0), f"{case}: {q_differ} values and {s_differ} scales differ"
        rows, width = (int(n) for n in case.split()[0].split("x"))
        assert q_shape == [rows, width] and s_shape == [rows, 1]
        assert zero_row == 0 and largest == 127, case  # each row's absmax maps to 127


def test_quantiser_applies_the_blocks_modulation_with_stocks_bits(interpreted):
    """Stock's ``mul_(1 + scale).add_(shift)`` inside the pass, per segment of rows (one parameter row, or one per
    row), as the route folds a block's modulation."""
    assert len(interpreted["modulated"]) == 2
    for case, (q_differ, s_differ) in interpreted["modulated"].items():
        assert (q_differ, s_differ) == (0, 0), case


def test_rows_split_into_power_of_two_tiles():
    ia = submodule("kernels.int8_activation")
    assert ia.row_tiles(1) == (1, 0, 0) and ia.row_tiles(20) == (16, 4, 0) and ia.row_tiles(21) == (16, 4, 1)
    assert ia.row_tiles(28) == (16, 8, 4) and ia.row_tiles(56) == (32, 16, 8) and ia.row_tiles(15) == (8, 4, 4)
    for groups in range(1, 65):
        tiles = ia.row_tiles(groups)
        assert groups <= sum(tiles) < groups + max(tiles[2], 1) and all(t & (t - 1) == 0 for t in tiles)
    assert (ia.row_warps(5376), ia.row_warps(7168), ia.row_warps(14336), ia.row_warps(16384)) == (2, 2, 4, 8)


def test_quantiser_declines_what_it_was_not_written_for():
    ia = submodule("kernels.int8_activation")
    x = torch.zeros(4, 512, dtype=torch.bfloat16)
    assert not ia.quantize_takes(x)  # a CPU tensor outside the interpreter
    with pytest.raises(ValueError, match="cannot take"):
        ia.quantize_rows(x)
    if not ia.interpreting():
        return
    assert not ia.quantize_takes(x.half()) and not ia.quantize_takes(x[:, :300])
    assert not ia.quantize_takes(torch.zeros(2, 2 * 16640, dtype=torch.bfloat16), "swiglu")  # past 16,384


def test_route_says_why_it_keeps_stocks_call():
    route = submodule("kernels.int8_linear")
    x = torch.zeros(16, 512, dtype=torch.bfloat16)
    w = torch.zeros(32, 512, dtype=torch.int8)
    assert route.int8_call_problem(x) == "not on a CUDA device"
    why = route.routed_or_reason(x, w, torch.ones(()), None)  # the route itself, asked anyway: it declines
    assert isinstance(why, str) and why.startswith("the pack's quantiser does not take")
