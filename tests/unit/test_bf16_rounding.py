"""``round_bf16``'s two forms: which one a launch takes, and what each compiles to (no GPU needed).

The hardware form (``cvt.rn.bf16x2.f32``, compute capability 8.0 and later) and the integer form round
the same way by definition; the interpreter runs only the integer form (tests/unit/test_block_ops.py
checks its bits), the GPU tests check the hardware form's bits against stock's. Here: the choice per
device, and every bf16 block pass compiled for sm90 with the hardware form (one conversion
instruction a rounding, fewer instructions, no spills) and for sm75 with the integer form (the
hardware form does not assemble there).
"""

from __future__ import annotations

import pytest
import torch

from comfyui_sage_strided_nhd.kernels import triton_support

static = pytest.importorskip("benchmarks.passes_static")


@pytest.mark.parametrize("capability,expected", [((7, 5), False), ((8, 0), True), ((8, 9), True), ((9, 0), True),
                                                 ((12, 0), True)])
def test_a_gpu_takes_the_conversion_instruction_from_compute_capability_8(monkeypatch, capability, expected):
    monkeypatch.setattr(triton_support, "_capability", lambda index: capability)
    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_support.hardware_bf16(torch.device("cuda", 0)) is expected


def test_the_cpu_the_interpreter_and_rocm_take_the_integer_form(monkeypatch):
    monkeypatch.setattr(triton_support, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_support.hardware_bf16(torch.device("cuda", 0)) is True
    assert triton_support.hardware_bf16(torch.device("cpu")) is False
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")  # a ROCm build: its GPUs are "cuda" devices
    assert triton_support.hardware_bf16(torch.device("cuda", 0)) is False
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(triton_support, "interpreting", lambda: True)
    assert triton_support.hardware_bf16(torch.device("cuda", 0)) is False


@pytest.mark.parametrize("name", [p.name for p in static.block_passes()])
def test_each_block_pass_rounds_with_one_instruction_on_sm90(name):
    p = next(p for p in static.block_passes() if p.name == name)
    integer, hardware = (static.analyse(p, hw, clock_hz=1.8e9) for hw in (False, True))
    sass = static._run_tool("nvdisasm", ["-c"], static.compile_pass(p, True).asm["cubin"])
    assert "F2FP.BF16.F32.PACK_AB" in sass
    assert hardware["stack_bytes"] == 0
    assert hardware["instructions_per_thread"] < integer["instructions_per_thread"]


@pytest.mark.parametrize("name", [p.name for p in static.block_passes()])
def test_each_block_pass_compiles_for_sm75_with_the_integer_form_only(name):
    p = next(p for p in static.block_passes() if p.name == name)
    assert static.compile_pass(p, False, arch=75).asm["cubin"]
    with pytest.raises(Exception, match="PTXAS"):
        static.compile_pass(p, True, arch=75)


def test_the_pass_benchmark_times_the_integer_form_and_puts_the_hardware_form_back():
    prep = pytest.importorskip("benchmarks.prep_passes")
    device = torch.device("cuda", 0)
    seen = prep.integer_rounding(lambda: [m.hardware_bf16(device) for m in prep.ROUNDING_MODULES])()
    assert seen == [False] * len(prep.ROUNDING_MODULES)
    assert all(m.hardware_bf16 is triton_support.hardware_bf16 for m in prep.ROUNDING_MODULES)
