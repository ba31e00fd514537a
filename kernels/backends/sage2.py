"""SageAttention 2.x ``sageattn`` (CUDA): any strides with a contiguous last dim, contiguous NHD out, int32 offsets."""

from __future__ import annotations

import importlib

import torch

from .. import gpu, sage2_quant
from . import sage2_binding
from .base import INT32_MAX_OFFSET, YES, AttentionBackend, Prepared, Verdict, no
from .sage2_selftest import self_test

SUPPORTED_CAPABILITIES = {(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (12, 1)}
# sm90's TMA descriptors take int32 strides (past 2**31 the process aborts): head chunks keep them below.
TMA_MAX_SPAN = 2**31 - 1
# Heads a launch of the kernel takes from LAUNCH_SPLIT_TOKENS tokens on (each head's output is its own: any split
# gives the same bits). On an H100 at its power cap, H3's 56 heads at 149,936 tokens ran 1.3% faster as 4 launches
# of 14 than as one (the card held a higher clock over them: 1,572 against 1,549 MHz, each run on its own for 8 s);
# at 37,810 tokens, interleaved, as fast. Shorter sequences (fewer waves a launch) keep one launch.
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
    major = 2 if hasattr(module, "sageattn_qk_int8_pv_fp16_cuda") else 1
    return module, major


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
        """On a device with a SageAttention 2 kernel for its capability, trusted once the binding probe and the
        numerical self-test have passed there."""
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
            if projection.k is None or tuple(projection.k.shape) != (seq, inner):
                raise ValueError(f"K taken ahead must be [{seq}, {inner}]")
            k_all = projection.k.view(1, seq, heads, d)
        else:
            if tuple(kv.shape) != (seq, 2 * inner):
                raise ValueError(f"kv buffer is {list(kv.shape)}, expected [{seq}, 2*{heads}*{d}]")
            k_all, v = kv.unflatten(1, (2, heads, d)).unsqueeze(0).unbind(2)
        ops = sage2_quant.RowOperands(seq, heads, projection.device, mode=mode)
        chunks = sage2_quant.projected_chunks(seq, chunk, by_columns)
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
        del v
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
            # head-major [hc, S, D] as NHD views [1, S, hc, D]: the batch stride is one chunk's span (< 2**31)
            qv = p["q_int8"][h0:h1].permute(1, 0, 2).unsqueeze(0)
            kv = p["k_int8"][h0:h1].permute(1, 0, 2).unsqueeze(0)
            vv = p["v_fp8"][h0:h1].permute(1, 0, 2).unsqueeze(0)  # [1, D, hc, S_pad]
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
    """Split heads so that each chunk's span in every head-major buffer stays below 2**31."""
    per_head = head_dim * sage2_quant.padded_len(seq)
    most = max(1, TMA_MAX_SPAN // per_head)
    n = -(-heads // most)
    size = -(-heads // n)
    return tuple((h0, min(heads, h0 + size)) for h0 in range(0, heads, size))
