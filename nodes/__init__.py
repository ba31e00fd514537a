"""ComfyUI glue for the pack: the node, the H3 forward patch, the generic override, the plan, the report."""

from .sage_node import NODES, SageStridedNHDAttention, patch_any_model

__all__ = ["NODES", "SageStridedNHDAttention", "patch_any_model"]
