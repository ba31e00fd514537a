"""torch.profiler's device activity. Where one sampling step's time goes: kernels, weight copies to the card, the
part of those copies no kernel ran beside, and waits; with nvidia-ml-py, the card's SM clock, power and temperature
while each kernel family ran (a card at its power cap runs the same kernel slower). ``summarize`` is interval
arithmetic on ``(kind, start_us, end_us, name)``. ``profile_kernels``: the kernels one call launches. Torch is
imported only inside the functions: a budget cell must start comfy-aimdo first.
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
import time
from collections import Counter

KERNEL, HOST_TO_DEVICE, OTHER_COPY = "kernel", "host_to_device", "other_copy"
TOP_KERNELS = 16  # the longest-running kernels a summary names
NAME_CHARS = 120  # of each name (C++ template names run to thousands of characters)
# Kernel families of an H3 block, by name: the matrix products and the attention kernel are what an
# exact path must run as stock runs them; everything else is what a fast path can fuse or drop.
_FAMILIES = (("attention", ("attn_kernel", "attention", "flash", "fmha", "_attn_fwd", "sdpa")),
             ("gemm", ("nvjet", "gemm", "Gemm", "cutlass", "sm90_xmma", "cublas")))
FAMILIES = tuple(family for family, _ in _FAMILIES) + ("other",)


def activity_kind(name: str) -> str | None:
    if name.startswith("Memcpy"):
        return HOST_TO_DEVICE if "HtoD" in name else OTHER_COPY
    if name.startswith("Memset"):
        return OTHER_COPY
    return None if name.startswith("## ") else KERNEL  # "## ...": a user range on the device timeline


def kernel_family(name: str) -> str:
    return next((family for family, needles in _FAMILIES if any(n in name for n in needles)), "other")


def device_activities(events) -> list[tuple]:
    """``(kind, start_us, end_us, name)`` of the device activity among torch.profiler's ``events``."""
    import torch

    return [(activity_kind(e.name), e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and activity_kind(e.name) is not None]


def union(intervals) -> list[tuple[float, float]]:
    """``intervals`` merged: sorted, disjoint ``(start, end)`` pairs covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def summarize(activities, wall_seconds: float) -> dict:
    """Seconds of one step: ``kernels`` (any running), ``host_to_device`` (a copy to the card running),
    ``host_to_device_exposed`` (no kernel beside), ``idle`` (the rest); kernel seconds per family and of the
    ``TOP_KERNELS`` longest (summed by name), and the counts."""
    by_kind: dict[str, list] = {KERNEL: [], HOST_TO_DEVICE: [], OTHER_COPY: []}
    family_us = dict.fromkeys(FAMILIES, 0.0)
    name_us: dict[str, float] = {}
    for kind, start, end, name in activities:
        by_kind[kind].append((start, end))
        if kind == KERNEL:
            family_us[kernel_family(name)] += end - start
            name_us[name] = name_us.get(name, 0.0) + end - start
    top = sorted(name_us.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    kernels, h2d = union(by_kind[KERNEL]), union(by_kind[HOST_TO_DEVICE])
    busy = union(kernels + h2d + by_kind[OTHER_COPY])
    seconds = {"wall": wall_seconds, "kernels": length(kernels) / 1e6, "host_to_device": length(h2d) / 1e6,
               "host_to_device_exposed": (length(union(kernels + h2d)) - length(kernels)) / 1e6,
               "idle": max(0.0, wall_seconds - length(busy) / 1e6)}
    return {"seconds": {k: round(v, 4) for k, v in seconds.items()},
            "kernel_seconds_by_family": {k: round(v / 1e6, 4) for k, v in family_us.items()},
            "kernel_seconds_by_name": {name[:NAME_CHARS]: round(us / 1e6, 4) for name, us in top},
            "kernel_launches": len(by_kind[KERNEL]), "host_to_device_copies": len(by_kind[HOST_TO_DEVICE])}


def clocks_by_family(activities, samples, anchor) -> dict:
    """Mean SM clock, power and temperature of the ``samples`` ``(host_s, mhz, watts, celsius)`` inside a kernel, by
    family, and over the step. ``anchor`` ``(host_s, device_us)``: the step's first kernel, launched on an idle
    device, ties the host clock to the profiler's (microseconds apart; the kernels that matter run milliseconds)."""
    kernels = sorted((start, end, kernel_family(name)) for kind, start, end, name in activities if kind == KERNEL)
    starts = [k[0] for k in kernels]
    picked: dict[str, list] = {family: [] for family in ("step",) + FAMILIES}
    host_s, device_us = anchor
    for t, *values in samples:
        at = device_us + (t - host_s) * 1e6
        picked["step"].append(values)
        i = bisect.bisect_right(starts, at) - 1
        if i >= 0 and kernels[i][1] >= at:
            picked[kernels[i][2]].append(values)

    def mean(rows):
        means = (round(statistics.fmean(column), 1) for column in zip(*rows))
        return dict(zip(("sm_mhz", "watts", "celsius"), means), samples=len(rows)) if rows else None

    return {family: mean(rows) for family, rows in picked.items()}


class ClockSampler:
    """The card's SM clock, power and temperature every ``period`` seconds on a thread (NVML via torch.cuda;
    ``problem`` says why not)."""

    def __init__(self, device, period: float = 0.02):
        self.device, self.period = device, period
        self.samples: list[tuple] = []
        self.problem: str | None = None
        self._stop, self._thread = threading.Event(), None

    def read(self) -> tuple:
        import torch

        return (time.perf_counter(), torch.cuda.clock_rate(self.device), torch.cuda.power_draw(self.device) / 1e3,
                torch.cuda.temperature(self.device))

    def start(self) -> None:
        try:
            self.read()
        except Exception as exc:  # noqa: BLE001  (no NVML: the timeline goes on without clocks)
            self.problem = f"{type(exc).__name__}: {exc}"
            return
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(self.read())

    def stop(self) -> list[tuple]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples


class StepTimeline:
    """torch.profiler recording device activity only (little overhead) between ``start()`` and ``stop()``, the
    caller synchronising the device before each; the ``device``'s clocks too (under ``clocks``)."""

    def __init__(self, device):
        self._device, self._profile, self._clocks = device, None, ClockSampler(device)
        self._started = self._anchor_s = None

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CUDA])
        self._profile.start()
        self._started = time.perf_counter()
        self._clocks.start()
        self._anchor_s = time.perf_counter()
        torch.zeros(1, device=self._device)  # the step's first kernel, on the idle device: the clocks' anchor

    def stop(self) -> dict:
        wall = time.perf_counter() - self._started
        samples = self._clocks.stop()
        self._profile.stop()
        activities = device_activities(self._profile.events())
        self._profile = None
        summary = summarize(activities, wall)
        first = min((start for kind, start, _, _ in activities if kind == KERNEL), default=None)
        summary["clocks"] = (clocks_by_family(activities, samples, (self._anchor_s, first))
                             if self._clocks.problem is None and first is not None
                             else {"problem": self._clocks.problem or "no kernel ran"})
        return summary

    def close(self) -> None:
        """Stop a profile still running (its step failed); nothing is recorded."""
        self._clocks.stop()
        if self._profile is not None:
            self._profile.stop()
            self._profile = None


