"""A Triton prototype of the sm90 attention kernel on the pack's prepared operands (issue 21, stage 2).

What it is: one Triton kernel (``_prototype_kernel``) with its launcher (``prototype_attention``) that
computes attention from exactly the operands ``kernels.sage2_quant.quantize_operands(q, k, v,
mode="exact")`` makes for SageAttention 2's compiled sm90 kernel, and a benchmark (``main``) that
times the two on the same operands.

The operands it reads (H heads, S tokens, D = 128; devkit/sage2_oracle.py has the exact semantics):

* ``q_int8`` [H, S, D] int8; ``q_scale`` [1, H, ceil(S/64)*32] fp32: row r has scale r//16*8 + r%8.
* ``k_int8`` [H, S, D] int8 (smoothed); ``k_scale`` [1, H, ceil(S/128)*4]: row r has r//128*4 + (r%8)//2.
* ``v_fp8`` [H, D, S_pad] e4m3 (S_pad a multiple of 128, zero padding); in each group of 16 tokens,
  token m sits at position p(m) = 2*(m//8) + 4*((m//2)%4) + m%2. ``v_scale`` [1, H, D] per channel.
* ``sm_scale``. The output: bf16 [S, H, D], contiguous (``out.view(S, H*D)`` is what out_proj reads).

The kernel, per program one head and BLOCK_M query rows, flash-attention style over key blocks:
S = int8 Q . int8 K^T in int32 (tl.dot), to fp32, times the rows' Q scales (sm_scale*log2(e) folded
in) and the columns' K scales. Column j of a key block is the token at V position n0 + j: K rows and
their scales are gathered in V's permuted order, so P's columns meet V's positions with no shuffle
(the softmax does not care about column order). Online softmax in fp32 with exp2; as SageAttention
does, the running max carries -8.807 (log2 448, its S_FP8_OFFSET), so P = exp2(s - m) lies in
[0, 447.9], the row sum is taken from the fp32 P, and P is rounded to e4m3 (nearest even,
saturating); the 448 cancels in the final division by the row sum. P.V is a fresh fp8 tl.dot per key
block (fp32 result, added to the rescaled accumulator: SageAttention's "inst_buf", which bounds the
sm90 fp8 tensor cores' imprecise accumulation to one block). At the end acc / l * v_scale, to bf16.
The tail (S not a multiple of the blocks) is one masked key block after the unmasked loop; masked
query rows are not stored; V's padding is zero. Every offset is int64 (program ids cast before any
product), so 320,000 tokens x 56 heads (offsets past 2**31) are addressed directly, without chunks.

Issue 21's methods, as far as Triton 3.x lets them be written:

* int32 -> float by an integer add and a float subtract: yes, used (``i2f_magic``, on by default):
  the bits of 1.5*2**23 added to the int32 and subtracted as a float, exact for |x| < 2**22
  (|q.k| <= 128*128*128 = 2**21). Config ``..._cvt`` is the plain conversion, for A/B.
* exp2 in f16x2: only through ``tl.inline_asm_elementwise("ex2.approx.f16x2", pack=2)``; present as
  the GPU-only config ``..._f16exp2`` (P in fp16, converted to e4m3 from fp16), not the default, and
  not covered by the CPU tests (the interpreter cannot run inline PTX).
* the row's Q scale folded into exp2's argument (``fold_q_scale``, configs ``..._fold``): scores kept
  as s / q_scale, the row max scaled once, one FFMA for the argument: one multiply less a score.
* P relabelled to V's positions in registers (``relabel_p``): K read in token order, and after the
  softmax P's columns reshaped/permuted (token 8a + 2t + b of 16 to position 4t + 2a + b), which
  Triton's layouts resolve without moving data: the accumulator already is fp8 wgmma's A operand.
* the K scales per group (``group_k_scale``, with ``relabel_p``): a thread's columns of a 128-key
  block share one K scale, so the row max is scaled per (row, group) and exp2's argument is one
  FFMA a score with the two scales' product (configs ``..._groupk``).
* the row sum on the tensor cores (``rowsum_mma``, configs ``..._mmasum``): the e4m3 P times a
  [BLOCK_N, 16] block of ones, one small fp8 wgmma (n16) beside P.V instead of an FADD a score; the
  normaliser is then the sum of the rounded P that multiplies V (SageAttention sums the unrounded P).
* producer/consumer warp specialisation: not available. ``tl.range(warp_specialize=True)`` is
  Blackwell-only in Triton 3.8 and Hopper needs Gluon's explicit partitions; Triton's software
  pipelining (``num_stages``: asynchronous copies multi-buffered ahead of the loop body) is what
  this kernel gets instead.

How to run it (CUDA sm90 with SageAttention 2 installed; it exits with a message elsewhere):

    python3 -m benchmarks.sage2_prototype --seq 8192 37810 --heads 56 --reps 20 --out proto.json
    python3 -m benchmarks.sage2_prototype --configs m128n128w8s3 --seq 37810 --reps 10

Per length it prepares the operands once (the pack's passes, H3-like normed inputs), times every
config in ``--configs`` against SageAttention's sm90 kernel (called as ``Sage2Backend.attend`` calls
it) interleaved rep by rep with CUDA events, and prints p50 ms, TOPS (4*S^2*H*D / t), the ratio
(SageAttention's time / the prototype's) and each one's error against fp32 attention of the same
dequantised operands on the first and last 256 query rows (relative L2, max abs).

``benchmarks/sm90_static.py`` reads every config from its sm90 machine code without a GPU
(instructions per score element against SageAttention's profiled kernel; docs/BENCHMARKS.md).

Status: a prototype. No back-end imports it; it stays out of the runtime until it is at least
1.10x SageAttention's kernel on these operands at H3's shapes with no more error.
tests/unit/test_sage2_prototype.py checks it under TRITON_INTERPRET=1, tests/gpu/test_sage2_prototype_gpu.py
on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace

import torch

from devkit.pack import submodule

sq = submodule("kernels.sage2_quant")
triton, tl = sq.triton, sq.tl

HEADS, D, ROT, EPS = 56, 128, 96, 1e-5
LOG2E = 1.4426950408889634
FP8_OFFSET = 8.807  # log2(448) as SageAttention's sm90 kernel takes it: P's largest value is 2**8.807
REF_ROWS = 256  # error rows: the first and the last REF_ROWS query rows


@dataclass(frozen=True)
class Config:
    """Tile sizes and launch parameters of one prototype variant."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    i2f_magic: bool = True   # int32 -> fp32 by integer add + float subtract (else the plain conversion)
    exp2_f16: bool = False   # exp2 as ex2.approx.f16x2 (GPU only)
    fold_q_scale: bool = False  # the row's Q scale applied in exp2's argument (one FFMA), not per score
    relabel_p: bool = False  # K read in token order, P's columns relabelled to V's positions (no gather)
    group_k_scale: bool = False  # with relabel_p: both scales applied per (row, K-scale group), not per score
    rowsum_mma: bool = False  # the row sum of the e4m3 P by a product with ones on the tensor cores
    tma_loads: bool = False  # with relabel_p: K and V tiles by the Tensor Memory Accelerator (in-kernel descriptors)
    max_registers: int | None = None  # ptxas' register cap: 168 leaves room for three 128-thread CTAs an SM


