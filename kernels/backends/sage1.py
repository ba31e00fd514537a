"""PyPI ``sageattention==1.0.6`` (Triton). Its ``smooth_k`` subtracts K's mean in place: nothing reads K afterwards."""

from __future__ import annotations

import importlib.util

import torch

from .base import INT32_MAX_OFFSET, YES, AttentionBackend, no
from .sage2 import installed_sageattention


class Sage1Backend(AttentionBackend):
    name = "sage1"
    max_element_offset = INT32_MAX_OFFSET
    row_block = 128
    dtypes = (torch.float16, torch.bfloat16)
    head_dims = (64, 96, 128)

    def _check_available(self):
        module, major = installed_sageattention()
        if module is None:
            return no("not_installed", major)
        if major != 1:
            return no("wrong_version", "installed sageattention is 2.x (use the sage2 back-end)")
        if importlib.util.find_spec("triton") is None:
            return no("not_installed", "triton is not installed")
        if not torch.cuda.is_available():
            return no("no_cuda", "no CUDA device")
        self._sageattn = module.sageattn
        return YES

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        return self._sageattn(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale, smooth_k=True)
