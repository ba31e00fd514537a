"""The block fast path's fused mode (``block_path="fused"``): an H3 DiT block's elementwise passes
merged further than stock's bits allow. Not bit-identical to stock; the error is stated in
benchmarks (``--variant NAME=...:fused_block``) and bounded in tests.

- ``norm_modulate``: RMSNorm (with its weight) and the modulation ``* (1 + scale) + shift`` in one
  pass, fp32 throughout and one rounding at the end (stock: the norm's output is rounded, then each
  of the two modulation passes rounds again). Reads x once, writes h once.
- ``residual_norm_modulate``: stock's gated residual ``x += other * gate`` (in place, rounded to x's
  dtype as stock's ``addcmul_``) and then ``norm_modulate`` of the updated rows, in one pass: the
  attention half's residual and the MLP half's norm share one read of x.
- ``swiglu``: ``silu(gate) * up`` over the two halves of fc1's output, one pass and one rounding
  (stock: silu is rounded and written, then read back for the product).

The modulation parameters (scale, shift, gate) are one row, or one row per token (current
ComfyUI's rows under a partial denoise mask). Each is a torch.library custom op with a fake
implementation, so torch.compile traces the block without a graph break; eager calls skip the
dispatcher. One Triton program holds one whole row (the norm needs its mean square); offsets are
int64. Inputs the kernels do not take (no Triton, a CPU tensor outside the interpreter,
non-contiguous rows) run the same fp32 math in torch."""

from __future__ import annotations

from typing import Optional

import torch

from .h3_block import per_token_params
from .sage2_quant import LIB
from .triton_support import hardware_bf16, interpreting, round_bf16, row_tiles, tl, triton

FUSED_DTYPES = (torch.bfloat16, torch.float16)
MAX_ROW = 16384  # widest row one program holds in registers (H3: 5,376)


# The norm + modulation pass's tiling: None, one row a program held whole in registers
# (``_norm_modulate_kernel``); or (rows a program, columns a sweep, warps) for the two-sweep
# ``_norm_modulate_rows_kernel``. benchmarks/prep_passes.py ``--norm-modulate`` times both kinds.
NORM_MODULATE_TILING = None


