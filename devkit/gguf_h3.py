"""A GGUF-quantized MiniMax H3, written with the ``gguf`` package and loaded as ComfyUI-GGUF's UnetLoaderGGUF loads one.

ComfyUI-GGUF (city96/ComfyUI-GGUF, read at 795e45156ece99afbc3efef911e63fcb46e6a20d) is not on a package registry,
so the tests cannot install it. This module is a stand-in written from its interfaces, not its code:

- the loader reads the file with ``gguf.GGUFReader`` and gives ComfyUI a state dict of tensors that keep the file's
  raw data (quantized blocks as bytes; F32/F16 as arrays) with the GGML type and the logical shape (``.shape``
  answers the logical shape, so ComfyUI's model detection reads the H3 config), then calls
  ``comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": ops})``;
- its ops subclass ``comfy.ops.manual_cast``: a ``Linear`` with ``comfy_cast_weights`` that keeps those tensors as its
  parameters (assigned, never copied) and, where the weight or bias is quantized (any type but F32/F16), dequantizes
  it on every call in ``forward_comfy_cast_weights``, then ``F.linear``; with F32/F16 tensors it runs manual_cast's
  own cast. Norms and buffers load as ComfyUI loads them (copied into plain tensors).
- which tensors stay unquantized follows its tools (convert.py, the llama.cpp patch): 1-D and tiny tensors F32, the
  embedding, time and output layers F16, the DiT and refiner blocks' linears quantized (F16 where their width is not a
  multiple of the type's block).

Not mirrored: the arch check (upstream 795e451 refuses "minimax_h3"; a fork and an open pull request add it),
LoRA patches on quantized weights (GGUFModelPatcher), its torch dequant kernels (here ``gguf.quants.dequantize``,
its own numpy fallback: the values of these tests, not a claim about its bits). Copied into a ComfyUI's
custom_nodes, this file is also a test loader node (``SageNHDTestUnetLoaderGGUF``). Needs ComfyUI importable.
"""

from __future__ import annotations

import os

import comfy.ops
import gguf
import torch

ARCH = "minimax_h3"
TYPES = gguf.GGMLQuantizationType
TORCH_TYPES = (TYPES.F32, TYPES.F16)  # kept as arrays: ComfyUI-GGUF runs manual_cast's own cast on them
BLOCK_LINEARS = (".attn.qkv_proj.weight", ".attn.out_proj.weight", ".mlp.fc1.weight", ".mlp.fc2.weight",
                 ".adaln_proj.linear.weight")
TINY = 1024  # ComfyUI-GGUF's convert keeps tensors of at most this many elements in F32


def stored_type(name: str, tensor: torch.Tensor, qtype: TYPES) -> TYPES:
    """The GGML type the tensor ``name`` is stored in, in a ``qtype`` file."""
    if tensor.dim() == 1 or tensor.numel() <= TINY:
        return TYPES.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if name.startswith(("blocks.", "token_refiner.blocks.")) and name.endswith(BLOCK_LINEARS) \
            and tensor.shape[-1] % block == 0:
        return qtype
    return TYPES.F16


