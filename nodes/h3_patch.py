"""MiniMax H3: replace each attention forward with the strided NHD dataflow.

ComfyUI's H3 ``Attention.forward(x, rope_freqs=None, transformer_options={})`` takes the
block input ``[S, hidden]``, runs the fused ``qkv_proj``, normalises and rotates Q/K,
calls attention through HND views (plus a ``v.clone()`` and a transposed output copy)
and applies ``out_proj``. The forward installed here keeps the same inputs, outputs
and the same cases (rope table or plain per-head norms; out-of-place norm+rope in
training mode) but hands the fused buffer to ``kernels.attention_from_fused_qkv``.

Object patches on a ``ModelPatcher.clone()`` apply only while that clone runs and are
undone after, so the input model and other graph branches keep stock attention.
"""

from __future__ import annotations

import inspect

import comfy.model_management

from .. import kernels
from . import conflicts
from .report import RunReport, install_run_report

H3_MODEL_CLASS = "comfy.ldm.minimax.model.MiniMaxH3Model"
FORWARD_PARAMS = ("self", "x", "rope_freqs", "transformer_options")

# Copies one attention call makes besides ours, for the report: stock ComfyUI makes a
# v.clone() and a transposed output copy; the HND reference makes three input copies
# (contiguous HND Q/K/V) and one transposed output copy.
STOCK_COPIES_PER_CALL = 2
HND_COPIES_PER_CALL = 4
REMAINING_COPIES = (
    "none in the dataflow when the back-end returns contiguous NHD (sage2, sage1, sdpa flash/CPU);",
    "comfy_kitchen_int8 returns HND, so one output copy remains;",
    "inside SageAttention on sm90, V is padded to a multiple of 128 rows (its own copy).",
)


class H3StructureError(ValueError):
    """The module is not the H3 attention this patch knows."""


def is_h3_model(diffusion_model) -> bool:
    cls = type(diffusion_model)
    return any(f"{c.__module__}.{c.__qualname__}" == H3_MODEL_CLASS for c in cls.__mro__)


def attention_keys(diffusion_model, patch_refiner: bool) -> list[str]:
    """Object-patch key prefixes (relative to the BaseModel) of every attention to patch."""
    keys = [f"diffusion_model.blocks.{i}.attn" for i in range(len(diffusion_model.blocks))]
    refiner = getattr(diffusion_model, "token_refiner", None)
    if patch_refiner and refiner is not None:
        keys += [f"diffusion_model.token_refiner.blocks.{i}.attn" for i in range(len(refiner.blocks))]
    return keys


def structure_problems(attn) -> list[str]:
    """Everything about ``attn`` that differs from the H3 attention the patch was written for."""
    problems = []
    for name in ("qkv_proj", "q_norm", "k_norm", "out_proj"):
        if getattr(getattr(attn, name, None), "weight", None) is None:
            problems.append(f"no {name}.weight")
    for name in ("heads", "head_dim"):
        if not isinstance(getattr(attn, name, None), int):
            problems.append(f"{name} is not an int ({getattr(attn, name, None)!r})")
    if problems:
        return problems
    inner = attn.heads * attn.head_dim
    qkv_w, out_w = attn.qkv_proj.weight, attn.out_proj.weight
    hidden = qkv_w.shape[1] if qkv_w.dim() == 2 else None
    if qkv_w.dim() != 2 or qkv_w.shape[0] != 3 * inner:
        problems.append(f"qkv_proj.weight is {list(qkv_w.shape)}, expected [3*heads*head_dim={3 * inner}, hidden]")
    if out_w.dim() != 2 or out_w.shape[1] != inner or (hidden is not None and out_w.shape[0] != hidden):
        problems.append(f"out_proj.weight is {list(out_w.shape)}, expected [hidden={hidden}, heads*head_dim={inner}]")
    for name in ("q_norm", "k_norm"):
        w = getattr(attn, name).weight
        if tuple(w.shape) != (attn.head_dim,):
            problems.append(f"{name}.weight is {list(w.shape)}, expected [head_dim={attn.head_dim}]")
    if not isinstance(getattr(attn.q_norm, "eps", None), float):
        problems.append("q_norm has no float eps")
    params = tuple(inspect.signature(type(attn).forward).parameters)
    if params != FORWARD_PARAMS:
        problems.append(f"forward{params} differs from forward{FORWARD_PARAMS}")
    return problems


