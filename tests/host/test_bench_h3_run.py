"""End to end: the H3 reference-run harness on a tiny H3 in a real ComfyUI, on the CPU.

Runs ``python -m benchmarks.h3_reference_run --tiny`` in a fresh interpreter (ComfyUI's flags are
per process) with the ``sdpa`` back-end, which stock ComfyUI also runs when started with
``--use-pytorch-cross-attention``; so all three variants must give the same bits. The report
must follow the reference report's schema.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.h3_reference_run import REFERENCE_COPY, reference_for
from benchmarks.report import CUDA_ONLY, check_against_reference, load_reference
from devkit.h3 import packed_token_count
from host_fixtures import import_comfy, require_host, run_ahead, tiny_h3_model, write_checkpoint
from peer_stand_in import write_stand_in

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--tiny", "--device", "cpu", "--backend", "sdpa", "--reps", "2", "--warmup", "1",
        "--attention-reps", "2", "--reps-2-step", "2", "--reps-12-step", "1"]


def run_harness(tmp_path: Path, *extra: str):
    host = require_host()
    out = tmp_path / "tiny.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.h3_reference_run", "--comfyui", str(host),
                           "--out", str(out), *FAST, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"no report written (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


# Each run is a fixture started ahead (host_fixtures.run_ahead): the runs overlap the tests this process runs.
@run_ahead
def ab_run(folder):
    return run_harness(folder)


def test_ab_run_completes_every_section(ab_run):
    proc, data = ab_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["errors"] == {}
    assert data["sections_completed"] == ["capture", "isolated_attention_layout", "real_block_results",
                                          "profiler_block_recapture", "sampling_2_step", "sampling_12_step"]


def test_ab_report_follows_the_reference_schema(ab_run):
    _, data = ab_run
    problems = check_against_reference(data, reference_for(data, load_reference(REFERENCE_COPY)), allow_null=CUDA_ONLY)
    assert problems == []
    assert data["reference_schema"] == "follows the reference report's keys and types"


def test_ab_report_measures_the_real_h3_code(ab_run):
    _, data = ab_run
    assert data["model"]["class"] == "MiniMaxH3Model"
    assert data["packed_tokens"] == data["packed_rows_expected"]["total"] == 32
    assert data["patch"]["function"] == "nodes.h3_patch.patch_model"
    assert data["patch"]["blocks_patched"] == 2 and data["patch"]["refiner_blocks_patched"] == 2
    assert data["stock_attention"] == "attention_pytorch"
    assert data["attention"] == "sdpa"  # what the patched forwards actually ran
    assert [b["block"] for b in data["real_block_results"]] == [0, 1]  # first, middle and last of 2 blocks
    for key in ("sampling_2_step", "sampling_12_step"):
        s = data[key]
        assert (s["sampler"], s["scheduler"], s["seed"]) == ("res_multistep", "simple", 440420)
        assert s["hnd_seconds"] > 0 and s["strided_nhd_seconds"] > 0
    assert data["sampling_2_step"]["order"] == ["hnd", "strided_nhd", "strided_nhd", "hnd"]
    assert len(data["sampling_12_step"]["runs"]) == 2
    # the profiler saw the four layout copies of the HND baseline that strided NHD does not make
    copies = data["profiler_block_recapture"]["large_copy_ops"]
    assert copies["hnd"] - copies["strided_nhd"] == 4
    assert data["dataflow"]["removed_copies_per_block"] == 4


def test_ab_report_validates_equality_between_layouts_and_stock(ab_run):
    _, data = ab_run
    v = data["validation"]
    assert v["isolated_attention"] == "bit-exact"
    assert v["blocks_0_1"] == "bit-exact"  # named for the blocks compared and the 2-block model sampled
    assert v["blocks_stock_vs_strided_nhd"] == "bit-exact"
    assert v["full_2_block_two_step_trajectory"] == "identical video and audio checksums"
    assert v["canonical_12_step_trajectory"] == "identical video and audio checksums"
    assert v["patch_reverted"].startswith("no attention forward left patched")
    assert v["outputs_finite"].startswith("all ")
    s2 = data["sampling_2_step"]
    assert s2["hnd_checksums"] == s2["strided_nhd_checksums"] == s2["checksums"]


def test_ab_run_on_cpu_ends_with_what_ran_and_the_equality_not_timings(ab_run):
    proc, data = ab_run
    assert "2-step hnd run 1/4: step 2/2" in proc.stdout
    tail = proc.stdout.strip().splitlines()[-8:]
    cells = [line.split() for line in tail]
    rows = {c[0]: c for c in cells if len(c) >= 4 and c[0] in ("hnd", "strided_nhd") and c[1] != "vs"}
    assert rows["hnd"][1] == rows["strided_nhd"][1] == "sdpa" and rows["hnd"][3:] == rows["strided_nhd"][3:]
    assert "hnd vs strided_nhd: identical latents" in tail
    assert not any("(p50)" in line or " ms" in line for line in tail), "a CPU run must not present timings"
    assert tail[-1].startswith("report: ")


@run_ahead
def setup_failure_run(folder):
    return run_harness(folder, "--checkpoint", str(folder / "missing.safetensors"))


def test_setup_failure_still_writes_a_report(setup_failure_run):
    proc, data = setup_failure_run
    assert proc.returncode != 0
    assert "setup" in data["errors"] and "missing.safetensors" in data["errors"]["setup"]["error"]
    assert data["device"].startswith("CPU") and data["sections_completed"] == []


def _tiny_checkpoint(folder) -> None:
    import_comfy(require_host())  # ComfyUI's own model classes, in this process before the tests start
    write_checkpoint(tiny_h3_model(seed=3), folder / "h3_tiny.safetensors")


@run_ahead(prepare=_tiny_checkpoint)
def checkpoint_run(folder):
    ckpt = folder / "h3_tiny.safetensors"
    return (*run_harness(folder, "--checkpoint", str(ckpt), "--sections", "blocks,sampling_2_step"), ckpt)


def test_checkpoint_weights_are_loaded_like_unetloader(checkpoint_run):
    proc, data, ckpt = checkpoint_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["model"]["source"] == f"checkpoint {ckpt}"
    assert data["model"]["config"]["text_dim"] == 32 and data["model"]["config"]["num_layers"] == 2
    assert data["validation"]["blocks_0_1"] == "bit-exact"
    assert data["validation"]["full_2_block_two_step_trajectory"] == "identical video and audio checksums"
    # sections the run was not asked for (isolated, profiler, 12 steps) are not reported missing
    assert data["reference_schema"] == "follows the reference report's keys and types"


@run_ahead
def int8_convrot_run(folder):
    return run_harness(folder, "--weights", "int8_convrot", "--sections", "blocks,sampling_2_step",
                       "--stock-sampling")


def test_int8_convrot_weights_give_stock_bits_in_both_layouts(int8_convrot_run):
    """The bundled workflows' weight format (int8_tensorwise + convrot linears through ComfyUI's
    mixed_precision_ops and comfy-kitchen int8_linear): blocks and 2-step sampling equal stock's bits."""
    proc, data = int8_convrot_run
    assert proc.returncode == 0 and data["errors"] == {}, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["model"]["source"].startswith("random int8_convrot weights") and data["weights"] == "int8_convrot"
    v = data["validation"]
    assert v["blocks_stock_vs_strided_nhd"] == "bit-exact" and v["blocks_0_1"] == "bit-exact"
    assert v["full_2_block_two_step_trajectory"] == "identical video and audio checksums"
    s2 = data["sampling_2_step"]
    assert s2["hnd_checksums"] == s2["strided_nhd_checksums"] == s2["checksums"]


