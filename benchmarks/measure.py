"""Timing, memory and kernel-count primitives (no ComfyUI import). Variants are always timed interleaved (A, B, C,
then B, C, A, ...): a GPU's speed drifts by a few percent over minutes."""

from __future__ import annotations

import platform
import statistics
import time
from collections import Counter
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


def device_timed(fn: Callable[[], object], device: torch.device) -> Callable[[], float]:
    """A runner returning the seconds of one ``fn()``: CUDA events on a GPU, elsewhere ``timed``."""
    return event_timed(fn) if device.type == "cuda" else (lambda: timed(fn, device)[0])


def rotated(names: list[str], rep: int) -> list[str]:
    shift = rep % len(names)
    return names[shift:] + names[:shift]


def interleaved_times(runners: dict[str, Callable[[], float]], reps: int, warmup: int,
                      progress: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Run each variant's ``runner()`` (which returns its own measured seconds) rep by rep, rotated."""
    names = list(runners)
    for rep in range(warmup):
        for name in rotated(names, rep):
            runners[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in rotated(names, rep):
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
    if not baseline_seconds or not new_seconds:
        return None
    return baseline_seconds / new_seconds


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


# Names the profiler gives to device activity that is not a kernel launch.
_NOT_KERNELS = ("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")

# Kernel families of an H3 block, by name: the matrix products and the attention kernel are what an
# exact path must run as stock runs them; everything else is what a fast path can fuse or drop.
_FAMILIES = (("attention", ("attn_kernel", "attention", "flash", "fmha", "_attn_fwd", "sdpa")),
             ("gemm", ("nvjet", "gemm", "Gemm", "cutlass", "sm90_xmma", "cublas")))


FAMILIES = tuple(family for family, _ in _FAMILIES) + ("other",)


def kernel_family(name: str) -> str:
    for family, needles in _FAMILIES:
        if any(n in name for n in needles):
            return family
    return "other"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _is_large_copy(event, large_numel: int) -> bool:
    shapes = [s for s in (event.input_shapes or []) if isinstance(s, (list, tuple)) and s]
    return any(_numel(s) >= large_numel for s in shapes)


def profile_kernels(fn: Callable[[], object], device: torch.device, large_numel: int, calls: int = 1) -> dict:
    """Device kernels one ``fn()`` launches (torch.profiler over ``calls`` calls; per call), and the layout copies:
    ``aten::copy_`` with an operand of at least ``large_numel`` elements."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()  # warm: lazy inits and allocator growth stay out of the count
    synchronize(device)
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(calls):
            fn()
            synchronize(device)
    kernels: Counter = Counter()
    kernel_us: Counter = Counter()
    family_us: Counter = Counter()
    large_copies = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if getattr(event, "is_user_annotation", False) or event.name.startswith(("## ",) + _NOT_KERNELS):
                continue  # a range on the device timeline (inductor's graph calls) or a transfer
            kernels[event.name] += 1
            kernel_us[event.name] += event.time_range.elapsed_us()
            family_us[kernel_family(event.name)] += event.time_range.elapsed_us()
        elif event.name == "aten::copy_" and _is_large_copy(event, large_numel):
            large_copies += 1
    return {"kernel_launches": sum(kernels.values()) // calls if cuda else None,
            "large_copy_ops": large_copies // calls,
            "kernel_ms": ({f: round(family_us[f] / 1e3 / calls, 3) for f in ("attention", "gemm", "other")}
                          if cuda else None),
            "kernels": {n: c // calls for n, c in sorted(kernels.items())},
            "kernel_ms_by_name": ({n: round(us / 1e3 / calls, 3) for n, us in kernel_us.most_common()}
                                  if cuda else None)}


def kernel_difference(baseline: dict, new: dict) -> dict:
    removed = Counter(baseline) - Counter(new)
    added = Counter(new) - Counter(baseline)
    return {"removed": dict(sorted(removed.items())), "added": dict(sorted(added.items()))}
