"""Where one sampling step's time goes on the device: torch.profiler's device activity over the step, split into
kernels (compute), weight copies to the card, the part of those copies no kernel ran beside (transfer not hidden
behind compute) and time the device did neither (waits: the host, a stream waiting on another, a page fault).

``summarize`` is plain interval arithmetic on ``(kind, start_us, end_us, name)`` activities, so the CPU tests
check it on made-up timelines; ``StepTimeline`` collects them from the profiler on a GPU.
"""

from __future__ import annotations

import time


KERNEL, HOST_TO_DEVICE, OTHER_COPY = "kernel", "host_to_device", "other_copy"


def activity_kind(name: str) -> str | None:
    """The kind of a profiler device activity, by the name CUPTI gives it (None: a range, not work)."""
    if name.startswith("Memcpy"):
        return HOST_TO_DEVICE if "HtoD" in name else OTHER_COPY
    if name.startswith("Memset"):
        return OTHER_COPY
    if name.startswith("## "):  # a user range on the device timeline
        return None
    return KERNEL


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


def minus(intervals, other) -> list[tuple[float, float]]:
    """The parts of disjoint sorted ``intervals`` that no interval of disjoint sorted ``other`` covers."""
    out, j = [], 0
    for start, end in intervals:
        while j < len(other) and other[j][1] <= start:
            j += 1
        k, at = j, start
        while k < len(other) and other[k][0] < end:
            if other[k][0] > at:
                out.append((at, other[k][0]))
            at = max(at, other[k][1])
            k += 1
        if at < end:
            out.append((at, end))
    return out


def summarize(activities, wall_seconds: float) -> dict:
    """Seconds of one step's ``wall_seconds``: ``kernels`` (any kernel running), ``host_to_device`` (a copy to the
    card running), ``host_to_device_exposed`` (of those, no kernel running beside), ``idle`` (neither kernel nor
    copy: the rest of the wall time), kernel seconds per family (summed, streams overlapping) and the counts."""
    from .measure import kernel_family  # (imports torch: a budget cell must start comfy-aimdo first)

    by_kind: dict[str, list] = {KERNEL: [], HOST_TO_DEVICE: [], OTHER_COPY: []}
    family_us = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    for kind, start, end, name in activities:
        by_kind[kind].append((start, end))
        if kind == KERNEL:
            family_us[kernel_family(name)] += end - start
    kernels = union(by_kind[KERNEL])
    h2d = union(by_kind[HOST_TO_DEVICE])
    busy = union(kernels + h2d + by_kind[OTHER_COPY])
    seconds = {"wall": wall_seconds, "kernels": length(kernels) / 1e6, "host_to_device": length(h2d) / 1e6,
               "host_to_device_exposed": length(minus(h2d, kernels)) / 1e6,
               "idle": max(0.0, wall_seconds - length(busy) / 1e6)}
    return {"seconds": {k: round(v, 4) for k, v in seconds.items()},
            "kernel_seconds_by_family": {k: round(v / 1e6, 4) for k, v in family_us.items()},
            "kernel_launches": len(by_kind[KERNEL]), "host_to_device_copies": len(by_kind[HOST_TO_DEVICE])}


class StepTimeline:
    """torch.profiler recording device activity only (no host events, no shapes: little overhead on a step of
    seconds) between ``start()`` and ``stop()``, the caller synchronising the device before each."""

    def __init__(self):
        self._profile, self._started = None, None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CUDA])
        self._profile.start()
        self._started = time.perf_counter()

    def stop(self) -> dict:
        import torch

        wall = time.perf_counter() - self._started
        self._profile.stop()
        activities = []
        for event in self._profile.events():
            if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
            kind = activity_kind(event.name)
            if kind is not None:
                activities.append((kind, event.time_range.start, event.time_range.end, event.name))
        self._profile = None
        return summarize(activities, wall)

    def close(self) -> None:
        """Stop a profile still running (its step failed); nothing is recorded."""
        if self._profile is not None:
            self._profile.stop()
            self._profile = None
