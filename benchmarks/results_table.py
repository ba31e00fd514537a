"""Markdown tables from benchmark JSONs: the README's tables are made with this, never by hand.

    python -m benchmarks.results_table benchmarks/results/h200-sage2.json
    python -m benchmarks.results_table benchmarks/results/*.json --readme README.md

Reference-run reports (``benchmarks.h3_reference_run``) fill the block between
``<!-- results-table:start -->`` and ``<!-- results-table:end -->``; isolated-attention reports
(``benchmarks.isolated_attention``) the block between ``<!-- kernels-table:start -->`` and
``<!-- kernels-table:end -->``. With ``--readme`` those blocks are replaced (the markers must already
be there); otherwise the tables are printed.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .report import markdown_table, variants_markdown

MARKERS = {"results": ("<!-- results-table:start -->", "<!-- results-table:end -->"),
           "kernels": ("<!-- kernels-table:start -->", "<!-- kernels-table:end -->")}


def report_kind(data: dict) -> str:
    """``kernels`` for an isolated-attention report, ``results`` for a reference-run report."""
    return "kernels" if "results" in data and "heads" in data else "results"



def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def describe_run(data: dict, source: str) -> str:
    """One line saying what ran where, and what was checked."""
    width, height = data.get("resolution") or ("?", "?")
    tokens = data.get("packed_tokens")
    tokens = f"{tokens:,}" if isinstance(tokens, int) else "?"
    model = (data.get("model") or {}).get("source", "?")
    return (f"**{data.get('device', '?')}** ({data.get('compute_capability', '?')}), torch {data.get('torch', '?')}, "
            f"patch back-end **{data.get('attention', '?')}**, stock ComfyUI attention "
            f"`{data.get('stock_attention', '?')}`; H3 {width}x{height}x{data.get('frames', '?')}, {tokens} packed "
            f"tokens, seed {data.get('seed', '?')}; {model}. Source: `{source}`.")


def memory_lines(data: dict) -> list[str]:
    lines = []
    for key, label in (("sampling_2_step", "2-step"), ("sampling_12_step", "12-step")):
        s = data.get(key) or {}
        if s.get("peak_allocated_bytes_saved") is not None:
            lines.append(f"- {label} sampling peak memory saved by strided NHD: {_gib(s['peak_allocated_bytes_saved'])} "
                         f"allocated, {_gib(s['peak_reserved_bytes_saved'])} reserved "
                         f"(HND {_gib(s.get('hnd_peak_allocated_bytes'))} -> strided NHD "
                         f"{_gib(s.get('strided_nhd_peak_allocated_bytes'))} allocated).")
    blocks = data.get("real_block_results") or []
    if blocks and blocks[0].get("peak_extra_bytes", {}).get("strided_nhd") is not None:
        peaks = blocks[0]["peak_extra_bytes"]
        lines.append("- One block's peak extra memory: " + ", ".join(
            f"{name} {v / 2**20:,.0f} MiB" for name, v in peaks.items() if v is not None) + ".")
    return lines


VALIDATION_LABELS = {
    "packed_tokens": "packed tokens",
    "isolated_attention": "isolated attention, HND vs strided NHD",
    "blocks_0_24_49": "blocks {blocks}, HND vs strided NHD",
    "blocks_stock_vs_hnd": "blocks {blocks}, stock vs HND",
    "blocks_stock_vs_strided_nhd": "blocks {blocks}, stock vs strided NHD",
    "full_50_block_two_step_trajectory": "2-step sampling, HND vs strided NHD",
    "sampling_2_step_repeat_runs": "2-step sampling, repeated runs of a layout",
    "canonical_12_step_trajectory": "12-step sampling, HND vs strided NHD",
    "sampling_12_step_repeat_runs": "12-step sampling, repeated runs of a layout",
    "patch_reverted": "after the patched runs",
    "outputs_finite": "outputs",
}


def validation_lines(data: dict) -> list[str]:
    checks = dict(data.get("validation") or {})
    blocks = checks.pop("blocks_compared", "0, 24, 49")
    return [f"- {VALIDATION_LABELS.get(item, item.replace('_', ' ')).format(blocks=blocks)}: {verdict}"
            for item, verdict in checks.items()]


def section_markdown(path: Path) -> str:
    data = json.loads(path.read_text())
    if report_kind(data) == "kernels":
        return kernels_markdown(data) + "\n"
    variants = variants_markdown(data)
    parts = [describe_run(data, path.as_posix()), "", variants or markdown_table(data), ""]
    parts += memory_lines(data)
    parts += validation_lines(data)
    if data.get("errors"):
        parts.append(f"- sections that failed in this run: {', '.join(data['errors'])}")
    png = path.with_suffix(".png")
    if png.is_file():
        parts += ["", f"![{data.get('device', '')}: HND vs strided NHD per measurement]({png.as_posix()})"]
    return "\n".join(parts).rstrip() + "\n"


KERNELS_HEADER = ["| back-end | S | HND | strided NHD | speedup | max abs diff | peak extra HND -> NHD |",
                  "|---|---|---|---|---|---|---|"]


def kernels_markdown(report: dict) -> str:
    """The isolated-attention table: per back-end and S, HND vs strided NHD."""
    env = report["environment"]
    lines = [f"**{env['device']}** ({env.get('compute_capability', '')}), torch {env['torch']}, "
             f"{report['heads']}x{report['head_dim']} heads {report['dtype']}.", "", *KERNELS_HEADER]
    for name, rows in report["results"].items():
        if "skipped" in rows:
            lines.append(f"| {name} | - | skipped: {rows['skipped']} | | | | |")
            continue
        for seq, row in rows.items():
            if "error" in row:
                lines.append(f"| {name} | {int(seq):,} | error: {row['error']} | | | | |")
                continue
            peak = "-" if row["hnd_peak_extra_bytes"] is None else (
                f"{row['hnd_peak_extra_bytes'] / 2**20:,.0f} -> {row['strided_nhd_peak_extra_bytes'] / 2**20:,.0f} MiB")
            lines.append(f"| {name} | {int(seq):,} | {row['hnd_median_seconds'] * 1e3:.3f} ms | "
                         f"{row['strided_nhd_median_seconds'] * 1e3:.3f} ms | {row['speedup']:.3f}x | "
                         f"{row['max_abs_difference']:.3g} | {peak} |")
    return "\n".join(lines)


def replace_between_markers(text: str, block: str, kind: str = "results") -> str:
    start, end = MARKERS[kind]
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} markers in the file")
    return pattern.sub(lambda _: f"{start}\n{block.rstrip()}\n{end}", text, count=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", type=Path)
    parser.add_argument("--readme", type=Path, help="file whose results-table markers to fill")
    args = parser.parse_args(argv)
    blocks: dict[str, list[str]] = {}
    for path in args.json:
        blocks.setdefault(report_kind(json.loads(path.read_text())), []).append(section_markdown(path))
    if args.readme:
        text = args.readme.read_text()
        for kind, parts in blocks.items():
            text = replace_between_markers(text, "\n".join(parts), kind)
        args.readme.write_text(text)
        print(f"updated {args.readme}: {', '.join(f'{k}-table' for k in blocks)}")
    else:
        print("\n".join(part for parts in blocks.values() for part in parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
