"""The format matrix: every quantized layout comfy-kitchen registers, the loader's fp8 weight dtypes and the block
variants users load, through the node on the tiny H3 in a real ComfyUI 0.33 host, on the CPU.

Each layout's weights are real ``QuantizedTensor``s made by comfy-kitchen's own ``quantize`` and loaded as
ComfyUI's UNETLoader loads such a checkpoint (``devkit.h3.build_model``). For each, one block forward with the
node's patch must give stock's bits, and the report must say which path the linears took: int8 tensor-wise ConvRot
and W4A8 linears the int8 route's (or the reason stock's ran), every other layout stock's call, never routed.

On the CPU the route declines every call (no CUDA), so "never routed" would hold for any layout. Each case therefore
runs twice: as this CPU gives it, and with the route's device and release checks answered yes and its GEMM replaced
by a recorder that declines (stock's computation then runs on the cast weight, stock's bits). The int8 ConvRot and
W4A8 cases reaching the recorder is what shows the check can fail. W4A8 also runs the route whole (0.2.40): the pack's
decode and call into the int8 linear, its quantiser and GEMM as their CUDA steps, against stock's W4A8 linear with
its int8 linear as those steps (tests/unit/test_int8_w4a8.py holds the pack's quantiser to them): stock's bits.

A layout or format the installed releases lack is a skip naming the release (a skip, not a pass);
scripts/test_kitchen_releases.sh runs this file against each comfy-kitchen release of kernels/kitchen.py.
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import pytest
import torch

from devkit import h3 as dh

CONFIG = dh.INT8_TINY_H3
SEQ = 100
RELEASE = importlib.metadata.version("comfy-kitchen")
HOST = "ComfyUI 0.33"
# every layout comfy-kitchen 0.2.40 registers -> the devkit.h3 weight formats that load as it
LAYOUTS = {
    "TensorWiseINT8Layout": ("int8_convrot", "int8_tensorwise"),
    "TensorCoreFP8Layout": ("float8_e4m3fn", "float8_e5m2"),
    "TensorCoreMXFP8Layout": ("mxfp8",),
    "TensorCoreNVFP4Layout": ("nvfp4",),
    "AsymW4A8Int8Layout": ("asym_w4a8_int8",),
    "TensorCoreConvRotW4A4Layout": ("convrot_w4a4",),
    "TensorCoreSVDQuantW4A4Layout": (),
    "TensorCoreAWQW4A16Layout": (),
}
CASES = [(layout, fmt) for layout, formats in LAYOUTS.items() for fmt in formats or (None,)]
# the node's settings per forward: MLP chunks that cut the modulation segments, and everything whole
ROUTED = ("int8_convrot", "asym_w4a8_int8")  # the formats whose layouts the int8 route knows
SETTINGS = {"chunked": dict(mlp_chunk_tokens=30, int8_mlp_chunk_tokens=30),
            "whole": dict(mlp_chunk_tokens=8192, int8_mlp_chunk_tokens=8192)}


def skip_reason(layout: str, fmt: str | None) -> str | None:
    """Why this release and host cannot make or load ``layout`` (None: they can)."""
    import comfy.quant_ops
    import comfy_kitchen.tensor as ckt

    if getattr(ckt, layout, None) is None:
        return f"comfy-kitchen {RELEASE} has no {layout}: not covered on this release (a skip, not a pass)"
    if fmt is None:
        loads = [name for name, algo in comfy.quant_ops.QUANT_ALGOS.items()
                 if algo["comfy_tensor_layout"] == layout]
        try:
            getattr(ckt, layout).quantize(torch.randn(64, 256, dtype=torch.bfloat16))
            made = "a quantize for it"
        except NotImplementedError:
            made = "no quantize for it (offline calibration only)"
        assert not loads, f"{HOST} loads {layout} as {loads}: give it a format in devkit.h3.KITCHEN_FORMATS"
        return (f"comfy-kitchen {RELEASE} has {layout} with {made}, and {HOST}'s loader reads no comfy_quant "
                "format as it: stock cannot load it, no bits to compare (a skip, not a pass)")
    if fmt != "int8_convrot" and fmt not in comfy.quant_ops.QUANT_ALGOS:
        return (f"{HOST} with comfy-kitchen {RELEASE} loads no {fmt!r} checkpoint ({layout}): "
                "not covered on this release (a skip, not a pass)")
    return None


@contextlib.contextmanager
def route_open(pack):
    """The int8 route's device and release checks answered yes (as on a GPU it was verified on), its GEMM a
    recorder that declines each call: yields the list of calls that reached the route."""
    reached = []

    def declining(x, *args, **kwargs):
        reached.append(tuple(x.shape))
        return None  # declined: stock's computation runs on the cast weight

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pack.kernels, "int8_call_problem", lambda x, input_act=None: None)
        mp.setattr(pack.kernels, "int8_weight_problem", lambda *args, **kwargs: None)
        mp.setattr(pack.kernels, "int8_rows_problem", lambda x: None)
        mp.setattr(pack.kernels, "int8_linear_routed", declining)
        mp.setattr(pack.kernels.int8_w4a8, "weight_problem", lambda *args: None)
        mp.setattr(pack.kernels.int8_w4a8, "rows_problem", lambda x: None)  # the tiny H3's 100 rows
        yield reached


def block_forward(pack, model, inputs, **settings):
    """Block 1 of ``model`` with the node's patch: (output, the forward's class name, report payload)."""
    s = pack.nodes.patch.Settings(backend="sdpa", **settings)
    clone, patch = pack.nodes.sage_node.patch_any_model(model, s)
    x, t_emb, segments, rope = inputs
    clone.patch_model(load_weights=False)
    try:
        block = clone.model.diffusion_model.blocks[1]
        forward = type(vars(block).get("forward")).__name__
        out = block(x.clone(), t_emb, segments, rope, transformer_options={})
    finally:
        clone.unpatch_model(unpatch_weights=False)
    return out, forward, patch.report.payload()


def stock_forward(model, inputs):
    x, t_emb, segments, rope = inputs
    return model.model.diffusion_model.blocks[1](x.clone(), t_emb, segments, rope, transformer_options={})


@pytest.fixture(scope="module", params=CASES, ids=[f"{layout}-{fmt}" for layout, fmt in CASES])
def case(request, pack):
    """One layout's model, stock's block output and the node's on the CPU and with the route open."""
    layout, fmt = request.param
    reason = skip_reason(layout, fmt)
    if reason is not None:
        pytest.skip(reason)
    model = dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, fmt)
    inputs = dh.random_block_inputs(model.model.diffusion_model.blocks[1], SEQ, seed=3, dtype=torch.bfloat16)
    runs = {}
    for name, settings in SETTINGS.items():
        runs[name, "cpu"] = (*block_forward(pack, model, inputs, **settings), [])
        with route_open(pack) as reached:
            runs[name, "route_open"] = (*block_forward(pack, model, inputs, **settings), reached)
    return dict(layout=layout, fmt=fmt, model=model, want=stock_forward(model, inputs), runs=runs)


