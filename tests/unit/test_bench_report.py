"""The benchmark's pure parts: schema check, ordering, the tables generated into docs/BENCHMARKS.md, token count."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from benchmarks import measure, results_table, schema
from devkit.h3 import FULL_H3, packed_token_count
from benchmarks.h3_reference_run import (REFERENCE_COPY, REFERENCE_KEYS_BY_SECTION, _section, parse_args,
                                         reference_for, validation_names)
from benchmarks.report import Report, markdown_table, text_table, variant_rows
from benchmarks.sections import sampling_order

ROOT = Path(__file__).resolve().parents[2]
# The project's shared copy of the reference report, where there is one: a shared/ folder in the
# checkout, or one beside it. The repo's copy (benchmarks/reference/) must be that file unchanged.
SHARED_COPIES = [base / "shared" / "reference" / REFERENCE_COPY.name for base in (ROOT, ROOT.parent)]


def reference() -> dict:
    return schema.load_reference(REFERENCE_COPY)


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
    paths = {path for path, _ in schema._walk(ref)}
    named = set(schema.RENAMED) | set(schema.NOT_APPLICABLE) | {
        key for keys in REFERENCE_KEYS_BY_SECTION.values() for key in keys}
    assert named <= paths, f"not in the reference copy: {sorted(named - paths)}"
    assert (ref["resolution"], ref["frames"], ref["packed_tokens"], ref["seed"]) == ([1344, 768], 124, 37810, 440420)
    assert [b["block"] for b in ref["real_block_results"]] == [0, 24, 49]


def test_report_with_every_reference_key_follows_schema():
    assert schema.check_against_reference(reference_shaped_report(), reference()) == []


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
    problems = schema.check_against_reference(data, reference())
    assert any(expected in p for p in problems), problems


def test_cuda_only_measurements_may_be_null_when_allowed():
    data = reference_shaped_report()
    data["profiler_block_recapture"]["hnd_kernel_launches"] = None
    data["sampling_2_step"]["peak_allocated_bytes_saved"] = None
    assert schema.check_against_reference(data, reference(), allow_null=schema.CUDA_ONLY) == []


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


def test_layout_comes_from_flag_then_environment(monkeypatch):
    monkeypatch.delenv("H3_SAGE_QKV_LAYOUT", raising=False)
    assert parse_args([]).layout == "ab"
    monkeypatch.setenv("H3_SAGE_QKV_LAYOUT", "hnd")
    assert parse_args([]).layout == "hnd"
    assert parse_args(["--layout", "strided_nhd"]).layout == "strided_nhd"
    monkeypatch.setenv("H3_SAGE_QKV_LAYOUT", "nhd")
    with pytest.raises(SystemExit):
        parse_args([])


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--sections", "blocks,warp"])
    assert "sampling_12_step" not in parse_args(["--skip-12-step"]).sections


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
    md = markdown_table(data)
    assert "| block 24 (p50) | - | 487.93 ms | 471.67 ms | 1.034x |" in md
    assert "| kernel launches per block | - | 53 | 49 | -4 |" in md
    assert "12-step sampling" in text_table(data)


def test_doc_markers_are_filled_from_the_json(tmp_path):
    data = reference_shaped_report()
    data.update(attention="sage2", stock_attention="attention_sage", validation={"isolated_attention": "bit-exact"})
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(data))
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("intro\n<!-- results-table:start -->\nold\n<!-- results-table:end -->\nrest\n")
    results_table.main([str(path), "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "| 2-step sampling | - | 52.497 s | 50.955 s | 1.030x |" in text
    assert "isolated attention, HND vs strided NHD: bit-exact" in text


def test_doc_without_markers_is_refused(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        results_table.replace_between_markers(doc.read_text(), "table")


def test_chart_is_linked_relative_to_the_doc(tmp_path):
    results, docs = tmp_path / "benchmarks" / "results", tmp_path / "docs"
    results.mkdir(parents=True)
    docs.mkdir()
    (results / "run.json").write_text(json.dumps(reference_shaped_report()))
    (results / "run.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    doc = docs / "BENCHMARKS.md"
    doc.write_text("<!-- results-table:start -->\n<!-- results-table:end -->\n")
    results_table.main([str(results / "run.json"), "--doc", str(doc)])
    assert "(../benchmarks/results/run.png)" in doc.read_text()


def test_superseded_rows_are_left_out_and_the_current_report_named(tmp_path):
    block = {"block": 0, "stock_p50_seconds": 0.105, "strided_nhd_p50_seconds": 0.1,
             "today_p50_seconds": 0.103, "nhd_rotated_p50_seconds": 0.101, "stock_over_strided_nhd": 1.05,
             "stock_over_today": 1.02, "stock_over_nhd_rotated": 1.04,
             "peak_extra_bytes": {"stock": 2**30, "strided_nhd": 2**29, "today": 2**29, "nhd_rotated": 2**29}}
    path = tmp_path / "h200-fast-path-blocks-37810.json"  # a name SUPERSEDED lists
    path.write_text(json.dumps(dict(reference_shaped_report(), real_block_results=[block])))
    text = results_table.section_markdown(path)
    assert "| strided_nhd |" in text and "| today |" in text and "| nhd_rotated |" not in text
    assert "not shown: nhd_rotated" in text and "h200-rotated-blocks-37810-run3.json" in text
    assert "today 512 MiB" in text and "nhd_rotated 512 MiB" not in text  # nor in the memory line


def test_validation_items_named_for_the_model_get_their_labels():
    data = {"validation": {"blocks_compared": "0, 1", "blocks_0_1": "bit-exact",
                           "full_2_block_two_step_trajectory": "identical video and audio checksums",
                           "blocks_0_24_49": "bit-exact", "full_50_block_two_step_trajectory": "identical"}}
    assert results_table.validation_lines(data) == [
        "- blocks 0, 1, HND vs strided NHD: bit-exact",
        "- 2-step sampling, HND vs strided NHD: identical video and audio checksums",
        "- blocks 0, 1, HND vs strided NHD: bit-exact",
        "- 2-step sampling, HND vs strided NHD: identical"]


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
    assert schema.check_against_reference(data, ref) == []
    # a section that was asked for and is absent is still reported
    asked_all = reference_for({"sections_requested": ["sampling_2_step", "sampling_12_step"], "model": {"blocks": 2}},
                              reference())
    assert any(p.startswith("missing sampling_12_step") for p in schema.check_against_reference(data, asked_all))


def test_chart_is_written(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: the chart cannot be drawn")
    from benchmarks.plot import write_chart

    png = write_chart(reference_shaped_report(), tmp_path / "chart.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_section_does_not_lose_the_others(tmp_path):
    report = Report(tmp_path / "r.json")
    assert _section(report, "real_block_results", lambda: 1 / 0) is None
    assert _section(report, "sampling_2_step", lambda: {"speedup": 1.02}) == {"speedup": 1.02}
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk["sections_completed"] == ["sampling_2_step"]
    assert on_disk["errors"]["real_block_results"]["error"].startswith("ZeroDivisionError")
    assert on_disk["sampling_2_step"] == {"speedup": 1.02}


def test_variant_table_without_stock_says_nothing_was_compared():
    block = {"block": 0, "strided_nhd_p50_seconds": 0.1, "nhd_rotated_p50_seconds": 0.101}
    with_stock = dict(block, stock_p50_seconds=0.105, stock_vs_nhd_rotated_bit_exact=False,
                      stock_vs_nhd_rotated_max_abs_difference=0.03125,
                      stock_vs_strided_nhd_bit_exact=True)
    without = {row[0]: row[4] for row in variant_rows({"real_block_results": [block]})}
    assert without == {"strided_nhd": "-", "nhd_rotated": "-"}
    compared = {row[0]: row[4] for row in variant_rows({"real_block_results": [with_stock]})}
    assert compared == {"strided_nhd": "bit-exact", "nhd_rotated": "max abs 0.0312", "stock": "-"}


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
              "block": 0, "pack": "strided_nhd", "past_int32_offsets": ["fused_qkv", "mlp_fc1_output"],
              "elements": {"fused_qkv": 119356 * 21504, "mlp_fc1_output": 119356 * 28672},
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


def test_peer_rows_put_the_pack_beside_each_peer_variant():
    from benchmarks.report import more_markdown, variants_markdown

    data = peer_report()
    table = variants_markdown(data)
    assert "| kj_lowvram | - | 104.00 ms | 1.010x | bit-exact | 4,000 MiB | - |" in table
    more = more_markdown(data)
    assert ("- strided_nhd against kj_lowvram (KJNodes: MiniMax H3 Low VRAM Attention (head_chunks 4)): "
            "block time kj_lowvram / strided_nhd 1.040x; peak extra strided_nhd / kj_lowvram 0.750x.") in more
    assert "MiniMax H3 Chunk FeedForward (chunks 2, seq_threshold 4096)): block time kj_lowvram_chunkff / " in more


def test_memory_table_gives_the_pack_over_each_variant_and_the_errors():
    from benchmarks.report import memory_markdown

    text = memory_markdown(peer_report())
    assert text.startswith("Peak extra memory of one block (block 0) at 119,356 packed tokens "
                           "(1344x768x396, asked 120,000):")
    assert "| kj_lowvram | 12,000 MiB | 0.750x |  |" in text
    assert "| kj_lowvram_chunkff | - | - | RuntimeError: CUDA error: an illegal memory access |" in text
    assert "| strided_nhd | 9,000 MiB | 1.000x |  |" in text
    assert "- past 2**31 elements (fused qkv 2,566,631,424, mlp fc1 output 3,422,175,232)" in text


def test_sampling_table_per_variant_says_whether_it_matched_stock():
    from benchmarks.report import correctness_table, sampling_variant_rows

    data = peer_report()
    rows = {r[0]: r for r in sampling_variant_rows(data, "sampling_2_step")}
    assert rows["strided_nhd"][1:4] == ("2-step 10.000 s", "1.050x", "identical checksums")
    assert rows["kj_lowvram"][3] == "differ: video max abs 0.5, audio 0.25"
    assert rows["stock"][2:4] == ("1.000x", "-")
    table = correctness_table(data)
    assert "kj_lowvram" in table and "stock vs kj_lowvram: DIFFER" in table
    layouts_only = {"sampling_2_step": {"order": ["hnd", "strided_nhd", "stock"]}}
    assert sampling_variant_rows(layouts_only, "sampling_2_step") == []


def test_validation_items_of_any_variant_get_their_labels():
    assert results_table.validation_lines({"validation": {
        "blocks_compared": "0, 1", "blocks_stock_vs_kj_lowvram": "bit-exact",
        "sampling_12_step_stock_vs_attention_only": "identical video and audio checksums",
        "peer_attention": "same kernel"}}) == [
        "- blocks 0, 1, stock vs kj_lowvram: bit-exact",
        "- 12-step sampling, stock vs attention_only: identical video and audio checksums",
        "- the peer (KJNodes) and the pack: same kernel"]


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
    assert measure.kernel_family(name) == family


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


def test_idle_between_kernels_is_the_span_minus_the_busy_union():
    # kernels 0-10, 5-12 (overlaps), 20-30: busy 22 of a 30 us span -> 8 us idle
    assert measure.idle_between([(20.0, 30.0), (0.0, 10.0), (5.0, 12.0)]) == pytest.approx(0.008)
    assert measure.idle_between([(0.0, 4.0), (1.0, 2.0)]) == 0.0  # one inside another
    assert measure.idle_between([]) is None


def test_idle_between_several_calls_leaves_out_the_syncs_between_them():
    # two calls, each with a 2 us gap inside; the 100 us between them is the host sync
    spans = [(0.0, 10.0), (12.0, 20.0), (120.0, 130.0), (132.0, 140.0)]
    assert measure.idle_between(spans, calls=2) == pytest.approx(0.002)
    assert measure.idle_between(spans) == pytest.approx(0.104)


def test_launch_waits_name_the_kernels_around_the_first_calls_gaps():
    spans = [(5.0, 10.0, "a"), (30.0, 40.0, "b"), (41.0, 50.0, "c"), (200.0, 210.0, "a")]
    waits = measure.launch_waits(spans, call_starts=[2.0, 190.0], top=2)
    assert waits["first_kernel_after_ms"] == pytest.approx(0.003)
    assert waits["largest_gaps"] == [(0.02, "a", "b"), (0.001, "b", "c")]
    assert measure.launch_waits([], [1.0]) == {}


def test_queued_table_sets_gpu_time_host_time_and_the_clock_beside_the_block_time():
    from benchmarks.report import queued_markdown
    data = {"real_block_results": [{"block": 0, "stock_p50_seconds": 0.104, "fused_p50_seconds": 0.096,
                                    "device_clocks": {"stock": {"sm_mhz": 1755.0, "watts": 690.0, "samples": 9},
                                                      "fused": None}}],
            "queued_block": {"block": 0, "reps": 5, "stock_gpu_p50_seconds": 0.1025, "stock_host_p50_seconds": 0.0021,
                             "fused_gpu_p50_seconds": 0.0941, "fused_host_p50_seconds": 0.0034,
                             "stock_over_stock_gpu": 1.0, "stock_over_fused_gpu": 0.1025 / 0.0941}}
    table = queued_markdown(data)
    assert "| stock | 104.00 ms | 102.50 ms | 1.000x | 2.10 ms | 1755 MHz |" in table
    assert "| fused | 96.00 ms | 94.10 ms | 1.089x | 3.40 ms | - |" in table
    assert queued_markdown({"real_block_results": data["real_block_results"]}) == ""


def test_device_sampler_averages_the_samples_inside_the_windows_only():
    sampler = measure.DeviceSampler.__new__(measure.DeviceSampler)
    sampler.samples = [(1.0, 1800.0, 600.0), (2.0, 1700.0, 700.0), (3.0, 1000.0, 100.0)]
    assert sampler.mean_over([(0.5, 2.5)]) == {"sm_mhz": 1750.0, "watts": 650.0, "samples": 2}
    assert sampler.mean_over([(5.0, 6.0)]) is None


def test_windowed_runner_records_each_calls_host_window():
    windows = []
    run = measure.windowed(lambda: 7, windows)
    assert run() == 7 and run() == 7
    assert len(windows) == 2 and all(a <= b for a, b in windows) and windows[0][1] <= windows[1][0]


def test_device_sampler_without_a_device_is_unavailable_and_samples_nothing():
    with measure.DeviceSampler(None) as sampler:
        pass
    assert not sampler.available and sampler.samples == [] and sampler.mean_over([(0.0, 1e12)]) is None


def test_mean_profile_averages_kernel_times_over_rounds_and_keeps_the_first_rounds_counts():
    def round_(attention, gemm, idle, first_after):
        return {"kernel_launches": 5, "memcpy_memset": 0, "large_copy_ops": 0, "gpu_idle_ms": idle,
                "kernel_ms": {"attention": attention, "gemm": gemm, "other": 1.0},
                "kernel_ms_by_name": {"attn": attention, "gemm": gemm}, "first_kernel_after_ms": first_after,
                "kernels": {"attn": 1, "gemm": 4}}
    merged = measure.mean_profile([round_(48.0, 36.0, 0.2, 2.0), round_(52.0, 37.0, 0.4, 3.0)])
    assert merged["kernel_ms"] == {"attention": 50.0, "gemm": 36.5, "other": 1.0}
    assert merged["kernel_ms_rounds"]["attention"] == [48.0, 52.0]
    assert merged["kernel_ms_by_name"] == {"attn": 50.0, "gemm": 36.5}
    assert merged["gpu_idle_ms"] == 0.3 and merged["first_kernel_after_ms"] == 2.0
    assert merged["kernel_launches"] == 5 and merged["kernels"] == {"attn": 1, "gemm": 4}
    cpu = {"kernel_launches": None, "kernel_ms": None, "gpu_idle_ms": None, "kernels": {}}
    assert measure.mean_profile([cpu, cpu]) == cpu
