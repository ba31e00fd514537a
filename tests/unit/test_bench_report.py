"""The benchmark's pure parts: schema check, ordering, table and README generation, token count."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from benchmarks import measure, results_table, schema
from devkit.h3 import FULL_H3, packed_token_count
from benchmarks.h3_reference_run import REFERENCE_COPY, _section, parse_args
from benchmarks.report import Report, markdown_table, text_table, variant_rows
from benchmarks.sections import sampling_order

SHARED_REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "gb10-strided-nhd-results.json"


def reference() -> dict:
    return schema.load_reference(REFERENCE_COPY)


def reference_shaped_report() -> dict:
    """The reference report rewritten with our key names, as a report of ours would carry them."""
    data = copy.deepcopy(reference())
    data["profiler_block_recapture"] = data.pop("nsight_block_recapture")
    s12 = data["sampling_12_step"]
    s12["hnd_seconds"] = s12.pop("component1_hnd_seconds")
    return data


def test_reference_copy_matches_shared_reference():
    if not SHARED_REFERENCE.is_file():
        pytest.skip(f"no shared reference at {SHARED_REFERENCE} to compare the repo's copy with")
    assert json.loads(SHARED_REFERENCE.read_text()) == reference()


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


def test_readme_markers_are_filled_from_the_json(tmp_path):
    data = reference_shaped_report()
    data.update(attention="sage2", stock_attention="attention_sage", validation={"isolated_attention": "bit-exact"})
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results-table:start -->\nold\n<!-- results-table:end -->\nrest\n")
    results_table.main([str(path), "--readme", str(readme)])
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "| 2-step sampling | - | 52.497 s | 50.955 s | 1.030x |" in text
    assert "isolated attention, HND vs strided NHD: bit-exact" in text


def test_readme_without_markers_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        results_table.replace_between_markers(readme.read_text(), "table")


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
