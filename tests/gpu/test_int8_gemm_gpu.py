"""The pack's int8 GEMM (kernels/int8_gemm.py) against comfy-kitchen's CUTLASS int8 GEMM, which stock's int8
linears run, bit for bit: H3's four linears (qkv 5,376 -> 21,504, out 7,168 -> 5,376, fc1 5,376 -> 28,672, fc2
14,336 -> 5,376) at rows off the tiles, with and without a bias (where the epilogue's single rounding of
acc * scale + bias shows), a weight scale per column, row and weight slices as the block path takes them, and an
output past 2**31 elements (64-bit offsets). Its epilogue's torch reference (the CPU tests' oracle) is tied to
CUTLASS's output here too. Runs where the GEMM runs (``gemm_problem`` None: sm90); elsewhere it says why. Where the
warp-specialised Hopper kernel runs (kernels/int8_gemm_sm90.py), the tests above check it, and it is tied to the
portable kernel (the interpreter's twin) bit for bit at tile edges."""

from __future__ import annotations

import importlib

import pytest
import torch

from devkit.int8_oracle import gemm_epilogue

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, INNER, FFN = 5376, 7168, 14336
LINEARS = {"qkv": (HIDDEN, 3 * INNER), "out": (INNER, HIDDEN), "fc1": (HIDDEN, 2 * FFN), "fc2": (FFN, HIDDEN)}


@pytest.fixture(scope="module")
def mods(kitchen_pack):
    """(kernels.kitchen, kernels.int8_gemm, the GEMM chosen on this GPU, as the route chooses it once)."""
    kitchen = importlib.import_module(kitchen_pack.__name__ + ".kernels.kitchen")
    gemm = importlib.import_module(kitchen_pack.__name__ + ".kernels.int8_gemm")
    cuda, why = kitchen.kitchen_cuda()
    if cuda is None:
        pytest.skip(why)
    chosen = gemm.choice(torch.device("cuda"), HIDDEN)
    if chosen.kernel == "comfy_kitchen":
        pytest.skip(f"the pack's int8 GEMM does not run here: {chosen.reason}")
    return kitchen, gemm, chosen