def test_weights_are_the_layout_comfy_kitchen_made(case):
    import comfy_kitchen.tensor as ckt

    blocks = case["model"].model.diffusion_model.blocks
    for layer in (blocks[1].attn.qkv_proj, blocks[1].attn.out_proj, blocks[1].mlp.fc1, blocks[1].mlp.fc2):
        w = layer.weight
        assert isinstance(w, ckt.QuantizedTensor), f"{case['fmt']}: {type(w).__name__}"
        # ComfyUI loads fp8 as its own subclasses of comfy-kitchen's TensorCoreFP8Layout
        assert issubclass(ckt.get_layout_class(w._layout_cls), getattr(ckt, case["layout"])), w._layout_cls


def test_block_path_gives_stock_bits(case):
    want = case["want"]
    for (settings, mode), (got, forward, _, _) in case["runs"].items():
        assert forward == "H3BlockForward", f"{settings}/{mode}: block forward {forward}"
        assert torch.equal(got, want), (f"{case['fmt']} {settings}/{mode}: max abs "
                                        f"{(got.float() - want.float()).abs().max().item()}")


def test_report_says_which_path_the_linears_took(case):
    import comfy_kitchen.tensor as ckt

    fc1 = case["model"].model.diffusion_model.blocks[1].mlp.fc1.weight
    layout = getattr(fc1._layout_cls, "__name__", fc1._layout_cls)  # ComfyUI's fp8 names its own subclasses
    assert issubclass(ckt.get_layout_class(fc1._layout_cls), getattr(ckt, case["layout"]))
    for (settings, mode), (_, _, payload, reached) in case["runs"].items():
        where = f"{case['fmt']} {settings}/{mode}"
        assert payload["int8_own_quantizer_calls"] == 0, where  # the recorder declines; the CPU has no route
        if case["fmt"] not in ROUTED:
            # never routed: no call reached the route, none was counted as an int8 ConvRot linear
            assert reached == [] and payload["int8_stock_quantizer"] == [], (where, reached, payload)
            assert payload["comfy_kitchen"] is None and payload["int8_gemm"] is None, where
            # and the report names their layout as stock's call: qkv, out, fc1 and fc2 at least once each
            others = {r["layout"]: r["count"] for r in payload["other_quantized_linears"]}
            named = f"{layout} (no ConvRot)" if case["fmt"] == "int8_tensorwise" else layout
            assert list(others) == [named] and others[named] >= 4, (where, others)
            continue
        assert payload["other_quantized_linears"] == [], where
        counts = {r["reason"]: r["count"] for r in payload["int8_stock_quantizer"]}
        assert sum(counts.values()) >= 4, (where, counts)  # qkv, out, fc1, fc2 at least once each
        if mode == "route_open":
            # calls reached the route and were declined there (stock's computation on the cast weight), each
            # counted with that reason; the rest with the route's reason (on the CPU fc2's cast dequantises)
            assert 0 < len(reached) == counts.get("CUTLASS declined the shape"), (where, counts, reached)
        else:
            assert reached == [] and "CUTLASS declined the shape" not in counts, (where, counts)
            assert counts.get("not on a CUDA device", 0) >= 4, (where, counts)


