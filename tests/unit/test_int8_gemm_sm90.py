"""The int8 GEMM's warp-specialised Hopper kernel (kernels/int8_gemm_sm90.py) on the CPU: it builds for sm90 with
the installed Triton, down to a cubin (devkit/gluon_aot.py), and is the kernel it says; where it runs and where the
portable kernel runs instead, and why. Its bits are checked on the GPU (tests/gpu/test_int8_gemm_gpu.py: against
the portable kernel, the interpreter's twin, and comfy-kitchen's CUTLASS GEMM)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from devkit.pack import submodule

HOPPER_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may have on sm90


def gluon_or_skip():
    why = submodule("kernels.int8_gemm_sm90").GLUON_ERROR
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must build the Gluon kernel: {why}")
        pytest.skip(why)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("per_column", [False, True])
def test_builds_for_sm90_as_the_kernel_it_says(bias, per_column):
    gluon_or_skip()
    from devkit import gluon_aot

    kernel = gluon_aot.build(bias, per_column)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES
    assert len(kernel.asm["cubin"]) > 0
    assert "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8" in ptx      # int8 x int8 -> int32 tensor cores
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx)    # TMA loads
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx                  # the TMA store
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx             # the loader's registers go to the MMAs
    assert ("fma.rn.f32" in ptx) == bias                                   # one rounding of t * w_scale + bias
    assert "mul.rn.f32" in ptx


def test_gated_epilogue_builds_reading_the_residual_in_16_byte_vectors():
    """The gated residual's epilogue: the residual read in coalesced 16-byte vectors, the tile still leaving by
    TMA, within shared memory and without spilling (ptxas's report)."""
    gluon_or_skip()
    from devkit import gluon_aot

    kernel = gluon_aot.build(False, False, gated=True)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= HOPPER_SHARED_BYTES
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx)              # the residual, 8 bf16 a load
    assert "cp.async.bulk.tensor.2d.global.shared" in ptx                  # the TMA store
    assert gluon_aot.spilled_bytes(kernel) == 0
    plain = gluon_aot.build(False, False)
    assert not re.search(r"ld\.global(\.\w+)*\.v4\.b32", plain.asm["ptx"])  # no residual read without the gate


def hopper_everywhere(monkeypatch, gemm, gpu, capability=(9, 0)):
    """Every device a GPU of ``capability`` with 132 SMs, on a Triton release the Gluon kernel was measured with,
    with fresh per-device answers."""
    if gemm.triton is None:
        pytest.skip("Triton not importable")
    monkeypatch.setattr(gemm, "interpreting", lambda: False)
    monkeypatch.setattr(gemm, "triton_problem", lambda: None)
    monkeypatch.setattr(gemm.int8_gemm_sm90, "GLUON_ERROR", None)
    monkeypatch.setattr(gemm, "GLUON_TRITON", (gemm.version_key(gemm.triton.__version__)[:2],))
    monkeypatch.setattr(gpu, "capability", lambda device: capability)
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    monkeypatch.setattr(gpu, "ANSWERS", gpu.DeviceAnswers())


def decided(chosen) -> tuple:
    """A choice's decision (whose kernel, why not the faster one, the Gluon release), without what it launches with."""
    return chosen.kernel, chosen.reason, chosen.release


def test_runs_only_where_declared_and_says_why(monkeypatch):
    gemm, gpu = submodule("kernels.int8_gemm"), submodule("kernels.gpu")
    cuda = torch.device("cuda", 0)
    assert gemm.choice(torch.device("cpu")).reason == "not on a CUDA device"
    hopper_everywhere(monkeypatch, gemm, gpu)
    assert decided(gemm.choice(cuda)) == decided(gemm.choice(cuda, n=21504)) == ("pack_sm90", None, "measured")
    chosen = gemm.choice(cuda)  # with what its launches need: asked of the GPU once, here
    assert (chosen.device, chosen.tiling, chosen.ws_tiling, chosen.programs) == (
        cuda, gemm.CONFIGS[(9, 0)], gemm.int8_gemm_sm90.SM90, 132)
    assert decided(gemm.choice(cuda, n=100)) == (
        "pack", "outputs 100 wide: its TMA store needs a multiple of 8", "measured")
    gpu.ANSWERS.fail("int8_gemm_sm90", cuda, "its Gluon kernel failed here (RuntimeError: x)")
    assert decided(gemm.choice(cuda, n=64)) == ("pack", "its Gluon kernel failed here (RuntimeError: x)", "measured")
    assert gemm.choice(torch.device("cuda", 1), n=64).kernel == "pack_sm90"  # a failure is per device
    monkeypatch.setattr(gpu, "ANSWERS", gpu.DeviceAnswers())  # fresh answers
    monkeypatch.setattr(gpu, "capability", lambda device: (8, 9))
    assert decided(gemm.choice(cuda, n=64)) == (
        "comfy_kitchen", "measured faster than comfy-kitchen's GEMM only on sm90, not on this sm89 GPU", "measured")
    monkeypatch.setattr(gemm, "CONFIGS", {**gemm.CONFIGS, (8, 9): gemm.INTERPRETER_CONFIG})
    assert decided(gemm.choice(cuda, n=64)) == (
        "pack", "warp-specialised kernel measured only on sm90, not sm89", "measured")
    monkeypatch.setattr(gemm.int8_gemm_sm90, "GLUON_ERROR", "no Gluon here")
    monkeypatch.setattr(gpu, "capability", lambda device: (9, 0))
    assert decided(gemm.choice(cuda, n=64)) == ("pack", "no Gluon here", "measured")


