"""The attention dataflow around the back-ends.

``strided_nhd`` (this pack's path)::

    qkv [S, 3*H*D] --view--> Q, K, V [1, S, H, D] (row stride 3*H*D, no copy)
        --comfy-kitchen RMSNorm+RoPE in place on Q, K--> back-end(layout="NHD")
        --> contiguous [1, S, H, D] --view--> [S, H*D] for out_proj

``hnd`` (the reference baseline, kept for A/B runs): the same norm+rope, then
contiguous [1, H, S, D] copies of Q, K and V, the back-end in HND, and a
transposed copy of the output to [S, H*D]. On the same kernel both give the same
bits: only where the numbers live in memory differs.
"""

from __future__ import annotations

import torch

from .chain import BackendChain, CallRecord, Skip, raise_if_context_lost
from .qk_transform import check_rope_table, norm_rope

LAYOUTS = ("strided_nhd", "hnd")

# How a back-end's fast path (today: sage2 on sm90) prepares its quantised operands:
#   exact   - comfy-kitchen norm+rope in place first, then the pack's fused quantisation; same bits as sageattn
#   fused   - per-head RMSNorm and the split-half rotation folded into the quantisation passes
#   rotated - exact, plus Q and K rotated along head_dim (normalised Hadamard) before the int8 step
PREP_MODES = ("exact", "fused", "rotated")


def split_fused_qkv(qkv: torch.Tensor, heads: int, head_dim: int):
    """Q, K, V as [1, S, H, D] views of the fused projection output; no data is copied."""
    if qkv.dim() != 2:
        raise ValueError(f"fused qkv must be [S, 3*heads*head_dim], got {qkv.dim()}-D {list(qkv.shape)}")
    inner = heads * head_dim
    if qkv.shape[1] != 3 * inner:
        raise ValueError(f"fused qkv has {qkv.shape[1]} columns, expected 3*{heads}*{head_dim} = {3 * inner}")
    if qkv.stride(1) != 1:
        raise ValueError("fused qkv must have a contiguous last dim")
    q, k, v = qkv.unflatten(1, (3, heads, head_dim)).unsqueeze(0).unbind(2)
    return q, k, v


