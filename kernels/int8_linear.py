"""int8 tensor-wise ConvRot linears as stock's CUDA ``int8_linear`` runs them, on the pack's quantiser and GEMM: same
bits. Stock's dispatch has no public entry point: the route mirrors each release in ``kitchen.RELEASES`` (verified),
and runs on another only where it passes a bits self-check on the device (``release_problem``)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import torch

from . import gpu, int8_activation
from .h3_block import PendingResidual
from .int8_gemm import GemmChoice, GemmDeclined, choice, gemm
from .kitchen import VERIFIED_VERSIONS, installed_release, kitchen_cuda

GROUP = int8_activation.GROUP


def int8_call_problem(x: torch.Tensor, *, input_act: str | None = None) -> str | None:
    """What about calls on rows like ``x`` (device, dtype, width; not their count) keeps stock's (None: nothing)."""
    if not x.is_cuda:
        return "not on a CUDA device"
    return _call_shape_problem(x, input_act) or release_problem(x.device)


def _call_shape_problem(x: torch.Tensor, input_act: str | None) -> str | None:  # the release's check aside
    if not int8_activation.quantize_takes(x, input_act):
        return f"the pack's quantiser does not take a {x.dtype} input {x.shape[-1]} wide (act {input_act!r})"
    return kitchen_cuda()[1]


def int8_rows_problem(x: torch.Tensor) -> str | None:
    """What about this one call keeps stock's: traced, or too few rows for the release's CUTLASS GEMM."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    version, release, _ = installed_release()
    if release is not None and x.shape[0] < release.min_rows:
        return (f"{x.shape[0]} row{'s' if x.shape[0] > 1 else ''}: comfy-kitchen {version} runs a GEMV for fewer than "
                f"{release.min_rows} rows, not its CUTLASS GEMM")
    return None


def int8_weight_problem(x: torch.Tensor, qdata: torch.Tensor, w_scale: torch.Tensor, bias, *,
                        input_act: str | None = None) -> str | None:
    """Why stock's ``int8_linear`` would not run the two kernels the route mirrors on this weight (None: it would)."""
    cuda = kitchen_cuda()[0]
    k = x.shape[1] // (2 if input_act == "swiglu" else 1)
    if qdata.dtype != torch.int8 or qdata.dim() != 2 or qdata.shape[1] != k:
        return f"weight {qdata.dtype} {tuple(qdata.shape)} does not match the {k}-wide activations"
    try:
        kwargs = {"x": x, "weight": qdata, "weight_scale": w_scale, "bias": bias, "out_dtype": x.dtype,
                  "convrot": True, "convrot_groupsize": GROUP, "input_act": input_act}
        if importlib.import_module("comfy_kitchen").registry.get_capable_backend("int8_linear", kwargs) != "cuda":
            return "comfy-kitchen would not run its CUDA int8_linear for this call"
        if not cuda._convrot_fused_shared_memory_fits(x, k, GROUP):
            return "comfy-kitchen's fused quantiser would not fit this row in shared memory"
        if (cuda._DISABLE_CUTLASS_INT8 or not cuda._cuda_device_supports_cutlass_int8_dequant(x)
                or cuda._cuda_device_is_turing(x.get_device())
                or cuda._prefer_cublas_int8_fallback(x.shape[0], qdata.shape[0], k, x.get_device())):
            return "comfy-kitchen would not run its CUTLASS int8 GEMM here"
    except Exception as exc:  # an internal that moved: stock's call is the safe answer
        return f"comfy-kitchen's int8_linear could not be inspected ({type(exc).__name__}: {exc})"
    return None


def int8_linear_routed(x: torch.Tensor, qdata: torch.Tensor, w_scale: torch.Tensor, bias=None, *, kernel: GemmChoice,
                       input_act: str | None = None, modulation: list | None = None,
                       residual: PendingResidual | None = None) -> torch.Tensor | None:
    """Stock's ``int8_linear`` on the pack's quantiser (``modulation`` folded in) and ``kernel``, the layer's GEMM;
    ``residual``: the output added to it (``residual.x`` returned); None where CUTLASS declines (nothing added)."""
    xq, x_scale = _quantize(x, input_act, modulation)
    return gemm(xq, x_scale, qdata, w_scale, bias, x.dtype, residual, kernel=kernel)


def _quantize(x, input_act, modulation):
    """(int8 rows, scales) of ``x``, ``modulation`` applied by the pass (the host tests' seam for a CPU quantiser)."""
    return int8_activation.quantize_rows(x, input_act, modulation=modulation)


def stock_int8_linear(x, qdata, w_scale, bias=None, *, input_act: str | None = None) -> torch.Tensor:
    """Stock's call itself, for a call the route declined after the cast."""
    ck = importlib.import_module("comfy_kitchen")
    return ck.int8_linear(x, qdata, w_scale, bias, x.dtype, convrot=True, convrot_groupsize=GROUP, input_act=input_act)


def routed_or_reason(x, qdata, w_scale, bias=None, *, input_act: str | None = None) -> torch.Tensor | str:
    """One call through the route as sampling takes it, the release's verification aside: its output, or why not."""
    why = (_call_shape_problem(x, input_act) or int8_rows_problem(x)
           or int8_weight_problem(x, qdata, w_scale, bias, input_act=input_act))
    if why is not None:
        return why
    kernel = choice(x.device, qdata.shape[1], qdata.shape[0])
    out = int8_linear_routed(x, qdata, w_scale, bias, input_act=input_act, kernel=kernel)
    return "CUTLASS declined the shape" if out is None else out


