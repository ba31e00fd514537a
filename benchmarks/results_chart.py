"""The README's chart, docs/results.png (``python -m benchmarks.results_chart``), from the committed VRAM-budget
reports: seconds per step of the full int8 H3 on an H100 cut down to a smaller card, stock, KJNodes and the pack;
a bar where a variant ran, what stopped it where it did not."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: the chart is a file
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .results_table import budget_outcome, budget_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "vram-budget"
# (tokens, card GiB, reports): each variant from the first report that ran it in that cell (24 GiB / 149,936:
# the pack and KJNodes from the run of today's launches, stock from the earlier run, the only one that ran it)
CELLS = [
    (37810, 6, ["h100-int8-37810-6gib.json"]),
    (37810, 8, ["h100-int8-37810-8gib.json"]),
    (37810, 12, ["h100-int8-37810-12-16-24gib.json"]),
    (37810, 16, ["h100-int8-37810-12-16-24gib.json"]),
    (37810, 24, ["h100-int8-37810-12-16-24gib.json"]),
    (149936, 12, ["h100-int8-149936-12gib.json"]),
    (149936, 16, ["h100-int8-149936-16gib.json"]),
    (149936, 24, ["h100-int8-149936-24gib-launch-split.json", "h100-int8-149936-24gib.json"]),
]
VARIANTS = {"stock": ("stock ComfyUI", "#9a9a9a"), "kjnodes": ("KJNodes (lowest memory)", "#e0a040"),
            "pack": ("this pack", "#2f6db5")}


def outcomes(results: Path = RESULTS) -> dict:
    out = {}
    for tokens, card, files in CELLS:
        for variant in VARIANTS:
            for name in files:
                cell = next((c for c in json.loads((results / name).read_text())["cells"]
                             if c.get("budget_gib") == card and c.get("packed_rows", {}).get("total") == tokens), None)
                run = budget_runs(cell).get(variant) if cell else None
                if run:
                    done = not run.get("error") and "crashed" not in run
                    out[(tokens, card, variant)] = run["seconds_per_step"] if done else budget_outcome(run)
                    break
            else:
                out[(tokens, card, variant)] = "not run"
    return out


def draw(data: dict, path: Path) -> dict:
    """The chart into ``path``; returns the height of every bar drawn, {(tokens, card, variant): seconds}."""
    drawn = {}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [5, 3]})
    for ax, tokens in zip(axes, (37810, 149936)):
        cards = [card for t, card, _ in CELLS if t == tokens]
        top = max(v for (t, _, _), v in data.items() if t == tokens and isinstance(v, float))
        for i, (variant, (label, color)) in enumerate(VARIANTS.items()):
            for x, card in enumerate(cards):
                value, at = data[(tokens, card, variant)], x + (i - 1) * 0.27
                if isinstance(value, float):
                    bar = ax.bar(at, value, 0.25, color=color)
                    drawn[(tokens, card, variant)] = bar.patches[0].get_height()
                    ax.text(at, value + top * 0.01, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
                else:
                    ax.text(at, top * 0.02, value, rotation=90, ha="center", va="bottom", fontsize=7, color="#b03030")
        ax.set_xticks(range(len(cards)), [f"{card} GiB card" for card in cards])
        ax.set_xlim(-0.6, len(cards) - 0.4)
        ax.set_ylim(0, top * 1.25)
        ax.set_title(f"{tokens:,} tokens", fontsize=10)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].set_ylabel("seconds per step (lower is faster)")
    handles = [Patch(color=color, label=label) for label, color in VARIANTS.values()]
    axes[0].legend(handles=handles, frameon=False, fontsize=8, loc="upper left", ncol=3)
    fig.suptitle("Full MiniMax H3 (int8 weights) sampled on an H100 cut down to a smaller card", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: the same numbers, the same file
    plt.close(fig)
    return drawn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results.png")
    args = parser.parse_args(argv)
    draw(outcomes(), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
