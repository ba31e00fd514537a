"""The results report: one dict in the reference's shape, written after every section (a failed section leaves
its error under ``errors``, so a run that dies midway still says what it measured); the check that it carries every
key of the reference system's report (benchmarks/reference/gb10-strided-nhd-results.json) with the same type, but for
those listed here with the reason; and the plain-text and Markdown tables made from it."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

LAYOUTS = ("hnd", "strided_nhd")

# Reference key path -> our key path, where the reference's name says something untrue of our run.
RENAMED = {
    "nsight_block_recapture": "profiler_block_recapture",  # counted with torch.profiler, not Nsight Systems
    # "component1" was the reference system's internal name for its HND baseline run
    "sampling_12_step.component1_hnd_seconds": "sampling_12_step.hnd_seconds",
}

# Reference key paths with no counterpart in this harness.
NOT_APPLICABLE = {
    "sampling_12_step.cumulative_reduction_vs_unfused_310_11_second_baseline":
        "the reference machine's older unfused baseline; no such run exists here",
    "validation.deployed_tests": "the pack's tests run in CI, not inside the benchmark",
    "feature_flag": "the reference system's environment switch; the layouts here come from --layout",
}

# Measurements that only exist on a CUDA device: null in a CPU report.
CUDA_ONLY = {
    "sampling_2_step.peak_allocated_bytes_saved", "sampling_2_step.peak_reserved_bytes_saved",
    "profiler_block_recapture.hnd_kernel_launches", "profiler_block_recapture.strided_nhd_kernel_launches",
    "profiler_block_recapture.removed_kernel_launches",
}


def load_reference(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def check_against_reference(report: dict, reference: dict, *, allow_null: set[str] = frozenset()) -> list[str]:
    """Lines naming each reference key our report lacks or carries with another type (a list of objects: each of
    the reference's items against each of ours)."""
    problems = []

    def check(ref: dict, ours, ref_prefix: str, our_prefix: str) -> None:
        for key, ref_value in ref.items():
            ref_path = ref_prefix + key
            if ref_path in NOT_APPLICABLE:
                continue
            path = RENAMED.get(ref_path, our_prefix + key)
            name = path.rsplit(".", 1)[-1]
            if not isinstance(ours, dict) or name not in ours:
                problems.append(f"missing {path}" + (f" (reference: {ref_path})" if path != ref_path else ""))
                continue
            value = ours[name]
            if value is None and path in allow_null:
                continue
            kind, ref_kind = type(value).__name__, type(ref_value).__name__
            if kind != ref_kind:
                problems.append(f"{path}: {kind} {value!r:.60}, reference has {ref_kind}")
            elif isinstance(ref_value, dict):
                check(ref_value, value, ref_path + ".", path + ".")
            elif ref_value and isinstance(ref_value, list) and isinstance(ref_value[0], dict):
                if not value:
                    problems.append(f"missing {path}[]: no items")
                for ref_item, item in ((r, o) for r in ref_value for o in value):
                    check(ref_item, item, ref_path + "[].", path + "[].")
            elif ref_value and isinstance(ref_value, list):
                if isinstance(ref_value[0], (int, float)) and len(value) != len(ref_value):
                    problems.append(f"{path}: {len(value)} items, reference has {len(ref_value)}")
                elif any(type(a) is not type(b) for a, b in zip(value, ref_value)):
                    problems.append(f"{path}: item types {[type(a).__name__ for a in value]}, "
                                    f"reference has {[type(b).__name__ for b in ref_value]}")

    check(reference, report, "", "")
    return list(dict.fromkeys(problems))  # a list's items each report the same key once


class Report:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.data: dict = {"sections_completed": [], "errors": {}}

    def update(self, **fields) -> None:
        self.data.update(fields)

    def section(self, name: str, result) -> None:
        self.data[name] = result
        if name not in self.data["sections_completed"]:
            self.data["sections_completed"].append(name)
        self.data["errors"].pop(name, None)
        self.write()

    def validation(self, item: str, verdict: str) -> None:
        self.data.setdefault("validation", {})[item] = verdict

    def fail(self, name: str, exc: BaseException) -> None:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        self.data["errors"][name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": "".join(lines[-6:])}
        self.write()

    def write(self) -> None:
        """Atomically (a reader never sees half a file); a copy under $OUT too (the GPU machine hands it back)."""
        copy = Path(os.environ["OUT"]) / self.path.name if os.environ.get("OUT") else self.path
        text = json.dumps(self.data, indent=2, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))
        for path in dict.fromkeys([self.path, copy]):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text + "\n")
            os.replace(tmp, path)


