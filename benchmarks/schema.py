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
    # a 310.11 s baseline that only existed on the reference machine
    "sampling_12_step.cumulative_reduction_vs_unfused_310_11_second_baseline":
        "the reference machine's older unfused baseline; no such run exists here",
    # the reference's own deployment test count; this pack's tests run in CI, not in the benchmark
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


def _walk(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else key
            yield path, value
            yield from _walk(value, path)
    elif isinstance(node, list) and node and isinstance(node[0], dict):
        for item in node:
            yield from _walk(item, prefix + "[]")


def _lookup(report: dict, path: str):
    nodes = [report]
    for part in path.split("."):
        listed = part.endswith("[]")
        key = part[:-2] if listed else part
        nxt = []
        for node in nodes:
            if not isinstance(node, dict) or key not in node:
                raise KeyError(path)
            value = node[key]
            if listed:
                if not isinstance(value, list) or not value:
                    raise KeyError(path)
                nxt.extend(value)
            else:
                nxt.append(value)
        nodes = nxt
    return nodes


def _mapped(path: str) -> str:
    for old, new in RENAMED.items():
        if path == old or path.startswith(old + "."):
            return new + path[len(old):]
    return path


def _type_name(value) -> str:
    return type(value).__name__


def check_against_reference(report: dict, reference: dict, *, allow_null: set[str] = frozenset()) -> list[str]:
    """Lines naming each reference key our report lacks or carries with another type."""
    problems = []
    for ref_path, ref_value in _walk(reference):
        if ref_path in NOT_APPLICABLE or any(ref_path.startswith(p + ".") for p in NOT_APPLICABLE):
            continue
        ours = _mapped(ref_path)
        try:
            values = _lookup(report, ours)
        except KeyError:
            problems.append(f"missing {ours}" + (f" (reference: {ref_path})" if ours != ref_path else ""))
            continue
        for value in values:
            if value is None and ours in allow_null:
                continue
            if type(value) is not type(ref_value):
                problems.append(f"{ours}: {_type_name(value)} {value!r:.60}, reference has {_type_name(ref_value)}")
            elif isinstance(ref_value, list) and ref_value and not isinstance(ref_value[0], dict):
                numeric = isinstance(ref_value[0], (int, float))
                if numeric and len(value) != len(ref_value):
                    problems.append(f"{ours}: {len(value)} items, reference has {len(ref_value)}")
                elif any(type(a) is not type(b) for a, b in zip(value, ref_value)):
                    problems.append(f"{ours}: item types {[_type_name(a) for a in value]}, "
                                    f"reference has {[_type_name(b) for b in ref_value]}")
    return problems