def profile_kernels(fn, device, large_numel: int, calls: int = 1) -> dict:
    """Device kernels one ``fn()`` launches (torch.profiler over ``calls`` calls; per call), and the layout copies:
    ``aten::copy_`` with an operand of at least ``large_numel`` elements."""
    from torch.profiler import ProfilerActivity, profile

    from .measure import synchronize

    cuda = device.type == "cuda"
    fn()  # warm: lazy inits and allocator growth stay out of the count
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 record_shapes=True) as prof:
        for _ in range(calls):
            fn()
            synchronize(device)
    kernels, family_us = Counter(), Counter()
    for kind, start, end, name in device_activities(prof.events()):
        if kind == KERNEL:
            kernels[name] += 1
            family_us[kernel_family(name)] += end - start

    def large_copy(event) -> bool:
        shapes = [s for s in event.input_shapes or [] if isinstance(s, (list, tuple)) and s]
        return event.name == "aten::copy_" and any(math.prod(s) >= large_numel for s in shapes)

    large_copies = sum(large_copy(e) for e in prof.events())
    return {"kernel_launches": sum(kernels.values()) // calls if cuda else None,
            "large_copy_ops": large_copies // calls,
            "kernel_ms": {f: round(family_us[f] / 1e3 / calls, 3) for f in FAMILIES} if cuda else None,
            "kernels": Counter({n: c // calls for n, c in kernels.items()})}
