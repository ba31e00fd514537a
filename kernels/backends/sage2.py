"""thu-ml SageAttention 2.x (CUDA kernels, built from source or community wheels).

``sageattn`` dispatches on the GPU arch and takes any strides with a contiguous
last dim; with ``tensor_layout="NHD"`` its output is contiguous NHD. It forms
element offsets in int32, so the chain keeps every offset below 2**31.
"""

from __future__ import annotations

import importlib

import torch

from .base import INT32_MAX_OFFSET, YES, AttentionBackend, cuda_capability, no

# Arches sageattn() has a kernel for (it raises on others).
SUPPORTED_CAPABILITIES = {(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)}


def installed_sageattention():
    """The importable ``sageattention`` module and its major version, or (None, reason)."""
    try:
        module = importlib.import_module("sageattention")
    except Exception as exc:  # ImportError, or a broken build raising on import
        return None, f"sageattention not importable ({type(exc).__name__}: {exc})"
    # 2.x ships the compiled CUDA entry points; 1.0.x is Triton only.
    major = 2 if hasattr(module, "sageattn_qk_int8_pv_fp16_cuda") else 1
    return module, major


class Sage2Backend(AttentionBackend):
    name = "sage2"
    max_element_offset = INT32_MAX_OFFSET
    row_block = 128
    dtypes = (torch.float16, torch.bfloat16)
    max_head_dim = 128

    def _check_available(self):
        module, major = installed_sageattention()
        if module is None:
            return no(major)
        if major != 2:
            return no("installed sageattention is 1.x (PyPI); SageAttention 2 must be built from source or a wheel")
        cap = cuda_capability()
        if cap is None:
            return no("no CUDA device")
        if cap not in SUPPORTED_CAPABILITIES:
            return no(f"no SageAttention 2 kernel for compute capability {cap[0]}.{cap[1]}")
        self._sageattn = module.sageattn
        return YES

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        return self._sageattn(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale)
