"""The node in a real ComfyUI server (CPU, PyTorch attention), driven over its HTTP API.

Each graph samples a tiny random-weight checkpoint for 2 steps and writes the sampled
latents to safetensors; comparisons are bit for bit. Skipped, with the reason, when no
ComfyUI host is found (see tests/host_fixtures.py).
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch

from host_fixtures import (assert_latents_equal, assert_meaningful, h3_graph, only_report, patch_inputs,
                           status_box_lines, tiny_h3_model, wan_graph)

STEPS = 2
INT8_CKPT = "sage_nhd_test_h3_tiny_int8_convrot.safetensors"


def test_node_is_listed_in_object_info(comfy_server):
    info = comfy_server.get("/object_info/SageStridedNHDAttention")["SageStridedNHDAttention"]
    assert info["display_name"] == "Sage Strided NHD Attention"
    assert info["category"] == "advanced/model_patches"
    assert info["output"] == ["MODEL"]
    req = info["input"]["required"]
    assert list(req) == ["model", "layout", "backend", "patch_text_refiner"]
    assert req["layout"][1]["default"] == "strided_nhd"
    assert req["backend"][1]["default"] == "auto"
    assert req["patch_text_refiner"][1]["default"] is True
    assert all(spec[1].get("tooltip") for spec in req.values()), "every input needs a tooltip"
    opt = info["input"].get("optional", {})
    assert list(opt) == ["sage2_prep", "block_path"], "optional: API graphs saved without them still validate"
    for name, values in (("sage2_prep", ["exact", "rotated"]), ("block_path", ["exact", "attention_only"])):
        spec = opt[name]
        assert spec[0] == values or spec[1].get("options") == values, (name, spec)  # no removed value offered
        assert spec[1].get("advanced") is True and spec[1]["default"] == "exact" and spec[1].get("tooltip")
    # layout is the one widget each bundled A/B pair differs in: shown in both canvas modes, never advanced
    assert not req["layout"][1].get("advanced")


def test_h3_latents_bit_identical_across_layouts_and_stock_and_patch_reverts(comfy_server):
    stock_before = comfy_server.run_graph(h3_graph(patch=None, name="h3_stock_before"))
    strided = comfy_server.run_graph(h3_graph(patch=patch_inputs("strided_nhd", "sdpa"), name="h3_strided", probe=True))
    hnd = comfy_server.run_graph(h3_graph(patch=patch_inputs("hnd", "sdpa"), name="h3_hnd"))
    stock_after = comfy_server.run_graph(h3_graph(patch=None, name="h3_stock_after", probe=True))
    other_seed = comfy_server.run_graph(h3_graph(patch=None, name="h3_other_seed", seed=8))

    for run in (strided, hnd, stock_after):  # same loaded model object, sampled anew each time
        assert "1" in run.cached_nodes() and "6" not in run.cached_nodes(), run.cached_nodes()
    base = stock_before.latent("9")
    assert set(base) == {"stream0", "stream1"}, "H3 samples a video and an audio latent"
    assert base["stream0"].shape[1] == 24 and base["stream1"].shape[1] == 32
    assert_meaningful(base)
    assert_latents_equal(strided.latent("9"), base, "strided_nhd vs stock")
    assert_latents_equal(hnd.latent("9"), base, "hnd vs stock")
    assert_latents_equal(stock_after.latent("9"), base, "stock after a patched run vs before")
    # the comparison can fail: another noise seed gives other latents
    assert not torch.equal(other_seed.latent("9")["stream0"], base["stream0"])

    # reverted: while the stock model sampled after the patched one, no forward was replaced
    assert len(strided.probe("h3_strided")) == 4, strided.probe("h3_strided")
    assert stock_after.probe("h3_stock_after") == []
    assert stock_before.reports == [] and stock_after.reports == []
    for run, layout in ((strided, "strided_nhd"), (hnd, "hnd")):
        r = only_report(run)
        assert r["model_family"] == "MiniMaxH3" and r["path"] == "h3_forward_patch" and r["layout"] == layout
        assert r["blocks_patched"] == 2 and r["refiner_blocks_patched"] == 2 and r["node_id"] == "3"
        assert r["backends_ran"] == {"sdpa": r["attention_calls"]} and r["attention_calls"] >= 2 * STEPS
        assert r["fallbacks"] == [] and r["status"] == "ok" and r["prompt_id"] and r["schema"] == 5
        assert r["notes"] == [] and r["prepared"] == [] and r["compile_events"] == [] and r["error"] is None
    # copies the dataflow really made: none on strided_nhd; HND's 3 input + 1 output copies
    assert only_report(strided)["copies_per_call"] == 0.0
    assert only_report(hnd)["copies_per_call"] == 4.0


def test_h3_refiner_toggle(comfy_server):
    on = only_report(comfy_server.run_graph(h3_graph(patch=patch_inputs(refiner=True), name="h3_ref_on")))
    off_run = comfy_server.run_graph(h3_graph(patch=patch_inputs(refiner=False), name="h3_ref_off"))
    off = only_report(off_run)
    assert off["refiner_blocks_patched"] == 0 and off["attention_calls"] == 2 * STEPS
    assert on["attention_calls"] > off["attention_calls"]
    stock = comfy_server.run_graph(h3_graph(patch=None, name="h3_ref_stock"))
    assert_latents_equal(off_run.latent("9"), stock.latent("9"), "refiner unpatched vs stock")


def test_second_family_through_the_override_is_bit_identical_and_reverts(comfy_server):
    stock_before = comfy_server.run_graph(wan_graph(patch=None, name="wan_stock_before"))
    strided = comfy_server.run_graph(wan_graph(patch=patch_inputs("strided_nhd", "sdpa"), name="wan_strided"))
    hnd = comfy_server.run_graph(wan_graph(patch=patch_inputs("hnd", "sdpa"), name="wan_hnd"))
    stock_after = comfy_server.run_graph(wan_graph(patch=None, name="wan_stock_after"))

    for run in (strided, hnd, stock_after):
        assert "1" in run.cached_nodes() and "6" not in run.cached_nodes(), run.cached_nodes()
    base = stock_before.latent("9")
    assert_meaningful(base)
    assert_latents_equal(strided.latent("9"), base, "Wan override strided_nhd vs stock")
    assert_latents_equal(hnd.latent("9"), base, "Wan override hnd vs stock")
    assert_latents_equal(stock_after.latent("9"), base, "Wan stock after a patched run vs before")
    r = only_report(strided)
    assert r["model_family"] == "WAN21" and r["path"] == "attention_override" and r["blocks_patched"] == 0
    assert r["backends_ran"] == {"sdpa": r["attention_calls"]} and r["attention_calls"] > 0 and r["stock_calls"] == 0
    assert r["copies_per_call"] == 0.0 and "copies_avoided_per_call" not in r and "remaining_copies" not in r


def test_node_applied_twice_replaces_its_own_patch(comfy_server):
    first = ("SageStridedNHDAttention", patch_inputs("hnd", "sdpa", refiner=True))
    run = comfy_server.run_graph(h3_graph(patch=patch_inputs("strided_nhd", "sdpa", refiner=False),
                                          name="h3_twice", extra_model_nodes=[first]))
    r = only_report(run)  # one report: the earlier patch's run report was replaced too
    assert r["replaced_own_patch"] is True and r["layout"] == "strided_nhd" and r["refiner_blocks_patched"] == 0
    assert any("replaced" in m for m in r["messages"])
    stock = comfy_server.run_graph(h3_graph(patch=None, name="h3_twice_stock"))
    assert_latents_equal(run.latent("9"), stock.latent("9"), "patched twice vs stock")


def test_foreign_object_patch_is_refused_with_a_clear_error(comfy_server):
    run = comfy_server.run_graph(h3_graph(patch=patch_inputs(), name="h3_foreign",
                                          extra_model_nodes=[("SageNHDTestForeignH3Patch", {})]))
    assert not run.ok
    msg = run.error_message()
    assert "PatchConflictError" in msg and "blocks.0.attn.forward" in msg and "another node already replaced" in msg
    assert run.reports == []


def test_api_graph_with_sage2_prep_validates_and_runs(comfy_server):
    run = comfy_server.run_graph(h3_graph(patch=dict(patch_inputs(), sage2_prep="rotated"), name="h3_prep_rotated"))
    r = only_report(run)
    assert r["prep_mode"] == "rotated" and r["prepared"] == []  # no sage2 prepared path on a CPU
    stock = comfy_server.run_graph(h3_graph(patch=None, name="h3_prep_stock"))
    assert_latents_equal(run.latent("9"), stock.latent("9"), "sage2_prep without a prepared path changes nothing")


@pytest.mark.parametrize("choice", ["sage2", "sage1"])
def test_cpu_device_with_sage_requested_falls_back_to_sdpa_and_says_why(comfy_server, choice):
    """The back-end asked for falls back; those the chain passed over on its way to sdpa (sage2 and fa4 when
    sage1 was asked for) were never asked for: skipped, not fallbacks."""
    run = comfy_server.run_graph(h3_graph(patch=patch_inputs("strided_nhd", choice), name=f"h3_cpu_{choice}"))
    r = only_report(run)
    assert r["backends_ran"] == {"sdpa": r["attention_calls"]}
    assert [f["backend"] for f in r["fallbacks"]] == [choice], r["fallbacks"]
    (fallback,) = r["fallbacks"]
    assert fallback["reason"] and fallback["count"] == r["attention_calls"]
    passed_over = {"sage2": ["fa4"], "sage1": ["sage2", "fa4"]}[choice]
    assert [s["backend"] for s in r["skipped"]] == passed_over, r["skipped"]
    assert all(s["reason"] and s["count"] == r["attention_calls"] for s in r["skipped"]), r["skipped"]
    assert [m.split(" (")[0] for m in r["messages"] if m.startswith("fallback")] == [f"fallback from {choice}"], \
        r["messages"]
    stock = comfy_server.run_graph(h3_graph(patch=None, name=f"h3_cpu_stock_{choice}"))
    assert_latents_equal(run.latent("9"), stock.latent("9"), f"{choice} requested on CPU vs stock")


# --- the report read back through the server: payload, log and status box --------------------------------
@pytest.fixture(scope="module")
def int8_checkpoint(comfy_server):
    """A tiny H3 checkpoint with int8 ConvRot block linears, in the server's diffusion_models folder."""
    from safetensors.torch import save_file

    from devkit.h3 import INT8_TINY_H3, int8_convrot_state_dict

    path = comfy_server.host / "models" / "diffusion_models" / INT8_CKPT
    state = int8_convrot_state_dict(tiny_h3_model(seed=4, config=INT8_TINY_H3).state_dict(), groupsize=256)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return INT8_CKPT


