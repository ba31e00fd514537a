"""Timing and memory primitives (no ComfyUI import). Variants are always timed interleaved (A, B, C,
then B, C, A, ...): a GPU's speed drifts by a few percent over minutes."""

from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import torch


def device_facts(device) -> dict:
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"device": torch.cuda.get_device_name(device), "compute_capability": f"SM{major}{minor}"}
    return {"device": f"CPU ({platform.machine()})", "compute_capability": "cpu"}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Wall seconds of ``fn()`` with the device drained before and after; returns (seconds, result)."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def event_timed(fn: Callable[[], object]) -> Callable[[], float]:
    def run():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return run


def interleaved_times(runners: dict[str, Callable[[], float]], reps: int, warmup: int,
                      progress: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Run each variant's ``runner()`` (which returns its own measured seconds) rep by rep, rotated."""
    names = list(runners)
    rotations = [names[i:] + names[:i] for i in range(len(names))]  # the variant going first moves each rep
    for rep in range(warmup):
        for name in rotations[rep % len(names)]:
            runners[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in rotations[rep % len(names)]:
            times[name].append(runners[name]())
        if progress:
            progress(f"rep {rep + 1}/{reps}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.2f} ms" for n in names))
    return times


def summary(times: list[float]) -> dict:
    p50 = statistics.median(times)
    return {"p50_seconds": p50, "mean_seconds": statistics.fmean(times), "min_seconds": min(times),
            "max_seconds": max(times), "spread": (max(times) - min(times)) / p50 if p50 else 0.0,
            "reps": len(times)}


def speedup(baseline_seconds: float | None, new_seconds: float | None) -> float | None:
    return baseline_seconds / new_seconds if baseline_seconds and new_seconds else None


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> tuple[int | None, object]:
    """Peak memory allocated above what was allocated before ``fn()`` (None off CUDA)."""
    if device.type != "cuda":
        return None, fn()
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, result


def max_abs_difference(a: torch.Tensor, b: torch.Tensor, rows: int = 8192) -> dict:
    """max/mean |a - b|, ||a - b|| / ||a|| and whether the bits are identical; ``rows`` at a time (a 320,000-token
    output needs no full-size fp32 copies), the sums in float64."""
    if a.shape != b.shape:
        raise ValueError(f"cannot compare outputs of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.numel() == 0:
        return {"max_abs_difference": 0.0, "mean_abs_difference": 0.0, "relative_l2": 0.0, "bit_exact": True}
    a, b = torch.atleast_1d(a), torch.atleast_1d(b)  # a 0-dim tensor as one row
    peak, abs_sum, diff_sq, ref_sq = 0.0, 0.0, 0.0, 0.0
    for start in range(0, a.shape[0], rows):
        ai, bi = a[start:start + rows], b[start:start + rows]
        d = (ai.float() - bi.float()).abs()
        peak = max(peak, float(d.max()))
        abs_sum += float(d.sum(dtype=torch.float64))
        diff_sq += float(d.square().sum(dtype=torch.float64))
        ref_sq += float(ai.float().square().sum(dtype=torch.float64))
    return {"max_abs_difference": peak,
            "mean_abs_difference": abs_sum / a.numel(),
            "relative_l2": (diff_sq / ref_sq) ** 0.5 if ref_sq > 0 else 0.0,
            "bit_exact": bool(torch.equal(a, b))}


def all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)
