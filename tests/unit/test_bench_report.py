"""The benchmark's pure parts: schema check, ordering, the tables generated into docs/BENCHMARKS.md, token count."""

from __future__ import annotations

import copy
import os
import json
from pathlib import Path

import pytest
import torch

from benchmarks import measure, results_table
from devkit.h3 import FULL_H3, packed_token_count
from benchmarks.h3_reference_run import (REFERENCE_COPY, REFERENCE_KEYS_BY_SECTION, _section, parse_args,
                                         reference_for, validation_names)
from benchmarks.report import (CUDA_ONLY, NOT_APPLICABLE, RENAMED, Report, check_against_reference, correctness_table,
                               first_contact_table, load_reference, table_rows, text_table)
from benchmarks.sections import sampling_order
from benchmarks.step_timeline import kernel_family

ROOT = Path(__file__).resolve().parents[2]
# The project's shared copy of the reference report, where there is one: a shared/ folder in the
# checkout, or one beside it. The repo's copy (benchmarks/reference/) must be that file unchanged.
SHARED_COPIES = [base / "shared" / "reference" / REFERENCE_COPY.name for base in (ROOT, ROOT.parent)]


def reference() -> dict:
    return load_reference(REFERENCE_COPY)


def reference_shaped_report() -> dict:
    """The reference report rewritten with our key names, as a report of ours would carry them."""
    data = copy.deepcopy(reference())
    data["profiler_block_recapture"] = data.pop("nsight_block_recapture")
    s12 = data["sampling_12_step"]
    s12["hnd_seconds"] = s12.pop("component1_hnd_seconds")
    return data


def test_reference_copy_is_the_shared_reference_with_the_keys_the_harness_relies_on():
    ref = reference()
    shared = [p for p in SHARED_COPIES if p.is_file()]
    for path in shared:
        assert json.loads(path.read_text()) == ref, f"benchmarks/reference/{REFERENCE_COPY.name} differs from {path.name}"
    # with or without a shared copy here: the repo's copy has every key the schema and the harness name
    def walk(node, prefix=""):
        for key, value in node.items() if isinstance(node, dict) else ():
            yield prefix + key
            yield from walk(value, prefix + key + ".")

    paths = set(walk(ref))
    named = set(RENAMED) | set(NOT_APPLICABLE) | {
        key for keys in REFERENCE_KEYS_BY_SECTION.values() for key in keys}
    assert named <= paths, f"not in the reference copy: {sorted(named - paths)}"
    assert (ref["resolution"], ref["frames"], ref["packed_tokens"], ref["seed"]) == ([1344, 768], 124, 37810, 440420)
    assert [b["block"] for b in ref["real_block_results"]] == [0, 24, 49]


def test_report_with_every_reference_key_follows_schema():
    assert check_against_reference(reference_shaped_report(), reference()) == []


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d.pop("packed_tokens"), "missing packed_tokens"),
    (lambda d: d["real_block_results"][1].pop("speedup"), "missing real_block_results[].speedup"),
    (lambda d: d.update(seed="440420"), "seed: str"),
    (lambda d: d["sampling_2_step"].update(checksums=[1.0]), "sampling_2_step.checksums: 1 items"),
    (lambda d: d["sampling_12_step"].pop("hnd_seconds"), "missing sampling_12_step.hnd_seconds"),
    (lambda d: d["profiler_block_recapture"].update(hnd_kernel_launches=None), "hnd_kernel_launches: NoneType"),
])
def test_schema_check_names_what_differs(mutate, expected):
    data = reference_shaped_report()
    mutate(data)
    problems = check_against_reference(data, reference())
    assert any(expected in p for p in problems), problems


def test_cuda_only_measurements_may_be_null_when_allowed():
    data = reference_shaped_report()
    data["profiler_block_recapture"]["hnd_kernel_launches"] = None
    data["sampling_2_step"]["peak_allocated_bytes_saved"] = None
    assert check_against_reference(data, reference(), allow_null=CUDA_ONLY) == []


