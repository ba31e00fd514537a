"""A check that a report of ours carries every key of the reference system's report
(benchmarks/reference/gb10-strided-nhd-results.json) with the same type, but for those listed here with the reason."""

from __future__ import annotations

import json
from pathlib import Path

# Reference key path -> our key path, where the reference's name says something untrue of our run.
RENAMED = {
    # counted with torch.profiler, not Nsight Systems
    "nsight_block_recapture": "profiler_block_recapture",
    # "component1" was the reference system's internal name for its HND baseline run
    "sampling_12_step.component1_hnd_seconds": "sampling_12_step.hnd_seconds",
}

# Reference key paths with no counterpart in this harness.
NOT_APPLICABLE = {
    "sampling_12_step.cumulative_reduction_vs_unfused_310_11_second_baseline":
        "the reference machine's older unfused baseline; no such run exists here",
    "validation.deployed_tests": "the pack's tests run in CI, not inside the benchmark",
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