def test_int8_reason_and_comfy_kitchen_release_are_whole_in_payload_log_and_status_box(
        comfy_server, int8_checkpoint, tmp_path):
    """An int8 ConvRot model on the CPU keeps stock's quantiser "not on a CUDA device": that sentence (once cut
    to its first letter) and comfy-kitchen's release line come back whole through the server's websocket, in its
    log, and in the text the status box renders from the payload."""
    graph = h3_graph(patch=patch_inputs("strided_nhd", "sdpa"), name="h3_int8_reason")
    graph["1"]["inputs"]["unet_name"] = int8_checkpoint
    stock_graph = h3_graph(patch=None, name="h3_int8_stock")
    stock_graph["1"]["inputs"]["unet_name"] = int8_checkpoint
    run = comfy_server.run_graph(graph)
    r = only_report(run)
    assert r["schema"] == 5 and r["int8_own_quantizer_calls"] == 0
    reasons = {row["reason"]: row["count"] for row in r["int8_stock_quantizer"]}
    assert list(reasons) == ["not on a CUDA device"] and reasons["not on a CUDA device"] >= 4 * STEPS, reasons
    kitchen = r["comfy_kitchen"]
    assert kitchen["release"] == version("comfy-kitchen") and kitchen["route"] in ("verified", "self_checked", "stock")
    assert (kitchen["reason"] is None) == (kitchen["route"] == "verified"), kitchen

    line = f"int8 ConvRot linears on stock's quantiser ({reasons['not on a CUDA device']} calls): not on a CUDA device"
    (kitchen_line,) = [m for m in r["messages"] if m.startswith(f"comfy-kitchen {kitchen['release']}: ")]
    assert line in r["messages"] and (kitchen["reason"] or "") in kitchen_line, r["messages"]
    log = comfy_server.log_path.read_text(errors="replace")
    for logged in (line, kitchen_line):
        assert f"[Sage Strided NHD] {logged}\n" in log, comfy_server.log_tail()

    box = status_box_lines(r, tmp_path)
    assert "why int8 ConvRot linears kept stock's quantiser: not on a CUDA device" in box, box
    assert any(b.startswith(f"comfy-kitchen {kitchen['release']}: ") and "int8 route" in b for b in box), box
    # no call took the route: neither the log nor the box may say it was verified for it, only that it did not run
    for said in (kitchen_line, *box):
        assert "verified for the int8 route" not in said, said
    if kitchen["route"] != "stock":
        assert "int8 route not run" in kitchen_line and any("int8 route not run" in b for b in box), (kitchen_line, box)
    if kitchen["reason"]:
        assert any(b.endswith(f": {kitchen['reason']}") for b in box), box

    stock = comfy_server.run_graph(stock_graph)
    assert stock.reports == []
    assert_latents_equal(run.latent("9"), stock.latent("9"), "int8 ConvRot model, patched vs stock")


