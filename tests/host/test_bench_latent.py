"""The harness's empty-latent fallback (used where torchaudio is missing) equals ComfyUI's node."""

from __future__ import annotations

import builtins

import pytest
import torch




@pytest.mark.parametrize("width, height, frames", [(1344, 768, 124), (64, 64, 5), (512, 320, 50)])
def test_fallback_latent_equals_the_node_latent(comfy_inprocess, monkeypatch, width, height, frames):  # noqa: F811
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from benchmarks import sections

    bench = sections.Bench(device=torch.device("cpu"), base=None, clones={}, patches={}, conditioning=None,
                           width=width, height=height, frames=frames, seed=0, block_indices=[0])
    node = EmptyMiniMaxH3LatentAV.execute(width, height, frames)[0]["samples"]
    assert sections.empty_av_latent(bench)["samples"].unbind()[0].shape == node.unbind()[0].shape
    assert bench.latent_source.startswith("EmptyMiniMaxH3LatentAV")

    real_import = builtins.__import__

    def no_h3_nodes(name, *args, **kwargs):
        if name == "comfy_extras.nodes_minimax_h3":
            raise ImportError("No module named 'torchaudio'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_h3_nodes)
    built = sections.empty_av_latent(bench)["samples"]
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert "torchaudio" in bench.latent_source
    for ours, theirs in zip(built.unbind(), node.unbind()):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype and torch.equal(ours, theirs)
