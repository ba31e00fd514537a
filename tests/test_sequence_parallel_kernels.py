"""kernels/ulysses.py on CPU: real gloo process groups, random fused qkv, uneven sequence lengths.

Each rank attends over its rows of one random fused qkv buffer; the concatenated rank
outputs must equal the single-process strided NHD path on the whole buffer.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels import BackendChain, attention_from_fused_qkv
from kernels import ulysses

HEADS, HEAD_DIM, ROT = 4, 32, 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, fn, args, out_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args):
    """Run ``fn(rank, world, *args)`` in ``world`` processes joined in a gloo group; return results by rank.

    Forked, not spawned: the children inherit the imported modules (and any model built
    before the call), which keeps a 4-rank test to seconds on a 2-core CI machine. CPU only.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=True,
                           start_method="fork")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def make_inputs(seq: int, seed: int):
    from conftest import make_rope_table
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(seq, 3 * HEADS * HEAD_DIM, generator=g)
    table = make_rope_table(seq, ROT, generator=g)
    qw = 1.0 + 0.1 * torch.randn(HEAD_DIM, generator=g)
    kw = 1.0 + 0.1 * torch.randn(HEAD_DIM, generator=g)
    return qkv, table, qw, kw


def _ulysses_rank(rank, world, seqs, seed):
    return [_ulysses_one(rank, world, seq, seed) for seq in seqs]


def _ulysses_one(rank, world, seq, seed):
    qkv, table, qw, kw = make_inputs(seq, seed)
    start, stop = ulysses.shard_bounds(seq, world)[rank]
    local = qkv[start:stop].clone()
    out, rec = ulysses.ulysses_attention_from_fused_qkv(
        local, HEADS, HEAD_DIM, chain=BackendChain.for_choice("sdpa"), seq_len=seq,
        rope_table=table[:, start:stop], q_weight=qw, k_weight=kw, eps=1e-6)
    return {"out": out, "rows": (start, stop), "backend": rec.backend, "copies": rec.copies}


def _reference(seq, seed):
    qkv, table, qw, kw = make_inputs(seq, seed)
    out, _ = attention_from_fused_qkv(qkv, HEADS, HEAD_DIM, chain=BackendChain.for_choice("sdpa"),
                                      rope_table=table, q_weight=qw, k_weight=kw, eps=1e-6)
    return out


@pytest.mark.parametrize("world,seqs", [(2, (37, 64)), (4, (23, 61, 64))])
def test_ulysses_matches_single_process_attention(world, seqs):
    """Uneven (37, 23, 61) and even (64) sequences; one process group per world size."""
    pytest.importorskip("comfy_kitchen")
    per_rank = run_ranks(_ulysses_rank, world, seqs, 7)
    for i, seq in enumerate(seqs):
        ranks = [r[i] for r in per_rank]
        ref = _reference(seq, 7)
        assert [r["rows"] for r in ranks] == ulysses.shard_bounds(seq, world)
        got = torch.cat([r["out"] for r in ranks])
        assert got.shape == ref.shape
        diff = (got - ref).abs().max().item()
        print(f"world={world} S={seq}: max abs diff vs single process {diff:.3e}")
        assert diff < 1e-5, f"world {world}, S {seq}: sequence-parallel attention differs by {diff}"
        assert all(r["backend"] == "sdpa" for r in ranks)
        assert all(r["copies"] == ulysses.ULYSSES_COPIES_PER_CALL for r in ranks)


def test_shards_cover_the_sequence_unevenly():
    assert ulysses.shard_sizes(10, 4) == [3, 3, 2, 2]
    assert ulysses.shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    shard = ulysses.SequenceShard(seq_len=37_810, world=8, rank=7)
    assert (shard.start, shard.stop) == (37_810 - 37_810 // 8, 37_810)
    with pytest.raises(ulysses.SequenceParallelConfigError, match="cannot be split"):
        ulysses.shard_sizes(3, 4)


@pytest.mark.parametrize("world", [3, 5, 6, 16])
def test_world_size_must_divide_heads(world):
    with pytest.raises(ulysses.SequenceParallelConfigError, match="1, 2, 4, 7, 8, 14, 28, 56"):
        ulysses.check_world_size(56, world)


@pytest.mark.parametrize("world", [1, 2, 4, 7, 8])
def test_h3_world_sizes_are_accepted(world):
    ulysses.check_world_size(56, world)


def _bad_world_rank(rank, world):
    qkv = torch.randn(4, 3 * 3 * 8)
    try:
        ulysses.ulysses_attention_from_fused_qkv(qkv[rank * 2:rank * 2 + 2], 3, 8, chain=BackendChain.for_choice("sdpa"),
                                                 seq_len=4, q_norm=lambda t: t, k_norm=lambda t: t)
    except ulysses.SequenceParallelConfigError as exc:
        return str(exc)
    return None


def test_attention_refuses_heads_not_divisible_by_world():
    messages = run_ranks(_bad_world_rank, 2)
    assert all(m and "cannot split 3 attention heads" in m for m in messages), messages
