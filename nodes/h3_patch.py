"""MiniMax H3: each attention forward replaced on a clone by one that hands the fused qkv buffer to the kernels'
dataflow; torch.compile traces only the projections (``_attend`` is skipped)."""

from __future__ import annotations

import contextlib
import functools
import inspect

import comfy.model_management
import torch
from comfy.patcher_extension import WrappersMP

from .. import kernels
from . import chunking, conflicts, h3_block, int8_layers
from .embedding_release import VIDEO_PROJECTION, EmbeddingRelease
from .ownership import is_foreign, is_own
from .patch import NODE, InstalledPatch, Note, Plan, Settings
from .report import RunReport

H3_MODEL_CLASS = "comfy.ldm.minimax.model.MiniMaxH3Model"
FORWARD_PARAMS = ("self", "x", "rope_freqs", "transformer_options")
# Attention modules without the fused qkv_proj, by the registered submodule that shows it (a read-only ``qkv_proj``
# view laid over q/k/v, as ComfyUI-H3-DTsQKV may lay, is no submodule and is never touched: it would concatenate)
DECLINED_PROJECTIONS = (
    (("q_proj", "k_proj", "v_proj"), "separate_qkv_declined",
     "separate q/k/v projections: {found} of {total} H3 attention modules project Q, K and V with q_proj/k_proj/v_proj "
     "(a split-QKV checkpoint such as DT-sQKV) instead of one fused qkv_proj"),
    (("qv_proj",), "keyless_declined",
     "no K projection: {found} of {total} H3 attention modules project a packed qv_proj (a \"Keyless\" H3 checkpoint) "
     "instead of one fused qkv_proj"),
)


class H3StructureError(ValueError):
    """The module is not the H3 attention this patch knows."""


def is_h3_model(diffusion_model) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" == H3_MODEL_CLASS for c in type(diffusion_model).__mro__)


def attention_keys(diffusion_model, patch_refiner: bool) -> list[str]:
    """Object-patch key prefixes (relative to the BaseModel) of every attention to patch."""
    keys = [f"diffusion_model.blocks.{i}.attn" for i in range(len(diffusion_model.blocks))]
    refiner = getattr(diffusion_model, "token_refiner", None)
    if patch_refiner and refiner is not None:
        keys += [f"diffusion_model.token_refiner.blocks.{i}.attn" for i in range(len(refiner.blocks))]
    return keys


def declined_note(model_patcher, prefixes) -> Note | None:
    """Why the node declines a checkpoint whose attention has no fused qkv_proj (``DECLINED_PROJECTIONS``), or None."""
    for names, code, text in DECLINED_PROJECTIONS:
        found = [p for p in prefixes
                 if any(getattr(model_patcher.get_model_object(p), "_modules", {}).get(n) is not None for n in names)]
        if found:
            return Note(code, text.format(found=len(found), total=len(prefixes)) + (
                ", so there is no fused buffer to take Q/K/V views of. Nothing was patched: stock ComfyUI runs every "
                "block, with its own attention and bits. Remove this node for this checkpoint, or load one with a "
                "fused qkv_proj."))
    return None


def structure_problems(attn) -> list[str]:
    """Everything about ``attn`` that differs from the H3 attention the patch was written for."""
    problems = h3_block.missing(attn, "qkv_proj.weight", "q_norm.weight", "k_norm.weight", "out_proj.weight")
    problems += [f"{name} is not an int ({getattr(attn, name, None)!r})" for name in ("heads", "head_dim")
                 if not isinstance(getattr(attn, name, None), int)]
    if problems:
        return problems
    inner = attn.heads * attn.head_dim
    qkv_w, out_w = attn.qkv_proj.weight, attn.out_proj.weight
    hidden = qkv_w.shape[1] if qkv_w.dim() == 2 else None
    if qkv_w.dim() != 2 or qkv_w.shape[0] != 3 * inner:
        problems.append(f"qkv_proj.weight is {list(qkv_w.shape)}, expected [3*heads*head_dim={3 * inner}, hidden]")
    if out_w.dim() != 2 or out_w.shape[1] != inner or (hidden is not None and out_w.shape[0] != hidden):
        problems.append(f"out_proj.weight is {list(out_w.shape)}, expected [hidden={hidden}, heads*head_dim={inner}]")
    problems += [f"{name}.weight is {list(getattr(attn, name).weight.shape)}, expected [head_dim={attn.head_dim}]"
                 for name in ("q_norm", "k_norm") if tuple(getattr(attn, name).weight.shape) != (attn.head_dim,)]
    if not isinstance(getattr(attn.q_norm, "eps", None), float):
        problems.append("q_norm has no float eps")
    # ComfyUI 0.33 and current upstream share this signature (upstream added comfy_attention, not parameters)
    params = tuple(inspect.signature(type(attn).forward).parameters)
    if params != FORWARD_PARAMS:
        problems.append(f"forward{params} differs from forward{FORWARD_PARAMS}")
    return problems


