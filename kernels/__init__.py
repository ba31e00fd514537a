"""Strided NHD attention for fused-QKV transformers, with no ComfyUI import.

See dataflow.py for the data path, chain.py for back-end selection and
fallback, offsets.py for the int32 offset rule, backends/ for the kernels.
"""

from .backends import AUTO_ORDER, BACKENDS
from .chain import BACKEND_CHOICES, BackendChain, CallRecord, NoBackendError, Skip, describe_backends
from .dataflow import LAYOUTS, PREP_MODES, attention_from_fused_qkv, attention_nhd, attention_token_major, split_fused_qkv, token_major
from .qk_transform import norm_rope, rope_rot_dim

__all__ = [
    "AUTO_ORDER", "BACKENDS", "BACKEND_CHOICES", "LAYOUTS", "PREP_MODES", "Skip", "BackendChain", "CallRecord", "NoBackendError",
    "attention_from_fused_qkv", "attention_nhd", "attention_token_major", "describe_backends", "norm_rope", "rope_rot_dim",
    "split_fused_qkv", "token_major",
]