def test_full_size_shape_packs_37810_tokens():
    rows = packed_token_count(1344, 768, 124, 100)
    assert (rows["video"], rows["audio"], rows["total"]) == (37296, 414, 37810)
    assert FULL_H3["num_attention_heads"] * FULL_H3["attention_head_dim"] == 7168


def test_sampling_order_is_abba_and_hnd_first():
    assert sampling_order(["hnd", "strided_nhd"], 1) == ["hnd", "strided_nhd"]
    assert sampling_order(["hnd", "strided_nhd"], 2) == ["hnd", "strided_nhd", "strided_nhd", "hnd"]
    assert sampling_order(["hnd"], 3) == ["hnd", "hnd", "hnd"]


def test_interleaved_times_rotates_the_leading_variant():
    calls = []
    runners = {name: (lambda name=name: calls.append(name) or 1.0) for name in ("a", "b", "c")}
    times = measure.interleaved_times(runners, reps=3, warmup=0)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert times == {"a": [1.0] * 3, "b": [1.0] * 3, "c": [1.0] * 3}


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--sections", "blocks,warp"])
    assert parse_args(["--sections", "blocks, sampling_2_step"]).sections == ["blocks", "sampling_2_step"]


def test_report_is_written_after_each_section_and_keeps_errors(tmp_path):
    report = Report(tmp_path / "r.json")
    report.section("capture", {"seconds": 1.0})
    try:
        raise RuntimeError("CUDA error: an illegal memory access")
    except RuntimeError as exc:
        report.fail("real_block_results", exc)
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["capture"] == {"seconds": 1.0}
    assert "illegal memory access" in on_disk["errors"]["real_block_results"]["error"]
    assert on_disk["sections_completed"] == ["capture"]


def test_tables_show_measured_numbers():
    data = reference_shaped_report()
    rows = table_rows(data)
    assert ("block 24 (p50)", "-", "487.93 ms", "471.67 ms", "1.034x") in rows
    assert ("kernel launches per block", "-", "53", "49", "-4") in rows
    assert "12-step sampling" in text_table(data)


