"""Triton passes that turn strided NHD Q/K/V views (Q and K normalised) into SageAttention 2's sm90 operands:
a reduction (V's channel absmax, the K mean by SageAttention's own ``k.mean``) and a quantisation (int8 Q/K with the
sm90 per-thread scales, fp8 V [H, D, S_pad] permuted). Int64 offsets; never traced (the attention runs under
``torch.compiler.disable``). Interpreted they match devkit/sage2_oracle.py bit for bit (the interpreter's truncating
casts are rounded in integer arithmetic)."""

from __future__ import annotations

import torch

from .triton_support import TRITON_ERROR, interpreting, tl, triton

HEAD_DIM = 128
# SageAttention 2's sm90 geometry: Q scales per 64 rows, K per 128, V padded to 128; fp8 e4m3's largest.
Q_BLOCK, K_BLOCK, V_PAD = 64, 128, 128
FP8_MAX = 448.0
# Rotation: an absmax below 2^(ROT_MIN_EXPONENT - 127) counts as that, so every factor stays a normal fp32.
ROT_MIN_EXPONENT = 32
# V absmax: rows per program, rows per loaded tile, channels per program, warps
VMAX_ROWS, VMAX_TILE_ROWS, VMAX_COLS, VMAX_WARPS = 256, 16, 1024, 8

# The preparation modes: name -> whether Q and K are rotated (an exact integer Hadamard product) before int8.
MODES = {"exact": False, "rotated": True}
# Warps per quantisation program, by rotation (the fastest per mode on an H200)
QUANT_WARPS = {False: 8, True: 4}


def rotates(mode: str) -> bool:
    if mode not in MODES:
        raise ValueError(f"unknown sage2 preparation mode {mode!r}; expected one of {list(MODES)}")
    return MODES[mode]


