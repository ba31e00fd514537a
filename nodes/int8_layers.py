"""A ComfyUI int8 tensor-wise ConvRot linear (the bundled workflows' checkpoint) called as stock calls
it, with its input quantised by the pack's pass (kernels/int8_linear.py): the same bits, less time.

``call(layer, x)`` stands for stock's ``layer(x)``, ``call(layer, u, "swiglu")`` for
``comfy.ops.linear_input_act(layer, u, "swiglu")``. The weight is cast as stock's forward casts it
(resident, offloaded or streamed by DynamicVRAM), once. A layer or a call the route does not take
(another format, a LoRA weight function, another node's forward, training, torch.compile, a
comfy-kitchen release it was not written for) runs stock's call; ``record(problem)`` is told, for
every int8 ConvRot layer, why (None: the pack's quantiser ran)."""

from __future__ import annotations

import functools

import comfy.model_management
import comfy.ops
import torch

from ..kernels import h3_block as block_ops
from ..kernels import int8_linear as route
from . import conflicts

# comfy-kitchen's int8 tensor-wise layout (the bundled checkpoint's): its activation quantiser works row
# by row, and ``linear_input_act`` folds SwiGLU into it
INT8_LAYOUT = "TensorWiseINT8Layout"


def is_int8_tensorwise(weight) -> bool:
    return (isinstance(weight, getattr(comfy.ops, "QuantizedTensor", ()))
            and getattr(weight, "_layout_cls", None) == INT8_LAYOUT)


def is_int8_convrot(weight) -> bool:
    """An int8 tensor-wise weight with ConvRot groups of 256, as stored (not transposed)."""
    params = getattr(weight, "_params", None)
    return (is_int8_tensorwise(weight) and getattr(params, "convrot", False)
            and getattr(params, "convrot_groupsize", None) == route.GROUP and not getattr(params, "transposed", False))


def layer_problem(layer, x, input_act=None) -> str | None:
    """Why ``call`` runs stock's call for the int8 ConvRot ``layer`` on ``x``, known before any cast."""
    if conflicts.replaced_forward(layer):
        return "another node replaced the layer's forward"
    if (getattr(layer, "weight_function", None) or getattr(layer, "bias_function", None)
            or getattr(layer, "pre_quant_scale", None) is not None or getattr(layer, "comfy_force_cast_weights", False)
            or getattr(layer, "_full_precision_mm", False) or getattr(layer, "layout_type", None) is None):
        return "the layer's forward would not run the int8 GEMM on its weight as stored"
    if comfy.model_management.in_training or x.requires_grad:
        return "training"
    if getattr(comfy.ops, "CastBiasWeightContext", None) is None:
        return "this ComfyUI has no comfy.ops.CastBiasWeightContext"
    return route.call_problem(x, input_act=input_act)