def removed_value_notes(report: dict) -> list[str]:
    return [n["text"] for n in report["notes"] if n["code"] == "removed_value"]


def test_workflow_saved_with_removed_values_validates_runs_and_says_so(comfy_server):
    """An old workflow's node carries block_path "fused" and sage2_prep "fused_rotated" (values the node
    no longer offers): ComfyUI validates it (the node's validate_inputs, not the options list), it runs
    on exact / rotated with stock's bits, and the report (payload and log) says what was mapped, also in
    a later sampling run that reuses the cached node."""
    old = dict(patch_inputs(), block_path="fused", sage2_prep="fused_rotated")
    run = comfy_server.run_graph(h3_graph(patch=old, name="h3_removed_values"))
    r = only_report(run)
    assert r["block_path"] == "exact" and r["prep_mode"] == "rotated", r
    assert r["block_path_blocks"] == r["blocks_patched"] == 2
    notes = removed_value_notes(r)
    assert len(notes) == 2, r["notes"]
    assert any("block_path 'fused'" in n and "'exact'" in n for n in notes), notes
    assert any("sage2_prep 'fused_rotated'" in n and "'rotated'" in n for n in notes), notes
    assert all(n in r["messages"] for n in notes), r["messages"]
    log = comfy_server.log_path.read_text(errors="replace")
    assert all(f"[Sage Strided NHD] {n}" in log for n in notes), comfy_server.log_tail()
    # the next prompt (only the conditioning's nonce differs) takes the node's output from ComfyUI's cache
    again = comfy_server.run_graph(h3_graph(patch=old, name="h3_removed_values_again"))
    assert "3" in again.cached_nodes(), again.cached_nodes()  # the node did not run again: its patch did
    assert removed_value_notes(only_report(again)) == notes
    stock = comfy_server.run_graph(h3_graph(patch=None, name="h3_removed_values_stock"))
    assert_latents_equal(run.latent("9"), stock.latent("9"), "a removed block_path mapped to exact vs stock")

    current = only_report(comfy_server.run_graph(h3_graph(patch=dict(patch_inputs(), block_path="exact",
                                                                     sage2_prep="rotated"), name="h3_current_values")))
    assert removed_value_notes(current) == [], current["notes"]