def test_int8_convrot_state_dict_marks_exactly_the_four_block_linears():
    import torch

    from devkit import h3

    def randn(*shape):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))

    sd = {"blocks.0.attn.qkv_proj.weight": randn(6, 4), "blocks.0.attn.q_norm.weight": randn(4),
          "blocks.0.mlp.fc2.weight": randn(4, 8), "token_refiner.blocks.0.attn.qkv_proj.weight": randn(6, 4)}
    out = h3.int8_convrot_state_dict(sd, groupsize=4)
    assert out["blocks.0.attn.qkv_proj.weight"].dtype == out["blocks.0.mlp.fc2.weight"].dtype == torch.int8
    assert {"blocks.0.attn.qkv_proj.comfy_quant", "blocks.0.mlp.fc2.weight_scale"} <= set(out)
    assert out["blocks.0.attn.q_norm.weight"] is sd["blocks.0.attn.q_norm.weight"]  # norms stay
    assert out["token_refiner.blocks.0.attn.qkv_proj.weight"] is sd["token_refiner.blocks.0.attn.qkv_proj.weight"]
    scale = out["blocks.0.mlp.fc2.weight_scale"]
    assert (out["blocks.0.mlp.fc2.weight"].float() * scale - sd["blocks.0.mlp.fc2.weight"]).abs().max() <= scale / 2 + 1e-6