def dump(data: dict, path: str | None) -> None:
    """A standalone benchmark's JSON into ``path`` (its ``--out``), where one is given."""
    if path:
        Path(path).write_text(json.dumps(data, indent=1))


def equality_verdict(diff: dict) -> str:
    if diff.get("bit_exact"):
        return "bit-exact"
    return f"outputs differ: max abs {diff['max_abs_difference']:.6g}, mean abs {diff['mean_abs_difference']:.6g}"


def seconds(value, unit="s") -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.2f} ms" if unit == "ms" else f"{value:.3f} s"


def ratio(value) -> str:
    return "-" if value is None else f"{value:.3f}x"


def table_rows(data: dict) -> list[tuple[str, str, str, str, str]]:
    rows = []
    iso = data.get("isolated_attention_layout")
    if iso:
        rows.append(("isolated attention (mean)", "-", seconds(iso.get("hnd_mean_seconds"), "ms"),
                     seconds(iso.get("strided_nhd_mean_seconds"), "ms"), ratio(iso.get("speedup"))))
    for block in data.get("real_block_results") or []:
        rows.append((f"block {block['block']} (p50)", seconds(block.get("stock_p50_seconds"), "ms"),
                     seconds(block.get("hnd_p50_seconds"), "ms"), seconds(block.get("strided_nhd_p50_seconds"), "ms"),
                     ratio(block.get("speedup"))))
    for key, label in (("sampling_2_step", "2-step sampling"), ("sampling_12_step", "12-step sampling")):
        s = data.get(key)
        if s:
            rows.append((label, seconds(s.get("stock_seconds")), seconds(s.get("hnd_seconds")),
                         seconds(s.get("strided_nhd_seconds")), ratio(s.get("speedup"))))
    prof = data.get("profiler_block_recapture")
    if prof:
        counts = [prof.get(f"{n}_kernel_launches") for n in ("stock", "hnd", "strided_nhd")]
        removed = prof.get("removed_kernel_launches")
        rows.append(("kernel launches per block", *("-" if c is None else str(c) for c in counts),
                     "-" if removed is None else f"-{removed}"))
    s2 = data.get("sampling_2_step")
    if s2 and s2.get("peak_allocated_bytes_saved") is not None:
        rows.append(("2-step peak allocated saved", "-", "-", "-",
                     f"{s2['peak_allocated_bytes_saved'] / 2**30:.2f} GiB"))
    return rows


