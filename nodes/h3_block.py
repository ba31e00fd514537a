"""MiniMax H3: the block fast path, each DiT block's forward replaced on the clone by stock's computation in
stock's order with stock's bits: one-pass modulation, the normed input handed to this pack's attention (freed
after the qkv projection), the MLP half in token chunks where rows are independent and no weight would be
transferred twice (fc1's [S, 2*ffn] output never exists whole), int8 ConvRot linears on the pack's quantiser
(int8_layers.py). docs/ARCHITECTURE.md has the details."""

from __future__ import annotations

import inspect
import sys

import comfy.model_management
import comfy.ops
import torch

from .. import kernels
from . import int8_layers
from .ownership import is_own, replaced_forward

BLOCK_PARAMS = ("self", "x", "t_emb", "mod_segments", "rope_freqs", "transformer_options")
# the module-level helpers stock's block forward uses, whose semantics the fast path reproduces
STOCK_HELPERS = ("_mod_scale_shift", "_mod_gate")
# what a block or MLP forward would pass ``comfy.ops.linear_input_act`` (ComfyUI 0.36+) to fuse a norm into the
# quantiser or the residual into the GEMM epilogue: a fused block rounds differently from the unfused one the fast
# path reproduces (stock H3 passes none of them up to the current upstream model)
FUSED_LINEAR_ARGS = ("act_weight", "act_eps", "residual", "residual_scale", "rms_norm", "gelu_tanh")
# activation dtypes whose MLP GEMMs give the same bits split by rows (int8: per-row quantiser, integer
# GEMM; bf16: checked by tests/gpu; fp16 taken to behave as bf16)
CHUNKED_DTYPES = (torch.bfloat16, torch.float16)
# devices whose GEMMs give each output row from its own input row whatever the row count: CUDA's.
# oneDNN's CPU GEMMs do not (bf16 on AMX), so on the CPU the MLP and the qkv projection run whole.
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
    for where, fn in (("MLP.forward", getattr(type(mlp), "forward", None)), ("forward", type(block).forward)):
        if fused := fused_linear_arguments(fn):
            problems.append(f"{where} fuses into its linears ({', '.join(fused)}), which the fast path does not")
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


def fused_linear_arguments(fn) -> list[str]:
    """The ``FUSED_LINEAR_ARGS`` that ``fn``'s code names (keyword names and string constants included)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    consts = [c for c in code.co_consts if isinstance(c, str)]
    consts += [n for c in code.co_consts if isinstance(c, tuple) for n in c if isinstance(n, str)]
    return [a for a in FUSED_LINEAR_ARGS if a in consts or a in code.co_names]


def pending_modulation(h, shift, scale, segments) -> kernels.PendingModulation:
    """Stock's ``_mod_scale_shift`` of ``h`` (same expressions), owed: its parameters per segment."""
    return kernels.PendingModulation(h, [(a, b, 1.0 + scale[row].to(h.dtype), shift[row].to(h.dtype))
                                     for a, b, row in segments])


def gated_residual(x, gate, other, segments):
    """Stock's ``_mod_gate``: ``x += other * gate`` per segment, in place, one pass each (stock's bits)."""
    for a, b, row in segments:
        kernels.gated_residual_(x[a:b], other[a:b], gate[row].to(x.dtype))
    return x


def weight_stays_on_device(layer, device) -> bool:
    """Calling ``layer`` again within one block transfers no weight again: its weight lies on ``device``, or
    it is a DynamicVRAM layer (``_v``: its pages stay resident between calls). Not with a weight function."""
    if getattr(layer, "weight_function", None):
        return False
    return getattr(layer.weight, "device", None) == device or hasattr(layer, "_v")


ROWWISE_LAYOUTS = (int8_layers.INT8_LAYOUT,)  # quantised layouts whose activation quantiser works row by row


def rows_independent(layer) -> bool:
    """Each output row of ``layer`` depends on its own input row only: float, int8 tensor-wise (per-row
    quantiser), weight-only or fixed-``input_scale`` weights; not a scale taken from the whole input."""
    weight = getattr(layer, "weight", None)
    quantized = getattr(comfy.ops, "QuantizedTensor", None)
    if quantized is None or not isinstance(weight, quantized):
        return True
    quantizes_input = getattr(comfy.ops, "QUANT_ALGOS", {}).get(getattr(layer, "quant_format", None), {}).get(
        "quantize_input", True)
    return (getattr(weight, "_layout_cls", None) in ROWWISE_LAYOUTS or not quantizes_input
            or getattr(layer, "input_scale", None) is not None)


def chunkable(x, *layers) -> bool:
    """Calling ``layers`` on token chunks of ``x`` gives the whole call's bits at no extra cost (fp16/bf16 on
    ``CHUNKED_DEVICES``, rows independent, weights that stay on the device)."""
    return x.dtype in CHUNKED_DTYPES and x.device.type in CHUNKED_DEVICES and all(
        not replaced_forward(m) and rows_independent(m) and weight_stays_on_device(m, x.device) for m in layers)