# the plain conversion, both scales per (row, K-scale group), P relabelled in registers: the base of
# the fewest-instruction configs below
_GROUPK = Config(i2f_magic=False, fold_q_scale=True, relabel_p=True, group_k_scale=True)
CONFIGS = {
    "m128n128w8s3": Config(),
    "m128n128w8s2": Config(num_stages=2),
    "m128n64w8s3": Config(block_n=64),
    "m64n128w4s3": Config(block_m=64, num_warps=4),
    "m128n128w8s3_cvt": Config(i2f_magic=False),
    "m128n128w8s3_f16exp2": Config(exp2_f16=True),
    "m128n128w8s3_fold": Config(fold_q_scale=True),
    "m128n128w8s3_cvt_fold": Config(i2f_magic=False, fold_q_scale=True),
    "m128n128w8s3_cvt_fold_relabel": Config(i2f_magic=False, fold_q_scale=True, relabel_p=True),
    "m128n128w8s3_cvt_groupk": _GROUPK,
    "m128n128w8s3_groupk": replace(_GROUPK, i2f_magic=True),
    "m64n256w4s2_cvt_groupk": replace(_GROUPK, block_m=64, block_n=256, num_warps=4, num_stages=2),
    "m128n256w8s2_cvt_groupk": replace(_GROUPK, block_n=256, num_stages=2),
    "m128n128w8s3_cvt_groupk_mmasum": replace(_GROUPK, rowsum_mma=True),
    "m128n256w8s2_cvt_groupk_mmasum": replace(_GROUPK, block_n=256, num_stages=2, rowsum_mma=True),
    "m128n256w8s3_cvt_groupk_mmasum": replace(_GROUPK, block_n=256, rowsum_mma=True),
    "m64n256w4s2_cvt_groupk_mmasum": replace(_GROUPK, block_m=64, block_n=256, num_warps=4, num_stages=2,
                                             rowsum_mma=True),
    "m64n128w4s3_cvt_groupk": replace(_GROUPK, block_m=64, num_warps=4),
    # K and V tiles by TMA; one warpgroup and 64 rows as SageAttention's kernel runs, the fastest without
    "m64n128w4s3_cvt_groupk_tma": replace(_GROUPK, block_m=64, num_warps=4, tma_loads=True),
    "m64n128w4s4_cvt_groupk_tma": replace(_GROUPK, block_m=64, num_warps=4, num_stages=4, tma_loads=True),
    "m64n128w4s3_cvt_groupk_mmasum_tma": replace(_GROUPK, block_m=64, num_warps=4, rowsum_mma=True, tma_loads=True),
    "m128n128w8s3_cvt_groupk_tma": replace(_GROUPK, tma_loads=True),
    "m128n256w8s2_cvt_groupk_mmasum_tma": replace(_GROUPK, block_n=256, num_stages=2, rowsum_mma=True, tma_loads=True),
    "m64n128w4s4_cvt_groupk": replace(_GROUPK, block_m=64, num_warps=4, num_stages=4),
    "m64n128w4s2_cvt_groupk": replace(_GROUPK, block_m=64, num_warps=4, num_stages=2),
    "m64n128w4s3_cvt_groupk_mmasum": replace(_GROUPK, block_m=64, num_warps=4, rowsum_mma=True),
    # SageAttention's occupancy: 168 registers (no spill with TMA) and two stages (73 KB shared) let
    # three CTAs share an SM, 12 warps where the configs above run 8 (Nsight Compute: 12.4% occupancy)
    "m64n128w4s2_cvt_groupk_tma_r168": replace(_GROUPK, block_m=64, num_warps=4, num_stages=2, tma_loads=True,
                                               max_registers=168),
    "m64n128w4s2_cvt_groupk_mmasum_tma_r168": replace(_GROUPK, block_m=64, num_warps=4, num_stages=2,
                                                      tma_loads=True, rowsum_mma=True, max_registers=168),
    "m64n128w4s3_cvt_groupk_tma_r168": replace(_GROUPK, block_m=64, num_warps=4, tma_loads=True, max_registers=168),
    "m64n128w4s2_cvt_groupk_tma": replace(_GROUPK, block_m=64, num_warps=4, num_stages=2, tma_loads=True),
    "m64n128w4s2_groupk_tma_r168": replace(_GROUPK, i2f_magic=True, block_m=64, num_warps=4, num_stages=2,
                                           tma_loads=True, max_registers=168),
    "m64n64w4s2_cvt_groupk_tma_r168": replace(_GROUPK, block_m=64, block_n=64, num_warps=4, num_stages=2,
                                              tma_loads=True, max_registers=168),
    # 128 registers: four CTAs of 4 warps (or two of 8) an SM, at the price of a small spill (144-192 B)
    "m64n64w4s2_cvt_groupk_tma_r128": replace(_GROUPK, block_m=64, block_n=64, num_warps=4, num_stages=2,
                                              tma_loads=True, max_registers=128),
    "m128n128w8s2_cvt_groupk_tma_r128": replace(_GROUPK, num_stages=2, tma_loads=True, max_registers=128),
}
DEFAULT_CONFIG = "m128n128w8s3"


