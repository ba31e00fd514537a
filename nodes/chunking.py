"""The chunk and cast-once rules of the H3 block fast path: where a linear's calls on token chunks give its whole
call's bits, a weight that ComfyUI casts per call (offloaded, streamed, patched) entered once for every chunk, and
the qkv projection by column blocks. docs/ARCHITECTURE.md has the details."""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import comfy.model_management
import comfy.ops
import torch

from .. import kernels
from . import int8_layers
from .ownership import replaced_forward

# activation dtypes whose GEMMs give the same bits split by rows (bf16: checked by tests/gpu; fp16 taken as bf16)
CHUNKED_DTYPES = (torch.bfloat16, torch.float16)
# devices whose GEMMs give a row the same bits at any row count: CUDA's (oneDNN's CPU GEMMs do not, bf16 on AMX)
CHUNKED_DEVICES = ("cuda",)


def weight_resident(layer, device) -> bool:
    """Each call of ``layer`` uses its weight as it lies on ``device``: nothing to transfer or patch per call. Not a
    DynamicVRAM layer (``_v``: its weight stays on the CPU, each call's cast maps its pages) nor a weight function."""
    weight = getattr(layer, "weight", None)
    if getattr(layer, "weight_function", None) or hasattr(layer, "_v") or int8_layers.gguf_type(weight):
        return False  # (a GGUF weight is dequantized by each call: each chunk's call would do it again)
    return getattr(weight, "device", None) == device


def rows_independent(layer) -> bool:
    """Each output row of ``layer`` depends on its own input row only: float, int8 tensor-wise (per-row
    quantiser), weight-only or fixed-``input_scale`` weights; not a scale taken from the whole input."""
    weight = getattr(layer, "weight", None)
    if not int8_layers.is_quantized(weight):
        return True
    quantizes_input = getattr(comfy.ops, "QUANT_ALGOS", {}).get(getattr(layer, "quant_format", None), {}).get(
        "quantize_input", True)
    return (int8_layers.is_int8_tensorwise(weight) or not quantizes_input
            or getattr(layer, "input_scale", None) is not None)


RESIDENT = "resident"    # each chunk calls the linear: its weight lies on the device, nothing is cast per call
CAST_ONCE = "cast_once"  # the weight cast as stock's call casts it, once per block; every chunk runs on it


@dataclass(frozen=True)
class Chunking:
    """``rows`` per token chunk and each linear's mode; or ``rows`` None: whole, ``reason`` None for one chunk."""
    rows: int | None = None
    modes: tuple = ()
    reason: str | None = None


def linear_chunking(layer, x, input_act: str | None = None, routes: dict | None = None,
                    shape: tuple | None = None) -> tuple[str | None, str | None]:
    """How ``layer``'s calls on token chunks of ``x`` give its whole call's bits with no weight transferred twice:
    ``(RESIDENT, None)``, ``(CAST_ONCE, None)``, or ``(None, why)``: it runs whole. ``routes``: the run's int8 routes;
    ``shape``: the ``(rows, width)`` of one chunk's input where that is not ``x``'s (fc2's). To cast once, the cast and
    the arithmetic on it must be the ones the layer's own call runs."""
    if x.dtype not in CHUNKED_DTYPES:
        return None, f"{x.dtype} activations: GEMMs split by rows may round differently"
    if x.device.type not in CHUNKED_DEVICES:
        return None, f"{x.device.type} GEMMs may give a row other bits at another row count"
    if replaced_forward(layer):
        return None, "another node replaced the layer's forward"
    if not rows_independent(layer):
        return None, "its activation scale is taken from the whole input"
    if weight_resident(layer, x.device):
        return RESIDENT, None
    weight = getattr(layer, "weight", None)
    if torch.compiler.is_compiling():
        why = "traced by torch.compile, where the cast runs per call"
    elif getattr(comfy.ops, "CastBiasWeightContext", None) is None:
        why = "this ComfyUI has no comfy.ops.CastBiasWeightContext"
    elif int8_layers.routable(weight):  # int8 ConvRot or W4A8: the route's own cast
        why = int8_layers.stock_quantizer_reason(layer, x if shape is None else call_input(x, *shape), input_act,
                                                 routes=routes)
    elif type(weight) not in (torch.Tensor, torch.nn.Parameter):
        why = f"a {type(weight).__name__} weight, whose cast the cast once does not mirror"
    elif not _float_forward_mirrored(type(layer)):
        why = f"{type(layer).__qualname__}.forward is not comfy.ops' Linear forward, whose cast the cast once mirrors"
    elif input_act is not None:
        why = f"linear_input_act({input_act!r}) on a float weight"
    elif not (getattr(layer, "comfy_cast_weights", False) or getattr(layer, "weight_function", None)
              or getattr(layer, "bias_function", None)):
        why = "its forward uses the weight as it lies, on another device"
    else:
        why = None
    return (None, why) if why else (CAST_ONCE, None)


