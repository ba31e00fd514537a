"""The int8 route's GEMM: ``bf16(fma(acc * x_scale, w_scale, bias))``, the bits of comfy-kitchen's CUTLASS epilogue
(read off its outputs on an H100), ``acc`` the exact int32 sum (exact in any order: the tiling is free). A persistent
Triton kernel (TMA operands, zero-filled past the edges) where it was measured faster than comfy-kitchen's GEMM; on
Hopper ``int8_gemm_sm90``'s warp-specialised kernel (same bits). TMA coordinates are element indices (< 2**31)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging

import torch

from . import gpu, int8_gemm_sm90
from .kitchen import kitchen_gemm
from .triton_support import TRITON_ERROR, fma_rn, grouped_tile, interpreting, round_bf16, tl, triton, version_key

log = logging.getLogger("sage_strided_nhd")


@dataclasses.dataclass(frozen=True)
class GemmConfig:  # the portable kernel's tiling
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8


# measured faster than comfy-kitchen's GEMM at H3's linears (docs/BENCHMARKS.md); other GPUs keep comfy-kitchen's
CONFIGS = {(9, 0): GemmConfig(block_m=128, block_n=256, block_k=128, stages=3, warps=8)}
MEASURED_TRITON = (3, 6)  # the oldest Triton it was measured with (older ones keep comfy-kitchen's GEMM)
# the interpreter's: the CPU tests' shapes cross several tiles in every dimension
INTERPRETER_CONFIG = GemmConfig(block_m=32, block_n=32, block_k=32, stages=1, warps=4, group_m=2)
K_ALIGN = 16  # TMA: the row pitch of an int8 operand must be a multiple of 16 bytes
# the warp-specialised kernel, and the Triton releases whose Gluon it was measured with (Gluon's API moves)
WS_CONFIGS = {(9, 0): int8_gemm_sm90.SM90}
GLUON_TRITON = ((3, 6),)
N_ALIGN = 8  # its TMA store: the row pitch of the bf16 output must be a multiple of 16 bytes
# its first-use check against the portable kernel on another Triton: out_proj's and fc2's (a bias, the gated epilogue)
GLUON_CHECK_SHAPES = ((300, 512, 7168, False, False), (77, 256, 5376, True, True))


if triton is not None:
    @triton.jit
    def _mul_rn(a, b, EMULATE: tl.constexpr):
        """``a * b`` rounded on its own: ``.rn`` keeps the compiler from contracting it into an FMA."""
        if EMULATE:
            return a * b
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _int8_gemm_kernel(a_desc, b_desc, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, M, N, K,
                          stride_out, NUM_PROGRAMS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SCALE_PER_COLUMN: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GATED: tl.constexpr, EMULATE: tl.constexpr):
        """GATED: ``out`` is the residual, ``out += bf16(product) * gate`` (stock's ``addcmul_``, one rounding)."""
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        k_steps = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=True):
            pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
            row0 = pid_m * BLOCK_M
            col0 = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for ks in range(k_steps):
                a = a_desc.load([row0, ks * BLOCK_K])
                b = b_desc.load([col0, ks * BLOCK_K])
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
            rows = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
            cols = col0.to(tl.int64) + tl.arange(0, BLOCK_N)
            row_ok = rows < M
            col_ok = cols < N
            x_scale = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)
            if SCALE_PER_COLUMN:
                w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
            else:
                w_scale = tl.load(w_scale_ptr)
            t = _mul_rn(acc.to(tl.float32), x_scale[:, None], EMULATE)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                y = fma_rn(t, w_scale, bias[None, :], EMULATE)
            else:
                y = _mul_rn(t, w_scale, EMULATE)
            y = round_bf16(y, not EMULATE)
            ok = row_ok[:, None] & col_ok[None, :]
            ptr = out_ptr + rows[:, None] * stride_out + cols[None, :]
            if GATED:  # the product of two bf16 values is exact in fp32: fused or not, one rounding
                gate = tl.load(gate_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                y = round_bf16(tl.load(ptr, mask=ok, other=0.0).to(tl.float32) + y * gate[None, :], not EMULATE)
            tl.store(ptr, y.to(tl.bfloat16), mask=ok)


@dataclasses.dataclass(frozen=True)
class GemmChoice:
    """Whose int8 GEMM runs on a device, why not a faster one, and what its launches need (never asked per call)."""
    kernel: str  # "pack_sm90" (warp-specialised, Gluon), "pack" (portable Triton) or "comfy_kitchen"
    reason: str | None = None  # why not the pack's warp-specialised kernel (None: it runs)
    release: str = "measured"  # the Gluon kernel on this Triton: "measured", or "self_checked" (a first-use bits check)
    device: torch.device | None = None
    tiling: GemmConfig | None = None  # the portable kernel's
    ws_tiling: int8_gemm_sm90.WsConfig | None = None  # the warp-specialised kernel's, where declared
    programs: int = 0  # the most persistent programs: one a streaming multiprocessor


def choice(device, k: int = K_ALIGN, n: int | None = None) -> GemmChoice:
    """The one answer to "whose GEMM, and why" on ``device`` for rows ``k`` wide (``n``: the output width, None: a
    multiple of 8); the Gluon kernel, on an unmeasured Triton, once its bits matched the portable kernel's there."""
    device = gpu.exact_device(device)
    why = gemm_problem(device, k)
    if why is not None:
        return GemmChoice("comfy_kitchen", why, device=device)
    cap = None if interpreting() else gpu.capability(device)
    if cap is None:  # the interpreter: small tiles
        return GemmChoice("pack", "not on a CUDA device", device=device, tiling=INTERPRETER_CONFIG, programs=4)
    pack = GemmChoice("pack", None, "measured", device, CONFIGS[cap], WS_CONFIGS.get(cap), gpu.sm_count(device))
    if pack.ws_tiling is None:
        why = f"warp-specialised kernel measured only on sm90, not sm{cap[0]}{cap[1]}"
        return dataclasses.replace(pack, reason=why)
    if int8_gemm_sm90.GLUON_ERROR is not None:
        return dataclasses.replace(pack, reason=int8_gemm_sm90.GLUON_ERROR)
    measured = version_key(triton.__version__)[:2] in GLUON_TRITON
    why = gpu.ANSWERS.reason("int8_gemm_sm90", device) if measured else gpu.ANSWERS.decide(
        "int8_gemm_sm90", device, lambda: _gluon_bits_check(pack))
    if why is None and n is not None and n % N_ALIGN:
        why = f"outputs {n} wide: its TMA store needs a multiple of {N_ALIGN}"
    return dataclasses.replace(pack, kernel="pack" if why else "pack_sm90", reason=why,
                               release="measured" if measured else "self_checked")


def still_runs(chosen: GemmChoice) -> GemmChoice:
    """``chosen``, or the next kernel down where one failed on its device since."""
    if chosen.kernel == "comfy_kitchen":
        return chosen
    failed = gpu.ANSWERS.reasons(chosen.device)
    if failed.get("int8_gemm"):
        return dataclasses.replace(chosen, kernel="comfy_kitchen")
    if chosen.kernel == "pack_sm90" and failed.get("int8_gemm_sm90"):
        return dataclasses.replace(chosen, kernel="pack")
    return chosen


def gemm_problem(device, k: int) -> str | None:
    """Why no pack GEMM runs on ``device`` for rows ``k`` wide (None: one does)."""
    why = triton_problem()
    if why is not None:
        return why
    device = torch.device(device)
    if not (interpreting() and device.type == "cpu"):
        cap = gpu.capability(device)
        if cap is None:
            return "not on a CUDA device"
        if cap not in CONFIGS:
            measured = ", ".join(f"sm{a}{b}" for a, b in CONFIGS)
            return f"measured faster than comfy-kitchen's GEMM only on {measured}, not on this sm{cap[0]}{cap[1]} GPU"
    why = gpu.ANSWERS.reason("int8_gemm", device)
    if why is None and (k <= 0 or k % K_ALIGN):
        why = f"rows {k} wide: TMA needs a positive multiple of {K_ALIGN}"
    return why


@functools.cache
def triton_problem() -> str | None:
    if triton is None:
        return TRITON_ERROR
    if version_key(triton.__version__) < MEASURED_TRITON and not interpreting():  # the CPU tests run on any
        measured = ".".join(map(str, MEASURED_TRITON))
        return f"Triton {triton.__version__} is older than the {measured} it was measured with"
    if importlib.util.find_spec("triton.tools.tensor_descriptor") is None:
        return f"Triton {triton.__version__} has no host TMA descriptors"
    return None


def _gluon_bits_check(pack: GemmChoice) -> str | None:
    """None where the Gluon kernel gives the portable kernel's bits on ``pack.device``; else why it is kept off."""
    release = f"its Gluon kernel was measured with Triton {', '.join('.'.join(map(str, v)) for v in GLUON_TRITON)}"
    device, g = pack.device, torch.Generator(device=pack.device).manual_seed(0)
    try:
        for m, n, k, with_bias, gated in GLUON_CHECK_SHAPES:
            xq, qdata = (torch.randint(-127, 128, s, generator=g, device=device, dtype=torch.int8)
                         for s in ((m, k), (n, k)))
            x_scale, w_scale = (torch.rand(s, generator=g, device=device) * 1e-2 for s in (m, n))
            bias, gate, out = (torch.randn(*s, generator=g, device=device).bfloat16() if made else None
                               for s, made in (((n,), with_bias), ((n,), gated), ((m, n), True)))
            want = out.clone()
            int8_gemm_sm90.launch(pack.ws_tiling, xq, x_scale, qdata, w_scale, bias, out, min(pack.programs, 8), gate)
            _launch_portable(xq, x_scale, qdata, w_scale, bias, want, gate, pack)
            if not torch.equal(out, want):
                return (f"{release}; on Triton {triton.__version__} it differed from the portable kernel in "
                        f"{int((out != want).sum())} of {m * n} outputs ({m} x {n} x {k})")
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a build or launch failure: the portable kernel runs
        return f"{release}; on Triton {triton.__version__} it failed its check here ({gpu.failure_text(exc)})"
    return None


def _check_operands(xq, x_scale, qdata, w_scale, bias, residual=None, gate=None):
    (m, k), n = xq.shape, qdata.shape[0]
    if xq.dtype != torch.int8 or qdata.dtype != torch.int8 or qdata.shape[1] != k:
        why = (f"needs int8 [m, k] and [n, k] operands, got {xq.dtype} {tuple(xq.shape)} and {qdata.dtype} "
               f"{tuple(qdata.shape)}")
    elif x_scale.dtype != torch.float32 or x_scale.numel() != m:
        why = f"needs {m} fp32 row scales, got {x_scale.dtype} {tuple(x_scale.shape)}"
    elif w_scale.numel() not in (1, n):
        why = f"the weight scale must be one value or {n}, got {tuple(w_scale.shape)}"
    elif bias is not None and bias.numel() != n:
        why = f"the bias must have {n} values, got {tuple(bias.shape)}"
    elif (residual is None) != (gate is None):
        why = "a residual needs its gate, and a gate its residual"
    elif residual is not None and (residual.dtype != torch.bfloat16 or tuple(residual.shape) != (m, n)
                                   or residual.stride(1) != 1 or gate.dtype != torch.bfloat16 or gate.numel() != n):
        why = (f"needs a bf16 [{m}, {n}] residual with a contiguous last dim and {n} bf16 gates, got {residual.dtype} "
               f"{tuple(residual.shape)} and {gate.dtype} {tuple(gate.shape)}")
    else:
        return
    raise ValueError(f"int8 GEMM: {why}")


def _launch(xq, x_scale, qdata, w_scale, bias, out, gate, kernel: GemmChoice):
    """The Gluon kernel where chosen and the output takes its TMA store, else (or where it fails) the portable one."""
    m, n = xq.shape[0], qdata.shape[0]
    # TMA reads from 16-byte aligned starts: a view at an odd storage offset is copied
    xq, qdata = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (xq.contiguous(), qdata.contiguous()))
    x_scale = x_scale.reshape(m).contiguous()
    w_scale = w_scale.to(device=xq.device, dtype=torch.float32).reshape(-1).contiguous()
    bias = bias.to(device=xq.device, dtype=torch.bfloat16).reshape(n).contiguous() if bias is not None else None
    gate = gate.reshape(n).contiguous() if gate is not None else None
    storable = out.data_ptr() % 16 == 0 and (out.stride(0) * out.element_size()) % 16 == 0
    if kernel.kernel == "pack_sm90" and storable:
        cfg = kernel.ws_tiling
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        try:
            return int8_gemm_sm90.launch(cfg, xq, x_scale, qdata, w_scale, bias, out, min(tiles, kernel.programs), gate)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - a build failure of the Gluon kernel: this file's kernel runs
            why = f"its Gluon kernel failed here ({gpu.failure_text(exc)})"
            gpu.ANSWERS.fail("int8_gemm_sm90", kernel.device, why)
            log.warning("[Sage Strided NHD] the warp-specialised int8 GEMM is off on %s: %s", kernel.device, why)
    _launch_portable(xq, x_scale, qdata, w_scale, bias, out, gate, kernel)


