"""MiniMax H3: the block fast path. Each DiT block's forward is replaced, on the clone, by one that
computes what stock's computes, in stock's order and with stock's bits:

- modulation (``h.mul_(1 + scale).add_(shift)``) in one pass per segment (kernels.h3_block),
- the normed block input handed to this pack's attention in a list, so it is freed after the qkv
  projection; an ``attention=`` passed by a block replace (core Model Sparse Attention) runs instead,
- the MLP half (norm2, modulation, fc1, SwiGLU, fc2, gated residual) in token chunks, so fc1's
  [S, 2*ffn] output never exists whole. Rows are independent there (RMSNorm and the int8
  activation quantiser are per row), so chunking changes no bit. Not chunked when each chunk would
  transfer the MLP weights again (offloaded to the CPU outside DynamicVRAM) or when another node
  replaced the MLP forward (KJNodes' Chunk FeedForward): that forward runs as it is.
- int8 ConvRot linears (the bundled checkpoint's qkv, out, fc1 and fc2): their input quantised by
  the pack's pass with comfy-kitchen's bits, then comfy-kitchen's GEMM (nodes/int8_layers.py).

``block_path="fused"`` merges more than stock's bits allow (kernels.h3_block_fused): each RMSNorm
with its modulation in one pass, the attention half's gated residual with the MLP half's norm, and
(bf16 weights) SwiGLU in one pass. A norm the kernels cannot take (weights cast on the fly, LoRA
weight functions, another node's forward) runs as the exact path runs it.
"""

from __future__ import annotations

import inspect
import sys

import comfy.model_management
import comfy.ops
import torch

from ..kernels import h3_block as ops
from ..kernels import h3_block_fused as fused_ops
from . import conflicts, int8_layers
from .conflicts import replaced_forward

BLOCK_PARAMS = ("self", "x", "t_emb", "mod_segments", "rope_freqs", "transformer_options")
# the module-level helpers stock's block forward uses, whose semantics the fast path reproduces
STOCK_HELPERS = ("_mod_scale_shift", "_mod_gate")
# activation dtypes whose MLP GEMMs give the same bits split by rows (int8 weights: per-row
# quantiser, integer GEMM; bf16: tests/gpu/test_block_path_gpu.py checks it on the GPU; fp16 is
# taken to behave as bf16 there, not measured)
CHUNKED_DTYPES = (torch.bfloat16, torch.float16)
# devices whose GEMMs give each output row from its own input row whatever the number of rows: CUDA's
# (the GPU test above). oneDNN's CPU GEMMs do not (bf16 on an AMX Xeon: rows change with the row
# count), so on the CPU the MLP and the qkv projection run whole, as stock runs them.
CHUNKED_DEVICES = ("cuda",)


def structure_problems(block) -> list[str]:
    """What differs from the DiT block the fast path was written for (empty: it matches)."""
    problems = [f"no {name}" for name in ("adaln_proj", "norm1", "norm2", "attn", "mlp")
                if getattr(block, name, None) is None]
    mlp = getattr(block, "mlp", None)
    problems += [f"no mlp.{name}.weight" for name in ("fc1", "fc2")
                 if getattr(getattr(mlp, name, None), "weight", None) is None]
    if mlp is not None and "linear_input_act" not in type(mlp).forward.__code__.co_names:
        problems.append("MLP.forward no longer calls comfy.ops.linear_input_act")
    params = tuple(inspect.signature(type(block).forward).parameters)
    if params not in (BLOCK_PARAMS, BLOCK_PARAMS + ("attention",)):
        problems.append(f"forward{params} differs from forward{BLOCK_PARAMS}[+attention]")
    module = sys.modules.get(type(block).__module__)
    names = getattr(type(block).forward, "__code__", None)
    missing = [n for n in STOCK_HELPERS if getattr(module, n, None) is None
               or n not in getattr(names, "co_names", ())]
    if missing:
        problems.append(f"the block forward no longer uses {', '.join(missing)}")
    return problems


def pending_modulation(h, shift, scale, segments) -> ops.PendingModulation:
    """Stock's ``_mod_scale_shift`` of ``h`` (same expressions), owed: its parameters per segment."""
    return ops.PendingModulation(h, [(a, b, 1.0 + scale[row].to(h.dtype), shift[row].to(h.dtype))
                                     for a, b, row in segments])


def modulate(h, shift, scale, segments):
    """Stock's ``_mod_scale_shift`` (same expressions, same bits), one pass per segment."""
    return pending_modulation(h, shift, scale, segments).apply()


def gated_residual(x, gate, other, segments):
    """Stock's ``_mod_gate``: ``x += other * gate`` per segment, in place (one vectorised pass each,
    stock's bits)."""
    for a, b, row in segments:
        ops.gated_residual_(x[a:b], other[a:b], gate[row].to(x.dtype))
    return x


