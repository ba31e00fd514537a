"""int8 tensor-wise ConvRot linears (the bundled checkpoint's) called as stock calls them (``layer(x)``,
``linear_input_act(layer, u, "swiglu")``), the weight cast as stock casts it, the input quantised by the pack's
pass: the same bits, less time. ``stock_quantizer_reason`` alone decides whose quantiser a call uses."""

from __future__ import annotations

import functools
import inspect

import comfy.model_management
import comfy.ops
import torch

from .. import kernels
from .ownership import replaced_forward

# comfy-kitchen's int8 tensor-wise layout (the bundled checkpoint's): its activation quantiser works row
# by row, and ``linear_input_act`` folds SwiGLU into it
INT8_LAYOUT = "TensorWiseINT8Layout"
# ``linear_input_act``'s arguments past ``input_act`` (ComfyUI 0.36+: a norm folded into the quantiser, a residual
# into the GEMM epilogue) at their defaults. The route takes only calls where they are the defaults.
EXTENDED_DEFAULTS = {"act_weight": None, "act_eps": 0.0, "residual": None, "residual_scale": None}
# The Linear forward of ComfyUI's mixed-precision ops the route mirrors (0.33 to the stored current ops): its
# parameters. ComfyUI 0.40 consolidated the forward with prologue/epilogue paths; a forward taking other
# parameters is not the one the route was checked against, so its calls keep stock's quantiser.
ROUTED_FORWARD_PARAMS = ("self", "input", "args", "kwargs")


def is_int8_tensorwise(weight) -> bool:
    return (isinstance(weight, getattr(comfy.ops, "QuantizedTensor", ()))
            and getattr(weight, "_layout_cls", None) == INT8_LAYOUT)


def is_int8_convrot(weight) -> bool:
    """An int8 tensor-wise weight with ConvRot groups of 256, as stored (not transposed)."""
    params = getattr(weight, "_params", None)
    return (is_int8_tensorwise(weight) and getattr(params, "convrot", False)
            and getattr(params, "convrot_groupsize", None) == kernels.CONVROT_GROUP
            and not getattr(params, "transposed", False))


def stock_quantizer_reason(layer, x, input_act=None, cast=None) -> str | None:
    """Why the int8 ConvRot ``layer``'s call on ``x`` keeps stock's quantiser (None: the pack's runs). ``cast``: the
    ``(weight, bias)`` as cast for this call; None: before the cast (what the layer and the call show)."""
    if cast is None:
        if replaced_forward(layer):
            return "another node replaced the layer's forward"
        if (getattr(layer, "weight_function", None) or getattr(layer, "bias_function", None)
                or getattr(layer, "pre_quant_scale", None) is not None
                or getattr(layer, "comfy_force_cast_weights", False) or getattr(layer, "_full_precision_mm", False)
                or getattr(layer, "layout_type", None) is None):
            return "the layer's forward would not run the int8 GEMM on its weight as stored"
        if comfy.model_management.in_training or x.requires_grad:
            return "training"
        if getattr(comfy.ops, "CastBiasWeightContext", None) is None:
            return "this ComfyUI has no comfy.ops.CastBiasWeightContext"
        params = forward_params(type(layer))
        if params != ROUTED_FORWARD_PARAMS:
            return (f"this ComfyUI's Linear forward{params} is not the forward{ROUTED_FORWARD_PARAMS} the route "
                    "mirrors (a forward with prologue/epilogue paths, ComfyUI 0.40+): stock's forward runs it")
        return kernels.int8_call_problem(x, input_act=input_act)
    weight, bias = cast
    if not is_int8_convrot(weight):
        return "the cast gave a weight that is not int8 ConvRot"
    return kernels.int8_weight_problem(x, weight._qdata, weight._params.scale, bias, input_act=input_act)


@functools.cache
def forward_params(cls) -> tuple:
    """The parameter names of ``cls.forward`` (a class's forward does not change in a process)."""
    return tuple(inspect.signature(cls.forward).parameters)


