"""PyTorch scaled_dot_product_attention (CPU too, 64-bit); on Hopper+ cuDNN first (faster), whatever ComfyUI asks."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch.nn.functional as F

from .. import gpu
from .base import YES, AttentionBackend


# Stock ComfyUI asks FLASH_ATTENTION first: from about 12,000 tokens the outputs differ by rounding.
HOPPER_PRIORITY = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


@functools.cache
def _hopper_priority():
    """A factory of the context asking SDPA for ``HOPPER_PRIORITY`` in order; None where PyTorch cannot set one."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
        return None
    order = [getattr(SDPBackend, name) for name in HOPPER_PRIORITY]
    return lambda: sdpa_kernel(order, set_priority=True)


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    needs_cuda = False
    takes_mask = True

    def _check_available(self):
        return YES

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        factory = _hopper_priority() if (gpu.capability(q.device) or (0, 0))[0] >= 9 else None
        with factory() if factory is not None else contextlib.nullcontext():
            if layout == "NHD":  # transposed views, no copies; fused paths allocate token-major: usually contiguous NHD
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
