"""Keeping int32-indexed kernels inside their offset range (past 2**31 they silently read and write
the wrong memory: H3's fused-buffer views at S > 99,864): the largest offset a call would form, and
head chunks whose compact copies fit."""

from __future__ import annotations

import torch


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def largest_offset(t: torch.Tensor, seq_dim: int, row_block: int) -> int:
    """Largest element offset from t's data pointer a kernel may form (the sequence extent rounded
    up to the kernel's row tile: tiled kernels form tile offsets before masking the tail)."""
    extent = 0
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if dim == seq_dim:
            size = _round_up(size, row_block)
        extent += (size - 1) * stride
    return extent


def compact_numel(t: torch.Tensor, seq_dim: int, row_block: int) -> int:
    """Elements of a compact copy of t padded to the row tile (the kernel's own buffers)."""
    n = 1
    for dim, size in enumerate(t.shape):
        n *= _round_up(size, row_block) if dim == seq_dim else size
    return n


def fits(tensors, seq_dim: int, row_block: int, limit: int) -> bool:
    """True when every offset into the inputs and into same-shaped kernel buffers stays <= limit."""
    return all(
        largest_offset(t, seq_dim, row_block) <= limit and compact_numel(t, seq_dim, row_block) - 1 <= limit
        for t in tensors
    )


def heads_per_chunk(q: torch.Tensor, k: torch.Tensor, head_dim_index: int, seq_dim: int,
                    row_block: int, limit: int) -> int:
    """Most heads whose compact copies (of q and of k/v) keep every offset <= limit; 0 if not even one."""
    per_head = max(compact_numel(t, seq_dim, row_block) // t.shape[head_dim_index] for t in (q, k))
    return min(q.shape[head_dim_index], (limit + 1) // per_head)
