"""comfy-kitchen as installed: its release, what the pack checked with each release it knows (one table), the int8
route's standing with it, its CUDA backend and the CUTLASS int8 GEMM the route calls as its ``int8_linear`` does. A
release not checked on a GPU runs the route on a device only after a bits self-check there at first use: any
difference from stock's ConvRot ``int8_linear``, decline or exception keeps stock's quantiser there, with the reason."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata

import torch

from . import gpu
from .triton_support import version_key


@dataclasses.dataclass(frozen=True)
class KitchenRelease:
    """One comfy-kitchen release: what its CUDA ``int8_linear`` (ConvRot, no residual) does that the int8 route
    mirrors, and what the pack checked with it on a GPU."""
    version: str
    min_rows: int  # fewer rows: stock runs a GEMV (one row; two rows too since 0.2.36), not the CUTLASS GEMM
    bias_in_out_dtype: bool  # the GEMM's bias operand: in the output dtype, 16-byte aligned (else fp32)
    gpu_verified: bool = True  # the int8 route gave stock's bits on a GPU with it; else it self-checks at first use
    # the pack's RMSNorm+RoPE pass gave its CUDA rms_rope_split_half_'s bits on a GPU (full-width H3 blocks equal to
    # stock's); with any other release comfy-kitchen's own kernel runs: stock's bits by construction
    norm_rope_checked: bool = True


# read from each release's code; 0.2.36 has not run on a GPU here: the int8 route self-checks its bits there first,
# and its norm+RoPE kernel runs rather than the pack's pass
RELEASES = {r.version: r for r in (
    KitchenRelease("0.2.31", min_rows=2, bias_in_out_dtype=False),
    KitchenRelease("0.2.36", min_rows=3, bias_in_out_dtype=True, gpu_verified=False, norm_rope_checked=False),
    KitchenRelease("0.2.40", min_rows=3, bias_in_out_dtype=True))}
KITCHEN_VERSIONS = tuple(RELEASES)
VERIFIED_VERSIONS = tuple(v for v, r in RELEASES.items() if r.gpu_verified)
# the CUDA backend's private names the route calls (ConvRot dispatch, GEMM operands, the extension itself)
CUDA_HELPERS = ("_convrot_fused_shared_memory_fits", "_DISABLE_CUTLASS_INT8",
                "_cuda_device_supports_cutlass_int8_dequant", "_cuda_device_is_turing", "_prefer_cublas_int8_fallback",
                "_int8_weight_scale_arg", "_empty_cuda_tensor", "_wrap_for_dlpack")
BIAS_HELPER = "_gemm_vector_arg"  # the aligned bias operand, where the release passes it in the output dtype
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the GEMM's output dtype codes


def release_for(version: str) -> tuple[KitchenRelease, bool]:
    """(the route's form for comfy-kitchen ``version``, whether it is verified on a GPU): another release takes the
    newest known release's form not newer than it (or the oldest's), to be self-checked."""
    if version in RELEASES:
        return RELEASES[version], RELEASES[version].gpu_verified
    by_age = sorted(RELEASES.values(), key=lambda r: version_key(r.version))
    older = [r for r in by_age if version_key(r.version) <= version_key(version)]
    return (older[-1] if older else by_age[0]), False


@functools.cache
def installed_release() -> tuple[str | None, KitchenRelease | None, bool]:
    """(comfy-kitchen's installed version or None, the route's form for it, verified), asked once a process."""
    try:
        version = importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:
        return None, None, False
    return (version, *release_for(version))


def norm_rope_checked() -> bool:
    """The installed release is one the pack's norm+RoPE pass was checked against (exactly: no nearest form)."""
    release = RELEASES.get(installed_release()[0])
    return release is not None and release.norm_rope_checked


def release_problem(device: torch.device) -> str | None:
    """Why the installed comfy-kitchen keeps stock's quantiser on ``device``: None for a verified release; another
    is self-checked there once (``gpu.ANSWERS``, question "kitchen_release")."""
    version, release, verified = installed_release()
    if verified:
        return None
    why = gpu.ANSWERS.decide("kitchen_release", device, lambda: self_check(device, release.min_rows))
    if why is None:
        return None
    return (f"comfy-kitchen {version} is not a release the route was verified on ({', '.join(VERIFIED_VERSIONS)}), and "
            f"on this device the route did not give stock's bits in its self-check: {why}")


def kitchen_release_status(device=None) -> dict:
    """For the report: ``{"release", "route": "verified" | "self_checked" | "stock", "reason"}``; a release outside
    ``RELEASES`` is self-checked on ``device`` (default: the current CUDA device) if it was not yet."""
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
    """H3's qkv/fc1 input (5,376), out input (7,168), fc2 input (SwiGLU to 14,336) (the quantiser variants sampling
    compiles anyway); rows ``min_rows`` (the fewest the route takes), 77, 300 (off the GEMM's tiles)."""
    return (Sample(min_rows, 5376, 384), Sample(77, 7168, 256), Sample(300, 14336, 256, "swiglu"),
            Sample(77, 5376, 256, bias=True))


