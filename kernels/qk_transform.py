"""Per-head RMSNorm + split-half partial RoPE on Q and K, in place on the strided views. Where comfy-kitchen's
``rms_rope_split_half_`` would pick CUDA, the pack's Triton pass runs with that kernel's bits (its arithmetic in its
order: lane-strided fma squares, a shuffle butterfly, ``rsqrtf``, bf16 normed values, an fma rotation), reading
the rotations once per group of heads. Elsewhere comfy-kitchen runs. Offsets are int64."""

from __future__ import annotations

import torch

from . import kitchen
from .triton_support import fma_rn, hardware_bf16, interpreting, round_bf16, runs_on, tl, triton


def _kitchen():
    try:
        import comfy_kitchen
    except Exception as exc:
        raise RuntimeError(
            "comfy-kitchen is required for RMSNorm+RoPE (pip install comfy-kitchen); "
            f"import failed: {type(exc).__name__}: {exc}") from exc
    return comfy_kitchen


def rope_rot_dim(rope_table: torch.Tensor) -> int:
    """Rotated prefix of the head dim: the table holds one 2x2 rotation per pair."""
    return rope_table.shape[-3] * 2


def check_rope_table(rope_table: torch.Tensor, seq_len: int, head_dim: int) -> None:
    shape = tuple(rope_table.shape)
    if rope_table.dim() != 6 or shape[0] != 1 or shape[2] != 1 or shape[-2:] != (2, 2):
        raise ValueError(f"rope table must be [1, S, 1, rot/2, 2, 2], got {list(shape)}")
    if shape[1] != seq_len:
        raise ValueError(f"rope table covers {shape[1]} tokens but the sequence has {seq_len}")
    if rope_rot_dim(rope_table) > head_dim:
        raise ValueError(f"rope rotates {rope_rot_dim(rope_table)} dims but head_dim is {head_dim}")


# the comfy-kitchen implementation whose bits the pack's pass reproduces
KITCHEN_BACKEND = "cuda"
# the pass's tiling: tokens per program, heads per program (the rotations are read once for them), warps
NORM_ROPE_TOKENS, NORM_ROPE_HEADS, NORM_ROPE_WARPS = 16, 8, 4


