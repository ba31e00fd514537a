"""MiniMax H3: replace each attention forward with the strided NHD dataflow.

ComfyUI's H3 ``Attention.forward(x, rope_freqs=None, transformer_options={})`` takes the
block input ``[S, hidden]``, runs the fused ``qkv_proj``, normalises and rotates Q/K,
calls attention through HND views (ComfyUI 0.33 also makes a ``v.clone()``; every version
makes a transposed output copy) and applies ``out_proj``. Current ComfyUI gives each
Attention a ``comfy_attention`` module through which a checkpoint may prefer an attention
function (see conflicts.py, rule 6); the forward signature is unchanged. The forward
installed here keeps the same inputs, outputs and cases (rope table or plain per-head
norms; out-of-place norm+rope in training mode) but hands the fused buffer to
``kernels.attention_from_fused_qkv``.

torch.compile: only ``qkv_proj`` and ``out_proj`` are traced. The attention and every
piece of bookkeeping (chain choice, the run report) run in ``_attend``, which dynamo does
not trace (``torch.compiler.disable``), so no guard depends on pack state.

Object patches on a ``ModelPatcher.clone()`` apply only while that clone runs and are
undone after, so the input model and other graph branches keep stock attention.
"""

from __future__ import annotations

import inspect

import comfy.model_management
import torch

from .. import kernels
from . import conflicts
from .report import RunReport, install_run_report
from .settings import check_settings

H3_MODEL_CLASS = "comfy.ldm.minimax.model.MiniMaxH3Model"
FORWARD_PARAMS = ("self", "x", "rope_freqs", "transformer_options")

# comfy_attention.config["attention"] names (ComfyUI's) -> the pack's back-end that runs them
PREFERENCE_BACKENDS = {"comfy_kitchen_int8": "comfy_kitchen_int8", "sdpa": "sdpa", "pytorch": "sdpa",
                       "sage": "sage2", "sage2": "sage2", "sage1": "sage1"}
# ComfyUI attention functions another node may set as comfy_attention.function (rule 7)
FUNCTION_BACKENDS = {"attention_comfy_kitchen_int8": "comfy_kitchen_int8", "attention_pytorch": "sdpa",
                     "attention_sage": "sage2"}


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
    # ComfyUI 0.33 and current upstream share this signature (upstream added comfy_attention, not parameters)
    params = tuple(inspect.signature(type(attn).forward).parameters)
    if params != FORWARD_PARAMS:
        problems.append(f"forward{params} differs from forward{FORWARD_PARAMS}")
    return problems


class H3AttentionForward:
    """Replacement for one H3 ``Attention.forward``: same arguments, same output.

    ``chain`` is the node's back-end chain; ``run_chain`` the one this sampling run uses for
    this module (the checkpoint's preference, rule 6), set when sampling starts.
    """

    sage_strided_nhd = True  # ownership mark (see conflicts.py)

    def __init__(self, attn, *, chain, layout: str, report: RunReport, prep_mode: str = "exact"):
        self.attn = attn
        self.chain = chain
        self.run_chain = chain
        self.layout = layout
        self.prep_mode = prep_mode
        self.report = report

    def __call__(self, x, rope_freqs=None, transformer_options={}):
        # the fused buffer is handed over in a list: no frame here keeps it alive while the kernel runs
        out = _attend(self, [self.attn.qkv_proj(x)], x.device, rope_freqs)
        return self.attn.out_proj(out)


@torch.compiler.disable
def _attend(fwd: H3AttentionForward, handed: list, device, rope_freqs):
    """The attention of one H3 forward and its record; never traced by dynamo."""
    attn = fwd.attn
    if rope_freqs is not None:
        # ComfyUI may keep weights offloaded or in another dtype: cast like upstream does
        q_weight = comfy.model_management.cast_to(attn.q_norm.weight, device=device)
        k_weight = comfy.model_management.cast_to(attn.k_norm.weight, device=device)
        out, rec = kernels.attention_from_fused_qkv(
            handed, attn.heads, attn.head_dim, chain=fwd.run_chain, layout=fwd.layout, rope_table=rope_freqs,
            q_weight=q_weight, k_weight=k_weight, eps=attn.q_norm.eps, prep_mode=fwd.prep_mode,
            inplace=not comfy.model_management.in_training)  # training keeps the graph: out of place
    else:
        out, rec = kernels.attention_from_fused_qkv(
            handed, attn.heads, attn.head_dim, chain=fwd.run_chain, layout=fwd.layout, prep_mode=fwd.prep_mode,
            q_norm=attn.q_norm, k_norm=attn.k_norm)
    fwd.report.record(rec)
    return out


# --- the checkpoint's attention preference (rules 6, 7) ----------------------------------------------
def preference(model_patcher, prefix: str):
    """(pack back-end or None, where it comes from, why it is ignored or None) for one attention module.

    Raises PatchConflictError for a foreign attention function the pack cannot run (rule 7).
    """
    fkey = prefix + ".comfy_attention.function"
    patched = model_patcher.object_patches.get(fkey)
    try:
        cattn = model_patcher.get_model_object(prefix + ".comfy_attention")
    except AttributeError:  # ComfyUI 0.33: no comfy_attention
        cattn = None
    if patched is None and cattn is None:
        return None, "", None
    config = getattr(cattn, "config", None)
    function = patched if patched is not None else getattr(cattn, "function", None)
    if patched is None and isinstance(config, dict) and config.get("attention"):
        name = str(config["attention"])
        backend = PREFERENCE_BACKENDS.get(name)
        if backend is None or backend not in kernels.BACKENDS:
            return None, f"comfy_attention.config {name!r}", "the pack has no back-end for it"
        return backend, f"comfy_attention.config {name!r}", None
    if function is None:
        return None, "", None
    backend = FUNCTION_BACKENDS.get(getattr(function, "__name__", ""))
    if backend is None:
        how = "set by another node's object patch" if patched is not None else "set on the module"
        raise conflicts.PatchConflictError(
            f"Sage Strided NHD Attention: {prefix}.comfy_attention.function is {conflicts.describe(function)} "
            f"({how}). This node's forward does not call it, so it would be silently dropped: remove the node "
            "that sets it, or remove this one.")
    return backend, f"comfy_attention.function {conflicts.describe(function)}", None