class H3Patch(InstalledPatch):
    """The node's state on an H3 clone, with the video embedding's release; its APPLY_MODEL wrapper adds the peak
    per model call (outside any compiled region, around it)."""

    def __init__(self, settings: Settings, report: RunReport, planner, plan: Plan):
        super().__init__(settings, report, planner, plan)
        self.embedding = None  # block path: an embedding_release.EmbeddingRelease (scoped by APPLY_MODEL)

    def wrappers(self) -> dict:
        return super().wrappers() | {WrappersMP.APPLY_MODEL: self.apply_model_wrapper}

    def apply_model_wrapper(self, executor, x, *args, **kwargs):
        """ComfyUI APPLY_MODEL wrapper: the model call's peak allocation goes to the report (CUDA); with the block
        path, the call is the scope of the video embedding's release."""
        with contextlib.ExitStack() as scope:
            if self.embedding is not None:  # the input's device: a tensor's, or the first of H3's video and audio
                device = next((t.device for t in (x if isinstance(x, (list, tuple)) else (x,))
                               if isinstance(t, torch.Tensor)), None)
                scope.enter_context(self.embedding.model_call(getattr(executor, "class_obj", None), device))
            if not self.settings.measure_peak:
                return executor(x, *args, **kwargs)
            return measured_call(executor, x, args, kwargs, self.report.measured_peak)


def measured_call(executor, x, args, kwargs, record):
    """``executor(x, *args, **kwargs)``; on CUDA, its peak allocation above what was allocated when it began goes to
    ``record`` (the allocator's own counters: no synchronisation; its peak statistics are reset here)."""
    device = getattr(x, "device", None)
    if device is None or device.type != "cuda":
        return executor(x, *args, **kwargs)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        return executor(x, *args, **kwargs)
    finally:
        record(torch.cuda.max_memory_allocated(device) - start)


