"""Triton, where it can be imported, and what the pack's Triton passes share: whether they run under
the CPU interpreter (``TRITON_INTERPRET=1``) and rounding to bf16 that the compiler cannot fold."""

from __future__ import annotations

import os

try:  # Triton ships with PyTorch's CUDA (and recent CPU) wheels; the pack must import without it.
    import triton
    import triton.language as tl
    TRITON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the install
    triton = tl = None
    TRITON_ERROR = f"triton not importable ({type(exc).__name__}: {exc})"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


round_bf16 = None  # a Triton function where Triton is importable
if triton is not None:
    @triton.jit
    def round_bf16(x):
        """fp32 -> the nearest bf16 (ties to even), kept as fp32, in integer operations. A plain cast
        was measured to change 27% of the results on an H200 against stock's two passes (the compiler
        may fold the round trip or contract the multiply and add); integers cannot be folded, and the
        interpreter (whose casts truncate) gives the same bits. A NaN stays NaN (as torch's rounding
        keeps it): the integer step would carry the GPU's NaN, 0x7FFFFFFF, over into -0.0."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