def _launch_portable(xq, x_scale, qdata, w_scale, bias, out, gate, kernel: GemmChoice):
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n, cfg = xq.shape, qdata.shape[0], kernel.tiling
    a_desc = TensorDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(qdata, [cfg.block_n, cfg.block_k])
    programs = min(triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), kernel.programs)
    _int8_gemm_kernel[(programs,)](
        a_desc, b_desc, out, x_scale, w_scale, bias if bias is not None else x_scale,
        gate if gate is not None else x_scale, m, n, k, out.stride(0), programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SCALE_PER_COLUMN=w_scale.numel() > 1, HAS_BIAS=bias is not None, GATED=gate is not None,
        EMULATE=interpreting(), num_warps=cfg.warps, num_stages=cfg.stages)


def int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, qdata: torch.Tensor, w_scale: torch.Tensor, bias=None, *,
              residual=None, gate=None, kernel: GemmChoice):
    """``bf16(int32(xq @ qdata.T) * x_scale * w_scale + bias)`` on ``kernel``, a pack kernel; with ``residual`` and
    ``gate``, ``residual.addcmul_(product, gate)``'s bits from the epilogue, ``residual`` returned."""
    _check_operands(xq, x_scale, qdata, w_scale, bias, residual, gate)
    if kernel.kernel == "comfy_kitchen":
        raise ValueError(f"int8 GEMM: {kernel.reason}")
    out = residual if residual is not None else torch.empty(xq.shape[0], qdata.shape[0], dtype=torch.bfloat16,
                                                            device=xq.device)
    if out.numel():
        _launch(xq, x_scale, qdata, w_scale, bias, out, gate, kernel)
    return out


