"""PyTorch scaled_dot_product_attention: always there, CPU included, 64-bit indexing. On Hopper and
newer it asks for cuDNN's fused attention first (72 ms at H3's shape on an H200 vs 114 ms for
FlashAttention-2), explicitly, so that an ambient priority (ComfyUI's) does not decide."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F

from .base import YES, AttentionBackend


# SDPBackend names, first asked first, on Hopper and newer. Stock ComfyUI (comfy/ops.py, 0.33 to current)
# asks FLASH_ATTENTION first: from about 12,000 tokens the two pick different kernels whose outputs
# differ by rounding (benchmarks/sdpa_priority.py).
HOPPER_PRIORITY = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def priority(names):
    """A context manager factory asking SDPA for ``names`` (SDPBackend names) in that order, or None
    where PyTorch cannot set priorities."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
        return None
    order = [getattr(SDPBackend, name) for name in names]
    return lambda: sdpa_kernel(order, set_priority=True)


@functools.cache
def _hopper_priority():
    return priority(HOPPER_PRIORITY)


def _kernel_priority(q: torch.Tensor):
    hopper = q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] >= 9
    factory = _hopper_priority() if hopper else None
    return factory() if factory is not None else contextlib.nullcontext()


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    max_element_offset = None
    needs_cuda = False
    takes_mask = True

    def _check_available(self):
        return YES

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        with _kernel_priority(q):
            if layout == "NHD":
                # SDPA wants [B,H,S,D]: transposed views, no copies. Its fused paths allocate the
                # output token-major, so the transposed-back result is usually contiguous NHD.
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
                return out.transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
