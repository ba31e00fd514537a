"""Per-head RMSNorm + split-half partial RoPE on Q and K, through comfy-kitchen (its CUDA, Triton
or eager implementation, chosen per call), in place on the strided views: no Q/K copies."""

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
    """RMSNorm over each head (whole head_dim), then rotate the first rot_dim dims (pairs i, i+rot/2).
    q, k: [1, S, H, D] views with a contiguous last dim; in place, or new tensors (``inplace=False``)."""
    check_rope_table(rope_table, q.shape[1], q.shape[-1])
    ck = _kitchen()
    rot = rope_rot_dim(rope_table)
    if inplace:
        ck.rms_rope_split_half_(q, k, rope_table, q_weight, k_weight, epsilon=eps, rot_dim=rot)
        return q, k
    return ck.rms_rope_split_half(q, k, rope_table, q_weight, k_weight, epsilon=eps, rot_dim=rot)


class QKNorm:
    """The normalisation one attention call owes Q and K, applied at most once: RMSNorm + split-half
    RoPE through comfy-kitchen (in place unless ``inplace`` is False), or the module's q_norm/k_norm. A
    prepared path may fold a ``foldable`` one into its passes (``mark_folded``); else ``apply`` it."""

    def __init__(self, *, rope_table=None, q_weight=None, k_weight=None, eps: float = 1e-6, q_norm=None,
                 k_norm=None, inplace: bool = True):
        if rope_table is not None and (q_weight is None or k_weight is None):
            raise ValueError("q_weight and k_weight are required with a rope table")
        if rope_table is None and (q_norm is None or k_norm is None):
            raise ValueError("q_norm and k_norm are required without a rope table")
        self.rope_table, self.q_weight, self.k_weight, self.eps = rope_table, q_weight, k_weight, eps
        self.q_norm, self.k_norm, self.inplace = q_norm, k_norm, inplace
        self.applied = False

    def check(self, seq_len: int, head_dim: int) -> None:
        if self.rope_table is not None:
            check_rope_table(self.rope_table, seq_len, head_dim)

    @property
    def foldable(self) -> bool:
        """Could a prepared path apply it inside its own passes, or a token range at a time (``apply_rows``)?
        In place, with a rope table, not yet applied."""
        return self.rope_table is not None and self.inplace and not self.applied

    def mark_folded(self) -> None:
        """The whole call's Q and K are normalised: inside a preparation, or row range by row range."""
        self.applied = True

    def apply_rows(self, q: torch.Tensor, k: torch.Tensor, start: int) -> None:
        """Normalise, in place, the rows of Q and K that start at token ``start`` (``q``, ``k``: those
        rows, [1, n, H, D]); rows are independent, so the bits are those of one call on every row.
        The caller marks the call done (``mark_folded``) once every row is."""
        if not self.foldable:
            raise RuntimeError("this normalisation cannot be applied by rows (no rope table, not in place, or done)")
        table = self.rope_table[:, start:start + q.shape[1]]
        norm_rope(q, k, table, self.q_weight, self.k_weight, self.eps, inplace=True)

    def apply(self, q: torch.Tensor, k: torch.Tensor):
        """Normalise q, k [1, S, H, D] (once; later calls return them unchanged)."""
        if self.applied:
            return q, k
        if self.rope_table is not None:
            q, k = norm_rope(q, k, self.rope_table, self.q_weight, self.k_weight, self.eps, inplace=self.inplace)
        else:
            q, k = self.q_norm(q[0]).unsqueeze(0), self.k_norm(k[0]).unsqueeze(0)
        self.applied = True  # only once it has succeeded: a fallback must not skip it
        return q, k
