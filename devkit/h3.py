"""ComfyUI's MiniMax H3 (and a tiny Wan) for tests and benchmarks: a real checkpoint, or random weights.

Random weights are drawn straight on the target device (no 38 GB state dict in host memory),
scaled by 1/sqrt(fan_in) so activations stay O(1) through all blocks. Timing and memory of the
attention dataflow do not depend on the weights' values; equality between layouts holds for any
weights. The shapes (and so the packed token count) follow the config exactly.
"""

from __future__ import annotations

import functools
import json
import math
import zlib

import torch

# The shipped H3 DiT (comfy/ldm/minimax/model.py defaults): 50 blocks, hidden 5376, 56 x 128 heads.
FULL_H3 = {
    "hidden_size": 5376, "num_layers": 50, "token_refiner_num_layers": 2,
    "num_attention_heads": 56, "attention_head_dim": 128, "ffn_hidden_size": 14336,
    "latents_dim": 24, "audio_latents_dim": 32, "text_dim": 5120,
    "timestep_input_dim": 256, "time_embed_hidden_size": 5376, "time_embed_dim": 2688,
    "rope_inv_freq_len": 16,
}

# A two-block, narrow H3 for CPU tests and the first-run job: same code paths, tiny shapes.
TINY_H3 = {
    "hidden_size": 64, "num_layers": 2, "token_refiner_num_layers": 2, "num_attention_heads": 2,
    "attention_head_dim": 32, "ffn_hidden_size": 128, "text_dim": 32, "timestep_input_dim": 256,
    "time_embed_hidden_size": 64, "time_embed_dim": 32, "rope_inv_freq_len": 4,
}

# TINY_H3 wide enough for the int8 ConvRot route (every linear's input a multiple of its 256-wide groups) and for
# SageAttention's head dim 128: the CPU tests of the int8 route, the block path and the embedding release.
INT8_TINY_H3 = dict(TINY_H3, hidden_size=256, num_attention_heads=2, attention_head_dim=128, ffn_hidden_size=512)

ROPE_THETA = 10000.0


