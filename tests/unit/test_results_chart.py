"""The README's chart (benchmarks/results_chart.py -> docs/results.png) is drawn from the committed VRAM-budget
reports: every bar is a report's seconds per step, and every cell without a bar is a run that did not finish."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import results_chart

ROOT = Path(__file__).resolve().parents[2]


def completed_runs() -> dict:
    """Straight from the JSON: {(tokens, card, variant): seconds_per_step} of the runs that finished, each variant
    from the first of its cell's reports that holds a run of it."""
    out = {}
    for tokens, card, files in results_chart.CELLS:
        runs = {}
        for name in reversed(files):  # the first report's runs win
            report = json.loads((ROOT / "benchmarks/results/vram-budget" / name).read_text())
            for cell in report["cells"]:
                if cell["budget_gib"] == card and cell["packed_rows"]["total"] == tokens:
                    runs.update(cell["runs"])
        out.update({(tokens, card, v): r["seconds_per_step"] for v, r in runs.items() if not r.get("error")})
    return out


def test_every_bar_is_a_committed_reports_seconds_per_step(tmp_path):
    out = tmp_path / "results.png"
    assert results_chart.main(["--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000

    drawn = results_chart.draw(results_chart.outcomes(), tmp_path / "again.png")
    assert drawn == completed_runs()
    # the figures the README and docs/BENCHMARKS.md quote from the same files
    quoted = {(37810, 6, "pack"): "4.12", (37810, 8, "kjnodes"): "5.09", (37810, 12, "stock"): "5.09",
              (149936, 12, "pack"): "46.13", (149936, 24, "pack"): "44.62", (149936, 24, "kjnodes"): "49.36"}
    assert {k: f"{drawn[k]:.2f}" for k in quoted} == quoted


def test_cells_without_a_bar_say_what_stopped_them():
    data = results_chart.outcomes()
    stopped = {k: v for k, v in data.items() if isinstance(v, str)}
    assert stopped == {(37810, 6, "stock"): "out of memory", (37810, 6, "kjnodes"): "out of memory",
                       (37810, 8, "stock"): "out of memory", (149936, 12, "stock"): "out of memory",
                       (149936, 12, "kjnodes"): "out of memory", (149936, 16, "stock"): "out of memory",
                       (149936, 16, "kjnodes"): "error (SystemError)", (149936, 24, "stock"): "process died"}


def test_the_committed_chart_is_cited():
    assert (ROOT / "docs" / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "docs/results.png" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "python -m benchmarks.results_chart" in (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
