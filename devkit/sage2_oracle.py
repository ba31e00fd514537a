"""Pure-PyTorch reference (the test oracle) of the sage2 prepared path's operand preparation.

Tests and benchmarks compare ``kernels/sage2_quant.py`` against it; the runtime never imports it.

Written from the semantics of SageAttention 2's sm90 path (``sageattn_qk_int8_pv_fp8_cuda_sm90``
with its defaults: per-thread int8 Q/K, ``smooth_k``, per-channel fp8 V, "fp32+fp32" PV
accumulation), not from its code:

* K is smoothed by its per-head mean over the sequence, taken in K's dtype (bf16) and
  subtracted in bf16, exactly as ``k - k.mean(dim=seq, keepdim=True)`` does.
* Q: one scale per "thread group" of 2 rows x 128 channels. In each 64-row block, rows
  ``16w + t`` and ``16w + 8 + t`` (w < 4, t < 8) share scale ``32 * block + 8w + t``.
* K: one scale per group of 32 rows. In each 128-row block, rows ``8j + 2t`` and ``8j + 2t + 1``
  (j < 16, t < 4) share scale ``4 * block + t``.
* scale = absmax / 127 + 1e-7; int8 = trunc(x / scale + 0.5 * sign(x)) with sign(0) = +1.
  No softmax scale is folded into Q: the sm90 kernel takes sm_scale itself.
* V: fp8 e4m3 per (head, channel): scale = absmax / 448 over the sequence, value = e4m3(v * (448 /
  absmax)) rounded to nearest even, saturating. Laid out head-major ``[H, D, S_pad]`` (channels by
  sequence, ``S_pad`` a multiple of 128, zero padding), tokens permuted inside every group of 16 so
  that token ``16g + m`` sits at ``16g + p(m)``, ``p(m) = 2*(m // 8) + 4*((m // 2) % 4) + m % 2``.

The ``rotated`` mode multiplies Q and the smoothed K by a normalised 128-point Walsh-Hadamard matrix
(an exact integer product on fixed-point rows) before the int8 step. The order of
every floating-point operation mirrors the Triton kernels in ``kernels/sage2_quant.py``, so under
``TRITON_INTERPRET=1`` the two agree bit for bit.
"""

from __future__ import annotations

import math

import torch

from .pack import submodule

_kernel = submodule("kernels.sage2_quant")  # the geometry and the modes are the kernel module's own
Q_BLOCK, K_BLOCK, FP8_MAX, ROT_MIN_EXPONENT = _kernel.Q_BLOCK, _kernel.K_BLOCK, _kernel.FP8_MAX, _kernel.ROT_MIN_EXPONENT
MODES, rotates, padded_len = _kernel.MODES, _kernel.rotates, _kernel.padded_len
INV_SQRT_128 = 1.0 / math.sqrt(128.0)


