"""FlashAttention-4 (``flash-attn-4``'s ``flash_attn.cute``): strided views in, contiguous NHD out, 64-bit
indexing where verified. JIT compiles (keyed by dtype, head dims, arch; not S) land in ``compile_events``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time

import torch

from .. import gpu
from .base import INT32_MAX_OFFSET, YES, AttentionBackend, no

MODULE = "flash_attn.cute"

# Compute-capability majors flash_attn.cute's forward dispatches (interface._flash_attn_fwd).
SUPPORTED_MAJORS = (8, 9, 10, 11, 12)
# Arches where 64-bit indexing past 2**31 was run and checked; elsewhere the int32 rule holds.
VERIFIED_64BIT = {(9, 0)}
# Without a readable compile cache, a call whose host time exceeds this is counted as a compile.
COMPILE_SECONDS_THRESHOLD = 0.5


def _installed() -> bool:
    """Is ``flash_attn.cute`` importable, without importing it (importing takes seconds)?"""
    if MODULE in sys.modules:
        return sys.modules[MODULE] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(MODULE) is not None
    except (ImportError, ValueError):
        return False


class Fa4Backend(AttentionBackend):
    name = "fa4"
    max_element_offset = None  # per arch in _check_available: None where 64-bit indexing was verified
    row_block = 128  # the m/n tile on every arch (sm80/sm120 tile_n 64 divides it)
    dtypes = (torch.float16, torch.bfloat16)
    max_head_dim = 256

    def __init__(self):
        self.compile_events: list[dict] = []
        self._func = None
        self._caches: list[tuple[str, dict]] = []
        self._cap: tuple[int, int] | None = None

    def _check_available(self):
        if not _installed():
            return no("not_installed", "flash-attn-4 not installed (pip install flash-attn-4)")
        cap = gpu.capability("cuda")  # the process's GPU family (fa4 declares its limits per process)
        if cap is None:
            return no("no_cuda", "no CUDA device")
        if cap[0] not in SUPPORTED_MAJORS:
            return no("gpu_arch", f"no fa4 kernel for compute capability {cap[0]}.{cap[1]}")
        try:
            module = importlib.import_module(MODULE)
            func = module.flash_attn_func
        except Exception as exc:  # a broken cutlass-dsl runtime raises anything from ImportError to RuntimeError
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            return no("not_installed", f"flash_attn.cute not importable ({type(exc).__name__}: {first_line})")
        self._func, self._cap = func, cap
        # the in-memory JIT caches (name, dict) of flash_attn.cute's interface functions
        interface = getattr(module, "interface", None) or sys.modules.get(f"{MODULE}.interface")
        for name, obj in sorted(vars(interface).items()) if interface is not None else ():
            cache = getattr(getattr(obj, "compile_cache", None), "cache", None)
            if callable(obj) and isinstance(cache, dict):
                self._caches.append((name, cache))
        if cap not in VERIFIED_64BIT:
            self.max_element_offset = INT32_MAX_OFFSET
        return YES

    def _supports(self, q, k, v, *, layout, mask=None):
        head_dim = q.shape[-1]
        cap = self._cap or gpu.capability(q.device) or (9, 0)
        # every multiple of 8 up to ``top`` is taken on this arch, and the ``extra`` sizes
        top, extra = (256, ()) if cap[0] == 9 else (128, (256,) if cap[0] in (10, 11) else ())
        if not (head_dim % 8 == 0 and (8 <= head_dim <= top or head_dim in extra)):
            sizes = f"multiples of 8 up to {top}" + "".join(f" or {e}" for e in extra)
            return no("head_dim", f"head_dim {head_dim} not supported on compute capability {cap[0]}.{cap[1]} "
                                  f"({sizes})")
        heads_dim = 2 if layout == "NHD" else 1
        if q.shape[heads_dim] % k.shape[heads_dim]:
            return no("shape", f"{q.shape[heads_dim]} query heads do not group over {k.shape[heads_dim]} key heads")
        return YES

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        if layout == "HND":
            return self._run(*(t.transpose(1, 2) for t in (q, k, v)), scale).transpose(1, 2)
        return self._run(q, k, v, scale)

    def _run(self, q, k, v, scale):
        before = {name: len(cache) for name, cache in self._caches}
        t0 = time.perf_counter()
        out, _lse = self._func(q, k, v, softmax_scale=scale, causal=False)
        seconds = time.perf_counter() - t0  # host time: the compile is synchronous, the kernel is not
        grown = [(name, len(cache) - before.get(name, 0)) for name, cache in self._caches
                 if len(cache) > before.get(name, 0)]
        if grown or (not self._caches and seconds > COMPILE_SECONDS_THRESHOLD):
            what = ", ".join(f"{name.lstrip('_')} x{n}" for name, n in grown) or "a kernel (timed)"
            cap = self._cap or (0, 0)
            key = (f"{what}: {str(q.dtype).removeprefix('torch.')} head_dim {q.shape[-1]}, sm{cap[0]}{cap[1]}, "
                   f"first seen at S={q.shape[1]}, {q.shape[2]} heads")
            self.compile_events.append({"key": key, "seconds": seconds})
        return out
