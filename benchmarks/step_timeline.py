"""Where one sampling step's time goes on the device (torch.profiler's device activity): kernels, weight copies to
the card, the part of those copies no kernel ran beside, and waits; with nvidia-ml-py, the card's SM clock, power
and temperature while each kernel family ran (a card at its power cap runs the same kernel slower).
``summarize`` is interval arithmetic on ``(kind, start_us, end_us, name)`` (the CPU tests feed it made-up timelines).
"""

from __future__ import annotations

import bisect
import threading
import time


KERNEL, HOST_TO_DEVICE, OTHER_COPY = "kernel", "host_to_device", "other_copy"


def activity_kind(name: str) -> str | None:
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
    """The parts of disjoint sorted ``intervals`` that disjoint sorted ``other`` does not cover."""
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


TOP_KERNELS = 16  # the longest-running kernels a summary names
NAME_CHARS = 120  # of each name (C++ template names run to thousands of characters)


def summarize(activities, wall_seconds: float) -> dict:
    """Seconds of one step: ``kernels`` (any running), ``host_to_device`` (a copy to the card running),
    ``host_to_device_exposed`` (no kernel beside), ``idle`` (the rest); kernel seconds per family and of the
    ``TOP_KERNELS`` longest (summed by name), and the counts."""
    from .measure import FAMILIES, kernel_family  # (imports torch: a budget cell must start comfy-aimdo first)

    by_kind: dict[str, list] = {KERNEL: [], HOST_TO_DEVICE: [], OTHER_COPY: []}
    family_us = dict.fromkeys(FAMILIES, 0.0)
    name_us: dict[str, float] = {}
    for kind, start, end, name in activities:
        by_kind[kind].append((start, end))
        if kind == KERNEL:
            family_us[kernel_family(name)] += end - start
            name_us[name] = name_us.get(name, 0.0) + end - start
    top = sorted(name_us.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    kernels = union(by_kind[KERNEL])
    h2d = union(by_kind[HOST_TO_DEVICE])
    busy = union(kernels + h2d + by_kind[OTHER_COPY])
    seconds = {"wall": wall_seconds, "kernels": length(kernels) / 1e6, "host_to_device": length(h2d) / 1e6,
               "host_to_device_exposed": length(minus(h2d, kernels)) / 1e6,
               "idle": max(0.0, wall_seconds - length(busy) / 1e6)}
    return {"seconds": {k: round(v, 4) for k, v in seconds.items()},
            "kernel_seconds_by_family": {k: round(v / 1e6, 4) for k, v in family_us.items()},
            "kernel_seconds_by_name": {name[:NAME_CHARS]: round(us / 1e6, 4) for name, us in top},
            "kernel_launches": len(by_kind[KERNEL]), "host_to_device_copies": len(by_kind[HOST_TO_DEVICE])}


def clocks_by_family(activities, samples, anchor) -> dict:
    """Mean SM clock, power and temperature of the ``samples`` ``(host_s, mhz, watts, celsius)`` inside a kernel, by
    family, and over the step. ``anchor`` ``(host_s, device_us)``: the step's first kernel, launched on an idle
    device, ties the host clock to the profiler's (microseconds apart; the kernels that matter run milliseconds)."""
    from .measure import FAMILIES, kernel_family

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
        if not rows:
            return None
        return {"sm_mhz": round(sum(r[0] for r in rows) / len(rows), 1),
                "watts": round(sum(r[1] for r in rows) / len(rows), 1),
                "celsius": round(sum(r[2] for r in rows) / len(rows), 1), "samples": len(rows)}

    return {family: mean(rows) for family, rows in picked.items()}


class ClockSampler:
    """The card's SM clock, power and temperature every ``period`` seconds on a thread (NVML via torch.cuda;
    ``problem`` says why not)."""

    def __init__(self, device, period: float = 0.02):
        self.device, self.period = device, period
        self.samples: list[tuple] = []
        self.problem: str | None = None
        self._stop = threading.Event()
        self._thread = None

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
    caller synchronising the device before each; given a ``device``, its clocks too (under ``clocks``)."""

    def __init__(self, device=None):
        self._profile, self._started = None, None
        self._device, self._clocks, self._anchor_s = device, None, None

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CUDA])
        self._profile.start()
        self._started = time.perf_counter()
        if self._device is not None:
            self._clocks = ClockSampler(self._device)
            self._clocks.start()
            self._anchor_s = time.perf_counter()
            torch.zeros(1, device=self._device)  # the step's first kernel, on the idle device: the clocks' anchor

    def stop(self) -> dict:
        import torch

        wall = time.perf_counter() - self._started
        samples = self._clocks.stop() if self._clocks is not None else None
        self._profile.stop()
        activities = []
        for event in self._profile.events():
            if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
                continue
            kind = activity_kind(event.name)
            if kind is not None:
                activities.append((kind, event.time_range.start, event.time_range.end, event.name))
        self._profile = None
        summary = summarize(activities, wall)
        if self._clocks is not None:
            first = min((start for kind, start, _, _ in activities if kind == KERNEL), default=None)
            summary["clocks"] = (clocks_by_family(activities, samples, (self._anchor_s, first))
                                 if self._clocks.problem is None and first is not None
                                 else {"problem": self._clocks.problem or "no kernel ran"})
        return summary

    def close(self) -> None:
        """Stop a profile still running (its step failed); nothing is recorded."""
        if self._clocks is not None:
            self._clocks.stop()
        if self._profile is not None:
            self._profile.stop()
            self._profile = None
