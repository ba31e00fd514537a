"""Ulysses sequence-parallel attention on the strided NHD dataflow (torch.distributed, any backend).

Every rank holds a contiguous slice of the packed sequence. One attention call::

    qkv_local [S_r, 3*H*D]                    (this rank's rows, all heads; the fused projection output)
      --RMSNorm+RoPE in place on the local Q/K views, with the local rows of the rope table
      --pack: [S_r, 3, W, H/W, D] -> [W, S_r, 3, H/W, D]                 (copy 1: all_to_all needs each
                                                                          destination's block contiguous)
      --all_to_all_single (rank r -> rank j: rows S_r, head slice j)
      --> recv [S, 3*(H/W)*D]: a fused qkv buffer of the full sequence for this rank's H/W heads,
          rows in rank order. Q/K/V are strided NHD views of it (last dim contiguous): no copy
      --back-end (layout NHD) --> out [1, S, H/W, D] contiguous
      --all_to_all_single (rank j -> rank r: rows of rank r's slice, head slice j); the send
        chunks are row ranges of the contiguous output, so they are views: no copy
      --> recv [W, S_r, H/W, D] --unpack--> [S_r, W, H/W, D] = [S_r, H*D]   (copy 2: heads back in order)

So each call makes exactly two layout copies (the qkv pack and the output unpack) on top of
the single-GPU strided NHD path, both forced by all_to_all's contiguous per-destination
blocks; the norm+rope, the Q/K/V split and the kernel output stay zero-copy. The two
transfers themselves write into fresh receive buffers.

The per-head RMSNorm and the rotation act on each token's own head vector, so applying
them before the all-to-all (on S_r rows, all heads) equals applying them after.

Uneven sequences (S not divisible by W) use uneven all_to_all splits: rank r owns
``shard_bounds(S, W)[r]``, sizes differ by at most one row, nothing is padded or masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .chain import BackendChain, CallRecord
from .dataflow import split_fused_qkv, token_major
from .qk_transform import norm_rope

# Layout copies one sequence-parallel call adds to the single-GPU strided NHD path (pack + unpack).
ULYSSES_COPIES_PER_CALL = 2


class SequenceParallelConfigError(ValueError):
    """The world size cannot split this attention's heads (or the sequence) across ranks."""


def check_world_size(heads: int, world: int) -> None:
    """Each rank takes heads/world whole heads: world must divide the head count."""
    if world < 1:
        raise SequenceParallelConfigError(f"world size must be at least 1, got {world}")
    if heads % world:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise SequenceParallelConfigError(
            f"{world} ranks cannot split {heads} attention heads evenly (Ulysses gives each rank heads/world "
            f"whole heads); use a world size that divides {heads}: {', '.join(map(str, divisors))}")


