"""One capability lookup, from the tensor's own device (kernels/gpu.py), on a stand-in two-GPU machine: an sm89
card as device 0 (the current one) and an sm90 card as device 1. The prepared path (sage2's sm90 kernel) must follow
q's device, never the current one; the per-device answers keep one shape."""

from __future__ import annotations

import types

import pytest
import torch

from comfyui_sage_strided_nhd.kernels import gpu, sage2_quant
from comfyui_sage_strided_nhd.kernels.backends import sage2

CARDS = {0: ((8, 9), 128), 1: ((9, 0), 132)}  # index -> (capability, SMs)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(gpu, "_properties", lambda index: CARDS[index])
    monkeypatch.setattr(sage2_quant, "operand_problem", lambda q, k, v: None)  # the operands are stand-ins
    monkeypatch.setattr(sage2_quant, "TRITON_ERROR", None)
    monkeypatch.setattr(sage2.sage2_binding, "sm90_attention_op", lambda: (object(), ""))


def views(index: int):
    """NHD stand-ins of q, k, v on ``cuda:index`` (what prepared_verdict reads: device and shape)."""
    t = types.SimpleNamespace(device=torch.device("cuda", index), shape=(1, 4096, 56, 128))
    return t, t, t


def test_capability_comes_from_the_devices_own_index(two_gpus):
    assert gpu.capability(torch.device("cuda", 1)) == (9, 0)
    assert gpu.capability(torch.device("cuda", 0)) == (8, 9)
    assert gpu.capability("cuda") == (8, 9)  # a bare "cuda" is the current device
    assert gpu.capability("cpu") is None and gpu.sm_count(torch.device("cuda", 1)) == 132


def test_prepared_path_follows_q_on_the_second_gpu_not_the_current_one(two_gpus):
    backend = sage2.Sage2Backend()
    assert backend.prepared_verdict(*views(1))  # q on the sm90 card while the current device is the sm89 one
    verdict = backend.prepared_verdict(*views(0))
    assert not verdict and verdict.code == "gpu_arch" and "8.9" in verdict.reason


def test_prepared_path_refuses_q_on_the_sm89_card_while_the_sm90_one_is_current(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    backend = sage2.Sage2Backend()
    assert not backend.prepared_verdict(*views(0))
    assert backend.prepared_verdict(*views(1))


def test_device_answers_are_decided_once_per_question_and_device(two_gpus):
    answers, asked = gpu.DeviceAnswers(), []
    decide = lambda why: lambda: (asked.append(why), why)[1]  # noqa: E731
    assert answers.decide("int8_gemm", torch.device("cuda", 1), decide(None)) is None
    assert answers.decide("int8_gemm", "cuda:1", decide("not asked again")) is None
    assert answers.decide("int8_gemm", "cuda", decide("bad on 0")) == "bad on 0"  # the current device, 0
    assert answers.fail("int8_gemm", torch.device("cuda", 1), "failed") == "failed"
    assert answers.reason("int8_gemm", "cuda:1") == "failed" and answers.reason("kitchen_release", "cuda:1") is None
    assert asked == [None, "bad on 0"]
