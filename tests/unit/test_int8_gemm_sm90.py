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


def test_runs_only_where_declared_and_says_why(monkeypatch):
    gemm = submodule("kernels.int8_gemm")
    cuda = torch.device("cuda", 0)
    assert gemm.ws_problem(torch.device("cpu")) == "not on a CUDA device"
    capability = {"now": (9, 0)}
    monkeypatch.setattr(gemm, "interpreting", lambda: False)
    monkeypatch.setattr(gemm.torch.version, "hip", None)
    monkeypatch.setattr(gemm, "exact_device", lambda device: cuda)
    monkeypatch.setattr(gemm, "_device_facts", lambda index: (capability["now"], 132))
    monkeypatch.setattr(gemm, "gluon_problem", lambda: None)
    monkeypatch.setattr(gemm, "WS_FAILED", {})
    assert gemm.ws_problem(cuda) is None and gemm.ws_problem(cuda, 21504) is None
    assert gemm.ws_problem(cuda, 100) == "outputs 100 wide: its TMA store needs a multiple of 8"
    gemm.WS_FAILED[cuda] = "its Gluon kernel failed here (RuntimeError: x)"
    assert gemm.ws_problem(cuda, 64) == "its Gluon kernel failed here (RuntimeError: x)"
    gemm.WS_FAILED.clear()
    capability["now"] = (8, 9)
    assert gemm.ws_problem(cuda, 64) == "warp-specialised kernel measured only on sm90, not sm89"


def test_a_triton_it_was_not_measured_with_keeps_the_portable_kernel(monkeypatch):
    gemm = submodule("kernels.int8_gemm")
    if gemm.triton is None or gemm.int8_gemm_sm90.GLUON_ERROR:
        pytest.skip("Gluon not importable")
    monkeypatch.setattr(gemm, "GLUON_TRITON", ((3, 6),))
    monkeypatch.setattr(gemm.triton, "__version__", "3.8.0")
    gemm.gluon_problem.cache_clear()
    try:
        assert gemm.gluon_problem() == "its Gluon kernel was measured with Triton 3.6, not 3.8.0"
        monkeypatch.setattr(gemm.triton, "__version__", "3.6.0+git1234")
        gemm.gluon_problem.cache_clear()
        assert gemm.gluon_problem() is None
    finally:
        monkeypatch.undo()
        gemm.gluon_problem.cache_clear()


def test_hopper_launches_it_and_a_build_failure_falls_back_to_the_portable_kernel(monkeypatch):
    gemm, route = submodule("kernels.int8_gemm"), submodule("kernels.int8_linear")
    sm90 = gemm.int8_gemm_sm90
    cuda = torch.device("cuda", 0)
    calls = []
    monkeypatch.setattr(gemm, "exact_device", lambda device: cuda)
    monkeypatch.setattr(gemm, "_device_facts", lambda index: ((9, 0), 132))
    monkeypatch.setattr(gemm, "ws_problem", lambda device, n=None: gemm.WS_FAILED.get(cuda))
    monkeypatch.setattr(gemm, "WS_FAILED", {})
    monkeypatch.setattr(sm90, "launch", lambda cfg, *args: calls.append(("sm90", cfg, args[6])))  # its programs
    monkeypatch.setattr(gemm, "_launch_portable", lambda *args: calls.append(("portable",)))
    xq, w = torch.zeros(300, 64, dtype=torch.int8), torch.zeros(520, 64, dtype=torch.int8)
    out = torch.empty(300, 520, dtype=torch.bfloat16)
    gemm._launch(xq, torch.ones(300, 1), w, torch.ones(()), None, out)
    assert calls == [("sm90", sm90.SM90, 3 * 3)]  # 128 x 256 tiles: 3 x 3 of them, fewer than the 132 SMs

    def broken(*args):
        raise RuntimeError("PassManager::run failed\nmore")
    monkeypatch.setattr(sm90, "launch", broken)
    calls.clear()
    gemm._launch(xq, torch.ones(300, 1), w, torch.ones(()), None, out)
    gemm._launch(xq, torch.ones(300, 1), w, torch.ones(()), None, out)
    assert calls == [("portable",), ("portable",)]
    assert gemm.WS_FAILED == {cuda: "its Gluon kernel failed here (RuntimeError: PassManager::run failed)"}

    monkeypatch.setattr(gemm, "gemm_problem", lambda device, k: None)
    assert route.gemm_status(cuda) == {"kernel": "pack", "reason": gemm.WS_FAILED[cuda]}
    monkeypatch.setattr(gemm, "ws_problem", lambda device, n=None: None)
    assert route.gemm_status(cuda) == {"kernel": "pack_sm90", "reason": None}


def test_its_tiling_fits_hopper_and_tma():
    sm90 = submodule("kernels.int8_gemm_sm90")
    gemm = submodule("kernels.int8_gemm")
    for cfg in gemm.WS_CONFIGS.values():
        assert cfg.shared_bytes <= HOPPER_SHARED_BYTES
        assert cfg.block_k % gemm.K_ALIGN == 0 and cfg.block_m == 64 * (sm90.MMA_WARPS // 4)
    assert sm90.MAX_REGS * 32 * (sm90.MMA_WARPS + 4) <= 65536
