"""The results report: one dict in the reference's shape, written to disk after every section.

A section that fails leaves its error under ``errors`` and the sections before it intact, so a
run that dies midway still says what it measured.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

LAYOUTS = ("hnd", "strided_nhd")


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
        """Write atomically: a reader never sees half a file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=_json_default) + "\n")
        os.replace(tmp, self.path)


def _json_default(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def equality_verdict(diff: dict | None, what: str = "outputs") -> str:
    """'bit-exact' or the measured difference."""
    if diff is None:
        return "not measured"
    if diff.get("bit_exact"):
        return "bit-exact"
    return f"{what} differ: max abs {diff['max_abs_difference']:.6g}, mean abs {diff['mean_abs_difference']:.6g}"


def _fmt_s(value, unit="s"):
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value * 1e3:.2f} ms"
    return f"{value:.3f} s"


def _fmt_x(value):
    return "-" if value is None else f"{value:.3f}x"


def table_rows(data: dict) -> list[tuple[str, str, str, str, str]]:
    """(measurement, stock, HND, strided NHD, HND/strided NHD) rows from a report dict."""
    rows = []
    iso = data.get("isolated_attention_layout")
    if iso:
        rows.append(("isolated attention (mean)", "-", _fmt_s(iso.get("hnd_mean_seconds"), "ms"),
                     _fmt_s(iso.get("strided_nhd_mean_seconds"), "ms"), _fmt_x(iso.get("speedup"))))
    for block in data.get("real_block_results") or []:
        rows.append((f"block {block['block']} (p50)", _fmt_s(block.get("stock_p50_seconds"), "ms"),
                     _fmt_s(block.get("hnd_p50_seconds"), "ms"), _fmt_s(block.get("strided_nhd_p50_seconds"), "ms"),
                     _fmt_x(block.get("speedup"))))
    for key, label in (("sampling_2_step", "2-step sampling"), ("sampling_12_step", "12-step sampling")):
        s = data.get(key)
        if s:
            rows.append((label, _fmt_s(s.get("stock_seconds")), _fmt_s(s.get("hnd_seconds")),
                         _fmt_s(s.get("strided_nhd_seconds")), _fmt_x(s.get("speedup"))))
    prof = data.get("profiler_block_recapture")
    if prof:
        def n(v):
            return "-" if v is None else str(v)
        removed = prof.get("removed_kernel_launches")
        rows.append(("kernel launches per block", n(prof.get("stock_kernel_launches")),
                     n(prof.get("hnd_kernel_launches")), n(prof.get("strided_nhd_kernel_launches")),
                     "-" if removed is None else f"-{removed}"))
    s2 = data.get("sampling_2_step")
    if s2 and s2.get("peak_allocated_bytes_saved") is not None:
        rows.append(("2-step peak allocated saved", "-", "-", "-",
                     f"{s2['peak_allocated_bytes_saved'] / 2**30:.2f} GiB"))
    return rows


HEADER = ("measurement", "stock ComfyUI", "HND", "strided NHD", "HND / strided NHD")


def text_table(data: dict) -> str:
    more = more_markdown(data)
    variants = variants_markdown(data)
    if variants:
        return "\n\n".join(p for p in (variants, more) if p)
    rows = [HEADER] + table_rows(data)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + (f"\n\n{more}" if more else "")