def norm_modulate_warps(cols: int) -> int:
    """Warps of the one-row program for rows of ``cols`` columns: at most 48 columns a thread, between 4
    and 16 warps. H3's rows (5,376 columns) take 4, the fewest instructions a row without spilling
    (benchmarks/passes_static.py). On an H100 at 37,810 tokens the norm and the residual with its norm
    took 0.344 + 0.570 ms at 4 warps, 0.368 + 0.608 at 8 and 0.413 + 0.674 at 16 (prep_passes,
    2026-12-05)."""
    return min(16, max(4, triton.next_power_of_2(-(-cols // (32 * 48)))))
SWIGLU_COLS, SWIGLU_ROWS = 1024, 4

if triton is not None:
    from .h3_block import _modulation, swiglu_halves

    @triton.jit
    def _rounded(y, ptr, HW_BF16: tl.constexpr):
        """fp32 -> ``ptr``'s dtype, to nearest (bf16 by ``round_bf16``: TRITON_INTERPRET's cast truncates)."""
        if ptr.dtype.element_ty == tl.bfloat16:
            y = round_bf16(y, HW_BF16)
        return y.to(ptr.dtype.element_ty)

    @triton.jit
    def _row_piece(x_ptr, other_ptr, gate_ptr, row, stride_x, stride_o, stride_p, cols, C0: tl.constexpr,
                   T: tl.constexpr, RESIDUAL: tl.constexpr, HW_BF16: tl.constexpr):
        """Columns C0 .. C0 + T of the row, fp32 (masked past ``cols``), after stock's ``addcmul_``
        (RESIDUAL: x + other * gate rounded to x's dtype, written back): (values, columns, mask)."""
        c = C0 + tl.arange(0, T).to(tl.int64)
        ok = c < cols
        x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
        if RESIDUAL:
            o = tl.load(other_ptr + row * stride_o + c, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(gate_ptr + row * stride_p + c, mask=ok, other=0.0).to(tl.float32)
            x = _rounded(x.to(tl.float32) + o * g, x_ptr, HW_BF16)
            tl.store(x_ptr + row * stride_x + c, x, mask=ok)
        return x.to(tl.float32), c, ok

    @triton.jit
    def _store_normed(h_ptr, w_ptr, scale_ptr, shift_ptr, row, stride_h, stride_p, xf, c, ok, inv_rms,
                      WEIGHT: tl.constexpr, HW_BF16: tl.constexpr):
        """One piece of the row normalised (times the weight), modulated, rounded once, stored."""
        y = xf * inv_rms
        if WEIGHT:
            y = y * tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
        p = row * stride_p + c  # the modulation row: 0 stride for one row, cols for one per token
        s1 = 1.0 + tl.load(scale_ptr + p, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(shift_ptr + p, mask=ok, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * stride_h + c, _rounded(y * s1 + b, h_ptr, HW_BF16), mask=ok)

    @triton.jit
    def _norm_modulate_kernel(x_ptr, other_ptr, gate_ptr, w_ptr, scale_ptr, shift_ptr, h_ptr, cols,
                              stride_x, stride_o, stride_h, stride_p, eps,
                              RESIDUAL: tl.constexpr, WEIGHT: tl.constexpr, HW_BF16: tl.constexpr,
                              T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr):
        # One row, whole, in registers, as up to three power-of-two pieces of T1, T2 and T3 columns
        # (``row_tiles``: only the last runs past the row), so no lane of a power-of-two block idles.
        row = tl.program_id(0).to(tl.int64)
        x1, c1, ok1 = _row_piece(x_ptr, other_ptr, gate_ptr, row, stride_x, stride_o, stride_p, cols, 0, T1,
                                 RESIDUAL, HW_BF16)
        squares = tl.sum(x1 * x1, axis=0)
        if T2 > 0:
            x2, c2, ok2 = _row_piece(x_ptr, other_ptr, gate_ptr, row, stride_x, stride_o, stride_p, cols, T1, T2,
                                     RESIDUAL, HW_BF16)
            squares += tl.sum(x2 * x2, axis=0)
        if T3 > 0:
            x3, c3, ok3 = _row_piece(x_ptr, other_ptr, gate_ptr, row, stride_x, stride_o, stride_p, cols, T1 + T2,
                                     T3, RESIDUAL, HW_BF16)
            squares += tl.sum(x3 * x3, axis=0)
        inv_rms = 1.0 / tl.sqrt(squares / cols + eps)
        _store_normed(h_ptr, w_ptr, scale_ptr, shift_ptr, row, stride_h, stride_p, x1, c1, ok1, inv_rms, WEIGHT,
                      HW_BF16)
        if T2 > 0:
            _store_normed(h_ptr, w_ptr, scale_ptr, shift_ptr, row, stride_h, stride_p, x2, c2, ok2, inv_rms, WEIGHT,
                          HW_BF16)
        if T3 > 0:
            _store_normed(h_ptr, w_ptr, scale_ptr, shift_ptr, row, stride_h, stride_p, x3, c3, ok3, inv_rms, WEIGHT,
                          HW_BF16)

    @triton.jit
    def _norm_modulate_rows_kernel(x_ptr, other_ptr, gate_ptr, w_ptr, scale_ptr, shift_ptr, h_ptr, rows, cols,
                                   stride_x, stride_o, stride_h, eps, RESIDUAL: tl.constexpr,
                                   WEIGHT: tl.constexpr, PER_ROW: tl.constexpr, HW_BF16: tl.constexpr,
                                   R: tl.constexpr, BLOCK_C: tl.constexpr):
        """``_norm_modulate_kernel``'s result, R rows a program, BLOCK_C columns at a time: one sweep
        sums the squares (writing the residual back), a second reads the rows again (from cache) and
        writes them normalised and modulated. Few registers a thread, so many rows are in flight; the
        modulation parameters of one row for all are read once per program, not once per row."""
        r = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
        rok = r < rows
        acc = tl.zeros([R, BLOCK_C], dtype=tl.float32)
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
            ok = rok[:, None] & (c < cols)[None, :]
            xp = x_ptr + r[:, None] * stride_x + c[None, :]
            x = tl.load(xp, mask=ok, other=0.0)
            if RESIDUAL:  # stock's addcmul_, written back (the second sweep reads it again)
                o = tl.load(other_ptr + r[:, None] * stride_o + c[None, :], mask=ok, other=0.0).to(tl.float32)
                x = _rounded(x.to(tl.float32) + o * _modulation(gate_ptr, r, c, cols, c < cols, ok, PER_ROW), x_ptr,
                             HW_BF16)
                tl.store(xp, x, mask=ok)
            xf = x.to(tl.float32)
            acc += xf * xf
        inv_rms = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / cols + eps)
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
            ok = rok[:, None] & (c < cols)[None, :]
            y = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=ok, other=0.0).to(tl.float32)
            y = y * inv_rms[:, None]
            if WEIGHT:
                y = y * tl.load(w_ptr + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
            s1 = 1.0 + _modulation(scale_ptr, r, c, cols, c < cols, ok, PER_ROW)
            b = _modulation(shift_ptr, r, c, cols, c < cols, ok, PER_ROW)
            tl.store(h_ptr + r[:, None] * stride_h + c[None, :], _rounded(y * s1 + b, h_ptr, HW_BF16), mask=ok)

    @triton.jit
    def _swiglu_kernel(u_ptr, y_ptr, rows, half, stride_u, stride_y, HW_BF16: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r, c, ok, g, up = swiglu_halves(u_ptr, rows, half, stride_u, BLOCK_R, BLOCK_C)
        y = g / (1.0 + tl.exp(-g)) * up
        tl.store(y_ptr + r[:, None] * stride_y + c[None, :], _rounded(y, y_ptr, HW_BF16), mask=ok)


def _kernel_takes(*tensors) -> bool:
    t = tensors[0]
    on_device = t.is_cuda or (interpreting() and t.device.type == "cpu")
    return (triton is not None and on_device and t.dtype in FUSED_DTYPES and t.numel() > 0
            and all(a.dim() == 2 and a.stride(-1) == 1 for a in tensors))


def _norm_modulate_torch(x, weight, scale, shift, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return (y * (1.0 + scale.float()) + shift.float()).to(x.dtype)


def _norm_modulate_impl(x, other, gate, weight, scale, shift, eps, h, tiling="default"):
    """Writes ``h``; ``other``/``gate`` None: norm and modulation only, else the gated residual
    first, in place. ``tiling``: ``NORM_MODULATE_TILING``'s forms, or an int: the one-row program's
    warps ("default": ``NORM_MODULATE_TILING``)."""
    rows, cols = x.shape
    if not (_kernel_takes(x, h, *(() if other is None else (other,))) and cols <= MAX_ROW):
        if other is not None:
            x.addcmul_(other, gate.to(x.dtype))
        h.copy_(_norm_modulate_torch(x, weight, scale, shift, eps))
        return
    tiling = NORM_MODULATE_TILING if tiling == "default" else tiling
    per_row = per_token_params(x, scale, shift, *(() if gate is None else (gate,)))
    tensors = (x, other if other is not None else x, gate.contiguous() if gate is not None else scale,
               weight.contiguous() if weight is not None else scale, scale.contiguous(), shift.contiguous(), h)
    flags = dict(RESIDUAL=other is not None, WEIGHT=weight is not None, HW_BF16=hardware_bf16(x.device))
    if isinstance(tiling, tuple):
        r, block_c, warps = tiling
        _norm_modulate_rows_kernel[(triton.cdiv(rows, r),)](
            *tensors, rows, cols, x.stride(0), other.stride(0) if other is not None else 0, h.stride(0), float(eps),
            PER_ROW=per_row, R=r, BLOCK_C=block_c, num_warps=warps, **flags)
        return
    t1, t2, t3 = row_tiles(cols)
    _norm_modulate_kernel[(rows,)](
        *tensors, cols, x.stride(0), other.stride(0) if other is not None else 0, h.stride(0),
        cols if per_row else 0, float(eps), T1=t1, T2=t2, T3=t3, num_warps=tiling or norm_modulate_warps(cols),
        **flags)


def _swiglu_impl(u):
    rows, cols = u.shape
    half = cols // 2
    if not _kernel_takes(u):
        g, up = u.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * up).to(u.dtype)
    y = torch.empty(rows, half, dtype=u.dtype, device=u.device)
    grid = (triton.cdiv(rows, SWIGLU_ROWS), triton.cdiv(half, SWIGLU_COLS))
    _swiglu_kernel[grid](u, y, rows, half, u.stride(0), y.stride(0), HW_BF16=hardware_bf16(u.device),
                         BLOCK_R=SWIGLU_ROWS, BLOCK_C=SWIGLU_COLS, num_warps=4)
    return y


@torch.library.custom_op(f"{LIB}::norm_modulate", mutates_args=("h",))
def _norm_modulate_op(x: torch.Tensor, weight: Optional[torch.Tensor], scale: torch.Tensor,
                      shift: torch.Tensor, eps: float, h: torch.Tensor) -> None:
    _norm_modulate_impl(x, None, None, weight, scale, shift, eps, h)


@torch.library.custom_op(f"{LIB}::residual_norm_modulate", mutates_args=("x", "h"))
def _residual_norm_modulate_op(x: torch.Tensor, other: torch.Tensor, gate: torch.Tensor,
                               weight: Optional[torch.Tensor], scale: torch.Tensor, shift: torch.Tensor,
                               eps: float, h: torch.Tensor) -> None:
    _norm_modulate_impl(x, other, gate, weight, scale, shift, eps, h)


@torch.library.custom_op(f"{LIB}::swiglu", mutates_args=())
def _swiglu_op(u: torch.Tensor) -> torch.Tensor:
    return _swiglu_impl(u)


@_swiglu_op.register_fake
def _(u):
    return u.new_empty(u.shape[0], u.shape[1] // 2)


def _check_rows(x, h, weight, *modulation):
    """x and h one [rows, cols] block of one dtype; the norm weight [cols]; the modulation parameters
    all [cols] or all [rows, cols] (per_token_params raises otherwise)."""
    if x.dim() != 2 or h.shape != x.shape or h.dtype != x.dtype or (
            weight is not None and weight.shape != x.shape[1:]):
        raise ValueError(f"fused block pass: x and h must be [rows, cols] of one dtype with a [cols] weight, got "
                         f"{tuple(x.shape)}, {tuple(h.shape)} and {None if weight is None else tuple(weight.shape)}")
    per_token_params(x, *modulation)


def norm_modulate(x, weight, scale, shift, eps: float, h: torch.Tensor) -> torch.Tensor:
    """``h = rms_norm(x, weight, eps) * (1 + scale) + shift``, written into ``h`` (a row block, e.g. one
    modulation segment of the whole output); ``weight`` is one row, ``scale``/``shift`` one row or
    one per token."""
    _check_rows(x, h, weight, scale, shift)
    if torch.compiler.is_compiling():
        torch.ops.sage_strided_nhd.norm_modulate(x, weight, scale, shift, float(eps), h)
    else:
        _norm_modulate_impl(x, None, None, weight, scale, shift, float(eps), h)
    return h


def residual_norm_modulate_(x, other, gate, weight, scale, shift, eps: float, h: torch.Tensor) -> torch.Tensor:
    """``x += other * gate`` in place, then ``h = norm_modulate(x)``."""
    _check_rows(x, h, weight, gate, scale, shift)
    if other.shape != x.shape:
        raise ValueError(f"fused block pass: residual {tuple(other.shape)} does not match x {tuple(x.shape)}")
    if torch.compiler.is_compiling():
        torch.ops.sage_strided_nhd.residual_norm_modulate(x, other, gate, weight, scale, shift, float(eps), h)
    else:
        _norm_modulate_impl(x, other, gate, weight, scale, shift, float(eps), h)
    return h


def swiglu(u: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``u = [gate | up]`` along the last dim (stock's ``_swiglu_eager``)."""
    if u.dim() != 2 or u.shape[1] % 2:
        raise ValueError(f"swiglu: u must be [rows, 2*n], got {tuple(u.shape)}")
    if torch.compiler.is_compiling():
        return torch.ops.sage_strided_nhd.swiglu(u)
    return _swiglu_impl(u)
