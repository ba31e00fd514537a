"""Markdown tables from benchmark JSONs: the tables in docs/BENCHMARKS.md are made with this, never by hand.

    python -m benchmarks.results_table benchmarks/results/h200-sdpa-cudnn.json      # print the tables
    python -m benchmarks.results_table <JSONs> --doc docs/BENCHMARKS.md             # fill the doc's blocks

(docs/BENCHMARKS.md gives the exact list of JSONs, in order.) Reference-run reports
(``benchmarks.h3_reference_run``) fill the block between ``<!-- results-table:start -->`` and
``<!-- results-table:end -->``; isolated-attention reports (``benchmarks.isolated_attention``) the
block between ``<!-- kernels-table:start -->`` and ``<!-- kernels-table:end -->``. With ``--doc``
those blocks of that file are replaced (the markers must already be there); otherwise the tables
are printed.

Rows that a newer report measures again are left out (``SUPERSEDED``), and the table says so and
names the report that is current for them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
from pathlib import Path

from .report import markdown_table, more_markdown, variants_markdown

MARKERS = {"results": ("<!-- results-table:start -->", "<!-- results-table:end -->"),
           "kernels": ("<!-- kernels-table:start -->", "<!-- kernels-table:end -->")}


# (report file name, variant or back-end) -> (what that row measured, the report current for it).
# A variant of a reference-run report or a back-end of an isolated-attention report.
SUPERSEDED = {
    ("h200-fast-path-blocks-37810.json", "nhd_rotated"): (
        "the rotation's first version (an in-register butterfly, since replaced)",
        "`benchmarks/results/h200-rotated-blocks-37810-run2.json` and "
        "`benchmarks/results/h200-rotated-blocks-37810-run3.json` (the shipped rotation)"),
    ("h200-fast-path-blocks-8k.json", "nhd_rotated"): (
        "the rotation's first version (an in-register butterfly, since replaced)",
        "attention alone at 8,192 in `benchmarks/results/h200-sage2-fast-speed-call4.json` "
        "(no H3 block run at this length since)"),
    ("h200-isolated-attention-plain.json", "sage2"): (
        "plain `sageattn` before the prepared path", "`benchmarks/results/h200-isolated-attention.json`"),
    ("h200-isolated-attention-plain.json", "sdpa"): (
        "an earlier run of the same back-end", "`benchmarks/results/h200-isolated-attention.json`"),
}


def report_kind(data: dict) -> str:
    """``kernels`` for an isolated-attention report, ``results`` for a reference-run report."""
    return "kernels" if "results" in data and "heads" in data else "results"


def drop_superseded(data: dict, name: str) -> tuple[dict, list[str]]:
    """``data`` without the rows ``SUPERSEDED`` lists for the report file ``name``, and one line per dropped row."""
    gone = {row: why for (file, row), why in SUPERSEDED.items() if file == name}
    if not gone:
        return data, []
    data = copy.deepcopy(data)
    lines = []
    for row, (what, current) in gone.items():
        if report_kind(data) == "kernels":
            found = data["results"].pop(row, None) is not None
        else:
            found = False
            for block in data.get("real_block_results") or []:
                found |= block.pop(f"{row}_p50_seconds", None) is not None
                (block.get("peak_extra_bytes") or {}).pop(row, None)
            (data.get("attention_by_variant") or {}).pop(row, None)
        if found:
            lines.append(f"- not shown: {row}, {what}; current: {current}.")
    return data, lines


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
    "blocks_stock_vs_hnd": "blocks {blocks}, stock vs HND",
    "blocks_stock_vs_strided_nhd": "blocks {blocks}, stock vs strided NHD",
    "sampling_2_step_repeat_runs": "2-step sampling, repeated runs of a layout",
    "canonical_12_step_trajectory": "12-step sampling, HND vs strided NHD",
    "sampling_12_step_repeat_runs": "12-step sampling, repeated runs of a layout",
    "peer_attention": "the peer (KJNodes) and the pack",
    "patch_reverted": "after the patched runs",
    "outputs_finite": "outputs",
}


# Items named for what ran (benchmarks.h3_reference_run.validation_names): the blocks compared,
# the block count of the model sampled.
VALIDATION_PATTERNS = (
    (re.compile(r"blocks(?:_\d+)+"), "blocks {blocks}, HND vs strided NHD"),
    (re.compile(r"full_\d+_block_two_step_trajectory"), "2-step sampling, HND vs strided NHD"),
    (re.compile(r"blocks_stock_vs_(\w+)"), "blocks {blocks}, stock vs {0}"),
    (re.compile(r"sampling_(\d+)_step_stock_vs_(\w+)"), "{0}-step sampling, stock vs {1}"),
)


def validation_label(item: str) -> str:
    if item in VALIDATION_LABELS:
        return VALIDATION_LABELS[item]
    for pattern, label in VALIDATION_PATTERNS:
        match = pattern.fullmatch(item)
        if match:
            return label.format(*match.groups(), blocks="{blocks}")  # {blocks} is filled by the caller
    return item.replace("_", " ")


def validation_lines(data: dict) -> list[str]:
    checks = dict(data.get("validation") or {})
    blocks = checks.pop("blocks_compared", "0, 24, 49")
    return [f"- {validation_label(item).format(blocks=blocks)}: {verdict}" for item, verdict in checks.items()]


def section_markdown(path: Path, doc_dir: Path | None = None) -> str:
    """The tables of one report; a chart beside the JSON is linked relative to ``doc_dir`` (the file filled)."""
    data, dropped = drop_superseded(json.loads(path.read_text()), path.name)
    if report_kind(data) == "kernels":
        return kernels_markdown(data, path.as_posix()) + ("\n\n" + "\n".join(dropped) if dropped else "") + "\n"
    variants = variants_markdown(data)
    parts = [describe_run(data, path.as_posix()), "", variants or markdown_table(data), ""]
    more = more_markdown(data)
    parts += [more, ""] if more else []
    parts += dropped
    parts += memory_lines(data)
    parts += validation_lines(data)
    if data.get("errors"):
        parts.append(f"- sections that failed in this run: {', '.join(data['errors'])}")
    png = path.with_suffix(".png")
    if png.is_file():
        link = Path(os.path.relpath(png.resolve(), doc_dir.resolve())) if doc_dir is not None else png
        parts += ["", f"![{data.get('device', '')}: HND vs strided NHD per measurement]({link.as_posix()})"]
    return "\n".join(parts).rstrip() + "\n"


KERNELS_HEADER = ["| back-end | S | HND | strided NHD | speedup | max abs diff | peak extra HND -> NHD |",
                  "|---|---|---|---|---|---|---|"]


def kernels_markdown(report: dict, source: str | None = None) -> str:
    """The isolated-attention table: per back-end and S, HND vs strided NHD."""
    env = report["environment"]
    where = f" Source: `{source}`." if source else ""
    lines = [f"**{env['device']}** ({env.get('compute_capability', '')}), torch {env['torch']}, "
             f"{report['heads']}x{report['head_dim']} heads {report['dtype']}.{where}", "", *KERNELS_HEADER]
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
    parser.add_argument("--doc", type=Path, help="Markdown file whose table markers to fill (docs/BENCHMARKS.md)")
    args = parser.parse_args(argv)
    blocks: dict[str, list[str]] = {}
    for path in args.json:
        blocks.setdefault(report_kind(json.loads(path.read_text())), []).append(
            section_markdown(path, args.doc.parent if args.doc else None))
    if args.doc:
        text = args.doc.read_text()
        for kind, parts in blocks.items():
            text = replace_between_markers(text, "\n".join(parts), kind)
        args.doc.write_text(text)
        print(f"updated {args.doc}: {', '.join(f'{k}-table' for k in blocks)}")
    else:
        print("\n".join(part for parts in blocks.values() for part in parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
