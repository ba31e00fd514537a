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

So the transposed output copy stock attention makes is avoided. Calls the back-ends cannot
take (GQA, a model that turns off low-precision attention, a back-end chain with nothing
left) go to ``func`` unchanged and are counted in the report.

torch.compile: the override body runs in ``_override_call``, which dynamo does not trace
(``torch.compiler.disable``), so no guard depends on pack state.
"""

from __future__ import annotations

import torch

from .. import kernels
from . import conflicts
from .report import RunReport, install_run_report
from .settings import check_settings


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
        return _override_call(self, func, q, k, v, heads, mask=mask, attn_precision=attn_precision,
                              skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape, **kwargs)


@torch.compiler.disable
def _override_call(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                   skip_output_reshape=False, **kwargs):
    """The override's work and its record; never traced by dynamo."""
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
        out, rec = kernels.attention_nhd(qn, kn, vn, chain=self.chain, layout=self.layout, mask=_mask_4d(mask),
                                         scale=kwargs.get("scale"))
    except kernels.NoBackendError as exc:
        return stock(str(exc))
    if skip_output_reshape:
        result = out.transpose(1, 2)
    else:
        flat, copies = kernels.token_major(out)
        rec.copies += copies
        result = flat.view(b, s, h * d)
    self.report.record(rec)
    return result


def patch_model(model_patcher, layout: str = "strided_nhd", backend: str = "auto", node_id=None,
                prep_mode: str = "exact", *, checked: bool = False):
    """Install the override on a clone; returns ``(clone, summary)`` like ``h3_patch.patch_model``.

    ``prep_mode`` is recorded only: the override path has no fused buffer, so no fast path runs.
    """
    if not checked:
        check_settings(layout, backend, prep_mode)
    replaced_own = conflicts.check_override_at_patch(model_patcher, "attention_override")
    clone = model_patcher.clone()
    report = RunReport(node_id=node_id, model_family=type(model_patcher.model).__name__, path="attention_override",
                       layout=layout, backend_requested=backend, prep_mode=prep_mode, replaced_own_patch=replaced_own)
    chain = kernels.BackendChain.for_choice(backend, model_patcher.load_device)
    ours = AttentionOverride(chain=chain, layout=layout, report=report)
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = ours
    report.inspector = lambda patcher, options: {
        "notes": conflicts.check_override_at_sampling(patcher, options, "attention_override", ours=ours)}
    install_run_report(clone, report)
    summary = dict(report.static, report=report,
                   backends_here=kernels.describe_backends(model_patcher.load_device))
    return clone, summary