def markdown_table(data: dict) -> str:
    rows = table_rows(data)
    out = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def correctness_table(data: dict) -> str:
    """What a run on any machine proves, without timings: per sampled variant, the back-end that ran and
    the sampled checksums, and whether the outputs are equal (for the first-run summary on a CPU)."""
    sampling = data.get("sampling_2_step") or data.get("sampling_12_step") or {}
    ran = data.get("attention_by_variant") or {}
    names = list(dict.fromkeys(["stock", *sampling.get("order", ()), "hnd", "strided_nhd"]))
    rows = [("variant", "attention that ran", "video checksum", "audio checksum")]
    for name in names:
        sums = sampling.get(f"{name}_checksums")
        if sums is None:
            continue
        rows.append((name, ran.get(name, "-"), f"{sums[0]:.6g}", f"{sums[1]:.6g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    verdicts = []
    if "identical_video_and_audio" in sampling:
        verdicts.append("hnd vs strided_nhd: " + ("identical latents" if sampling["identical_video_and_audio"]
                                                  else f"DIFFER (max abs {sampling['max_abs_difference']})"))
    for key, value in sampling.items():
        if key.startswith("stock_vs_") and key.endswith("_identical"):
            verdicts.append(f"stock vs {key[9:-10]}: " + ("identical latents" if value else "DIFFER"))
    return "\n".join(lines + verdicts)


def variant_rows(data: dict) -> list[tuple[str, ...]]:
    """One row per variant of the block section: p50 per block, stock over it, equality with stock,
    peak extra memory and kernel launches of one block. Empty when only stock and the layouts ran."""
    blocks = data.get("real_block_results") or []
    if not blocks:
        return []
    names = [k[:-len("_p50_seconds")] for k in blocks[0] if k.endswith("_p50_seconds")]
    if set(names) <= {"stock", "hnd", "strided_nhd"}:
        return []
    prof = data.get("profiler_block_recapture") or {}
    ran = data.get("attention_by_variant") or {}
    rows = []
    for name in names:
        times = " / ".join(_fmt_s(b.get(f"{name}_p50_seconds"), "ms") for b in blocks)
        # the block section stores stock_over_<variant> for every variant
        ratio = " / ".join(_fmt_x(1.0 if name == "stock" else b.get(f"stock_over_{name}")) for b in blocks)
        if name == "stock" or not any(f"stock_vs_{name}_bit_exact" in b for b in blocks):
            same = "-"  # stock itself, or a run without stock (--no-stock): nothing to compare with
        elif all(b.get(f"stock_vs_{name}_bit_exact") for b in blocks):
            same = "bit-exact"
        else:
            same = "max abs " + " / ".join(f"{b.get(f'stock_vs_{name}_max_abs_difference', float('nan')):.3g}"
                                           for b in blocks)
        peak = blocks[0].get("peak_extra_bytes", {}).get(name)
        launches = prof.get(f"{name}_kernel_launches")
        rows.append((name, ran.get(name, "-"), times, ratio, same,
                     "-" if peak is None else f"{peak / 2**20:,.0f} MiB", "-" if launches is None else str(launches)))
    return rows


VARIANT_HEADER = ("variant", "attention that ran", "block p50", "stock / variant", "vs stock",
                  "peak extra (block 0)", "kernels")


def _markdown(header, rows) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def variants_markdown(data: dict) -> str:
    rows = variant_rows(data)
    return "\n".join(_markdown(VARIANT_HEADER, rows)) if rows else ""


def more_markdown(data: dict) -> str:
    """What follows the main table where it ran: the sampling tables per variant, the long-sequence
    memory table, the pack against the peer."""
    parts = []
    for key in ("sampling_2_step", "sampling_12_step"):
        sampled = sampling_variant_rows(data, key)
        if sampled:
            parts.append("\n".join(_markdown(SAMPLING_HEADER, sampled)))
    parts.append(queued_markdown(data))
    parts.append(memory_markdown(data))
    parts.append("\n".join(peer_lines(data)))
    return "\n\n".join(p for p in parts if p)


QUEUED_HEADER = ("variant", "block p50", "GPU time, queue ahead", "stock / variant (GPU)", "host enqueue",
                 "SM clock")


def queued_markdown(data: dict) -> str:
    """Block 0 per variant: the block section's p50 beside its GPU time with the launch queue kept
    ahead and the host's enqueue time, and the mean SM clock over the block section's reps. (The JSON
    also keeps NVML's board power, which the driver averages over longer than one block: with the
    variants interleaved block by block it mixes them, so the table leaves it out.)"""
    q = data.get("queued_block") or {}
    blocks = data.get("real_block_results") or []
    if not q:
        return ""
    first = blocks[0] if blocks else {}
    clocks = first.get("device_clocks") or {}
    names = [k[:-len("_gpu_p50_seconds")] for k in q if k.endswith("_gpu_p50_seconds")]
    rows = []
    for name in names:
        c = clocks.get(name) or {}
        rows.append((name, _fmt_s(first.get(f"{name}_p50_seconds"), "ms"), _fmt_s(q.get(f"{name}_gpu_p50_seconds"), "ms"),
                     _fmt_x(1.0 if name == "stock" else q.get(f"stock_over_{name}_gpu")),
                     _fmt_s(q.get(f"{name}_host_p50_seconds"), "ms"),
                     f"{c['sm_mhz']:.0f} MHz" if c else "-"))
    return (f"Block {q.get('block')} with the launch queue kept ahead ({q.get('reps')} reps; clocks over the "
            "block section's reps):\n\n" + "\n".join(_markdown(QUEUED_HEADER, rows)))


SAMPLING_HEADER = ("variant", "sampling", "stock / variant", "vs stock", "peak allocated")


def sampling_variant_rows(data: dict, key: str) -> list[tuple[str, ...]]:
    """One row per variant sampled in section ``key`` (empty when only stock and the layouts sampled)."""
    s = data.get(key) or {}
    names = list(dict.fromkeys(s.get("order", ())))
    if set(names) <= {"stock", "hnd", "strided_nhd"}:
        return []
    rows = []
    for name in names:
        same = s.get(f"stock_vs_{name}_identical")
        same = "-" if same is None else ("identical checksums" if same else
                                         "differ: video max abs {video:.3g}, audio {audio:.3g}".format(
                                             **s[f"stock_vs_{name}_max_abs_difference"]))
        peak = s.get(f"{name}_peak_allocated_bytes")
        rows.append((name, f"{s['steps']}-step {_fmt_s(s.get(f'{name}_seconds'))}",
                     _fmt_x(1.0 if name == "stock" else s.get(f"stock_over_{name}")), same,
                     "-" if peak is None else f"{peak / 2**30:.2f} GiB"))
    return rows


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def memory_markdown(data: dict) -> str:
    """The long-sequence memory section: peak extra of one block per variant, the pack's over each."""
    m = data.get("peak_memory_long_sequence")
    if not m:
        return ""
    peaks, main = m["peak_extra_bytes"], m["pack"]
    width, height = m["resolution"]
    rows = []
    for name, peak in peaks.items():
        ratio = _fmt_x(peaks[main] / peak) if peak and peaks.get(main) else "-"
        error = (m.get("errors") or {}).get(name, "")
        rows.append((name, _mib(peak), ratio, error.splitlines()[0][:100] if error else ""))
    lines = [f"Peak extra memory of one block (block {m['block']}) at {m['packed_tokens']:,} packed tokens "
             f"({width}x{height}x{m['frames']}, asked {m['tokens_asked']:,}):", ""]
    lines += _markdown(("variant", "peak extra", f"{main} / variant", "error"), rows)
    past = m.get("past_int32_offsets") or []
    if past:
        sizes = ", ".join(f"{name.replace('_', ' ')} {m['elements'][name]:,}" for name in past)
        lines += ["", f"- past 2**31 elements ({sizes}): kernels with int32 offsets (plain `sageattn`, stock's "
                      "and the peer's attention, on the fused qkv buffer) are not exact there; outputs at this "
                      "length are not compared, the peaks are what each variant allocated."]
    return "\n".join(lines)


def peer_lines(data: dict) -> list[str]:
    """The pack (strided NHD) against each of the peer's variants: block time and peak extra memory."""
    blocks = data.get("real_block_results") or []
    peer = (data.get("peer") or {}).get("variants") or {}
    main = "strided_nhd"
    if not blocks or f"{main}_p50_seconds" not in blocks[0]:
        return []
    lines = []
    for name, nodes in peer.items():
        if f"{name}_p50_seconds" not in blocks[0]:
            continue
        what = " + ".join(f"{n['display_name']} ({', '.join(f'{k} {v}' for k, v in n['inputs'].items())})"
                          for n in nodes)
        times = " / ".join(_fmt_x(b[f"{name}_p50_seconds"] / b[f"{main}_p50_seconds"]) for b in blocks)
        peaks = blocks[0].get("peak_extra_bytes") or {}
        peak = (_fmt_x(peaks[main] / peaks[name]) if peaks.get(main) and peaks.get(name) else "-")
        lines.append(f"- {main} against {name} (KJNodes: {what}): block time {name} / {main} {times}; "
                     f"peak extra {main} / {name} {peak}.")
    return lines