def _span(indices: list[int]) -> str:
    runs, start, prev = [], None, None
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            runs.append((start, prev))
            start = prev = i
    if start is not None:
        runs.append((start, prev))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


_CHAINS: dict[tuple[str, str], kernels.BackendChain] = {}


def _chain_for(choice: str, device) -> kernels.BackendChain:
    key = (choice, str(device))
    if key not in _CHAINS:
        _CHAINS[key] = kernels.BackendChain.for_choice(choice, device)
    return _CHAINS[key]


def _inspector(forwards: dict, backend: str):
    """The sampling-time stack check for one H3 patch (see conflicts.py for the rules)."""

    def inspect_stack(model_patcher, model_options):
        notes = conflicts.check_override_at_sampling(model_patcher, model_options, "h3_forward_patch")
        foreign, active = [], []
        for key, fwd in forwards.items():
            current = model_patcher.object_patches.get(key)
            if current is fwd:
                active.append(key)
            elif current is not None and not conflicts.is_own(current):
                foreign.append(key)
        if foreign:
            raise conflicts.forward_conflict(model_patcher, foreign, "replaced (after this node)")

        groups: dict[tuple, list[int]] = {}
        for key in active:
            fwd = forwards[key]
            prefix = key[: -len(".forward")]
            preferred, source, ignored = preference(model_patcher, prefix)
            fwd.run_chain = fwd.chain
            family = "token_refiner blocks" if ".token_refiner." in prefix else "blocks"
            index = int(prefix.split(".")[-2])
            if ignored:
                groups.setdefault((family, source, f"ignored: {ignored}"), []).append(index)
            elif preferred is not None:
                if backend == "auto":
                    fwd.run_chain = _chain_for(preferred, model_patcher.load_device)
                    verdict = f"honoured: {preferred} runs first (backend auto)"
                else:
                    verdict = f"overridden by the node's back-end {backend}"
                groups.setdefault((family, source, verdict), []).append(index)
        for (family, source, verdict), indices in groups.items():
            notes.append(f"checkpoint attention preference ({source}) on {family} {_span(indices)}: {verdict}")

        replaced = model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
        if replaced and not conflicts.sparse_node_present(model_patcher):
            notes.append(f"another node replaces {len(replaced)} DiT block(s) (patches_replace 'dit'): calls they "
                         "route to the block's attention run this node's forward and are counted; others are theirs")
        blocks = sum(1 for k in active if ".token_refiner." not in k)
        return {"blocks_patched": blocks, "refiner_blocks_patched": len(active) - blocks, "notes": notes}

    return inspect_stack


def patch_model(model_patcher, layout: str = "strided_nhd", backend: str = "auto", patch_refiner: bool = True,
                node_id=None, prep_mode: str = "exact", *, checked: bool = False):
    """Patch a clone of an H3 ModelPatcher exactly as the node does.

    Returns ``(clone, summary)``; the input patcher is not modified. ``summary`` holds the
    static facts of the patch, ``summary["report"]`` the :class:`RunReport` that collects
    each sampling run (``report.last`` is the last payload sent). Raises ``ValueError`` for
    a model that is not H3 or unknown settings, :class:`H3StructureError` when an attention
    module differs from the known structure, and ``conflicts.PatchConflictError`` per the
    rules in conflicts.py (again when sampling starts, for nodes placed after this one).
    """
    if not checked:
        check_settings(layout, backend, prep_mode)
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    if not is_h3_model(diffusion_model):
        raise ValueError(f"Sage Strided NHD Attention: {type(diffusion_model).__name__} is not {H3_MODEL_CLASS}")
    conflicts.check_override_at_patch(model_patcher, "h3_forward_patch")
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
    for prefix in prefixes:
        preference(model_patcher, prefix)  # rule 7 when the node executes, too

    clone = model_patcher.clone()
    if replaced_own:
        # our earlier patch may have covered the refiner when this one does not
        for key in [k for k, v in clone.object_patches.items() if conflicts.is_own(v)]:
            del clone.object_patches[key]
    n_refiner = sum(1 for p in prefixes if ".token_refiner." in p)
    report = RunReport(node_id=node_id, model_family=type(model_patcher.model).__name__, path="h3_forward_patch",
                       layout=layout, backend_requested=backend, prep_mode=prep_mode,
                       blocks_patched=len(prefixes) - n_refiner, refiner_blocks_patched=n_refiner,
                       replaced_own_patch=replaced_own)
    chain = _chain_for(backend, model_patcher.load_device)
    forwards = {}
    for prefix in prefixes:
        forward = H3AttentionForward(model_patcher.get_model_object(prefix), chain=chain, layout=layout,
                                     report=report, prep_mode=prep_mode)
        clone.add_object_patch(prefix + ".forward", forward)
        forwards[prefix + ".forward"] = forward
    report.inspector = _inspector(forwards, backend)
    install_run_report(clone, report)
    summary = dict(report.static, report=report,
                   backends_here=kernels.describe_backends(model_patcher.load_device))
    return clone, summary