if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _lane_pairs(x, R: tl.constexpr, W: tl.constexpr):
        """[R, 2W] -> [R, W]: column j plus column j + W, as a shuffle-down by W adds lane j + W to lane j."""
        lo, hi = tl.split(tl.permute(tl.reshape(x, [R, 2, W]), [0, 2, 1]))
        return lo + hi

    @triton.jit
    def _norm_rope_values(X, rows, ok, h, stride_s, stride_h, w_lo, w_hi, w_tail, f00, f01, f10, f11, eps,
                          R: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PP: tl.constexpr,
                          TAIL: tl.constexpr, TP: tl.constexpr, EMULATE: tl.constexpr, HW_BF16: tl.constexpr):
        """Norm + rope of head ``h`` of ``R`` rows in comfy-kitchen's steps: (row address, halves, tail), unstored."""
        row = X + rows[:, None] * stride_s + h * stride_h
        lane = tl.arange(0, 32)
        acc = tl.zeros([R, 32], dtype=tl.float32)
        for i in tl.static_range(D // 32):  # lane l squares elements l, l + 32, ... in that order
            v = tl.load(row + i * 32 + lane[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            acc = fma_rn(v, v, acc, EMULATE)
        acc = _lane_pairs(acc, R, 16)
        acc = _lane_pairs(acc, R, 8)
        acc = _lane_pairs(acc, R, 4)
        acc = _lane_pairs(acc, R, 2)
        total = tl.reshape(_lane_pairs(acc, R, 1), [R])
        ms = tl.math.div_rn(total, tl.full([R], D, tl.float32)) + eps  # CUDA's IEEE division
        if EMULATE:
            rrms = tl.math.rsqrt(ms)
        else:
            rrms = libdevice.rsqrt(ms)  # CUDA's rsqrtf
        rrms = rrms[:, None]
        p = tl.arange(0, PP)
        pm = ok[:, None] & (p < P)[None, :]
        x0 = tl.load(row + p[None, :], mask=pm, other=0.0).to(tl.float32)
        x1 = tl.load(row + P + p[None, :], mask=pm, other=0.0).to(tl.float32)
        n0 = round_bf16(x0 * rrms * w_lo[None, :], HW_BF16)  # (x * rrms) * weight, then the bf16 value
        n1 = round_bf16(x1 * rrms * w_hi[None, :], HW_BF16)
        y0 = fma_rn(f00, n0, f01 * n1, EMULATE)  # f00*n0 + f01*n1, contracted as nvcc contracts it
        y1 = fma_rn(f10, n0, f11 * n1, EMULATE)
        yt = tl.zeros([R, TP], dtype=tl.float32)
        if TAIL > 0:  # dims past the rotated prefix: normed, not rotated
            t = tl.arange(0, TP)
            xt = tl.load(row + 2 * P + t[None, :], mask=ok[:, None] & (t < TAIL)[None, :], other=0.0)
            yt = xt.to(tl.float32) * rrms * w_tail[None, :]
        return row, round_bf16(y0, HW_BF16), round_bf16(y1, HW_BF16), round_bf16(yt, HW_BF16)

    @triton.jit
    def _norm_rope_store(row, y0, y1, yt, ok, P: tl.constexpr, PP: tl.constexpr, TAIL: tl.constexpr,
                         TP: tl.constexpr):
        p = tl.arange(0, PP)
        pm = ok[:, None] & (p < P)[None, :]
        tl.store(row + p[None, :], y0.to(tl.bfloat16), mask=pm)
        tl.store(row + P + p[None, :], y1.to(tl.bfloat16), mask=pm)
        if TAIL > 0:
            t = tl.arange(0, TP)
            tl.store(row + 2 * P + t[None, :], yt.to(tl.bfloat16), mask=ok[:, None] & (t < TAIL)[None, :])

    @triton.jit
    def _norm_rope_kernel(Q, K, T, QW, KW, S, H, sqs, sqh, sks, skh, sts, stp, str_, stc, eps,
                          D: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, TAIL: tl.constexpr,
                          TP: tl.constexpr, R: tl.constexpr, HG: tl.constexpr, EMULATE: tl.constexpr,
                          HW_BF16: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
        ok = rows < S
        p = tl.arange(0, PP)
        pm = ok[:, None] & (p < P)[None, :]
        f = T + rows[:, None] * sts + p[None, :] * stp
        f00 = tl.load(f, mask=pm, other=0.0).to(tl.float32)
        f01 = tl.load(f + stc, mask=pm, other=0.0).to(tl.float32)
        f10 = tl.load(f + str_, mask=pm, other=0.0).to(tl.float32)
        f11 = tl.load(f + str_ + stc, mask=pm, other=0.0).to(tl.float32)
        t = tl.arange(0, TP)
        qw_lo = tl.load(QW + p, mask=p < P, other=0.0).to(tl.float32)
        qw_hi = tl.load(QW + P + p, mask=p < P, other=0.0).to(tl.float32)
        qw_tail = tl.load(QW + 2 * P + t, mask=t < TAIL, other=0.0).to(tl.float32)
        kw_lo = tl.load(KW + p, mask=p < P, other=0.0).to(tl.float32)
        kw_hi = tl.load(KW + P + p, mask=p < P, other=0.0).to(tl.float32)
        kw_tail = tl.load(KW + 2 * P + t, mask=t < TAIL, other=0.0).to(tl.float32)
        h0 = tl.program_id(1).to(tl.int64) * HG
        for g in range(HG):
            h = h0 + g
            hok = ok & (h < H)
            q = _norm_rope_values(Q, rows, hok, h, sqs, sqh, qw_lo, qw_hi, qw_tail, f00, f01, f10, f11, eps,
                                  R, D, P, PP, TAIL, TP, EMULATE, HW_BF16)
            _norm_rope_store(q[0], q[1], q[2], q[3], hok, P, PP, TAIL, TP)
            k = _norm_rope_values(K, rows, hok, h, sks, skh, kw_lo, kw_hi, kw_tail, f00, f01, f10, f11, eps,
                                  R, D, P, PP, TAIL, TP, EMULATE, HW_BF16)
            _norm_rope_store(k[0], k[1], k[2], k[3], hok, P, PP, TAIL, TP)


def own_pass_takes(q: torch.Tensor, k: torch.Tensor, rope_table: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor) -> bool:
    """Whether the pack's pass takes this in-place call (bf16; head_dim % 32 == 0: a warp per (token, head) row)."""
    d = q.shape[-1]
    return (runs_on(q) and q.dtype == torch.bfloat16 and k.dtype == q.dtype
            and q.shape == k.shape and q.dim() == 4 and q.shape[0] == 1 and d % 32 == 0
            and q.stride(-1) == 1 and k.stride(-1) == 1 and rope_table.dtype in (torch.bfloat16, torch.float32)
            and all(t.device == q.device for t in (k, rope_table, q_weight, k_weight))
            and q_weight.shape == (d,) and k_weight.shape == (d,) and q.numel() > 0)


def kitchen_backend(q, k, rope_table, q_weight, k_weight, eps: float, rot: int) -> str | None:
    """The comfy-kitchen implementation stock's in-place call would run (None: none would)."""
    ck = _kitchen()
    kwargs = dict(q=q, k=k, freqs_cis=rope_table, q_scale=q_weight, k_scale=k_weight, epsilon=eps, rot_dim=rot)
    try:
        return ck.registry.get_capable_backend("rms_rope_split_half_", kwargs)
    except Exception:
        return None


def norm_rope_pass(q: torch.Tensor, k: torch.Tensor, rope_table: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float) -> None:
    """The pack's in-place pass (``own_pass_takes`` must hold): comfy-kitchen's CUDA bits."""
    s, h, d = q.shape[1:]
    p = rope_rot_dim(rope_table) // 2
    tail = d - 2 * p
    grid = (triton.cdiv(s, NORM_ROPE_TOKENS), triton.cdiv(h, NORM_ROPE_HEADS))
    st = rope_table.stride()
    _norm_rope_kernel[grid](q, k, rope_table, q_weight, k_weight, s, h, q.stride(1), q.stride(2), k.stride(1),
                            k.stride(2), st[1], st[3], st[4], st[5], float(eps), D=d, P=p,
                            PP=triton.next_power_of_2(max(p, 1)), TAIL=tail, TP=triton.next_power_of_2(max(tail, 1)),
                            R=NORM_ROPE_TOKENS, HG=NORM_ROPE_HEADS, EMULATE=interpreting(),
                            HW_BF16=hardware_bf16(q.device), num_warps=NORM_ROPE_WARPS)


def norm_rope(q: torch.Tensor, k: torch.Tensor, rope_table: torch.Tensor, q_weight: torch.Tensor,
              k_weight: torch.Tensor, eps: float, *, inplace: bool = True):
    """RMSNorm per head, then rotate the first rot_dim dims (pairs i, i+rot/2); in place (the pack's pass) or not."""
    check_rope_table(rope_table, q.shape[1], q.shape[-1])
    rot = rope_rot_dim(rope_table)
    if inplace and kitchen.norm_rope_checked() and own_pass_takes(q, k, rope_table, q_weight, k_weight) and (
            kitchen_backend(q, k, rope_table, q_weight, k_weight, eps, rot) == KITCHEN_BACKEND):
        norm_rope_pass(q, k, rope_table, q_weight, k_weight, eps)
        return q, k
    ck = _kitchen()
    if inplace:
        ck.rms_rope_split_half_(q, k, rope_table, q_weight, k_weight, epsilon=eps, rot_dim=rot)
        return q, k
    return ck.rms_rope_split_half(q, k, rope_table, q_weight, k_weight, epsilon=eps, rot_dim=rot)


class QKNorm:
    """The normalisation one call owes Q and K, applied at most once: RMSNorm + split-half RoPE or the module's
    q_norm/k_norm; whole (``apply``) or, where ``by_rows``, by token ranges (``apply_rows``, ``mark_applied``)."""

    def __init__(self, *, rope_table=None, q_weight=None, k_weight=None, eps: float = 1e-6, q_norm=None,
                 k_norm=None, inplace: bool = True):
        if rope_table is not None and (q_weight is None or k_weight is None):
            raise ValueError("q_weight and k_weight are required with a rope table")
        if rope_table is None and (q_norm is None or k_norm is None):
            raise ValueError("q_norm and k_norm are required without a rope table")
        self.rope_table, self.q_weight, self.k_weight, self.eps = rope_table, q_weight, k_weight, eps
        self.q_norm, self.k_norm, self.inplace = q_norm, k_norm, inplace
        self.applied = False

    def check(self, seq_len: int, head_dim: int) -> None:
        if self.rope_table is not None:
            check_rope_table(self.rope_table, seq_len, head_dim)

    @property
    def by_rows(self) -> bool:
        """Can it be applied a token range at a time? In place, with a rope table, not yet applied."""
        return self.rope_table is not None and self.inplace and not self.applied

    def mark_applied(self) -> None:
        """Every row range of the call's Q and K is normalised."""
        self.applied = True

    def apply_rows(self, q: torch.Tensor, k: torch.Tensor, start: int) -> None:
        """Normalise in place Q/K rows from token ``start``: rows are independent, so the bits are one call's."""
        if not self.by_rows:
            raise RuntimeError("this normalisation cannot be applied by rows (no rope table, not in place, or done)")
        table = self.rope_table[:, start:start + q.shape[1]]
        norm_rope(q, k, table, self.q_weight, self.k_weight, self.eps, inplace=True)

    def apply(self, q: torch.Tensor, k: torch.Tensor):
        """Normalise q, k [1, S, H, D] (once; later calls return them unchanged)."""
        if self.applied:
            return q, k
        if self.rope_table is not None:
            q, k = norm_rope(q, k, self.rope_table, self.q_weight, self.k_weight, self.eps, inplace=self.inplace)
        else:
            q, k = self.q_norm(q[0]).unsqueeze(0), self.k_norm(k[0]).unsqueeze(0)
        self.applied = True  # only once it has succeeded: a fallback must not skip it
        return q, k
