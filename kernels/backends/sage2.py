"""SageAttention 2.x ``sageattn`` (CUDA): any strides with a contiguous last dim, contiguous NHD out, int32 offsets."""

from __future__ import annotations

import importlib

import torch

from .. import gpu, sage2_quant
from ..offsets import token_chunks
from . import sage2_binding
from .base import INT32_MAX_OFFSET, YES, AttentionBackend, Prepared, Verdict, no
from .sage2_selftest import self_test

SUPPORTED_CAPABILITIES = {(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)}
# Heads a launch of the kernel takes from LAUNCH_SPLIT_TOKENS tokens on: the same bits (each head's output is its
# own), faster at H3's longest sequences on an H100 at its power cap (docs/BENCHMARKS.md).
LAUNCH_HEADS, LAUNCH_SPLIT_TOKENS = 14, 37810
# The kernel writes its bf16 output through uint32 element offsets (row * stride_seq + head * D).
OUTPUT_MAX_OFFSET = 2**32 - 1
# Where SageAttention is self-tested before it is trusted: its kernels run on CUDA only (the CPU tests add "cpu").
SELF_TESTED_DEVICES = ("cuda",)


def installed_sageattention():
    """The importable ``sageattention`` module and its major version, or (None, reason)."""
    try:
        module = importlib.import_module("sageattention")
    except Exception as exc:  # ImportError, or a broken build raising on import
        return None, f"sageattention not importable ({type(exc).__name__}: {exc})"
    # 2.x ships the compiled CUDA entry points; 1.0.x is Triton only.
    return module, 2 if hasattr(module, "sageattn_qk_int8_pv_fp16_cuda") else 1


