"""SageAttention 2's compiled sm90 op and whether a device runs it: shared by the back-end and its self-test."""

from __future__ import annotations

import importlib

import torch

from .. import gpu

SM90_OP = "qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf"
_SM90_OP: list = []  # [(op or None, reason)], filled on first use (a plain list: torch.compile reads it)


def sm90_attention_op():
    """SageAttention 2's registered sm90 op, or (None, reason). Imported once."""
    if not _SM90_OP:
        try:
            importlib.import_module("sageattention.sm90_compile")
            _SM90_OP.append((getattr(torch.ops.sageattention_sm90, SM90_OP), ""))
        except Exception as exc:
            _SM90_OP.append((None, "SageAttention's compiled sm90 kernel is not importable "
                                   f"({type(exc).__name__}: {exc})"))
    return _SM90_OP[0]


def on_sm90(device) -> bool:
    """Whether ``device`` is an sm90 GPU: there ``sageattn`` and the prepared path run SageAttention's sm90 kernel."""
    return gpu.capability(device) == (9, 0)