def test_unknown_input_values_are_refused_at_validation(comfy_server):
    for name, value, offered in (("block_path", "bogus", "exact, attention_only"),
                                 ("sage2_prep", "fused_bogus", "exact, rotated")):
        body = comfy_server.refused(h3_graph(patch=dict(patch_inputs(), **{name: value}), name=f"h3_bad_{name}"))
        errors = body["node_errors"]["3"]["errors"]
        details = [e["details"] for e in errors if e["type"] == "custom_validation_failed"]
        assert any(f"{name} {value!r} is not one of {offered}" in d for d in details), body
        assert body["node_errors"]["3"]["class_type"] == "SageStridedNHDAttention"


# --- inputs as a new user wires them: linked values, JSON values, a MODEL that is not one, denoise 0 ------------
def linked(graph: dict, name: str, node: dict) -> dict:
    """``graph`` with our node's input ``name`` linked from ``node`` (added as node "30")."""
    graph["30"] = node
    graph["3"]["inputs"][name] = ["30", 0]
    return graph


def test_linked_block_path_and_sage2_prep_are_checked_when_their_value_arrives(comfy_server):
    """ComfyUI validates a linked input as None: the node takes it there and checks the value in execute. A valid
    value from core's switch runs; a removed value from a primitive runs its mapped value with the note; another
    value stops the run with an error naming the input and the values it takes."""
    switch = {"class_type": "ComfySwitchNode", "inputs": {"switch": True, "on_true": "attention_only",
                                                          "on_false": "exact"}}
    run = comfy_server.run_graph(linked(h3_graph(patch=patch_inputs(), name="h3_linked_switch"), "block_path", switch))
    r = only_report(run)
    assert r["block_path"] == "attention_only" and r["block_path_blocks"] == 0 and removed_value_notes(r) == [], r

    primitive = {"class_type": "SageNHDTestComboValue", "inputs": {"value": "fused_rotated"}}
    r = only_report(comfy_server.run_graph(linked(h3_graph(patch=patch_inputs(), name="h3_linked_removed"),
                                                  "sage2_prep", primitive)))
    assert r["prep_mode"] == "rotated", r
    assert removed_value_notes(r) == ["sage2_prep 'fused_rotated' was removed from the node: this workflow runs "
                                      "'rotated'"], r["notes"]

    for name, offered in (("block_path", "exact, attention_only"), ("sage2_prep", "exact, rotated")):
        bad = {"class_type": "SageNHDTestComboValue", "inputs": {"value": "bogus"}}
        run = comfy_server.run_graph(linked(h3_graph(patch=patch_inputs(), name=f"h3_linked_bad_{name}"), name, bad))
        assert not run.ok and run.reports == []
        assert run.error_message().strip() == (f"ValueError: Sage Strided NHD Attention: {name} 'bogus' is not one of "
                                       f"{offered}"), run.error_message()