def packed_token_count(width: int, height: int, frames: int, text_tokens: int) -> dict:
    """Rows of H3's packed sequence for an empty AV latent of this size (see the H3 nodes)."""
    frames_aligned = frames
    while frames_aligned % 17 != 5:
        frames_aligned += 1
    latent_t = 2 if frames_aligned <= 5 else ((frames_aligned - 5) // 17) * 5 + 2
    audio_t = round(frames_aligned / 24 * 40)
    video_rows = latent_t * (height // 32) * (width // 32)
    audio_rows = 2 * audio_t
    return {"text": text_tokens, "audio": audio_rows, "video": video_rows,
            "total": text_tokens + audio_rows + video_rows, "latent_t": latent_t, "audio_t": audio_t}


@torch.no_grad()
def init_random_weights_(module: torch.nn.Module, seed: int, norm_spread: float = 0.0) -> None:
    """Fill every parameter in place: norms 1 (+ N(0, norm_spread)), biases 0, matrices N(0, 1/fan_in),
    rope real frequencies. Tests use a norm spread so that a norm weight applied wrongly shows."""
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if not tensor.is_floating_point():
            continue
        gen = torch.Generator(device=tensor.device).manual_seed(seed + zlib.crc32(name.encode()))
        if name.endswith("inv_freq"):
            n = tensor.numel()
            tensor.copy_(1.0 / ROPE_THETA ** (torch.arange(n, dtype=torch.float64) / n))
        elif tensor.dim() == 1 and "norm" in name:
            tensor.fill_(1.0)
            if norm_spread:
                tensor.add_(torch.randn(tensor.shape, generator=gen, device=tensor.device, dtype=tensor.dtype),
                            alpha=norm_spread)
        elif tensor.dim() == 1:
            tensor.zero_()
        else:
            fan_in = tensor.shape[-1]
            tensor.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)


def build_random_model(config: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """A ComfyUI ModelPatcher around a MiniMax H3 BaseModel built on ``device`` with random weights."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    model_config = comfy.supported_models.MiniMaxH3({"image_model": "minimax_h3", **config})
    model_config.set_inference_dtype(dtype, None, device=device)
    model = model_config.get_model({}, "", device=device)
    init_random_weights_(model.diffusion_model, seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=mm.unet_offload_device())


# The linears the bundled workflows' checkpoint (minimax_h3_fl2va_pruned_int8_convrot) stores as
# int8_tensorwise + convrot; ComfyUI loads them with mixed_precision_ops as QuantizedTensor
# ("TensorWiseINT8Layout") and runs comfy-kitchen int8_linear with a rotating activation quantiser.
INT8_CONVROT_LINEARS = (".attn.qkv_proj.weight", ".attn.out_proj.weight", ".mlp.fc1.weight", ".mlp.fc2.weight")
WEIGHT_FORMATS = ("bf16", "int8_convrot")


def int8_convrot_state_dict(state_dict: dict, groupsize: int = 256) -> dict:
    """``state_dict`` with every DiT block's qkv/out/fc1/fc2 weight in ComfyUI's int8_tensorwise + convrot
    format (int8 data, one fp32 scale per tensor, the ``comfy_quant`` JSON). The random weights are not
    rotated first: the numbers mean nothing, the loaded layers and their kernels are the checkpoint's."""
    import json

    out = {}
    for key, value in state_dict.items():
        if not (key.startswith("blocks.") and key.endswith(INT8_CONVROT_LINEARS)):
            out[key] = value
            continue
        w = value.float()
        scale = (w.abs().amax() / 127.0).clamp(min=1e-12)
        prefix = key[: -len("weight")]
        out[key] = (w / scale).round().clamp(-127, 127).to(torch.int8)
        out[prefix + "weight_scale"] = scale.reshape(()).cpu()
        conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": groupsize}
        out[prefix + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
    return out


# The other quantized formats ComfyUI's loader reads from a checkpoint's ``comfy_quant`` (comfy.quant_ops.QUANT_ALGOS),
# each with the comfy-kitchen layout it loads as and the arguments of that layout's own ``quantize``.
# TensorCoreSVDQuantW4A4Layout and TensorCoreAWQW4A16Layout have none: comfy-kitchen quantises neither (offline
# calibration) and ComfyUI 0.33's loader reads neither.
KITCHEN_FORMATS = {
    "int8_tensorwise": ("TensorWiseINT8Layout", {}),  # without ConvRot: not the bundled checkpoint's form
    "float8_e4m3fn": ("TensorCoreFP8Layout", {"dtype": torch.float8_e4m3fn}),
    "float8_e5m2": ("TensorCoreFP8Layout", {"dtype": torch.float8_e5m2}),
    "mxfp8": ("TensorCoreMXFP8Layout", {}),
    "nvfp4": ("TensorCoreNVFP4Layout", {}),
    "convrot_w4a4": ("TensorCoreConvRotW4A4Layout", {}),
    "asym_w4a8_int8": ("AsymW4A8Int8Layout", {}),
}
# the grouping fields ComfyUI writes into ``comfy_quant`` for the int4 formats (comfy.ops' state_dict)
GROUP_FIELDS = {"convrot_w4a4": ("convrot_groupsize",), "asym_w4a8_int8": ("group_size", "convrot_groupsize")}
# The UNETLoader's weight_dtype choices that store a plain checkpoint's weights in fp8 (computed in manual cast)
LOADER_DTYPES = {"loader_fp8_e4m3fn": torch.float8_e4m3fn, "loader_fp8_e5m2": torch.float8_e5m2}


def kitchen_state_dict(state_dict: dict, fmt: str) -> dict:
    """``state_dict`` with every DiT block's qkv/out/fc1/fc2 weight quantised by comfy-kitchen's own ``quantize`` of
    ``fmt``'s layout (KITCHEN_FORMATS), stored as ComfyUI writes such a checkpoint: the layout's tensors under the
    weight's name and the ``comfy_quant`` JSON. Raises ValueError where the installed comfy-kitchen lacks the layout."""
    import comfy_kitchen.tensor as ckt

    layout_name, kwargs = KITCHEN_FORMATS[fmt]
    layout = getattr(ckt, layout_name, None)
    if layout is None:
        raise ValueError(f"this comfy-kitchen has no {layout_name}")
    out = {}
    for key, value in state_dict.items():
        if not (key.startswith("blocks.") and key.endswith(INT8_CONVROT_LINEARS)):
            out[key] = value
            continue
        qdata, params = layout.quantize(value, **kwargs)
        out.update(ckt.QuantizedTensor(qdata, layout_name, params).state_dict(key))
        conf = {"format": fmt, **{name: getattr(params, name) for name in GROUP_FIELDS.get(fmt, ())}}
        out[key[: -len("weight")] + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")),
                                                                  dtype=torch.uint8)
    return out


def build_model(config: dict, device: torch.device, dtype: torch.dtype, seed: int, weights: str = "bf16"):
    """``build_random_model``, or the same random weights loaded as ``weights`` (WEIGHT_FORMATS, KITCHEN_FORMATS,
    LOADER_DTYPES) the way ComfyUI's UNETLoader loads such a checkpoint (comfy.sd picks mixed_precision_ops from
    comfy_quant; a loader fp8 weight_dtype stores plain weights in fp8)."""
    if weights not in WEIGHT_FORMATS + tuple(KITCHEN_FORMATS) + tuple(LOADER_DTYPES):
        raise ValueError(f"unknown weight format {weights!r}; choose one of {WEIGHT_FORMATS}, "
                         f"{tuple(KITCHEN_FORMATS)} or {tuple(LOADER_DTYPES)}")
    # drawn (and quantised) on the device: the full 50-block model is 19e9 parameters
    patcher = build_random_model(config, device, dtype, seed)
    if weights == "bf16":
        return patcher
    if weights in KITCHEN_FORMATS:
        convert = functools.partial(kitchen_state_dict, fmt=weights)
    elif weights in LOADER_DTYPES:
        convert, dtype = dict, LOADER_DTYPES[weights]  # bf16 on file, stored as the loader's fp8 dtype
    else:
        convert = functools.partial(int8_convrot_state_dict, groupsize=256 if config["hidden_size"] % 256 == 0
                                    else config["hidden_size"])
    import comfy.model_management as mm
    import comfy.sd

    with torch.inference_mode(False):  # loaded as a loader node loads: plain tensors, not inference ones
        # quantised where drawn, one tensor at a time, and copied to the CPU as a checkpoint file's
        # tensors come: the device never holds a second copy of the model (38 GB in bf16)
        state = {}
        for key, value in patcher.model.diffusion_model.state_dict().items():
            for name, tensor in convert({key: value}).items():
                state[name] = tensor.to("cpu", copy=True)
        del patcher
        # in ``dtype`` (the GPU's bf16; ComfyUI would pick fp32 on the CPU): the int8 layers' cast and
        # their int8 kernels depend on it
        quantised = comfy.sd.load_diffusion_model_state_dict(state, model_options={"dtype": dtype})
        del state
        quantised.load_device = device
        # loaded here, outside inference mode: moving QuantizedTensor parameters re-registers them
        mm.load_models_gpu([quantised], force_full_load=True)
    return quantised


def load_checkpoint_model(path: str):
    """A ComfyUI ModelPatcher for an H3 diffusion-model checkpoint, loaded as UNETLoader does."""
    import comfy.sd

    patcher = comfy.sd.load_diffusion_model(path)
    dm = patcher.model.diffusion_model
    if type(dm).__name__ != "MiniMaxH3Model":
        raise ValueError(f"{path} is a {type(dm).__name__} checkpoint, not MiniMax H3")
    return patcher


def model_config_of(patcher) -> dict:
    """The H3 dimensions of a loaded model, read from its modules."""
    dm = patcher.model.diffusion_model
    attn = dm.blocks[0].attn
    return {"hidden_size": dm.hidden_size, "num_layers": len(dm.blocks),
            "token_refiner_num_layers": len(dm.token_refiner.blocks),
            "num_attention_heads": attn.heads, "attention_head_dim": attn.head_dim,
            "ffn_hidden_size": dm.blocks[0].mlp.fc2.weight.shape[1],
            "text_dim": dm.condition_proj.weight.shape[1]}


def random_conditioning(text_tokens: int, text_dim: int, seed: int):
    """A CONDITIONING with seeded random text states [1, tokens, text_dim] (a stand-in for the text encoder)."""
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(1, text_tokens, text_dim, generator=gen, dtype=torch.float32)
    return [[states, {}]]


# A tiny Wan 2.1 text-to-video model: a model that calls ComfyUI's optimized_attention (override path).
TINY_WAN = {"model_type": "t2v", "dim": 128, "ffn_dim": 256, "num_heads": 1, "num_layers": 2, "in_dim": 16,
            "out_dim": 16, "text_dim": 4096, "freq_dim": 256}


def tiny_h3_model(seed: int = 0, config: dict = TINY_H3):
    """A bare random-weight MiniMaxH3Model in fp32 on the CPU (needs ComfyUI imported)."""
    import comfy.ldm.minimax.model as h3
    import comfy.ops

    model = h3.MiniMaxH3Model(**config, dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init)
    init_random_weights_(model, seed, norm_spread=0.1)
    return model.requires_grad_(False)  # ComfyUI runs inference; comfy-kitchen's in-place rope insists


def tiny_wan_model(seed: int = 0):
    import comfy.ldm.wan.model as wan
    import comfy.ops

    model = wan.WanModel(**TINY_WAN, dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init)
    init_random_weights_(model, seed, norm_spread=0.1)
    return model.requires_grad_(False)


def patcher_for(diffusion_model):
    """A CPU ModelPatcher around a bare diffusion model (what ModelPatcher patches lives under .diffusion_model)."""
    import comfy.model_patcher

    holder = torch.nn.Module()
    holder.diffusion_model = diffusion_model
    return comfy.model_patcher.ModelPatcher(holder, torch.device("cpu"), torch.device("cpu"))


def write_checkpoint(model, path) -> int:
    """``model``'s state dict as a safetensors file; returns its bytes."""
    return write_safetensors(path, lambda: model.state_dict().items())


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int8: "I8",
                      torch.uint8: "U8"}


def write_safetensors(path, named_tensors, metadata: dict | None = None) -> int:
    """A safetensors file from ``named_tensors()`` (a callable giving ``(name, tensor)`` pairs, asked twice: once for
    the header, once for the data), written tensor by tensor: never the whole model in host memory (47 GB for the
    int8 H3), whatever safetensors release the machine has; it appears whole (a rename). Returns the bytes."""
    import json
    import os
    from pathlib import Path

    header, offset = ({"__metadata__": metadata} if metadata else {}), 0
    for name, t in named_tensors():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, t in named_tensors():
            f.write(memoryview(t.detach().contiguous().to("cpu").view(-1).view(torch.uint8).numpy()))
    os.replace(tmp, path)
    return 8 + len(text) + offset


def random_block_inputs(block, seq: int, seed: int, text_rows: int = 100, audio_rows: int = 414,
                        dtype: torch.dtype | None = None, masked: bool = False, device: torch.device | None = None):
    """Inputs of one H3 ``DiTBlock`` call at ``seq`` packed tokens, on the block's device and dtype
    (or ``dtype``: a manual-cast model, such as the int8 one, computes in its inputs' dtype; ``device``: a block
    whose weights ComfyUI offloaded computes where its inputs lie):
    ``(x, t_emb, mod_segments, rope_freqs)`` with the packed layout's segments (text, audio, video;
    three modulation rows) and a random rope rotation table (rot_dim 96 of head_dim 128, as H3).
    ``masked``: as current ComfyUI under a partial denoise mask, two timesteps (six modulation rows)
    and the video segment's row a per-token index tensor choosing between the two."""
    from .rope import make_rope_table

    weight = block.norm1.weight
    device, dtype = device or weight.device, dtype or weight.dtype
    gen = torch.Generator().manual_seed(seed)
    text_rows, audio_rows = min(text_rows, seq // 3), min(audio_rows, seq // 3)
    x = torch.randn(seq, weight.shape[0], generator=gen).to(device, dtype)
    t_emb = torch.randn(1 + masked, block.adaln_proj.linear.weight.shape[1], generator=gen).to(device, dtype)
    video = 0
    if masked:
        video = (torch.randint(0, 2, (seq - text_rows - audio_rows,), generator=gen) * 3).to(device)
    segments = [(0, text_rows, 1), (text_rows, text_rows + audio_rows, 2), (text_rows + audio_rows, seq, video)]
    rot = block.attn.head_dim * 3 // 4
    rope = make_rope_table(seq, rot, generator=gen).to(device)
    return x, t_emb, segments, rope
