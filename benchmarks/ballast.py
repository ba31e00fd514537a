"""A smaller card on a big one: device memory taken away from everything in the process before the model loads.

The ballast is one raw ``cuMemAlloc`` of (the card's total - the budget), made through the driver API: it is
device memory as real as the card's own limit, so every allocator sees the budget. ComfyUI's accounting
(``torch.cuda.mem_get_info`` in ``get_free_memory``), comfy-aimdo's DynamicVRAM pages (mapped by the driver, never
through torch) and torch's allocator (caching or cudaMallocAsync) all find only the budget free, and an allocation
past it fails as on a small card. ``torch.cuda.set_per_process_memory_fraction`` would bind torch's caching
allocator alone: not aimdo's pages, not the cudaMallocAsync backend ComfyUI runs by default. The ballast is never
in torch's statistics, so the peaks a run reports are the run's own.
"""

from __future__ import annotations

import ctypes

GIB = 2**30


class BallastError(RuntimeError):
    """The driver would not give the ballast."""


def ballast_bytes(total_bytes: int, budget_gib: float) -> int:
    """Bytes to occupy so a card of ``total_bytes`` keeps ``budget_gib`` GiB, as a card of that size has
    (its CUDA context and anything else already allocated then come out of the budget, as on that card)."""
    budget = int(budget_gib * GIB)
    if budget <= 0:
        raise ValueError(f"a budget must be positive, got {budget_gib} GiB")
    if budget >= total_bytes:
        raise ValueError(f"a {budget_gib} GiB budget is not below this card's {total_bytes / GIB:.1f} GiB")
    return total_bytes - budget


class Ballast:
    """The device memory held back from a CUDA device for the rest of the process (the driver frees it at exit)."""

    def __init__(self, device_index: int, nbytes: int):
        import torch

        torch.cuda.set_device(device_index)
        torch.cuda.synchronize(device_index)  # the primary context exists and is current on this thread
        self.nbytes = nbytes
        self._ptr = ctypes.c_uint64(0)
        status = ctypes.CDLL("libcuda.so.1").cuMemAlloc_v2(ctypes.byref(self._ptr), ctypes.c_size_t(nbytes))
        if status != 0:
            raise BallastError(f"cuMemAlloc of {nbytes / GIB:.2f} GiB failed (CUresult {status})")


def occupy(device_index: int, budget_gib: float) -> tuple[Ballast, dict]:
    """Hold back all but ``budget_gib`` GiB of the card; returns the ballast and what the card showed before and
    after (``torch.cuda.mem_get_info``: free and total bytes)."""
    import torch

    free_before, total = torch.cuda.mem_get_info(device_index)
    ballast = Ballast(device_index, ballast_bytes(total, budget_gib))
    free_after, _ = torch.cuda.mem_get_info(device_index)
    return ballast, {"budget_gib": budget_gib, "card_total_bytes": total, "ballast_bytes": ballast.nbytes,
                     "free_before_bytes": free_before, "free_after_bytes": free_after}
