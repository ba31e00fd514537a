"""The "Sage Strided NHD Attention" node: schema and a thin execute. MiniMax H3 gets its attention
forwards replaced (h3_patch.py), any other model an attention override (override.py), on a clone."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from .. import kernels
from . import h3_patch, override
from .patch import BLOCK_PATHS, Settings

CATEGORY = "advanced/model_patches"


def patch_any_model(model_patcher, layout: str = "strided_nhd", backend: str = "auto", patch_refiner: bool = True,
                    node_id=None, prep_mode: str = "exact", block_path: str = "exact"):
    """The node's whole job, callable without a graph: returns ``(clone, patch)``. Probes no back-end
    (they are probed when sampling starts), so it imports no kernel package."""
    settings = Settings(layout=layout, backend=backend, prep_mode=prep_mode, patch_refiner=patch_refiner,
                        block_path=block_path)
    if h3_patch.is_h3_model(model_patcher.get_model_object("diffusion_model")):
        return h3_patch.patch_model(model_patcher, settings, node_id=node_id)
    return override.patch_model(model_patcher, settings, node_id=node_id)


class SageStridedNHDAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SageStridedNHDAttention",
            display_name="Sage Strided NHD Attention",
            category=CATEGORY,
            description=(
                "Runs the model's attention on SageAttention (or a fallback) without layout copies. "
                "MiniMax H3: Q/K/V stay strided views of the fused qkv buffer, the output is viewed "
                "token-major. Other models: an attention override that hands the kernel NHD views. "
                "Patches a copy of the model only; a report of what ran is sent after each sampling run."),
            # widget order is the bundled workflows' (layout, backend, patch_text_refiner, sage2_prep), then block_path
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to patch. The input model itself is left unchanged."),
                io.Combo.Input(
                    "layout", options=list(kernels.LAYOUTS), default="strided_nhd", advanced=True,
                    tooltip="strided_nhd: no Q/K/V or output copies (fast, less memory). "
                            "hnd: the reference path with contiguous head-major copies, for A/B comparison."),
                io.Combo.Input(
                    "backend", options=list(kernels.BACKEND_CHOICES), default="auto",
                    tooltip="Attention kernel. auto: the fastest one available here. A named kernel is tried "
                            "first; if it cannot run (not installed, CPU, unsupported shape) the next one runs "
                            "and the report says why."),
                io.Boolean.Input(
                    "patch_text_refiner", default=True,
                    tooltip="MiniMax H3 only: also patch the 2 text refiner blocks (run once per sampling). "
                            "Ignored for other models."),
                io.Combo.Input(
                    "sage2_prep", options=list(kernels.PREPARED_MODES), default="exact", optional=True,
                    advanced=True,
                    tooltip="How SageAttention 2's prepared path (MiniMax H3, strided_nhd, H100/H200) makes its "
                            "int8/fp8 operands. exact: bit-identical to SageAttention. fused: RMSNorm+RoPE folded "
                            "into the quantisation (not bit-identical; about as fast as exact on an H200). rotated: "
                            "Q/K rotated (Hadamard) before int8, for H3's late-block outlier channels (about 0.65 ms "
                            "more per attention call at 37,810 tokens on an H200, lower int8 error). fused_rotated: "
                            "both. Ignored where the prepared path does not run."),
                io.Combo.Input(
                    "block_path", options=list(BLOCK_PATHS), default="exact", optional=True, advanced=True,
                    tooltip="MiniMax H3 only. exact: each DiT block runs the block fast path (one-pass modulation, "
                            "the MLP in token chunks so its large intermediates never exist whole: less VRAM), "
                            "bit-identical to stock. fused: also each RMSNorm with its modulation, the attention "
                            "residual with the MLP's norm and (bf16 weights) SwiGLU in one pass each; not "
                            "bit-identical (a few bf16 steps per value). attention_only: only the attention "
                            "forwards are replaced."),
            ],
            outputs=[io.Model.Output(tooltip="The patched copy of the model.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, layout, backend, patch_text_refiner=True, sage2_prep="exact",
                block_path="exact") -> io.NodeOutput:
        clone, _ = patch_any_model(model, layout, backend, patch_text_refiner, node_id=cls.hidden.unique_id,
                                   prep_mode=sage2_prep, block_path=block_path)
        return io.NodeOutput(clone)


NODES = [SageStridedNHDAttention]


class SageStridedNHDExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)
