"""The elementwise passes of an H3 DiT block that the block fast path fuses, with stock's bits.

Stock modulates a normed row segment in two in-place passes, ``h.mul_(1 + scale).add_(shift)``, each
rounding to the tensor's dtype. ``scale_shift_`` does both in one pass with the same two roundings
(the product of two bf16 values is exact in fp32; each rounding to bf16 is done in integer
operations, which keeps the compiler from folding it or contracting the multiply and add), so the
result is bit-identical. Other dtypes take stock's two passes. Under torch.compile it is stock's
expression again: inductor fuses it with the RMSNorm before it into one kernel, which an opaque
custom op would prevent. Offsets are int64.
The modulation parameters are one row for the whole segment, or one row per token: current ComfyUI
gives rows under a partial denoise mask their own timestep (a per-token index tensor as the
segment's mod row). ``gated_residual_`` is stock's ``addcmul_`` residual in one vectorised pass, same
bits. ``PendingModulation`` hands rows with the modulation still owed to a pass that
applies it as it reads them (the int8 quantiser). ``token_chunks`` splits a sequence for the block's MLP."""

from __future__ import annotations

import torch

from .triton_support import hardware_bf16, interpreting, round_bf16, tl, triton

if triton is not None:
    from triton.language.extra import libdevice

FUSED_DTYPES = (torch.bfloat16,)
BLOCK_COLS, BLOCK_ROWS = 1024, 4

if triton is not None:
    @triton.jit
    def _row_tile(rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """This program's tile of a [rows, cols] block: (row offsets, column offsets, column mask, mask)."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
        col_ok = c < cols
        return r, c, col_ok, (r[:, None] < rows) & col_ok[None, :]

    @triton.jit
    def _modulation(ptr, r, c, cols, col_ok, ok, PER_ROW: tl.constexpr):
        """A modulation parameter over the tile, fp32: one row per token ([rows, cols] contiguous) or one
        row for all ([cols], broadcast)."""
        if PER_ROW:
            return tl.load(ptr + r[:, None] * cols + c[None, :], mask=ok, other=0.0).to(tl.float32)
        return tl.load(ptr + c, mask=col_ok, other=0.0).to(tl.float32)[None, :]

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
        # torch's addcmul: a + (b * c) in fp32, rounded to bf16. The bf16 product is exact in fp32, so a
        # fused multiply-add gives the same fp32 sum.
        tl.store(ptr, round_bf16(x + y * g, HW_BF16).to(tl.bfloat16), mask=ok)

    @triton.jit
    def swiglu_halves(u_ptr, rows, half, stride_u, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """This program's tile of a SwiGLU input's two halves, fp32: (rows, columns, mask, gate, up)."""
        r, c, _, ok = _row_tile(rows, half, BLOCK_R, BLOCK_C)
        base = u_ptr + r[:, None] * stride_u + c[None, :]
        g = tl.load(base, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(base + half, mask=ok, other=0.0).to(tl.float32)
        return r, c, ok, g, up

    @triton.jit
    def _swiglu_exact_kernel(u_ptr, y_ptr, rows, half, stride_u, stride_y, EMULATE: tl.constexpr,
                             HW_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """``silu(gate).mul_(up)`` with torch's CUDA bits: silu as ``x / (1 + expf(-x))`` (libdevice's
        expf, an IEEE division) rounded to bf16, then the product rounded again. EMULATE (the
        interpreter, which has no libdevice): numpy's exp; the steps are the same."""
        r, c, ok, g, up = swiglu_halves(u_ptr, rows, half, stride_u, BLOCK_R, BLOCK_C)
        if EMULATE:
            e = tl.exp(-g)
        else:
            e = libdevice.exp(-g)
        s = round_bf16(tl.math.div_rn(g, 1.0 + e), HW_BF16)
        tl.store(y_ptr + r[:, None] * stride_y + c[None, :], round_bf16(s * up, HW_BF16).to(tl.bfloat16), mask=ok)


def fusable(h: torch.Tensor) -> bool:
    """One Triton pass can take ``h``: a 2-D bf16 row block with contiguous rows, on a GPU (or on
    the CPU under TRITON_INTERPRET), Triton importable."""
    on_device = h.is_cuda or (interpreting() and h.device.type == "cpu")
    return (triton is not None and on_device and h.dim() == 2 and h.dtype in FUSED_DTYPES
            and h.stride(-1) == 1 and h.numel() > 0)


