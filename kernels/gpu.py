"""Which GPU a tensor is on, asked one way (from the tensor's own device, never the current one), and the process's
answers per device: what was decided or what failed where, in one shape."""

from __future__ import annotations

import functools
from typing import Callable

import torch


def exact_device(device) -> torch.device:
    """``device`` as a ``torch.device`` with its index (a bare "cuda": the current one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=None)
def _properties(index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.multi_processor_count


def capability(device) -> tuple[int, int] | None:
    """``device``'s NVIDIA compute capability; None off NVIDIA CUDA (the CPU, ROCm) or without a CUDA device."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return None
    return _properties(exact_device(device).index)[0]


def sm_count(device) -> int:
    return _properties(exact_device(device).index)[1]


def failure_text(exc: BaseException) -> str:
    """"RuntimeError: <the first line of its message>", for a reason in the report."""
    return f"{type(exc).__name__}: " + next(iter(str(exc).strip().splitlines()), "")[:200]


class DeviceAnswers:
    """The process's answers to one question per device ("int8_gemm", "kitchen_release", ...): a reason (why the
    thing is off there) or None (it runs there). Each is decided once, or recorded when a launch fails."""

    def __init__(self):
        self._answers: dict[torch.device, dict[str, str | None]] = {}

    def reasons(self, device) -> dict[str, str | None]:  # a copy
        return dict(self._answers.get(exact_device(device), {}))

    def decide(self, question: str, device, decide: Callable[[], str | None]) -> str | None:
        answers = self._answers.setdefault(exact_device(device), {})
        if question not in answers:
            answers[question] = decide()
        return answers[question]

    def fail(self, question: str, device, reason: str) -> str:
        self._answers.setdefault(exact_device(device), {})[question] = reason
        return reason

    def reason(self, question: str, device) -> str | None:
        return self._answers.get(exact_device(device), {}).get(question)


ANSWERS = DeviceAnswers()
