"""The isolated-attention benchmark runs end to end on CPU and writes its report."""

from __future__ import annotations

import json

from benchmarks import isolated_attention as bench
from benchmarks import results_table


def test_bench_cpu_smoke_run_writes_the_reference_fields(tmp_path, capsys):
    out = tmp_path / "report.json"
    bench.main(["--device", "cpu", "--seq", "40", "--heads", "2", "--head-dim", "32", "--rot-dim", "16",
                "--reps", "2", "--warmup", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    row = report["results"]["sdpa"]["40"]
    for key in ("hnd_mean_seconds", "strided_nhd_mean_seconds", "speedup", "max_abs_difference",
                "mean_abs_difference", "hnd_peak_extra_bytes", "strided_nhd_peak_extra_bytes"):
        assert key in row, key
    assert row["hnd_mean_seconds"] > 0 and row["strided_nhd_mean_seconds"] > 0
    assert row["bit_identical"] and row["max_abs_difference"] == 0.0
    assert row["records"]["strided_nhd"]["copies"] == 0
    assert "speedup" in capsys.readouterr().out


def test_bench_table_is_generated_into_the_doc_block(tmp_path):
    report = tmp_path / "report.json"
    bench.main(["--device", "cpu", "--seq", "24", "--heads", "2", "--head-dim", "32", "--rot-dim", "16",
                "--reps", "1", "--warmup", "0", "--out", str(report)])
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("intro\n<!-- kernels-table:start -->\nold\n<!-- kernels-table:end -->\noutro\n")
    results_table.main([str(report), "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "| sdpa | 24 |" in text and "peak extra HND -> NHD" in text
    assert f"Source: `{report.as_posix()}`" in text
