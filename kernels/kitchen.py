"""comfy-kitchen as installed: its release, what the pack checked with each release it knows (one table), its CUDA
backend and the CUTLASS int8 GEMM the route calls as its ``int8_linear`` does. (A release outside the table: the
route's own first-use self-check, ``int8_linear.release_problem``.)"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata

import torch

from .triton_support import version_key


@dataclasses.dataclass(frozen=True)
class KitchenRelease:
    """One comfy-kitchen release: what the int8 route mirrors of its CUDA ``int8_linear``, and what the pack checked."""
    version: str
    min_rows: int  # fewer rows: stock runs a GEMV (one row; two rows too since 0.2.36), not the CUTLASS GEMM
    bias_in_out_dtype: bool  # the GEMM's bias operand: in the output dtype, 16-byte aligned (else fp32)
    gpu_verified: bool = True  # the int8 route gave stock's bits on a GPU with it; else it self-checks at first use
    # the pack's RMSNorm+RoPE pass gave its CUDA rms_rope_split_half_'s bits on a GPU (full-width H3 blocks equal to
    # stock's); with any other release comfy-kitchen's own kernel runs: stock's bits by construction
    norm_rope_checked: bool = True


# read from each release's code; 0.2.36 has not run on a GPU here
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
    """(the route's form for ``version``, verified); another: the newest known form not newer (else the oldest)."""
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
    stream = torch.cuda.current_stream(device).cuda_stream
    used = cuda._C.cutlass_int8_dequant(wrap(xq), wrap(qdata.contiguous()), wrap(x_scale), wrap(ws), wrap(bias_arg),
                                        wrap(out), DTYPE_CODES[out_dtype], stream)
    return out if used else None