@pytest.mark.parametrize("name, value, said", [
    ("block_path", {"path": "exact"}, "a JSON object {'path': 'exact'}"),
    ("sage2_prep", {"__value__": ["exact", "rotated"]}, "a list ['exact', 'rotated']"),
])
def test_a_json_object_or_list_value_is_refused_naming_the_input(comfy_server, name, value, said):
    body = comfy_server.refused(h3_graph(patch=dict(patch_inputs(), **{name: value}), name=f"h3_json_{name}"))
    details = [e["details"] for e in body["node_errors"]["3"]["errors"]]
    offered = {"block_path": "exact, attention_only", "sage2_prep": "exact, rotated"}[name]
    assert any(f"{name} takes one of {offered} (text); it got {said}" in d for d in details), body


@pytest.mark.parametrize("kind, said", [
    ("clip", "got a comfy.sd.CLIP object, not a diffusion model"),
    ("vae", "got a comfy.sd.VAE object, not a diffusion model"),
    ("text_encoder_model", "got a MODEL whose model (Linear) has no diffusion model"),
])
def test_a_model_that_is_not_a_diffusion_model_gets_the_packs_message(comfy_server, kind, said):
    wrong = ("SageNHDTestNotADiffusionModel", {"kind": kind})
    run = comfy_server.run_graph(h3_graph(patch=patch_inputs(), name=f"h3_not_dit_{kind}", extra_model_nodes=[wrong]))
    assert not run.ok and run.reports == []
    msg = run.error_message()
    assert msg.startswith("TypeError: Sage Strided NHD Attention: the model input ") and said in msg, msg
    assert "Load Diffusion Model" in msg, msg  # what to do