def call(layer, x, input_act: str | None = None, record=None) -> torch.Tensor:
    """Stock's ``layer(x)`` (``input_act``: ``comfy.ops.linear_input_act(layer, x, input_act)``), through
    the pack's quantiser where that keeps stock's bits. ``x``: a tensor, or rows owed stock's modulation
    (``kernels.h3_block.PendingModulation``), which the quantiser applies where it takes the call."""
    if torch.compiler.is_compiling() or not is_int8_convrot(getattr(layer, "weight", None)):
        return _stock(layer, x, input_act)  # (stock's int8 linears do not compile; nothing is recorded in a trace)
    x, pending = _owed(x, input_act is None)
    problem = layer_problem(layer, x, input_act)
    if problem is not None:
        _tell(record, problem)
        return _stock(layer, pending if pending is not None else x, input_act)
    if input_act is None:
        _every_op()
        cast = comfy.ops.CastBiasWeightContext(layer, None, dtype=layer.weight.dtype, device=x.device,
                                               bias_dtype=x.dtype, offloadable=True, compute_dtype=x.dtype,
                                               want_requant=True)
    else:  # linear_input_act's cast
        cast = comfy.ops.CastBiasWeightContext(layer, x, offloadable=True, compute_dtype=x.dtype, want_requant=True)
    with cast as (weight, bias):
        if input_act is None:
            weight = weight.to(dtype=x.dtype)
        quantized = is_int8_convrot(weight)
        if quantized:
            qdata, scale = weight._qdata, weight._params.scale
            problem = route.weight_problem(x, qdata, scale, bias, input_act=input_act)  # the call's: checked above
            out = None if problem else route.routed(x, qdata, scale, bias, input_act=input_act,
                                                    modulation=pending.segments if pending is not None else None)
            _tell(record, None if out is not None else problem or "CUTLASS declined the shape")
            if out is not None:
                return out
        else:
            _tell(record, "the cast gave a weight that is not int8 ConvRot")
        x = block_ops.settled(pending) if pending is not None else x  # the modulation owed, applied once
        if quantized and input_act is not None:
            return route.stock_int8_linear(x, qdata, scale, bias, input_act=input_act)
        if input_act is not None:
            x = comfy.ops.INPUT_ACT_EAGER[input_act](x)
        return torch.nn.functional.linear(x, weight, bias)


def quantized_columns(layer, x, inner: int, record=None):
    """The fused qkv projection of the int8 ConvRot ``layer`` by output columns (``kernels.RowProjection``'s
    column form) on ``x`` quantised once: ``(rows, project, columns)``, or None where the route does not
    take it (the projection then goes by rows, each chunk through ``call``). Only for a weight resident
    on x's device without a bias, as the bf16 column form: then stock's forward casts nothing. ``x``: a
    tensor, or rows owed the block's modulation (a ``PendingModulation``), applied by the quantiser."""
    w = getattr(layer, "weight", None)
    pending = x if isinstance(x, block_ops.PendingModulation) and x.foldable else None
    if pending is not None:
        x = pending.rows
    elif isinstance(x, block_ops.PendingModulation):
        return None  # a modulation the pass cannot fold: the caller applies it
    if (not is_int8_convrot(w) or getattr(layer, "bias", None) is not None or hasattr(layer, "_v")
            or w.device != x.device or layer_problem(layer, x) is not None):
        return None
    qdata, scale = w._qdata, w._params.scale
    if qdata.shape[0] != 3 * inner or route.weight_problem(x, qdata, scale, None) is not None:  # the call's: above
        return None
    _every_op()
    rows = route.quantized_rows(x, pending.segments if pending is not None else None)
    _tell(record, None)
    return rows, route.column_products(qdata, scale, 3 * inner)[0], route.column_products(qdata, scale, inner)


def route_on(settings) -> bool:
    """The patch's int8 ConvRot linears take the pack's quantiser: the block fast path is on and
    ``settings.own_int8_quantizer``."""
    return settings.block_path != "attention_only" and settings.own_int8_quantizer


def caller(settings, report):
    """How one patch calls a linear ``(layer, x, input_act=None)``: through ``call`` where ``route_on``,
    else stock's call."""
    return functools.partial(call, record=report.record_int8) if route_on(settings) else _stock


def _owed(x, fold: bool):
    """(rows, the ``PendingModulation`` they still owe or None): a modulation the quantiser can fold
    (``fold`` and ``foldable``) is kept owed; any other is applied here."""
    if fold and isinstance(x, block_ops.PendingModulation) and x.foldable:
        return x.rows, x
    return block_ops.settled(x), None


def _every_op() -> None:
    every_op = getattr(comfy.ops, "run_every_op", None)
    if every_op is not None:
        every_op()  # stock's forward checks for an interrupt first


def _tell(record, problem) -> None:
    if record is not None:
        record(problem)


def _stock(layer, x, input_act=None):
    x = block_ops.settled(x)
    return layer(x) if input_act is None else comfy.ops.linear_input_act(layer, x, input_act)
