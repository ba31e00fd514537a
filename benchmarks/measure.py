"""Timing, memory and kernel-count primitives. No ComfyUI import.

Variants are always timed interleaved (A, B, C, then B, C, A, ...), because a GPU's speed drifts
by a few percent over minutes: only ratios measured side by side mean anything.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Callable

import torch


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


def event_timed(fn: Callable[[], object], before: Callable[[], object] | None = None) -> Callable[[], float]:
    """A runner returning the seconds of one ``fn()`` between two CUDA events (``before()``, if given,
    is enqueued ahead of the first event: what the device runs just before, untimed)."""
    def run():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return run


def device_timed(fn: Callable[[], object], device: torch.device) -> Callable[[], float]:
    """A runner returning the seconds of one ``fn()``: CUDA events on a GPU, elsewhere the wall clock
    with the device drained (``timed``)."""
    return event_timed(fn) if device.type == "cuda" else (lambda: timed(fn, device)[0])


# GPU cycles the queued timing holds the device for before the measured call (~0.1 s at 2 GHz): far
# longer than any block takes to enqueue, so the host is done before the GPU reaches the call
QUEUE_HEAD_START_CYCLES = 200_000_000


def queued_timed(fn: Callable[[], object]) -> Callable[[], tuple[float, float]]:
    """A runner returning ``(host seconds, GPU seconds)`` of one ``fn()`` enqueued behind a GPU busy
    wait: the host enqueues every kernel before the GPU reaches the first, as in a sampling run where
    the previous block still runs. The GPU time (CUDA events) then has no host gaps in it; the host
    time is what enqueuing the call cost (a host sync inside ``fn`` would show as both)."""
    def run():
        torch.cuda.synchronize()
        torch.cuda._sleep(QUEUE_HEAD_START_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return host, start.elapsed_time(end) / 1e3
    return run


class DeviceSampler:
    """SM clock and board power sampled every ``period`` seconds in a background thread (NVML through
    ``pynvml``, nvidia-ml-py); ``mean_over(windows)`` averages the samples inside host time windows.
    ``available`` is False without pynvml or an NVML device, or with no ``device_index``: the tables
    then leave the columns out."""

    def __init__(self, device_index: int | None, period: float = 0.002):
        import threading
        self.samples: list[tuple[float, float, float]] = []  # (perf_counter, MHz, W)
        self._stop = threading.Event()
        self._thread = None
        self.period = period
        self._nvml = self._handle = None
        self.available = False
        if device_index is not None:
            try:
                import pynvml
                pynvml.nvmlInit()
                self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(device_index)
                self.available = True
            except Exception:
                pass  # no pynvml or no NVML device: not available
        if self.available:
            self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        nvml = self._nvml
        while not self._stop.is_set():
            try:
                mhz = nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM)
                watts = nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3
            except Exception:
                return
            self.samples.append((time.perf_counter(), float(mhz), float(watts)))
            time.sleep(self.period)

    def __enter__(self):
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mean_over(self, windows: list[tuple[float, float]]) -> dict | None:
        """Mean SM clock (MHz) and power (W) of the samples taken inside ``windows``; None without any."""
        inside = [(m, w) for t, m, w in self.samples if any(a <= t <= b for a, b in windows)]
        if not inside:
            return None
        return {"sm_mhz": statistics.fmean(m for m, _ in inside), "watts": statistics.fmean(w for _, w in inside),
                "samples": len(inside)}


def windowed(runner: Callable[[], object], windows: list) -> Callable[[], object]:
    """``runner`` that also appends the host time window of each call to ``windows``."""
    def run():
        t0 = time.perf_counter()
        result = runner()
        windows.append((t0, time.perf_counter()))
        return result
    return run


def rotated(names: list[str], rep: int) -> list[str]:
    """The variant order for repetition ``rep``: each variant leads in turn."""
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
    """p50, mean, min, max and relative spread of one variant's times (seconds)."""
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
    """max/mean |a - b| and the relative L2 error ||a - b|| / ||a|| in float32 terms, plus whether the
    bits are identical. Taken ``rows`` of the leading dimension at a time, so a 320,000-token output
    needs no full-size fp32 copies; the sums are kept in float64."""
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


CALL_RANGE = "profiled_call"  # the profiler range around each profiled call

# Names the profiler gives to device activity that is not a kernel launch.
_NOT_KERNELS = ("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")

# Kernel families of an H3 block, by name: the matrix products and the attention kernel are what an
# exact path must run as stock runs them; everything else is what a fast path can fuse or drop.
_FAMILIES = (("attention", ("attn_kernel", "attention", "flash", "fmha", "_attn_fwd", "sdpa")),
             ("gemm", ("nvjet", "gemm", "Gemm", "cutlass", "sm90_xmma", "cublas")))


def idle_gaps(spans: list[tuple]) -> list[tuple[float, object, object]]:
    """The gaps with no kernel running between the first kernel's start and the last one's end
    (launch gaps, host waits), in microseconds as the spans are: ``(gap, before, after)`` per span after
    the first, where a span is ``(start, end)`` or ``(start, end, name)`` and ``before`` / ``after``
    name the kernel reaching furthest so far and the next one (None without names)."""
    gaps, reach, before = [], None, None
    for start, end, *name in sorted(spans):
        name = name[0] if name else None
        if reach is not None:
            gaps.append((max(0.0, start - reach), before, name))  # the part past everything seen so far
        if reach is None or end >= reach:
            reach, before = end, name
    return gaps