def test_a_triton_it_was_not_measured_with_runs_it_after_a_bits_check(monkeypatch):
    """On a Triton release the Gluon kernel was not measured with, it runs only once its bits matched the portable
    kernel's on the device, checked once per device ("int8_gemm_sm90"); the report says it was self-checked."""
    gemm, gpu = submodule("kernels.int8_gemm"), submodule("kernels.gpu")
    hopper_everywhere(monkeypatch, gemm, gpu)
    monkeypatch.setattr(gemm, "GLUON_TRITON", ((3, 6),))
    monkeypatch.setattr(gemm.triton, "__version__", "3.8.0")
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    verdicts, checked = {cuda0: None, cuda1: "it differed"}, []
    monkeypatch.setattr(gemm, "_gluon_bits_check",
                        lambda pack: checked.append(pack.device) or verdicts[pack.device])
    assert decided(gemm.choice(cuda0)) == ("pack_sm90", None, "self_checked")
    assert decided(gemm.choice(cuda0, n=64)) == ("pack_sm90", None, "self_checked")
    assert decided(gemm.choice(cuda1)) == ("pack", "it differed", "self_checked")
    assert decided(gemm.choice(cuda1)) == ("pack", "it differed", "self_checked")
    assert checked == [cuda0, cuda1]  # once per device
    assert gpu.ANSWERS.reason("int8_gemm_sm90", cuda1) == "it differed"
    monkeypatch.setattr(gemm.triton, "__version__", "3.6.0+git1234")
    monkeypatch.setattr(gpu, "ANSWERS", gpu.DeviceAnswers())  # fresh answers
    assert decided(gemm.choice(cuda1)) == ("pack_sm90", None, "measured")
    assert checked == [cuda0, cuda1]  # a measured release is not checked


def test_the_bits_check_compares_with_the_portable_kernel(monkeypatch):
    """``_gluon_bits_check``: None where the Gluon kernel wrote the portable kernel's outputs on every check shape;
    else how many differed, or how it failed (the launches stand in: the Gluon kernel needs a Hopper GPU)."""
    gemm, gpu = submodule("kernels.int8_gemm"), submodule("kernels.gpu")
    hopper_everywhere(monkeypatch, gemm, gpu)
    monkeypatch.setattr(gemm, "GLUON_TRITON", ((3, 6),))
    monkeypatch.setattr(gemm.triton, "__version__", "3.8.0")
    monkeypatch.setattr(gemm, "GLUON_CHECK_SHAPES", ((5, 16, 32, True, False), (3, 8, 16, False, True)))
    cpu, shapes = torch.device("cpu"), []

    def portable(xq, x_scale, qdata, w_scale, bias, out, gate, kernel):
        out.fill_(1.0)

    def same(cfg, xq, x_scale, qdata, w_scale, bias, out, programs, gate=None):
        shapes.append((xq.shape[0], qdata.shape[0], xq.shape[1], bias is not None, gate is not None, cfg, programs))
        out.fill_(1.0)

    monkeypatch.setattr(gemm, "_launch_portable", portable)
    monkeypatch.setattr(gemm.int8_gemm_sm90, "launch", same)
    sm90 = gemm.int8_gemm_sm90.SM90
    pack = gemm.GemmChoice("pack", device=cpu, tiling=gemm.CONFIGS[(9, 0)], ws_tiling=sm90, programs=132)
    assert gemm._gluon_bits_check(pack) is None
    assert shapes == [(5, 16, 32, True, False, sm90, 8), (3, 8, 16, False, True, sm90, 8)]

    def one_off(cfg, xq, x_scale, qdata, w_scale, bias, out, programs, gate=None):
        out.fill_(1.0)
        out[0, 0] = 2.0
    monkeypatch.setattr(gemm.int8_gemm_sm90, "launch", one_off)
    assert gemm._gluon_bits_check(pack) == ("its Gluon kernel was measured with Triton 3.6; on Triton 3.8.0 it "
                                            "differed from the portable kernel in 1 of 80 outputs (5 x 16 x 32)")

    def broken(*args):
        raise RuntimeError("PassManager::run failed\nmore")
    monkeypatch.setattr(gemm.int8_gemm_sm90, "launch", broken)
    assert gemm._gluon_bits_check(pack) == ("its Gluon kernel was measured with Triton 3.6; on Triton 3.8.0 it "
                                            "failed its check here (RuntimeError: PassManager::run failed)")


