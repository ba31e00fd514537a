"""``round_bf16``'s two forms: which one a launch takes (no GPU needed).

The hardware form (``cvt.rn.bf16x2.f32``, compute capability 8.0 and later) and the integer form round
the same way by definition; the interpreter runs only the integer form (tests/unit/test_block_ops.py
checks its bits), the GPU tests check the hardware form's bits against stock's. Here: the choice per
device.
"""

from __future__ import annotations

import pytest
import torch

from comfyui_sage_strided_nhd.kernels import gpu, triton_support


def with_gpu(monkeypatch, capability):
    """A CUDA device 0 of ``capability`` (the lookup's own CPU, ROCm and interpreter checks still run)."""
    monkeypatch.setattr(gpu, "_properties", lambda index: (capability, 132))
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("capability,expected", [((7, 5), False), ((8, 0), True), ((8, 9), True), ((9, 0), True),
                                                 ((12, 0), True)])
def test_a_gpu_takes_the_conversion_instruction_from_compute_capability_8(monkeypatch, capability, expected):
    with_gpu(monkeypatch, capability)
    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_support.hardware_bf16(torch.device("cuda", 0)) is expected


def test_the_cpu_the_interpreter_and_rocm_take_the_integer_form(monkeypatch):
    with_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_support.hardware_bf16(torch.device("cuda", 0)) is True
    assert triton_support.hardware_bf16(torch.device("cpu")) is False
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")  # a ROCm build: its GPUs are "cuda" devices
    assert triton_support.hardware_bf16(torch.device("cuda", 0)) is False
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(triton_support, "interpreting", lambda: True)
    assert triton_support.hardware_bf16(torch.device("cuda", 0)) is False