def gemm_status(device=None) -> dict:
    """For the report: ``choice`` on ``device`` (default: the first CUDA one); the reason on a GPU only."""
    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    chosen = choice(device)
    reason = chosen.reason if chosen.kernel != "pack" or device.type == "cuda" else None
    return {"kernel": chosen.kernel, "reason": reason, "release": chosen.release}


@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """int8 rows, their fp32 scales and the bf16 ``dtype``, sliced by rows (for ``kernels.RowProjection``)."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self):
        return self.q.shape

    @property
    def device(self):
        return self.q.device

    def __getitem__(self, rows: slice) -> "QuantizedRows":
        return QuantizedRows(self.q[rows], self.scale[rows], self.dtype)


def int8_quantized_rows(x: torch.Tensor, modulation: list | None = None) -> QuantizedRows:
    """``x`` quantised as ``int8_linear_routed`` quantises it."""
    return QuantizedRows(*_quantize(x, None, modulation), x.dtype)


def int8_column_products(qdata: torch.Tensor, w_scale: torch.Tensor, inner: int | None = None, *,
                         kernel: GemmChoice):
    """``(project_q, project_k, project_v)`` on weight rows [0, inner), [inner, 2*inner), [2*inner, ...) (``inner``
    None: ``(project,)``), on ``kernel``: any column block gives the whole product's bits (``GemmDeclined``)."""
    def block(a: int, b: int | None):
        w = qdata[a:b]
        ws = w_scale if w_scale.numel() == 1 else w_scale.reshape(-1)[a:b]

        def project(rows: QuantizedRows) -> torch.Tensor:
            out = gemm(rows.q, rows.scale, w, ws, None, rows.dtype, kernel=kernel)
            if out is None:
                raise GemmDeclined(f"CUTLASS declined an int8 GEMM of {rows.q.shape[0]} x {w.shape[0]} x {w.shape[1]}")
            return out
        return project

    if inner is None:
        return (block(0, None),)
    return block(0, inner), block(inner, 2 * inner), block(2 * inner, None)


# --- a release outside the verified ones: the route checks itself against stock on the device at first use ----

def release_problem(device: torch.device) -> str | None:
    """Why the installed comfy-kitchen keeps stock's quantiser on ``device`` (None: verified, or self-checked there)."""
    version, release, verified = installed_release()
    if verified:
        return None
    why = gpu.ANSWERS.decide("kitchen_release", device, lambda: self_check(device, release.min_rows))
    if why is None:
        return None
    return (f"comfy-kitchen {version} is not a release the route was verified on "
            f"({', '.join(VERIFIED_VERSIONS)}), and on this device the route did not give stock's bits in its "
            f"self-check: {why}")


def kitchen_release_status(device=None) -> dict:
    """For the report: the route "verified", "self_checked" (on ``device``, default the current CUDA one) or "stock"."""
    version, _, verified = installed_release()
    why = kitchen_cuda()[1]
    if why is None and not verified:
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda")
        on_cuda = device is not None and torch.device(device).type == "cuda"
        why = release_problem(torch.device(device)) if on_cuda else "no CUDA device to self-check the release on"
    return {"release": version, "route": "stock" if why else "verified" if verified else "self_checked", "reason": why}


@dataclasses.dataclass(frozen=True)
class Sample:
    rows: int
    width: int  # the quantised width (the input is twice as wide with SwiGLU)
    out_features: int
    input_act: str | None = None
    bias: bool = False

    def __str__(self) -> str:
        act = f" {self.input_act}" if self.input_act else ""
        return f"{self.rows} x {self.width}{act} -> {self.out_features}{' with a bias' if self.bias else ''}"


def samples(min_rows: int) -> tuple[Sample, ...]:
    """H3's linears' inputs (the quantiser variants sampling compiles anyway), the fewest rows and rows off tiles."""
    return (Sample(min_rows, 5376, 384), Sample(77, 7168, 256), Sample(300, 14336, 256, "swiglu"),
            Sample(77, 5376, 256, bias=True))


def self_check(device, min_rows: int) -> str | None:
    """Now (not memoised): None where the route gives stock's call's bits on every sample; else what went wrong."""
    device = gpu.exact_device(device)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), torch.no_grad():
            problem = next(filter(None, (_sample_problem(device, seed, sample)
                                         for seed, sample in enumerate(samples(min_rows)))), None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as exc:  # the device itself failing: stock's call is the safe answer
        problem = f"{type(exc).__name__}: {exc}"
    return problem


def _sample_problem(device, seed: int, sample: Sample) -> str | None:
    g = torch.Generator(device=device).manual_seed(seed)
    try:
        cols = sample.width * (2 if sample.input_act == "swiglu" else 1)
        x = (2 * torch.randn(sample.rows, cols, generator=g, device=device)).bfloat16()
        w = torch.randint(-127, 128, (sample.out_features, sample.width), generator=g, device=device, dtype=torch.int8)
        bias = torch.randn(sample.out_features, generator=g, device=device).bfloat16() if sample.bias else None
        w_scale = torch.tensor(2e-3, device=device)
        want = stock_int8_linear(x, w, w_scale, bias, input_act=sample.input_act)
        got = routed_or_reason(x, w, w_scale, bias, input_act=sample.input_act)
    except Exception as exc:  # whatever broke, stock's call is the safe answer
        return f"{type(exc).__name__} on {sample}: {exc}"
    if isinstance(got, str):
        return f"the route declined {sample}: {got}"
    if not torch.equal(got, want):
        return f"{int((got != want).sum())} of {want.numel()} outputs differ from stock's on {sample}"
    return None
