"""When the int8 route (nodes/int8_layers.py) leaves a linear to stock's call, in a real ComfyUI 0.33 host
on the CPU: each reason is recorded, the output is exactly what stock's call gives, and float layers
are never counted. The route taking calls is tests/host/test_int8_route.py's."""

from __future__ import annotations

import types

import pytest
import torch

from devkit import h3 as dh

CONFIG = dh.INT8_TINY_H3


@pytest.fixture(scope="module")
def blocks(pack):
    return {w: dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, w).model.diffusion_model.blocks[0]
            for w in dh.WEIGHT_FORMATS}


def routed(pack, layer, x, input_act=None):
    reasons = []
    return pack.nodes.int8_layers.call(layer, x, input_act, record=reasons.append), reasons


def test_float_layers_run_stocks_call_unrecorded(pack, blocks):
    fc1 = blocks["bf16"].mlp.fc1
    x = torch.randn(5, CONFIG["hidden_size"]).bfloat16()
    out, reasons = routed(pack, fc1, x)
    assert torch.equal(out, fc1(x)) and reasons == []


def test_each_declined_call_runs_stocks_call_and_says_why(pack, blocks, monkeypatch):
    import comfy.model_management

    fc1 = blocks["int8_convrot"].mlp.fc1
    assert pack.nodes.int8_layers.is_int8_convrot(fc1.weight)
    x = torch.randn(5, CONFIG["hidden_size"]).bfloat16()
    out, reasons = routed(pack, fc1, x)
    assert torch.equal(out, fc1(x)) and reasons == ["not on a CUDA device"]

    monkeypatch.setattr(fc1, "weight_function", [lambda w: w])  # a LoRA-style weight function
    out, reasons = routed(pack, fc1, x)
    assert torch.equal(out, fc1(x)) and "would not run the int8 GEMM" in reasons[0]
    monkeypatch.undo()

    monkeypatch.setattr(fc1, "forward", types.MethodType(lambda self, t: t[:, :3] * 2, fc1))  # another node's
    out, reasons = routed(pack, fc1, x)
    assert torch.equal(out, x[:, :3] * 2) and "replaced the layer's forward" in reasons[0]
    monkeypatch.undo()

    monkeypatch.setattr(comfy.model_management, "in_training", True)
    out, reasons = routed(pack, fc1, x)
    assert torch.equal(out, fc1(x)) and reasons == ["training"]


def test_the_caller_follows_the_settings(pack):
    """The installed patch routes its int8 linears on either block path (each layer's ``route`` decides); its calls
    memoise their routes on the run's plan."""
    layers, patch = pack.nodes.int8_layers, pack.nodes.patch
    report = types.SimpleNamespace(record_int8=lambda problem: None, record_layout=lambda layout: None)

    def installed(settings):
        return types.SimpleNamespace(settings=settings, report=report, plan=patch.Plan(default=None))

    for block_path in ("exact", "attention_only"):  # attention only routes its int8 linears too
        on = installed(patch.Settings(block_path=block_path))
        taken = layers.caller(on)
        assert taken.func is layers.call
        assert taken.keywords == {"record": report.record_int8, "routes": on.plan.int8_routes,
                                  "layouts": report.record_layout}
        assert taken.keywords["routes"] is on.plan.int8_routes
    assert patch.Plan(default=None).int8_routes is not patch.Plan(default=None).int8_routes  # a run's own


def test_a_cast_that_dequantises_runs_the_float_linear(pack, blocks, monkeypatch):
    """Where stock's cast hands back a dequantised weight (a LoRA patched in on the fly, activations of
    another dtype), the call is stock's float linear on it, for both call forms, with the reason recorded."""
    import comfy.ops

    # past the CPU's own reason (nodes/ reach the route's checks through the kernels package's face)
    monkeypatch.setattr(pack.kernels, "int8_call_problem", lambda x, input_act=None: None)
    fc2 = blocks["int8_convrot"].mlp.fc2
    dequantised = fc2.weight.dequantize().to(torch.bfloat16)

    class Cast:  # stock's context, handing back the dequantised weight
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return dequantised, None

        def __exit__(self, *args):
            return False

    monkeypatch.setattr(comfy.ops, "CastBiasWeightContext", Cast)
    u = torch.randn(4, 2 * CONFIG["ffn_hidden_size"]).bfloat16()
    for x, act in ((u[:, :CONFIG["ffn_hidden_size"]].contiguous(), None), (u, "swiglu")):
        out, reasons = routed(pack, fc2, x, act)
        want_in = comfy.ops.INPUT_ACT_EAGER[act](x) if act else x
        assert torch.equal(out, torch.nn.functional.linear(want_in, dequantised))
        assert reasons == ["the cast gave a weight that is not int8 ConvRot"]


def test_one_function_says_whose_quantiser_a_call_uses(pack, blocks, monkeypatch):
    """``stock_quantizer_reason``: before the cast what the layer and the call show, after it (``cast``)
    what the cast weight shows; None where the pack's quantiser runs."""
    import comfy.model_management

    reason = pack.nodes.int8_layers.stock_quantizer_reason
    fc1 = blocks["int8_convrot"].mlp.fc1
    x = torch.randn(5, CONFIG["hidden_size"]).bfloat16()
    assert reason(fc1, x) == "not on a CUDA device"
    monkeypatch.setattr(pack.kernels, "int8_call_problem", lambda x, input_act=None: None)
    assert reason(fc1, x) is None
    assert reason(fc1, x.requires_grad_()) == "training"
    with monkeypatch.context() as m:
        m.setattr(comfy.model_management, "in_training", True)
        assert reason(fc1, x.detach()) == "training"
    x = x.detach()
    with monkeypatch.context() as m:
        m.setattr(fc1, "weight_function", [lambda w: w])
        assert "would not run the int8 GEMM" in reason(fc1, x)
    dequantised = fc1.weight.dequantize().to(torch.bfloat16)
    assert reason(fc1, x, cast=(dequantised, None)) == "the cast gave a weight that is not int8 ConvRot"
    monkeypatch.setattr(pack.kernels, "int8_weight_problem", lambda *args, input_act=None: None)
    assert reason(fc1, x, cast=(fc1.weight, None)) is None