def weight_stays_on_device(layer, device) -> bool:
    """Calling ``layer`` again within one block costs no second weight transfer: its weight lies on
    ``device``, or it is a DynamicVRAM layer (current ComfyUI with comfy-aimdo: ``_v`` is its slot in
    the VRAM buffer, its ``weight`` stays on the CPU, and a repeat call finds the pages the first call
    faulted in still resident and copies nothing). A weight function (LoRA hook) would run per call."""
    if getattr(layer, "weight_function", None):
        return False
    return getattr(layer.weight, "device", None) == device or hasattr(layer, "_v")


# quantised layouts whose activation quantiser works row by row
ROWWISE_LAYOUTS = (int8_layers.INT8_LAYOUT,)


def rows_independent(layer) -> bool:
    """Each output row of ``layer`` depends on its own input row only: float weights, int8 tensor-wise
    weights (a per-row activation quantiser), weight-only quantisation, or a fixed activation scale
    (``input_scale``). A per-tensor scale taken from the whole input (fp8 or nvfp4 without
    ``input_scale``) depends on every row, so token chunks would change its bits."""
    weight = getattr(layer, "weight", None)
    quantized = getattr(comfy.ops, "QuantizedTensor", None)
    if quantized is None or not isinstance(weight, quantized):
        return True
    quantizes_input = getattr(comfy.ops, "QUANT_ALGOS", {}).get(getattr(layer, "quant_format", None), {}).get(
        "quantize_input", True)
    return (getattr(weight, "_layout_cls", None) in ROWWISE_LAYOUTS or not quantizes_input
            or getattr(layer, "input_scale", None) is not None)


def chunkable(x, *layers) -> bool:
    """Calling ``layers`` on token chunks of ``x`` gives the whole call's bits at no extra cost: fp16/bf16
    activations (fp32 GEMMs split by rows need not give the same bits: measured on the CPU) on a device
    of ``CHUNKED_DEVICES``, every output row from its own input row, weights that stay on the device
    (no transfer per chunk)."""
    return x.dtype in CHUNKED_DTYPES and x.device.type in CHUNKED_DEVICES and all(
        not replaced_forward(m) and rows_independent(m) and weight_stays_on_device(m, x.device) for m in layers)


def int8_tensorwise(layer) -> bool:
    return int8_layers.is_int8_tensorwise(getattr(layer, "weight", None))


def mlp_chunk_setting(settings, mlp) -> int:
    """The settings' rows per MLP chunk for this MLP's weight format (fc1's: the larger GEMM)."""
    return settings.int8_mlp_chunk_tokens if int8_tensorwise(mlp.fc1) else settings.mlp_chunk_tokens


def mlp_chunk_rows(mlp, x, chunk: int) -> int | None:
    """Rows per MLP chunk, or None when the MLP must run whole as the model has it (another node's MLP
    forward runs as it is)."""
    if replaced_forward(mlp) or not chunkable(x, mlp.fc1, mlp.fc2):
        return None
    return chunk if x.shape[0] > chunk else None


def column_products(linear, x, inner: int):
    """``(project_q, project_kv)`` for ``kernels.RowProjection`` when ``linear``'s output is the
    plain product ``x @ weight.T`` (a float weight of x's dtype on x's device, no bias, nothing cast or
    patched per call): Q is its first ``inner`` output columns, K and V the rest. Column blocks of
    that product give its bits (benchmarks/projection_split.py checks it on the GPU). Else None."""
    w = getattr(linear, "weight", None)
    if (type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dtype != x.dtype or w.device != x.device
            or w.dim() != 2 or w.shape[0] != 3 * inner or getattr(linear, "bias", None) is not None
            or getattr(linear, "weight_function", None) or getattr(linear, "bias_function", None)
            or getattr(linear, "comfy_cast_weights", False) or replaced_forward(linear)):
        return None
    return (lambda rows: torch.nn.functional.linear(rows, w[:inner]),
            lambda rows: torch.mm(rows, w[inner:].t()))


def projection_chunk_rows(linear, x, chunk: int) -> int | None:
    """Rows per chunk of the attention's qkv projection, or None: project whole (under torch.compile,
    which traces the projection; when chunks could change its bits; within one chunk)."""
    if torch.compiler.is_compiling() or not chunkable(x, linear):
        return None
    return chunk if x.shape[0] > chunk else None


def fused_norm_takes(norm, x) -> bool:
    """The fused passes can stand in for ``norm``: stock's RMSNorm forward, its weight (if any, any
    float dtype: the passes read it in fp32) resident on x's device, nothing patched onto it."""
    w = getattr(norm, "weight", None)
    return (not replaced_forward(norm) and not getattr(norm, "weight_function", None)
            and not getattr(norm, "bias_function", None) and getattr(norm, "bias", None) is None
            and len(getattr(norm, "normalized_shape", ())) == 1 and x.dtype in fused_ops.FUSED_DTYPES
            and (w is None or (w.device == x.device and w.dtype.is_floating_point
                               and type(w) in (torch.Tensor, torch.nn.Parameter))))


def norm_eps(norm, x) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps  # torch's rms_norm default


