"""What the pack's back-ends say about this machine, for benchmark reports and tests."""

from __future__ import annotations

import torch

from .pack import kernels


def describe_backends(device=None) -> list[dict]:
    """Every back-end in auto order with whether it can run here (on ``device``: its self-test too) and why not."""
    k = kernels()
    rows = []
    for name in k.backends.AUTO_ORDER:
        backend = k.BACKENDS[name]
        verdict = backend.available()
        ok, code, reason = verdict.ok, verdict.code, verdict.reason
        if ok and device is not None and backend.needs_cuda and torch.device(device).type != "cuda":
            ok, code, reason = False, "no_cuda", f"needs a CUDA device, got {torch.device(device).type}"
        elif ok and device is not None:
            verdict = backend.available(device)  # per device: sage2 runs its self-test there once
            ok, code, reason = verdict.ok, verdict.code, verdict.reason
        rows.append({"name": name, "available": ok, "code": code, "reason": reason})
    return rows
