"""What a sampling run of an H3 clone is told it needs, and what its model calls took.

ComfyUI keeps weights on the GPU by ``sampler_helpers.estimate_memory`` -> the shared BaseModel's
``memory_required`` (H3's config factor: several times what the block fast path needs, ``kernels.memory_model``).
While this clone's sampling is prepared (its PREPARE_SAMPLING wrapper, in ComfyUI 0.33 and current upstream alike) the
shared model answers for the run's latent with the pack's model of one model call at the run's packed token count;
before and after, and for every other clone, stock's answer stands. Where anything that model needs is missing,
stock's answer stands too, and an estimate never fails the run. The measured peak: ``measured_call`` around each
model call (the clone's APPLY_MODEL wrapper: outside any compiled region, no synchronisation)."""

from __future__ import annotations

import contextlib
import functools
import logging

import comfy.model_management
import torch

from comfy_api.torch_helpers.torch_compile import TORCH_COMPILE_KWARGS

from .. import kernels
from . import chunking, int8_layers
from .embedding_release import VIDEO_PROJECTION, comfy_compiler_records

log = logging.getLogger("sage_strided_nhd")

ESTIMATED_DEVICES = ("cuda",)  # load devices whose estimate the pack gives (the CPU tests add "cpu")


def packed_tokens(conds: dict, latent_shapes) -> int | None:
    """The most rows one model call of the run packs (the longest cond's sequence: text, keyframes, references,
    audio, video), as the H3 model lays them out (its ``PackedLayout``, from the sampler's video and audio latent
    shapes); None where the run does not say."""
    import comfy.ldm.minimax.model as h3

    if not latent_shapes or len(latent_shapes) < 2 or len(latent_shapes[0]) != 5:
        return None
    video, audio = tuple(latent_shapes[0]), tuple(latent_shapes[1])
    most = None
    for cond in (c for cs in conds.values() for c in cs):
        text = cond.get("cross_attn")
        if text is None:
            return None
        # the model's h/w rounded up to its 2x2 patch, as its extra_conds builds the layout
        layout = h3.PackedLayout(text.shape[1], video[2], (video[3] + 1) // 2 * 2, (video[4] + 1) // 2 * 2,
                                 audio[-1], keyframes=cond.get("minimax_keyframes"), refs=cond.get("minimax_refs"))
        most = max(most or 0, layout.seq_len)
    return most


def block_dims(diffusion_model) -> dict:
    """``kernels.block_phases``' dimensions of the H3 DiT blocks."""
    block = diffusion_model.blocks[0]
    return {"hidden": int(diffusion_model.hidden_size), "heads": int(block.attn.heads),
            "head_dim": int(block.attn.head_dim), "ffn": int(block.mlp.fc2.in_features)}


def weight_formats(block) -> set[str]:
    """The block's linears' formats (``kernels.memory_model.WEIGHT_FORMATS``); both where they are mixed."""
    layers = (block.attn.qkv_proj, block.attn.out_proj, block.mlp.fc1, block.mlp.fc2)
    return {"int8" if int8_layers.is_int8_tensorwise(getattr(m, "weight", None)) else "bf16" for m in layers}


def inference_dtype(base_model) -> torch.dtype:
    get = getattr(base_model, "get_dtype_inference", None)
    return get() if get is not None else (getattr(base_model, "manual_cast_dtype", None) or base_model.get_dtype())


def full_load(force_full_load: bool) -> bool:
    """ComfyUI will load every weight onto the device (``load_models_gpu``: forced, or a VRAM state without
    partial loads)."""
    states = getattr(comfy.model_management, "VRAMState", None)
    if force_full_load or states is None:
        return bool(force_full_load)
    return getattr(comfy.model_management, "vram_state", None) not in (states.LOW_VRAM, states.NORMAL_VRAM,
                                                                       states.NO_VRAM)


def by_columns(block, dtype) -> bool:
    """The qkv weight, on the device as it is stored, gives its product by column blocks: an int8 ConvRot weight
    (``int8_layers.quantized_columns``) or a plain one in the compute dtype, no bias (``chunking.column_products``)."""
    layer = block.attn.qkv_proj
    w = getattr(layer, "weight", None)
    return int8_layers.is_int8_convrot(w) or (type(w) in (torch.Tensor, torch.nn.Parameter) and w.dtype == dtype
                                              and getattr(layer, "bias", None) is None)


def weight_forms(patcher, force_full_load: bool, chunks: bool, columns: bool = True) -> list[dict]:
    """The forms the blocks' linears may take in this run (``kernels.block_phases`` arguments), decided by ComfyUI's
    load after the estimate: a full load of a plain patcher leaves every weight on the device (the qkv projection by
    ``columns`` or by rows); DynamicVRAM casts each weight for its calls (chunked, cast once a block); a partial load,
    or weight patches, may run a block whole."""
    resident = not patcher.is_dynamic() and full_load(force_full_load)
    patched = bool(patcher.patches or getattr(patcher, "weight_wrapper_patches", None))
    ways = (columns,) if resident else (True, False)
    forms = [dict(chunked=True, qkv_by_columns=by, cast_weights=not resident) for by in ways] if chunks else []
    if not (chunks and (resident or (patcher.is_dynamic() and not patched))):
        forms.append(dict(chunked=False, cast_weights=not resident))
    return forms


