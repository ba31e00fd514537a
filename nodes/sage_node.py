"""The "Sage Strided NHD Attention" node: schema and a thin execute. MiniMax H3 gets its attention
forwards replaced (h3_patch.py), any other model an attention override (override.py), on a clone."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .. import kernels
from . import h3_patch, override
from .patch import BLOCK_PATHS, NODE, REMOVED_VALUES, Settings, current_value

CATEGORY = "advanced/model_patches"

DESCRIPTION = (
    "Runs the model's attention on SageAttention (or a fallback) without layout copies: MiniMax H3's Q/K/V stay "
    "views of the fused qkv buffer; other models get an attention override. Patches a copy of the model only; a "
    "report of what ran is sent after each sampling run.")
TOOLTIPS = {
    "model": "The diffusion model to patch. The input model itself is left unchanged.",
    "layout": "strided_nhd: no Q/K/V or output copies. hnd: the reference path with head-major copies, for A/B runs.",
    "backend": "Attention kernel. auto: the fastest one here. A named kernel is tried first; if it cannot run, the "
               "next one runs and the report says why.",
    "patch_text_refiner": "MiniMax H3 only: also patch the 2 text refiner blocks (run once per sampling).",
    "sage2_prep": "SageAttention 2's prepared path (H3, strided_nhd, H100/H200). exact: bit-identical to "
                  "SageAttention. rotated: Q/K rotated before int8 (a little slower, lower error on outliers).",
    "block_path": "MiniMax H3 only. exact: the block fast path (one-pass modulation, the MLP in token chunks: less "
                  "VRAM), bit-identical to stock. attention_only: only the attention forwards are replaced.",
}


def patch_any_model(model_patcher, settings: Settings = Settings(), node_id=None, notes=()):
    """The node's whole job, callable without a graph: ``(clone, patch)``; ``notes`` go to the report (a removed
    input value mapped). Probes no back-end (that happens when sampling starts)."""
    if h3_patch.is_h3_model(model_patcher.get_model_object("diffusion_model")):
        return h3_patch.patch_model(model_patcher, settings, node_id=node_id, notes=notes)
    return override.patch_model(model_patcher, settings, node_id=node_id, notes=notes)


class SageStridedNHDAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        # widget order is the bundled workflows' (layout, backend, patch_text_refiner, sage2_prep), then block_path
        return io.Schema(
            node_id="SageStridedNHDAttention", display_name=NODE, category=CATEGORY, description=DESCRIPTION,
            inputs=[
                io.Model.Input("model", tooltip=TOOLTIPS["model"]),
                io.Combo.Input("layout", options=list(kernels.LAYOUTS), default="strided_nhd",
                               tooltip=TOOLTIPS["layout"]),
                io.Combo.Input("backend", options=list(kernels.BACKEND_CHOICES), default="auto",
                               tooltip=TOOLTIPS["backend"]),
                io.Boolean.Input("patch_text_refiner", default=True, tooltip=TOOLTIPS["patch_text_refiner"]),
                io.Combo.Input("sage2_prep", options=list(kernels.PREPARED_MODES), default="exact", optional=True,
                               advanced=True, tooltip=TOOLTIPS["sage2_prep"]),
                io.Combo.Input("block_path", options=list(BLOCK_PATHS), default="exact", optional=True,
                               advanced=True, tooltip=TOOLTIPS["block_path"]),
            ],
            outputs=[io.Model.Output(tooltip="The patched copy of the model.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, sage2_prep="exact", block_path="exact"):
        """These two inputs are checked here, not against their options, so that a workflow saved with a
        removed value (``REMOVED_VALUES``) still runs; any other value is refused as ComfyUI would."""
        for name, value, offered in (("sage2_prep", sage2_prep, kernels.PREPARED_MODES),
                                     ("block_path", block_path, BLOCK_PATHS)):
            if value not in offered and value not in REMOVED_VALUES[name]:
                return f"{name} {value!r} is not one of {', '.join(offered)}"
        return True

    @classmethod
    def execute(cls, model, layout, backend, patch_text_refiner=True, sage2_prep="exact",
                block_path="exact") -> io.NodeOutput:
        prep_mode, prep_note = current_value("sage2_prep", sage2_prep)
        block_path, block_note = current_value("block_path", block_path)
        settings = Settings(layout=layout, backend=backend, prep_mode=prep_mode, patch_refiner=patch_text_refiner,
                            block_path=block_path)
        notes = tuple(n for n in (prep_note, block_note) if n is not None)
        clone, _ = patch_any_model(model, settings, node_id=cls.hidden.unique_id, notes=notes)
        return io.NodeOutput(clone)


NODES = [SageStridedNHDAttention]


class SageStridedNHDExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)
