"""W4A8 linears (comfy-kitchen's ``AsymW4A8Int8Layout``: grouped int4 or int6 codes, per-group scales ``s_rel``, a
per-channel ``s_channel``) on the int8 route. comfy-kitchen's ``w4a8_int8_linear`` decodes the codes to an int8 grid,
then runs its ConvRot int8 linear with ``s_channel`` as the weight scale (quantising 512 rows or more with the
convrot64 kernel the pack mirrors); here its own decode runs, then the pack's int8 linear. Whether its chunked
decode-and-GEMM kernel gives the pack's bits is checked on each device and form at first use. The int8 weight is
decoded per call and freed after the GEMM: cached per layer it would triple the resident bytes the format saves."""

from __future__ import annotations

import importlib

import torch

from . import gpu, int8_linear
from .kitchen import installed_release, kitchen_cuda

LAYOUT = "AsymW4A8Int8Layout"
READ_RELEASES = ("0.2.40",)  # the releases whose w4a8_int8_linear dispatch this mirrors (read from their code)
# fewer rows: comfy-kitchen runs its GEMV (up to 8 rows) or its fused chunked linear, with a quantiser of its own
MIN_ROWS = 512
GROUP_SIZE = 16  # the layout's default group, the one the bits check samples


def operands(weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], fp32 per-channel scale [N]) of a W4A8 ``QuantizedTensor``, by comfy-kitchen's private
    decode: its CUDA backend's on a GPU (the bits check covers it), its eager backend's elsewhere."""
    p = weight._params
    cuda = kitchen_cuda()[0] if weight._qdata.is_cuda else None
    module = cuda or importlib.import_module("comfy_kitchen.backends.eager.w4a8_int8")
    return module._dequant_int4_grouped_to_int8(weight._qdata, p.scale, p.codebook, p.group_size), p.s_channel


def weight_problem(x: torch.Tensor, weight, bias) -> str | None:
    """Why stock's call keeps a W4A8 ``weight`` (as cast) on rows like ``x`` (None: the route takes it)."""
    p, version = weight._params, installed_release()[0]
    k = p.scale.shape[-1] * p.group_size
    if version not in READ_RELEASES:
        return f"comfy-kitchen {version}'s W4A8 linear is not one the route mirrors ({', '.join(READ_RELEASES)})"
    if p.mma_packed or p.transposed:
        return "a W4A8 weight packed for comfy-kitchen's GEMV kernels, or transposed: its own kernels run it"
    if p.correction is not None:
        return "an asymmetric W4A8 weight: comfy-kitchen adds its correction after a GEMM on another quantiser"
    if p.scale.dtype != torch.float8_e4m3fn:
        return f"{p.scale.dtype} W4A8 group scales: comfy-kitchen quantises for them with another ConvRot kernel"
    if p.group_size != GROUP_SIZE or p.convrot_groupsize != int8_linear.GROUP:
        return f"W4A8 groups of {p.group_size} with ConvRot groups of {p.convrot_groupsize}: a form not checked"
    if x.dim() != 2 or x.shape[-1] != k or p.orig_dtype != x.dtype:
        return f"a W4A8 weight for {k}-wide {p.orig_dtype} rows called on {x.dtype} {tuple(x.shape)}"
    try:
        cuda = kitchen_cuda()[0]
        kwargs = dict(x=x, qdata=weight._qdata, s_rel=p.scale, s_channel=p.s_channel, codebook=p.codebook, bias=bias,
                      group_size=p.group_size, convrot_groupsize=p.convrot_groupsize, out_dtype=x.dtype)
        if importlib.import_module("comfy_kitchen").registry.get_capable_backend("w4a8_int8_linear", kwargs) != "cuda":
            return "comfy-kitchen would not run its CUDA w4a8_int8_linear for this call"
        if not (cuda._W4A8_CHUNKED and cuda._w4a8_fast_act_ok(x, MIN_ROWS, k, p.convrot_groupsize)):
            return "comfy-kitchen would not quantise these rows with its convrot64 kernel"
    except Exception as exc:  # an internal that moved: stock's call is the safe answer
        return f"comfy-kitchen's w4a8_int8_linear could not be inspected ({gpu.failure_text(exc)})"
    form = (weight._qdata.shape[1] * 8 // k, p.codebook is not None)  # (bits, a codebook)
    return gpu.ANSWERS.decide(f"w4a8_bits {form}", x.device, lambda: _bits_problem(x.device, *form))


def rows_problem(x: torch.Tensor) -> str | None:
    """What about this one call of a routed W4A8 layer keeps stock's (None: nothing)."""
    if x.shape[0] < MIN_ROWS:
        return (f"{x.shape[0]} rows: comfy-kitchen {installed_release()[0]} runs its fused W4A8 kernels for fewer "
                f"than {MIN_ROWS} rows, with a quantiser of its own")
    return int8_linear.int8_rows_problem(x)


def _bits_problem(device, bits: int, codebook: bool) -> str | None:
    """comfy-kitchen's ``w4a8_int8_linear`` against the route on one random sample of a form (H3's width, a bias)."""
    ck = importlib.import_module("comfy_kitchen")
    g = torch.Generator(device=device).manual_seed(0)
    x = (2 * torch.randn(MIN_ROWS + 77, 5376, generator=g, device=device)).bfloat16()
    w, bias = torch.randn(256, 5376, generator=g, device=device), torch.randn(256, generator=g, device=device)
    sample = f"{x.shape[0]} x 5376 -> 256, {bits}-bit{' with a codebook' if codebook else ''}"
    try:
        qdata, s_rel, s_channel, _, table = ck.quantize_w4a8_int8_weight(w.bfloat16(), bits=bits, codebook=codebook)
        want = ck.w4a8_int8_linear(x, qdata, s_rel, s_channel, table, bias=bias.bfloat16(), out_dtype=x.dtype)
        int8_weight = kitchen_cuda()[0]._dequant_int4_grouped_to_int8(qdata, s_rel, table, GROUP_SIZE)
        got = int8_linear.int8_linear_routed(x, int8_weight, s_channel, bias.bfloat16(),
                                             kernel=int8_linear.choice(device, 5376, 256))
    except Exception as exc:  # whatever broke, stock's call is the safe answer
        return f"the W4A8 bits check on {sample} failed: {gpu.failure_text(exc)}"
    if got is None:
        return f"the W4A8 bits check on {sample}: CUTLASS declined the shape"
    differ = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    return None if differ == 0 else f"{differ} of {want.numel()} outputs differ from comfy-kitchen's on {sample}"