def operands(m, k, n, seed, bias=False, per_column=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    xs = (torch.rand(m, 1, device="cuda", generator=g) * 0.05 + 1e-4).bfloat16().float()
    ws = (torch.rand(n, device="cuda", generator=g) * 1e-2) if per_column else torch.tensor(3.1e-3, device="cuda")
    b = (4 * torch.randn(n, device="cuda", generator=g)).bfloat16() if bias else None
    return xq, xs, w, ws, b


def differ(a, b) -> str:
    return f"{int((a != b).sum())} of {b.numel()} outputs differ"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("linear", list(LINEARS))
def test_gemm_gives_cutlass_bits_at_h3_widths(mods, linear, bias):
    kitchen, gemm, chosen = mods
    k, n = LINEARS[linear]
    for m in (3, 333, 4099):
        xq, xs, w, ws, b = operands(m, k, n, seed=m + k, bias=bias)
        got = gemm.int8_gemm(xq, xs, w, ws, b, kernel=chosen)
        want = kitchen.kitchen_gemm(xq, xs, w, ws, b, torch.bfloat16)
        assert want is not None and torch.equal(got, want), f"{linear} {m} rows, bias {bias}: {differ(got, want)}"


def test_reference_epilogue_gives_cutlass_bits(mods):
    """The CPU tests' oracle: the exact int32 product through ``gemm_epilogue`` equals CUTLASS's output, with
    a bias on millions of outputs (where one rounding against two shows a few times in 10 million)."""
    kitchen, _, _ = mods
    xq, xs, w, ws, b = operands(2048, HIDDEN, 3 * INNER, seed=7, bias=True)
    acc = torch._int_mm(xq, w.t())
    want = kitchen.kitchen_gemm(xq, xs, w, ws, b, torch.bfloat16)
    got = gemm_epilogue(acc, xs, ws, b)
    assert torch.equal(got, want), differ(got, want)
    twice = (acc.float() * xs * ws + b.float()).bfloat16()
    assert not torch.equal(twice, want), "the sample must tell one rounding from two"


def test_per_column_scale_and_slices(mods):
    kitchen, gemm, chosen = mods
    xq, xs, w, ws, _ = operands(1000, HIDDEN, 3 * INNER, seed=3, per_column=True)
    got, want = gemm.int8_gemm(xq, xs, w, ws, kernel=chosen), kitchen.kitchen_gemm(xq, xs, w, ws, None, torch.bfloat16)
    assert torch.equal(got, want), differ(got, want)
    rows, cols = slice(200, 777), slice(INNER, 3 * INNER)  # a token chunk, the K/V columns
    got = gemm.int8_gemm(xq[rows], xs[rows], w[cols], ws[cols], kernel=chosen)
    assert torch.equal(got, want[rows, cols]), differ(got, want[rows, cols])


def test_output_past_int32_offsets(mods):
    kitchen, gemm, chosen = mods
    m, k, n = 100_000, 64 * 16, 3 * INNER  # 2.15e9 outputs
    xq, xs, w, ws, _ = operands(m, k, n, seed=11)
    got = gemm.int8_gemm(xq, xs, w, ws, kernel=chosen)
    tail = slice(m - 300, m)
    want = kitchen.kitchen_gemm(xq[tail], xs[tail], w, ws, None, torch.bfloat16)
    assert torch.equal(got[tail], want), differ(got[tail], want)
    head = kitchen.kitchen_gemm(xq[:300], xs[:300], w, ws, None, torch.bfloat16)
    assert torch.equal(got[:300], head), differ(got[:300], head)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("per_column", [False, True])
def test_warp_specialised_kernel_gives_the_portable_kernels_bits(mods, bias, per_column):
    """M, N and K off the 128 x 256 x 64 tiles, one row, fewer tiles than SMs and many tiles a program."""
    _, gemm, chosen = mods
    if chosen.kernel != "pack_sm90":
        pytest.skip(f"the warp-specialised kernel does not run here: {chosen.reason}")
    for m, n, k in ((1, 136, 48), (5, 8, 16), (129, 264, 272), (777, 520, 1040), (4099, 5376, 7168),
                    (20000, 3 * INNER, HIDDEN)):
        xq, xs, w, ws, b = operands(m, k, n, seed=m + n + k, bias=bias, per_column=per_column)
        portable = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        gemm._launch_portable(xq, xs.reshape(m), w, ws.reshape(-1), b, portable, None, chosen)
        got = gemm.int8_gemm(xq, xs, w, ws, b, kernel=chosen)
        assert torch.equal(got, portable), f"{m}x{n}x{k}: {differ(got, portable)}"
    assert gemm.gpu.ANSWERS.reason("int8_gemm_sm90", "cuda") is None


@pytest.mark.parametrize("kernel", ["warp_specialised", "portable"])
def test_gated_residual_in_the_epilogue_gives_stocks_two_steps(mods, kernel):
    """out_proj's and fc2's product added to the residual in the epilogue: the bits of CUTLASS's output then stock's
    ``residual.addcmul_(product, gate)``, on a whole residual and on a token range of one (rows around it untouched,
    M off the tiles), with the warp-specialised kernel and the portable one."""
    kitchen, gemm, chosen = mods
    if kernel == "warp_specialised" and chosen.kernel != "pack_sm90":
        pytest.skip(f"the warp-specialised kernel does not run here: {chosen.reason}")
    chosen = chosen if kernel == "warp_specialised" else gemm.dataclasses.replace(chosen, kernel="pack")
    for linear in ("out", "fc2"):
        k, n = LINEARS[linear]
        xq, xs, w, ws, _ = operands(4099, k, n, seed=k + 1)
        g = torch.Generator(device="cuda").manual_seed(k)
        residual = torch.randn(5000, n, device="cuda", generator=g).bfloat16()
        gate = torch.randn(n, device="cuda", generator=g).bfloat16()
        product = kitchen.kitchen_gemm(xq, xs, w, ws, None, torch.bfloat16)
        want = residual.clone()
        want[300:4399].addcmul_(product, gate)
        got = residual.clone()
        added = gemm.int8_gemm(xq, xs, w, ws, residual=got[300:4399], gate=gate, kernel=chosen)
        assert added.data_ptr() == got[300].data_ptr()
        assert torch.equal(got, want), f"{linear} slice: {differ(got, want)}"
        whole = residual[:4099].clone()
        gemm.int8_gemm(xq, xs, w, ws, residual=whole, gate=gate, kernel=chosen)
        stock = residual[:4099].addcmul(product, gate)
        assert torch.equal(whole, stock), f"{linear} whole: {differ(whole, stock)}"