def prepared_path(patch, device, tokens: int, dims: dict, dtype) -> bool:
    """Every chain takes a call of this shape on a prepared path by token chunks (``BackendChain.projected_backend``,
    as ``run_projected`` asks it), asked on a broadcast view of one row (no call-sized buffer)."""
    s = patch.settings
    if s.layout != "strided_nhd" or comfy.model_management.in_training or device.type != "cuda":
        return False
    one = torch.empty(1, 1, dims["heads"], dims["head_dim"], dtype=dtype, device=device)
    probe = one.expand(1, tokens, dims["heads"], dims["head_dim"])
    return all(chain.projected_backend([probe] * 3, s.prep_mode) is not None
               for chain in (patch.plan.default, *patch.plan.chains.values()))


def model_call_estimate(patch, patcher, conds: dict, model_options, force_full_load: bool = False) -> int | None:
    """The pack's bytes of one model call (batch 1) of this run, or None: stock's estimate stands (a block not on
    the fast path, a block replace, the run's token count unknown)."""
    diffusion_model = patcher.get_model_object("diffusion_model")
    blocks = len(getattr(diffusion_model, "blocks", ()))
    replaced = (model_options or {}).get("transformer_options", {}).get("patches_replace", {}).get("dit")
    if not blocks or patch.plan.block_path_blocks != blocks or replaced:
        return None
    tokens = packed_tokens(conds, patch.latent_shapes)
    if not tokens:
        return None
    device, dtype, dims = torch.device(patcher.load_device), inference_dtype(patcher.model), block_dims(diffusion_model)
    chunks = dtype in chunking.CHUNKED_DTYPES and device.type in chunking.CHUNKED_DEVICES
    s = patch.settings
    how = dict(dims, act_bytes=dtype.itemsize, prepared=prepared_path(patch, device, tokens, dims, dtype),
               qkv_chunk_tokens=s.qkv_chunk_tokens, mlp_chunk_tokens=s.mlp_chunk_tokens,
               int8_mlp_chunk_tokens=s.int8_mlp_chunk_tokens)
    block = diffusion_model.blocks[0]
    forms = weight_forms(patcher, force_full_load, chunks, by_columns(block, dtype))
    formats = weight_formats(block)
    peak = max(kernels.block_peak_bytes(tokens, weights=w, **form, **how) for w in formats for form in forms)
    return kernels.model_call_bytes(tokens, peak, hidden=dims["hidden"], act_bytes=dtype.itemsize,
                                    embedding_released=embedding_released(patch, patcher, model_options, device))


def embedding_released(patch, patcher, model_options, device) -> bool:
    """The first block hands stock's video embedding back (embedding_release.py): the pack's release is the video
    patch projection's forward on this patcher, and neither a torch.compile wrapper nor the Comfy Compiler takes
    the forward (both keep it)."""
    on = patch.embedding is not None and patcher.object_patches.get(VIDEO_PROJECTION + ".forward") is patch.embedding
    return on and TORCH_COMPILE_KWARGS not in (model_options or {}) and not comfy_compiler_records(device)


@contextlib.contextmanager
def run_estimate(patch, patcher, noise_shape, conds: dict, model_options=None, force_full_load: bool = False):
    """For the ``with`` block (the clone's sampling preparation), the shared BaseModel's ``memory_required`` answers
    for this run's latent: the pack's bytes per batch item where ``model_call_estimate`` gives them, else stock's;
    each answer goes to the report. On a load device outside ``ESTIMATED_DEVICES``, or where another patch answers
    (an object patch or an attribute of the model's own), nothing changes."""
    base = getattr(patcher, "model", None)
    device = getattr(patcher, "load_device", None)
    if (base is None or device is None or torch.device(device).type not in ESTIMATED_DEVICES
            or "memory_required" in vars(base) or "memory_required" in getattr(patcher, "object_patches", {})):
        yield
        return
    try:
        per_call = model_call_estimate(patch, patcher, conds, model_options, force_full_load)
    except Exception as exc:  # an estimate never fails the run: stock's stands
        log.warning("[Sage Strided NHD] memory estimate: ComfyUI's own stands (%s: %s)", type(exc).__name__, exc)
        per_call = None
    stock = base.memory_required
    run_shape = list(noise_shape[1:])

    # stock's signature (``__wrapped__``): current ComfyUI passes an argument only where the method takes it
    @functools.wraps(stock)
    def memory_required(input_shape, *args, **kwargs):
        if per_call is not None and list(input_shape[1:]) == run_shape:
            answer, by = input_shape[0] * per_call, "pack"
        else:
            answer, by = stock(input_shape, *args, **kwargs), "comfyui"
        if list(input_shape[1:]) == run_shape:
            patch.report.estimated(answer, by)
        return answer

    base.memory_required = memory_required
    try:
        yield
    finally:
        if vars(base).get("memory_required") is memory_required:
            del base.memory_required


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