class Sage2Backend(AttentionBackend):
    """``sageattn`` for every call it supports; on sm90 also the prepared path."""

    name = "sage2"
    max_element_offset = INT32_MAX_OFFSET
    row_block = 128
    dtypes = (torch.float16, torch.bfloat16)
    max_head_dim = 128
    prepared_modes = tuple(sage2_quant.MODES)
    prepares_projected = True

    def _check_available(self):
        module, major = installed_sageattention()
        if module is None:
            return no("not_installed", major)
        if major != 2:
            return no("wrong_version", "installed sageattention is 1.x (PyPI); SageAttention 2 must be built from "
                                       "source or a wheel")
        self._sageattn = module.sageattn
        return YES

    def _check_device(self, device):
        if device.type not in SELF_TESTED_DEVICES:
            return YES
        cap = gpu.capability(device)
        if cap not in SUPPORTED_CAPABILITIES:
            got = "a GPU that is not NVIDIA's" if cap is None else f"compute capability {cap[0]}.{cap[1]}"
            return no("gpu_arch", f"no SageAttention 2 kernel for {got}")
        return self_test(self, device)

    def __call__(self, q, k, v, *, layout, scale=None, mask=None):
        return self._sageattn(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=scale)

    def prepared_verdict(self, q, k, v) -> Verdict:
        """Can ``prepare`` take these NHD views (no mask)? Asked after ``available`` and ``supports``."""
        cap = gpu.capability(q.device)  # q's own device, not the current one
        if cap != (9, 0):
            got = "no CUDA device" if cap is None else f"{cap[0]}.{cap[1]}"
            return no("gpu_arch", f"prepared path needs sm90 (H100/H200), got {got}")
        if any(t.device.type != "cuda" for t in (q, k, v)):
            return no("no_cuda", "prepared path needs CUDA tensors")
        problem = sage2_quant.operand_problem(q, k, v)
        if problem:
            return no(problem[0], f"prepared path {problem[1]}")
        _, s, h, d = q.shape
        if s * h * d > OUTPUT_MAX_OFFSET:
            return no("too_long", f"S*H*D = {s * h * d} passes the sm90 kernel's 32-bit output offsets")
        if sage2_quant.TRITON_ERROR:
            return no("not_installed", sage2_quant.TRITON_ERROR)
        op, reason = sage2_binding.sm90_attention_op()
        return YES if op is not None else no("not_installed", reason)

    def prepare(self, q, k, v, *, mode="exact", scale=None) -> Prepared:
        """int8 Q/K + fp8 V from NHD [1, S, H, 128] views of normalised Q and K."""
        _, s, h, d = q.shape
        return Prepared(self.name, mode, sage2_quant.quantize_operands(q, k, v, mode=mode),
                        float(d ** -0.5 if scale is None else scale), q.dtype, s, h, d, head_chunks(s, h, d))

    def prepare_projected(self, projection, kv, *, heads, norm, mode="exact", scale=None, chunk=8192) -> Prepared:
        """``prepare``'s bits from a projection taken by token chunks (``norm`` applied per chunk to Q's and K's rows).
        By columns (``kv`` None): K taken ahead as ``projection.k``, Q by ``q_rows(a, b)``, V by ``v()`` once K's
        operand is made and its rows freed. Whole rows: ``rows(a, b)``, K/V copied into ``kv``, then ``release()``."""
        seq, d = projection.seq, sage2_quant.HEAD_DIM
        inner = heads * d
        by_columns = kv is None
        if by_columns:
            k_all = projection.k.view(1, seq, heads, d)
        else:
            k_all, v = kv.unflatten(1, (2, heads, d)).unsqueeze(0).unbind(2)
        ops = sage2_quant.RowOperands(seq, heads, projection.device, mode=mode)
        # chunks start on K blocks (as add_q_rows takes them); by columns a Q row is a third of a whole row
        block, size = sage2_quant.K_BLOCK, chunk * 3 if by_columns else chunk
        chunks = token_chunks(seq, max(block, size // block * block), align=block)
        for a, b in chunks:
            if by_columns:
                rows = projection.q_rows(a, b)
                q, k = rows.view(1, b - a, heads, d), k_all[:, a:b]
            else:
                rows = projection.rows(a, b)
                q, k = rows.unflatten(1, (3, heads, d)).unsqueeze(0).unbind(2)[:2]  # no view left to hold the chunk
            norm.apply_rows(q, k, a)  # raises where the norm cannot be applied by rows
            ops.add_q_rows(q)
            if not by_columns:
                kv[a:b].copy_(rows[:, inner:])
            del rows, q, k
        ops.add_k(k_all)
        if by_columns:
            del k_all
            projection.k = None  # K's rows are freed: V's take their place
            v = projection.v().view(1, seq, heads, d)  # the projection's last product; its input released
        else:
            projection.release()
        ops.add_v(v)
        norm.mark_applied()  # only now: a fallback from a failure before this projects and normalises anew
        return Prepared(self.name, mode, ops.operands(), float(d ** -0.5 if scale is None else scale),
                        projection.dtype, seq, heads, d, head_chunks(seq, heads, d), projected_chunks=len(chunks))

    def attend(self, prepared: Prepared, out=None) -> torch.Tensor:
        """SageAttention 2's sm90 kernel on prepared operands -> contiguous NHD [1, S, H, 128] (``out`` if given)."""
        op, reason = sage2_binding.sm90_attention_op()
        if op is None:
            raise RuntimeError(reason)
        p, s, h, d = prepared.operands, prepared.seq, prepared.heads, prepared.head_dim
        if out is None:
            out = torch.empty(1, s, h, d, dtype=prepared.out_dtype, device=p["q_int8"].device)
        for h0, h1 in launches(prepared.head_chunks, s):
            # [hc, S, D] as NHD views [1, S, hc, D] (V: [1, D, hc, S_pad]): the batch stride is a chunk's span < 2**31
            qv, kv, vv = (p[name][h0:h1].permute(1, 0, 2).unsqueeze(0) for name in ("q_int8", "k_int8", "v_fp8"))
            ov = out if (h0, h1) == (0, h) else out.as_strided((1, s, h1 - h0, d), (h * d, h * d, d, 1),
                                                                out.storage_offset() + h0 * d)
            op(qv, kv, vv, ov, p["q_scale"][:, h0:h1], p["k_scale"][:, h0:h1], p["v_scale"][:, h0:h1],
               0, 0, 3, prepared.sm_scale, 0)
        return out


def launches(chunks, seq: int) -> list:
    """The kernel launches of ``head_chunks`` for ``seq`` tokens, in head order: each at most ``LAUNCH_HEADS`` heads
    from ``LAUNCH_SPLIT_TOKENS`` tokens on, else one a chunk."""
    if seq < LAUNCH_SPLIT_TOKENS:
        return list(chunks)
    return [(a, min(h1, a + LAUNCH_HEADS)) for h0, h1 in chunks for a in range(h0, h1, LAUNCH_HEADS)]


def head_chunks(seq: int, heads: int, head_dim: int = 128) -> tuple:
    """Heads split evenly so that each chunk's span in every head-major buffer stays below 2**31: sm90's TMA
    descriptors take int32 strides (past them the process aborts)."""
    return tuple(token_chunks(heads, max(1, INT32_MAX_OFFSET // (head_dim * sage2_quant.padded_len(seq))), align=1))
