"""Stock's H3 forward keeps the video embedding it built the residual stream from alive through every block, though
nothing reads it again; the block fast path hands its memory back at the first DiT block (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import contextlib

import torch

VIDEO_PROJECTION = "diffusion_model.video_patch_proj"


class EmbeddingRelease:
    """One clone's embedding recorded in the model call in progress. A reader of the released tensor would raise (a
    storage of size 0), never read stale values."""

    sage_strided_nhd = True  # ownership mark (see ownership.py)

    def __init__(self, projection, report):
        self.projection, self.report = projection, report  # the video patch projection (stock's forward on its class)
        self.dtype: torch.dtype | None = None  # the model call's compute dtype, while one runs
        self.embedding: torch.Tensor | None = None

    @contextlib.contextmanager
    def model_call(self, model, device):
        """One model call of ``model`` (a BaseModel) on ``device`` (the clone's APPLY_MODEL wrapper): its compute dtype
        (ComfyUI casts H3's context to it); none where the Comfy Compiler records the forward."""
        dtype = getattr(model, "get_dtype_inference", lambda: None)()
        self.dtype = None if device is None or comfy_compiler_records(device) else dtype
        self.embedding = None
        try:
            yield
        finally:
            self.dtype = self.embedding = None

    def __call__(self, rows, *args, **kwargs):
        """The video patch projection's forward (this object is the patch): stock's, then the cast stock's
        ``.to(dtype)`` makes (which then returns this very tensor), recorded."""
        out = type(self.projection).forward(self.projection, rows, *args, **kwargs)
        if torch.compiler.is_compiling() or self.dtype is None:
            return out
        self.embedding = out.to(self.dtype)
        return self.embedding

    def release(self, residual: torch.Tensor) -> None:
        """At a block's start: the recorded embedding's memory handed back (never the residual stream's own)."""
        if torch.compiler.is_compiling():
            return
        embedding, self.embedding = self.embedding, None
        storage = None if embedding is None else embedding.untyped_storage()
        if storage is not None and storage.data_ptr() != residual.untyped_storage().data_ptr():
            self.report.released(storage.nbytes())
            storage.resize_(0)


def comfy_compiler_records(device) -> bool:
    """Current ComfyUI's "Comfy Compiler" (comfy-aimdo's malloc graph, 0.34+) records the forwards on ``device``: a
    release there would fail the graph (docs/ARCHITECTURE.md), so the embedding stays, as stock keeps it."""
    import comfy.model_prefetch

    enabled = getattr(comfy.model_prefetch, "malloc_graph_enabled", None)
    return enabled is not None and bool(enabled(device))