def int8_tensorwise(layer) -> bool:
    return int8_layers.is_int8_tensorwise(getattr(layer, "weight", None))


def mlp_chunk_setting(settings, mlp) -> int:
    """The settings' rows per MLP chunk for this MLP's weight format (fc1's: the larger GEMM)."""
    return settings.int8_mlp_chunk_tokens if int8_tensorwise(mlp.fc1) else settings.mlp_chunk_tokens


def mlp_chunk_rows(mlp, x, chunk: int) -> int | None:
    """Rows per MLP chunk, or None: the MLP runs whole (or another node's MLP forward runs as it is)."""
    if replaced_forward(mlp) or not chunkable(x, mlp.fc1, mlp.fc2):
        return None
    return chunk if x.shape[0] > chunk else None


def column_products(linear, x, inner: int):
    """``(project_q, project_kv)`` for ``kernels.RowProjection`` when ``linear`` is the plain product
    ``x @ weight.T`` (nothing cast or patched per call), whose column blocks give its bits; else None."""
    w = getattr(linear, "weight", None)
    if (type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dtype != x.dtype or w.device != x.device
            or w.dim() != 2 or w.shape[0] != 3 * inner or getattr(linear, "bias", None) is not None
            or getattr(linear, "weight_function", None) or getattr(linear, "bias_function", None)
            or getattr(linear, "comfy_cast_weights", False) or replaced_forward(linear)):
        return None
    return (lambda rows: torch.nn.functional.linear(rows, w[:inner]),
            lambda rows: torch.mm(rows, w[inner:].t()))


def projection_chunk_rows(linear, x, chunk: int) -> int | None:
    """Rows per qkv-projection chunk, or None: project whole (torch.compile, bits at risk, one chunk)."""
    if torch.compiler.is_compiling() or not chunkable(x, linear):
        return None
    return chunk if x.shape[0] > chunk else None


def folds_swiglu(linear) -> bool:
    """``comfy.ops.linear_input_act`` folds SwiGLU into this linear's int8 activation quantiser (its conditions)."""
    return (not comfy.model_management.in_training and int8_tensorwise(linear)
            and not getattr(getattr(linear.weight, "_params", None), "transposed", False))


def mlp_forward(mlp, h, linear):
    """Stock's ``MLP.forward(h)``: fc1, SwiGLU (folded into fc2's quantiser, or one pass with stock's
    bits), fc2; each linear through ``linear(layer, x, input_act=None)`` (int8_layers.caller)."""
    u = linear(mlp.fc1, h)
    if folds_swiglu(mlp.fc2):
        return linear(mlp.fc2, u, "swiglu")
    return linear(mlp.fc2, kernels.swiglu(u))


class H3BlockForward:
    """Replacement for one H3 ``DiTBlock.forward`` (0.33's arguments and current upstream's ``attention=``)."""

    sage_strided_nhd = True  # ownership mark (see ownership.py)

    def __init__(self, block, patch):
        self.block = block
        self.patch = patch

    def __call__(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        blk = self.block
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = blk.adaln_proj(t_emb)
        # the modulation owed: the qkv projection's int8 quantiser applies it where it takes the call
        handed = [pending_modulation(blk.norm1(x), shift_msa, scale_msa, mod_segments)]
        if attention is None and is_own(vars(blk.attn).get("forward")):
            out = blk.attn(handed, rope_freqs=rope_freqs, transformer_options=transformer_options)
        else:  # a block replace's attention, or another node's attention forward: a tensor, as stock hands it
            out = (attention or blk.attn)(kernels.settled(handed.pop()), rope_freqs=rope_freqs,
                                          transformer_options=transformer_options)
        x = gated_residual(x, gate_msa, out, mod_segments)
        del out
        return self._mlp_half(x, shift_mlp, scale_mlp, gate_mlp, mod_segments)

    def _mlp_half(self, x, shift, scale, gate, segments):
        """``x += mlp(modulate(norm2(x))) * gate``, by token chunks where they give the same bits. The MLP's
        input goes as its normed rows with the modulation still owed (fc1's int8 quantiser applies it)."""
        blk = self.block
        chunk = mlp_chunk_rows(blk.mlp, x, mlp_chunk_setting(self.patch.settings, blk.mlp))
        linear = int8_layers.caller(self.patch.settings, self.patch.report)
        if chunk is None:
            h = pending_modulation(blk.norm2(x), shift, scale, segments)
            y = blk.mlp(kernels.settled(h)) if replaced_forward(blk.mlp) else mlp_forward(blk.mlp, h, linear)
            return gated_residual(x, gate, y, segments)
        for a, b in kernels.token_chunks(x.shape[0], chunk):
            segs = kernels.clip_segments(segments, a, b)
            h = pending_modulation(blk.norm2(x[a:b]), shift, scale, segs)
            y = mlp_forward(blk.mlp, h, linear)
            del h
            gated_residual(x[a:b], gate, y, segs)
        return x


def block_keys(diffusion_model) -> list[str]:
    return [f"diffusion_model.blocks.{i}.forward" for i in range(len(diffusion_model.blocks))]

