"""comfy-kitchen's CUDA int8 activation quantiser with ConvRot (``quantize_int8_rowwise_convrot64``,
which stock's int8 tensor-wise linears run on an NVIDIA GPU), step by step in torch: the reference the
pack's own quantiser (kernels/int8_activation.py) is tested against on the CPU.

comfy-kitchen builds its CUDA kernels with ``--use_fast_math``: a division is ``a * rcp(b)``, ``expf``
is ``exp2`` of ``x * log2(e)``, both approximate on the GPU. Here they are the IEEE reciprocal and a
correctly rounded ``exp2``, as the pack's kernel computes them under the interpreter; on the GPU the
two kernels are compared directly (tests/gpu/test_int8_activation_gpu.py)."""

from __future__ import annotations

import torch

GROUP = 256
BF16_MAX = 3.38953139e38
INV_127 = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(127.0, dtype=torch.float32)
LOG2E = 1.4426950408889634


def bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest bf16 (ties to even), as fp32."""
    return x.to(torch.bfloat16).float()


def swiglu_fp32(u: torch.Tensor) -> torch.Tensor:
    """The quantiser's folded SwiGLU on ``u = [gate | up]``: fp32 throughout, never rounded to bf16."""
    gate, up = u.float().chunk(2, dim=-1)
    e = torch.exp2((-gate * LOG2E).double()).float()  # ex2 of the fp32 product, correctly rounded
    return gate * torch.reciprocal(1.0 + e) * up


def h4_stage(x: torch.Tensor, stride: int) -> torch.Tensor:
    """One radix-4 butterfly of the fast Hadamard transform on [rows, 256] fp32, over the base-4 digit
    of ``stride``: output d of each quadruple is 0.5 * (row d of H4 . (x0, x1, x2, x3)), the sums taken
    left to right as the CUDA source writes them."""
    rows = x.shape[0]
    t = x.reshape(rows, GROUP // (4 * stride), 4, stride)
    x0, x1, x2, x3 = t.unbind(2)
    y = torch.stack([((x0 + x1) + x2) - x3, ((x0 + x1) - x2) + x3, ((x0 - x1) + x2) + x3,
                     ((-x0 + x1) + x2) + x3], dim=2) * 0.5
    return y.reshape(rows, GROUP)


def convrot(x: torch.Tensor) -> torch.Tensor:
    """[m, k] fp32 -> each 256-wide group rotated by H256 = (1/16) H4 x H4 x H4 x H4, fp32."""
    m, k = x.shape
    g = x.reshape(m * (k // GROUP), GROUP)
    for stride in (1, 4, 16, 64):
        g = h4_stage(g, stride)
    return g.reshape(m, k)


def quantize_rows_convrot(x: torch.Tensor, input_act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [m, k], fp32 scales [m, 1]) as comfy-kitchen's CUDA convrot64 quantiser makes them from bf16
    ``x`` [m, k] (``input_act="swiglu"``: [m, 2k], SwiGLU folded in)."""
    if x.dtype != torch.bfloat16:
        raise ValueError("the oracle models bf16 activations")
    a = swiglu_fp32(x) if input_act == "swiglu" else x.float()
    y = convrot(a)
    absmax = y.abs().amax(dim=1, keepdim=True)
    scale = torch.clamp(torch.clamp(absmax, max=BF16_MAX) * INV_127, min=1e-30)
    scale_t = bf16(scale)
    quotient = bf16(bf16(y) * torch.reciprocal(scale_t))
    q = torch.clamp(torch.round(quotient), -128, 127)  # round: half to even, as nearbyintf
    return q.to(torch.int8), scale


def int8_linear(xq: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The int8 GEMM with its dequantising epilogue, on the CPU: exact int32 (int64 here) products, then
    ``acc * x_scale * w_scale (+ bias)`` in fp32, rounded to ``out_dtype``. A stand-in for the GPU GEMM
    in CPU tests of the wiring around it (its epilogue's own bits are the GPU tests' concern)."""
    acc = (xq.long() @ w_q.long().t()).float()
    y = acc * x_scale.float() * w_scale.float().reshape(1, -1).expand(1, w_q.shape[0])
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def gemm_epilogue(acc: torch.Tensor, x_scale, w_scale, bias=None) -> torch.Tensor:
    """The int8 GEMM's epilogue as CUTLASS takes it (kernels/int8_gemm.py): ``acc * x_scale`` in fp32, then
    ``* w_scale + bias`` rounded once (an FMA; through fp64 here), bf16. Tied to CUTLASS's output in tests/gpu."""
    m, n = acc.shape
    t = acc.float() * x_scale.reshape(m, 1).float()
    ws = w_scale.float().reshape(1, -1)
    if bias is None:
        return (t * ws).to(torch.bfloat16)
    return (t.double() * ws.double() + bias.to(torch.bfloat16).double().reshape(1, n)).float().to(torch.bfloat16)


def cuda_int8_linear(x, weight, weight_scale, bias=None, out_dtype=None, convrot=False, convrot_groupsize=256,
                     input_act=None, **extended):
    """comfy-kitchen's CUDA ``int8_linear`` (stock's int8 ConvRot call on a GPU) in torch: the quantiser above, then
    the exact integer GEMM with its epilogue. ``extended`` (0.2.36+: act weight/eps, residual) must be defaults."""
    assert convrot and convrot_groupsize == GROUP and all(v is None or v == 0.0 for v in extended.values())
    flat = x.reshape(-1, x.shape[-1])
    q, s = quantize_rows_convrot(flat, input_act)
    y = int8_linear(q, s, weight, weight_scale, bias, out_dtype or x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def stand_in_for_cuda_int8_linear(comfy_kitchen) -> None:
    """Make comfy-kitchen's registry answer ``int8_linear`` with ``cuda_int8_linear`` (a CPU has no CUDA one)."""
    registry = comfy_kitchen.registry
    lookup = registry.get_implementation
    registry.get_implementation = lambda name, kwargs=None: (
        cuda_int8_linear if name == "int8_linear" else lookup(name, kwargs=kwargs))


def declining_gemm(declines: set, ran: list | None = None):
    """The route's GEMM (``kernels.int8_gemm.gemm``'s arguments, looked up as ``kernels.int8_linear.gemm``) as
    ``int8_linear``, declining as CUTLASS may a shape: None for an output width in ``declines``, or, with "k" in it,
    for a fused qkv weight's K rows (a slice that starts its own size into the weight: rows [inner, 2 * inner)).
    ``ran``: each GEMM's output width. A ``residual`` (``PendingResidual``) gets the product added as stock's
    ``addcmul_`` adds it, in the "epilogue" where it folds, else by its own pass, and ``residual.x`` is returned."""
    def gemm(xq, xs, qdata, w_scale, bias, out_dtype, residual=None, *, kernel):
        k_rows = qdata.storage_offset() == qdata.shape[0] * qdata.shape[1] > 0
        if qdata.shape[0] in declines or (k_rows and "k" in declines):
            return None
        if ran is not None:
            ran.append(qdata.shape[0])
        out = int8_linear(xq, xs, qdata, w_scale, bias, out_dtype)
        if residual is None or not residual.foldable:
            return out if residual is None else residual.apply(out)
        for a, b, gate in residual.claim():
            residual.x[a:b].addcmul_(out[a:b], gate)
        return residual.x
    return gemm
