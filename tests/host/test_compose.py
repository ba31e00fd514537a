"""The node with other attention patches stacked on the same model, in a real ComfyUI server.

One test per rule of nodes/conflicts.py, each in both orders (the other node before and
after this one) and, where the rule covers it, on H3 (forward patch) and on Wan (override
path). The other patches are stand-in nodes from tests/host_helper_nodes.py. Skipped, with
the reason, when no ComfyUI host is found (see tests/host_fixtures.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from host_fixtures import (H3_CKPT, TINY_H3, TINY_WAN, WAN_CKPT, patch_inputs, require_host, tiny_h3_model,
                           write_checkpoint)

STEPS = 2
PREF_CKPT = "sage_nhd_test_h3_pref.safetensors"  # its own file: the preference stand-in mutates the loaded model
SAGE = "SageStridedNHDAttention"


def chain_graph(family: str, nodes: list, name: str, *, ckpt: str | None = None, steps: int = STEPS) -> dict:
    """UNETLoader -> nodes (in order) -> KSampler -> save latent tensors (node "9")."""
    ckpt = ckpt or (H3_CKPT if family == "h3" else WAN_CKPT)
    g = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": ckpt, "weight_dtype": "default"}}}
    model = ["1", 0]
    for i, (cls, inputs) in enumerate(nodes):
        nid = str(30 + i)
        g[nid] = {"class_type": cls, "inputs": dict(inputs, model=model)}
        model = [nid, 0]
    dim = TINY_H3["text_dim"] if family == "h3" else TINY_WAN["text_dim"]
    g["4"] = {"class_type": "SageNHDTestConditioning", "inputs": {"seed": 3, "tokens": 8, "dim": dim, "nonce": name}}
    if family == "h3":
        g["5"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": 5}}
    else:
        g["5"] = {"class_type": "EmptyHunyuanLatentVideo",
                  "inputs": {"width": 32, "height": 32, "length": 5, "batch_size": 1}}
    g["6"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": 7, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["4", 0], "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}}
    g["9"] = {"class_type": "SageNHDTestSaveLatentTensors", "inputs": {"samples": ["6", 0], "name": name}}
    return g


def ordered(other: tuple, order: str, patch: dict | None = None) -> list:
    ours = (SAGE, patch or patch_inputs())
    return [other, ours] if order == "before" else [ours, other]


def counts(server, name: str) -> dict:
    path = server.output_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def notes_text(report: dict) -> list[str]:
    """The sentences of a report's notes (schema 3: {"code", "text"} each)."""
    assert all(set(n) == {"code", "text"} for n in report["notes"]), report["notes"]
    return [n["text"] for n in report["notes"]]


def assert_latents_equal(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), f"{what}: streams {sorted(a)} vs {sorted(b)}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs, max abs {(a[k] - b[k]).abs().max().item()}"


def only_report(run) -> dict:
    assert len(run.reports) == 1, f"expected one report, got {len(run.reports)}: {run.reports}\n{run.server.log_tail()}"
    return run.reports[0]


def ok_report(run) -> dict:
    assert run.ok, f"graph failed: {run.error_message()}\n{run.server.log_tail()}"
    return only_report(run)


def assert_refused(run, *needles):
    assert not run.ok, "the graph should have been refused"
    msg = run.error_message()
    assert "PatchConflictError" in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


@pytest.fixture(scope="module")
def stock(comfy_server):
    """Stock latents per family (no attention patch at all)."""
    return {f: comfy_server.run_graph(chain_graph(f, [], f"compose_stock_{f}")).latent("9") for f in ("h3", "wan")}


@pytest.fixture(scope="module")
def pref_ckpt(comfy_server):
    """A copy of the tiny H3 checkpoint (same weights) for the graphs that give it a preference."""
    write_checkpoint(tiny_h3_model(seed=1), require_host() / "models" / "diffusion_models" / PREF_CKPT)
    return PREF_CKPT


