"""Markdown tables from benchmark JSONs, a row per report (or sampled variant): docs/BENCHMARKS.md's tables are made
with this, never by hand (the doc gives the command). With ``--doc``, each fills the doc's block between
``<!-- NAME-table:start -->`` and ``<!-- NAME-table:end -->``. Variants run with a setting the pack no longer offers
(``REMOVED_SETTINGS``) are left out of every table; the JSON keeps them.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .report import markdown, ratio

# settings of variants that the pack no longer offers (removed after f9302b4)
REMOVED_SETTINGS = {"block_path": {"fused"}, "prep": {"fused", "fused_rotated"},
                    "prep_mode": {"fused", "fused_rotated"}}
# keys a report keeps per variant NAME (in block rows, sampling sections, profiler and validation items)
VARIANT_KEYS = ("{}", "{}_p50_seconds", "{}_spread", "{}_kernel_launches", "{}_seconds", "{}_checksums",
                "{}_peak_allocated_bytes", "{}_peak_reserved_bytes", "stock_over_{}", "stock_vs_{}_bit_exact",
                "stock_vs_{}_max_abs_difference", "stock_vs_{}_relative_l2", "stock_vs_{}_identical",
                "blocks_stock_vs_{}", "sampling_2_step_stock_vs_{}", "sampling_12_step_stock_vs_{}")


def removed_variants(data: dict) -> list[str]:
    return [name for name, s in (data.get("variant_settings") or {}).items()
            if any(s.get(key) in values for key, values in REMOVED_SETTINGS.items())]


def _drop(node, keys: set, name: str):
    if isinstance(node, dict):
        return {k: _drop(v, keys, name) for k, v in node.items() if k not in keys}
    if isinstance(node, list):
        return [_drop(v, keys, name) for v in node if v != name]
    return node


def without_removed(data: dict) -> dict:
    for name in removed_variants(data):
        data = _drop(data, {k.format(name) for k in VARIANT_KEYS}, name)
    return data


def load(path: Path) -> dict:
    return without_removed(json.loads(Path(path).read_text()))


def weights_of(data: dict) -> str:
    source = (data.get("model") or {}).get("source", "")
    return data.get("weights") or (source.split()[1] if source.startswith("random ") else "checkpoint")


def sources(reports: list[dict], paths: list[Path]) -> list[str]:
    """A line per environment (device, versions, stock's attention, the peer) naming the reports made there."""
    by_env: dict[str, list[str]] = {}
    for data, path in zip(reports, paths):
        peer = data.get("peer") or {}
        sha = peer.get("sha256")
        where = peer.get("git_commit") or (sha and f"nodes/minimax_nodes.py sha256 {sha[:12]}")
        env = (f"{data.get('device', '?')}, torch {data.get('torch', '?')}, "
               f"ComfyUI {(data.get('comfyui') or {}).get('version', '?')}, "
               f"stock `{data.get('stock_attention', '?')}`" + (f", KJNodes {where}" if where else ""))
        by_env.setdefault(env, []).append(f"`{Path(path).as_posix()}`")
    return [f"- {env}: {', '.join(files)}" for env, files in by_env.items()]


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def block_row(data: dict, names: list[str], report: str) -> tuple[str, ...]:
    blocks = data["real_block_results"]
    ratios = [" / ".join(ratio(b.get(f"stock_over_{n}")) for b in blocks) if f"{n}_p50_seconds" in blocks[0] else "-"
              for n in names]
    compared = [n for n in names if f"stock_vs_{n}_bit_exact" in blocks[0]]
    differ = [f"{n} max abs " + " / ".join(f"{b[f'stock_vs_{n}_max_abs_difference']:.3g}" for b in blocks)
              for n in compared if not all(b[f"stock_vs_{n}_bit_exact"] for b in blocks)]
    peaks = blocks[0].get("peak_extra_bytes") or {}
    return (report, weights_of(data), f"{data.get('packed_tokens', 0):,}", str(blocks[0].get("reps", "?")),
            " / ".join(_ms(b.get("stock_p50_seconds")) for b in blocks) + " ms", *ratios,
            "-" if not compared else "; ".join(differ) or "all bit-exact",
            " / ".join(_mib(peaks.get(n)) for n in ["stock", *names]))


def block_notes(data: dict, report: str) -> list[str]:
    notes = []
    for row in data.get("compiled_block_results") or []:
        ratios = ", ".join(f"{k.removeprefix('stock_over_')} {ratio(v)}" for k, v in row.items()
                           if k.startswith("stock_over_"))
        notes.append(f"- {report}, torch.compile, block {row['block']}: compiled stock "
                     f"{_ms(row.get('stock_p50_seconds'))} ms; stock / variant: {ratios}")
    memory = data.get("peak_memory_long_sequence")
    if memory:
        errors = memory.get("errors") or {}
        skipped = [n for n, e in errors.items() if e.startswith("not run")]
        peaks = [f"{n} {_mib(p)} MiB" if p is not None else f"{n} {errors.get(n, '-').splitlines()[0][:80]}"
                 for n, p in memory["peak_extra_bytes"].items() if n not in skipped]
        notes.append(f"- {report}, one block at {memory['packed_tokens']:,} tokens ({memory['frames']} frames), "
                     f"peak extra: {', '.join(peaks)}" + (f"; not run after that fault: {', '.join(skipped)}"
                                                          if skipped else ""))
    return notes


def blocks_markdown(named: list[tuple[str, dict]]) -> list[str]:
    keys = [key for _, data in named for key in (data.get("real_block_results") or [{}])[0]]
    names = list(dict.fromkeys(key[:-len("_p50_seconds")] for key in keys
                               if key.endswith("_p50_seconds") and key != "stock_p50_seconds"))
    header = ("report", "weights", "tokens", "reps", "stock, block 0 / 1", *(f"stock / {n}" for n in names),
              "equal to stock", "peak extra MiB: " + " / ".join(["stock", *names]))
    lines = markdown(header, [block_row(data, names, label) for label, data in named])
    notes = [note for label, data in named for note in block_notes(data, label)]
    return lines + ([""] + notes if notes else [])


def blocks_table(paths: list[Path]) -> str:
    reports = [load(p) for p in paths]
    return "\n".join(blocks_markdown([(Path(p).stem, d) for p, d in zip(paths, reports)]) + [""]
                     + sources(reports, paths))


SAMPLING_HEADER = ("weights", "blocks", "steps", "variant", "stock", "variant s", "stock / variant",
                   "latents", "peak allocated GB, stock / variant")


def sampling_rows(data: dict) -> list[tuple[str, ...]]:
    rows = []
    for key in ("sampling_2_step", "sampling_12_step"):
        s = data.get(key) or {}
        for name in [n for n in dict.fromkeys(s.get("order", ())) if n != "stock" and "stock_seconds" in s]:
            same = s.get(f"stock_vs_{name}_identical")
            peaks = [s.get(f"{n}_peak_allocated_bytes") for n in ("stock", name)]
            blocks = str((data.get("model") or {}).get("blocks", "?"))
            rows.append((weights_of(data), blocks, str(s["steps"]), name,
                         f"{s['stock_seconds']:.2f} s", f"{s[f'{name}_seconds']:.2f} s",
                         ratio(s.get(f"stock_over_{name}")),
                         "identical" if same else "differ" if same is False else "-",
                         " / ".join("-" if p is None else f"{p / 1e9:.2f}" for p in peaks)))
    return rows


def sampling_table(paths: list[Path]) -> str:
    reports = [load(p) for p in paths]
    lines = markdown(SAMPLING_HEADER, [r for d in reports for r in sampling_rows(d)]) + [""]
    return "\n".join(lines + sources(reports, paths))


def run_tables(data: dict, label: str) -> str:
    """The block and sampling tables of one report (what a run prints last)."""
    data = without_removed(data)
    parts = ["\n".join(blocks_markdown([(label, data)]))] if data.get("real_block_results") else []
    rows = sampling_rows(data)
    return "\n\n".join(parts + (["\n".join(markdown(SAMPLING_HEADER, rows))] if rows else []))


KERNELS_HEADER = ("back-end", "S", "HND", "strided NHD", "speedup", "max abs diff", "peak extra MiB, HND -> NHD")


def kernel_rows(report: dict, shown: set) -> list[tuple[str, ...]]:
    """``benchmarks.isolated_attention``'s rows; a back-end in ``shown`` (an earlier report's) is left out."""
    rows = []
    for name, by_seq in report["results"].items():
        if name in shown:
            continue
        shown.add(name)
        if "skipped" in by_seq:
            rows.append((name, "-", f"skipped: {by_seq['skipped']}", "", "", "", ""))
        for seq, row in ({} if "skipped" in by_seq else by_seq).items():
            if "error" in row:
                rows.append((name, f"{int(seq):,}", f"error: {row['error']}", "", "", "", ""))
                continue
            rows.append((name, f"{int(seq):,}", f"{_ms(row['hnd_median_seconds'])} ms",
                         f"{_ms(row['strided_nhd_median_seconds'])} ms", ratio(row["speedup"]),
                         f"{row['max_abs_difference']:.3g}",
                         "-" if row["hnd_peak_extra_bytes"] is None else
                         f"{_mib(row['hnd_peak_extra_bytes'])} -> {_mib(row['strided_nhd_peak_extra_bytes'])}"))
    return rows


def kernels_table(paths: list[Path]) -> str:
    shown: set = set()
    reports = [load(p) for p in paths]
    rows = [r for report in reports for r in kernel_rows(report, shown)]
    notes = [f"- `{Path(p).as_posix()}`: {r['environment']['device']}, torch {r['environment']['torch']}, "
             f"{r['heads']}x{r['head_dim']} heads {r['dtype']}" for r, p in zip(reports, paths)]
    return "\n".join(markdown(KERNELS_HEADER, rows) + [""] + notes)


def budget_runs(cell: dict) -> dict:
    """The cell's runs by variant, with the one its process died in (a signal or an exit code before its run was
    recorded) as ``{"crashed": exit code}``."""
    stage, code = cell.get("stage") or "", cell.get("returncode")
    name = stage.removeprefix("sample ")
    crashed = isinstance(code, int) and code != 0 and name != stage and name not in cell.get("runs", {})
    return dict(cell.get("runs", {}), **({name: {"crashed": code}} if crashed else {}))


def budget_outcome(run: dict | None) -> str:
    if not run:
        return "not run"
    if "crashed" in run:
        return "process died"
    error = run.get("error")
    if error:
        return "out of memory" if error.get("oom") else f"error ({error['type']})"
    return f"{run['seconds_per_step']:.2f} s"


def budget_ratio(a: dict | None, b: dict | None) -> float | None:
    """a's seconds per step over b's (how many times faster b is), where both completed."""
    done = [r.get("seconds_per_step") for r in (a, b) if r and not r.get("error")]
    return done[0] / done[1] if len(done) == 2 and all(done) else None


def timeline_text(run: dict) -> str | None:
    """Where the run's profiled last step went (``benchmarks.step_timeline``), or None."""
    timeline = run.get("last_step_timeline") or {}
    t = timeline.get("seconds")
    if not t:
        return None
    text = (f"last step {t['wall']:.2f} s: kernels {t['kernels']:.2f} s, weight copies {t['host_to_device']:.2f} s "
            f"({t['host_to_device_exposed']:.2f} s not hidden behind kernels), idle {t['idle']:.2f} s")
    families = timeline.get("kernel_seconds_by_family")
    if families:
        text += "; " + ", ".join(f"{name} {s:.2f} s" for name, s in families.items())
    clocks = timeline.get("clocks") or {}
    if clocks.get("problem"):
        text += f"; clocks not sampled ({clocks['problem']})"
    elif clocks:
        text += "; SM clock " + ", ".join(f"{name} {c['sm_mhz']:.0f} MHz {c['watts']:.0f} W {c['celsius']:.0f} C"
                                          for name, c in clocks.items() if c)
    return text


def _card(cell: dict) -> str:
    return "whole card" if cell.get("budget_gib") is None else f"{cell['budget_gib']:g} GiB"


def _tokens(cell: dict) -> str:
    return f"{cell.get('packed_rows', {}).get('total', cell.get('tokens_asked')):,}"


def budget_markdown(datas: list[dict]) -> list[str]:
    """Budget x length: seconds per step (steps after the first) or why not, and the pack's lead."""
    rows = []
    for cell in sorted((c for d in datas for c in d["cells"]),
                       key=lambda c: (c.get("packed_rows", {}).get("total", 0), c.get("budget_gib") or 1e9)):
        runs = budget_runs(cell)
        lead = [budget_ratio(runs.get(other), runs.get("pack")) for other in ("stock", "kjnodes")]
        rows.append((_card(cell), _tokens(cell), *(budget_outcome(runs.get(n)) for n in ("stock", "kjnodes", "pack")),
                     *("" if r is None else f"{r:.3f}x" for r in lead)))
    return markdown(("card", "tokens", "stock", "KJNodes (lowest memory)", "the pack", "pack vs stock",
                     "pack vs KJNodes"), rows)


def budget_details(data: dict) -> list[str]:
    lines = []
    for cell in data["cells"]:
        error = cell.get("error")
        parts = [f"cell failed at {cell.get('stage')}: {error['type']}: {error['message']}"] if error else []
        for name, run in budget_runs(cell).items():
            if "crashed" in run:
                parts.append(f"{name}: the process died while sampling (exit code {run['crashed']})")
                continue
            if run.get("error"):
                why = "" if run["error"].get("oom") else f" ({run['error']['message'][:90]})"
                parts.append(f"{name} {budget_outcome(run)}{why}")
                continue
            same = run.get("vs_stock", {}).get("identical")
            facts = [f"peak {run['peak_allocated_bytes'] / 2**30:.2f} GiB"] if "peak_allocated_bytes" in run else []
            facts.append(f"copied {(run['copied_bytes_per_step'] or 0) / 2**30:.1f} GiB/step")
            if same is not None:
                facts.append("stock's bits" if same else "not stock's bits")
            if timeline := timeline_text(run):
                facts.append(timeline)
            parts.append(f"{name} " + ", ".join(facts))
        lines.append(f"- {_card(cell)}, {_tokens(cell)} tokens: " + "; ".join(parts))
    return lines


def budget_table(paths: list[Path]) -> str:
    reports = [load(p) for p in paths]
    lines = budget_markdown(reports) + [""]
    for data, path in zip(reports, paths):
        cell = next((c for c in data["cells"] if c.get("gpu")), {})
        lines.append(f"- {cell.get('gpu', 'no GPU')}, torch {cell.get('torch')}, "
                     f"ComfyUI {cell.get('comfyui', {}).get('version')}, loader {data.get('loader')}, "
                     f"{data.get('steps')} steps a run: `{path}`")
        lines += budget_details(data)
    return "\n".join(lines)


def replace_between_markers(text: str, block: str, kind: str) -> str:
    start, end = f"<!-- {kind}-table:start -->", f"<!-- {kind}-table:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no {start} ... {end} markers in the file")
    return pattern.sub(lambda _: f"{start}\n{block.rstrip()}\n{end}", text, count=1)


def main(argv=None) -> int:
    makers = {"blocks": blocks_table, "sampling": sampling_table, "kernels": kernels_table, "budget": budget_table}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for kind in makers:
        parser.add_argument(f"--{kind}", nargs="+", type=Path, default=[], metavar="JSON")
    parser.add_argument("--doc", type=Path, help="Markdown file whose table markers to fill (docs/BENCHMARKS.md)")
    args = parser.parse_args(argv)
    tables = {kind: make(getattr(args, kind)) for kind, make in makers.items() if getattr(args, kind)}
    if not tables:
        parser.error("give at least one of --blocks, --sampling, --kernels, --budget")
    if args.doc:
        text = args.doc.read_text()
        for kind, table in tables.items():
            text = replace_between_markers(text, table, kind)
        args.doc.write_text(text)
        print(f"updated {args.doc}: {', '.join(f'{k}-table' for k in tables)}")
    else:
        print("\n\n".join(tables.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
