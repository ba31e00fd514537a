"""thu-ml SageAttention 2.x (CUDA kernels, built from source or community wheels).

``sageattn`` dispatches on the GPU arch and takes any strides with a contiguous
last dim; with ``tensor_layout="NHD"`` its output is contiguous NHD. It forms
element offsets in int32, so the chain keeps every offset below 2**31.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from .. import sage2_quant
from ..sage2_quant_ref import padded_len
from .base import INT32_MAX_OFFSET, YES, AttentionBackend, Verdict, cuda_capability, no

# Arches sageattn() has a kernel for (it raises on others).
SUPPORTED_CAPABILITIES = {(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)}


def installed_sageattention():
    """The importable ``sageattention`` module and its major version, or (None, reason)."""
    try:
        module = importlib.import_module("sageattention")
    except Exception as exc:  # ImportError, or a broken build raising on import
        return None, f"sageattention not importable ({type(exc).__name__}: {exc})"
    # 2.x ships the compiled CUDA entry points; 1.0.x is Triton only.
    major = 2 if hasattr(module, "sageattn_qk_int8_pv_fp16_cuda") else 1
    return module, major


class Sage2Backend(AttentionBackend):
    name = "sage2"
    max_element_offset = INT32_MAX_OFFSET
    row_block = 128
    dtypes = (torch.float16, torch.bfloat16)
    max_head_dim = 128

    def _check_available(self):
        module, major = installed_sageattention()
        if module is None:
            return no(major)
        if major != 2:
            return no("installed sageattention is 1.x (PyPI); SageAttention 2 must be built from source or a wheel")
        cap = cuda_capability()
        if cap is None:
            return no("no CUDA device")
        if cap not in SUPPORTED_CAPABILITIES:
            return no(f"no SageAttention 2 kernel for compute capability {cap[0]}.{cap[1]}")
        self._sageattn = module.sageattn
        return YES

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        return self._sageattn(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale)

    # -- the sm90 fast path (see the bottom of this module) --

    def fast_path_verdict(self, q, k, v, *, layout, mask=None) -> Verdict:
        """YES when prepare()/attend() can take this call; otherwise the reason (plain sageattn runs)."""
        return _fast_path_verdict(self, q, k, v, layout=layout, mask=mask)

    def prepare(self, q, k, v, *, mode="exact", scale=None, rope_table=None, q_weight=None,
                k_weight=None, eps=None) -> "Prepared":
        """int8 Q/K + fp8 V operands from NHD [1, S, H, 128] views (strided views of one qkv buffer).

        ``exact``/``rotated``: q and k already RMSNorm+RoPE'd (in place). ``fused``/``fused_rotated``:
        pass rope_table [1, S, 1, rot/2, 2, 2], q_weight and k_weight [128] and eps; the passes apply
        them. After it returns the caller may free q, k, v and the buffer they view.
        """
        return _prepare(q, k, v, mode=mode, scale=scale, rope_table=rope_table, q_weight=q_weight,
                        k_weight=k_weight, eps=eps)

    def attend(self, prepared: "Prepared") -> torch.Tensor:
        """SageAttention 2's sm90 kernel on prepared operands -> contiguous NHD [1, S, H, 128]."""
        return _attend(prepared)


# ---------------------------------------------------------------------------------------------
# The sm90 fast path: the pack prepares SageAttention 2's int8/fp8 operands itself (one
# reduction pass and one quantisation pass, kernels/sage2_quant.py) and calls the compiled sm90
# kernel directly. Anything it does not cover goes to plain ``sageattn`` (``__call__`` above).

FAST_PATH_MODES = ("exact", "fused", "rotated", "fused_rotated")
FAST_PATH_DEFAULT_MODE = "exact"
# The sm90 kernel builds its TMA descriptors from int32 strides (create_tensor_map_4D): a
# contiguous NHD int8 buffer's batch stride S*H*D passes 2**31 at S = 299,593 for 56x128 heads,
# and the descriptor set-up then aborts the process. The pack's operands are head-major, so the
# largest stride it hands over is one head chunk's span: chunks keep that below 2**31.
TMA_MAX_SPAN = 2**31 - 1
# The kernel writes its bf16 output through uint32 element offsets (row * stride_seq + head * D).
OUTPUT_MAX_OFFSET = 2**32 - 1


_SM90_OP: list = []  # [(op or None, reason)], filled on first use (a plain list: torch.compile reads it)


def _sm90_attention_op():
    """SageAttention 2's registered sm90 op, or (None, reason). Imported once."""
    if not _SM90_OP:
        try:
            importlib.import_module("sageattention.sm90_compile")
            _SM90_OP.append((torch.ops.sageattention_sm90.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf, ""))
        except Exception as exc:
            _SM90_OP.append((None, "SageAttention's compiled sm90 kernel is not importable "
                                   f"({type(exc).__name__}: {exc})"))
    return _SM90_OP[0]