def fused_norm_modulate(norm, x, shift, scale, segments, other=None, gate=None):
    """``modulate(norm(x))`` (after ``x += other * gate`` when given) by the fused passes, per segment."""
    h = torch.empty_like(x)
    eps = norm_eps(norm, x)
    for a, b, row in segments:
        params = (norm.weight, scale[row].to(x.dtype), shift[row].to(x.dtype), eps, h[a:b])
        if other is None:
            fused_ops.norm_modulate(x[a:b], *params)
        else:
            fused_ops.residual_norm_modulate_(x[a:b], other[a:b], gate[row].to(x.dtype), *params)
    return h


def folds_swiglu(linear) -> bool:
    """``comfy.ops.linear_input_act`` folds the activation into this linear's int8 activation quantiser
    (its own conditions); otherwise it applies the eager SwiGLU and then the linear."""
    return (not comfy.model_management.in_training and int8_tensorwise(linear)
            and not getattr(getattr(linear.weight, "_params", None), "transposed", False))


def mlp_down(mlp, u, fused: bool, linear):
    """fc2(SwiGLU(u)) as stock's MLP.forward: ``linear_input_act`` where it folds SwiGLU into fc2's int8
    activation quantiser; else SwiGLU in one pass (stock's bits, or one rounding in fused mode), then
    fc2. ``linear(layer, x, input_act=None)`` makes the linear calls (int8_layers.caller)."""
    if folds_swiglu(mlp.fc2):
        return linear(mlp.fc2, u, "swiglu")
    return linear(mlp.fc2, fused_ops.swiglu(u) if fused else ops.swiglu(u))


def mlp_forward(mlp, h, fused: bool, linear):
    """Stock's ``MLP.forward(h)``: fc1, SwiGLU, fc2, each linear through ``linear``."""
    return mlp_down(mlp, linear(mlp.fc1, h), fused, linear)


class H3BlockForward:
    """Replacement for one H3 ``DiTBlock.forward`` (0.33's arguments and current upstream's
    ``attention=``); the installed patch's settings give the MLP chunk size."""

    sage_strided_nhd = True  # ownership mark (see conflicts.py)

    def __init__(self, block, patch):
        self.block = block
        self.patch = patch

    def __call__(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        blk = self.block
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = blk.adaln_proj(t_emb)
        fused = self.patch.settings.block_path == "fused"
        if fused and fused_norm_takes(blk.norm1, x):
            handed = [fused_norm_modulate(blk.norm1, x, shift_msa, scale_msa, mod_segments)]
        else:  # the modulation owed: the qkv projection's int8 quantiser applies it where it takes the call
            handed = [pending_modulation(blk.norm1(x), shift_msa, scale_msa, mod_segments)]
        if attention is None and conflicts.is_own(vars(blk.attn).get("forward")):
            out = blk.attn(handed, rope_freqs=rope_freqs, transformer_options=transformer_options)
        else:  # a block replace's attention, or another node's attention forward: a tensor, as stock hands it
            out = (attention or blk.attn)(ops.settled(handed.pop()), rope_freqs=rope_freqs,
                                          transformer_options=transformer_options)
        if fused and fused_norm_takes(blk.norm2, x) and out.shape == x.shape and out.stride(-1) == 1:
            h = fused_norm_modulate(blk.norm2, x, shift_mlp, scale_mlp, mod_segments, other=out, gate=gate_msa)
            del out
            return self._mlp_half(x, gate_mlp, mod_segments, lambda a, b, segs: h[a:b], fused=True)
        x = gated_residual(x, gate_msa, out, mod_segments)
        del out
        # the modulation owed: fc1's int8 quantiser applies it where it takes the call
        return self._mlp_half(x, gate_mlp, mod_segments, lambda a, b, segs: pending_modulation(
            blk.norm2(x[a:b]), shift_mlp, scale_mlp, segs), fused)

    def _mlp_half(self, x, gate, segments, mlp_input, fused: bool):
        """``x += mlp(mlp_input(a, b, segments of a:b)) * gate``, by token chunks where they give the same bits
        (``mlp_input``: the MLP's input, or its normed rows with the modulation still owed)."""
        blk = self.block
        chunk = mlp_chunk_rows(blk.mlp, x, mlp_chunk_setting(self.patch.settings, blk.mlp))
        linear = int8_layers.caller(self.patch.settings, self.patch.report)
        if chunk is None:
            h = mlp_input(0, x.shape[0], segments)
            y = blk.mlp(ops.settled(h)) if replaced_forward(blk.mlp) else mlp_forward(blk.mlp, h, fused, linear)
            return gated_residual(x, gate, y, segments)
        for a, b in ops.token_chunks(x.shape[0], chunk):
            segs = ops.clip_segments(segments, a, b)
            h = mlp_input(a, b, segs)
            y = mlp_forward(blk.mlp, h, fused, linear)
            del h
            gated_residual(x[a:b], gate, y, segs)
        return x


def block_keys(diffusion_model) -> list[str]:
    return [f"diffusion_model.blocks.{i}.forward" for i in range(len(diffusion_model.blocks))]