class H3AttentionForward:
    """Replacement for one H3 ``Attention.forward`` (same arguments, same output) on the run's chain for its ``key``."""

    sage_strided_nhd = True  # ownership mark (see ownership.py)

    def __init__(self, attn, key: str, patch: InstalledPatch):
        self.attn = attn
        self.key = key
        self.patch = patch

    def __call__(self, x, rope_freqs=None, transformer_options={}, into=None):
        """``into`` (from our block forward): a ``kernels.PendingResidual`` the output is added to, returned."""
        if isinstance(x, list):  # a block forward handed its input over (KJNodes' Low VRAM Attention; ours)
            x = x.pop()
        rows = x.rows if isinstance(x, kernels.PendingModulation) else x  # ours: with the modulation still owed
        device, qkv, routes = rows.device, self.attn.qkv_proj, self.patch.plan.int8_routes
        linear = int8_layers.caller(self.patch)  # int8 ConvRot GEMMs on the pack's quantiser where the route runs
        plan = chunking.projection_chunking(qkv, rows, self.patch.settings.qkv_chunk_tokens, routes)
        if plan.rows is None or rope_freqs is None:
            del rows
            source = [linear(qkv, x)]
            del x  # the fused buffer, handed over, is the only thing alive while the kernel runs
            out = _attend(self, source, device, rope_freqs)
        else:  # a prepared path may take the projection by token chunks: the fused buffer never exists whole
            # a weight ComfyUI casts per call is cast once (CAST_ONCE), held until the attention has taken every row
            with (chunking.cast_once(qkv, rows, None, self.patch.report.record_int8, routes)
                  if chunking.CAST_ONCE in plan.modes else contextlib.nullcontext()) as held:
                del rows
                source = self._row_projection(x, held, linear)
                del x  # the projection, handed over, is the only thing alive while the kernel runs
                out = _attend(self, source, device, rope_freqs, plan.rows)
                del source, held  # nothing keeps the cast weight past its context
        return linear(self.attn.out_proj, out, into=into)

    def _row_projection(self, x, held, linear):
        """The projection taken by token ranges (``kernels.RowProjection``): by columns on its input quantised once
        where the int8 route takes it (``int8_layers.quantized_columns``), else each range through the layer's call,
        K/V by column blocks where they give its bits. ``held``: the weight as cast once (``int8_layers.HeldCast``)."""
        qkv, inner, report = self.attn.qkv_proj, self.attn.heads * self.attn.head_dim, self.patch.report
        cast = None if held is None else (held.weight, held.bias)
        form = int8_layers.quantized_columns(qkv, x, inner, record=report.record_int8,
                                             routes=self.patch.plan.int8_routes, cast=cast)
        if form is not None:
            rows, project, columns = form
            del form
            try:
                return kernels.RowProjection(project, rows, columns=columns)  # K projected here
            except kernels.GemmDeclined as exc:
                report.record_int8(str(exc))  # by rows, each chunk as stock computes it
            del rows, project, columns
        x = kernels.settled(x)
        project = functools.partial(linear, qkv) if held is None else held
        return kernels.RowProjection(project, x, columns=chunking.column_products(qkv, x, inner, cast))


@torch.compiler.disable
def _attend(fwd: H3AttentionForward, source, device, rope_freqs, chunk=None):
    """The attention of one H3 forward and its record; never traced by dynamo. ``source``: the fused
    projection handed over in a list, or a ``kernels.RowProjection`` taken by ``chunk`` rows."""
    attn, patch = fwd.attn, fwd.patch
    if rope_freqs is not None:
        # ComfyUI may keep weights offloaded or in another dtype: cast like upstream does
        norm = kernels.QKNorm(rope_table=rope_freqs, eps=attn.q_norm.eps,
                              q_weight=comfy.model_management.cast_to(attn.q_norm.weight, device=device),
                              k_weight=comfy.model_management.cast_to(attn.k_norm.weight, device=device),
                              inplace=not comfy.model_management.in_training)  # training keeps the graph
    else:
        norm = kernels.QKNorm(q_norm=attn.q_norm, k_norm=attn.k_norm)
    how = dict(chain=patch.plan.chain_for(fwd.key), norm=norm, layout=patch.settings.layout,
               prepared_mode=patch.settings.prep_mode)
    if chunk is None:
        out, rec = kernels.attention_from_fused_qkv(source, attn.heads, attn.head_dim, **how)
    else:
        out, rec = kernels.attention_from_projection(source, attn.heads, attn.head_dim, chunk=chunk, **how)
    patch.report.record(rec)
    return out


