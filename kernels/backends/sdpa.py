"""PyTorch scaled_dot_product_attention: always there, CPU included, 64-bit indexing."""

from __future__ import annotations

import torch.nn.functional as F

from .base import YES, AttentionBackend


class SdpaBackend(AttentionBackend):
    name = "sdpa"
    max_element_offset = None
    needs_cuda = False
    takes_mask = True

    def _check_available(self):
        return YES

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        if layout == "NHD":
            # SDPA wants [B,H,S,D]: transposed views, no copies. Its flash paths allocate the
            # output token-major, so the transposed-back result is usually contiguous NHD.
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
            return out.transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
