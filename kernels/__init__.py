"""Strided NHD attention for fused-QKV transformers, with no ComfyUI import (docs/ARCHITECTURE.md)."""

from .backends import AUTO_ORDER, BACKENDS
from .backends.base import REASON_CODES
from .chain import BACKEND_CHOICES, BackendChain, CallRecord, NoBackendError, Skip
from .dataflow import (LAYOUTS, RowProjection, attention_from_fused_qkv, attention_from_projection, attention_nhd,
                       split_fused_qkv, token_major)
from .qk_transform import QKNorm, norm_rope, rope_rot_dim
from .sage2_quant import MODES as PREPARED_MODES

__all__ = ["AUTO_ORDER", "BACKENDS", "BACKEND_CHOICES", "LAYOUTS", "PREPARED_MODES", "REASON_CODES", "BackendChain",
           "CallRecord", "NoBackendError", "QKNorm", "RowProjection", "Skip", "attention_from_fused_qkv",
           "attention_from_projection", "attention_nhd", "norm_rope",
           "rope_rot_dim", "split_fused_qkv", "token_major"]
