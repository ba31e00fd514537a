"""Stock's video embedding handed back at the first block (nodes/embedding_release.py), in a real ComfyUI 0.33 host on
the CPU: sampling through ComfyUI's nodes gives the same latents bit for bit with and without the release, in both
weight formats; the embedding's storage is empty once the first block has started; nothing is released where another
node replaced the video patch projection, the block path is off or current ComfyUI's Comfy Compiler records the
forward; a reader of a released embedding raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from devkit import h3 as dh

CONFIG = dh.INT8_TINY_H3
SIZE = (64, 64, 5)  # the empty AV latent's width, height and frames (current_comfyui_standins.sample)
TEXT_TOKENS = 8
PROJECTION = "diffusion_model.video_patch_proj.forward"


def conditioning():
    return dh.random_conditioning(TEXT_TOKENS, CONFIG["text_dim"], 3)


def settings(pack, **more):
    return pack.nodes.patch.Settings(backend="sdpa", **more)


@pytest.mark.parametrize("weights", dh.WEIGHT_FORMATS)
def test_sampling_gives_the_same_bits_with_the_embedding_released_at_the_first_block(pack, cur, weights, monkeypatch):
    base = dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, weights)
    with monkeypatch.context() as m:  # the oracle: the same patch without the release
        m.setattr(pack.nodes.h3_patch, "_install_embedding_release", lambda *args: None)
        kept, kept_patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
        want = cur.sample(kept, conditioning(), steps=2, size=SIZE)
    assert kept_patch.embedding is None and PROJECTION not in kept.object_patches

    embeddings, at_block_end = [], []
    release_cls, block_cls = pack.nodes.embedding_release.EmbeddingRelease, pack.nodes.h3_block.H3BlockForward
    project, block_forward = release_cls.__call__, block_cls.__call__

    def recording_projection(self, *args, **kwargs):
        out = project(self, *args, **kwargs)
        embeddings.append(out)
        return out

    def recording_block(self, *args, **kwargs):
        out = block_forward(self, *args, **kwargs)
        at_block_end.append(embeddings[-1].untyped_storage().nbytes())
        return out

    monkeypatch.setattr(release_cls, "__call__", recording_projection)
    monkeypatch.setattr(block_cls, "__call__", recording_block)
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    got = cur.sample(clone, conditioning(), steps=2, size=SIZE)

    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    video_rows, dtype = dh.packed_token_count(*SIZE, TEXT_TOKENS)["video"], base.model.get_dtype_inference()
    assert len(embeddings) == 2  # one per model call (two steps), in the call's dtype (int8 here: fp32, manual cast)
    assert all(e.shape == (video_rows, CONFIG["hidden_size"]) and e.dtype == dtype for e in embeddings)
    assert len(at_block_end) == 2 * CONFIG["num_layers"] and not any(at_block_end)
    assert patch.report.last["memory"]["released_bytes"] == video_rows * CONFIG["hidden_size"] * dtype.itemsize
    assert patch.embedding.dtype is None and patch.embedding.embedding is None  # nothing held past the call


def test_nothing_is_released_where_another_node_replaced_the_projection_or_the_block_path_is_off(pack, cur):
    base = dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "bf16")
    projection = base.get_model_object("diffusion_model.video_patch_proj")
    theirs = base.clone()
    theirs.add_object_patch(PROJECTION, lambda rows: type(projection).forward(projection, rows))
    for model, more in ((theirs, {}), (base, {"block_path": "attention_only"})):
        clone, patch = pack.nodes.h3_patch.patch_model(model, settings(pack, **more))
        assert patch.embedding is None and clone.object_patches.get(PROJECTION) is model.object_patches.get(PROJECTION)
        cur.sample(clone, conditioning(), steps=1, size=SIZE)
        assert (patch.report.last["memory"] or {}).get("released_bytes") is None


def test_nothing_is_released_where_the_comfy_compiler_records_the_forward(pack, cur, monkeypatch):
    """Current ComfyUI's malloc graph: an allocation freed outside the scope that made it fails the graph."""
    import comfy.model_prefetch

    asked = []
    monkeypatch.setattr(comfy.model_prefetch, "malloc_graph_enabled", lambda device: asked.append(device) or True,
                        raising=False)
    base = dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "bf16")
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    cur.sample(clone, conditioning(), steps=1, size=SIZE)
    assert asked == [torch.device("cpu")] and patch.embedding is not None
    assert (patch.report.last["memory"] or {}).get("released_bytes") is None


def test_a_released_embedding_raises_when_read_and_the_residual_is_never_released(pack):
    release_cls = pack.nodes.embedding_release.EmbeddingRelease
    projection = torch.nn.Linear(4, 8, dtype=torch.float32)
    report = pack.nodes.report.RunReport(node_id=None, model_family="MiniMaxH3", path="h3_forward_patch",
                                         settings=pack.nodes.patch.Settings())
    release = release_cls(projection, report)
    rows = torch.randn(5, 4)
    model = SimpleNamespace(get_dtype_inference=lambda: torch.bfloat16)
    with release.model_call(model, torch.device("cpu")):
        embedding = release(rows)
        assert embedding.dtype == torch.bfloat16 and torch.equal(embedding, projection(rows).to(torch.bfloat16))
        release.release(embedding.view(-1))  # the same storage as the residual: kept
        assert embedding.untyped_storage().nbytes() == 5 * 8 * 2 and report.released_bytes is None
        release.release(torch.empty(3))  # recorded once, considered once
        assert embedding.untyped_storage().nbytes() == 5 * 8 * 2 and report.released_bytes is None
        embedding = release(rows)
        release.release(torch.empty(3))
        assert embedding.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError):
        embedding.float().sum()
    assert report.released_bytes == 5 * 8 * 2
    assert release(rows).dtype == torch.float32  # outside a model call: stock's forward alone, nothing recorded
    assert release.embedding is None
