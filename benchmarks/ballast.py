"""A smaller card on a big one: one raw driver ``cuMemAlloc`` of (the card's total - the budget) before the model
loads, so ComfyUI's accounting, comfy-aimdo's DynamicVRAM pages and torch's allocators all find only the budget
free (``torch.cuda.set_per_process_memory_fraction`` binds torch's caching allocator alone). It is never in torch's
statistics, so the peaks a run reports are its own.
"""

from __future__ import annotations

import ctypes

GIB = 2**30


def ballast_bytes(total_bytes: int, budget_gib: float) -> int:
    """Bytes to occupy so a card of ``total_bytes`` keeps ``budget_gib`` GiB (the CUDA context comes out of it)."""
    budget = int(budget_gib * GIB)
    if budget <= 0:
        raise ValueError(f"a budget must be positive, got {budget_gib} GiB")
    if budget >= total_bytes:
        raise ValueError(f"a {budget_gib} GiB budget is not below this card's {total_bytes / GIB:.1f} GiB")
    return total_bytes - budget


def occupy(device_index: int, budget_gib: float) -> tuple[ctypes.c_uint64, dict]:
    """Hold back all but ``budget_gib`` GiB for the rest of the process (the driver frees it at exit): the
    allocation, for the caller to hold, and the card's free and total bytes before and after."""
    import torch

    free_before, total = torch.cuda.mem_get_info(device_index)
    nbytes = ballast_bytes(total, budget_gib)
    torch.cuda.set_device(device_index)
    torch.cuda.synchronize(device_index)  # the primary context exists and is current on this thread
    pointer = ctypes.c_uint64(0)
    status = ctypes.CDLL("libcuda.so.1").cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(nbytes))
    if status != 0:
        raise RuntimeError(f"ballast: cuMemAlloc of {nbytes / GIB:.2f} GiB failed (CUresult {status})")
    free_after, _ = torch.cuda.mem_get_info(device_index)
    return pointer, {"budget_gib": budget_gib, "card_total_bytes": total, "ballast_bytes": nbytes,
                     "free_before_bytes": free_before, "free_after_bytes": free_after}
