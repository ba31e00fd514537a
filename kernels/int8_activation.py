"""The int8 ConvRot activation quantiser with the bits of comfy-kitchen's CUDA ``quantize_int8_rowwise_convrot64``:
each 256-wide group rotated by four radix-4 Hadamard butterflies, the row's absmax as scale, each value over it (both
bf16) rounded to int8; optionally after fc1's SwiGLU or the block's modulation. Fast math as comfy-kitchen's build
(``div.approx.ftz``, ``ex2.approx.ftz``), but subnormal sums are not flushed (inputs below ~1e-38 may differ)."""

from __future__ import annotations

import torch

from .triton_support import interpreting, per_token_params, round_bf16, row_tiles, runs_on, tl, triton

GROUP = 256            # ConvRot's rotation group (comfy-kitchen's fused kernels take only 256)
MAX_COLS = 16384       # comfy-kitchen's fused ConvRot quantiser takes rows up to this width
BF16_MAX = 3.38953139e38  # the largest finite bf16: an infinite absmax is clamped to it
INV_127 = float(torch.tensor(1.0) / torch.tensor(127.0))  # fp32, correctly rounded: what nvcc folds 1.0f / 127.0f to


if triton is not None:
    @triton.jit
    def _div_approx(a, b, EMULATE: tl.constexpr):
        """``a / b`` as nvcc's fast math computes it (``a * rcp.approx(b)``)."""
        if EMULATE:
            return a * (1.0 / b)
        return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _exp_approx(x, EMULATE: tl.constexpr):
        """``expf(x)`` as nvcc's fast math computes it: ``ex2.approx.ftz(x * log2(e))``."""
        y = x * 1.4426950408889634
        if EMULATE:
            return tl.math.exp2(y.to(tl.float64)).to(tl.float32)
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [y],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _mul_unfused(a, b, EMULATE: tl.constexpr):
        """``a * b`` rounded on its own (``.rn``: never contracted into an FMA, as nvcc's code does not)."""
        if EMULATE:
            return a * b
        return tl.inline_asm_elementwise("mul.rn.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _h4_stage(x, G: tl.constexpr, S: tl.constexpr):
        """One radix-4 butterfly over the base-4 digit of stride ``S``: output d of a quadruple is 0.5 * H4[d] .
        (x0, x1, x2, x3), summed left to right as comfy-kitchen's source does (+ + + -, + + - +, + - + +, - + + +)."""
        A: tl.constexpr = 256 // (4 * S)
        t = tl.permute(tl.reshape(x, [G, A, 4, S]), [0, 1, 3, 2])   # the quadruple's index last
        t = tl.reshape(t, [G, A * S, 2, 2])                          # index d = 2e + f
        f0, f1 = tl.split(t)
        x0, x2 = tl.split(f0)
        x1, x3 = tl.split(f1)
        p = x0 + x1
        m = x0 - x1
        y0 = 0.5 * ((p + x2) - x3)
        y1 = 0.5 * ((p - x2) + x3)
        y2 = 0.5 * ((m + x2) + x3)
        y3 = 0.5 * ((x2 - m) + x3)  # (-x0 + x1) + x2: -x0 + x1 is -(x0 - x1) exactly
        t = tl.join(tl.join(y0, y2), tl.join(y1, y3))               # [G, A*S, 2 (e), 2 (f)]
        t = tl.permute(tl.reshape(t, [G, A, S, 4]), [0, 1, 3, 2])
        return tl.reshape(t, [G, 256])

    @triton.jit
    def _load(ptr, ok, MASKED: tl.constexpr):
        """A tile as fp32, masked only where it runs past the row."""
        if MASKED:
            return tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
        return tl.load(ptr).to(tl.float32)

    @triton.jit
    def _rotated_tile(X, S1, B, row, stride_x, stride_p, K, NG, G0: tl.constexpr, G: tl.constexpr,
                      MASKED: tl.constexpr, SWIGLU: tl.constexpr, MOD: tl.constexpr, EMULATE: tl.constexpr):
        """Groups ``G0 .. G0 + G`` after the SwiGLU (fp32) or modulation (stock's roundings), rotated; cols, mask."""
        g = tl.arange(0, G).to(tl.int64) + G0
        col = g[:, None] * 256 + tl.arange(0, 256).to(tl.int64)[None, :]
        ok = (g < NG)[:, None] & (col >= 0)  # [G, 256]
        src = X + row * stride_x + col
        a = _load(src, ok, MASKED)
        if SWIGLU:
            silu = _div_approx(a, 1.0 + _exp_approx(-a, EMULATE), EMULATE)
            a = _mul_unfused(silu, _load(src + K, ok, MASKED), EMULATE)
        if MOD:
            p = row * stride_p + col
            s1, b = _load(S1 + p, ok, MASKED), _load(B + p, ok, MASKED)
            a = round_bf16(round_bf16(a * s1, not EMULATE) + b, not EMULATE)  # stock's mul_, then its add_
        a = _h4_stage(a, G, 1)
        a = _h4_stage(a, G, 4)
        a = _h4_stage(a, G, 16)
        a = _h4_stage(a, G, 64)
        return a, col, ok

    @triton.jit
    def _store_quantized(Q, row, stride_q, col, ok, a, scale_t, MASKED: tl.constexpr, EMULATE: tl.constexpr):
        """Each rotated value (rounded to bf16) over the bf16 scale, rounded to bf16, to the nearest int8."""
        q = round_bf16(_div_approx(round_bf16(a, not EMULATE), scale_t, EMULATE), not EMULATE)
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)  # a NaN becomes -128, as fmaxf/fminf make it
        if EMULATE:
            q = (q + 12582912.0) - 12582912.0  # to the nearest integer, ties to even (|q| <= 128 < 2**22)
        else:
            q = tl.inline_asm_elementwise("cvt.rni.f32.f32 $0, $1;", "=r,r", [q], dtype=tl.float32, is_pure=True, pack=1)
        if MASKED:
            tl.store(Q + row * stride_q + col, q.to(tl.int8), mask=ok)
        else:
            tl.store(Q + row * stride_q + col, q.to(tl.int8))

    @triton.jit
    def _quantize_rows_kernel(X, S1, B, Q, SCALE, K, stride_x, stride_p, stride_q, inv_127, bf16_max,
                              SWIGLU: tl.constexpr, MOD: tl.constexpr, G1: tl.constexpr, G2: tl.constexpr,
                              G3: tl.constexpr, EMULATE: tl.constexpr):
        # One row in registers: its K / 256 groups as tiles of G1, G2, G3 groups (only the last masked).
        row = tl.program_id(0).to(tl.int64)
        ng = K // 256
        a1, c1, m1 = _rotated_tile(X, S1, B, row, stride_x, stride_p, K, ng, 0, G1, G2 == 0, SWIGLU, MOD, EMULATE)
        absmax = tl.max(tl.abs(a1))
        if G2 > 0:
            a2, c2, m2 = _rotated_tile(X, S1, B, row, stride_x, stride_p, K, ng, G1, G2, G3 == 0, SWIGLU, MOD,
                                       EMULATE)
            absmax = tl.maximum(absmax, tl.max(tl.abs(a2)))
        if G3 > 0:
            a3, c3, m3 = _rotated_tile(X, S1, B, row, stride_x, stride_p, K, ng, G1 + G2, G3, True, SWIGLU, MOD,
                                       EMULATE)
            absmax = tl.maximum(absmax, tl.max(tl.abs(a3)))
        scale = tl.maximum(tl.minimum(absmax, bf16_max) * inv_127, 1e-30)  # padding groups are zeros
        tl.store(SCALE + row, scale)
        scale_t = round_bf16(scale, not EMULATE)
        _store_quantized(Q, row, stride_q, c1, m1, a1, scale_t, G2 == 0, EMULATE)
        if G2 > 0:
            _store_quantized(Q, row, stride_q, c2, m2, a2, scale_t, G3 == 0, EMULATE)
        if G3 > 0:
            _store_quantized(Q, row, stride_q, c3, m3, a3, scale_t, True, EMULATE)