class H3AttentionForward:
    """Replacement for one H3 ``Attention.forward``: same arguments, same output."""

    sage_strided_nhd = True  # ownership mark (see conflicts.py)

    def __init__(self, attn, *, chain, layout: str, report: RunReport):
        self.attn = attn
        self.chain = chain
        self.layout = layout
        self.report = report

    def __call__(self, x, rope_freqs=None, transformer_options={}):
        attn = self.attn
        qkv = attn.qkv_proj(x)
        if rope_freqs is not None:
            # ComfyUI may keep weights offloaded or in another dtype: cast like upstream does
            q_weight = comfy.model_management.cast_to(attn.q_norm.weight, device=x.device)
            k_weight = comfy.model_management.cast_to(attn.k_norm.weight, device=x.device)
            out, rec = kernels.attention_from_fused_qkv(
                qkv, attn.heads, attn.head_dim, chain=self.chain, layout=self.layout, rope_table=rope_freqs,
                q_weight=q_weight, k_weight=k_weight, eps=attn.q_norm.eps,
                inplace=not comfy.model_management.in_training)  # training keeps the graph: out of place
        else:
            out, rec = kernels.attention_from_fused_qkv(
                qkv, attn.heads, attn.head_dim, chain=self.chain, layout=self.layout,
                q_norm=attn.q_norm, k_norm=attn.k_norm)
        self.report.record(rec, stock_copies=STOCK_COPIES_PER_CALL, hnd_copies=HND_COPIES_PER_CALL)
        return attn.out_proj(out)


def check_layout_backend(layout: str, backend: str) -> None:
    if layout not in kernels.LAYOUTS:
        raise ValueError(f"Sage Strided NHD Attention: unknown layout {layout!r}; choose one of {', '.join(kernels.LAYOUTS)}")
    if backend not in kernels.BACKEND_CHOICES:
        raise ValueError(f"Sage Strided NHD Attention: unknown back-end {backend!r}; "
                         f"choose one of {', '.join(kernels.BACKEND_CHOICES)}")


def patch_model(model_patcher, layout: str = "strided_nhd", backend: str = "auto", patch_refiner: bool = True,
                node_id=None):
    """Patch a clone of an H3 ModelPatcher exactly as the node does.

    Returns ``(clone, summary)``; the input patcher is not modified. ``summary`` holds the
    static facts of the patch, ``summary["report"]`` the :class:`RunReport` that collects
    each sampling run (``report.sent`` keeps every payload sent). Raises ``ValueError`` for
    a model that is not H3 or unknown settings, :class:`H3StructureError` when an attention
    module differs from the known structure, and ``conflicts.PatchConflictError`` per the
    rules in conflicts.py.
    """
    check_layout_backend(layout, backend)
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    if not is_h3_model(diffusion_model):
        raise ValueError(f"Sage Strided NHD Attention: {type(diffusion_model).__name__} is not {H3_MODEL_CLASS}")
    conflicts.check_override(model_patcher)  # a foreign override would silently stop running: refuse
    prefixes = attention_keys(diffusion_model, patch_refiner)
    forward_keys = [p + ".forward" for p in prefixes]
    replaced_own = conflicts.check_object_patches(model_patcher, forward_keys)

    problems = {}
    for prefix in prefixes:
        found = structure_problems(model_patcher.get_model_object(prefix))
        if found:
            problems[prefix] = found
    if problems:
        first, why = next(iter(problems.items()))
        raise H3StructureError(
            f"Sage Strided NHD Attention: {len(problems)} of {len(prefixes)} H3 attention modules differ from the "
            f"structure this patch knows, so nothing was patched. First: {first}: {'; '.join(why)}. "
            "This ComfyUI's H3 code has changed: update the pack, or run without this node.")

    clone = model_patcher.clone()
    if replaced_own:
        # our earlier patch may have covered the refiner when this one does not
        for key in [k for k, v in clone.object_patches.items() if conflicts.is_own(v)]:
            del clone.object_patches[key]
    n_refiner = sum(1 for p in prefixes if ".token_refiner." in p)
    report = RunReport(node_id=node_id, model_family=type(model_patcher.model).__name__, path="h3_forward_patch",
                       layout=layout, backend_requested=backend, blocks_patched=len(prefixes) - n_refiner,
                       refiner_blocks_patched=n_refiner, remaining_copies=REMAINING_COPIES,
                       replaced_own_patch=replaced_own)
    chain = kernels.BackendChain.for_choice(backend, model_patcher.load_device)
    for prefix in prefixes:
        forward = H3AttentionForward(model_patcher.get_model_object(prefix), chain=chain, layout=layout, report=report)
        clone.add_object_patch(prefix + ".forward", forward)
    install_run_report(clone, report)
    summary = dict(report.static, report=report,
                   backends_here=kernels.describe_backends(model_patcher.load_device))
    return clone, summary
