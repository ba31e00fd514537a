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
    assert row["bit_exact"] and row["max_abs_difference"] == 0.0
    assert row["records"]["strided_nhd"]["copies"] == 0 and row["records"]["hnd"]["copies"] == 4
    assert row["hnd_min_max_seconds"][0] <= row["hnd_median_seconds"] <= row["hnd_min_max_seconds"][1]
    out = capsys.readouterr().out
    assert "sdpa S=40: HND" in out and f"| sdpa | 40 | {row['hnd_median_seconds'] * 1e3:.2f} ms |" in out


def test_bench_table_is_generated_into_the_doc_block(tmp_path):
    report = tmp_path / "report.json"
    bench.main(["--device", "cpu", "--seq", "24", "--heads", "2", "--head-dim", "32", "--rot-dim", "16",
                "--reps", "1", "--warmup", "0", "--out", str(report)])
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("intro\n<!-- kernels-table:start -->\nold\n<!-- kernels-table:end -->\noutro\n")
    results_table.main(["--kernels", str(report), "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "| sdpa | 24 |" in text and "| back-end | S | HND | strided NHD |" in text
    assert f"- `{report.as_posix()}`: CPU (" in text and "2x32 heads bfloat16" in text
