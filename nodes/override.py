"""Models other than H3: a per-clone ``optimized_attention_override``.

Models that call ComfyUI's ``optimized_attention`` (Wan, LTX-2, Flux, ...) pass through
``wrap_attn``, which calls ``transformer_options["optimized_attention_override"]`` as
``override(func, q, k, v, heads, mask=..., skip_reshape=..., skip_output_reshape=...,
transformer_options=..., **kwargs)`` with plain tensors (``func`` is the stock attention
function). The override installed here hands the back-end NHD views of what the model
passed and returns token-major views of the back-end's NHD output:

- token-major input ``[B, S, H*D]`` (``skip_reshape=False``) is viewed ``[B, S, H, D]``;
- head-major input ``[B, H, S, D]`` (``skip_reshape=True``) is viewed NHD by a transpose;
- the output ``[B, S, H, D]`` is viewed ``[B, S, H*D]``, or transposed (a view) to
  ``[B, H, S, D]`` when the model asks for ``skip_output_reshape``.

So the transposed output copy stock attention makes is avoided. Copies that remain are
listed in REMAINING_COPIES. Calls the back-ends cannot take (GQA, a model that turns off
low-precision attention, a back-end chain with nothing left) go to ``func`` unchanged and
are counted in the report.
"""

from __future__ import annotations

from .. import kernels
from . import conflicts
from .h3_patch import check_layout_backend
from .report import RunReport, install_run_report

REMAINING_COPIES = (
    "the model's own Q/K/V tensors (separate projections, its RoPE and norms) are made before the call and stay;",
    "head-major inputs already copied into [B, H, S, D] by the model stay copied;",
    "comfy_kitchen_int8 returns HND, so one output copy remains for token-major callers;",
    "inside SageAttention on sm90, V is padded to a multiple of 128 rows (its own copy).",
)


def _mask_4d(mask):
    # same broadcast rule as ComfyUI's own attention functions: [S,S] / [B,S,S] -> [B,H,S,S]
    if mask is None:
        return None
    if mask.ndim == 2:
        mask = mask.unsqueeze(0)
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    return mask


class AttentionOverride:
    """``optimized_attention_override`` for one patched clone."""

    sage_strided_nhd = True  # ownership mark (see conflicts.py)

    def __init__(self, *, chain, layout: str, report: RunReport):
        self.chain = chain
        self.layout = layout
        self.report = report

    def __call__(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        def stock(reason):
            self.report.record_stock(reason)
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)

        if kwargs.get("enable_gqa", False):
            return stock("grouped-query attention (enable_gqa) is left to ComfyUI's attention")
        if kwargs.get("low_precision_attention", True) is False:
            return stock("the model turned off low-precision attention for this call")
        if q.dim() != (4 if skip_reshape else 3):
            return stock(f"unexpected q shape {list(q.shape)} for skip_reshape={skip_reshape}")
        if skip_reshape:
            b, h, s, d = q.shape
            qn, kn, vn = (t.transpose(1, 2) for t in (q, k, v))
        else:
            b, s, inner = q.shape
            if inner % heads:
                return stock(f"{inner} channels do not split into {heads} heads")
            h, d = heads, inner // heads
            qn, kn, vn = (t.view(t.shape[0], t.shape[1], h, d) for t in (q, k, v))
        try:
            out, rec = self._attention(qn, kn, vn, mask=_mask_4d(mask), scale=kwargs.get("scale"))
        except kernels.NoBackendError as exc:
            return stock(str(exc))
        # stock: a transposed copy of the output when the caller wants it token-major
        stock_copies = 0 if skip_output_reshape else 1
        if skip_output_reshape:
            result = out.transpose(1, 2)
        else:
            flat, copies = kernels.token_major(out)
            rec.copies += copies
            result = flat.view(b, s, h * d)
        hnd_in_copies = 0 if skip_reshape else 3  # head-major input is already what HND needs
        self.report.record(rec, stock_copies=stock_copies, hnd_copies=hnd_in_copies + stock_copies)
        return result

    def _attention(self, qn, kn, vn, *, mask, scale):
        """NHD views in, NHD output out (a view of HND memory for the hnd reference)."""
        if self.layout == "strided_nhd":
            return self.chain.run(qn, kn, vn, layout="NHD", scale=scale, mask=mask)
        # hnd reference: contiguous HND copies in, HND back-end call
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (qn, kn, vn))
        out, rec = self.chain.run(qh, kh, vh, layout="HND", scale=scale, mask=mask)
        rec.copies += sum(a.data_ptr() != b.data_ptr() for a, b in zip((qh, kh, vh), (qn, kn, vn)))
        rec.layout = "hnd"
        return out.transpose(1, 2), rec


def patch_model(model_patcher, layout: str = "strided_nhd", backend: str = "auto", node_id=None):
    """Install the override on a clone; returns ``(clone, summary)`` like ``h3_patch.patch_model``."""
    check_layout_backend(layout, backend)
    replaced_own = conflicts.check_override(model_patcher)
    clone = model_patcher.clone()
    report = RunReport(node_id=node_id, model_family=type(model_patcher.model).__name__, path="attention_override",
                       layout=layout, backend_requested=backend, remaining_copies=REMAINING_COPIES,
                       replaced_own_patch=replaced_own)
    chain = kernels.BackendChain.for_choice(backend, model_patcher.load_device)
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = \
        AttentionOverride(chain=chain, layout=layout, report=report)
    install_run_report(clone, report)
    summary = dict(report.static, report=report,
                   backends_here=kernels.describe_backends(model_patcher.load_device))
    return clone, summary