def per_token_params(h: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether the modulation ``params`` of the row block ``h`` are one row per token (``[rows, cols]``)
    rather than one row (``[cols]``); any other shape is an error, never a silent broadcast."""
    shapes = {tuple(p.shape) for p in params}
    if shapes == {tuple(h.shape[-1:])}:
        return False
    if shapes == {tuple(h.shape)} and h.dim() == 2:
        return True
    raise ValueError(f"modulation parameters must be [cols] or [rows, cols] for a {tuple(h.shape)} row block, "
                     f"got {sorted(shapes)}")


def _scale_shift_impl(h: torch.Tensor, scale1: torch.Tensor, shift: torch.Tensor) -> None:
    per_row = per_token_params(h, scale1, shift)
    if not fusable(h):
        h.mul_(scale1).add_(shift)
        return
    rows, cols = h.shape
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
    _scale_shift_kernel[grid](h, scale1.contiguous(), shift.contiguous(), rows, cols, h.stride(0),
                              PER_ROW=per_row, HW_BF16=hardware_bf16(h.device), BLOCK_R=BLOCK_ROWS,
                              BLOCK_C=BLOCK_COLS, num_warps=4)


def scale_shift_(h: torch.Tensor, scale1: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``h.mul_(scale1).add_(shift)`` in one pass, stock's bits; ``scale1`` and ``shift`` (h's dtype) are
    one row (``[cols]``) or one row per token (``[rows, cols]``). Returns ``h``."""
    if torch.compiler.is_compiling():
        return h.mul_(scale1).add_(shift)  # inductor fuses it with the norm
    _scale_shift_impl(h, scale1, shift)
    return h


def gated_residual_(x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Stock's ``x.addcmul_(other, gate)`` in one pass with its bits; ``gate`` (x's dtype) is one row
    (``[cols]``) or one row per token (``[rows, cols]``). torch's own kernel reads the broadcast gate
    unvectorised (about 1.7 TB/s on an H200). Inputs the pass cannot take, and torch.compile (inductor
    fuses stock's expression), run stock's. Returns ``x``."""
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
    """Stock's SwiGLU, ``silu(gate).mul_(up)`` over the two halves of ``u`` (comfy.ops' eager one), in
    one pass with its bits: the silu output is rounded as stock rounds it, but never written out.
    Inputs the pass cannot take (and torch.compile, which fuses stock's expression itself) run stock's."""
    if torch.compiler.is_compiling() or not fusable(u) or u.shape[1] % 2:  # odd: stock's own error
        gate, up = u.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate).mul_(up)
    rows, half = u.shape[0], u.shape[1] // 2
    y = torch.empty(rows, half, dtype=u.dtype, device=u.device)
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(half, BLOCK_COLS))
    _swiglu_exact_kernel[grid](u, y, rows, half, u.stride(0), y.stride(0), EMULATE=interpreting(),
                               HW_BF16=hardware_bf16(u.device), BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS, num_warps=4)
    return y


class PendingModulation:
    """Rows owed stock's modulation, ``h[a:b].mul_(scale1).add_(shift)`` per segment ``(a, b, scale1, shift)``
    (``scale1`` = 1 + scale in h's dtype; each parameter one row or one per row): handed to a consumer
    that may fold it into its own pass (the int8 quantiser), which reads ``rows`` and ``segments``;
    anything else calls ``apply`` first."""

    def __init__(self, rows: torch.Tensor, segments: list):
        self.rows, self.segments = rows, segments
        self.applied = False

    @property
    def foldable(self) -> bool:
        """Owed, with segments that tile the rows in order (no gaps or overlaps): a pass that reads the
        rows once, segment by segment, can apply it."""
        at = 0
        for a, b, *_ in self.segments:
            if a != at or b < a:
                return False
            at = b
        return not self.applied and at == self.rows.shape[0]

    def apply(self) -> torch.Tensor:
        """The rows modulated, in place (one pass a segment, stock's bits); once, however often asked."""
        if not self.applied:
            for a, b, scale1, shift in self.segments:
                scale_shift_(self.rows[a:b], scale1, shift)
            self.applied = True
        return self.rows


def settled(rows):
    """``rows`` as a tensor: a ``PendingModulation`` applied, a tensor as it is."""
    return rows.apply() if isinstance(rows, PendingModulation) else rows


def token_chunks(rows: int, chunk: int, align: int = 64) -> list[tuple[int, int]]:
    """``[(start, stop)]`` covering ``range(rows)`` in as few chunks of at most ``chunk`` rows as
    possible, of equal size rounded up to ``align`` rows where that stays within ``chunk``: no small
    last GEMM. With ``chunk`` a multiple of ``align`` every chunk starts on a multiple of ``align``."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    size = -(-rows // -(-rows // chunk)) if rows else chunk
    size = min(-(-size // align) * align, chunk)
    return [(a, min(a + size, rows)) for a in range(0, rows, size)]


def clip_segments(segments, start: int, stop: int) -> list[tuple]:
    """The ``(a, b, row)`` modulation segments that meet rows ``[start, stop)``, relative to ``start``.
    A per-token ``row`` (an index tensor over ``a:b``) is cut to the rows kept."""
    clipped = []
    for a, b, row in segments:
        lo, hi = max(a, start), min(b, stop)
        if hi > lo:
            clipped.append((lo - start, hi - start, row[lo - a:hi - a] if torch.is_tensor(row) and row.dim() else row))
    return clipped