# --- the peer (KJNodes) through a stand-in, the long-sequence memory section ------------------------------
PEER_NAMES = ["kj_lowvram", "kj_lowvram_chunkff"]
PEER_TABLE = ["stock", "strided_nhd", "attention_only", *PEER_NAMES]


@run_ahead
def peer_run(folder):
    kj = write_stand_in(folder / "kjnodes")
    return run_harness(folder, "--peer-table", "--kjnodes", str(kj), "--sections", "blocks,profiler,sampling_2_step",
                       "--memory-at", "300")


def test_peer_table_takes_part_in_every_section(peer_run):
    proc, data = peer_run
    assert proc.returncode == 0 and data["errors"] == {}, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["sections_completed"] == ["capture", "real_block_results", "profiler_block_recapture",
                                          "sampling_2_step", "peak_memory_long_sequence"]
    assert data["layouts_measured"] == ["strided_nhd"]
    for row in data["real_block_results"]:
        assert all(row[f"{n}_p50_seconds"] > 0 for n in PEER_TABLE)
        assert sorted(row["peak_extra_bytes"]) == sorted(PEER_TABLE)
    prof = data["profiler_block_recapture"]
    assert sorted(prof["large_copy_ops"]) == sorted(PEER_TABLE) and "kj_lowvram_kernel_launches" in prof
    # sampled interleaved, ABBA over all five, stock among them
    forward = ["strided_nhd", "attention_only", *PEER_NAMES, "stock"]
    assert data["sampling_2_step"]["order"] == forward + forward[::-1]


def test_peer_variants_are_its_nodes_at_their_schema_defaults(peer_run):
    _, data = peer_run
    peer = data["peer"]
    assert peer["file"] == "nodes/minimax_nodes.py" and peer["git_commit"] is None and len(peer["sha256"]) == 64
    low = {"node": "MiniMaxLowVRAMAttention", "display_name": "MiniMax H3 Low VRAM Attention",
           "inputs": {"head_chunks": 3}}
    ff = {"node": "MiniMaxChunkFeedForward", "display_name": "MiniMax H3 Chunk FeedForward",
          "inputs": {"chunks": 5, "seq_threshold": 2048}}
    assert peer["variants"] == {"kj_lowvram": [low], "kj_lowvram_chunkff": [low, ff]}
    assert peer["attention"] == "attention_pytorch" and peer["same_attention_as_stock"] is True
    assert data["validation"]["peer_attention"].startswith("same kernel: the peer and stock call attention_pytorch")
    settings = data["variant_settings"]  # every field of the nodes.patch.Settings each variant ran with
    assert settings["strided_nhd"]["block_path"] == "exact" and settings["strided_nhd"]["prepared"] is True
    only = settings["attention_only"]
    assert (only["layout"], only["backend"], only["prep_mode"], only["block_path"]) == (
        "strided_nhd", "sdpa", "exact", "attention_only")
    assert data["attention_by_variant"]["kj_lowvram"] == "attention_pytorch (KJNodes' forward)"


