"""int8 ConvRot and W4A8 linears called as stock calls them (``layer(x)``, ``linear_input_act(layer, u, "swiglu")``),
the weight cast as stock casts it (per call, or once for a block's token chunks), on the pack's quantiser and int8
GEMM: the same bits, less time. ``route`` alone decides whose quantiser and whose GEMM a layer's calls use."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect

import comfy.model_management
import comfy.ops
import torch

from .. import kernels
from .ownership import replaced_forward

# comfy-kitchen's int8 tensor-wise layout (the bundled checkpoint's): ``linear_input_act`` folds SwiGLU into it
INT8_LAYOUT = "TensorWiseINT8Layout"
# The parameters of the Linear forward of ComfyUI's mixed-precision ops the route mirrors (0.33 to the stored current
# ops); ComfyUI 0.40's forward, with prologue/epilogue paths, takes others: its calls keep stock's quantiser.
ROUTED_FORWARD_PARAMS = ("self", "input", "args", "kwargs")


def is_quantized(weight) -> bool:
    return isinstance(weight, getattr(comfy.ops, "QuantizedTensor", ()))


def is_int8_tensorwise(weight) -> bool:
    return is_quantized(weight) and weight._layout_cls == INT8_LAYOUT


def is_w4a8(weight) -> bool:
    return is_quantized(weight) and weight._layout_cls == kernels.int8_w4a8.LAYOUT


def routable(weight) -> bool:
    """A layout the route knows (int8 ConvRot, W4A8): ``route`` decides the rest."""
    return is_int8_convrot(weight) or is_w4a8(weight)


def gguf_type(weight) -> str | None:
    """A GGUF weight's type name where its calls dequantize it (ComfyUI-GGUF's ``tensor_type``: all but F32, F16)."""
    name = getattr(getattr(weight, "tensor_type", None), "name", None)
    return None if name in (None, "F32", "F16") else name


def quantized_layout(weight) -> str:
    """A quantized weight's layout as the report names it (int8 tensor-wise without ConvRot apart; GGUF's type)."""
    if gguf_type(weight):
        return f"GGUF {gguf_type(weight)}"
    layout = getattr(weight, "_layout_cls", None) or type(weight)
    layout = getattr(layout, "__name__", str(layout))
    if layout != INT8_LAYOUT:
        return layout
    return f"{layout} ({'ConvRot of another form' if getattr(weight._params, 'convrot', False) else 'no ConvRot'})"


def is_int8_convrot(weight) -> bool:
    """An int8 tensor-wise weight with ConvRot groups of 256, as stored (not transposed)."""
    params = getattr(weight, "_params", None)
    return (is_int8_tensorwise(weight) and getattr(params, "convrot", False)
            and getattr(params, "convrot_groupsize", None) == kernels.CONVROT_GROUP
            and not getattr(params, "transposed", False))


@dataclasses.dataclass(frozen=True)
class Route:
    """Whose quantiser and whose GEMM an int8 ConvRot or W4A8 layer's calls run in one sampling run, and why."""
    quantizer: str                  # "pack" or "stock"
    gemm: str                       # the pack's quantiser: "pack_sm90", "pack" or "comfy_kitchen"; else "stock"
    reason: str | None = None       # why stock's quantiser (None: the pack's)
    gemm_reason: str | None = None  # why not the pack's warp-specialised GEMM
    choice: object = None           # the pack's quantiser: the GEMM's kernels.GemmChoice, what each call launches


UNDECIDED = Route("pack", "undecided")  # the layer allows the route; its cast weight decides the rest