def test_a_run_at_denoise_0_reports_that_no_model_call_was_made(comfy_server, tmp_path):
    """The sampler returns its latent before any wrapper runs: at the prompt's end the node's report says it ran and
    no sampling run used its model, in the payload, the log and the status box. A later run samples as before."""
    from comfyui_sage_strided_nhd.nodes.report import NO_MODEL_CALLS

    graph = h3_graph(patch=patch_inputs("hnd", "sdpa", refiner=False), name="h3_denoise_0")
    graph["6"]["inputs"]["denoise"] = 0.0
    run = comfy_server.run_graph(graph)
    assert "3" not in run.cached_nodes(), run.cached_nodes()
    r = only_report(run)
    assert r["status"] == "no_model_calls" and r["attention_calls"] == 0 and r["node_id"] == "3", r
    assert r["messages"][-1] == NO_MODEL_CALLS and "denoise 0" in NO_MODEL_CALLS, r["messages"]
    assert f"[Sage Strided NHD] {NO_MODEL_CALLS}\n" in comfy_server.log_path.read_text(errors="replace")
    box = status_box_lines(r, tmp_path)
    assert box[0] == f"ran: {NO_MODEL_CALLS}", box
    assert not any("no report" in b or "did not run" in b for b in box), box

    again = dict(graph, **{"4": dict(graph["4"], inputs=dict(graph["4"]["inputs"], nonce="h3_denoise_1"))})
    again["6"] = dict(graph["6"], inputs=dict(graph["6"]["inputs"], denoise=1.0))
    r = only_report(comfy_server.run_graph(again))
    assert r["status"] == "ok" and r["attention_calls"] > 0, r


# --- rule 10: loaders that run the model's forward themselves (stand-ins: tests/host_helper_nodes.py) --------
def after_our_node(graph: dict, class_type: str) -> dict:
    """``graph`` with ``class_type`` between our node ("3") and the sampler, as node "21"."""
    graph["21"] = {"class_type": class_type, "inputs": {"model": ["3", 0]}}
    graph["6"]["inputs"]["model"] = ["21", 0]
    return graph


SP_ENTRY = ("an object patch of diffusion_model._forward: ", "MiniMaxH3SPUNETLoader.execute.<locals>.sp_entry)")


