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

from benchmarks import schema
from benchmarks.h3_reference_run import REFERENCE_COPY, reference_for
from host_fixtures import require_host, tiny_h3_model, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--tiny", "--device", "cpu", "--backend", "sdpa", "--reps", "2", "--warmup", "1",
        "--attention-reps", "2", "--reps-2-step", "2", "--reps-12-step", "1"]


def run_harness(tmp_path: Path, *extra: str, env_layout: str | None = None):
    host = require_host()
    out = tmp_path / "tiny.json"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "H3_SAGE_QKV_LAYOUT")}
    if env_layout:
        env["H3_SAGE_QKV_LAYOUT"] = env_layout
    proc = subprocess.run([sys.executable, "-m", "benchmarks.h3_reference_run", "--comfyui", str(host),
                           "--out", str(out), *FAST, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), f"no report written (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory):
    return run_harness(tmp_path_factory.mktemp("bench"))


def test_ab_run_completes_every_section(ab_run):
    proc, data = ab_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["errors"] == {}
    assert data["sections_completed"] == ["capture", "isolated_attention_layout", "real_block_results",
                                          "profiler_block_recapture", "sampling_2_step", "sampling_12_step"]


def test_ab_report_follows_the_reference_schema(ab_run):
    _, data = ab_run
    problems = schema.check_against_reference(data, reference_for(data, schema.load_reference(REFERENCE_COPY)),
                                              allow_null=schema.CUDA_ONLY)
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


def test_chart_beside_the_report(ab_run):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: the run cannot draw its chart")
    _, data = ab_run
    png = Path(data["chart"])
    assert png.suffix == ".png" and png.read_bytes()[:4] == b"\x89PNG"


def test_layout_from_environment_measures_one_layout(tmp_path):
    proc, data = run_harness(tmp_path, "--sections", "blocks", "--no-chart", env_layout="hnd")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["layout"] == "hnd" and data["layouts_measured"] == ["hnd"]
    row = data["real_block_results"][0]
    assert row["hnd_p50_seconds"] > 0 and "strided_nhd_p50_seconds" not in row
    assert data["validation"]["blocks_stock_vs_hnd"] == "bit-exact"


def test_setup_failure_still_writes_a_report(tmp_path):
    proc, data = run_harness(tmp_path, "--checkpoint", str(tmp_path / "missing.safetensors"), "--no-chart")
    assert proc.returncode != 0
    assert "setup" in data["errors"] and "missing.safetensors" in data["errors"]["setup"]["error"]
    assert data["device"].startswith("CPU") and data["sections_completed"] == []


def test_checkpoint_weights_are_loaded_like_unetloader(comfy_inprocess, tmp_path):  # noqa: F811
    ckpt = tmp_path / "h3_tiny.safetensors"
    write_checkpoint(tiny_h3_model(seed=3), ckpt)
    proc, data = run_harness(tmp_path, "--checkpoint", str(ckpt), "--sections", "blocks,sampling_2_step",
                             "--no-chart")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["model"]["source"] == f"checkpoint {ckpt}"
    assert data["model"]["config"]["text_dim"] == 32 and data["model"]["config"]["num_layers"] == 2
    assert data["validation"]["blocks_0_1"] == "bit-exact"
    assert data["validation"]["full_2_block_two_step_trajectory"] == "identical video and audio checksums"
    # sections the run was not asked for (isolated, profiler, 12 steps) are not reported missing
    assert data["reference_schema"] == "follows the reference report's keys and types"


def test_int8_convrot_weights_give_stock_bits_in_both_layouts(tmp_path):
    """The bundled workflows' weight format (int8_tensorwise + convrot linears through ComfyUI's
    mixed_precision_ops and comfy-kitchen int8_linear): blocks and 2-step sampling equal stock's bits."""
    proc, data = run_harness(tmp_path, "--weights", "int8_convrot", "--sections", "blocks,sampling_2_step",
                             "--stock-sampling")
    assert proc.returncode == 0 and data["errors"] == {}, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert data["model"]["source"].startswith("random int8_convrot weights")
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
