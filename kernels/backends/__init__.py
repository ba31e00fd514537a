"""Attention back-ends and the order ``auto`` tries them in."""

from __future__ import annotations

from .base import INT32_MAX_OFFSET, AttentionBackend
from .comfy_kitchen_int8 import ComfyKitchenInt8Backend
from .fa4 import Fa4Backend
from .sage1 import Sage1Backend
from .sage2 import Sage2Backend
from .sdpa import SdpaBackend

# One instance each: availability is probed once per process.
BACKENDS: dict[str, AttentionBackend] = {
    b.name: b for b in (Sage2Backend(), Fa4Backend(), SdpaBackend(), ComfyKitchenInt8Backend(), Sage1Backend())
}

# Fastest first at H3's shape (docs/BENCHMARKS.md); fa4 is the fastest exact one.
AUTO_ORDER = ("sage2", "fa4", "sdpa", "comfy_kitchen_int8", "sage1")

__all__ = ["AUTO_ORDER", "BACKENDS", "INT32_MAX_OFFSET", "AttentionBackend"]