def call(layer, x, input_act: str | None = None, record=None, **extended) -> torch.Tensor:
    """Stock's ``layer(x)`` / ``linear_input_act(layer, x, input_act, **extended)`` on the pack's quantiser where it
    keeps stock's bits; ``x`` may be a ``kernels.PendingModulation`` (applied by the quantiser, or here).
    ``extended``: ``linear_input_act``'s later arguments (EXTENDED_DEFAULTS); a call that sets one is stock's."""
    extra = _set_arguments(extended)
    if torch.compiler.is_compiling() or not is_int8_convrot(getattr(layer, "weight", None)):
        return _stock(layer, x, input_act, **extra)  # (stock's int8 linears do not compile; a trace records nothing)
    if extra:
        _tell(record, f"the call sets linear_input_act's {', '.join(extra)}: stock's call runs them")
        return _stock(layer, x, input_act, **extra)
    x, pending = _owed(x, input_act is None)
    reason = stock_quantizer_reason(layer, x, input_act)
    if reason is not None:
        _tell(record, reason)
        return _stock(layer, pending if pending is not None else x, input_act)
    with _cast(layer, x, input_act) as (weight, bias):
        if input_act is None:
            weight = weight.to(dtype=x.dtype)
        reason, out = stock_quantizer_reason(layer, x, input_act, cast=(weight, bias)), None
        if reason is None:
            out = kernels.int8_linear_routed(x, weight._qdata, weight._params.scale, bias, input_act=input_act,
                                             modulation=pending.segments if pending is not None else None)
            reason = None if out is not None else "CUTLASS declined the shape"
        _tell(record, reason)
        if out is not None:
            return out
        return _stock_on_cast(x if pending is None else kernels.settled(pending), weight, bias, input_act)


def _cast(layer, x, input_act):
    """Stock's weight cast for this call: its forward's, or ``linear_input_act``'s."""
    if input_act is None:
        _every_op()
        return comfy.ops.CastBiasWeightContext(layer, None, dtype=layer.weight.dtype, device=x.device,
                                               bias_dtype=x.dtype, offloadable=True, compute_dtype=x.dtype,
                                               want_requant=True)
    return comfy.ops.CastBiasWeightContext(layer, x, offloadable=True, compute_dtype=x.dtype, want_requant=True)


def _stock_on_cast(x, weight, bias, input_act):
    """Stock's computation on a weight already cast (a call declined after the cast)."""
    if is_int8_convrot(weight) and input_act is not None:
        return kernels.stock_int8_linear(x, weight._qdata, weight._params.scale, bias, input_act=input_act)
    if input_act is not None:
        x = comfy.ops.INPUT_ACT_EAGER[input_act](x)
    return torch.nn.functional.linear(x, weight, bias)


def quantized_columns(layer, x, inner: int, record=None):
    """The qkv projection by output columns on ``x`` quantised once (``kernels.RowProjection``'s column form):
    ``(rows, project, columns)``, or None (then by rows through ``call``). Resident weight, no bias only."""
    w = getattr(layer, "weight", None)
    pending = x if isinstance(x, kernels.PendingModulation) and x.foldable else None
    if pending is not None:
        x = pending.rows
    elif isinstance(x, kernels.PendingModulation):
        return None  # a modulation the pass cannot fold: the caller applies it
    if (not is_int8_convrot(w) or getattr(layer, "bias", None) is not None or hasattr(layer, "_v")
            or w.device != x.device or w._qdata.shape[0] != 3 * inner
            or stock_quantizer_reason(layer, x) is not None
            or stock_quantizer_reason(layer, x, cast=(w, None)) is not None):  # resident: nothing to cast
        return None
    _every_op()
    rows = kernels.int8_quantized_rows(x, pending.segments if pending is not None else None)
    _tell(record, None)
    qdata, scale = w._qdata, w._params.scale
    return rows, kernels.int8_column_products(qdata, scale, 3 * inner)[0], kernels.int8_column_products(
        qdata, scale, inner)


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
    if fold and isinstance(x, kernels.PendingModulation) and x.foldable:
        return x.rows, x
    return kernels.settled(x), None


def _every_op() -> None:
    every_op = getattr(comfy.ops, "run_every_op", None)
    if every_op is not None:
        every_op()  # stock's forward checks for an interrupt first


def _tell(record, reason) -> None:
    if record is not None:
        record(reason)


def _set_arguments(extended: dict) -> dict:
    """``linear_input_act``'s arguments past ``input_act`` that differ from their defaults (unknown names: an error)."""
    unknown = sorted(set(extended) - set(EXTENDED_DEFAULTS))
    if unknown:
        raise TypeError(f"int8_layers.call got unexpected argument(s) {', '.join(unknown)}")
    return {k: v for k, v in extended.items()
            if not (v is None if EXTENDED_DEFAULTS[k] is None else v == EXTENDED_DEFAULTS[k])}


def _stock(layer, x, input_act=None, **extra):
    x = kernels.settled(x)
    if not extra:
        return layer(x) if input_act is None else comfy.ops.linear_input_act(layer, x, input_act)
    missing = [k for k in extra if k not in inspect.signature(comfy.ops.linear_input_act).parameters]
    if missing:
        raise TypeError(f"[Sage Strided NHD] this ComfyUI's comfy.ops.linear_input_act takes no {', '.join(missing)} "
                        "(ComfyUI 0.36 added them)")
    return comfy.ops.linear_input_act(layer, x, input_act, **extra)
