"""Attention back-ends and the order ``auto`` tries them in."""

from __future__ import annotations

from .base import INT32_MAX_OFFSET, AttentionBackend, Verdict
from .comfy_kitchen_int8 import ComfyKitchenInt8Backend
from .fa4 import Fa4Backend
from .sage1 import Sage1Backend
from .sage2 import Sage2Backend
from .sdpa import SdpaBackend

# One instance each: availability is probed once per process.
BACKENDS: dict[str, AttentionBackend] = {
    b.name: b for b in (Sage2Backend(), Fa4Backend(), SdpaBackend(), ComfyKitchenInt8Backend(), Sage1Backend())
}

# Fastest first, as measured on an H200 at S = 37,810 (see README):
# sage2 53 ms < fa4 60 ms < sdpa 71 ms < comfy_kitchen_int8 89 ms < sage1 93 ms.
# fa4 (FlashAttention-4, exact bf16) is the fastest exact kernel: on the strided NHD views it ran
# 60.2 ms vs cuDNN SDPA 71.4 ms (1.19x) at 37,810 and 2.70 vs 2.89 ms (1.07x) at 8,192, same error
# vs fp32 (benchmarks/results/h200-fa4-measure.json). Optional: `pip install flash-attn-4`; import
# ~7 s and a ~1.7 s JIT compile on the first call per dtype/head_dim.
AUTO_ORDER = ("sage2", "fa4", "sdpa", "comfy_kitchen_int8", "sage1")

__all__ = ["AUTO_ORDER", "BACKENDS", "INT32_MAX_OFFSET", "AttentionBackend", "Verdict"]