if triton is not None:
    _FP8_OFFSET = tl.constexpr(FP8_OFFSET)

    @triton.jit
    def _i32_to_f32(x, MAGIC: tl.constexpr):
        """int32 -> fp32; MAGIC: 0x4B400000 is 1.5*2**23's bits, exact for |x| < 2**22."""
        if MAGIC:
            y = (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        else:
            y = x.to(tl.float32)
        return y

    @triton.jit
    def _exp2(x, F16: tl.constexpr):
        """2**x: fp32 (ex2.approx.f32), or fp16 pairs through ex2.approx.f16x2 (an fp16 result)."""
        if F16:
            y = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)],
                                          dtype=tl.float16, is_pure=True, pack=2)
        else:
            y = tl.exp2(x)
        return y

    @triton.jit
    def _p_to_e4m3(p, F16: tl.constexpr, EMULATE: tl.constexpr):
        if F16:
            y = p.to(tl.float8e4nv)
        else:
            y = sq._e4m3(p, EMULATE)  # under the interpreter: rounded in integer arithmetic first
        return y

    @triton.jit
    def _ones_e4m3(N: tl.constexpr, EMULATE: tl.constexpr):
        """[N, 16] e4m3 ones. A constant splat, which the compiler keeps out of the loop's stores; the
        interpreter fills an fp8 full() with the raw value's bits, so there: 1.0 is the byte 0x38."""
        if EMULATE:
            ones = tl.full((N, 16), 0x38, tl.int8).to(tl.float8e4nv, bitcast=True)
        else:
            ones = tl.full((N, 16), 1.0, tl.float8e4nv)
        return ones

    @triton.jit
    def _arg_by_k_groups(f, qsc, ks, m_i, valid, MASKED: tl.constexpr):
        """exp2's argument with both scales applied once per (row, K-scale group) instead of per score.
        In token order column 128u + 8x + 2g + b has K scale g of 128-key block u (``ks`` [U, 4]), so
        the scores reshape to [M, U, N/8U, 4, 2]; the row max is the unscaled max per (row, u, g)
        scaled once (scales are >= 0) and the argument one FFMA a score, f * (q_scale * ks) - m."""
        M: tl.constexpr = f.shape[0]
        N: tl.constexpr = f.shape[1]
        U: tl.constexpr = ks.shape[0]
        shape: tl.constexpr = (M, U, N // (8 * U), 4, 2)
        f5 = tl.reshape(f, shape)
        if MASKED:
            v5 = tl.reshape(tl.broadcast_to(valid[None, :], (M, N)), shape)
            f5 = tl.where(v5, f5, float("-inf"))
        gmax = tl.max(tl.max(f5, 4), 2)  # [M, U, 4]
        scaled = gmax * ks[None, :, :]
        if MASKED:  # a group with no valid key: -inf times a zero scale would be NaN
            scaled = tl.where(gmax == float("-inf"), float("-inf"), scaled)
        m_new = tl.maximum(m_i, tl.max(tl.max(scaled, 2), 1) * qsc - _FP8_OFFSET)
        mult = qsc[:, None, None] * ks[None, :, :]
        arg5 = f5 * mult[:, :, None, :, None] - m_new[:, None, None, None, None]
        if MASKED:
            arg5 = tl.where(v5, arg5, float("-inf"))
        return tl.reshape(arg5, (M, N)), m_new

    @triton.jit
    def _key_block(acc, l_i, m_i, q, qsc, k_head, ks_head, v_head, v_cols, n0, S, perm, j, c, k_desc, v_desc,
                   D: tl.constexpr, MASKED: tl.constexpr, I2F_MAGIC: tl.constexpr, EXP2_F16: tl.constexpr,
                   FOLD_Q: tl.constexpr, RELABEL: tl.constexpr, GROUP_K: tl.constexpr, MMA_SUM: tl.constexpr,
                   TMA: tl.constexpr, EMULATE: tl.constexpr):
        """One key block. Column j of S is the token at V position n0 + j: K rows and K scales are
        gathered in V's permuted order, so P's columns meet V's positions as they are.
        FOLD_Q: scores are kept as t = s / q_scale of the row (scales are >= 0, so the row max is
        max(t) * q_scale) and exp2's argument is one FFMA, t * q_scale - m: one multiply less a score."""
        tok = n0 + perm  # int64 token index of each column
        ks_off = tok // 128 * 4 + (tok % 8) // 2  # the K scale of the token's 32-row group
        if MASKED:
            valid = tok < S
        if TMA:  # token order (relabel_p): one [BLOCK_N, D] tile, zero past S
            k = k_desc.load([n0, 0])
        elif MASKED:
            k = tl.load(k_head + tok[:, None] * D + c[None, :], mask=valid[:, None], other=0)
        else:
            k = tl.load(k_head + tok[:, None] * D + c[None, :])
        if not GROUP_K:
            if MASKED:
                ks = tl.load(ks_head + ks_off, mask=valid, other=0.0)
            else:
                ks = tl.load(ks_head + ks_off)
        qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
        if GROUP_K:
            u = n0 // 128 + tl.arange(0, (j.shape[0] + 127) // 128)  # the 128-key K-scale blocks met
            ks_at = ks_head + u[:, None] * 4 + tl.arange(0, 4)[None, :]
            if MASKED:  # a 256-key tail block may reach past the last K-scale block
                ks = tl.load(ks_at, mask=(u * 128 < S)[:, None], other=0.0)
            else:
                ks = tl.load(ks_at)
            arg, m_new = _arg_by_k_groups(_i32_to_f32(qk, I2F_MAGIC), qsc, ks, m_i, valid if MASKED else tok,
                                          MASKED)
        elif FOLD_Q:
            t = _i32_to_f32(qk, I2F_MAGIC) * ks[None, :]
            if MASKED:
                t = tl.where(valid[None, :], t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(t, 1) * qsc - _FP8_OFFSET)
            arg = t * qsc[:, None] - m_new[:, None]
            if MASKED:  # a zero row scale would turn the masked -inf into NaN
                arg = tl.where(valid[None, :], arg, float("-inf"))
        else:
            s = _i32_to_f32(qk, I2F_MAGIC) * qsc[:, None] * ks[None, :]
            if MASKED:
                s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) - _FP8_OFFSET)
            arg = s - m_new[:, None]
        alpha = tl.exp2(m_i - m_new)
        p = _exp2(arg, EXP2_F16)
        if not MMA_SUM:
            l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)  # the row sum of the unrounded P
        if RELABEL:  # token 8a + 2t + b of each 16 to V's position 4t + 2a + b (SageAttention's layout)
            p = tl.reshape(tl.permute(tl.reshape(p, (p.shape[0], p.shape[1] // 16, 2, 4, 2)), (0, 1, 3, 2, 4)),
                           (p.shape[0], p.shape[1]))
        if TMA:  # [D, BLOCK_N] of V's padded rows, zero past them
            vt = v_desc.load([0, n0])
        elif MASKED:  # a 256-key tail block may reach past V's padding (a multiple of 128)
            vt = tl.load(v_head + v_cols + (n0 + j)[None, :], mask=((n0 + j) < (S + 127) // 128 * 128)[None, :],
                         other=0.0)
        else:
            vt = tl.load(v_head + v_cols + (n0 + j)[None, :])  # [D, BLOCK_N] e4m3: K-major for the dot
        p8 = _p_to_e4m3(p, EXP2_F16, EMULATE)
        pv = tl.dot(p8, tl.trans(vt))  # a fresh fp32 result per block
        if MMA_SUM:  # the row sum of the e4m3 P that meets V, as 16 equal columns of P . ones
            l_i = l_i * alpha + tl.max(tl.dot(p8, _ones_e4m3(p8.shape[1], EMULATE)), 1)
        acc = acc * alpha[:, None] + pv
        return acc, l_i, m_new

    @triton.jit
    def _prototype_kernel(Q, QS, K, KS, V, VS, O, S, H, NQS, NKS, LPAD, qk_scale,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          I2F_MAGIC: tl.constexpr, EXP2_F16: tl.constexpr, FOLD_Q: tl.constexpr,
                          RELABEL: tl.constexpr, GROUP_K: tl.constexpr, MMA_SUM: tl.constexpr,
                          TMA: tl.constexpr, EMULATE: tl.constexpr):
        pid_m = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < S
        c = tl.arange(0, D)
        q = tl.load(Q + h * S * D + rows[:, None] * D + c[None, :], mask=row_ok[:, None], other=0)
        qsc = tl.load(QS + h * NQS + rows // 16 * 8 + rows % 8, mask=row_ok, other=0.0) * qk_scale
        j = tl.arange(0, BLOCK_N)
        jj = j % 16
        if RELABEL:  # column j is token n0 + j; P is relabelled to V's positions after the softmax
            perm = j.to(tl.int64)
        else:
            perm = (j - jj + ((jj // 2) % 2) * 8 + (jj // 4) * 2 + jj % 2).to(tl.int64)  # position -> token
        k_head, ks_head, v_head = K + h * S * D, KS + h * NKS, V + h * D * LPAD
        v_cols = c.to(tl.int64)[:, None] * LPAD
        if TMA:  # descriptors made in the kernel (global scratch): K [S, D] and V [D, LPAD] of this head
            k_desc = tl.make_tensor_descriptor(k_head, shape=[S, D], strides=[D, 1], block_shape=[BLOCK_N, D])
            v_desc = tl.make_tensor_descriptor(v_head, shape=[D, LPAD], strides=[LPAD, 1], block_shape=[D, BLOCK_N])
        else:
            k_desc = k_head
            v_desc = v_head
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        full = S // BLOCK_N * BLOCK_N
        for n0 in tl.range(0, full, BLOCK_N):
            acc, l_i, m_i = _key_block(acc, l_i, m_i, q, qsc, k_head, ks_head, v_head, v_cols, n0, S, perm, j, c,
                                       k_desc, v_desc, D, False, I2F_MAGIC, EXP2_F16, FOLD_Q, RELABEL, GROUP_K,
                                       MMA_SUM, TMA, EMULATE)
        if full < S:
            acc, l_i, m_i = _key_block(acc, l_i, m_i, q, qsc, k_head, ks_head, v_head, v_cols, full, S, perm, j, c,
                                       k_desc, v_desc, D, True, I2F_MAGIC, EXP2_F16, FOLD_Q, RELABEL, GROUP_K,
                                       MMA_SUM, TMA, EMULATE)
        vs = tl.load(VS + h * D + c)
        o = acc / l_i[:, None] * vs[None, :]
        if EMULATE:
            o = sq._round_like(o, tl.bfloat16, True)  # the interpreter's bf16 cast truncates
        tl.store(O + rows[:, None] * (H * D) + h * D + c[None, :], o.to(tl.bfloat16), mask=row_ok[:, None])


def all_configs() -> dict:
    """Every variant by name: this module's Triton configs, then the warp-specialised Gluon ones."""
    from benchmarks import sage2_ws

    return {**CONFIGS, **sage2_ws.WS_CONFIGS}


def kernel_constexprs(cfg: Config, emulate: bool) -> dict:
    """The kernel's constexpr arguments for ``cfg`` (a launch here and the ahead-of-time build alike)."""
    return dict(D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, I2F_MAGIC=cfg.i2f_magic, EXP2_F16=cfg.exp2_f16,
                FOLD_Q=cfg.fold_q_scale, RELABEL=cfg.relabel_p, GROUP_K=cfg.group_k_scale, MMA_SUM=cfg.rowsum_mma,
                TMA=cfg.tma_loads, EMULATE=emulate)


def compile_options(cfg: Config) -> dict:
    """Triton's compile options for ``cfg``: warps, pipeline stages and, where set, the register cap."""
    return dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}))


def _check_operands(ops: dict) -> tuple[int, int, int]:
    """(H, S, D) of a prepared-operand dict, or ValueError naming what does not fit."""
    qi, ki, vo = ops["q_int8"], ops["k_int8"], ops["v_fp8"]
    if qi.dim() != 3 or qi.shape[-1] != sq.HEAD_DIM:
        raise ValueError(f"q_int8 must be [H, S, {sq.HEAD_DIM}], got {list(qi.shape)}")
    h, s, d = qi.shape
    expect = {"q_int8": ((h, s, d), torch.int8), "k_int8": ((h, s, d), torch.int8),
              "q_scale": ((1, h, -(-s // sq.Q_BLOCK) * 32), torch.float32),
              "k_scale": ((1, h, -(-s // sq.K_BLOCK) * 4), torch.float32),
              "v_fp8": ((h, d, sq.padded_len(s)), torch.float8_e4m3fn), "v_scale": ((1, h, d), torch.float32)}
    for name, (shape, dtype) in expect.items():
        t = ops[name]
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != qi.device:
            raise ValueError(f"{name} must be a contiguous {dtype} {list(shape)} on {qi.device}, got "
                             f"{t.dtype} {list(t.shape)} (contiguous: {t.is_contiguous()}) on {t.device}")
    return h, s, d


def prototype_attention(ops: dict, sm_scale: float, *, config: str | Config = DEFAULT_CONFIG,
                        aot=None) -> torch.Tensor:
    """Attention from prepared operands (the dict ``quantize_operands`` returns) -> bf16 [S, H, D].
    ``config`` may also name (or be) a warp-specialised Gluon variant (``benchmarks/sage2_ws.py``).

    ``aot``: a ``benchmarks.triton_aot.Cubins`` to launch the config's ahead-of-time cubin from (``config``
    then names one it holds) instead of compiling the kernel with this process's Triton."""
    if triton is None:
        raise RuntimeError(f"the sage2 prototype needs Triton: {sq.TRITON_ERROR}")
    from benchmarks import sage2_ws

    if (isinstance(config, str) and config in sage2_ws.WS_CONFIGS) or isinstance(config, sage2_ws.WsConfig):
        return sage2_ws.ws_attention(ops, sm_scale, config, aot)
    cfg = CONFIGS[config] if isinstance(config, str) else config
    if (sq.V_PAD % cfg.block_n and cfg.block_n % sq.V_PAD) or cfg.block_n % 16 or cfg.block_m % 16:
        raise ValueError(f"block_n must divide {sq.V_PAD} or be a multiple of it, and be a multiple of 16, block_m a "
                         f"multiple of 16: {cfg}")
    if cfg.group_k_scale and not cfg.relabel_p:
        raise ValueError(f"group_k_scale reads the K-scale groups in token order: it needs relabel_p: {cfg}")
    if cfg.tma_loads and not cfg.relabel_p:
        raise ValueError(f"tma_loads reads K tiles in token order: it needs relabel_p: {cfg}")
    if cfg.exp2_f16 and sq.interpreting():
        raise ValueError("exp2_f16 uses inline PTX, which TRITON_INTERPRET cannot run")
    out, grid, values = launch_arguments(ops, sm_scale, cfg.block_m)
    if aot is not None:
        return launch_ahead_of_time(aot, config, grid, values, out)
    if cfg.tma_loads and not sq.interpreting():
        scratch_allocator()
    _prototype_kernel[grid](*values, **kernel_constexprs(cfg, emulate=sq.interpreting()), **compile_options(cfg))
    return out


def launch_arguments(ops: dict, sm_scale: float, block_m: int) -> tuple:
    """``(out, grid, values)`` of a launch on prepared operands: the bf16 output [S, H, D], one program per
    ``block_m`` query rows of a head, and the kernel's non-constexpr arguments in order (the Triton and
    the Gluon prototype take the same ones)."""
    h, s, d = _check_operands(ops)
    out = torch.empty(s, h, d, dtype=torch.bfloat16, device=ops["q_int8"].device)
    values = (ops["q_int8"], ops["q_scale"], ops["k_int8"], ops["k_scale"], ops["v_fp8"], ops["v_scale"], out,
              s, h, ops["q_scale"].shape[-1], ops["k_scale"].shape[-1], ops["v_fp8"].shape[-1],
              float(sm_scale) * LOG2E)
    return out, (-(-s // block_m), h), values


def launch_ahead_of_time(aot, config, grid: tuple, values: tuple, out: torch.Tensor) -> torch.Tensor:
    """One launch of config ``config``'s cubin from ``aot`` (a ``benchmarks.triton_aot.Cubins``) on
    torch's current stream; ``out``, which it writes."""
    if not isinstance(config, str):
        raise ValueError("an ahead-of-time launch names its config (the cubin is built per name)")
    aot.launch(config, grid, values, torch.cuda.current_stream(out.device).cuda_stream)
    return out


def scratch_allocator() -> None:
    """Give Triton's launcher the global scratch that in-kernel TMA descriptors live in (torch memory)."""
    def allocate(size: int, alignment: int, stream):  # torch's blocks are 512-byte aligned, past any ask here
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(allocate)


# ---------------------------------------------------------------------------------------------
# the benchmark (CUDA sm90 with SageAttention 2)


def head_slice(ops: dict, h0: int, h1: int) -> dict:
    """The operands of heads h0..h1-1 (views)."""
    return {"q_int8": ops["q_int8"][h0:h1], "k_int8": ops["k_int8"][h0:h1], "v_fp8": ops["v_fp8"][h0:h1],
            "q_scale": ops["q_scale"][:, h0:h1], "k_scale": ops["k_scale"][:, h0:h1],
            "v_scale": ops["v_scale"][:, h0:h1]}


def reference_rows(ops: dict, rows: torch.Tensor, sm_scale: float, heads_per_step: int = 8) -> torch.Tensor:
    """fp32 attention of query rows ``rows`` from the dequantised operands -> [R, H, D] (all keys)."""
    from devkit import sage2_oracle

    h = ops["q_int8"].shape[0]
    parts = []
    for h0 in range(0, h, heads_per_step):
        qd, kd, vd = sage2_oracle.dequantize_operands(head_slice(ops, h0, min(h, h0 + heads_per_step)))
        p = torch.softmax((qd[:, rows] @ kd.transpose(1, 2)) * sm_scale, dim=-1)
        parts.append((p @ vd).transpose(0, 1))
        del qd, kd, vd, p
    return torch.cat(parts, 1)


def row_errors(out: torch.Tensor, ref: torch.Tensor, n: int) -> dict:
    """out/ref [R, H, D] on the first n and last n of R rows: relative L2 and max abs per part."""
    err = {}
    for part, sel in (("head", slice(0, n)), ("tail", slice(-n, None))):
        o, r = out[sel].float(), ref[sel]
        err[part] = {"rel_l2": ((o - r).norm() / r.norm()).item(), "max_abs": (o - r).abs().max().item()}
    return err



def make_operands(seq: int, heads: int, seed: int) -> dict:
    """H3-like inputs (normed + roped in place, as exact mode takes them) -> the pack's operands."""
    from devkit import sage2_oracle
    from devkit.inputs import fused_attention_inputs

    qkv, table, qw, kw = fused_attention_inputs(seq, heads, D, ROT, seed=seed, weight_mean=1.0,
                                                weight_spread=0.2, table_dtype=torch.float32)
    q, k, v = qkv.unflatten(1, (3, heads, D)).unsqueeze(0).unbind(2)
    sage2_oracle.norm_rope_eager_(q, k, table, qw, kw, EPS)
    return sq.quantize_operands(q, k, v, mode="exact")


def sage_call(ops: dict, seq: int, heads: int, sm_scale: float):
    """SageAttention's sm90 kernel on ``ops``, called exactly as the prepared path calls it."""
    kernels = submodule("kernels")
    sage2 = submodule("kernels.backends.sage2")
    base = submodule("kernels.backends.base")
    backend = kernels.BACKENDS["sage2"]
    prepared = base.Prepared(backend.name, "exact", ops, float(sm_scale), torch.bfloat16, seq, heads, D,
                             sage2.head_chunks(seq, heads, D))
    return lambda: backend.attend(prepared)[0]


def compiled_variants(ops: dict, sm_scale: float, names: list[str], aot=None) -> tuple[dict, dict]:
    """{name: call} for the configs that compile (or load, with ``aot``) and run here, {name: error} for the others."""
    calls, failed = {}, {}
    for name in names:
        call = (lambda n: lambda: prototype_attention(ops, sm_scale, config=n, aot=aot))(name)
        try:
            call()
            torch.cuda.synchronize()
            calls[name] = call
        except Exception as exc:  # a config that does not compile on this Triton is reported, not fatal
            failed[name] = f"{type(exc).__name__}: {str(exc)[:400]}"
            print(f"config {name} failed: {failed[name]}", flush=True)
    return calls, failed


def bench_length(seq: int, heads: int, names: list[str], reps: int, warmup: int, aot=None) -> dict:
    from benchmarks.measure import event_timed, interleaved_times, summary

    sm_scale = D ** -0.5
    ops = make_operands(seq, heads, seed=7)
    calls, failed = compiled_variants(ops, sm_scale, names, aot)
    calls = {"sage2_sm90": sage_call(ops, seq, heads, sm_scale), **calls}
    times = interleaved_times({n: event_timed(f) for n, f in calls.items()}, reps=reps, warmup=warmup)
    rows = torch.cat([torch.arange(REF_ROWS), torch.arange(seq - REF_ROWS, seq)]).cuda()
    ref = reference_rows(ops, rows, sm_scale)
    outs = {n: f()[rows] for n, f in calls.items()}
    flops = 4.0 * seq * seq * heads * D
    sage_p50 = summary(times["sage2_sm90"])["p50_seconds"]
    variants = {}
    for n, t in times.items():
        s = summary(t)
        variants[n] = {**s, "p50_ms": s["p50_seconds"] * 1e3, "tops": flops / s["p50_seconds"] / 1e12,
                       "ratio_vs_sage2": sage_p50 / s["p50_seconds"], "error_vs_fp32": row_errors(outs[n], ref, REF_ROWS),
                       "max_abs_vs_sage2": (outs[n].float() - outs["sage2_sm90"].float()).abs().max().item()}
    return {"seq": seq, "heads": heads, "head_dim": D, "reps": reps, "sm_scale": sm_scale,
            "error_rows": f"first and last {REF_ROWS}", "variants": variants, "failed_configs": failed}


def print_length(r: dict) -> None:
    print(f"\nS = {r['seq']:,}, {r['heads']}x{r['head_dim']} heads, p50 of {r['reps']} (CUDA events, interleaved)")
    print(f"{'variant':24s} {'p50 ms':>9s} {'TOPS':>7s} {'ratio':>6s} {'spread':>7s}  rel L2 head/tail   max abs head/tail")
    for n, v in r["variants"].items():
        e = v["error_vs_fp32"]
        print(f"{n:24s} {v['p50_ms']:9.3f} {v['tops']:7.1f} {v['ratio_vs_sage2']:6.3f} {v['spread'] * 100:6.1f}%  "
              f"{e['head']['rel_l2'] * 100:6.3f}/{e['tail']['rel_l2'] * 100:6.3f}%   "
              f"{e['head']['max_abs']:.4f}/{e['tail']['max_abs']:.4f}")
    for n, why in r["failed_configs"].items():
        print(f"{n:24s} failed: {why}")


def device_problem() -> str | None:
    """Why the benchmark cannot run on this machine, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (an H100/H200, sm90) with SageAttention 2; no CUDA device here"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs sm90 (H100/H200), got compute capability {torch.cuda.get_device_capability()}"
    backend = submodule("kernels").BACKENDS["sage2"]
    available = backend.available()
    if not available:
        return f"SageAttention 2 unavailable: {available.reason}"
    probe = torch.empty(1, 128, 1, D, dtype=torch.bfloat16, device="cuda")
    verdict = backend.prepared_verdict(probe, probe, probe)
    return None if verdict else f"SageAttention 2's sm90 kernel unavailable: {verdict.reason}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 37810])
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=["all"],
                   help=f"names from {list(all_configs())}, or all (the Triton configs), or ws (the Gluon ones)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--aot", default=None, metavar="DIR",
                   help="launch the configs from the cubins `python -m benchmarks.triton_aot --out DIR` built "
                        "(a newer Triton's code on a machine whose Triton is older; needs CuPy) instead of this Triton")
    args = p.parse_args(argv)
    known = all_configs()
    groups = {"all": list(CONFIGS), "ws": [n for n in known if n not in CONFIGS]}
    names = [n for arg in args.configs for n in groups.get(arg, [arg])]
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown configs {unknown}; known: {list(known)}")
    problem = device_problem()
    if problem:
        sys.exit(f"sage2_prototype: {problem}")
    import sageattention
    aot = None
    if args.aot:
        from benchmarks.triton_aot import Cubins
        aot = Cubins(args.aot)
    cap = torch.cuda.get_device_capability()
    report = {"device": torch.cuda.get_device_name(), "compute_capability": f"SM{cap[0]}{cap[1]}",
              "torch": torch.__version__, "triton": triton.__version__,
              "kernels_from": (f"cubins built ahead of time by Triton {aot.manifest['triton']}" if aot
                               else f"this machine's Triton {triton.__version__}"),
              "sageattention": getattr(sageattention, "__version__", None),
              "configs": {n: asdict(known[n]) for n in names}, "lengths": []}
    for seq in args.seq:
        report["lengths"].append(bench_length(seq, args.heads, names, args.reps, args.warmup, aot))
        print_length(report["lengths"][-1])
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
