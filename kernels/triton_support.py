"""Triton where it imports, and what the pack's Triton passes share."""

from __future__ import annotations

import os
import re

import torch

from . import gpu

try:  # Triton ships with PyTorch's CUDA (and recent CPU) wheels; the pack must import without it.
    import triton
    import triton.language as tl
    TRITON_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the install
    triton = tl = None
    TRITON_ERROR = f"triton not importable ({type(exc).__name__}: {exc})"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_on(t: torch.Tensor) -> bool:
    """A Triton pass can run on ``t``'s device: a GPU, or the CPU under the interpreter."""
    return triton is not None and (t.is_cuda or (interpreting() and t.device.type == "cpu"))


def version_key(version: str) -> tuple[int, ...]:
    """A release string's first three numbers, for ordering ("3.6.0+git1a2b" -> (3, 6, 0); no leading digit: 0)."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split(".")[:3])


HW_BF16_MIN_CAPABILITY = (8, 0)  # PTX's cvt.rn.bf16x2.f32


def hardware_bf16(device: torch.device) -> bool:
    """Whether ``round_bf16`` may use the GPU's conversion: not interpreted, NVIDIA sm80+."""
    if interpreting():
        return False
    cap = gpu.capability(device)
    return cap is not None and cap >= HW_BF16_MIN_CAPABILITY


def per_token_params(h: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether ``params`` are one row per token ([rows, cols]), not one row ([cols]); other shapes raise."""
    shapes = {tuple(p.shape) for p in params}
    if shapes == {tuple(h.shape[-1:])}:
        return False
    if shapes == {tuple(h.shape)} and h.dim() == 2:
        return True
    raise ValueError(f"modulation parameters must be [cols] or [rows, cols] for a {tuple(h.shape)} row block, "
                     f"got {sorted(shapes)}")


def row_tiles(n: int) -> tuple[int, int, int]:
    """``n`` as up to three power-of-two tiles, largest first (the rest rounded up: the only padding; 0: none)."""
    first = 1 << (n.bit_length() - 1)
    rest = n - first
    second = 1 << (rest.bit_length() - 1) if rest else 0
    rest -= second
    return first, second, 1 << (rest - 1).bit_length() if rest else 0


round_bf16 = fma_rn = grouped_tile = None  # Triton functions where Triton is importable
if triton is not None:
    @triton.jit
    def round_bf16(x, HW: tl.constexpr):
        """fp32 -> the nearest bf16 (ties to even) as fp32, in steps the compiler cannot fold or contract with the
        multiply and add around it. HW: ``cvt.rn.bf16x2.f32`` of x and 0; else integer steps, same bits (the
        interpreter's casts truncate), a NaN kept."""
        if HW:
            return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,r,r", [x, tl.zeros_like(x)],
                                             dtype=tl.float32, is_pure=True, pack=1)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)

    @triton.jit
    def fma_rn(a, b, c, EMULATE: tl.constexpr):
        """``a * b + c`` rounded once. EMULATE (the interpreter's fma rounds twice): in fp64, where the product is
        exact and the sum rounds to fp32 as the FMA does but where it lands halfway between two fp32 values after the
        fp64 rounding (the CPU tests' references round the same way; the GPU tests check the FMA's bits)."""
        if EMULATE:
            return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
        return tl.fma(a, b, c)

    @triton.jit
    def grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        """Output tile ``tile`` of a ``tiles_m`` x ``tiles_n`` grid as (pid_m, pid_n): the int8 GEMM's order, both of
        its kernels' (Triton's and Gluon's). GROUP_M row tiles in turn share each column tile's weights in L2."""
        tiles_per_group = GROUP_M * tiles_n
        first_m = (tile // tiles_per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        return first_m + (tile % tiles_per_group) % group_rows, (tile % tiles_per_group) // group_rows