def idle_between(spans: list[tuple], calls: int = 1) -> float | None:
    """Milliseconds per call with no kernel running (microseconds in), for the spans of ``calls``
    consecutive calls with a host sync after each: the ``calls - 1`` largest gaps are those syncs."""
    if not spans:
        return None
    gaps = sorted(gap for gap, _, _ in idle_gaps(spans))
    return round(sum(gaps[: len(gaps) - (calls - 1)]) / 1e3 / calls, 3)


def launch_waits(named_spans: list[tuple[float, float, str]], call_starts: list[float], top: int = 4) -> dict:
    """Where the device waited for the host in the first profiled call: from the call's start to its first
    kernel (``first_kernel_after_ms``, the host's time before its first launch plus the launch latency),
    and the ``top`` largest gaps between its kernels with the kernels on either side."""
    if not named_spans or not call_starts:
        return {}
    starts = sorted(call_starts)
    first_call = [s for s in sorted(named_spans) if s[0] >= starts[0] and (len(starts) == 1 or s[0] < starts[1])]
    if not first_call:
        return {}
    gaps = [(round(gap / 1e3, 3), before, after) for gap, before, after in idle_gaps(first_call) if gap > 0]
    return {"first_kernel_after_ms": round((first_call[0][0] - starts[0]) / 1e3, 3),
            "largest_gaps": sorted(gaps, reverse=True)[:top]}


def kernel_family(name: str) -> str:
    """The family of a CUDA kernel, by its name: "attention", "gemm" or "other"."""
    for family, needles in _FAMILIES:
        if any(n in name for n in needles):
            return family
    return "other"


def profile_kernels(fn: Callable[[], object], device: torch.device, large_numel: int, calls: int = 1) -> dict:
    """Device kernels launched by one ``fn()`` call, counted by torch.profiler over ``calls`` calls
    (counts per call; times the mean per call, also per kernel name, so one slow call weighs less).

    Also counts tensor copies (``aten::copy_``) whose operands have at least ``large_numel``
    elements: the layout copies (transpose/contiguous/clone of Q, K, V or the output).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    fn()  # warm: lazy inits and allocator growth stay out of the count
    synchronize(device)
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(calls):
            with record_function(CALL_RANGE):
                fn()
            synchronize(device)  # the idle time then counts the gaps within calls, not between them
    kernels: Counter = Counter()
    family_us: Counter = Counter()
    name_us: Counter = Counter()
    spans = []  # (start, end, name) of every device kernel, microseconds
    call_starts = []  # host time each call began, microseconds
    transfers = 0
    large_copies = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if getattr(event, "is_user_annotation", False) or event.name == CALL_RANGE or event.name.startswith("## "):
                continue  # a range on the device timeline (this function's, inductor's graph calls), not a kernel
            if event.name.startswith(_NOT_KERNELS):
                transfers += 1
            else:
                kernels[event.name] += 1
                family_us[kernel_family(event.name)] += event.time_range.elapsed_us()
                name_us[event.name] += event.time_range.elapsed_us()
                spans.append((event.time_range.start, event.time_range.end, event.name))
        elif event.name == CALL_RANGE:
            call_starts.append(event.time_range.start)
        elif event.name == "aten::copy_":
            shapes = [s for s in (event.input_shapes or []) if isinstance(s, (list, tuple)) and s]
            if any(_numel(s) >= large_numel for s in shapes):
                large_copies += 1
    cuda = device.type == "cuda"
    return {"kernel_launches": sum(kernels.values()) // calls if cuda else None,
            "memcpy_memset": transfers // calls if cuda else None,
            "large_copy_ops": large_copies // calls,
            "kernel_ms": ({f: round(family_us[f] / 1e3 / calls, 3) for f in ("attention", "gemm", "other")}
                          if cuda else None),
            "gpu_idle_ms": idle_between(spans, calls) if cuda else None,
            "kernel_ms_by_name": ({n: round(us / 1e3 / calls, 3) for n, us in name_us.most_common()} if cuda else None),
            **(launch_waits(spans, call_starts) if cuda else {}),
            "kernels": {n: c // calls for n, c in sorted(kernels.items())}}


def mean_profile(rounds: list[dict]) -> dict:
    """One variant's ``profile_kernels`` results from several rounds as one: kernel times and idle time
    averaged over the rounds (each family's per-round times kept in ``kernel_ms_rounds``); counts and
    launch waits from the first round (the kernels launched do not change between rounds)."""
    first = rounds[0]
    if first["kernel_ms"] is None:
        return dict(first)
    names = {n for r in rounds for n in r["kernel_ms_by_name"]}
    by_name = {n: round(sum(r["kernel_ms_by_name"].get(n, 0.0) for r in rounds) / len(rounds), 3) for n in names}
    return {**first,
            "kernel_ms": {f: round(sum(r["kernel_ms"][f] for r in rounds) / len(rounds), 3) for f in first["kernel_ms"]},
            "kernel_ms_rounds": {f: [r["kernel_ms"][f] for r in rounds] for f in first["kernel_ms"]},
            "gpu_idle_ms": round(sum(r["gpu_idle_ms"] for r in rounds) / len(rounds), 3),
            "kernel_ms_by_name": dict(sorted(by_name.items(), key=lambda kv: -kv[1]))}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def kernel_difference(baseline: dict, new: dict) -> dict:
    """Kernels launched more often by ``baseline`` than by ``new`` (name -> how many more)."""
    removed = Counter(baseline) - Counter(new)
    added = Counter(new) - Counter(baseline)
    return {"removed": dict(sorted(removed.items())), "added": dict(sorted(added.items()))}
