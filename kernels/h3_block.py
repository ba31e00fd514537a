"""The elementwise passes of an H3 block that the fast path fuses, with stock's bits: the modulation (``scale_shift_``,
``PendingModulation``), the ``addcmul_`` residual (``PendingResidual``), the SwiGLU. Parameters are one row, or one
per token (rows under a partial denoise mask get their own timestep). Offsets are int64."""

from __future__ import annotations

import torch

from .triton_support import hardware_bf16, interpreting, per_token_params, round_bf16, runs_on, tl, triton

BLOCK_COLS, BLOCK_ROWS = 1024, 4

if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _row_tile(rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """This program's tile of a [rows, cols] block: (row offsets, column offsets, column mask, mask)."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
        col_ok = c < cols
        return r, c, col_ok, (r[:, None] < rows) & col_ok[None, :]

    @triton.jit
    def _modulation(ptr, r, c, cols, col_ok, ok, PER_ROW: tl.constexpr):
        """A modulation parameter over the tile, fp32: one row per token ([rows, cols] contiguous) or one row."""
        if PER_ROW:  # one return: Triton types every return of a function, even one past a constexpr branch
            values = tl.load(ptr + r[:, None] * cols + c[None, :], mask=ok, other=0.0).to(tl.float32)
        else:
            values = tl.load(ptr + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        return values

    @triton.jit
    def _scale_shift_kernel(h_ptr, scale_ptr, shift_ptr, rows, cols, stride_row, PER_ROW: tl.constexpr,
                            HW_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r, c, col_ok, ok = _row_tile(rows, cols, BLOCK_R, BLOCK_C)
        s = _modulation(scale_ptr, r, c, cols, col_ok, ok, PER_ROW)
        b = _modulation(shift_ptr, r, c, cols, col_ok, ok, PER_ROW)
        ptr = h_ptr + r[:, None] * stride_row + c[None, :]
        h = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
        scaled = round_bf16(h * s, HW_BF16)  # stock's mul_: one rounding
        tl.store(ptr, round_bf16(scaled + b, HW_BF16).to(tl.bfloat16), mask=ok)  # add_: the second

    @triton.jit
    def _gated_residual_kernel(x_ptr, y_ptr, gate_ptr, rows, cols, stride_x, stride_y, PER_ROW: tl.constexpr,
                               HW_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r, c, col_ok, ok = _row_tile(rows, cols, BLOCK_R, BLOCK_C)
        g = _modulation(gate_ptr, r, c, cols, col_ok, ok, PER_ROW)
        ptr = x_ptr + r[:, None] * stride_x + c[None, :]
        x = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + r[:, None] * stride_y + c[None, :], mask=ok, other=0.0).to(tl.float32)
        # torch's addcmul: a + b * c in fp32, rounded to bf16 (the product is exact: fma or not, same sum)
        tl.store(ptr, round_bf16(x + y * g, HW_BF16).to(tl.bfloat16), mask=ok)

    @triton.jit
    def _swiglu_exact_kernel(u_ptr, y_ptr, rows, half, stride_u, stride_y, EMULATE: tl.constexpr,
                             HW_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """``silu(gate).mul_(up)`` with torch's CUDA bits: ``x / (1 + expf(-x))`` (libdevice, IEEE division)
        rounded to bf16, then the product. EMULATE: numpy's exp (the interpreter has no libdevice)."""
        r, c, _, ok = _row_tile(rows, half, BLOCK_R, BLOCK_C)
        base = u_ptr + r[:, None] * stride_u + c[None, :]
        g = tl.load(base, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(base + half, mask=ok, other=0.0).to(tl.float32)
        if EMULATE:
            e = tl.exp(-g)
        else:
            e = libdevice.exp(-g)
        s = round_bf16(tl.math.div_rn(g, 1.0 + e), HW_BF16)
        tl.store(y_ptr + r[:, None] * stride_y + c[None, :], round_bf16(s * up, HW_BF16).to(tl.bfloat16), mask=ok)


def fusable(h: torch.Tensor) -> bool:
    """One Triton pass takes ``h``: 2-D bf16 rows, contiguous last dim, on a GPU (or interpreted on the CPU)."""
    return runs_on(h) and h.dim() == 2 and h.dtype == torch.bfloat16 and h.stride(-1) == 1 and h.numel() > 0


def scale_shift_(h: torch.Tensor, scale1: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``h.mul_(scale1).add_(shift)`` in one pass with its two bf16 roundings; else stock's two passes. -> ``h``."""
    if torch.compiler.is_compiling():
        return h.mul_(scale1).add_(shift)  # inductor fuses it with the norm
    per_row = per_token_params(h, scale1, shift)
    if not fusable(h):
        return h.mul_(scale1).add_(shift)
    rows, cols = h.shape
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
    _scale_shift_kernel[grid](h, scale1.contiguous(), shift.contiguous(), rows, cols, h.stride(0),
                              PER_ROW=per_row, HW_BF16=hardware_bf16(h.device), BLOCK_R=BLOCK_ROWS,
                              BLOCK_C=BLOCK_COLS, num_warps=4)
    return h


def gated_residual_(x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Stock's ``x.addcmul_(other, gate)`` in one pass, same bits (torch reads a broadcast gate unvectorised)."""
    per_row = per_token_params(x, gate)
    if (torch.compiler.is_compiling() or not (fusable(x) and fusable(other)) or other.shape != x.shape
            or gate.dtype != x.dtype):  # a wider gate: torch promotes, the product is no longer exact
        return x.addcmul_(other, gate)
    rows, cols = x.shape
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
    _gated_residual_kernel[grid](x, other, gate.contiguous(), rows, cols, x.stride(0), other.stride(0),
                                 PER_ROW=per_row, HW_BF16=hardware_bf16(x.device), BLOCK_R=BLOCK_ROWS,
                                 BLOCK_C=BLOCK_COLS, num_warps=4)
    return x


def swiglu(u: torch.Tensor) -> torch.Tensor:
    """Stock's SwiGLU (``silu(gate).mul_(up)`` on ``u``'s halves) in one pass, same bits; else stock's."""
    if torch.compiler.is_compiling() or not fusable(u) or u.shape[1] % 2:  # odd: stock's own error
        gate, up = u.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate).mul_(up)
    rows, half = u.shape[0], u.shape[1] // 2
    y = torch.empty(rows, half, dtype=u.dtype, device=u.device)
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(half, BLOCK_COLS))
    _swiglu_exact_kernel[grid](u, y, rows, half, u.stride(0), y.stride(0), EMULATE=interpreting(),
                               HW_BF16=hardware_bf16(u.device), BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS, num_warps=4)
    return y


def tiles_rows(segments, rows: int) -> bool:
    """Segments ``(a, b, ...)`` cover rows ``[0, rows)`` in order, each once."""
    at = 0
    for a, b, *_ in segments:
        if a != at or b < a:
            return False
        at = b
    return at == rows


class PendingModulation:
    """Rows owed ``h[a:b].mul_(scale1).add_(shift)`` per segment ``(a, b, scale1, shift)``: a pass may fold it
    (the int8 quantiser reads ``rows`` and ``segments``); anything else calls ``apply`` first."""

    def __init__(self, rows: torch.Tensor, segments: list):
        self.rows, self.segments = rows, segments
        self.applied = False

    @property
    def foldable(self) -> bool:
        """Owed, with segments tiling the rows in order: a pass reading them once can apply it."""
        return not self.applied and tiles_rows(self.segments, self.rows.shape[0])

    def apply(self) -> torch.Tensor:
        """The rows modulated, in place (one pass a segment, stock's bits); once, however often asked."""
        if not self.applied:
            for a, b, scale1, shift in self.segments:
                scale_shift_(self.rows[a:b], scale1, shift)
            self.applied = True
        return self.rows


class PendingResidual:
    """``x[a:b].addcmul_(y[a:b], gate)`` owed per segment ``(a, b, gate)`` (stock's ``_mod_gate``) for a linear's
    output ``y`` not computed yet: the int8 GEMM may fold it into its epilogue; anything else calls ``apply(y)``."""

    def __init__(self, x: torch.Tensor, segments: list):
        self.x, self.segments = x, segments
        self.applied = False

    @property
    def foldable(self) -> bool:
        return (not self.applied and tiles_rows(self.segments, self.x.shape[0])
                and all(gate.dim() == 1 and gate.dtype == self.x.dtype for *_, gate in self.segments))

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        """``x`` with ``y`` added per segment, in place (one pass a segment, stock's bits); once."""
        for a, b, gate in self.claim():
            gated_residual_(self.x[a:b], y[a:b], gate)
        return self.x

    def claim(self) -> list:
        """The segments, for a caller that adds each one (or fails loudly): from here the residual counts as added."""
        if self.applied:
            raise RuntimeError("[Sage Strided NHD] a residual owed once was added twice")
        self.applied = True
        return self.segments


def settled(rows):
    return rows.apply() if isinstance(rows, PendingModulation) else rows


def clip_segments(segments, start: int, stop: int) -> list[tuple]:
    """The ``(a, b, row)`` segments meeting rows ``[start, stop)``, relative to ``start``, per-token rows cut."""
    clipped = []
    for a, b, row in segments:
        lo, hi = max(a, start), min(b, stop)
        if hi > lo:
            clipped.append((lo - start, hi - start, row[lo - a:hi - a] if torch.is_tensor(row) and row.dim() else row))
    return clipped