def patch_model(model_patcher, settings: Settings, node_id=None, notes=()):
    """Patch a clone of an H3 ModelPatcher as the node does; returns ``(clone, patch)``. Raises
    ValueError (not H3), H3StructureError, or conflicts.PatchConflictError (the stack rules)."""
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    if not is_h3_model(diffusion_model):
        raise ValueError(f"{NODE}: {type(diffusion_model).__name__} is not {H3_MODEL_CLASS}")
    prefixes = attention_keys(diffusion_model, settings.patch_refiner)
    declined = declined_note(model_patcher, prefixes)
    if declined is not None:  # a clone carrying no forward of this node's, only its report: sampling runs stock
        clone, report, default = _clone(model_patcher, settings, node_id, tuple(notes) + (declined,), True)
        patch = H3Patch(settings, report, lambda patcher, options: Plan(default), Plan(default))
        patch.install(clone)
        return clone, patch
    conflicts.check_override_at_patch(model_patcher, "h3_forward_patch")
    replaced_own, taken_over = conflicts.check_object_patches(model_patcher, [p + ".forward" for p in prefixes])
    problems = {p: found for p in prefixes if (found := structure_problems(model_patcher.get_model_object(p)))}
    if problems:
        first, why = next(iter(problems.items()))
        raise H3StructureError(
            f"{NODE}: {len(problems)} of {len(prefixes)} H3 attention modules differ from the "
            f"structure this patch knows, so nothing was patched. First: {first}: {'; '.join(why)}. "
            "This ComfyUI's H3 code has changed: update the pack, or run without this node.")
    for prefix in prefixes:
        conflicts.preference(model_patcher, prefix)  # rule 7 when the node executes, too

    n_refiner = sum(1 for p in prefixes if ".token_refiner." in p)
    clone, report, default = _clone(model_patcher, settings, node_id, notes, replaced_own,
                                    blocks_patched=len(prefixes) - n_refiner, refiner_blocks_patched=n_refiner,
                                    replaced_own_patch=replaced_own)
    forwards = {}
    patch = H3Patch(settings, report, lambda patcher, options: conflicts.plan_h3(
        patcher, options, forwards, settings.backend, default, taken_over, blocks), Plan(default))
    blocks = _install_block_path(model_patcher, clone, diffusion_model, patch)
    patch.embedding = _install_embedding_release(model_patcher, clone, diffusion_model, blocks, report)
    for prefix in prefixes:
        forwards[prefix + ".forward"] = H3AttentionForward(model_patcher.get_model_object(prefix),
                                                           prefix + ".forward", patch)
        clone.add_object_patch(prefix + ".forward", forwards[prefix + ".forward"])
    patch.install(clone)
    return clone, patch


def _clone(model_patcher, settings: Settings, node_id, notes, shed_own: bool, **counts):
    """``(clone, its report, the node's own chain)``; ``shed_own``: this node's earlier patches taken off the clone
    (rule 1; our earlier patch may have covered the refiner when this one does not)."""
    clone = model_patcher.clone()
    if shed_own:
        for key in [k for k, v in clone.object_patches.items() if is_own(v)]:
            del clone.object_patches[key]
    report = RunReport(node_id=node_id, model_family=type(model_patcher.model).__name__, path="h3_forward_patch",
                       settings=settings, notes=notes, **counts)
    return clone, report, kernels.BackendChain.for_choice(settings.backend, prepared=settings.prepared)


def _install_block_path(model_patcher, clone, diffusion_model, patch: H3Patch) -> conflicts.BlockPath:
    """The block fast path's forwards on the clone, where the settings, the block structure and the
    patch stack allow it; the rest of the blocks keep the attention-only patch (rule 9)."""
    if patch.settings.block_path == "attention_only":
        return conflicts.BlockPath(declined="the node's block_path is attention_only")
    problems = h3_block.structure_problems(diffusion_model.blocks[0]) if len(diffusion_model.blocks) else []
    if problems:
        return conflicts.BlockPath(
            declined=f"the DiT block differs from the one it was written for: {'; '.join(problems)}")
    keys = h3_block.block_keys(diffusion_model)
    free, taken_over = conflicts.check_block_forwards(model_patcher, keys)
    forwards = {}
    for key in free:
        block = model_patcher.get_model_object(key[: -len(".forward")])
        forwards[key] = h3_block.H3BlockForward(block, patch)
        clone.add_object_patch(key, forwards[key])
    return conflicts.BlockPath(forwards=forwards, taken_over=taken_over)


def _install_embedding_release(model_patcher, clone, diffusion_model, blocks: conflicts.BlockPath,
                               report) -> EmbeddingRelease | None:
    """The video embedding's release where the block path runs the first DiT block and no other node replaced the
    video patch projection's forward; None elsewhere (stock keeps the embedding)."""
    key = VIDEO_PROJECTION + ".forward"
    first = h3_block.block_keys(diffusion_model)[:1]
    if not first or first[0] not in blocks.forwards or is_foreign(clone.object_patches.get(key)):
        return None
    release = EmbeddingRelease(model_patcher.get_model_object(VIDEO_PROJECTION), report)
    clone.add_object_patch(key, release)
    return release
