"""Triton, where it can be imported, and what the pack's Triton passes share: whether they run under
the CPU interpreter (``TRITON_INTERPRET=1``) and rounding to bf16 that the compiler cannot fold."""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton ships with PyTorch's CUDA (and recent CPU) wheels; the pack must import without it.
    import triton
    import triton.language as tl
    TRITON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the install
    triton = tl = None
    TRITON_ERROR = f"triton not importable ({type(exc).__name__}: {exc})"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def hardware_bf16(device: torch.device) -> bool:
    """Whether a pass launched on ``device`` rounds to bf16 with the GPU's own conversion (``round_bf16``'s
    ``HW``): an NVIDIA GPU of compute capability 8.0 or later (PTX's bf16 conversions); not the
    interpreter (no inline assembly there), not a ROCm build (its "cuda" devices take no PTX)."""
    if interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(torch.cuda.current_device() if device.index is None else device.index) >= (8, 0)


def row_tiles(n: int) -> tuple[int, int, int]:
    """``n`` (columns, or groups of them) as up to three power-of-two tiles, largest first: the two
    largest powers of two that fit, then the rest rounded up to a power of two (the only padding). 0:
    no tile. A pass that holds a whole row in registers takes it in these pieces."""
    first = 1 << (n.bit_length() - 1)
    rest = n - first
    second = 1 << (rest.bit_length() - 1) if rest else 0
    rest -= second
    return first, second, 1 << (rest - 1).bit_length() if rest else 0


round_bf16 = None  # a Triton function where Triton is importable
if triton is not None:
    @triton.jit
    def round_bf16(x, HW: tl.constexpr):
        """fp32 -> the nearest bf16 (ties to even), kept as fp32, in steps the compiler cannot fold (a plain
        cast round trip was measured to change 27% of the results on an H200 against stock's two passes:
        the compiler may fold it or contract the multiply and add around it). HW (``hardware_bf16``): one
        conversion instruction, ``cvt.rn.bf16x2.f32`` of x and 0 (bf16(x) in the upper half, zeros below:
        the bits of bf16(x) as fp32), opaque to the compiler. Else integer operations, the same bits
        (the interpreter's casts truncate); a NaN stays NaN (the integer step would carry the GPU's
        NaN, 0x7FFFFFFF, over into -0.0)."""
        if HW:
            return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,r,r", [x, tl.zeros_like(x)],
                                             dtype=tl.float32, is_pure=True, pack=1)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
