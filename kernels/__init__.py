"""Strided NHD attention, the H3 block's passes, the int8 ConvRot route; no ComfyUI import. nodes/ imports only it."""

from . import int8_w4a8
from .backends import BACKENDS
from .backends.base import REASON_CODES
from .chain import BACKEND_CHOICES, BackendChain, CallRecord, NoBackendError
from .dataflow import (LAYOUTS, RowProjection, attention_from_fused_qkv, attention_from_projection, attention_nhd,
                       token_major)
from .h3_block import PendingModulation, PendingResidual, clip_segments, settled, swiglu
from .int8_gemm import choice as gemm_choice
from .int8_linear import GROUP as CONVROT_GROUP
from .int8_linear import (GemmDeclined, gemm_status, int8_call_problem, int8_column_products, int8_linear_routed,
                          int8_quantized_rows, int8_rows_problem, int8_weight_problem, kitchen_release_status,
                          stock_int8_linear)
from .offsets import token_chunks
from .qk_transform import QKNorm
from .sage2_quant import MODES as PREPARED_MODES

__all__ = ["BACKENDS", "BACKEND_CHOICES", "CONVROT_GROUP", "LAYOUTS", "PREPARED_MODES", "REASON_CODES", "BackendChain",
           "CallRecord", "GemmDeclined", "NoBackendError", "PendingModulation", "PendingResidual", "QKNorm",
           "RowProjection", "attention_from_fused_qkv", "attention_from_projection", "attention_nhd",
           "clip_segments", "gemm_choice", "gemm_status", "int8_call_problem", "int8_column_products",
           "int8_linear_routed", "int8_quantized_rows", "int8_rows_problem", "int8_w4a8", "int8_weight_problem",
           "kitchen_release_status", "settled", "stock_int8_linear", "swiglu", "token_chunks", "token_major"]