def aligned(rows: list[tuple[str, ...]], numbers: bool = False) -> list[str]:
    """Plain-text columns under a rule below the header; ``numbers``: right-aligned past the first."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if numbers and i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def text_table(data: dict) -> str:
    header = ("measurement", "stock ComfyUI", "HND", "strided NHD", "HND / strided NHD")
    return "\n".join(aligned([header] + table_rows(data), numbers=True))


def correctness_table(data: dict) -> str:
    """What a run on any machine proves, without timings: per sampled variant what ran, its checksums, equality."""
    sampling = data.get("sampling_2_step") or data.get("sampling_12_step") or {}
    ran = data.get("attention_by_variant") or {}
    names = list(dict.fromkeys(["stock", *sampling.get("order", ()), "hnd", "strided_nhd"]))
    sums = {name: sampling[f"{name}_checksums"] for name in names if f"{name}_checksums" in sampling}
    rows = [("variant", "attention that ran", "video checksum", "audio checksum")]
    rows += [(name, ran.get(name, "-"), f"{s[0]:.6g}", f"{s[1]:.6g}") for name, s in sums.items()]
    verdicts = []
    if "identical_video_and_audio" in sampling:
        verdicts.append("hnd vs strided_nhd: " + ("identical latents" if sampling["identical_video_and_audio"]
                                                  else f"DIFFER (max abs {sampling['max_abs_difference']})"))
    for key, value in sampling.items():
        if key.startswith("stock_vs_") and key.endswith("_identical"):
            verdicts.append(f"stock vs {key[9:-10]}: " + ("identical latents" if value else "DIFFER"))
    return "\n".join(aligned(rows) + verdicts)


def first_contact_row(run: dict) -> tuple[str, ...]:
    blocks, pack = run["blocks"], run["pack"]
    stock_s, pack_s = ([b[f"{n}_p50_seconds"] for b in blocks] for n in ("stock", pack))
    worst = max(b[f"stock_vs_{pack}_max_abs_difference"] for b in blocks)
    peaks = [[b["peak_extra_bytes"].get(n) for b in blocks] for n in ("stock", pack)]
    return (run["weights"], f"{run['packed_tokens']:,}", *(f"{sum(t) / len(t) * 1e3:.2f}" for t in (stock_s, pack_s)),
            ratio(sum(stock_s) / sum(pack_s)),
            "yes" if all(b[f"stock_vs_{pack}_bit_exact"] for b in blocks) else f"no (max abs {worst:.3g})",
            " / ".join("-" if None in p else f"{max(p) / 2**20:,.0f}" for p in peaks))


def first_contact_table(data: dict) -> str:
    """``--first-contact``'s table: per format and length, stock and the pack; what the pack ran; the memory."""
    plan, errors = data["first_contact"], data["errors"]
    rows = [("weights", "tokens", "stock ms/block", "pack ms/block", "stock / pack", "bit-identical",
             "peak extra MiB, stock / pack")]
    notes, reps = {}, "?"
    for weights in plan["formats"]:
        for tokens in plan["lengths"]:
            run = data.get(f"first_contact_{weights}_{tokens}")
            if run is None:  # failed (the error's first words), or not reached
                error = (errors.get(f"first_contact_{weights}_{tokens}") or {}).get("error", "")
                rows.append((weights, f"{tokens:,}", "not run" + (f": {error[:90]}" if error else ""), *[""] * 4))
                continue
            rows.append(first_contact_row(run))
            int8 = "; ".join(r["reason"] for r in run["int8_stock_quantizer"])
            notes[weights] = f"{weights}: the pack ran {run['pack_ran']}" + (
                f"; its int8 linears kept stock's quantiser: {int8}" if int8 else
                "; its int8 linears ran its own quantiser" if run["int8_own_quantizer_calls"] else "")
            reps = run["blocks"][0]["reps"]
    c, ck = (data.get("model") or {}).get("config", {}), data.get("comfy_kitchen") or {}
    head = (f"H3 blocks 0 and 1 (hidden {c.get('hidden_size')}, {c.get('num_attention_heads')} heads x "
            f"{c.get('attention_head_dim')}) on {data.get('device')}: stock ComfyUI ({data.get('stock_attention')}) "
            f"beside the pack ({data.get('layout')}, back-end {data.get('attention_requested')}), p50 of {reps} reps; "
            f"comfy-kitchen {ck.get('release')} (int8 route: {ck.get('route')})")
    return "\n".join([head, ""] + aligned(rows, numbers=True) + [*notes.values(), f"lengths by memory: {plan['why']}"])


def markdown(header, rows) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])