def route(layer, x, input_act=None, cast=None, routes: dict | None = None) -> Route:
    """Whose quantiser and whose GEMM ``layer``'s calls on rows like ``x`` run, and why: from the layer, its weight as
    cast (None: that part waits), the device and the releases; kept in ``routes`` (``Plan.int8_routes``)."""
    key = (id(layer), x.device, x.dtype, x.shape[-1], input_act)
    known = routes.get(key) if routes is not None else None
    known = known[1] if known is not None and known[0] is layer else None
    if known is not None and (known is not UNDECIDED or cast is None):
        return known
    reason = _layer_reason(layer, x, input_act) if known is None else None  # UNDECIDED: the layer's part passed
    if reason is None and cast is not None:
        weight, bias = cast
        if is_w4a8(layer.weight):
            reason = (kernels.int8_w4a8.weight_problem(x, weight, bias) if is_w4a8(weight)
                      else "the cast gave no W4A8 weight")
        else:
            reason = (kernels.int8_weight_problem(x, weight._qdata, weight._params.scale, bias, input_act=input_act)
                      if is_int8_convrot(weight) else "the cast gave a weight that is not int8 ConvRot")
    if reason is not None:
        answer = Route("stock", "stock", reason)
    elif cast is None:
        answer = UNDECIDED  # the cast weight decides the rest
    else:
        qdata = cast[0]._qdata
        chosen = kernels.gemm_choice(x.device, x.shape[-1] // (2 if input_act == "swiglu" else 1), qdata.shape[0])
        answer = Route("pack", chosen.kernel, None, chosen.reason, chosen)
    if routes is not None:
        routes[key] = (layer, answer)  # the layer held: its id is not reused while the memo lives
    return answer


def _layer_reason(layer, x, input_act) -> str | None:
    """Why the layer's calls keep stock's quantiser, from the layer, the device and the releases (not the cast)."""
    weight = getattr(layer, "weight", None)
    if not routable(weight):
        return f"a {quantized_layout(weight)} weight: a layout the int8 route does not take"
    if is_w4a8(weight) and input_act is not None:
        return f"linear_input_act({input_act!r}) on a W4A8 weight: stock's call applies the activation first"
    if replaced_forward(layer):
        return "another node replaced the layer's forward"
    if (getattr(layer, "weight_function", None) or getattr(layer, "bias_function", None)
            or getattr(layer, "pre_quant_scale", None) is not None
            or getattr(layer, "comfy_force_cast_weights", False) or getattr(layer, "_full_precision_mm", False)
            or getattr(layer, "layout_type", None) is None):
        return "the layer's forward would not run the int8 GEMM on its weight as stored"
    if getattr(comfy.ops, "CastBiasWeightContext", None) is None:
        return "this ComfyUI has no comfy.ops.CastBiasWeightContext"
    params = tuple(inspect.signature(type(layer).forward).parameters)
    if params != ROUTED_FORWARD_PARAMS:
        return (f"this ComfyUI's Linear forward{params} is not the forward{ROUTED_FORWARD_PARAMS} the route "
                "mirrors (a forward with prologue/epilogue paths, ComfyUI 0.40+): stock's forward runs it")
    return kernels.int8_call_problem(x, input_act=input_act)


def stock_quantizer_reason(layer, x, input_act=None, cast=None, routes: dict | None = None) -> str | None:
    """Why ``layer``'s call on ``x`` keeps stock's quantiser (None: the pack's runs): training, its ``route`` (``cast``:
    the weight and bias as cast for this call), or this call's rows (the only check a routed layer's call repeats)."""
    return _decided(layer, x, input_act, cast, routes)[1]


def _decided(layer, x, input_act, cast, routes) -> tuple[Route | None, str | None]:
    """(the layer's ``route``, or None in training; ``stock_quantizer_reason``'s answer)."""
    if comfy.model_management.in_training or x.requires_grad:
        return None, "training"
    answer = route(layer, x, input_act, cast, routes)
    rows = kernels.int8_w4a8.rows_problem if is_w4a8(layer.weight) else kernels.int8_rows_problem
    return answer, answer.reason or rows(x)


def call(layer, x, input_act: str | None = None, record=None, into=None, routes=None, layouts=None) -> torch.Tensor:
    """Stock's ``layer(x)`` / ``linear_input_act(layer, x, input_act)`` on the pack's quantiser where it keeps stock's
    bits. ``x`` may be a ``kernels.PendingModulation``; ``into`` a ``kernels.PendingResidual`` the output is added to,
    its ``x`` returned. ``layouts``: told the layout of each quantized linear the route does not know."""
    weight = getattr(layer, "weight", None)
    if torch.compiler.is_compiling() or not routable(weight):
        if layouts is not None and (is_quantized(weight) or gguf_type(weight)):
            layouts(quantized_layout(weight))
        return _stock(layer, x, input_act, into)  # (stock's int8 linears do not compile)
    x, pending = _owed(x, input_act is None)
    reason = stock_quantizer_reason(layer, x, input_act, routes=routes)
    if reason is not None:
        _tell(record, reason, weight)
        return _stock(layer, pending if pending is not None else x, input_act, into)
    with _cast(layer, x, input_act) as (weight, bias):
        if input_act is None:
            weight = weight.to(dtype=x.dtype)
        return _added(_on_cast(layer, x, pending, input_act, weight, bias, record, into, routes), into)


def _added(out, into):
    return out if into is None or into.applied else into.apply(out)


def _on_cast(layer, x, pending, input_act, weight, bias, record, into=None, routes=None):
    """One call on the weight as cast for it: the route where it takes the call (``stock_quantizer_reason``), else
    stock's arithmetic on that weight; the reason told either way."""
    (answer, reason), out, w4a8 = _decided(layer, x, input_act, (weight, bias), routes), None, is_w4a8(weight)
    if reason is None:  # a W4A8 weight decoded to its int8 grid for this call only (kernels/int8_w4a8.py)
        qdata, w_scale = kernels.int8_w4a8.operands(weight) if w4a8 else (weight._qdata, weight._params.scale)
        out = kernels.int8_linear_routed(x, qdata, w_scale, bias, input_act=input_act, kernel=answer.choice,
                                         modulation=pending.segments if pending is not None else None, residual=into)
        reason = None if out is not None else "CUTLASS declined the shape"
    _tell(record, reason, weight)
    if out is not None:
        return out
    x = x if pending is None else kernels.settled(pending)
    if is_int8_convrot(weight) and input_act is not None:
        return kernels.stock_int8_linear(x, weight._qdata, weight._params.scale, bias, input_act=input_act)
    if input_act is not None:
        x = comfy.ops.INPUT_ACT_EAGER[input_act](x)
    return torch.nn.functional.linear(x, weight, bias)


class HeldCast:
    """A linear's weight as stock's cast gave it for ``dtype`` rows on ``device`` with ``input_act``, held over a
    block's token chunks; ``run(rows, into)`` runs the layer's call on a chunk (``into`` added by it, or here)."""

    def __init__(self, run, weight, bias, rows: torch.Tensor, input_act: str | None = None):
        self._run, self.weight, self.bias, self.input_act = run, weight, bias, input_act
        self.dtype, self.device = rows.dtype, rows.device

    def __call__(self, x, input_act: str | None = None, into=None) -> torch.Tensor:
        rows = x.rows if isinstance(x, kernels.PendingModulation) else x
        if (input_act, rows.dtype, rows.device) != (self.input_act, self.dtype, self.device):
            # stock's call here would cast again while other weights are held (a cast may reuse their buffer)
            raise RuntimeError(f"[Sage Strided NHD] a weight cast once for {self.dtype} rows on {self.device} "
                               f"(act {self.input_act!r}) was called with {rows.dtype} rows on {rows.device} "
                               f"(act {input_act!r})")
        return _added(self._run(x, into), into)


@contextlib.contextmanager
def cast_once(layer, x, input_act: str | None = None, record=None, routes=None):
    """A ``HeldCast``: ``call(layer, chunk, input_act)`` for every row chunk of one call on ``x`` (or a stand-in of its
    dtype and device) on stock's weight cast for the call, entered once; for a layer the route takes."""
    rows = x.rows if isinstance(x, kernels.PendingModulation) else x
    with _cast(layer, rows, input_act) as (weight, bias):
        if input_act is None:
            weight = weight.to(dtype=rows.dtype)

        def run(chunk, into=None):  # the whole call's checks passed: only a chunk's row count could differ
            return _on_cast(layer, *_owed(chunk, input_act is None), input_act, weight, bias, record, into, routes)

        held = HeldCast(run, weight, bias, rows, input_act)
        del x, rows  # the context lasts as long as the attention: it keeps no input alive
        yield held


def shares_memory(a: HeldCast, b: HeldCast) -> bool:
    """Two held casts' tensors overlap in device memory: ComfyUI cast both into one offload buffer."""
    spans = list(_spans(a))
    return any(d == e and lo < hi2 and lo2 < hi for d, lo, hi in spans for e, lo2, hi2 in _spans(b))


def _spans(cast: HeldCast):
    """(device, first byte, past the last byte) of each tensor a held cast computes with."""
    for t in (cast.weight, cast.bias):
        params = getattr(t, "_params", None) if is_quantized(t) else None
        fields = dataclasses.fields(params) if dataclasses.is_dataclass(params) else ()
        for p in [getattr(t, "_qdata", t)] + [getattr(params, f.name) for f in fields]:
            if torch.is_tensor(p) and p.numel():
                extent = (sum((n - 1) * s for n, s in zip(p.shape, p.stride())) + 1) * p.element_size()
                yield p.device, p.data_ptr(), p.data_ptr() + extent


def _cast(layer, x, input_act):
    """Stock's weight cast for this call: its forward's (weight-only), or ``linear_input_act``'s."""
    if input_act is None:
        _every_op()
        return comfy.ops.CastBiasWeightContext(layer, None, dtype=layer.weight.dtype, device=x.device,
                                               bias_dtype=x.dtype, offloadable=True, compute_dtype=x.dtype,
                                               want_requant=True)
    return comfy.ops.CastBiasWeightContext(layer, x, offloadable=True, compute_dtype=x.dtype, want_requant=True)


def quantized_columns(layer, x, inner: int, record=None, cast=None, routes=None):
    """The int8 ConvRot qkv projection (no bias) by output columns on ``x`` quantised once: ``(rows, project,
    columns)``, or None (then by rows through ``call``). ``cast``: the weight and bias as cast once for this call."""
    if isinstance(x, kernels.PendingModulation) and not x.foldable:
        return None  # a modulation the pass cannot fold: the caller applies it
    x, pending = _owed(x, True)
    weight, bias = cast if cast is not None else (getattr(layer, "weight", None), getattr(layer, "bias", None))
    if cast is None and (hasattr(layer, "_v") or getattr(weight, "device", None) != x.device):
        return None  # not resident: a weight cast per call
    if not is_int8_convrot(weight) or bias is not None or weight._qdata.shape[0] != 3 * inner:
        return None
    answer, reason = _decided(layer, x, None, (weight, None), routes)
    if reason is not None:
        return None
    _every_op()
    rows = kernels.int8_quantized_rows(x, pending.segments if pending is not None else None)
    _tell(record, None, weight)
    qdata, scale = weight._qdata, weight._params.scale
    (project,) = kernels.int8_column_products(qdata, scale, kernel=answer.choice)
    return rows, project, kernels.int8_column_products(qdata, scale, inner, kernel=answer.choice)


def caller(patch):
    """How one installed patch calls a linear ``(layer, x, input_act=None)`` in the current run."""
    return functools.partial(call, record=patch.report.record_int8, routes=patch.plan.int8_routes,
                             layouts=patch.report.record_layout)


def _owed(x, fold: bool):
    """(rows, the ``PendingModulation`` they still owe, kept where the quantiser folds it (``fold``), or None)."""
    if fold and isinstance(x, kernels.PendingModulation) and x.foldable:
        return x.rows, x
    return kernels.settled(x), None


def _every_op() -> None:
    getattr(comfy.ops, "run_every_op", lambda: None)()  # stock's forward checks for an interrupt first


def _tell(record, reason, weight) -> None:
    """``reason`` to the report (None: the route ran the call), with a W4A8 weight's layout (int8 ConvRot: none)."""
    if record is not None:
        record(reason, **({"layout": kernels.int8_w4a8.LAYOUT} if is_w4a8(weight) else {}))


def _stock(layer, x, input_act=None, into=None):
    """Stock's call (``into``: the residual its output is then added to by the residual's own pass)."""
    x = kernels.settled(x)
    return _added(layer(x) if input_act is None else comfy.ops.linear_input_act(layer, x, input_act), into)
