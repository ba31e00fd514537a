"""PNG chart of a results JSON: HND vs strided NHD (and stock) per measurement.

    python -m benchmarks.plot benchmarks/results/h200-sage2.json            # writes h200-sage2.png beside it
    python -m benchmarks.plot results.json --png chart.png

Needs matplotlib (the benchmark run writes the chart itself when it is installed; otherwise make
it afterwards from the JSON with this command).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = {"stock": "#9e9e9e", "hnd": "#e07b39", "strided_nhd": "#2b7bba", "attention_only": "#7fb3d5",
          "kj_lowvram": "#8e44ad", "kj_lowvram_chunkff": "#c39bd3"}
LABELS = {"stock": "stock ComfyUI", "hnd": "HND (baseline)", "strided_nhd": "strided NHD",
          "attention_only": "strided NHD, attention only", "kj_lowvram": "KJNodes Low VRAM Attention",
          "kj_lowvram_chunkff": "KJNodes Low VRAM + Chunk FF"}


def _groups(data: dict) -> list[tuple[str, str, list[tuple[str, dict]]]]:
    """(panel title, unit, [(measurement label, {variant: value})]) for each panel."""
    fast = []
    iso = data.get("isolated_attention_layout") or {}
    if iso:
        fast.append(("attention", {v: iso.get(f"{v}_mean_seconds") for v in ("hnd", "strided_nhd")}))
    for block in data.get("real_block_results") or []:
        fast.append((f"block {block['block']}", {v: block.get(f"{v}_p50_seconds") for v in COLORS}))
    slow = []
    for key, label in (("sampling_2_step", "2-step"), ("sampling_12_step", "12-step")):
        s = data.get(key) or {}
        if s:
            slow.append((label, {v: s.get(f"{v}_seconds") for v in COLORS}))
    prof = data.get("profiler_block_recapture") or {}
    launches = []
    if prof:
        launches.append(("kernels / block", {v: prof.get(f"{v}_kernel_launches") for v in COLORS}))
    # the same measurements as ratios: a few percent is invisible on absolute bars
    ratios = []
    for label, vals in fast + slow:
        s = vals.get("strided_nhd")
        if s:
            ratios.append((label, {v: (vals[v] / s if vals.get(v) else None) for v in COLORS if v != "strided_nhd"}))
    panels = (("attention and one block (p50)", "ms", fast), ("sampling", "s", slow),
              ("time / strided NHD time", "x", ratios), ("kernel launches per block", "", launches))
    return [(title, unit, items) for title, unit, items in panels
            if any(v is not None for _, vals in items for v in vals.values())]


def write_chart(data: dict, png: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _groups(data)
    if not panels:
        raise ValueError("the report has no measurement to plot")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, (title, unit, items) in zip(axes[0], panels):
        variants = [v for v in COLORS if any(vals.get(v) is not None for _, vals in items)]
        width = 0.8 / max(len(variants), 1)
        for j, variant in enumerate(variants):
            xs, ys = [], []
            for i, (_, vals) in enumerate(items):
                if vals.get(variant) is not None:
                    xs.append(i + (j - (len(variants) - 1) / 2) * width)
                    ys.append(vals[variant] * (1e3 if unit == "ms" else 1))
            bars = ax.bar(xs, ys, width, color=COLORS[variant], label=LABELS[variant])
            ax.bar_label(bars, fmt={"x": "%.3f", "": "%d"}.get(unit, "%.1f"), fontsize=7, padding=1)
        if unit == "x":
            values = [v for _, vals in items for v in vals.values() if v is not None] + [1.0]
            ax.set_ylim(min(values) - 0.02, max(values) + 0.02)
            ax.axhline(1.0, color="#2b7bba", linewidth=1, linestyle="--")
        ax.set_xticks(range(len(items)), [label for label, _ in items])
        ax.set_title(title)
        if unit in ("ms", "s"):
            ax.set_ylabel(unit)
        ax.legend(fontsize=7, loc="best")
    where = f"{data.get('device', '?')}, torch {data.get('torch', '?')}, back-end {data.get('attention', '?')}"
    shape = f"{data.get('resolution', ['?', '?'])[0]}x{data.get('resolution', ['?', '?'])[1]}x{data.get('frames', '?')}"
    fig.suptitle(f"MiniMax H3, {shape}, {data.get('packed_tokens', '?')} tokens: {where}", fontsize=10)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--png", type=Path, help="output path (default: the JSON's name with .png)")
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    print(write_chart(data, args.png or args.json.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