def test_w4a8_runs_the_int8_route_with_stocks_bits(pack):
    """A W4A8 checkpoint with the route open and its quantiser and GEMM as their CUDA steps: every qkv, out, fc1 and
    fc2 call takes the route (the report counts them, no other layout, no reason), with stock's bits, stock's W4A8
    linear running its int8 linear as the same steps."""
    from comfy_kitchen.backends.eager import w4a8_int8 as eager_w4a8

    from devkit import int8_oracle

    mirrored = pack.kernels.int8_w4a8.READ_RELEASES
    if skip_reason("AsymW4A8Int8Layout", "asym_w4a8_int8") or RELEASE not in mirrored:
        pytest.skip(f"comfy-kitchen {RELEASE}: the W4A8 route mirrors {', '.join(mirrored)} only (a skip, not a pass)")
    model = dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "asym_w4a8_int8")
    inputs = dh.random_block_inputs(model.model.diffusion_model.blocks[1], SEQ, seed=3, dtype=torch.bfloat16)
    block_ops = pack.kernels.h3_block

    def quantize(x, input_act, modulation):  # the CUDA quantiser's steps, on rows modulated by the block's own pass
        if modulation is not None:
            x = x.clone()
            for a, b, scale1, shift in modulation:
                block_ops.scale_shift_(x[a:b], scale1, shift)
        return int8_oracle.quantize_rows_convrot(x, input_act)

    with route_open(pack), pytest.MonkeyPatch.context() as mp:
        mp.setattr(pack.kernels, "int8_linear_routed", pack.kernels.int8_linear.int8_linear_routed)
        mp.setattr(pack.kernels.int8_linear, "_quantize", quantize)
        mp.setattr(pack.kernels.int8_linear, "gemm", int8_oracle.declining_gemm(set()))
        mp.setattr(eager_w4a8, "int8_linear", int8_oracle.cuda_int8_linear)
        want = stock_forward(model, inputs)
        for name, settings in SETTINGS.items():
            got, forward, payload = block_forward(pack, model, inputs, **settings)
            assert forward == "H3BlockForward" and torch.equal(got, want), (
                f"{name}: max abs {(got.float() - want.float()).abs().max().item()}")
            assert payload["int8_stock_quantizer"] == [] and payload["other_quantized_linears"] == [], payload
            assert payload["int8_own_quantizer_calls"] >= 4, payload  # qkv, out, fc1 and fc2 at least once each


@pytest.fixture(scope="module")
def bf16_model(pack):
    return dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "bf16")


