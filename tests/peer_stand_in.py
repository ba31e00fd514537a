"""A stand-in for the peer, KJNodes' H3 nodes, that the benchmarks' host tests load as a real checkout.

The real peer is never needed in the tests: the stand-in has KJNodes' node classes, inputs and import shape
(comfy, comfy_api, server, a relative import of a sibling module). Its defaults differ from KJNodes' on purpose:
the benchmarks must read them from the node's schema.
"""

from pathlib import Path

STAND_IN_NODES = '''
"""Stand-in for KJNodes' nodes/minimax_nodes.py: the same node classes and inputs, stock-equal forwards."""
import types

import torch

import comfy.model_management  # noqa: F401  (the real file imports comfy at the top)
from comfy.ldm.modules.attention import optimized_attention  # noqa: F401  (the attention the peer calls)
from comfy_api.latest import io

try:
    from server import PromptServer  # noqa: F401
except Exception:
    PromptServer = None

from ..utility.helpers import check_head_chunks


def lowvram_block_forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}):
    check_head_chunks(transformer_options)
    return type(self).forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options)


def lowvram_attn_forward(self, x, rope_freqs=None, transformer_options={}):
    return type(self).forward(self, x, rope_freqs, transformer_options)


class MiniMaxLowVRAMAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="MiniMaxLowVRAMAttention", display_name="MiniMax H3 Low VRAM Attention",
                         category="testing", inputs=[io.Model.Input("model"),
                                                     io.Int.Input("head_chunks", default=3, min=1, max=56)],
                         outputs=[io.Model.Output()])

    @classmethod
    def execute(cls, model, head_chunks) -> io.NodeOutput:
        m = model.clone()
        m.model_options["transformer_options"]["minimax_head_chunks"] = head_chunks
        for i, block in enumerate(m.get_model_object("diffusion_model").blocks):
            m.add_object_patch(f"diffusion_model.blocks.{i}.forward", types.MethodType(lowvram_block_forward, block))
            m.add_object_patch(f"diffusion_model.blocks.{i}.attn.forward",
                               types.MethodType(lowvram_attn_forward, block.attn))
        return io.NodeOutput(m)


class MiniMaxChunkFeedForward(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="MiniMaxChunkFeedForward", display_name="MiniMax H3 Chunk FeedForward",
                         category="testing", inputs=[io.Model.Input("model"), io.Int.Input("chunks", default=5),
                                                     io.Int.Input("seq_threshold", default=2048)],
                         outputs=[io.Model.Output()])

    @classmethod
    def execute(cls, model, chunks, seq_threshold) -> io.NodeOutput:
        def forward(mlp, x):
            if x.shape[0] <= seq_threshold:
                return type(mlp).forward(mlp, x)
            return torch.cat([type(mlp).forward(mlp, c) for c in torch.chunk(x, chunks)])

        m = model.clone()
        for i, block in enumerate(m.get_model_object("diffusion_model").blocks):
            m.add_object_patch(f"diffusion_model.blocks.{i}.mlp.forward", types.MethodType(forward, block.mlp))
        return io.NodeOutput(m)
'''
STAND_IN_HELPERS = '''
def check_head_chunks(transformer_options):
    # the block must get the clone's transformer_options, as in a graph
    if transformer_options.get("minimax_head_chunks") != 3:
        raise RuntimeError(f"the stand-in's block got no head_chunks: {sorted(transformer_options)}")
'''
# KJNodes keeps its H3 memory-efficient SageAttention patch in nodes/ltxv_nodes.py. The stand-in's refuses as the
# real one does without a SageAttention it knows, or patches every attention with a stock-equal forward.
STAND_IN_MEM_EFF = '''
import types

from comfy_api.latest import io

REFUSE = {refuse}


def attn_forward(self, x, rope_freqs=None, transformer_options={{}}):
    return type(self).forward(self, x, rope_freqs, transformer_options)


class MiniMaxH3MemoryEfficientSageAttentionPatch(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="MiniMaxH3MemoryEfficientSageAttentionPatch",
                         display_name="MiniMax H3 Mem Eff Sage Attention Patch", category="testing",
                         inputs=[io.Model.Input("model")], outputs=[io.Model.Output()])

    @classmethod
    def execute(cls, model) -> io.NodeOutput:
        if REFUSE:
            raise RuntimeError("sageattention is not new enough version (stand-in)")
        m = model.clone()
        for i, block in enumerate(m.get_model_object("diffusion_model").blocks):
            m.add_object_patch(f"diffusion_model.blocks.{{i}}.attn.forward", types.MethodType(attn_forward, block.attn))
        return io.NodeOutput(m)
'''


def write_stand_in(root: Path, mem_eff: bool | None = None) -> Path:
    """A ComfyUI-KJNodes-shaped folder whose pack __init__ must never run. ``mem_eff``: with nodes/ltxv_nodes.py's
    memory-efficient sage patch, which works (True) or refuses (False)."""
    (root / "nodes").mkdir(parents=True)
    (root / "utility").mkdir()
    (root / "__init__.py").write_text('raise ImportError("the whole KJ pack was imported")\n')
    (root / "nodes" / "__init__.py").write_text('raise ImportError("the KJ nodes package was imported")\n')
    (root / "nodes" / "minimax_nodes.py").write_text(STAND_IN_NODES)
    (root / "utility" / "__init__.py").write_text("")
    (root / "utility" / "helpers.py").write_text(STAND_IN_HELPERS)
    if mem_eff is not None:
        (root / "nodes" / "ltxv_nodes.py").write_text(STAND_IN_MEM_EFF.format(refuse=not mem_eff))
    return root


