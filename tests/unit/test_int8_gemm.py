"""The pack's int8 GEMM (kernels/int8_gemm.py) on the CPU.

The kernel runs under ``TRITON_INTERPRET=1`` in a subprocess with the interpreter's small tiles, and must equal,
bit for bit, the exact int32 product taken through the epilogue's steps in torch (devkit/int8_oracle.py's
``gemm_epilogue``: the fp32 scale product, one rounding of acc * scale + bias, then bf16; the GPU test ties those
steps to comfy-kitchen's CUTLASS output). Edges: M, N and K off the tiles, one row, an empty segment, a weight scale
per column, a bias, row and weight slices of larger buffers (as the block path's row chunks and Q/KV column blocks
take them), sums near int32's reach where fp32 rounds the accumulator, and the gated residual added in the epilogue
(stock's ``addcmul_`` of the product: the same bits, rows outside a residual slice untouched)."""

from __future__ import annotations

import pytest
import torch

from devkit.int8_oracle import gemm_epilogue
from devkit.interpreted import run_interpreted
from devkit.pack import submodule

INTERPRETED = r"""
    from comfyui_sage_strided_nhd.kernels import int8_gemm
    from devkit.int8_oracle import gemm_epilogue
    g = torch.Generator().manual_seed(0)
    out = {}
    kernel = int8_gemm.choice("cpu")  # the portable kernel, the interpreter's tiles
    assert (kernel.kernel, kernel.tiling) == ("pack", int8_gemm.INTERPRETER_CONFIG), kernel
    def case(name, xq, w, x_scale, w_scale, bias):
        got = int8_gemm.int8_gemm(xq, x_scale, w, w_scale, bias, kernel=kernel)
        acc = (xq.long() @ w.long().t()).int()
        want = gemm_epilogue(acc, x_scale, w_scale, bias)
        out[name] = [int((got != want).sum()), list(got.shape), str(got.dtype), bool(torch.isfinite(got.float()).all())]
    i8 = lambda *s: torch.randint(-127, 128, s, generator=g, dtype=torch.int8)
    scales = lambda m: (torch.rand(m, 1, generator=g) * 0.05 + 1e-4).bfloat16().float()
    # (M, N, K): off the 32-tiles in each dimension, exact tiles, one row, more tiles than programs
    for m, n, k in ((70, 96, 80), (1, 40, 48), (37, 33, 112), (64, 64, 64), (200, 130, 16), (3, 8, 544)):
        for bias in (False, True):
            b = (4 * torch.randn(n, generator=g)).bfloat16() if bias else None
            case(f"{m}x{n}x{k} bias={bias}", i8(m, k), i8(n, k), scales(m), torch.tensor(3.1e-3), b)
    case("per-column scale", i8(45, 80), i8(50, 80), scales(45), torch.rand(50, generator=g) * 1e-2, None)
    big_x, big_w = i8(90, 96), i8(140, 96)
    xs = scales(90)
    case("row and weight slices", big_x[7:61], big_w[33:101], xs[7:61], torch.tensor(2e-3), None)
    odd = i8(1 + 40 * 64)[1:].view(40, 64)  # rows whose first byte is off TMA's 16-byte alignment
    case("unaligned rows", odd, i8(24, 64), scales(40), torch.tensor(2e-3), None)
    sat_x, sat_w = torch.full((40, 2048), 127, dtype=torch.int8), torch.full((36, 2048), -127, dtype=torch.int8)
    sat_x[1::2] = -127
    case("sums past 2**24", sat_x, sat_w, scales(40), torch.tensor(1e-3), (torch.randn(36, generator=g)).bfloat16())
    case("no rows", i8(0, 48), i8(24, 48), scales(0), torch.tensor(1.0), None)
    # the gated residual in the epilogue: stock's two steps (the product, then residual.addcmul_(product, gate))
    def gated(name, xq, w, x_scale, w_scale, bias, residual, gate, whole=None):
        acc = (xq.long() @ w.long().t()).int()
        want = residual.clone().addcmul_(gemm_epilogue(acc, x_scale, w_scale, bias), gate)
        around = None if whole is None else whole.clone()
        got = int8_gemm.int8_gemm(xq, x_scale, w, w_scale, bias, residual=residual, gate=gate, kernel=kernel)
        assert got is residual
        differ = int((got != want).sum())
        if whole is not None:  # rows outside the slice untouched
            outside = torch.ones(whole.shape[0], dtype=torch.bool)
            outside[residual.storage_offset() // whole.shape[1]:][:residual.shape[0]] = False
            differ += int((whole[outside] != around[outside]).sum())
        out[name] = [differ, list(got.shape), str(got.dtype), bool(torch.isfinite(got.float()).all())]
    bf = lambda *s: torch.randn(*s, generator=g).bfloat16()
    gated("gated 70x96x80", i8(70, 80), i8(96, 80), scales(70), torch.tensor(3.1e-3), None, bf(70, 96), bf(96))
    gated("gated bias, per-column scale", i8(37, 112), i8(33, 112), scales(37), torch.rand(33, generator=g) * 1e-2,
          bf(33), bf(37, 33), bf(33))
    whole = bf(90, 40)
    gated("gated row slice", i8(50, 48), i8(40, 48), scales(50), torch.tensor(2e-3), None, whole[13:63], bf(40),
          whole)
    report(out)
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(INTERPRETED)


def test_gemm_gives_the_exact_products_epilogue_bits(interpreted):
    assert len(interpreted) == 20
    for name, (differ, shape, dtype, finite) in interpreted.items():
        assert differ == 0, f"{name}: {differ} outputs differ"
        assert dtype == "torch.bfloat16" and finite, name
    assert interpreted["no rows"][1] == [0, 24]
    assert interpreted["row and weight slices"][1] == [54, 68]
    assert interpreted["gated row slice"][1] == [50, 40]


def test_reference_epilogue_rounds_once_with_a_bias():
    """(acc * x_scale) * w_scale + bias rounds once after the product with the row's scale (an FMA), not twice: on
    this input the two give different bf16 values (found among random ones), so a reference that rounded twice
    would fail here; and the row's scale goes first (acc * (x_scale * w_scale) gives other bits too)."""
    acc = torch.tensor([[-7269539]], dtype=torch.int32)
    x_scale, w_scale = torch.tensor([[float.fromhex("0x1.74p-8")]]), torch.tensor(3.1e-3)
    bias = torch.tensor([-0.58203125], dtype=torch.bfloat16)
    t = acc.float() * x_scale
    once = (t.double() * w_scale.double() + bias.double()).float().bfloat16()
    twice = (t * w_scale + bias.float()).bfloat16()
    assert not torch.equal(once, twice)
    assert torch.equal(gemm_epilogue(acc, x_scale, w_scale, bias), once)