def self_check(device, min_rows: int) -> str | None:
    """Now (not memoised): None where the route (``int8_linear.routed_or_reason``) gives stock's call's bits on every
    sample (random inputs from a generator of their own); else what went wrong, on which sample."""
    from . import int8_linear  # the route reads this table: taken when a check runs

    device = gpu.exact_device(device)
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), torch.no_grad():
            problem = next(filter(None, (_sample_problem(int8_linear, device, seed, sample)
                                         for seed, sample in enumerate(samples(min_rows)))), None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except Exception as exc:  # the device itself failing: stock's call is the safe answer
        problem = f"{type(exc).__name__}: {exc}"
    return problem


def _sample_problem(route, device, seed: int, sample: Sample) -> str | None:
    g = torch.Generator(device=device).manual_seed(seed)
    try:
        cols = sample.width * (2 if sample.input_act == "swiglu" else 1)
        x = (2 * torch.randn(sample.rows, cols, generator=g, device=device)).bfloat16()
        w = torch.randint(-127, 128, (sample.out_features, sample.width), generator=g, device=device, dtype=torch.int8)
        bias = torch.randn(sample.out_features, generator=g, device=device).bfloat16() if sample.bias else None
        w_scale = torch.tensor(2e-3, device=device)
        want = route.stock_int8_linear(x, w, w_scale, bias, input_act=sample.input_act)
        got = route.routed_or_reason(x, w, w_scale, bias, input_act=sample.input_act)
    except Exception as exc:  # whatever broke, stock's call is the safe answer
        return f"{type(exc).__name__} on {sample}: {exc}"
    if isinstance(got, str):
        return f"the route declined {sample}: {got}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"the route gave {got.dtype} {tuple(got.shape)} for stock's {want.dtype} {tuple(want.shape)} on {sample}"
    if not torch.equal(got, want):
        return f"{int((got != want).sum())} of {want.numel()} outputs differ from stock's on {sample}"
    return None


@functools.cache
def kitchen_cuda():
    """(comfy-kitchen's CUDA backend module, None), or (None, why the route cannot use it); asked once a process."""
    version, release, _ = installed_release()
    if version is None:
        return None, "comfy-kitchen is not installed"
    try:
        cuda = importlib.import_module("comfy_kitchen.backends.cuda")
    except Exception as exc:
        return None, f"comfy-kitchen's CUDA backend does not import ({type(exc).__name__}: {exc})"
    if not getattr(cuda, "_EXT_AVAILABLE", False) or not hasattr(getattr(cuda, "_C", None), "cutlass_int8_dequant"):
        return None, "comfy-kitchen's CUDA extension (its CUTLASS int8 GEMM) is not loaded"
    needed = CUDA_HELPERS + ((BIAS_HELPER,) if release.bias_in_out_dtype else ())
    missing = [name for name in needed if not hasattr(cuda, name)]
    if missing:
        return None, f"comfy-kitchen {version}'s CUDA backend has no {', '.join(missing)}, which the route calls"
    return cuda, None


def kitchen_gemm(xq: torch.Tensor, x_scale: torch.Tensor, qdata: torch.Tensor, w_scale: torch.Tensor, bias,
                 out_dtype: torch.dtype) -> torch.Tensor | None:
    """comfy-kitchen's CUTLASS int8 GEMM as its ``int8_linear`` calls it; None where CUTLASS declines the shape."""
    cuda, why = kitchen_cuda()
    if cuda is None:
        raise RuntimeError(why)
    n, device = qdata.shape[0], xq.device
    out = torch.empty(xq.shape[0], n, dtype=out_dtype, device=device)
    ws = cuda._int8_weight_scale_arg(w_scale, device)
    ws = ws if ws.numel() == n else ws.expand(n).contiguous()
    if bias is None:
        bias_arg = cuda._empty_cuda_tensor(device, out_dtype)
    elif installed_release()[1].bias_in_out_dtype:
        bias_arg = getattr(cuda, BIAS_HELPER)(bias, device, out_dtype)
    else:  # fp32 from the bias cast to the output dtype
        bias_arg = bias.to(device=device, dtype=out_dtype).contiguous().to(torch.float32).contiguous()
    wrap = cuda._wrap_for_dlpack
    used = cuda._C.cutlass_int8_dequant(wrap(xq), wrap(qdata.contiguous()), wrap(x_scale), wrap(ws), wrap(bias_arg),
                                        wrap(out), DTYPE_CODES[out_dtype], torch.cuda.current_stream(device).cuda_stream)
    return out if used else None