@pytest.mark.parametrize("loader, where, who, how", [
    ("SageNHDTestSGLangIntegrated", "before", "SGLang Diffusion's integrated mode",
     ("the diffusion model is a ", ".MiniMaxH3Executor object, not ComfyUI's MiniMaxH3Model)")),
    ("SageNHDTestRaylight", "before", "Raylight", ("diffusion_model._forward set on the model by ",
                                                  "raylight.diffusion_models.minimax.xdit_context_parallel.usp_dit_forward)")),
    ("SageNHDTestUlyssesSP", "before", "the MiniMax H3 Multi-GPU Loader (Ulysses SP)", SP_ENTRY),
    ("SageNHDTestUlyssesSP", "after", "the MiniMax H3 Multi-GPU Loader (Ulysses SP)", SP_ENTRY),
])
def test_a_loader_that_runs_the_forward_itself_gets_a_not_active_report(comfy_server, tmp_path, loader, where, who,
                                                                        how):
    """Placed before the node (seen when it executes: nothing is patched) or after it (seen when sampling starts: the
    patched forwards are never called), the report says the node is not active, who runs the forward and what on the
    model shows it (``how``: the start and the end of that, around the module the host named): in the payload, the
    log and the status box. The loader's run gives stock's latents."""
    name = f"h3_taken_{loader}_{where}"
    if where == "before":
        graph = h3_graph(patch=patch_inputs(), name=name, extra_model_nodes=[(loader, {})])
    else:
        graph = after_our_node(h3_graph(patch=patch_inputs(), name=name), loader)
    run = comfy_server.run_graph(graph)
    r = only_report(run)
    assert r["status"] == "not_active", r
    (said,) = [n["text"] for n in r["notes"] if n["code"] == "forward_taken_away"]
    assert said.startswith(f"{who} runs the model's forward ({how[0]}") and said.endswith(how[1]), said
    line = f"not active: {said}. This node's patches are not reached through that forward"
    (logged,) = [m for m in r["messages"] if m.startswith("not active: ")]
    assert logged.startswith(line), r["messages"]
    assert f"[Sage Strided NHD] {logged}\n" in comfy_server.log_path.read_text(errors="replace")
    box = status_box_lines(r, tmp_path)
    assert box[0] == f"not active: {said}", box
    if where == "before":  # nothing patched: nothing counted
        assert r["blocks_patched"] == r["attention_calls"] == 0 and not any(b.startswith("ran:") for b in box), box
    else:  # no DiT block call came; ComfyUI's conditioning ran the text refiner through its patched forwards
        assert r["blocks_patched"] == 2 and r["attention_calls"] == r["backends_ran"]["sdpa"] > 0, r
        assert r["attention_calls"] % r["refiner_blocks_patched"] == 0 and "ran: sdpa" in box[1], box

    stock = comfy_server.run_graph(h3_graph(patch=None, name=f"{name}_stock"))
    assert_latents_equal(run.latent("9"), stock.latent("9"), f"{loader} ({where} the node) vs stock")


def test_no_call_reaching_the_installed_patch_is_said_with_its_likely_cause(comfy_server, tmp_path):
    """A DIFFUSION_MODEL wrapper that runs a replica instead of the model: nothing on the model shows it, the patch
    stays installed and no call reaches it; the report says so, naming the likely cause, in the log and the box. (The
    text refiner is left unpatched: ComfyUI's conditioning runs it outside the model's forward.)"""
    from comfyui_sage_strided_nhd.nodes.report import NO_CALLS_CAUSE

    graph = h3_graph(patch=patch_inputs(refiner=False), name="h3_wrapper_replica")
    run = comfy_server.run_graph(after_our_node(graph,
                                                "SageNHDTestWrapperRunsReplica"))
    r = only_report(run)
    assert r["status"] == "no_attention_calls" and r["blocks_patched"] == 2 and r["notes"] == [], r
    line = f"no attention call went through the patched H3 forwards this run: {NO_CALLS_CAUSE}"
    assert r["messages"][-1] == line and "DIFFUSION_MODEL wrapper" in line, r["messages"]
    assert f"[Sage Strided NHD] {line}\n" in comfy_server.log_path.read_text(errors="replace")
    box = status_box_lines(r, tmp_path)
    assert box[0] == "ran: nothing: no attention call went through the patch" and NO_CALLS_CAUSE in box, box