def test_peer_and_block_paths_equal_stock_in_blocks_and_sampling(peer_run):
    _, data = peer_run
    v, s2 = data["validation"], data["sampling_2_step"]
    for name in PEER_TABLE[1:]:
        assert v[f"blocks_stock_vs_{name}"] == "bit-exact", name
        assert v[f"sampling_2_step_stock_vs_{name}"] == "identical video and audio checksums", name
        assert s2[f"stock_vs_{name}_identical"] is True and s2[f"{name}_checksums"] == s2["stock_checksums"]
    assert v["patch_reverted"].startswith("no attention forward left patched")


def test_memory_at_tokens_measures_one_block_per_variant_at_the_closest_frame_count(peer_run):
    _, data = peer_run
    m = data["peak_memory_long_sequence"]
    # 64x64 with 8 text tokens: 56 frames pack 262 rows, 73 frames 340; 262 is closer to 300
    assert (m["tokens_asked"], m["packed_tokens"], m["frames"], m["resolution"]) == (300, 262, 56, [64, 64])
    assert m["packed_rows_expected"]["total"] == 262
    assert m["order"] == ["strided_nhd", *PEER_NAMES, "attention_only", "stock"]  # the comparison first, stock last
    assert m["peak_extra_bytes"] == dict.fromkeys(m["order"]) and m["errors"] == {}  # no peaks off CUDA
    assert m["pack"] == "strided_nhd"


def test_tables_put_the_peer_beside_stock_and_the_pack(peer_run, tmp_path):
    from benchmarks import results_table

    proc, data = peer_run
    printed = results_table.run_tables(data, "peer")  # what the run prints last on a GPU
    path = tmp_path / "peer.json"
    path.write_text(json.dumps(data))
    blocks = results_table.blocks_table([path])  # docs/BENCHMARKS.md's table, a row per report
    assert blocks.startswith(printed.split("\n\n")[0])
    assert "| stock / strided_nhd | stock / attention_only | stock / kj_lowvram | stock / kj_lowvram_chunkff |" in blocks
    row = next(line for line in blocks.splitlines() if line.startswith("| peer | bf16 | 32 | 2 | "))
    assert row.endswith("| all bit-exact | - / - / - / - / - |"), row  # every variant gave stock's bits; no CUDA peaks
    assert ("- peer, one block at 262 tokens (56 frames), peak extra: strided_nhd -, kj_lowvram -, "
            "kj_lowvram_chunkff -, attention_only -, stock -") in blocks
    sampled = results_table.sampling_table([path])
    for name in PEER_TABLE[1:]:
        assert f"| bf16 | 2 | 2 | {name} | " in sampled and f"| bf16 | 2 | 2 | {name} | " in printed
    assert sampled.count("| identical |") == 4


@run_ahead
def int8_peer_12_step_run(folder):
    kj = write_stand_in(folder / "kjnodes")
    return run_harness(folder, "--weights", "int8_convrot", "--kjnodes", str(kj), "--layout", "strided_nhd",
                       "--sections", "sampling_12_step", "--stock-sampling")


def test_int8_convrot_peer_samples_12_steps_interleaved_with_stock(int8_peer_12_step_run):
    proc, data = int8_peer_12_step_run
    assert proc.returncode == 0 and data["errors"] == {}, proc.stdout[-3000:] + proc.stderr[-3000:]
    s12 = data["sampling_12_step"]
    assert s12["order"] == ["strided_nhd", *PEER_NAMES, "stock"] and s12["steps"] == 12
    for name in ["strided_nhd", *PEER_NAMES]:
        assert s12[f"stock_vs_{name}_identical"] is True, name
        assert data["validation"][f"sampling_12_step_stock_vs_{name}"] == "identical video and audio checksums"