def test_hopper_launches_it_and_a_build_failure_falls_back_to_the_portable_kernel(monkeypatch):
    gemm, route, gpu = submodule("kernels.int8_gemm"), submodule("kernels.int8_linear"), submodule("kernels.gpu")
    sm90 = gemm.int8_gemm_sm90
    hopper_everywhere(monkeypatch, gemm, gpu)  # the CPU tensors below stand in for an H100's
    chosen = gemm.choice(torch.device("cpu"))  # what the route decides once

    def not_asked(device):
        raise AssertionError("a call asked the GPU")
    monkeypatch.setattr(gpu, "capability", not_asked)
    monkeypatch.setattr(gpu, "sm_count", not_asked)
    calls = []
    monkeypatch.setattr(sm90, "launch", lambda cfg, *args: calls.append(("sm90", cfg, args[6])))  # its programs
    monkeypatch.setattr(gemm, "_launch_portable", lambda *args: calls.append(("portable",)))
    xq, w = torch.zeros(300, 64, dtype=torch.int8), torch.zeros(520, 64, dtype=torch.int8)
    out = torch.empty(300, 520, dtype=torch.bfloat16)
    gemm._launch(xq, torch.ones(300, 1), w, torch.ones(()), None, out, None, chosen)
    assert calls == [("sm90", sm90.SM90, 3 * 3)]  # 128 x 256 tiles: 3 x 3 of them, fewer than the 132 SMs
    gemm._launch(xq, torch.ones(300, 1), w, torch.ones(()), None, out, None, gemm.dataclasses.replace(
        chosen, kernel="pack"))
    assert calls[1:] == [("portable",)]

    def broken(*args):
        calls.append(("broken",))
        raise RuntimeError("PassManager::run failed\nmore")
    monkeypatch.setattr(sm90, "launch", broken)
    calls.clear()
    for _ in range(2):  # the route's choice, made once, checked per call against what failed since
        gemm._launch(xq, torch.ones(300, 1), w, torch.ones(()), None, out, None, gemm.still_runs(chosen))
    assert calls == [("broken",), ("portable",), ("portable",)]
    why = "its Gluon kernel failed here (RuntimeError: PassManager::run failed)"
    assert gpu.ANSWERS.reason("int8_gemm_sm90", xq.device) == why
    assert gpu.ANSWERS.reason("int8_gemm", xq.device) is None  # the portable kernel still runs there

    monkeypatch.setattr(gpu, "capability", lambda device: (9, 0))
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert route.gemm_status(cuda) == {"kernel": "pack_sm90", "reason": None, "release": "measured"}
    gpu.ANSWERS.fail("int8_gemm_sm90", cuda, why)
    assert route.gemm_status(cuda) == {"kernel": "pack", "reason": why, "release": "measured"}


def test_its_tiling_fits_hopper_and_tma():
    sm90 = submodule("kernels.int8_gemm_sm90")
    gemm = submodule("kernels.int8_gemm")
    for cfg in gemm.WS_CONFIGS.values():
        ring = cfg.stages * (cfg.block_m + cfg.block_n) * cfg.block_k
        assert ring + cfg.block_m * cfg.block_n * 2 + 2 * 8 * cfg.stages <= HOPPER_SHARED_BYTES  # + out tile, barriers
        assert cfg.block_k % gemm.K_ALIGN == 0 and cfg.block_m == 64 * (sm90.MMA_WARPS // 4)
    assert sm90.MAX_REGS * 32 * (sm90.MMA_WARPS + 4) <= 65536
