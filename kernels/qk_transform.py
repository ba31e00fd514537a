"""Per-head RMSNorm + split-half partial RoPE on Q and K, through comfy-kitchen.

comfy-kitchen picks its CUDA, Triton or eager (plain PyTorch, CPU) implementation
per call. The in-place variant writes straight into the strided Q/K views of the
fused qkv buffer, so no Q/K copies are made.
"""

from __future__ import annotations

import torch


def _kitchen():
    try:
        import comfy_kitchen
    except Exception as exc:
        raise RuntimeError(
            "comfy-kitchen is required for RMSNorm+RoPE (pip install comfy-kitchen); "
            f"import failed: {type(exc).__name__}: {exc}") from exc
    return comfy_kitchen


def rope_rot_dim(rope_table: torch.Tensor) -> int:
    """Rotated prefix of the head dim: the table holds one 2x2 rotation per pair."""
    return rope_table.shape[-3] * 2


def check_rope_table(rope_table: torch.Tensor, seq_len: int, head_dim: int) -> None:
    shape = tuple(rope_table.shape)
    if rope_table.dim() != 6 or shape[0] != 1 or shape[2] != 1 or shape[-2:] != (2, 2):
        raise ValueError(f"rope table must be [1, S, 1, rot/2, 2, 2], got {list(shape)}")
    if shape[1] != seq_len:
        raise ValueError(f"rope table covers {shape[1]} tokens but the sequence has {seq_len}")
    if rope_rot_dim(rope_table) > head_dim:
        raise ValueError(f"rope rotates {rope_rot_dim(rope_table)} dims but head_dim is {head_dim}")


def norm_rope(q: torch.Tensor, k: torch.Tensor, rope_table: torch.Tensor, q_weight: torch.Tensor,
              k_weight: torch.Tensor, eps: float, *, inplace: bool = True):
    """RMSNorm over each head (whole head_dim) then rotate the first rot_dim dims (pairs i, i+rot/2).

    q, k: [1, S, H, D], any strides with the last dim contiguous. In place by default
    (returns the same views); ``inplace=False`` returns new tensors (training).
    """
    check_rope_table(rope_table, q.shape[1], q.shape[-1])
    ck = _kitchen()
    rot = rope_rot_dim(rope_table)
    if inplace:
        ck.rms_rope_split_half_(q, k, rope_table, q_weight, k_weight, epsilon=eps, rot_dim=rot)
        return q, k
    return ck.rms_rope_split_half(q, k, rope_table, q_weight, k_weight, epsilon=eps, rot_dim=rot)