# --- the options, parsed (no ComfyUI needed) ----------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--peer-table", "--no-stock"], "leave out --no-stock"),
    (["--kjnodes", "/nonexistent/kjnodes"], "no nodes/minimax_nodes.py under /nonexistent/kjnodes"),
    (["--sections", "blocks,memory"], "section memory needs --memory-at TOKENS"),
    (["--memory-at", "0"], "expected a positive token count"),
])
def test_bad_options_are_refused_with_the_reason(argv, message, capsys):
    from benchmarks.h3_reference_run import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_peer_table_sets_up_the_comparison(tmp_path):
    from benchmarks.h3_reference_run import parse_args

    kj = write_stand_in(tmp_path / "kjnodes")
    a = parse_args(["--peer-table", "--kjnodes", str(kj), "--backend", "sdpa", "--memory-at", "120000"])
    assert a.layout == "strided_nhd" and a.stock_sampling and a.peer_variants == PEER_NAMES
    assert a.variants == {"attention_only": {"layout": "strided_nhd", "backend": "sdpa",
                                             "block_path": "attention_only"}}
    assert a.sampled_extras == ["attention_only", *PEER_NAMES] and a.sections[-1] == "memory"
    assert parse_args(["--peer-table"]).peer_variants == []  # without a checkout: no peer, no error
    assert parse_args(["--peer-table", "--layout", "ab"]).layout == "ab"


def test_peer_module_loads_by_path_without_the_pack(tmp_path):
    """Under stub packages: the checkout's and nodes/' __init__ (which raise here) never run, and a
    relative import of a sibling module resolves inside the checkout."""
    import sys

    from benchmarks import peer

    root = write_stand_in(tmp_path / "kjnodes")
    (root / "nodes" / "minimax_nodes.py").write_text("from ..utility.helpers import check_head_chunks\n")
    try:
        module = peer.load_module(root)
        assert module.check_head_chunks.__module__ == f"{peer.PACKAGE}.utility.helpers"
        assert module.__file__ == str((root / "nodes" / "minimax_nodes.py").resolve())
    finally:
        for name in [n for n in sys.modules if n == peer.PACKAGE or n.startswith(peer.PACKAGE + ".")]:
            del sys.modules[name]


@run_ahead
def compiled_blocks_run(folder):
    import shutil
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor on the CPU needs a C++ compiler (g++), none found")
    return run_harness(folder, "--peer-table", "--sections", "blocks", "--compile-blocks")


def test_compiled_blocks_time_stock_and_the_pack_under_torch_compile(compiled_blocks_run):
    proc, data = compiled_blocks_run
    assert proc.returncode == 0 and data["errors"] == {}, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = data["compiled_block_results"]
    assert len(rows) == 1 and rows[0]["block"] == 0, rows
    row = rows[0]
    assert row["stock_p50_seconds"] > 0 and row["strided_nhd_p50_seconds"] > 0 and "stock_over_strided_nhd" in row
    assert set(row["peak_extra_bytes"]) == {"stock", "strided_nhd"}  # stock and the layouts, not the extras
    assert row["stock_vs_strided_nhd_relative_l2"] < 1e-2


# --- --first-contact: the README's first command (scripts/setup.sh) -----------------------------------------
GIB = 2**30