def test_gemm_says_why_it_does_not_run():
    gemm = submodule("kernels.int8_gemm")
    if gemm.interpreting():
        assert gemm.gemm_problem(torch.device("cpu"), 64) is None
        assert "multiple of 16" in gemm.gemm_problem(torch.device("cpu"), 40)
        assert "positive multiple of 16" in gemm.gemm_problem(torch.device("cpu"), 0)  # TMA takes no empty rows
    else:
        assert gemm.gemm_problem(torch.device("cpu"), 64) == "not on a CUDA device"
    kernel = gemm.GemmChoice("pack", device=torch.device("cpu"), tiling=gemm.INTERPRETER_CONFIG, programs=4)
    with pytest.raises(ValueError, match="int8"):
        gemm.int8_gemm(torch.zeros(4, 64), torch.ones(4, 1), torch.zeros(8, 64, dtype=torch.int8), torch.ones(()),
                       kernel=kernel)
    with pytest.raises(ValueError, match="int8 GEMM: not on a CUDA device"):  # a call no pack kernel takes
        gemm.int8_gemm(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1), torch.zeros(8, 64, dtype=torch.int8),
                       torch.ones(()), kernel=gemm.GemmChoice("comfy_kitchen", "not on a CUDA device"))


def test_configs_are_declared_per_gpu():
    gemm = submodule("kernels.int8_gemm")
    for capability, cfg in gemm.CONFIGS.items():
        assert isinstance(capability, tuple) and len(capability) == 2
        assert cfg.block_k % gemm.K_ALIGN == 0 and cfg.block_m % 64 == 0 and cfg.block_n % 64 == 0


def test_an_older_triton_keeps_comfy_kitchens_gemm(monkeypatch):
    gemm = submodule("kernels.int8_gemm")
    if gemm.triton is None:
        pytest.skip("triton not importable")
    monkeypatch.setattr(gemm.triton, "__version__", "3.4.1")
    gemm.triton_problem.cache_clear()
    try:
        assert gemm.triton_problem() == "Triton 3.4.1 is older than the 3.6 it was measured with"
        assert gemm.gemm_problem(torch.device("cpu"), 64) == gemm.triton_problem()
    finally:
        monkeypatch.undo()
        gemm.triton_problem.cache_clear()
    assert gemm.triton_problem() is None


def test_a_failed_launch_turns_the_gemm_off_on_that_device_and_says_why(monkeypatch):
    """A compile or launch error keeps comfy-kitchen's GEMM (stock's bits) on that device from then on, with the
    reason in the report's status and the log; running out of memory is raised, not taken as such a failure."""
    gemm, route, gpu = submodule("kernels.int8_gemm"), submodule("kernels.int8_linear"), submodule("kernels.gpu")
    device = torch.device("cpu")
    monkeypatch.setattr(gemm, "interpreting", lambda: True)  # the pack's GEMM runs on the CPU
    monkeypatch.setattr(gpu, "ANSWERS", gpu.DeviceAnswers())
    tries = []

    def broken(*args):
        tries.append(1)
        raise RuntimeError("PTX .version 8.7 does not support .target sm_90\nmore")
    monkeypatch.setattr(gemm, "_launch", broken)
    monkeypatch.setattr(gemm, "kitchen_gemm", lambda *args: "comfy-kitchen's")
    xq, xs = torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1)
    w = torch.zeros(8, 64, dtype=torch.int8)
    assert route.gemm_status(device) == {"kernel": "pack", "reason": None, "release": "measured"}
    chosen = gemm.choice(device, 64, 8)  # once, as the route chooses it; each call checks it still runs
    assert gemm.gemm(xq, xs, w, torch.ones(()), None, torch.bfloat16, kernel=chosen) == "comfy-kitchen's"
    assert gemm.gemm(xq, xs, w, torch.ones(()), None, torch.bfloat16, kernel=chosen) == "comfy-kitchen's"
    assert len(tries) == 1  # not tried again on that device
    assert gemm.still_runs(chosen).kernel == "comfy_kitchen"
    status = route.gemm_status(device)
    assert status["kernel"] == "comfy_kitchen"
    assert status["reason"] == "it failed on this GPU (RuntimeError: PTX .version 8.7 does not support .target sm_90)"
    assert gpu.ANSWERS.reason("int8_gemm", device) == status["reason"]

    monkeypatch.setattr(gpu, "ANSWERS", gpu.DeviceAnswers())  # fresh answers

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(gemm, "_launch", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        gemm.gemm(xq, xs, w, torch.ones(()), None, torch.bfloat16, kernel=chosen)
    assert gpu.ANSWERS.reason("int8_gemm", device) is None