@functools.cache
def _float_forward_mirrored(cls) -> bool:
    """``cls``'s forward is comfy.ops' Linear forward (disable_weight_init, manual_cast), whose per-call cast
    ``CastBiasWeightContext(self, input, offloadable=True)`` then ``F.linear(input, weight, bias)`` the cast once
    enters: known by its parameters and the names its cast-and-product code uses. Asked once a class."""
    base = getattr(getattr(comfy.ops, "disable_weight_init", None), "Linear", None)
    if base is None or getattr(cls, "forward", None) is not base.forward:
        return False
    cast = getattr(cls, "forward_comfy_cast_weights", None)
    return (cast is base.forward_comfy_cast_weights
            and tuple(inspect.signature(cls.forward).parameters) == ("self", "args", "kwargs")
            and tuple(inspect.signature(cast).parameters) == ("self", "input")
            and cast.__code__.co_names == ("CastBiasWeightContext", "torch", "nn", "functional", "linear"))


def call_input(x, rows: int, width: int) -> torch.Tensor:
    """A ``[rows, width]`` stand-in for a call's input, of ``x``'s dtype and device, for the checks that read its
    shape (fc2's input does not exist before the MLP runs): every row views ``x``'s first ``width`` elements."""
    if width == x.shape[-1]:
        return x[:rows]
    if x.untyped_storage().nbytes() // x.element_size() - x.storage_offset() >= width:
        return x.as_strided((rows, width), (0, 1))
    return x.new_empty((1, width)).expand(rows, width)


def mlp_chunk_setting(settings, mlp) -> int:  # by fc1's weight format: the larger GEMM
    int8 = int8_layers.is_int8_tensorwise(getattr(mlp.fc1, "weight", None))
    return settings.int8_mlp_chunk_tokens if int8 else settings.mlp_chunk_tokens


def mlp_chunking(mlp, x, chunk: int, routes: dict | None = None) -> Chunking:
    """The MLP half's token chunks of ``chunk`` rows (fc1's and fc2's modes), or why it runs whole."""
    if replaced_forward(mlp):
        return Chunking(reason="another node's MLP forward runs as it is")
    act = "swiglu" if folds_swiglu(mlp.fc2) else None
    width = (getattr(mlp.fc2, "in_features", None) or mlp.fc2.weight.shape[-1]) * (2 if act else 1)
    return _chunking(x, chunk, routes, ("fc1: ", mlp.fc1, None, x.shape[-1]), ("fc2: ", mlp.fc2, act, width))


def projection_chunking(linear, x, chunk: int, routes: dict | None = None) -> Chunking:
    """The qkv projection's token chunks of ``chunk`` rows, or why it runs whole (torch.compile, bits at risk)."""
    if torch.compiler.is_compiling():
        return Chunking(reason="traced by torch.compile: the projection runs whole")
    return _chunking(x, chunk, routes, ("", linear, None, None))