# --- rule 3: another node's attention override -------------------------------------------------
@pytest.mark.parametrize("family", ["h3", "wan"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_foreign_override_is_refused_in_either_order(comfy_server, family, order):
    name = f"fo_{family}_{order}"
    other = ("SageNHDTestForeignOverride", {"name": name, "chain_previous": False})
    run = comfy_server.run_graph(chain_graph(family, ordered(other, order), name))
    assert_refused(run, "other_backend_override", "attention override")
    assert counts(comfy_server, name) == {}, "the refused graph must not sample"
    if order == "after":  # seen when sampling starts: the run is reported as failed, with the reason
        r = only_report(run)
        assert r["status"] == "failed" and r["attention_calls"] == 0
        assert any("PatchConflictError" in m for m in r["messages"]), r["messages"]
    else:  # seen when the node executes: nothing sampled, nothing reported
        assert run.reports == []


def test_h3_refuses_a_chaining_override_added_after_it(comfy_server):
    # on H3 the patched forwards do not call optimized_attention: any other override would get no calls
    name = "fo_h3_wrapping"
    other = ("SageNHDTestForeignOverride", {"name": name, "chain_previous": True})
    run = comfy_server.run_graph(chain_graph("h3", ordered(other, "after"), name))
    assert_refused(run, "other_backend_override", "do not call optimized_attention")


def test_wan_override_that_wraps_ours_composes_and_says_so(comfy_server, stock):
    name = "fo_wan_wrapping"
    other = ("SageNHDTestForeignOverride", {"name": name, "chain_previous": True})
    run = comfy_server.run_graph(chain_graph("wan", ordered(other, "after"), name))
    r = ok_report(run)
    assert r["status"] == "ok" and r["attention_calls"] > 0 and r["backends_ran"] == {"sdpa": r["attention_calls"]}
    assert counts(comfy_server, name)["calls"] == r["attention_calls"]  # every call passed through both
    assert any("composed with another node's attention override" in n and "other_backend_override" in n
               for n in notes_text(r)), r["notes"]
    assert_latents_equal(run.latent("9"), stock["wan"], "wrapping override + node vs stock")


# --- rule 2: another node's object patch of the H3 forward --------------------------------------
@pytest.mark.parametrize("order", ["before", "after"])
def test_foreign_forward_patch_is_refused_in_either_order(comfy_server, order):
    name = f"ff_{order}"
    run = comfy_server.run_graph(chain_graph("h3", ordered(("SageNHDTestForeignH3Patch", {}), order), name))
    assert_refused(run, "blocks.0.attn.forward", "foreign_forward")
    if order == "after":
        r = only_report(run)
        assert r["status"] == "failed" and "replaced (after this node)" in " ".join(r["messages"])


# --- rule 8: another node's block forwards (KJNodes' Low VRAM Attention) --------------------------
@pytest.mark.parametrize("order", ["before", "after"])
def test_low_vram_block_patch_composes_in_either_order(comfy_server, stock, order):
    """Its block forwards run (handing the attention input over in a list), every attention call runs
    this node's forward, the result equals stock, and the report names what was composed."""
    name = f"lv_{order}"
    run = comfy_server.run_graph(chain_graph("h3", ordered(("SageNHDTestLowVramBlockPatch", {"name": name}), order),
                                             name))
    r = ok_report(run)
    # before this node its stock-equal block forwards are taken over by the block fast path (rule 9);
    # after it, they replace the fast path and call this node's attention (rule 8)
    block_calls = 0 if order == "before" else STEPS * TINY_H3["num_layers"]
    assert counts(comfy_server, name).get("block_calls", 0) == block_calls, counts(comfy_server, name)
    assert r["block_path_blocks"] == (TINY_H3["num_layers"] if order == "before" else 0), r
    assert r["attention_calls"] == STEPS * (TINY_H3["num_layers"] + TINY_H3["token_refiner_num_layers"]), r
    codes = {n["code"] for n in r["notes"]}
    assert ("block_forward_taken_over" if order == "before" else "block_forwards") in codes, r["notes"]
    # before this node, its stock-equal attention forwards were taken over (and said so); after it, it kept ours
    assert ("forward_taken_over" in codes) == (order == "before"), r["notes"]
    assert any("Low VRAM" in t for t in notes_text(r)) == (order == "before"), r["notes"]
    assert_latents_equal(run.latent("9"), stock["h3"], f"low-VRAM stand-in {order} the node vs stock")


# --- rule 9: another node's MLP forward (KJNodes' Chunk FeedForward) inside the block fast path ----
@pytest.mark.parametrize("order", ["before", "after"])
def test_chunk_feedforward_runs_inside_the_block_fast_path_in_either_order(comfy_server, stock, order):
    name = f"cff_{order}"
    alone = comfy_server.run_graph(chain_graph("h3", [("SageNHDTestChunkFeedForward", {"name": f"{name}_alone",
                                                                                        "chunks": 3})], f"{name}_alone"))
    other = ("SageNHDTestChunkFeedForward", {"name": name, "chunks": 3})
    run = comfy_server.run_graph(chain_graph("h3", ordered(other, order), name))
    r = ok_report(run)
    assert counts(comfy_server, name).get("mlp_calls") == STEPS * TINY_H3["num_layers"], counts(comfy_server, name)
    assert r["block_path_blocks"] == TINY_H3["num_layers"], r
    assert "mlp_forward_composed" in {n["code"] for n in r["notes"]}, r["notes"]
    # its fp32 chunked GEMMs need not give stock's bits on the CPU: the node must add no difference of its own
    assert_latents_equal(run.latent("9"), alone.latent("9"), f"chunk feedforward stand-in {order} the node vs alone")


def test_attention_only_block_path_leaves_the_blocks_alone(comfy_server, stock):
    run = comfy_server.run_graph(chain_graph("h3", [(SAGE, dict(patch_inputs(), block_path="attention_only"))],
                                             "attention_only"))
    r = ok_report(run)
    assert r["block_path_blocks"] == 0 and r["block_path"] == "attention_only", r
    assert "block_path_off" in {n["code"] for n in r["notes"]}, r["notes"]
    assert_latents_equal(run.latent("9"), stock["h3"], "attention-only vs stock")


# --- rule 4: core Model Sparse Attention --------------------------------------------------------
@pytest.mark.parametrize("order", ["before", "after"])
def test_sparse_attention_composes_on_h3_in_either_order(comfy_server, stock, order):
    name = f"sp_h3_{order}"
    other = ("SageNHDTestSparseAttention", {"name": name, "dense_blocks": "1"})
    run = comfy_server.run_graph(chain_graph("h3", ordered(other, order), name))
    r = ok_report(run)
    c = counts(comfy_server, name)
    # block 0 runs the sparse node's attention= (not counted here); block 1 and the refiner run ours, every step
    assert c.get("block_sparse") == STEPS, c
    assert r["attention_calls"] == STEPS * (1 + TINY_H3["token_refiner_num_layers"]), r
    assert r["blocks_patched"] == 2 and r["status"] == "ok"
    assert r["block_path_blocks"] == 2, r  # block 0 runs the fast path with the sparse node's attention=
    assert any("Model Sparse Attention" in n for n in notes_text(r)), r["notes"]
    assert_latents_equal(run.latent("9"), stock["h3"], "sparse stand-in + node vs stock")


@pytest.mark.parametrize("order", ["before", "after"])
def test_sparse_attention_composes_on_wan_in_either_order(comfy_server, stock, order):
    name = f"sp_wan_{order}"
    other = ("SageNHDTestSparseAttention", {"name": name, "dense_blocks": ""})
    run = comfy_server.run_graph(chain_graph("wan", ordered(other, order), name))
    r = ok_report(run)
    c = counts(comfy_server, name)
    assert c.get("sparse", 0) > 0 and c.get("dense", 0) > 0, c
    assert r["attention_calls"] == c["dense"], (r, c)  # its dense calls fall back to this node
    assert any("Model Sparse Attention" in n for n in notes_text(r)), r["notes"]
    assert_latents_equal(run.latent("9"), stock["wan"], "sparse stand-in + node vs stock (Wan)")


# --- rule 5: other block replaces on H3 -----------------------------------------------------------
# (covered by the sparse stand-in above: its block replaces route block 0 away from the node's forward,
#  and only the calls that really ran here are counted)


# --- rule 6: the checkpoint's attention preference ------------------------------------------------
@pytest.mark.parametrize("order", ["before", "after"])
def test_checkpoint_preference_is_honoured_with_auto(comfy_server, pref_ckpt, order):
    name = f"pref_auto_{order}"
    pref = ("SageNHDTestAttentionPreference", {"config": '{"attention": "comfy_kitchen_int8"}', "blocks": "0",
                                               "name": name})
    run = comfy_server.run_graph(chain_graph("h3", ordered(pref, order, patch_inputs(backend="auto")), name,
                                             ckpt=pref_ckpt))
    r = ok_report(run)
    notes = " | ".join(notes_text(r))
    assert "checkpoint attention preference (comfy_attention.config 'comfy_kitchen_int8') on blocks 0: honoured" in notes
    # block 0 asked for comfy_kitchen_int8 first: on this CPU it cannot run, which is a fallback (not an auto skip)
    fb = {f["backend"]: f for f in r["fallbacks"]}
    assert fb["comfy_kitchen_int8"]["count"] == STEPS, r["fallbacks"]
    assert r["backends_ran"] == {"sdpa": r["attention_calls"]}
    stock_run = comfy_server.run_graph(chain_graph("h3", [pref], name + "_stock", ckpt=pref_ckpt))
    assert_latents_equal(run.latent("9"), stock_run.latent("9"), "preference honoured vs stock")


def test_explicit_backend_overrides_the_preference_and_says_so(comfy_server, pref_ckpt):
    name = "pref_explicit"
    pref = ("SageNHDTestAttentionPreference", {"config": '{"attention": "comfy_kitchen_int8"}', "blocks": "0,1",
                                               "name": name})
    run = comfy_server.run_graph(chain_graph("h3", ordered(pref, "before", patch_inputs(backend="sdpa")), name,
                                             ckpt=pref_ckpt))
    r = ok_report(run)
    assert any("on blocks 0-1: overridden by the node's back-end sdpa" in n for n in notes_text(r)), r["notes"]
    assert all(f["backend"] != "comfy_kitchen_int8" for f in r["fallbacks"]), r["fallbacks"]


def test_unsupported_preference_is_ignored_with_a_note(comfy_server, pref_ckpt):
    name = "pref_unknown"
    pref = ("SageNHDTestAttentionPreference", {"config": '{"attention": "flash_magic"}', "blocks": "1", "name": name})
    r = ok_report(comfy_server.run_graph(chain_graph("h3", ordered(pref, "before"), name, ckpt=pref_ckpt)))
    assert any("'flash_magic'" in n and "ignored" in n for n in notes_text(r)), r["notes"]


# --- rule 7: another node's object patch of comfy_attention.function ------------------------------
@pytest.mark.parametrize("order", ["before", "after"])
def test_foreign_comfy_attention_function_is_refused(comfy_server, pref_ckpt, order):
    name = f"cf_foreign_{order}"
    pref = ("SageNHDTestAttentionPreference", {"config": "", "blocks": "", "name": name})
    fn = ("SageNHDTestComfyAttentionFunction", {"kind": "foreign", "block": 0})
    nodes = [pref] + ordered(fn, order)
    run = comfy_server.run_graph(chain_graph("h3", nodes, name, ckpt=pref_ckpt))
    assert_refused(run, "blocks.0.attn.comfy_attention.function", "other_pack_attention")


def test_comfy_attention_function_of_comfyui_is_taken_as_the_preference(comfy_server, pref_ckpt):
    name = "cf_known"
    pref = ("SageNHDTestAttentionPreference", {"config": "", "blocks": "", "name": name})
    fn = ("SageNHDTestComfyAttentionFunction", {"kind": "comfy_kitchen_int8", "block": 1})
    r = ok_report(comfy_server.run_graph(chain_graph("h3", [pref] + ordered(fn, "after", patch_inputs(backend="auto")),
                                                     name, ckpt=pref_ckpt)))
    assert any("attention_comfy_kitchen_int8" in n and "on blocks 1: honoured" in n for n in notes_text(r)), r["notes"]


# --- interrupted and failed runs ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["h3", "wan"])
@pytest.mark.parametrize("kind,status", [("interrupt", "interrupted"), ("error", "failed")])
def test_interrupted_and_failed_runs_are_reported_as_such(comfy_server, family, kind, status):
    name = f"raise_{family}_{kind}"
    raiser = ("SageNHDTestRaiseWhileSampling", {"kind": kind, "at_call": 2})
    run = comfy_server.run_graph(chain_graph(family, ordered(raiser, "after"), name))
    assert not run.ok
    r = only_report(run)
    assert r["status"] == status, r
    assert r["attention_calls"] > 0  # the first model call ran through the patch
    if kind == "error":
        assert "stand-in failure while sampling" in run.error_message()
        assert any("failed: RuntimeError: stand-in failure" in m for m in r["messages"]), r["messages"]
    else:
        assert any("interrupted" in m for m in r["messages"]), r["messages"]
    log = comfy_server.log_path.read_text(errors="replace")
    assert f"the sampling run {'was interrupted' if kind == 'interrupt' else 'failed'}" in log