def token_major(out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B, S, H, D] NHD output -> [B*S, H*D], as a view when its memory is already token-major.

    Returns (tensor, copies made): 0 when it is a view, 1 when a copy was needed.
    """
    b, s, h, d = out.shape
    if out.is_contiguous():
        return out.view(b * s, h * d), 0
    return out.reshape(b * s, h * d), 1


def attention_from_fused_qkv(qkv, heads: int, head_dim: int, *, chain: BackendChain,
                             layout: str = "strided_nhd", rope_table: torch.Tensor | None = None,
                             q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                             eps: float = 1e-6, q_norm=None, k_norm=None, inplace: bool = True,
                             scale: float | None = None, prep_mode: str = "exact") -> tuple[torch.Tensor, CallRecord]:
    """Attention of one fused qkv projection; returns ([S, heads*head_dim], CallRecord).

    ``qkv`` is the [S, 3*heads*head_dim] projection, or a one-element list holding it: the list
    hands the buffer over, so that on a back-end's prepared-operand fast path it is freed before the
    attention kernel runs (a plain argument stays alive in the caller's frame until the call returns).

    With ``rope_table`` the per-head RMSNorm (weights ``q_weight``/``k_weight``) and the partial
    split-half rotation run through comfy-kitchen, in place on the views unless ``inplace`` is
    False. Without it ``q_norm``/``k_norm`` are applied to [S, H, D] views (no rotation).
    The fused buffer's Q and K are overwritten (and, with sage1, K is mean-shifted) by design.

    ``prep_mode`` picks how a fast path prepares its operands (strided_nhd only, see PREP_MODES);
    where no fast path runs it changes nothing, and the record's ``fast_path`` stays empty.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if prep_mode not in PREP_MODES:
        raise ValueError(f"prep_mode must be one of {PREP_MODES}, got {prep_mode!r}")
    if isinstance(qkv, list):
        qkv = qkv.pop()
    q, k, v = split_fused_qkv(qkv, heads, head_dim)
    if rope_table is not None:
        if q_weight is None or k_weight is None:
            raise ValueError("q_weight and k_weight are required with a rope table")
        check_rope_table(rope_table, q.shape[1], head_dim)
    elif q_norm is None or k_norm is None:
        raise ValueError("q_norm and k_norm are required without a rope table")

    fast, skipped, no_fast_path = None, [], ""
    if layout == "strided_nhd" and inplace:
        fast, skipped, no_fast_path = chain.fast_path(q, k, v, layout="NHD")
    fold_norm = fast is not None and prep_mode == "fused" and rope_table is not None
    if not fold_norm:
        q, k = _normalise(q, k, rope_table, q_weight, k_weight, eps, q_norm, k_norm, inplace)

    earlier: tuple[Skip, ...] = ()
    if fast is not None:
        backend = fast
        norm = dict(rope_table=rope_table, q_weight=q_weight, k_weight=k_weight, eps=eps) if fold_norm else {}
        mode = prep_mode if (prep_mode != "fused" or fold_norm) else "exact"
        try:
            prepared = backend.prepare(q, k, v, mode=mode, scale=scale, **norm)
        except Exception as exc:
            raise_if_context_lost(exc)
            no_fast_path = f"{backend.name} fast path raised {type(exc).__name__}: {exc}"
            earlier = (Skip(f"{backend.name} fast path", no_fast_path, "raised"),)
            if fold_norm:
                q, k = _normalise(q, k, rope_table, q_weight, k_weight, eps, q_norm, k_norm, inplace)
        else:
            # Nothing below reads the bf16 buffer: drop every reference so the kernel's working set
            # replaces it instead of adding to it (freed here when the caller handed it over).
            del q, k, v, qkv
            out = backend.attend(prepared)
            chunks = len(prepared.head_chunks)
            del prepared
            record = chain.record(backend, skipped, fast_path=f"{backend.name} prepared operands ({mode})",
                                  head_chunks=chunks)
            record.layout = layout
            flat, record.copies = token_major(out)
            return flat, record

    out, record = attention_nhd(q, k, v, chain=chain, layout=layout, scale=scale)
    flat, copies = token_major(out)
    record.copies += copies
    record.skipped = earlier + record.skipped
    record.fast_path_skipped = no_fast_path
    return flat, record


def _normalise(q, k, rope_table, q_weight, k_weight, eps, q_norm, k_norm, inplace):
    if rope_table is not None:
        return norm_rope(q, k, rope_table, q_weight, k_weight, eps, inplace=inplace)
    return q_norm(q[0]).unsqueeze(0), k_norm(k[0]).unsqueeze(0)


def attention_nhd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chain: BackendChain,
                  layout: str = "strided_nhd", mask=None, scale: float | None = None):
    """Attention on NHD [B, S, H, D] q/k/v (views with any strides); returns (NHD output, CallRecord).

    ``strided_nhd`` hands the views to the back-end as they are. ``hnd`` (the baseline) makes
    contiguous [B, H, S, D] copies first (none for inputs already head-major in memory) and returns
    the HND output as an NHD view, so the caller's token-major step makes the baseline's output copy.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "strided_nhd":
        out, record = chain.run(q, k, v, layout="NHD", scale=scale, mask=mask)
    else:
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out, record = chain.run(qh, kh, vh, layout="HND", scale=scale, mask=mask)
        record.copies += sum(a.data_ptr() != b.data_ptr() for a, b in zip((qh, kh, vh), (q, k, v)))
        out = out.transpose(1, 2)
    record.layout = layout
    return out, record


def attention_token_major(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, *,
                          chain: BackendChain, layout: str = "strided_nhd", mask=None, scale: float | None = None):
    """Attention on token-major [B, S, H*D] q/k/v (how most ComfyUI models call attention).

    They are viewed NHD [B, S, H, D] with no copy, and the back-end's NHD output is viewed back
    to [B, S, H*D]. Returns (output, CallRecord).
    """
    b, s, inner = q.shape
    if inner % heads:
        raise ValueError(f"{inner} channels do not split into {heads} heads")
    d = inner // heads
    qn, kn, vn = (t.view(t.shape[0], t.shape[1], heads, d) for t in (q, k, v))
    out, record = attention_nhd(qn, kn, vn, chain=chain, layout=layout, scale=scale, mask=mask)
    flat, copies = token_major(out)
    record.copies += copies
    return flat.view(b, s, inner), record
