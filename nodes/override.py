"""Models other than H3: a per-clone ``optimized_attention_override`` that hands the back-end NHD views and
returns views of its output (no transposed copy); calls the back-ends cannot take go to ``func``, counted."""

from __future__ import annotations

import torch

from .. import kernels
from . import conflicts
from .patch import InstalledPatch, Plan, Settings
from .report import RunReport


class AttentionOverride:
    """``optimized_attention_override`` for one patched clone."""

    sage_strided_nhd = True  # ownership mark (see ownership.py)

    def __init__(self, patch: InstalledPatch):
        self.patch = patch

    @torch.compiler.disable
    def __call__(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        def stock(code, reason):
            self.patch.report.record_stock(code, reason)
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)

        if kwargs.get("enable_gqa", False):
            return stock("model_request", "grouped-query attention (enable_gqa) is left to ComfyUI's attention")
        if kwargs.get("low_precision_attention", True) is False:
            return stock("model_request", "the model turned off low-precision attention for this call")
        if q.dim() != (4 if skip_reshape else 3):
            return stock("shape", f"unexpected q shape {list(q.shape)} for skip_reshape={skip_reshape}")
        if skip_reshape:  # [B, H, S, D] -> NHD views
            views, h, d = tuple(t.transpose(1, 2) for t in (q, k, v)), q.shape[1], q.shape[3]
        elif q.shape[2] % heads:
            return stock("shape", f"{q.shape[2]} channels do not split into {heads} heads")
        else:
            h, d = heads, q.shape[2] // heads
            views = tuple(t.view(t.shape[0], t.shape[1], h, d) for t in (q, k, v))
        mask4 = mask
        while mask4 is not None and mask4.ndim in (2, 3):  # ComfyUI's broadcast: [S, S] / [B, S, S] -> [B, H, S, S]
            mask4 = mask4.unsqueeze(0 if mask4.ndim == 2 else 1)
        try:
            out, rec = kernels.attention_nhd(*views, chain=self.patch.plan.default,
                                             layout=self.patch.settings.layout, mask=mask4, scale=kwargs.get("scale"))
        except kernels.NoBackendError as exc:
            return stock("no_backend", str(exc))
        if skip_output_reshape:
            result = out.transpose(1, 2)
        else:
            flat, copies = kernels.token_major(out)
            rec.copies += copies
            result = flat.view(q.shape[0], -1, h * d)
        self.patch.report.record(rec)
        return result


def patch_model(model_patcher, settings: Settings, node_id=None, notes=()):
    """Install the override on a clone; returns ``(clone, patch)``. No fused buffer: no prepared path."""
    replaced_own = conflicts.check_override_at_patch(model_patcher, "attention_override")
    clone = model_patcher.clone()
    report = RunReport(node_id=node_id, model_family=type(model_patcher.model).__name__, path="attention_override",
                       settings=settings, replaced_own_patch=replaced_own, notes=notes)
    default = kernels.BackendChain.for_choice(settings.backend, prepared=settings.prepared)
    patch = InstalledPatch(settings, report, None, Plan(default))
    ours = AttentionOverride(patch)
    patch.planner = lambda patcher, options: conflicts.plan_override(patcher, options, ours, default)
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = ours
    patch.install(clone)
    return clone, patch
