"""The attention dataflow: ``strided_nhd`` (views of the fused buffer, no copies) and the ``hnd`` copy baseline."""

from __future__ import annotations

import torch

from .chain import BackendChain, CallRecord
from .qk_transform import QKNorm

LAYOUTS = ("strided_nhd", "hnd")


def split_fused_qkv(qkv: torch.Tensor, heads: int, head_dim: int):
    """Q, K, V as [1, S, H, D] views of the fused projection output; no data is copied."""
    if qkv.dim() != 2:
        raise ValueError(f"fused qkv must be [S, 3*heads*head_dim], got {qkv.dim()}-D {list(qkv.shape)}")
    inner = heads * head_dim
    if qkv.shape[1] != 3 * inner:
        raise ValueError(f"fused qkv has {qkv.shape[1]} columns, expected 3*{heads}*{head_dim} = {3 * inner}")
    if qkv.stride(1) != 1:
        raise ValueError("fused qkv must have a contiguous last dim")
    return qkv.unflatten(1, (3, heads, head_dim)).unsqueeze(0).unbind(2)


def token_major(out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[B, S, H, D] NHD output -> ([B*S, H*D], copies made): a view (0) when the memory allows, else 1."""
    b, s, h, d = out.shape
    if out.is_contiguous():
        return out.view(b * s, h * d), 0
    return out.reshape(b * s, h * d), 1


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def attention_from_fused_qkv(handed, heads: int, head_dim: int, *, chain: BackendChain, norm: QKNorm,
                             layout: str = "strided_nhd", scale: float | None = None,
                             prepared_mode: str = "exact") -> tuple[torch.Tensor, CallRecord]:
    """Attention of one fused qkv projection -> ([S, heads*head_dim], CallRecord). ``handed``: it, or a
    one-element list holding it (a prepared path then frees it). ``norm`` overwrites its Q and K in place."""
    _check_layout(layout)
    views = list(split_fused_qkv(handed.pop() if isinstance(handed, list) else handed, heads, head_dim))
    return _attention_from_views(views, head_dim, chain=chain, norm=norm, layout=layout, scale=scale,
                                 prepared_mode=prepared_mode)


def _attention_from_views(views: list, head_dim: int, *, chain: BackendChain, norm: QKNorm, layout: str,
                          scale: float | None, prepared_mode: str) -> tuple[torch.Tensor, CallRecord]:
    """On ``views = [q, k, v]`` ([1, S, H, D]), which it empties: the chain holds the only references."""
    norm.check(views[0].shape[1], head_dim)
    if layout == "hnd":
        q, k, v = views
        views.clear()
        q, k = norm.apply(q, k)
        out, record = attention_nhd(q, k, v, chain=chain, layout=layout, scale=scale)
    else:
        out, record = chain.run_handed(views, layout="NHD", scale=scale, norm=norm,
                                       prepared_mode=prepared_mode if norm.inplace else None)
    return _token_major_result(out, record, layout)


def _token_major_result(out: torch.Tensor, record: CallRecord, layout: str) -> tuple[torch.Tensor, CallRecord]:
    record.layout = layout
    flat, copies = token_major(out)
    record.copies += copies
    return flat, record


class RowProjection:
    """The fused qkv projection of one call, taken by token ranges (``rows(a, b)`` = ``project(x[a:b])``), its
    input freed (``release``) before the kernel. ``columns``: ``(project_q, project_k, project_v)`` where column
    blocks give the product's bits: K of every row at once (``k``, while the call is planned), Q by rows, then V
    (``v``), so that K's and V's rows need not be alive together."""

    def __init__(self, project, x: torch.Tensor, columns=None):
        self._project, self._x, self._columns = project, x, columns
        self.k = columns[1](x) if columns is not None else None
        self.seq, self.dtype, self.device = x.shape[0], x.dtype, x.device

    @property
    def released(self) -> bool:
        return self._x is None

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self._project(self._x[start:stop])

    def q_rows(self, start: int, stop: int) -> torch.Tensor:
        """Q rows [n, H*D] alone (by columns)."""
        return self._columns[0](self._x[start:stop])

    def v(self) -> torch.Tensor:
        """V of every row [S, H*D] (by columns), then ``release``: the projection's last product."""
        v = self._columns[2](self._x)
        self.release()
        return v

    def whole(self, heads: int, head_dim: int) -> list[torch.Tensor]:
        """Every row as ``[q, k, v]`` [1, S, H, D] views, then ``release``; K as taken ahead (else anew)."""
        if self._columns is None:
            views = list(split_fused_qkv(self.rows(0, self.seq), heads, head_dim))
        else:
            k = self.k if self.k is not None else self._columns[1](self._x)
            views = [t.view(1, self.seq, heads, head_dim) for t in (self.q_rows(0, self.seq), k, self.v())]
        self.release()
        return views

    def release(self) -> None:
        self._x = None
        self.k = None


def attention_from_projection(projection: RowProjection, heads: int, head_dim: int, *, chain: BackendChain,
                              norm: QKNorm, chunk: int, layout: str = "strided_nhd", scale: float | None = None,
                              prepared_mode: str = "exact") -> tuple[torch.Tensor, CallRecord]:
    """``attention_from_fused_qkv``, by token chunks of ``chunk`` rows where the chain's back-end offers it."""
    _check_layout(layout)
    norm.check(projection.seq, head_dim)
    if layout == "strided_nhd" and norm.inplace and projection.seq > chunk:
        out, record = chain.run_projected(projection, heads, head_dim, norm=norm, prepared_mode=prepared_mode,
                                          chunk=chunk, scale=scale)
        if out is not None:
            return _token_major_result(out, record, layout)
    return _attention_from_views(projection.whole(heads, head_dim), head_dim, chain=chain, norm=norm,
                                 layout=layout, scale=scale, prepared_mode=prepared_mode)


def attention_nhd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chain: BackendChain,
                  layout: str = "strided_nhd", mask=None, scale: float | None = None):
    """NHD [B, S, H, D] views of any strides -> (NHD output, CallRecord); ``hnd`` attends contiguous copies."""
    _check_layout(layout)
    if layout == "strided_nhd":
        out, record = chain.run(q, k, v, layout="NHD", scale=scale, mask=mask)
    else:
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out, record = chain.run(qh, kh, vh, layout="HND", scale=scale, mask=mask)
        record.copies += sum(a.data_ptr() != b.data_ptr() for a, b in zip((qh, kh, vh), (q, k, v)))
        out = out.transpose(1, 2)
    record.layout = layout
    return out, record