def v_permutation(n: int) -> torch.Tensor:
    """pos[t] = where token t sits in the permuted V sequence axis (n a multiple of 16)."""
    m = torch.arange(16)
    p = 2 * (m // 8) + 4 * ((m // 2) % 4) + m % 2
    return (torch.arange(n) // 16 * 16 + p.repeat(n // 16))


def sylvester_hadamard(n: int = 128) -> torch.Tensor:
    """The +-1 Sylvester Hadamard matrix: H[i, j] = (-1)^popcount(i & j) (symmetric, H H = n I)."""
    i = torch.arange(n)
    parity = torch.zeros(n, n, dtype=torch.long)
    both = i[:, None] & i[None, :]
    while bool(both.any()):
        parity ^= both & 1
        both = both >> 1
    return 1 - 2 * parity


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """Normalised 128-point Walsh-Hadamard transform of the last dim, fp32, in exact arithmetic.

    Each row is written in 14-bit fixed point under ``s``, the power of two just above its absmax
    (``s >= 2^(ROT_MIN_EXPONENT - 126)``), truncated toward zero: < 2^-13 of the row's absmax per
    element (1/64 of the int8 step that follows at most), so, the matrix being orthogonal, a row's
    error norm < sqrt(128) 2^-13 absmax. That integer vector times the +-1 Sylvester matrix is exact
    in any summation order and in fp32 (|sums| < 2^21): the kernel does it on int8 tensor cores in
    two 7-bit digits with int32 accumulation, here in float64. Then the scale ``s / 2^14`` and
    ``1/sqrt(128)`` (which makes the matrix orthogonal), the only rounding.
    """
    if x.shape[-1] != 128:
        raise ValueError(f"hadamard_rows needs a last dim of 128, got {x.shape[-1]}")
    x = x.float()
    e = (x.abs().amax(-1, keepdim=True).view(torch.int32) >> 23) & 0xFF
    e = e.clamp(min=ROT_MIN_EXPONENT)
    to_fixed = ((267 - e) << 23).view(torch.float32)  # 2^14 / s with s = 2^(e - 126)
    from_fixed = ((e - 13) << 23).view(torch.float32)
    fixed = (x * to_fixed).to(torch.int32)
    h = sylvester_hadamard(128).to(device=x.device, dtype=torch.float64)
    y = (fixed.double() @ h).float()
    return y * from_fixed * torch.tensor(INV_SQRT_128, dtype=torch.float32)


def _int8_groups(x: torch.Tensor):
    """x: [..., G, N] fp32 groups -> (int8 [..., G, N], scales [..., G])."""
    scale = x.abs().amax(-1) / 127.0 + 1e-7
    y = x / scale[..., None]
    y = y + 0.5 * torch.where(y >= 0, 1.0, -1.0)
    return y.to(torch.int8), scale


def quant_q_per_thread(q: torch.Tensor):
    """q: [H, S, D] fp32 -> int8 [H, S, D], scales [H, ceil(S/64) * 32]."""
    h, s, d = q.shape
    nb = -(-s // Q_BLOCK)
    qp = q.new_zeros(h, nb * Q_BLOCK, d)
    qp[:, :s] = q
    # row = 64b + 16w + 8u + t  ->  group (b, w, t), member u
    g = qp.view(h, nb, 4, 2, 8, d).permute(0, 1, 2, 4, 3, 5).reshape(h, nb * 32, 2 * d)
    qi, scale = _int8_groups(g)
    qi = qi.view(h, nb, 4, 8, 2, d).permute(0, 1, 2, 4, 3, 5).reshape(h, nb * Q_BLOCK, d)
    return qi[:, :s].contiguous(), scale


def quant_k_per_thread(k: torch.Tensor):
    """k: [H, S, D] fp32 (already smoothed) -> int8 [H, S, D], scales [H, ceil(S/128) * 4]."""
    h, s, d = k.shape
    nb = -(-s // K_BLOCK)
    kp = k.new_zeros(h, nb * K_BLOCK, d)
    kp[:, :s] = k
    # row = 128b + 8j + 2t + e  ->  group (b, t), members (j, e)
    g = kp.view(h, nb, 16, 4, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(h, nb * 4, 32 * d)
    ki, scale = _int8_groups(g)
    ki = ki.view(h, nb, 4, 16, 2, d).permute(0, 1, 3, 2, 4, 5).reshape(h, nb * K_BLOCK, d)
    return ki[:, :s].contiguous(), scale


def quant_v_per_channel(v: torch.Tensor):
    """v: [1, S, H, D] -> (fp8 [H, D, S_pad] permuted, scale [1, H, D])."""
    _, s, h, d = v.shape
    vf = v[0].float().permute(1, 2, 0)  # [H, D, S]
    amax = vf.abs().amax(-1)
    scale = amax / FP8_MAX
    recp = torch.full_like(amax, FP8_MAX) / amax  # one rounding (a python scalar / tensor is 448 * (1/x))
    sp = padded_len(s)
    vp = vf.new_zeros(h, d, sp)
    vp[..., :s] = vf
    y = (vp * recp[..., None]).clamp(-FP8_MAX, FP8_MAX)
    out = torch.empty(h, d, sp, dtype=torch.float8_e4m3fn, device=vf.device)
    out[..., v_permutation(sp).to(vf.device)] = y.to(torch.float8_e4m3fn)
    return out, scale[None]


def prepare_reference(q, k, v, *, mode="exact"):
    """All operands the sm90 kernel takes, from NHD [1, S, H, 128] views of normalised Q and K. CPU or
    GPU, any strides.

    Returns a dict: q_int8 / k_int8 [H, S, D] int8, q_scale [1, H, nq], k_scale [1, H, nk],
    v_fp8 [H, D, S_pad] float8_e4m3fn, v_scale [1, H, D].
    """
    qf = q.float()
    km = k.mean(dim=1, keepdim=True)  # in k's dtype, as SageAttention takes it
    ks = (k.float() - km.float()).to(k.dtype).float()
    if rotates(mode):
        qf, ks = hadamard_rows(qf), hadamard_rows(ks)
    q_i8, q_scale = quant_q_per_thread(qf[0].permute(1, 0, 2))
    k_i8, k_scale = quant_k_per_thread(ks[0].permute(1, 0, 2))
    v_fp8, v_scale = quant_v_per_channel(v)
    return {"q_int8": q_i8, "q_scale": q_scale[None], "k_int8": k_i8, "k_scale": k_scale[None],
            "v_fp8": v_fp8, "v_scale": v_scale}


def dequantize_operands(ops: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The values the sm90 kernel's operands stand for: Q, K, V as fp32 [H, S, D] (V unpermuted)."""
    qi, ki = ops["q_int8"].float(), ops["k_int8"].float()
    h, s, d = qi.shape
    rows = torch.arange(s, device=qi.device)
    q_group = rows // 16 * 8 + rows % 8
    k_group = rows // 128 * 4 + (rows % 8) // 2
    if int(q_group.max()) >= ops["q_scale"].shape[-1]:
        raise ValueError("q_scale has fewer groups than q_int8's rows need")
    qd = qi * ops["q_scale"][0][:, q_group, None]
    kd = ki * ops["k_scale"][0][:, k_group, None]
    sp = ops["v_fp8"].shape[-1]
    order = v_permutation(sp).to(qi.device)
    vd = ops["v_fp8"].float()[..., order][..., :s] * ops["v_scale"][0][..., None]  # [H, D, S]
    return qd, kd, vd.transpose(1, 2)


def dequant_attention_reference(ops: dict, sm_scale: float) -> torch.Tensor:
    """fp32 attention from prepared operands (what the sm90 kernel computes, without its rounding).

    Returns [1, S, H, D] fp32. Small shapes only (materialises S x S per head).
    """
    qd, kd, vd = dequantize_operands(ops)
    p = torch.softmax((qd @ kd.transpose(1, 2)) * sm_scale, dim=-1)
    return (p @ vd).permute(1, 0, 2)[None]


def norm_rope_eager_(q, k, rope_table, q_weight, k_weight, eps):
    """In-place RMSNorm + split-half partial RoPE with comfy-kitchen's eager rounding (bf16 after
    the norm, table dtype for the rotation, bf16 out). For tests and benchmarks on machines
    without comfy-kitchen."""
    half = rope_table.shape[-3]
    rot = 2 * half
    f = rope_table[0, :, 0].to(torch.float32)  # [S, half, 2, 2]
    for x, w in ((q, q_weight), (k, k_weight)):
        xn = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight=w.to(x.dtype), eps=eps)
        a = xn[..., :half].float()
        b = xn[..., half:rot].float()
        ff = f[:, None]  # [S, 1, half, 2, 2]
        first = ff[..., 0, 0] * a[0] + ff[..., 0, 1] * b[0]
        second = ff[..., 1, 0] * a[0] + ff[..., 1, 1] * b[0]
        x[..., :half].copy_(first[None].to(x.dtype))
        x[..., half:rot].copy_(second[None].to(x.dtype))
        x[..., rot:].copy_(xn[..., rot:])
    return q, k


def operand_mismatches(got: dict, expected: dict) -> dict:
    """Per operand name, how many elements differ (fp8 compared as bytes), or the shapes when they differ."""
    out = {}
    for key, e in expected.items():
        a = got[key]
        if a.dtype == torch.float8_e4m3fn:
            a, e = a.view(torch.uint8), e.view(torch.uint8)
        out[key] = int((a != e).sum().item()) if a.shape == e.shape else f"shape {list(a.shape)} vs {list(e.shape)}"
    return out