@pytest.mark.parametrize("weights", tuple(dh.LOADER_DTYPES))
def test_loader_fp8_weight_dtype(pack, weights):
    """UNETLoader's weight_dtype fp8_e4m3fn / fp8_e5m2: plain weights stored in fp8, computed in manual cast."""
    model = dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, weights)
    assert model.model.diffusion_model.blocks[1].mlp.fc1.weight.dtype == dh.LOADER_DTYPES[weights]
    inputs = dh.random_block_inputs(model.model.diffusion_model.blocks[1], SEQ, seed=4, dtype=torch.bfloat16)
    try:
        want = stock_forward(model, inputs)
    except Exception as exc:  # noqa: BLE001 - stock's own failure is what the node must match
        stock_error = f"{type(exc).__name__}: {exc}"
        with pytest.raises(type(exc)) as raised:
            block_forward(pack, model, inputs, **SETTINGS["chunked"])
        assert f"{raised.type.__name__}: {raised.value}" == stock_error  # the same failure, not the pack's own
        pytest.skip(f"{HOST} with comfy-kitchen {RELEASE} cannot run the H3 block with weight_dtype {weights} on "
                    f"the CPU ({stock_error[:160]}); the node fails as stock does. No bits to compare "
                    "(a skip, not a pass)")
    for settings in SETTINGS.values():
        got, forward, payload = block_forward(pack, model, inputs, **settings)
        assert forward == "H3BlockForward" and torch.equal(got, want)
        assert payload["int8_own_quantizer_calls"] == 0 and payload["int8_stock_quantizer"] == []


def variant_model(variant: str):
    """The bf16 tiny H3 with every attention module (DiT and refiner) rewritten as a checkpoint of ``variant`` loads
    (the server's stand-in loader does the same: tests/host_helper_nodes.py)."""
    import host_helper_nodes  # the host's folder_paths is importable once the pack fixture imported ComfyUI

    model = dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "bf16")
    host_helper_nodes.rewrite_attention(model.model.diffusion_model, variant)
    return model


@pytest.fixture(scope="module")
def block_inputs(bf16_model):
    return dh.random_block_inputs(bf16_model.model.diffusion_model.blocks[1], SEQ, seed=5, dtype=torch.bfloat16)


@pytest.mark.parametrize("variant, code, named", [("separate_qkv", "separate_qkv_declined", "q_proj/k_proj/v_proj"),
                                                   ("keyless", "keyless_declined", "qv_proj")])
def test_a_block_without_a_fused_qkv_is_declined_with_stock_bits(pack, block_inputs, variant, code, named):
    """Separate q/k/v projections, or the "Keyless" packed qv_proj with no K projection: the node declines with a
    note naming the projections, installs no forward of its own, and stock's forward runs with its own bits."""
    model = variant_model(variant)
    want = stock_forward(model, block_inputs)
    got, forward, payload = block_forward(pack, model, block_inputs)
    assert forward == "NoneType"  # no forward of the node's on the block
    assert [n["code"] for n in payload["notes"]] == [code] and named in payload["notes"][0]["text"]
    assert payload["attention_calls"] == 0 and payload["int8_own_quantizer_calls"] == 0 and torch.equal(got, want)


def test_w4a8_calls_on_the_route_are_named_w4a8_in_the_report(pack):
    """The log lines of a W4A8 block run whole on the route (as above) name its calls W4A8, not int8 ConvRot."""
    from comfy_kitchen.backends.eager import w4a8_int8 as eager_w4a8

    from devkit import int8_oracle

    if skip_reason("AsymW4A8Int8Layout", "asym_w4a8_int8") or RELEASE not in pack.kernels.int8_w4a8.READ_RELEASES:
        pytest.skip(f"comfy-kitchen {RELEASE}: the W4A8 route mirrors other releases only (a skip, not a pass)")
    model = dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "asym_w4a8_int8")
    inputs = dh.random_block_inputs(model.model.diffusion_model.blocks[1], SEQ, seed=3, dtype=torch.bfloat16)
    with route_open(pack), pytest.MonkeyPatch.context() as mp:
        mp.setattr(pack.kernels, "int8_linear_routed", pack.kernels.int8_linear.int8_linear_routed)
        mp.setattr(pack.kernels.int8_linear, "_quantize", lambda x, act, mod: int8_oracle.quantize_rows_convrot(x, act))
        mp.setattr(pack.kernels.int8_linear, "gemm", int8_oracle.declining_gemm(set()))
        mp.setattr(eager_w4a8, "int8_linear", int8_oracle.cuda_int8_linear)
        payload = block_forward(pack, model, inputs, **SETTINGS["whole"])[2]
    layouts = {r["layout"]: r["count"] for r in payload["int8_own_layouts"]}
    assert list(layouts) == ["AsymW4A8Int8Layout"] and layouts["AsymW4A8Int8Layout"] >= 4, payload
    line = f"W4A8 linears: {layouts['AsymW4A8Int8Layout']} calls quantised by the pack's pass (stock's bits)"
    assert line in payload["messages"], payload["messages"]
    assert not any(m.startswith("int8 ConvRot linears") for m in payload["messages"]), payload["messages"]