@pytest.mark.parametrize("free_gib, job, lengths, full_model, why", [
    (None, "tiny_cpu", [], False, "no CUDA GPU"),
    # a GPU without room for two full-width blocks at 8,192 tokens: the CPU job, and why
    (6.9, "tiny_cpu", [], False, "6.9 GiB free; 37,810 tokens need 14 GiB, 8,192 tokens need 7 GiB"),
    (7, "blocks", [8192], False, "7.0 GiB free; 37,810 tokens need 14 GiB"),  # an 8 GB card: 8,192 tokens only
    (13.9, "blocks", [8192], False, "13.9 GiB free; 37,810 tokens need 14 GiB"),
    (14, "blocks", [37810, 8192], False, "14.0 GiB free"),  # a 16 GB card: the bundled workflows' length too
    (78.7, "blocks", [37810, 8192], False, "78.7 GiB free"),  # an 80 GB H100: no room for the full model
    (80.1, "blocks", [37810, 8192], True, "80.1 GiB free"),  # an H200: the full model is sampled as well
])
def test_first_contact_plan_picks_the_run_by_free_memory(free_gib, job, lengths, full_model, why):
    import comfy_kitchen.tensor as ckt

    from benchmarks.h3_reference_run import FIRST_CONTACT_SHAPES, first_contact_plan

    plan = first_contact_plan(None if free_gib is None else int(free_gib * GIB))
    assert (plan["job"], plan["lengths"], plan["full_model"], plan["why"]) == (job, lengths, full_model, why)
    # fp8 scaled and W4A8 where this comfy-kitchen has their layouts (0.2.31 has both)
    kitchen = [f for f, layout in (("float8_e4m3fn", "TensorCoreFP8Layout"), ("asym_w4a8_int8", "AsymW4A8Int8Layout"))
               if hasattr(ckt, layout)]
    assert plan["formats"] == (["bf16", "int8_convrot", *kitchen] if job == "blocks" else ["bf16"])
    for tokens in lengths:  # each length's clip packs exactly that many tokens
        assert packed_token_count(*FIRST_CONTACT_SHAPES[tokens])["total"] == tokens


def test_first_contact_on_a_cpu_is_the_tiny_sampling_job_as_before():
    from benchmarks.h3_reference_run import parse_args

    fields = ("tiny", "device", "sections", "stock_sampling", "layout", "backend", "weights", "blocks",
              "width", "height", "frames", "text_tokens")
    fc = parse_args(["--first-contact", "--device", "cpu", "--backend", "auto"])
    before = parse_args(["--tiny", "--device", "cpu", "--backend", "auto", "--sections", "sampling_2_step",
                         "--stock-sampling"])  # scripts/setup.sh's CPU command before --first-contact
    assert [getattr(fc, f) for f in fields] == [getattr(before, f) for f in fields]
    assert fc.first_contact_plan["job"] == "tiny_cpu" and fc.first_contact_plan["why"] == "no CUDA GPU"
    assert before.first_contact_plan is None


def test_first_contact_on_a_gpu_sets_two_blocks_of_the_pack_beside_stock(monkeypatch):
    import torch

    from benchmarks import h3_reference_run as run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (22 * GIB, 24 * GIB))  # a 24 GB card
    a = run.parse_args(["--first-contact", "--device", "cuda", "--sections", "sampling_12_step"])
    assert (a.device, a.layout, a.blocks, a.weights, a.sections, a.tiny) == ("cuda", "strided_nhd", 2, "bf16", [], False)
    assert a.first_contact_plan["lengths"] == [37810, 8192] and not a.no_stock
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * GIB, 8 * GIB))  # too little: the CPU job
    small = run.parse_args(["--first-contact"])
    assert (small.device, small.tiny, small.sections) == ("cpu", True, ["sampling_2_step"])
    assert small.first_contact_plan["why"].startswith("5.0 GiB free; 37,810 tokens need 14 GiB")


@pytest.mark.parametrize("extra", [["--checkpoint", "x.safetensors"], ["--peer-table"], ["--kjnodes", "kj"]])
def test_first_contact_refuses_options_that_pick_another_run(extra, capsys):
    from benchmarks.h3_reference_run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--first-contact", "--device", "cpu", *extra])
    assert "--first-contact picks its own run" in capsys.readouterr().err


