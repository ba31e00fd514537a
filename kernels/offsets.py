"""How calls are split: head chunks that keep int32-indexed kernels in range (past 2**31 they silently touch
the wrong memory: H3's fused-buffer views at S > 99,864), and even token chunks."""

from __future__ import annotations

import math

import torch


def _padded(t: torch.Tensor, seq_dim: int, row_block: int) -> list[int]:
    """``t``'s sizes, the sequence's rounded up to the row tile: tiled kernels address whole tiles before masking."""
    return [-(-n // row_block) * row_block if dim == seq_dim else n for dim, n in enumerate(t.shape)]


def largest_offset(t: torch.Tensor, seq_dim: int, row_block: int) -> int:
    """Largest element offset a kernel may form into ``t`` (whole row tiles)."""
    return sum((n - 1) * stride for n, stride in zip(_padded(t, seq_dim, row_block), t.stride()))


def fits(tensors, seq_dim: int, row_block: int, limit: int) -> bool:
    """True when every offset into the inputs and into compact kernel buffers of their padded shape stays <= limit."""
    return all(largest_offset(t, seq_dim, row_block) <= limit and math.prod(_padded(t, seq_dim, row_block)) - 1 <= limit
               for t in tensors)


def heads_per_chunk(q: torch.Tensor, k: torch.Tensor, head_dim_index: int, seq_dim: int,
                    row_block: int, limit: int) -> int:
    """Most heads whose compact copies (of q and of k/v) keep every offset <= limit; 0 if not even one."""
    per_head = max(math.prod(_padded(t, seq_dim, row_block)) // t.shape[head_dim_index] for t in (q, k))
    return min(q.shape[head_dim_index], (limit + 1) // per_head)


def token_chunks(rows: int, chunk: int, align: int = 64) -> list[tuple[int, int]]:
    """``[(start, stop)]``: the fewest chunks of at most ``chunk`` rows, equal, rounded up to ``align`` where
    that fits (no small last GEMM); with ``chunk`` a multiple of ``align`` each starts on one."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    size = -(-rows // -(-rows // chunk)) if rows else chunk
    size = min(-(-size // align) * align, chunk)
    return [(a, min(a + size, rows)) for a in range(0, rows, size)]
