"""The contract every attention back-end follows.

A back-end is one small module: it says whether it can run at all on this
machine (``available``), whether it can take one particular call
(``supports``), and runs it (``__call__``). The reasons are data, so the chain
can report exactly why a back-end was skipped.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Kernels that compute element offsets in 32-bit integers wrap silently past this.
INT32_MAX_OFFSET = 2**31 - 1

# How a back-end is handed q/k/v: [B, S, H, D] or [B, H, S, D] (SageAttention's tensor_layout).
# Not to be confused with the dataflow layouts (kernels.LAYOUTS: strided_nhd, hnd).
TENSOR_LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


YES = Verdict(True)


def no(reason: str) -> Verdict:
    return Verdict(False, reason)


class AttentionBackend:
    """Base class: subclasses set the class attributes and implement the hooks.

    ``max_element_offset`` is the largest element offset (from a tensor's own
    data pointer, or within a buffer the kernel allocates) the kernel indexes
    safely; ``None`` means 64-bit indexing. ``row_block`` is the row tile the
    kernel rounds sequence lengths up to when it forms offsets.
    """

    name: str = ""
    max_element_offset: int | None = None
    row_block: int = 1
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
    head_dims: tuple[int, ...] | None = None  # None: any
    max_head_dim: int | None = None
    needs_cuda: bool = True
    takes_mask: bool = False

    @functools.cached_property
    def _availability(self) -> Verdict:
        return self._check_available()

    def available(self) -> Verdict:
        """Can this back-end run on this machine at all? Checked once."""
        return self._availability

    def _check_available(self) -> Verdict:  # pragma: no cover - overridden
        raise NotImplementedError

    def supports(self, q, k, v, *, layout: str, mask=None) -> Verdict:
        """Can it take this call? Shared rules first, then the back-end's own."""
        if self.needs_cuda and q.device.type != "cuda":
            return no(f"needs a CUDA device, got {q.device.type}")
        if q.dtype not in self.dtypes:
            return no(f"dtype {q.dtype} not in {[str(d) for d in self.dtypes]}")
        if not (q.dtype == k.dtype == v.dtype):
            return no("q, k and v dtypes differ")
        head_dim = q.shape[-1]
        if self.head_dims is not None and head_dim not in self.head_dims:
            return no(f"head_dim {head_dim} not in {list(self.head_dims)}")
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return no(f"head_dim {head_dim} > {self.max_head_dim}")
        if mask is not None and not self.takes_mask:
            return no("attention masks are not supported")
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            return no("last dim of q, k, v must be contiguous")
        return self._supports(q, k, v, layout=layout, mask=mask)

    def _supports(self, q, k, v, *, layout: str, mask=None) -> Verdict:
        return YES

    def __call__(self, q, k, v, *, layout: str, scale: float | None = None, mask=None) -> torch.Tensor:
        """Attention in ``layout`` ("NHD" [B,S,H,D] or "HND" [B,H,S,D]); output in the same layout."""
        raise NotImplementedError


def cuda_capability() -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()