def test_doc_without_markers_is_refused(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        results_table.replace_between_markers(doc.read_text(), "table", "blocks")


def test_validation_names_say_what_ran():
    assert validation_names(50) == {"blocks_0_24_49": "blocks_0_24_49",
                                    "full_50_block_two_step_trajectory": "full_50_block_two_step_trajectory"}
    assert validation_names(2) == {"blocks_0_24_49": "blocks_0_1",
                                   "full_50_block_two_step_trajectory": "full_2_block_two_step_trajectory"}


def test_a_run_is_checked_only_for_the_sections_it_was_asked_to_make():
    # the CPU main job: a 2-block model, 2-step sampling only
    ref = reference_for({"sections_requested": ["sampling_2_step"], "model": {"blocks": 2}}, reference())
    assert "sampling_2_step" in ref and ref["validation"]["full_2_block_two_step_trajectory"]
    for gone in ("isolated_attention_layout", "real_block_results", "nsight_block_recapture", "sampling_12_step"):
        assert gone not in ref
    assert "removed_copies_per_block" not in ref["dataflow"]  # made by the isolated section
    assert set(ref["validation"]) == {"full_2_block_two_step_trajectory", "deployed_tests"}
    data = reference_shaped_report()
    for key in ("isolated_attention_layout", "real_block_results", "profiler_block_recapture", "sampling_12_step"):
        data.pop(key)
    data["dataflow"]["removed_copies_per_block"] = None
    data["validation"] = {"full_2_block_two_step_trajectory": "identical video and audio checksums"}
    assert check_against_reference(data, ref) == []
    # a section that was asked for and is absent is still reported
    asked_all = reference_for({"sections_requested": ["sampling_2_step", "sampling_12_step"], "model": {"blocks": 2}},
                              reference())
    assert any(p.startswith("missing sampling_12_step") for p in check_against_reference(data, asked_all))


def test_a_failing_section_does_not_lose_the_others(tmp_path):
    report = Report(tmp_path / "r.json")
    assert _section(report, "real_block_results", lambda: 1 / 0) is None
    assert _section(report, "sampling_2_step", lambda: {"speedup": 1.02}) == {"speedup": 1.02}
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["sections_completed"] == ["sampling_2_step"]
    assert on_disk["errors"]["real_block_results"]["error"].startswith("ZeroDivisionError")
    assert on_disk["sampling_2_step"] == {"speedup": 1.02}


def test_run_tables_without_stock_say_nothing_was_compared():
    block = {"block": 0, "strided_nhd_p50_seconds": 0.1, "nhd_rotated_p50_seconds": 0.101, "reps": 3}
    text = results_table.run_tables({"real_block_results": [block], "packed_tokens": 64}, "run")
    assert "| run | checkpoint | 64 | 3 | - ms | - | - | - | - / - / - |" in text
    compared = dict(block, stock_p50_seconds=0.105, stock_over_strided_nhd=1.05, stock_vs_strided_nhd_bit_exact=True,
                    stock_vs_nhd_rotated_bit_exact=False, stock_vs_nhd_rotated_max_abs_difference=0.03125)
    text = results_table.run_tables({"real_block_results": [compared]}, "run")
    assert "| 105.00 ms | 1.050x | - | nhd_rotated max abs 0.0312 |" in text


def test_memory_shape_is_the_frame_count_closest_to_the_tokens_asked():
    from benchmarks.sections import frames_for_tokens

    frames, rows = frames_for_tokens(120000, 1344, 768, 100)
    assert (frames, rows["total"]) == (396, 119356)  # 379 frames pack 114,260, 413 pack 124,452
    assert frames % 17 == 5
    assert frames_for_tokens(37810, 1344, 768, 100)[0] == 124
    assert frames_for_tokens(1, 64, 64, 8)[0] == 5  # never below the shortest clip


def test_a_device_fault_in_the_memory_section_stops_the_variants_after_it(monkeypatch):
    """Past the int32 line plain sageattn may fault: that variant's error is kept, the later ones are not
    run (the device is gone), the earlier ones keep their peaks."""
    from types import SimpleNamespace

    from benchmarks import sections

    def fake_call(bench, patcher, index, inputs):
        def run(meter=None):
            if patcher == "kj":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if patcher == "bad":
                raise ValueError("not H3")
            return (7 * 2**20, None)
        return run

    monkeypatch.setattr(sections, "_block_call", fake_call)
    bench = SimpleNamespace(variants=lambda with_stock: {"pack": "pack", "bad": "bad", "kj": "kj", "stock": "stock"},
                            log=lambda message: None)
    peaks, errors = sections._peaks_in_order(bench, ["pack", "bad", "kj", "stock"], 0, ())
    assert peaks == {"pack": 7 * 2**20, "bad": None, "kj": None, "stock": None}
    assert errors["bad"] == "ValueError: not H3" and errors["kj"].startswith("RuntimeError: CUDA error")
    assert errors["stock"] == "not run: the device failed in kj's call"


def peer_report() -> dict:
    """A report of a --peer-table run in the shape the harness writes it (numbers made up)."""
    names = ["stock", "strided_nhd", "attention_only", "kj_lowvram", "kj_lowvram_chunkff"]
    p50 = dict(zip(names, (0.105, 0.100, 0.102, 0.104, 0.106)))
    peaks = dict(zip(names, (4000 * 2**20, 3000 * 2**20, 3500 * 2**20, 4000 * 2**20, 3750 * 2**20)))
    block = {"block": 0, "peak_extra_bytes": peaks, **{f"{n}_p50_seconds": t for n, t in p50.items()}}
    for n in names[1:]:
        block.update({f"stock_over_{n}": p50["stock"] / p50[n], f"stock_vs_{n}_bit_exact": True})
    low = {"node": "MiniMaxLowVRAMAttention", "display_name": "MiniMax H3 Low VRAM Attention",
           "inputs": {"head_chunks": 4}}
    ff = {"node": "MiniMaxChunkFeedForward", "display_name": "MiniMax H3 Chunk FeedForward",
          "inputs": {"chunks": 2, "seq_threshold": 4096}}
    memory = {"tokens_asked": 120000, "packed_tokens": 119356, "resolution": [1344, 768], "frames": 396,
              "block": 0, "pack": "strided_nhd",
              "peak_extra_bytes": {"strided_nhd": 9000 * 2**20, "attention_only": 10000 * 2**20,
                                   "kj_lowvram": 12000 * 2**20, "kj_lowvram_chunkff": None, "stock": None},
              "errors": {"kj_lowvram_chunkff": "RuntimeError: CUDA error: an illegal memory access\nmore",
                         "stock": "not run: the device failed in kj_lowvram_chunkff's call"}}
    sampling = {"steps": 2, "order": ["strided_nhd", "kj_lowvram", "stock"], "stock_seconds": 10.5,
                "strided_nhd_seconds": 10.0, "kj_lowvram_seconds": 10.4, "stock_over_strided_nhd": 1.05,
                "stock_over_kj_lowvram": 10.5 / 10.4, "stock_vs_strided_nhd_identical": True,
                "stock_vs_kj_lowvram_identical": False,
                "stock_vs_kj_lowvram_max_abs_difference": {"video": 0.5, "audio": 0.25},
                **{f"{n}_checksums": [1.0, 2.0] for n in ("stock", "strided_nhd", "kj_lowvram")}}
    return {"real_block_results": [block], "peer": {"variants": {"kj_lowvram": [low], "kj_lowvram_chunkff": [low, ff]}},
            "peak_memory_long_sequence": memory, "sampling_2_step": sampling}


def test_correctness_table_says_which_sampled_latents_matched_stock():
    table = correctness_table(peer_report())
    assert "kj_lowvram" in table and "stock vs kj_lowvram: DIFFER" in table
    assert "stock vs strided_nhd: identical latents" in table
    lines = table.splitlines()
    assert lines[0].split() == ["variant", "attention", "that", "ran", "video", "checksum", "audio", "checksum"]
    assert set(lines[1]) == {"-"}


@pytest.mark.parametrize("name, family", [
    ("void qk_int8_sv_f8_attn_kernel<64u, 128u, 128u, 128u>", "attention"),  # SageAttention 2 sm90
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", "gemm"),  # cuBLAS bf16
    ("void cutlass::Kernel2<cutlass::gemm::kernel::DefaultGemmWithVisitor<signed char>>", "gemm"),  # int8_linear
    ("void comfy::(anonymous namespace)::quantize_int8_rowwise_convrot64_kernel<__nv_bfloat16>", "other"),
    ("_scale_shift_kernel", "other"),
    ("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float, true>", "other"),
])
def test_kernel_family_splits_a_block_into_attention_gemms_and_the_rest(name, family):
    assert kernel_family(name) == family


@pytest.mark.parametrize("shape, rows", [((37, 3, 8), 8), ((37, 3, 8), 100), ((1, 2, 5, 4), 1), ((), 8)])
def test_max_abs_difference_by_row_blocks_equals_the_whole_tensor_figures(shape, rows):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(shape, generator=gen).to(torch.bfloat16)
    b = (a.float() + 0.125 + 0.01 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    got = measure.max_abs_difference(a, b, rows=rows)
    d = (a.float() - b.float()).abs()
    assert got["max_abs_difference"] == float(d.max())  # a maximum is exact whatever the blocks
    assert got["mean_abs_difference"] == pytest.approx(float(d.double().mean()), rel=1e-9)
    assert got["relative_l2"] == pytest.approx(float(d.double().norm() / a.double().norm()), rel=1e-9)
    assert got["bit_exact"] is False and measure.max_abs_difference(a, a.clone(), rows=rows)["bit_exact"] is True


def test_max_abs_difference_refuses_outputs_of_different_shapes():
    with pytest.raises(ValueError, match="shapes"):
        measure.max_abs_difference(torch.zeros(4, 2), torch.zeros(2, 4))




# --- the tables generated into docs/BENCHMARKS.md -----------------------------------------------------

def peer_run_report(weights: str, tokens: int, pack_p50: float) -> dict:
    """A --peer-table report with a removed variant (block_path fused) beside the current ones."""
    data = peer_report()
    block = data["real_block_results"][0]
    block.update(strided_nhd_p50_seconds=pack_p50, stock_over_strided_nhd=0.105 / pack_p50,
                 fused_p50_seconds=0.099, stock_over_fused=0.105 / 0.099, stock_vs_fused_bit_exact=False,
                 stock_vs_fused_max_abs_difference=0.03125, reps=18)
    block["peak_extra_bytes"]["fused"] = 3000 * 2**20
    data["real_block_results"].append(dict(block, block=1))
    data.update(device="NVIDIA H100 80GB HBM3", torch="2.11.0+cu130", comfyui={"version": "0.33.0"},
                stock_attention="attention_sage", packed_tokens=tokens,
                model={"source": f"random {weights} weights (seed 0)", "blocks": 2},
                validation={"blocks_stock_vs_fused": "differ", "blocks_stock_vs_strided_nhd": "bit-exact"},
                variant_settings={"strided_nhd": {"block_path": "exact", "prep_mode": "exact"},
                                  "fused": {"block_path": "fused", "prep": "exact"}})
    data["peer"]["git_commit"] = "3f20054abcdef"
    data["sampling_2_step"]["order"].append("fused")
    data["sampling_2_step"].update(fused_seconds=9.9, stock_over_fused=10.5 / 9.9, stock_vs_fused_identical=False)
    return data


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_removed_variants_leave_no_key_behind():
    data = results_table.without_removed(peer_run_report("bf16", 37810, 0.1))
    text = json.dumps(data).replace('"fused_qkv"', "")  # the memory section's qkv buffer, not the variant
    assert "fused" not in text, [k for k in text.split('"') if "fused" in k]
    assert data["real_block_results"][0]["stock_over_strided_nhd"] == pytest.approx(1.05)
    assert data["sampling_2_step"]["order"] == ["strided_nhd", "kj_lowvram", "stock"]
    assert results_table.removed_variants({"variant_settings": {"a": {"prep_mode": "fused_rotated"},
                                                                "b": {"prep_mode": "rotated"}}}) == ["a"]


def test_blocks_table_has_a_row_per_report_and_a_column_per_variant(tmp_path):
    paths = [write(tmp_path / "peer-bf16-37810.json", peer_run_report("bf16", 37810, 0.1)),
             write(tmp_path / "peer-int8_convrot-8192.json", peer_run_report("int8_convrot", 8192, 0.0875))]
    text = results_table.blocks_table(paths)
    assert "fused" not in text
    assert ("| report | weights | tokens | reps | stock, block 0 / 1 | stock / strided_nhd | stock / attention_only "
            "| stock / kj_lowvram | stock / kj_lowvram_chunkff | equal to stock |") in text
    assert ("| peer-bf16-37810 | bf16 | 37,810 | 18 | 105.00 / 105.00 ms | 1.050x / 1.050x | 1.029x / 1.029x | "
            "1.010x / 1.010x | 0.991x / 0.991x | all bit-exact | 4,000 / 3,000 / 3,500 / 4,000 / 3,750 |") in text
    assert "| peer-int8_convrot-8192 | int8_convrot | 8,192 | 18 | 105.00 / 105.00 ms | 1.200x / 1.200x |" in text
    assert ("- peer-bf16-37810, one block at 119,356 tokens (396 frames), peak extra: strided_nhd 9,000 MiB, "
            "attention_only 10,000 MiB, kj_lowvram 12,000 MiB, kj_lowvram_chunkff RuntimeError: CUDA error: an "
            "illegal memory access; not run after that fault: stock") in text
    assert text.endswith("- NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, ComfyUI 0.33.0, stock `attention_sage`, "
                         f"KJNodes 3f20054abcdef: `{paths[0].as_posix()}`, `{paths[1].as_posix()}`")


def test_blocks_table_names_the_variants_that_differ_from_stock(tmp_path):
    data = peer_run_report("int8_convrot", 37810, 0.1)
    for block, diff in zip(data["real_block_results"], (0.0508, 0.0)):
        block.update(stock_vs_kj_lowvram_bit_exact=diff == 0.0, stock_vs_kj_lowvram_max_abs_difference=diff)
    text = results_table.blocks_table([write(tmp_path / "r.json", data)])
    assert "| kj_lowvram max abs 0.0508 / 0 |" in text


def test_sampling_table_puts_each_sampled_variant_beside_stock(tmp_path):
    data = peer_run_report("int8_convrot", 37810, 0.1)
    data["sampling_2_step"].update(stock_peak_allocated_bytes=54_380_000_000,
                                   strided_nhd_peak_allocated_bytes=51_260_000_000)
    text = results_table.sampling_table([write(tmp_path / "s.json", data)])
    assert ("| int8_convrot | 2 | 2 | strided_nhd | 10.50 s | 10.00 s | 1.050x | identical | 54.38 / 51.26 |"
            in text)
    assert "| int8_convrot | 2 | 2 | kj_lowvram | 10.50 s | 10.40 s | 1.010x | differ | 54.38 / - |" in text
    assert "fused" not in text


def isolated_report(backends: dict) -> dict:
    row = {"hnd_median_seconds": 0.004, "strided_nhd_median_seconds": 0.0032, "speedup": 1.25,
           "max_abs_difference": 0.0, "hnd_peak_extra_bytes": 729 * 2**20, "strided_nhd_peak_extra_bytes": 281 * 2**20}
    return {"environment": {"device": "NVIDIA H200", "torch": "2.11.0+cu130"}, "heads": 56, "head_dim": 128,
            "dtype": "bfloat16", "results": {name: ({"8192": dict(row, speedup=x)} if x else {"skipped": "no"})
                                             for name, x in backends.items()}}


def test_kernels_table_shows_each_back_end_from_the_first_report_that_has_it(tmp_path):
    new = write(tmp_path / "new.json", isolated_report({"sage2": 1.25, "fa4": None}))
    old = write(tmp_path / "old.json", isolated_report({"sage2": 1.05, "sage1": 1.09}))
    text = results_table.kernels_table([new, old])
    assert "| sage2 | 8,192 | 4.00 ms | 3.20 ms | 1.250x | 0 | 729 -> 281 |" in text
    assert "1.050x" not in text and "| sage1 | 8,192 |" in text and "| fa4 | - | skipped: no |" in text
    assert f"- `{old.as_posix()}`: NVIDIA H200, torch 2.11.0+cu130, 56x128 heads bfloat16" in text


def test_doc_markers_are_filled_from_the_json(tmp_path):
    blocks = write(tmp_path / "b.json", peer_run_report("bf16", 37810, 0.1))
    kernels = write(tmp_path / "k.json", isolated_report({"sdpa": 1.1}))
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("intro\n<!-- blocks-table:start -->\nold\n<!-- blocks-table:end -->\nmiddle\n"
                   "<!-- kernels-table:start -->\nold\n<!-- kernels-table:end -->\nrest\n")
    results_table.main(["--blocks", str(blocks), "--kernels", str(kernels), "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("rest\n") and "\nmiddle\n" in text
    assert "| b | bf16 | 37,810 |" in text and "| sdpa | 8,192 |" in text
    with pytest.raises(ValueError, match="sampling-table"):  # a table the doc has no place for
        results_table.main(["--sampling", str(blocks), "--doc", str(doc)])
    with pytest.raises(SystemExit):
        results_table.main(["--doc", str(doc)])


def test_the_docs_tables_are_what_their_regenerate_command_makes(tmp_path):
    """docs/BENCHMARKS.md's command, run on a copy of the doc, changes nothing: the tables are current
    and every result file they name is in the repository."""
    doc = ROOT / "docs" / "BENCHMARKS.md"
    text = doc.read_text()
    block = text.split("## Regenerate the tables", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    folder = next(line.split("=", 1)[1] for line in lines if line.startswith("R="))
    argv = next(line for line in lines if "benchmarks.results_table" in line).replace("$R", folder).split()
    argv = argv[argv.index("benchmarks.results_table") + 1:]
    copy_of_doc = tmp_path / "BENCHMARKS.md"
    copy_of_doc.write_text(text)
    argv[argv.index("--doc") + 1] = str(copy_of_doc)
    cwd = Path.cwd()
    try:
        os.chdir(ROOT)  # the command's paths are relative to the repository root
        results_table.main(argv)
    finally:
        os.chdir(cwd)
    assert copy_of_doc.read_text() == text


# --- --first-contact's table (the README's first command on a GPU) -----------------------------------------

def first_contact_run(weights: str, stock_ms: tuple, pack_ms: tuple, same=(True, True), **extra) -> dict:
    """One format-and-length section as the harness writes it: blocks 0 and 1, stock and strided_nhd."""
    blocks = [{"block": i, "stock_p50_seconds": s / 1e3, "strided_nhd_p50_seconds": p / 1e3, "reps": 9,
               "stock_vs_strided_nhd_bit_exact": eq, "stock_vs_strided_nhd_max_abs_difference": 0.0 if eq else 0.5,
               "peak_extra_bytes": {"stock": (3 + i) * 2**30, "strided_nhd": (1 + i) * 2**30}}
              for i, (s, p, eq) in enumerate(zip(stock_ms, pack_ms, same))]
    return dict({"weights": weights, "packed_tokens": 37810, "pack": "strided_nhd", "blocks": blocks,
                 "pack_ran": "sage2 x4", "int8_own_quantizer_calls": 0, "int8_stock_quantizer": []}, **extra)


def first_contact_report(**sections) -> dict:
    return {"first_contact": {"job": "blocks", "formats": ["bf16", "int8_convrot"], "lengths": [37810, 8192],
                              "why": "79.1 GiB free"},
            "device": "NVIDIA H100 80GB HBM3", "stock_attention": "attention_sage", "layout": "strided_nhd",
            "attention_requested": "auto", "model": {"config": {"hidden_size": 5376, "num_attention_heads": 56,
                                                                "attention_head_dim": 128}},
            "errors": {}, **sections}


def test_first_contact_table_gives_each_format_and_length_its_row_from_the_sections():
    data = first_contact_report(first_contact_bf16_37810=first_contact_run("bf16", (60.0, 64.0), (50.0, 54.0)))
    lines = first_contact_table(data).splitlines()
    assert lines[0].startswith("H3 blocks 0 and 1 (hidden 5376, 56 heads x 128) on NVIDIA H100 80GB HBM3: stock ComfyUI "
                               "(attention_sage) beside the pack (strided_nhd, back-end auto), p50 of 9 reps")
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in lines[4:8]}
    # means of the blocks' p50s, the ratio of their sums (124 / 104), the largest peak of each variant
    assert rows[("bf16", "37,810")] == ["62.00", "52.00", "1.192x", "yes", "4,096", "/", "2,048"]
    assert rows[("bf16", "8,192")] == ["not", "run"]  # no section, no error: not reached
    assert lines[-2:] == ["bf16: the pack ran sage2 x4", "lengths by memory: 79.1 GiB free"]


def test_first_contact_table_says_which_outputs_differ_and_why_a_row_is_missing():
    stock_q = [{"reason": "comfy-kitchen 0.2.40: not a release this route was written for", "count": 8}]
    data = first_contact_report(
        first_contact_int8_convrot_37810=first_contact_run("int8_convrot", (40.0, 40.0), (50.0, 30.0), same=(True, False),
                                                           int8_stock_quantizer=stock_q))
    data["errors"]["first_contact_int8_convrot_8192"] = {"error": "OutOfMemoryError: CUDA out of memory", "traceback": ""}
    text = first_contact_table(data)
    row = next(line for line in text.splitlines() if line.startswith("int8_convrot") and "37,810" in line)
    assert row.split()[2:7] == ["40.00", "40.00", "1.000x", "no", "(max"] and "max abs 0.5" in row
    assert "int8_convrot   8,192  not run: OutOfMemoryError: CUDA out of memory" in text
    assert ("int8_convrot: the pack ran sage2 x4; its int8 linears kept stock's quantiser: comfy-kitchen 0.2.40: "
            "not a release this route was written for") in text
    no_peaks = first_contact_run("bf16", (1.0, 1.0), (1.0, 1.0))
    for block in no_peaks["blocks"]:
        block["peak_extra_bytes"] = {"stock": None, "strided_nhd": None}  # off CUDA
    assert first_contact_table(first_contact_report(first_contact_bf16_37810=no_peaks)).splitlines()[4].endswith("- / -")