# The block job on the CPU: the harness's own main() with a tiny H3 and two tiny lengths standing in for
# 37,810 and 8,192 tokens, and the GPU's free memory given (the plan is the real one, fed 20 GiB).
FIRST_CONTACT_DRIVER = """
import sys
import benchmarks.h3_reference_run as run
plan = run.first_contact_plan
run.FIRST_CONTACT_SHAPES = {32: (64, 64, 5, 8), 110: (64, 64, 22, 8)}
run.FIRST_CONTACT_NEEDS = {32: 1, 110: 1}
run.first_contact_plan = lambda free: plan(20 * 2**30)
run.FIRST_CONTACT_KITCHEN_FORMATS = ("float8_e4m3fn",)  # W4A8 needs 256-wide inputs: the tiny H3's are 64
sys.exit(run.main(sys.argv[1:]))
"""


@run_ahead
def first_contact_run(folder):
    host = require_host()
    out = folder / "first-run.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, "-c", FIRST_CONTACT_DRIVER, "--first-contact", "--tiny", "--device", "cpu",
                           "--backend", "sdpa", "--reps", "2", "--warmup", "1", "--comfyui", str(host), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"no report written (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


def test_first_contact_measures_each_format_at_each_length_beside_stock(first_contact_run):
    proc, data = first_contact_run
    assert proc.returncode == 0 and data["errors"] == {}, proc.stdout[-3000:] + proc.stderr[-3000:]
    keys = [f"first_contact_{w}_{t}" for w in data["first_contact"]["formats"] for t in (32, 110)]
    assert data["first_contact"]["formats"][:2] == ["bf16", "int8_convrot"]
    assert data["sections_completed"] == keys
    assert data["first_contact"]["job"] == "blocks" and data["layouts_measured"] == ["strided_nhd"]
    for key in keys:
        run = data[key]
        assert run["packed_tokens"] == run["tokens_asked"] == int(key.rsplit("_", 1)[1])
        assert run["weights"] == key[len("first_contact_"):].rsplit("_", 1)[0] and run["pack"] == "strided_nhd"
        assert [b["block"] for b in run["blocks"]] == [0, 1]
        for b in run["blocks"]:  # stock and the pack, timed and compared on the same captured input
            assert b["stock_p50_seconds"] > 0 and b["strided_nhd_p50_seconds"] > 0
            assert b["stock_vs_strided_nhd_bit_exact"] is True
        assert run["pack_ran"].startswith("sdpa x")
    last = data["first_contact"]["formats"][-1]
    assert data["model"]["source"].startswith(f"random {last} weights") and data["model"]["blocks"] == 2
    assert "reference_schema" not in data  # the block job's sections are its own, not the reference's


def test_first_contact_prints_the_table_made_from_its_json(first_contact_run):
    from benchmarks.report import first_contact_table

    proc, data = first_contact_run
    table = first_contact_table(data)
    assert table in proc.stdout and proc.stdout.strip().splitlines()[-1].startswith("report: ")
    rows = [line.split() for line in table.splitlines() if line.startswith(("bf16 ", "int8_convrot "))]
    assert [r[:2] for r in rows] == [["bf16", "32"], ["bf16", "110"], ["int8_convrot", "32"], ["int8_convrot", "110"]]
    for row in rows:  # each row's numbers are its section's: p50s averaged over the blocks, their ratio
        blocks = data[f"first_contact_{row[0]}_{row[1]}"]["blocks"]
        stock, pack = (sum(b[f"{n}_p50_seconds"] for b in blocks) for n in ("stock", "strided_nhd"))
        assert row[2:6] == [f"{stock / 2 * 1e3:.2f}", f"{pack / 2 * 1e3:.2f}", f"{stock / pack:.3f}x", "yes"]
        assert row[6:] == ["-", "/", "-"]  # no peak memory off CUDA
    assert table.splitlines()[-1] == "lengths by memory: 20.0 GiB free"
