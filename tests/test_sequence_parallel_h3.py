"""Sequence parallel H3 on CPU: ComfyUI's real MiniMaxH3Model, gloo groups of 2 and 4 processes.

A tiny random-weight H3 (4 heads so that 4 ranks split them) runs its whole forward once in
this process with stock attention, then in every rank with nodes/sequence_parallel.py's
patch. Each rank must return the single-process output within float reduction-order
tolerance. The packed sequence (23 rows) splits unevenly over 2 and over 4 ranks.
"""

from __future__ import annotations

import pytest
import torch

from host_fixtures import _randomise, comfy_inprocess, patcher_for  # noqa: F401  (fixture)
from test_sequence_parallel_kernels import run_ranks

TINY_SP_H3 = dict(hidden_size=64, num_layers=3, token_refiner_num_layers=1, num_attention_heads=4,
                  attention_head_dim=32, ffn_hidden_size=128, text_dim=32, timestep_input_dim=64,
                  time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=4)
TEXT, T, H, W, A = 5, 2, 4, 6, 3     # 5 text + 2*2*3 video + 2*3 audio = 23 packed rows
TOL = 1e-5


@pytest.fixture(scope="module")
def pack(comfy_inprocess):
    import importlib
    importlib.import_module(f"{comfy_inprocess.__name__}.nodes.sequence_parallel")  # until it is registered
    torch.set_grad_enabled(False)  # ComfyUI samples without autograd; in-place rope requires it
    yield comfy_inprocess
    torch.set_grad_enabled(True)


def tiny_model(seed=11):
    import comfy.ldm.minimax.model as h3
    import comfy.ops
    model = h3.MiniMaxH3Model(**TINY_SP_H3, dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init)
    return _randomise(model, seed)


def inputs(seed=12):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 24, T, H, W, generator=g)
    audio = torch.randn(1, 32, 2, A, generator=g)
    context = torch.randn(1, TEXT, TINY_SP_H3["text_dim"], generator=g)
    return [video, audio], torch.tensor([700.0]), context


def forward(diffusion_model, transformer_options):
    x, timestep, context = inputs()
    video, audio = diffusion_model(x, timestep, context, transformer_options=transformer_options)
    return torch.cat([video.flatten(), audio.flatten()])


def _parallel_rank(rank, world, pack, patcher, after_sage=False):
    if after_sage:  # the Sage Strided NHD node first: its chain must be the one each rank runs
        patcher, _ = pack.nodes.h3_patch.patch_model(patcher, "strided_nhd", "sdpa")
    clone, summary = pack.nodes.sequence_parallel.patch_model(patcher, world, "auto")
    clone.patch_model(load_weights=False)  # applies the object patches, as ComfyUI does before sampling
    try:
        out = forward(clone.model.diffusion_model, clone.model_options["transformer_options"])
    finally:
        clone.unpatch_model()
    pack.nodes.report._prompt_server = lambda: None  # no server here; skip importing ComfyUI's server module
    report = summary["report"].payload()
    return {"out": out, "sp": summary["sequence_parallel"], "calls": report["attention_calls"],
            "backends": report["backends_ran"], "messages": report["messages"]}


@pytest.mark.parametrize("world,after_sage", [(2, False), (4, False), (2, True)])
def test_sequence_parallel_forward_equals_single_process(pack, world, after_sage):
    model = tiny_model()
    reference = forward(model, {})  # stock H3 with PyTorch attention, one process
    ranks = run_ranks(_parallel_rank, world, pack, patcher_for(model), after_sage)
    for rank, r in enumerate(ranks):
        diff = (r["out"] - reference).abs().max().item()
        print(f"world={world} rank={rank}: max abs diff vs single process {diff:.3e} "
              f"(output max abs {reference.abs().max().item():.3f})")
        assert diff < TOL, f"rank {rank} of {world}: output differs from the single-process forward by {diff}"
        assert r["sp"]["chain_from"] == ("Sage Strided NHD Attention node" if after_sage else "this node (auto)")
        assert r["sp"]["world_size"] == world and r["sp"]["rank"] == rank and r["sp"]["heads_per_rank"] == 4 // world
        assert r["calls"] == TINY_SP_H3["num_layers"] and r["backends"] == {"sdpa": TINY_SP_H3["num_layers"]}
    assert any("sequence parallel (Ulysses) on" in m for m in ranks[0]["messages"])


def test_segments_are_rebased_to_local_rows(pack):
    sp = pack.nodes.sequence_parallel
    segments = [(0, 5, 3), (5, 11, 5), (11, 23, 0)]
    assert sp.local_segments(segments, 0, 6) == [(0, 5, 3), (5, 6, 5)]
    assert sp.local_segments(segments, 6, 12) == [(0, 5, 5), (5, 6, 0)]
    assert sp.local_segments(segments, 17, 23) == [(0, 6, 0)]


def test_world_size_must_divide_heads(pack):
    with pytest.raises(pack.kernels.ulysses.SequenceParallelConfigError, match="cannot split 4 attention heads"):
        pack.nodes.sequence_parallel.patch_model(patcher_for(tiny_model()), 3)


def test_without_a_process_group_the_node_refuses_clearly(pack):
    with pytest.raises(pack.nodes.sequence_parallel.SequenceParallelError, match="one process per GPU"):
        pack.nodes.sequence_parallel.patch_model(patcher_for(tiny_model()), 2)


def test_world_size_one_passes_the_model_through(pack):
    mp = patcher_for(tiny_model())
    clone, summary = pack.nodes.sequence_parallel.patch_model(mp, 1)
    assert clone.object_patches == {} and summary["sequence_parallel"] == {"world_size": 1, "patched": False}


def _sage_after_sp_rank(rank, world, pack, patcher):
    clone, _ = pack.nodes.sequence_parallel.patch_model(patcher, world, "sdpa")
    try:
        pack.nodes.h3_patch.patch_model(clone, "strided_nhd", "sdpa")
    except pack.nodes.conflicts.PatchConflictError as exc:
        return str(exc)
    return None


def test_sage_node_after_sequence_parallel_refuses(pack):
    """Replacing the Ulysses forwards while the blocks stay sharded would attend over local rows only."""
    messages = run_ranks(_sage_after_sp_rank, 2, pack, patcher_for(tiny_model()))
    assert all(m and "already replaced" in m for m in messages), messages
