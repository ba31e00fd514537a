"""The format matrix's report read back through a real ComfyUI server (CPU, PyTorch attention): a W4A8 checkpoint, an
fp8 one (comfy-kitchen's TensorCoreFP8Layout, as ComfyUI's loader reads it) and the H3 variants the node declines
(separate q/k/v projections, the "Keyless" packed qv_proj, loaded by a stand-in loader node). For each, the node's
graph samples stock's latents bit for bit and its report says which path the linears took, or why the blocks were
declined, in the payload, the server's log and the text the status box renders. The int8 ConvRot case is
test_host_server.py's. In-process, every layout: test_format_matrix.py; scripts/test_kitchen_releases.sh runs this
file against each comfy-kitchen release (a release or host that cannot make or load a format: a skip naming it).
"""

from __future__ import annotations

import importlib.metadata

import pytest

from host_fixtures import (assert_latents_equal, assert_meaningful, h3_graph, only_report, patch_inputs,
                           status_box_lines, tiny_h3_model)

STEPS = 2  # h3_graph's

RELEASE = importlib.metadata.version("comfy-kitchen")
NOT_ROUTED = "the int8 route takes int8 ConvRot and W4A8 only"


def kitchen_checkpoint(server, fmt: str) -> str:
    """The tiny H3 (int8-sized) with its DiT blocks' linears in ``fmt``'s comfy-kitchen layout, in the server's
    diffusion_models folder; a skip naming the release where this comfy-kitchen or ComfyUI cannot make or load it."""
    import comfy.quant_ops
    from safetensors.torch import save_file

    from devkit.h3 import INT8_TINY_H3, KITCHEN_FORMATS, kitchen_state_dict

    layout = KITCHEN_FORMATS[fmt][0]
    if fmt not in comfy.quant_ops.QUANT_ALGOS:
        pytest.skip(f"this ComfyUI with comfy-kitchen {RELEASE} loads no {fmt!r} checkpoint ({layout}): not covered "
                    "on this release (a skip, not a pass)")
    try:
        state = kitchen_state_dict(tiny_h3_model(seed=4, config=INT8_TINY_H3).state_dict(), fmt)
    except ValueError as exc:
        pytest.skip(f"comfy-kitchen {RELEASE}: {exc} (a skip, not a pass)")
    name = f"sage_nhd_test_h3_tiny_{fmt}_ck{RELEASE}.safetensors"  # each release its own: they run side by side
    save_file({k: v.contiguous() for k, v in state.items()}, str(server.host / "models" / "diffusion_models" / name))
    return name


def node_and_stock(server, graph_name: str, unet: str | None = None, variant: str | None = None):
    """The node's run and stock's of one checkpoint (``variant``: through the stand-in loader of that variant)."""
    extra = [("SageNHDTestAttentionVariant", {"variant": variant})] if variant else None
    runs = []
    for patch in (patch_inputs("strided_nhd", "sdpa"), None):
        graph = h3_graph(patch=patch, name=f"{graph_name}_{'node' if patch else 'stock'}", extra_model_nodes=extra)
        if unet is not None:
            graph["1"]["inputs"]["unet_name"] = unet
        runs.append(server.run_graph(graph))
    node, stock = runs
    assert stock.ok, f"stock's graph failed: {stock.error_message()}\n{server.log_tail()}"
    assert stock.reports == []
    report = only_report(node)
    assert_meaningful(stock.latent("9"))
    assert_latents_equal(node.latent("9"), stock.latent("9"), f"{graph_name}: the node's latents vs stock's")
    return report


def assert_said(server, report: dict, message: str, box_line: str, tmp_path) -> list[str]:
    """``message`` in the report's messages and the server's log, ``box_line`` in the status box's text."""
    assert message in report["messages"], report["messages"]
    log = server.log_path.read_text(errors="replace")
    assert f"[Sage Strided NHD] {message}\n" in log, server.log_tail()
    box = status_box_lines(report, tmp_path)
    assert box_line in box, box
    return box


def test_w4a8_checkpoint_reports_its_linears_as_w4a8(comfy_server, tmp_path):
    """On the CPU the route declines every call ("not on a CUDA device"); the report counts them as W4A8 linears on
    stock's quantiser, not as int8 ConvRot ones, and names no other layout."""
    report = node_and_stock(comfy_server, "h3_w4a8", kitchen_checkpoint(comfy_server, "asym_w4a8_int8"))
    assert report["status"] == "ok" and report["other_quantized_linears"] == [], report
    rows = report["int8_stock_quantizer"]
    assert [(r["layout"], r["reason"]) for r in rows] == [("AsymW4A8Int8Layout", "not on a CUDA device")], rows
    calls = rows[0]["count"]
    assert calls >= 4 * STEPS and report["int8_own_quantizer_calls"] == 0, report  # qkv, out, fc1, fc2 a step
    box = assert_said(comfy_server, report, f"W4A8 linears on stock's quantiser ({calls} calls): not on a CUDA device",
                      f"W4A8 linears on stock's quantiser ×{calls}", tmp_path)
    assert "why W4A8 linears kept stock's quantiser: not on a CUDA device" in box, box
    assert not any("int8 ConvRot" in line for line in report["messages"] + box), (report["messages"], box)


def test_fp8_checkpoint_runs_stocks_call_and_is_named(comfy_server, tmp_path):
    """fp8 linears are never routed: stock's call, counted under their layout, no int8 line."""
    report = node_and_stock(comfy_server, "h3_fp8", kitchen_checkpoint(comfy_server, "float8_e4m3fn"))
    assert report["status"] == "ok" and report["int8_stock_quantizer"] == [], report
    assert report["int8_own_quantizer_calls"] == 0 and report["comfy_kitchen"] is None, report
    (row,) = report["other_quantized_linears"]
    assert "FP8" in row["layout"] and row["count"] >= 4 * STEPS, row  # ComfyUI names its own fp8 layout subclasses
    assert_said(comfy_server, report, f"{row['layout']} linears: stock's call ({row['count']} calls; {NOT_ROUTED})",
                f"{row['layout']} linears: stock's call ×{row['count']}", tmp_path)


@pytest.mark.parametrize("variant, code, named", [("separate_qkv", "separate_qkv_declined", "q_proj/k_proj/v_proj"),
                                                   ("keyless", "keyless_declined", "qv_proj")])
def test_a_declined_variant_says_why_and_samples_stocks_latents(comfy_server, tmp_path, variant, code, named):
    """Separate q/k/v projections or the Keyless qv_proj: the node declines every block with a note naming the
    projections, no attention call reaches it, stock's latents."""
    report = node_and_stock(comfy_server, f"h3_{variant}", variant=variant)
    assert [n["code"] for n in report["notes"]] == [code], report["notes"]
    note = report["notes"][0]["text"]
    assert named in note and report["attention_calls"] == 0 and report["blocks_patched"] == 0, report
    box = status_box_lines(report, tmp_path)
    assert any(note in line for line in box), box
    assert any(note in m for m in report["messages"]), report["messages"]
    log = comfy_server.log_path.read_text(errors="replace")
    assert note in log, comfy_server.log_tail()
