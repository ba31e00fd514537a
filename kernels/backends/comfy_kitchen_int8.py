"""comfy-kitchen ``int8_attention`` (CUDA, rotated INT8): [B, H, S, D] views of any strides in, contiguous HND out."""

from __future__ import annotations

import torch

from .base import INT32_MAX_OFFSET, YES, AttentionBackend, no


class ComfyKitchenInt8Backend(AttentionBackend):
    name = "comfy_kitchen_int8"
    max_element_offset = INT32_MAX_OFFSET
    row_block = 128
    takes_mask = True

    def _check_available(self):
        try:
            import comfy_kitchen
        except Exception as exc:
            return no("not_installed", f"comfy_kitchen not importable ({type(exc).__name__}: {exc})")
        if not hasattr(comfy_kitchen, "int8_attention"):
            return no("wrong_version", "this comfy_kitchen has no int8_attention")
        if not torch.cuda.is_available():
            return no("no_cuda", "no CUDA device")
        try:
            ok = comfy_kitchen.int8_attention_is_available()
        except Exception as exc:
            return no("gpu_unavailable", f"int8_attention_is_available failed ({exc})")
        if not ok:
            return no("gpu_unavailable", "comfy_kitchen reports int8_attention unavailable on this GPU/build")
        self._attn = comfy_kitchen.int8_attention
        return YES

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        if layout == "NHD":  # the output as a view: contiguous HND memory, not contiguous NHD
            return self._attn(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale, attn_mask=mask).transpose(1, 2)
        return self._attn(q, k, v, scale=scale, attn_mask=mask)