def write_gguf(state_dict: dict, path, qtype: str) -> dict:
    """``state_dict`` as a GGUF file of architecture ``ARCH`` with the block linears in ``qtype`` (a GGML type name
    that gguf quantizes: it has no quantizer for the K-quants); returns each tensor's stored type."""
    writer = gguf.GGUFWriter(str(path), ARCH)
    stored = {}
    for name, tensor in state_dict.items():
        stored[name] = stored_type(name, tensor, TYPES[qtype])
        data = tensor.detach().float().cpu().numpy()
        writer.add_tensor(name, gguf.quants.quantize(data, stored[name]), raw_dtype=stored[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


class GGUFTensor(torch.Tensor):
    """A GGUF tensor's data as the file holds it, with its GGML type and logical shape under ComfyUI-GGUF's
    GGMLTensor's names (``tensor_type``, ``tensor_shape``; ``.shape`` answers the logical shape). Arithmetic on it
    gives plain tensors; a move or a detach keeps the type and shape."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data, *, tensor_type, shape):
        t = torch.Tensor._make_subclass(cls, data, False)
        t.tensor_type, t.tensor_shape = tensor_type, torch.Size(shape)
        return t

    @property
    def shape(self):
        return self.tensor_shape

    def _rewrap(self, data):
        return GGUFTensor(data, tensor_type=self.tensor_type, shape=self.tensor_shape)

    def detach(self):
        return self._rewrap(super().detach())

    def to(self, *args, **kwargs):
        moved = super().to(*args, **kwargs)
        return self._rewrap(moved) if moved.dtype == self.dtype else moved  # a cast is no longer the file's data


def quantized(t) -> bool:
    return isinstance(t, GGUFTensor) and t.tensor_type not in TORCH_TYPES


def dequantize(t: GGUFTensor, dtype, device) -> torch.Tensor:
    """``t``'s values in ``dtype`` on ``device`` (a quantized tensor decoded by gguf's dequantizer)."""
    values = gguf.quants.dequantize(t.as_subclass(torch.Tensor).cpu().numpy(), t.tensor_type)
    return torch.from_numpy(values).reshape(t.shape).to(device=device, dtype=dtype)


class GGUFOps(comfy.ops.manual_cast):
    class Linear(comfy.ops.manual_cast.Linear):
        """Holds the file's tensors as they are; a quantized weight is dequantized on every call."""

        def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
            torch.nn.Module.__init__(self)  # nothing allocated: the file's tensors are assigned as they load
            self.in_features, self.out_features = in_features, out_features
            self.weight = self.bias = None

        def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                  error_msgs):
            for name in ("weight", "bias"):
                if prefix + name in state_dict:
                    setattr(self, name, torch.nn.Parameter(state_dict[prefix + name], requires_grad=False))
                elif name == "weight":
                    missing_keys.append(prefix + name)

        def forward_comfy_cast_weights(self, input, *args, **kwargs):
            if not (quantized(self.weight) or quantized(self.bias)):
                return super().forward_comfy_cast_weights(input, *args, **kwargs)
            weight = dequantize(self.weight, input.dtype, input.device)
            bias = None if self.bias is None else dequantize(self.bias, input.dtype, input.device) \
                if quantized(self.bias) else self.bias.to(device=input.device, dtype=input.dtype)
            return torch.nn.functional.linear(input, weight, bias)


def read_state_dict(path) -> dict:
    """The file's tensors as ``GGUFTensor``s by name; a file of another architecture is refused."""
    reader = gguf.GGUFReader(str(path))
    field = reader.get_field("general.architecture")
    arch = None if field is None else bytes(field.parts[field.data[-1]]).decode()
    if arch != ARCH:
        raise ValueError(f"{path}: a GGUF file of architecture {arch!r}, not {ARCH!r}")
    out = {}
    for t in reader.tensors:
        shape = torch.Size(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        data = torch.from_numpy(t.data.copy())
        out[t.name] = GGUFTensor(data.view(shape) if t.tensor_type in TORCH_TYPES else data,
                                 tensor_type=t.tensor_type, shape=shape)
    return out


def load_model(path, dtype: torch.dtype | None = None):
    """A ComfyUI ModelPatcher of the GGUF H3 at ``path``, loaded as UnetLoaderGGUF loads it (``dtype``: the compute
    dtype where not ComfyUI's choice for the device)."""
    import comfy.sd

    options = {"custom_operations": GGUFOps} | ({"dtype": dtype} if dtype is not None else {})
    model = comfy.sd.load_diffusion_model_state_dict(read_state_dict(path), model_options=options)
    if model is None:
        raise RuntimeError(f"ComfyUI detected no model in {path}")
    return model


class SageNHDTestUnetLoaderGGUF:
    """The test loader node: a ``.gguf`` file in diffusion_models, loaded as UnetLoaderGGUF loads it."""

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "sage_nhd_test"

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths

        names = sorted(f for d in folder_paths.get_folder_paths("diffusion_models") if os.path.isdir(d)
                       for f in os.listdir(d) if f.endswith(".gguf"))
        return {"required": {"unet_name": (names,)}}

    def load(self, unet_name):
        import folder_paths

        return (load_model(folder_paths.get_full_path_or_raise("diffusion_models", unet_name)),)


# dict(): the Manager's scan (its literal-mapping patterns) credits the pack with its one node only
NODE_CLASS_MAPPINGS = dict(SageNHDTestUnetLoaderGGUF=SageNHDTestUnetLoaderGGUF)