def quantize_takes(x: torch.Tensor, input_act: str | None = None) -> bool:
    """The pass takes ``x``: 2-D bf16 rows on a GPU (or interpreted), quantised width 256 * n <= 16,384."""
    if not runs_on(x) or input_act not in (None, "swiglu") or x.dim() != 2 or x.dtype != torch.bfloat16:
        return False
    width = x.shape[1] // (2 if input_act == "swiglu" else 1)
    return (x.stride(-1) == 1 and x.shape[0] > 0 and x.shape[1] % (2 if input_act else 1) == 0
            and width % GROUP == 0 and GROUP <= width <= MAX_COLS)


def quantize_rows(x: torch.Tensor, input_act: str | None = None, *, modulation=None):
    """-> (int8 [m, k], fp32 scales [m, 1]) of bf16 rows ``x`` ([m, 2k] with SwiGLU); ``quantize_takes`` must hold.
    ``modulation``: segments ``(a, b, scale1, shift)`` tiling the rows, applied as stock does (a launch a segment)."""
    if not quantize_takes(x, input_act) or (modulation is not None and input_act is not None):
        raise ValueError(f"the int8 quantiser cannot take a {x.dtype} {tuple(x.shape)} input with act {input_act!r}"
                         + (" and a modulation" if modulation is not None else ""))
    m = x.shape[0]
    k = x.shape[1] // (2 if input_act == "swiglu" else 1)
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    g1, g2, g3 = row_tiles(k // GROUP)
    for a, b, scale1, shift in modulation or [(0, m, None, None)]:
        rows = x[a:b]
        params = (rows, rows) if scale1 is None else tuple(p.to(x.dtype).contiguous() for p in (scale1, shift))
        per_row = scale1 is not None and per_token_params(rows, *params)
        _quantize_rows_kernel[(b - a,)](rows, *params, q[a:b], scale[a:b], k, x.stride(0), k if per_row else 0,
                                        q.stride(0), INV_127, BF16_MAX, SWIGLU=input_act == "swiglu",
                                        MOD=scale1 is not None, G1=g1, G2=g2, G3=g3, EMULATE=interpreting(),
                                        num_warps=row_warps(k))
    return q, scale


def row_warps(width: int) -> int:
    """Warps of one row's program: the fewest, at least 2, holding at most 112 values a thread (128 spill; measured in
    docs/BENCHMARKS.md)."""
    return min(16, max(2, triton.next_power_of_2(-(-width // (32 * 112)))))
