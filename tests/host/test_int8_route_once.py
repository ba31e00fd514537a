"""Whose quantiser and whose GEMM an int8 ConvRot layer's calls run is decided once per layer in a run
(nodes/int8_layers.py ``route``, memoised on the run's plan), in a real ComfyUI 0.33 host on the CPU: later calls of
that layer in the run read the answer; a new run (a new plan) decides again; each layer has its own answer."""

from __future__ import annotations

import pytest
import torch

from devkit import h3 as dh

CONFIG = dh.INT8_TINY_H3


@pytest.fixture(scope="module")
def block(pack):
    return dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "int8_convrot").model.diffusion_model.blocks[0]


@pytest.fixture
def asked(pack, monkeypatch):
    """The layers whose route was decided, in order (each decision reads the layer's facts once)."""
    layers = pack.nodes.int8_layers
    decided, real = [], layers._layer_reason
    monkeypatch.setattr(layers, "_layer_reason", lambda layer, *a: (decided.append(layer), real(layer, *a))[1])
    return decided


def test_a_layers_route_is_decided_on_its_first_call_of_a_run(pack, block, asked):
    layers = pack.nodes.int8_layers
    fc1, out_proj = block.mlp.fc1, block.attn.out_proj
    x = torch.randn(5, CONFIG["hidden_size"]).bfloat16()
    run, reasons = pack.nodes.patch.Plan(default=None).int8_routes, []
    for _ in range(4):
        assert torch.equal(layers.call(fc1, x, record=reasons.append, routes=run), fc1(x))
    assert asked == [fc1] and reasons == ["not on a CUDA device"] * 4
    answer = layers.route(fc1, x, routes=run)
    assert answer == layers.Route("stock", "stock", "not on a CUDA device") and asked == [fc1]

    y = torch.randn(5, out_proj.in_features).bfloat16()
    layers.call(out_proj, y, routes=run)
    layers.call(out_proj, y, routes=run)
    assert asked == [fc1, out_proj]  # each layer its own answer

    layers.call(fc1, x, routes=pack.nodes.patch.Plan(default=None).int8_routes)  # the next run's plan
    assert asked == [fc1, out_proj, fc1]


def test_a_call_with_too_few_rows_is_the_only_check_repeated(pack, block, asked, monkeypatch):
    layers = pack.nodes.int8_layers
    fc1 = block.mlp.fc1
    monkeypatch.setattr(layers, "_layer_reason", lambda layer, *a: (asked.append(layer), None)[1])
    monkeypatch.setattr(pack.kernels, "int8_weight_problem", lambda *a, **k: None)
    run = {}
    wide = torch.randn(5, CONFIG["hidden_size"]).bfloat16()
    too_few = wide[:pack.kernels.kitchen.installed_release()[1].min_rows - 1]
    cast = (fc1.weight, None)
    assert layers.stock_quantizer_reason(fc1, wide, routes=run) is None  # before the cast: the layer's part
    assert layers.route(fc1, wide, routes=run) is layers.UNDECIDED
    assert layers.stock_quantizer_reason(fc1, wide, cast=cast, routes=run) is None  # the cast decides the rest
    assert layers.route(fc1, wide, routes=run).quantizer == "pack"
    assert "runs a GEMV for fewer than" in layers.stock_quantizer_reason(fc1, too_few, routes=run)
    assert asked == [fc1]  # the rows were checked per call; the layer's facts were read once