def _chunking(x, chunk: int, routes, *linears) -> Chunking:
    """Chunks of ``chunk`` rows of ``x`` for each ``(prefix of its reason, layer, input_act, width of its input
    where not x's)`` of ``linears``, or why they run whole (None width: checked on all of ``x``)."""
    if x.shape[0] <= chunk:
        return Chunking()
    a, b = kernels.token_chunks(x.shape[0], chunk)[0]
    modes = []
    for prefix, layer, input_act, width in linears:
        mode, why = linear_chunking(layer, x, input_act, routes, None if width is None else (b - a, width))
        if mode is None:
            return Chunking(reason=prefix + why)
        modes.append(mode)
    # ComfyUI casts each offloaded weight into its offload stream's one buffer and alternates the streams: two casts
    # held together need two streams, or none (each then allocates its own); ``hold_casts`` checks the casts too
    if modes.count(CAST_ONCE) > 1 and getattr(comfy.model_management, "NUM_STREAMS", 0) == 1:
        return Chunking(reason="one offload stream: fc1's and fc2's casts would share its one buffer")
    return Chunking(rows=chunk, modes=tuple(modes))


def column_products(linear, x, inner: int, cast=None):
    """``(project_q, project_k, project_v)`` for ``kernels.RowProjection`` when ``linear`` is the plain product
    ``x @ weight.T`` (nothing cast or patched per call), whose column blocks give its bits; else None.
    ``cast``: the ``(weight, bias)`` as cast once for this call (then the product is on that weight)."""
    w, bias = cast if cast is not None else (getattr(linear, "weight", None), getattr(linear, "bias", None))
    if (type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dtype != x.dtype or w.device != x.device
            or w.dim() != 2 or w.shape[0] != 3 * inner or bias is not None or replaced_forward(linear)
            or (cast is None and (getattr(linear, "weight_function", None) or getattr(linear, "bias_function", None)
                                  or getattr(linear, "comfy_cast_weights", False)))):
        return None
    return (lambda rows: torch.nn.functional.linear(rows, w[:inner]),
            lambda rows: torch.mm(rows, w[inner:2 * inner].t()),
            lambda rows: torch.mm(rows, w[2 * inner:].t()))


def cast_once(layer, x, input_act: str | None = None, record=None, routes=None):
    """Stock's weight cast for ``layer``'s calls on the token chunks of ``x`` (``linear_chunking`` gave CAST_ONCE),
    entered once: a context manager yielding an ``int8_layers.HeldCast``, left as stock's call leaves its cast. A float
    weight (comfy.ops' Linear forward): each chunk is ``F.linear(rows, weight, bias)``, the forward's own arithmetic."""
    if int8_layers.routable(getattr(layer, "weight", None)):
        return int8_layers.cast_once(layer, x, input_act, record, routes)
    return _float_cast_once(layer, x.rows if isinstance(x, kernels.PendingModulation) else x)


@contextlib.contextmanager
def _float_cast_once(layer, x):
    int8_layers._every_op()  # stock's forward checks for an interrupt first
    with comfy.ops.CastBiasWeightContext(layer, x, offloadable=True) as (weight, bias):
        def run(rows, into=None):  # a residual owed is added after the product, by HeldCast
            return torch.nn.functional.linear(kernels.settled(rows), weight, bias)

        held = int8_layers.HeldCast(run, weight, bias, x)
        del x  # the context lasts as long as the attention: it keeps no input alive
        yield held


def hold_casts(stack: contextlib.ExitStack, linear, casts, x, record=None, routes=None):
    """``linear`` (a ``(layer, x, input_act=None)`` caller) with each ``(layer, input_act)`` of ``casts`` served by
    its weight cast once for calls on ``x``'s rows, entered into ``stack`` (left as it closes). None, ``stack``
    closed, where two of the casts lie in the same memory (ComfyUI reused one buffer): nothing ran on them."""
    held = {}
    for layer, input_act in casts:
        cast = stack.enter_context(cast_once(layer, x, input_act, record, routes))
        if any(int8_layers.shares_memory(cast, other) for other in held.values()):
            stack.close()
            return None
        held[id(layer)] = cast

    def call(layer, rows, input_act=None, into=None):
        cast = held.get(id(layer))
        return linear(layer, rows, input_act, into=into) if cast is None else cast(rows, input_act, into)
    return call


def folds_swiglu(linear) -> bool:
    """``comfy.ops.linear_input_act`` folds SwiGLU into this linear's int8 activation quantiser (its conditions)."""
    return (not comfy.model_management.in_training and int8_layers.is_int8_tensorwise(getattr(linear, "weight", None))
            and not getattr(getattr(linear.weight, "_params", None), "transposed", False))