def padded_len(seq: int) -> int:
    return -(-seq // V_PAD) * V_PAD


if triton is not None:
    _ROT_MIN_EXPONENT = tl.constexpr(ROT_MIN_EXPONENT)

    @triton.jit
    def _e4m3(y, EMULATE: tl.constexpr):
        """fp32 -> float8_e4m3fn, round to nearest even, saturating (as cvt.rn.satfinite)."""
        if EMULATE:
            a = tl.abs(y)
            bits = a.to(tl.int32, bitcast=True)
            rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits, RNE
            rn = tl.minimum(rb.to(tl.float32, bitcast=True), 448.0)
            rs = (a + 24576.0) - 24576.0  # subnormals: RNE to a multiple of 2**-9
            r = tl.where(a < 0.015625, rs, rn)
            neg = y.to(tl.int32, bitcast=True) < 0
            y = tl.where(neg, -r, r)
        return y.to(tl.float8e4nv)

    @triton.jit
    def _round_like(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
        """fp32 -> dtype -> fp32 with round-to-nearest-even (the interpreter's bf16 cast truncates)."""
        if EMULATE and dtype == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _sylvester128():
        """The +-1 Sylvester Hadamard matrix, int8 [128, 128]: H[i, j] = (-1)^popcount(i & j)."""
        n = tl.arange(0, 128)
        par = n[:, None] & n[None, :]
        par = par ^ (par >> 4)
        par = par ^ (par >> 2)
        par = par ^ (par >> 1)
        return (1 - 2 * (par & 1)).to(tl.int8)

    @triton.jit
    def _hadamard_rows(x, sylvester):
        """Exact normalised Walsh-Hadamard transform of each row of an [R, 128] tile (R >= 16), as the oracle's:
        14-bit fixed point as two 7-bit int8 digits, each times the +-1 Sylvester matrix (int32 sums: any order)."""
        e = (tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.maximum(e, _ROT_MIN_EXPONENT)
        to_fixed = ((267 - e) << 23).to(tl.float32, bitcast=True)  # 2^14 / s, s = 2^(e - 126)
        from_fixed = ((e - 13) << 23).to(tl.float32, bitcast=True)  # s / 2^14
        fixed = (x * to_fixed[:, None]).to(tl.int32)  # |fixed| < 2^14, truncated toward zero
        mag = tl.abs(fixed)
        neg = fixed < 0
        hi = tl.where(neg, -(mag >> 7), mag >> 7).to(tl.int8)
        lo = tl.where(neg, -(mag & 127), mag & 127).to(tl.int8)
        acc = tl.dot(hi, sylvester, out_dtype=tl.int32)
        acc = tl.dot(lo, sylvester, acc * 128, out_dtype=tl.int32)
        return acc.to(tl.float32) * from_fixed[:, None] * 0.08838834764831845

    @triton.jit
    def _load_rows(X, rows, m, h, c, stride_s, stride_h):
        ptr = X + rows[:, None] * stride_s + h * stride_h + c[None, :]
        return tl.load(ptr, mask=m[:, None], other=0.0)

    @triton.jit
    def _vmax_kernel(V, VMAX, S, HD, svs, svh, D: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr,
                     BC: tl.constexpr):
        """V's absmax over ROWS rows, BC channels: kept per element, reduced once at the end so the loads stream."""
        split = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC).to(tl.int64)
        cm = c < HD
        col = (c // D) * svh + c % D
        acc = tl.zeros([RB, BC], dtype=tl.float32)
        for r0 in range(0, ROWS, RB):
            rows = split * ROWS + r0 + tl.arange(0, RB).to(tl.int64)
            m = (rows < S)[:, None] & cm[None, :]
            vv = tl.load(V + rows[:, None] * svs + col[None, :], mask=m, other=0.0)
            acc = tl.maximum(acc, tl.abs(vv.to(tl.float32)))
        tl.store(VMAX + split * HD + c, tl.max(acc, axis=0), mask=cm)

    @triton.jit
    def _finalize_kernel(VMAX, VSCALE, VRECP, VSPLIT, H, scale_max, D: tl.constexpr):
        h = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, D)
        vm = tl.zeros([D], dtype=tl.float32)
        for sp in range(0, VSPLIT):
            vm = tl.maximum(vm, tl.load(VMAX + (sp * H + h) * D + c))
        smax = tl.zeros([D], dtype=tl.float32) + scale_max
        tl.store(VSCALE + h * D + c, vm / smax)
        tl.store(VRECP + h * D + c, smax / vm)

    @triton.jit
    def _quant_q_subtile(Q, QO, QS, b, qs, h, c, i, S, SQ, ROW0, NQB, sqs, sqh, sylvester,
                         D: tl.constexpr, ROTATE: tl.constexpr):
        """Q sub-tile ``qs`` (of 4) of block ``b``: row i is sequence row 16w + 8u + t (w = 2*half + i//16,
        t = (i//2) % 8, u = i % 2): rows 2g, 2g+1 share scale 8w + t. ``Q``: rows from ROW0 (a multiple of 128)."""
        qblk = 2 * b + qs // 2
        rows = qblk * 64 + 16 * (2 * (qs % 2) + i // 16) + 8 * (i % 2) + (i // 2) % 8
        m = rows < SQ
        x = tl.where(m[:, None], _load_rows(Q, rows, m, h, c, sqs, sqh).to(tl.float32), 0.0)
        if ROTATE:
            x = _hadamard_rows(x, sylvester)
        x3 = tl.reshape(x, [16, 2, D])
        scale = tl.max(tl.max(tl.abs(x3), axis=2), axis=1) / 127. + 0.0000001
        y = x3 / scale[:, None, None]
        y += 0.5 * tl.where(y >= 0, 1, -1)
        y = tl.reshape(y.to(tl.int8), [32, D])
        tl.store(QO + h * S * D + (ROW0 + rows[:, None]) * D + c[None, :], y, mask=m[:, None])
        g = tl.arange(0, 16)
        qblk += ROW0 // 64
        tl.store(QS + h * NQB * 32 + qblk * 32 + (qs % 2) * 16 + g, scale, mask=(g < 16) & (qblk < NQB))

    @triton.jit
    def _quant_k_subtile(K, KO, KS, km, b, t, h, c, i, S, NKB, sks, skh, sylvester,
                         D: tl.constexpr, ROTATE: tl.constexpr, EMULATE_FP8: tl.constexpr):
        """Smoothed K sub-tile ``t`` (of 4): rows 8j + 2t + e (j = i//2, e = i%2), one scale."""
        rows = b * 128 + 8 * (i // 2) + 2 * t + i % 2
        m = rows < S
        xin = _load_rows(K, rows, m, h, c, sks, skh)
        x = tl.where(m[:, None], _round_like(xin.to(tl.float32) - km[None, :], xin.dtype, EMULATE_FP8), 0.0)
        if ROTATE:
            x = _hadamard_rows(x, sylvester)
        scale = tl.max(tl.abs(x)) / 127. + 0.0000001
        y = x / scale
        y += 0.5 * tl.where(y >= 0, 1, -1)
        tl.store(KO + h * S * D + rows[:, None] * D + c[None, :], y.to(tl.int8), mask=m[:, None])
        tl.store(KS + h * NKB * 4 + b * 4 + t, scale)

    @triton.jit
    def _quant_v_subtile(V, VO, recp, b, part, h, c, i, S, LPAD, svs, svh,
                         D: tl.constexpr, EMULATE_FP8: tl.constexpr):
        """V sub-tile ``part``: position j holds token 16(j//16) + pinv(j%16), fp8-mma's order; past S, zeros."""
        j = part * 32 + i
        qq = j % 16
        src = b * 128 + (j // 16) * 16 + ((qq // 2) % 2) * 8 + (qq // 4) * 2 + qq % 2
        mv = src < S
        vv = _load_rows(V, src, mv, h, c, svs, svh).to(tl.float32)
        vq = _e4m3(vv * recp[None, :], EMULATE_FP8)
        tl.store(VO + h * D * LPAD + c[None, :] * LPAD + b * 128 + j[:, None], vq)

    @triton.jit
    def _quant_kernel(Q, K, V, KM, VR, QO, QS, KO, KS, VO, S, SQ, ROW0, H, NQB, NKB, LPAD, sqs, sqh, sks, skh,
                      svs, svh, D: tl.constexpr, ROTATE: tl.constexpr, EMULATE_FP8: tl.constexpr,
                      DO_Q: tl.constexpr, DO_K: tl.constexpr, DO_V: tl.constexpr):
        # One head, one 128-token block, in 32-row sub-tiles (register pressure); DO_Q / DO_K / DO_V: what it writes.
        pid = tl.program_id(0).to(tl.int64)
        h = pid % H
        b = pid // H
        c = tl.arange(0, D)
        i = tl.arange(0, 32)
        sylvester = _sylvester128()  # used by the rotated modes only (dead code otherwise)
        if DO_Q:
            for qs in tl.range(0, 4):
                _quant_q_subtile(Q, QO, QS, b, qs, h, c, i, S, SQ, ROW0, NQB, sqs, sqh, sylvester, D, ROTATE)
        if DO_K:
            km = tl.load(KM + h * D + c)
            for t in tl.range(0, 4):
                _quant_k_subtile(K, KO, KS, km, b, t, h, c, i, S, NKB, sks, skh, sylvester, D, ROTATE, EMULATE_FP8)
        if DO_V:
            recp = tl.load(VR + h * D + c)
            for part in tl.range(0, 4):
                _quant_v_subtile(V, VO, recp, b, part, h, c, i, S, LPAD, svs, svh, D, EMULATE_FP8)


def _require_triton():
    if triton is None:
        raise RuntimeError(f"the sage2 prepared path needs Triton: {TRITON_ERROR}")


def operand_problem(q, k, v) -> tuple[str, str] | None:
    """(reason code, reason) when the passes cannot take these views, else None: the one input check."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "shape", "q, k and v must be tensors"
    if not (q.dim() == 4 and q.shape[0] == 1 and q.shape[-1] == HEAD_DIM and q.shape == k.shape == v.shape):
        return "shape", (f"needs q, k, v of one shape [1, S, H, {HEAD_DIM}], got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if q.shape[1] < 1:
        return "shape", "empty sequence"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "strides", "needs a contiguous last dim"
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return "dtype", f"needs bfloat16 q/k/v, got {q.dtype}/{k.dtype}/{v.dtype}"
    if not (q.device == k.device == v.device):
        return "shape", "q, k and v are on different devices"
    return None


def k_mean(k):
    """K's mean over its tokens, fp32 [H, D]: SageAttention's own ``k.mean`` (its bits), widened exactly."""
    _, _, h, d = k.shape
    return k.mean(dim=1, keepdim=True).reshape(h, d).to(torch.float32)


def v_scales(v):
    """(v_scale [1, H, D], v_recp [H, D]) fp32: V's channel absmax over every token, over fp8 e4m3's largest."""
    _require_triton()
    s, h, d = v.shape[1:]
    vmax = torch.empty(-(-s // VMAX_ROWS), h, d, dtype=torch.float32, device=v.device)  # per VMAX_ROWS-token split
    _vmax_kernel[(vmax.shape[0], triton.cdiv(h * d, VMAX_COLS))](
        v, vmax, s, h * d, v.stride(1), v.stride(2), D=d, ROWS=VMAX_ROWS, RB=VMAX_TILE_ROWS, BC=VMAX_COLS,
        num_warps=VMAX_WARPS)
    vscale = torch.empty(1, h, d, dtype=torch.float32, device=v.device)
    vrecp = torch.empty(h, d, dtype=torch.float32, device=v.device)
    _finalize_kernel[(h,)](vmax, vscale, vrecp, vmax.shape[0], h, FP8_MAX, D=d, num_warps=1)
    return vscale, vrecp


def _reduce(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (k_mean [H, D] fp32, v_scale [1, H, D] fp32, v_recp [H, D] fp32)."""
    return (k_mean(k), *v_scales(v))


def _empty_operands(s, h, d, dev, parts="qkv"):
    """(q_int8, q_scale, k_int8, k_scale, v_fp8), None for those not in ``parts``."""
    nqb, nkb, lpad = -(-s // Q_BLOCK), -(-s // K_BLOCK), padded_len(s)
    q = (torch.empty(h, s, d, dtype=torch.int8, device=dev),
         torch.empty(1, h, nqb * 32, dtype=torch.float32, device=dev)) if "q" in parts else (None, None)
    k = (torch.empty(h, s, d, dtype=torch.int8, device=dev),
         torch.empty(1, h, nkb * 4, dtype=torch.float32, device=dev)) if "k" in parts else (None, None)
    v = (torch.empty(h, d, lpad, dtype=torch.float8_e4m3fn, device=dev),) if "v" in parts else (None,)
    return q + k + v


def _quant_launch(q, k, v, k_mean, v_recp, rotate, out, *, row0=0):
    """One quantisation launch into ``out``: whichever of Q (rows from ``row0``, a multiple of 128), K and V are
    given (the others None)."""
    _require_triton()
    qo, qs, ko, ks, vo = out
    if qo is not None:
        h, s, d = qo.shape
    else:
        _, s, h, d = (k if k is not None else v).shape
    nqb, nkb, lpad = -(-s // Q_BLOCK), -(-s // K_BLOCK), padded_len(s)
    do_q, do_k, do_v = q is not None, k is not None, v is not None
    sq = q.shape[1] if do_q else 0
    if do_q and (row0 % K_BLOCK or row0 + sq > s):
        raise ValueError(f"Q rows {row0}:{row0 + sq} must start at a multiple of {K_BLOCK} within {s} rows")
    blocks = nkb if do_k or do_v else -(-sq // K_BLOCK)
    # operands a launch does not touch are dead code in the kernel; any tensor of the launch stands in for them
    given = next(t for t in (q, k, v) if t is not None)
    q, k, v = (t if t is not None else given for t in (q, k, v))
    written = next(t for t in (qo, ko, vo) if t is not None)
    qo, ko, vo = (t if t is not None else written for t in (qo, ko, vo))
    scales = next(t for t in (qs, ks, k_mean, v_recp) if t is not None)
    qs, km, vr, ks = (t if t is not None else scales for t in (qs, k_mean, v_recp, ks))
    _quant_kernel[(blocks * h,)](
        q, k, v, km, vr, qo, qs, ko, ks, vo, s, sq, row0, h, nqb, nkb, lpad,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        D=d, ROTATE=rotate, EMULATE_FP8=interpreting(), DO_Q=do_q, DO_K=do_k, DO_V=do_v,
        num_warps=QUANT_WARPS[rotate])


def _quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_mean: torch.Tensor, v_recp: torch.Tensor,
              rotate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q_int8 [H, S, D], q_scale [1, H, nq], k_int8 [H, S, D], k_scale [1, H, nk], v_fp8 [H, D, S_pad])."""
    out = _empty_operands(*q.shape[1:], q.device)
    _quant_launch(q, k, v, k_mean, v_recp, rotate, out)
    return out


def _operand_dict(qo, qs, ko, ks, vo, vscale) -> dict:
    return {"q_int8": qo, "q_scale": qs, "k_int8": ko, "k_scale": ks, "v_fp8": vo, "v_scale": vscale}


def quantize_operands(q, k, v, *, mode="exact"):
    """Both passes -> the oracle's operand dict."""
    rotate = rotates(mode)
    problem = operand_problem(q, k, v)
    if problem:
        raise ValueError(f"sage2 preparation: {problem[1]}")
    kmean, vscale, vrecp = _reduce(k, v)
    return _operand_dict(*_quantize(q, k, v, kmean, vrecp, rotate), vscale)


class RowOperands:
    """``quantize_operands``' bits in steps: Q rows per token chunk (``add_q_rows``), then K (``add_k``), then V
    (``add_v``), so that K's and V's bf16 rows need not be alive at once; ``operands()`` once all three are in."""

    def __init__(self, seq, heads, device, *, mode="exact"):
        self.rotate = rotates(mode)
        self.seq, self.heads, self.device = seq, heads, device
        # Q's outputs now, K's and V's only when they come: they would sit unused beside every chunk
        self.q_out = _empty_operands(seq, heads, HEAD_DIM, device, parts="q")
        self.rows_done, self.k_out, self.v_out = 0, None, None

    def add_q_rows(self, q):
        """Quantise Q's next rows: ``q`` [1, n, H, 128] (n a multiple of 128 but for the last chunk)."""
        self._check(q, "Q")  # its rows' place: the launch checks it
        _quant_launch(q, None, None, None, None, self.rotate, self.q_out, row0=self.rows_done)
        self.rows_done += q.shape[1]

    def add_k(self, k):
        """Quantise K, every row [1, S, H, 128], smoothed by its own mean (normalised already)."""
        self._check(k, "K")
        mean = k_mean(k)  # before K's operand exists: torch's reduction stages partial sums of its own
        ko, ks = _empty_operands(self.seq, self.heads, HEAD_DIM, self.device, parts="k")[2:4]
        _quant_launch(None, k, None, mean, None, self.rotate, (None, None, ko, ks, None))
        self.k_out = ko, ks

    def add_v(self, v):
        """Quantise V, every row [1, S, H, 128], to fp8 by its channel absmax."""
        self._check(v, "V")
        vo = _empty_operands(self.seq, self.heads, HEAD_DIM, self.device, parts="v")[4]
        vscale, vrecp = v_scales(v)
        _quant_launch(None, None, v, None, vrecp, self.rotate, (None, None, None, None, vo))
        self.v_out = vo, vscale

    def operands(self) -> dict:
        if self.rows_done != self.seq or self.k_out is None or self.v_out is None:
            raise ValueError(f"Q has {self.rows_done} of {self.seq} rows quantised, "
                             f"K {'done' if self.k_out else 'not'}, V {'done' if self.v_out else 'not'}")
        return _operand_dict(*self.q_out[:2], *self.k_out, *self.v_out)

    def _check(self, x, name: str) -> None:
        problem = operand_problem(x, x, x)
        if problem:
            raise ValueError(f"sage2 preparation: {problem[1]}")
        if x.shape[2] != self.heads or (name != "Q" and x.shape[1] != self.seq):
            raise ValueError(f"sage2 preparation: {name} is {list(x.shape)}, the call has {self.seq} rows "
                             f"of {self.heads} heads")