@dataclass
class Prepared:
    """The sm90 kernel's operands for one attention call (q/k/v and the qkv buffer may be freed)."""

    q_int8: torch.Tensor   # [H, S, D] int8, head-major
    q_scale: torch.Tensor  # [1, H, ceil(S/64) * 32] fp32
    k_int8: torch.Tensor   # [H, S, D] int8 (K minus its per-head mean)
    k_scale: torch.Tensor  # [1, H, ceil(S/128) * 4] fp32
    v_fp8: torch.Tensor    # [H, D, S_pad] float8_e4m3fn, SageAttention's token permutation, zero pad
    v_scale: torch.Tensor  # [1, H, D] fp32
    sm_scale: float
    mode: str
    out_dtype: torch.dtype
    head_chunks: tuple

    @property
    def seq(self) -> int:
        return self.q_int8.shape[1]

    @property
    def heads(self) -> int:
        return self.q_int8.shape[0]


def head_chunks(seq: int, heads: int, head_dim: int = 128) -> tuple:
    """Split heads so that each chunk's span in every head-major buffer stays below 2**31."""
    per_head = head_dim * padded_len(seq)
    most = max(1, TMA_MAX_SPAN // per_head)
    n = -(-heads // most)
    size = -(-heads // n)
    return tuple((h0, min(heads, h0 + size)) for h0 in range(0, heads, size))


def _fast_path_verdict(backend, q, k, v, *, layout, mask=None) -> Verdict:
    avail = backend.available()
    if not avail:
        return avail
    cap = cuda_capability()
    if cap != (9, 0):
        got = "no CUDA device" if cap is None else f"{cap[0]}.{cap[1]}"
        return no(f"fast path needs sm90 (H100/H200), got {got}")
    if layout != "NHD":
        return no(f"fast path takes NHD views, got {layout}")
    if mask is not None:
        return no("fast path takes no attention mask")
    if any(t.device.type != "cuda" for t in (q, k, v)):
        return no("fast path needs CUDA tensors")
    if not (q.dtype == k.dtype == v.dtype == torch.bfloat16):
        return no(f"fast path needs bfloat16 q/k/v, got {q.dtype}/{k.dtype}/{v.dtype}")
    if q.dim() != 4 or q.shape[0] != 1 or not (q.shape == k.shape == v.shape):
        return no(f"fast path needs q, k, v of one shape [1, S, H, 128], got {list(q.shape)}, "
                  f"{list(k.shape)}, {list(v.shape)}")
    if q.shape[-1] != 128:
        return no(f"fast path needs head_dim 128, got {q.shape[-1]}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return no("fast path needs a contiguous last dim")
    _, s, h, d = q.shape
    if s * h * d > OUTPUT_MAX_OFFSET:
        return no(f"S*H*D = {s * h * d} passes the sm90 kernel's 32-bit output offsets")
    if sage2_quant.TRITON_ERROR:
        return no(sage2_quant.TRITON_ERROR)
    op, reason = _sm90_attention_op()
    if op is None:
        return no(reason)
    return YES


def _prepare(q, k, v, *, mode="exact", scale=None, rope_table=None, q_weight=None, k_weight=None,
             eps=None) -> Prepared:
    if mode not in FAST_PATH_MODES:
        raise ValueError(f"unknown sage2 fast-path mode {mode!r}; expected one of {list(FAST_PATH_MODES)}")
    if mode.startswith("fused") and (rope_table is None or q_weight is None or k_weight is None or eps is None):
        raise ValueError(f"mode {mode!r} folds RMSNorm+RoPE into the passes: pass rope_table, q_weight, "
                         "k_weight and eps (or use 'exact' on inputs already normed in place)")
    ops = sage2_quant.quantize_operands(q, k, v, mode=mode, rope_table=rope_table, q_weight=q_weight,
                            k_weight=k_weight, eps=eps)
    _, s, h, d = q.shape
    return Prepared(q_int8=ops["q_int8"], q_scale=ops["q_scale"], k_int8=ops["k_int8"], k_scale=ops["k_scale"],
                    v_fp8=ops["v_fp8"], v_scale=ops["v_scale"],
                    sm_scale=float(d ** -0.5 if scale is None else scale), mode=mode, out_dtype=q.dtype,
                    head_chunks=head_chunks(s, h, d))


def _attend(p: Prepared) -> torch.Tensor:
    op, reason = _sm90_attention_op()
    if op is None:
        raise RuntimeError(reason)
    h, s, d = p.q_int8.shape
    out = torch.empty(1, s, h, d, dtype=p.out_dtype, device=p.q_int8.device)
    for h0, h1 in p.head_chunks:
        # [hc, S, D] head-major -> NHD-shaped views [1, S, hc, D]; the batch stride is one chunk's
        # span (< 2**31), the only stride the kernel would otherwise overflow.
        qv = p.q_int8[h0:h1].permute(1, 0, 2).unsqueeze(0)
        kv = p.k_int8[h0:h1].permute(1, 0, 2).unsqueeze(0)
        vv = p.v_fp8[h0:h1].permute(1, 0, 2).unsqueeze(0)  # [1, D, hc, S_pad]
        if (h0, h1) == (0, h):
            ov = out
        else:
            ov = out.as_strided((1, s, h1 - h0, d), (h * d, h * d, d, 1), out.storage_offset() + h0 * d)
        op(qv, kv, vv, ov, p.q_scale[:, h0:h1], p.k_scale[:, h0:h1], p.v_scale[:, h0:h1],
           0, 0, 3, p.sm_scale, 0)
    return out