class GemmDeclined(RuntimeError):
    """comfy-kitchen's CUTLASS int8 GEMM declined a shape (stock would then take its cuBLAS path)."""


def gemm(xq, x_scale, qdata, w_scale, bias, out_dtype: torch.dtype, residual=None, *, kernel: GemmChoice):
    """The route's GEMM: ``kernel`` where it still runs, else the next one down; None where CUTLASS declines (nothing
    added). ``residual`` (``PendingResidual``): the product added to it (in the epilogue where it folds), returned
    as ``residual.x``."""
    runs = still_runs(kernel)
    pack = runs if runs.kernel != "comfy_kitchen" and out_dtype == torch.bfloat16 else None
    if residual is None or pack is None or not residual.foldable:
        out = _one_gemm(xq, x_scale, qdata, w_scale, bias, out_dtype, pack)
        return out if out is None or residual is None else residual.apply(out)
    for a, b, gate in residual.claim():  # each segment is added, or the call raises
        if _one_gemm(xq[a:b], x_scale[a:b], qdata, w_scale, bias, out_dtype, pack, residual.x[a:b], gate) is None:
            # reached only where the pack's GEMM failed to build mid-call and CUTLASS then declined: nothing can
            # take these rows back, so the call fails loudly rather than hand on a half-added residual
            raise GemmDeclined(f"CUTLASS declined an int8 GEMM of {b - a} x {qdata.shape[0]} x {qdata.shape[1]} "
                               "after the pack's GEMM failed; the residual's earlier rows were added")
    return residual.x


def _one_gemm(xq, x_scale, qdata, w_scale, bias, out_dtype, pack: GemmChoice | None, residual=None, gate=None):
    """The ``pack`` kernel (None: comfy-kitchen's GEMM; also where it fails); ``residual``: the product added."""
    if pack is not None:
        try:
            return int8_gemm(xq, x_scale, qdata, w_scale, bias, residual=residual, gate=gate, kernel=pack)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # its build or launch failed here: comfy-kitchen's GEMM (stock's bits) from now on
            why = f"it failed on this GPU ({gpu.failure_text(exc)})"
            gpu.ANSWERS.fail("int8_gemm", pack.device, why)
            log.warning("[Sage Strided NHD] the pack's int8 GEMM is off on %s, comfy-kitchen's runs: %s",
                        pack.device, why)
    out = kitchen_gemm(xq, x_scale, qdata, w_scale, bias, out_dtype)
    return out if out is None or residual is None else residual.addcmul_(out, gate)