def shard_sizes(seq_len: int, world: int) -> list[int]:
    """Rows per rank: as even as possible, the first ``seq_len % world`` ranks take one more."""
    if seq_len < world:
        raise SequenceParallelConfigError(f"a sequence of {seq_len} tokens cannot be split over {world} ranks")
    base, extra = divmod(seq_len, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def shard_bounds(seq_len: int, world: int) -> list[tuple[int, int]]:
    """[start, stop) of every rank's rows of the sequence."""
    bounds, start = [], 0
    for n in shard_sizes(seq_len, world):
        bounds.append((start, start + n))
        start += n
    return bounds


@dataclass(frozen=True)
class SequenceShard:
    """Where this rank's rows sit in the full sequence."""

    seq_len: int
    world: int
    rank: int

    @property
    def sizes(self) -> list[int]:
        return shard_sizes(self.seq_len, self.world)

    @property
    def start(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def stop(self) -> int:
        return self.start + self.sizes[self.rank]

    @property
    def local_len(self) -> int:
        return self.sizes[self.rank]


def _world_and_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def seq_to_heads(qkv_local: torch.Tensor, heads: int, head_dim: int, sizes: list[int], group=None) -> torch.Tensor:
    """[S_r, 3*H*D] local rows, all heads -> [S, 3*(H/W)*D] all rows, this rank's head slice."""
    world, _ = _world_and_rank(group)
    s_local = qkv_local.shape[0]
    local_heads = heads // world
    send = (qkv_local.view(s_local, 3, world, local_heads, head_dim)
            .permute(2, 0, 1, 3, 4).contiguous()            # copy 1: one contiguous block per destination
            .view(world * s_local, 3 * local_heads * head_dim))
    recv = qkv_local.new_empty(sum(sizes), 3 * local_heads * head_dim)
    dist.all_to_all_single(recv, send, output_split_sizes=list(sizes), input_split_sizes=[s_local] * world,
                           group=group)
    return recv


def heads_to_seq(out: torch.Tensor, sizes: list[int], group=None) -> torch.Tensor:
    """[S, H/W, D] all rows, this rank's heads (contiguous) -> [S_r, H*D] local rows, all heads."""
    world, rank = _world_and_rank(group)
    s, local_heads, head_dim = out.shape
    s_local = sizes[rank]
    send = out.view(s, local_heads * head_dim)              # row ranges per destination: views, no copy
    recv = out.new_empty(world * s_local, local_heads * head_dim)
    dist.all_to_all_single(recv, send, output_split_sizes=[s_local] * world, input_split_sizes=list(sizes),
                           group=group)
    # copy 2: [W, S_r, H/W, D] -> [S_r, W, H/W, D], i.e. heads back in model order
    return recv.view(world, s_local, local_heads, head_dim).permute(1, 0, 2, 3).reshape(s_local, -1)


def ulysses_attention_from_fused_qkv(
        qkv_local: torch.Tensor, heads: int, head_dim: int, *, chain: BackendChain, seq_len: int, group=None,
        rope_table: torch.Tensor | None = None, q_weight: torch.Tensor | None = None,
        k_weight: torch.Tensor | None = None, eps: float = 1e-6, q_norm=None, k_norm=None,
        inplace: bool = True, scale: float | None = None) -> tuple[torch.Tensor, CallRecord]:
    """Sequence-parallel attention of this rank's rows; returns ([S_r, heads*head_dim], CallRecord).

    ``qkv_local``: this rank's rows ``shard_bounds(seq_len, world)[rank]`` of the fused qkv
    projection, ``[S_r, 3*heads*head_dim]``. ``rope_table``: the same rows of the table,
    ``[1, S_r, 1, rot/2, 2, 2]``. Norm arguments as in :func:`kernels.attention_from_fused_qkv`.
    Every rank of ``group`` must call this with the same ``seq_len`` and shapes.
    """
    world, rank = _world_and_rank(group)
    check_world_size(heads, world)
    sizes = shard_sizes(seq_len, world)
    if qkv_local.dim() != 2 or qkv_local.shape[0] != sizes[rank]:
        raise ValueError(f"rank {rank} of {world} owns {sizes[rank]} of {seq_len} rows, "
                         f"got qkv {list(qkv_local.shape)}")
    q, k, _ = split_fused_qkv(qkv_local, heads, head_dim)   # also checks columns and last-dim stride
    if rope_table is not None:
        if q_weight is None or k_weight is None:
            raise ValueError("q_weight and k_weight are required with a rope table")
        q2, k2 = norm_rope(q, k, rope_table, q_weight, k_weight, eps, inplace=inplace)
        if not inplace:  # training: new Q/K tensors, so rebuild a fused buffer for the exchange
            qkv_local = torch.cat([q2[0].flatten(1), k2[0].flatten(1), qkv_local[:, 2 * heads * head_dim:]], dim=1)
    else:
        if q_norm is None or k_norm is None:
            raise ValueError("q_norm and k_norm are required without a rope table")
        # the plain per-head norms return new tensors: write them back into the fused buffer
        q.copy_(q_norm(q[0]).unsqueeze(0))
        k.copy_(k_norm(k[0]).unsqueeze(0))

    if world == 1:
        q, k, v = split_fused_qkv(qkv_local, heads, head_dim)
        out, record = chain.run(q, k, v, layout="NHD", scale=scale)
        flat, copies = token_major(out)
        record.copies += copies
        record.layout = "strided_nhd"
        return flat, record

    fused = seq_to_heads(qkv_local, heads, head_dim, sizes, group)
    q, k, v = split_fused_qkv(fused, heads // world, head_dim)
    out, record = chain.run(q, k, v, layout="NHD", scale=scale)
    copies = 0
    if not out.is_contiguous():  # e.g. an HND-only kernel: the exchange needs token-major rows
        out, copies = out.contiguous(), 1
    local = heads_to_seq(out[0], sizes, group)
    record.copies += copies + ULYSSES_COPIES_PER_CALL
    record.layout = "strided_nhd"
    return local, record
