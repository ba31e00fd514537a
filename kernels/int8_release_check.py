"""The bits self-check that lets the int8 route run on a comfy-kitchen release it was not verified against: at first
use on a CUDA device, stock's ConvRot ``int8_linear`` and the route on the same random inputs, ``torch.equal``; any
difference, decline or exception keeps stock's quantiser there, with the reason. The samples take H3's widths (the
quantiser variants sampling compiles anyway), the fewest rows the route takes and counts off the GEMM's tiles."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

from . import gpu
from .gpu import exact_device


@dataclasses.dataclass(frozen=True)
class Sample:
    rows: int
    width: int  # the quantised width (the input is twice as wide with SwiGLU)
    out_features: int
    input_act: str | None = None
    bias: bool = False

    def __str__(self) -> str:
        act = f" {self.input_act}" if self.input_act else ""
        return f"{self.rows} x {self.width}{act} -> {self.out_features}{' with a bias' if self.bias else ''}"


def samples(min_rows: int) -> tuple[Sample, ...]:
    """H3's qkv/fc1 input (5,376), out input (7,168), fc2 input (SwiGLU to 14,336); rows ``min_rows``, 77, 300."""
    return (Sample(min_rows, 5376, 384), Sample(77, 7168, 256), Sample(300, 14336, 256, "swiglu"),
            Sample(77, 5376, 256, bias=True))


def compare(route: Callable, stock: Callable, device: torch.device, checked: tuple[Sample, ...]) -> str | None:
    """None where ``route`` gives ``stock``'s bits on every sample (random inputs from a generator of their own);
    else what went wrong, on which sample. ``route`` returns its output or why it declined."""
    for seed, sample in enumerate(checked):
        g = torch.Generator(device=device).manual_seed(seed)
        try:
            cols = sample.width * (2 if sample.input_act == "swiglu" else 1)
            x = (2 * torch.randn(sample.rows, cols, generator=g, device=device)).bfloat16()
            w = torch.randint(-127, 128, (sample.out_features, sample.width), generator=g, device=device,
                              dtype=torch.int8)
            bias = torch.randn(sample.out_features, generator=g, device=device).bfloat16() if sample.bias else None
            w_scale = torch.tensor(2e-3, device=device)
            want = stock(x, w, w_scale, bias, input_act=sample.input_act)
            got = route(x, w, w_scale, bias, input_act=sample.input_act)
        except Exception as exc:  # whatever broke, stock's call is the safe answer
            return f"{type(exc).__name__} on {sample}: {exc}"
        if isinstance(got, str):
            return f"the route declined {sample}: {got}"
        if got.shape != want.shape or got.dtype != want.dtype:
            return (f"the route gave {got.dtype} {tuple(got.shape)} for stock's {want.dtype} {tuple(want.shape)} "
                    f"on {sample}")
        if not torch.equal(got, want):
            return f"{int((got != want).sum())} of {want.numel()} outputs differ from stock's on {sample}"
    return None


class ReleaseCheck:
    """The self-check of one process, decided once per device (``gpu.ANSWERS``, question "kitchen_release")."""

    def __init__(self, route: Callable, stock: Callable):
        self.route, self.stock = route, stock

    def problem(self, device, min_rows: int) -> str | None:
        """Why the route may not run on ``device`` (None: it may), from the first check there."""
        return gpu.ANSWERS.decide("kitchen_release", device, lambda: self.run(device, min_rows))

    def run(self, device, min_rows: int) -> str | None:
        """Check now (not cached): the route against stock on ``samples(min_rows)``."""
        device = exact_device(device)
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), torch.no_grad():
                problem = compare(self.route, self.stock, device, samples(min_rows))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        except Exception as exc:  # the device itself failing: stock's call is the safe answer
            problem = f"{type(exc).__name__}: {exc}"
        return problem
