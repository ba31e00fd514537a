"""Current upstream ComfyUI (0.34-0.47) for host tests on the 0.33 host: each function reshapes a loaded H3 (or
installs a ``comfy.ops`` function) into one current form, written from the stored upstream files
(Comfy-Org/ComfyUI ``comfy/ldm/minimax/model.py``, ``comfy/ops.py``, ``comfy/ldm/modules/attention.py``) and, for
the split-QKV checkpoints no upstream file builds, from ComfyUI-H3-DTsQKV's loader:

- ``current_attention``: ``Attention`` with ``comfy_attention`` (a checkpoint's preferred attention, handed to
  ``optimized_attention(..., preferred_attention=...)``), an optional ``to_gate_compress`` (VSA gate, unused by the
  dense forward) and no ``v.clone()``;
- ``current_block``: ``DiTBlock.forward(..., transformer_options={}, attention=None)``, a block replace's attention
  running in place of ``self.attn``;
- ``split_qkv_attention``: ``q_proj``/``k_proj``/``v_proj`` instead of ``qkv_proj`` (DT-sQKV), optionally with a
  read-only fused ``qkv_proj`` view that is no submodule (reading its weight here fails the test);
- ``extended_linear_input_act`` (0.36): ``linear_input_act(linear, x, input_act, act_weight=None, act_eps=0.0,
  residual=None, residual_scale=None)``;
- ``prologue_epilogue_linear`` and ``consolidated_linear_input_act`` (0.40, #16816, whose file is not stored: the
  form assumed here is a Linear forward taking the activation (prologue) and the residual (epilogue) as keywords).
"""

from __future__ import annotations

import copy

import comfy.ldm.minimax.model as h3
import comfy.model_management
import comfy.ops
import comfy.quant_ops
import comfy.rmsnorm
import torch
from comfy.ldm.modules.attention import AttentionTensorContainer, optimized_attention

HOST_LINEAR_INPUT_ACT = comfy.ops.linear_input_act  # the 0.33 host's (three arguments)


class ComfyAttention(torch.nn.Module):
    """Upstream's per-module attention preference: ``config`` (e.g. {"attention": "sdpa"}) and ``function``."""

    def __init__(self, config=None, function=None):
        super().__init__()
        self.config, self.function = config, function


def preferred_optimized_attention(q, k, v, heads, preferred_attention=None, **kwargs):
    """``optimized_attention`` taking ``preferred_attention`` (popped before any override sees the call, as
    upstream's ``wrap_attn`` does); a preference with a function runs it when no override is set."""
    function = getattr(preferred_attention, "function", None)
    if function is not None and "optimized_attention_override" not in (kwargs.get("transformer_options") or {}):
        q, k, v = (t.take() if isinstance(t, AttentionTensorContainer) else t for t in (q, k, v))
        return function(q, k, v, heads, **kwargs)
    return optimized_attention(q, k, v, heads, **kwargs)


class CurrentAttention(h3.Attention):
    """Upstream's H3 ``Attention.forward`` (norm+rope with comfy-kitchen's fused pass, no ``v.clone()``)."""

    def project(self, x):
        return self.qkv_proj(x).split(self.heads * self.head_dim, dim=-1)

    def forward(self, x, rope_freqs=None, transformer_options={}):
        s = x.shape[0]
        q, k, v = self.project(x)
        v = v.view(s, self.heads, self.head_dim)
        if rope_freqs is not None:
            q, k = q.view(1, s, self.heads, self.head_dim), k.view(1, s, self.heads, self.head_dim)
            qw = comfy.model_management.cast_to(self.q_norm.weight, device=x.device)
            kw = comfy.model_management.cast_to(self.k_norm.weight, device=x.device)
            comfy.quant_ops.ck.rms_rope_split_half_(q, k, rope_freqs, qw, kw, epsilon=self.q_norm.eps,
                                                    rot_dim=rope_freqs.shape[-3] * 2)
            q, k = q[0], k[0]
        else:
            q = self.q_norm(q.view(s, self.heads, self.head_dim))
            k = self.k_norm(k.view(s, self.heads, self.head_dim))
        q, k, v = (AttentionTensorContainer(t.transpose(0, 1).unsqueeze(0)) for t in (q, k, v))
        out = preferred_optimized_attention(q, k, v, self.heads, preferred_attention=self.comfy_attention, mask=None,
                                            skip_reshape=True, transformer_options=transformer_options)
        return self.out_proj(out.squeeze(0))


class SplitQKVAttention(CurrentAttention):
    """A split-QKV checkpoint's attention: three projections, each a slice of the fused one."""

    def project(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class FusedView:
    """ComfyUI-H3-DTsQKV's read-only ``qkv_proj`` over separate projections (not a submodule): reading its weight
    concatenates (dequantises) three weights, so here it fails the test."""

    @property
    def weight(self):
        raise AssertionError("the fused qkv_proj view was read: it concatenates the three weights")

    def __call__(self, x):
        raise AssertionError("the fused qkv_proj view was called")


def _linear_like(layer, weight):
    new = copy.deepcopy(layer)
    new.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    new.out_features = weight.shape[0]
    return new


def current_attention(attn, gate_compress: bool = False, seed: int = 0):
    """``attn`` reshaped in place to upstream's Attention (comfy_attention; to_gate_compress if asked)."""
    attn.__class__ = CurrentAttention
    attn.comfy_attention = ComfyAttention()
    attn.to_gate_compress = None
    if gate_compress:
        hidden, inner = attn.out_proj.out_features, attn.heads * attn.head_dim
        gate = comfy.ops.manual_cast.Linear(hidden, inner, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            gate.weight.copy_(torch.randn(inner, hidden, generator=gen) / hidden ** 0.5)
        attn.to_gate_compress = gate.requires_grad_(False)
    return attn


def split_qkv_attention(attn, fused_view: bool = False):
    """``attn`` (float weights) reshaped in place to a split-QKV checkpoint's attention."""
    current_attention(attn)
    inner = attn.heads * attn.head_dim
    w = attn.qkv_proj.weight
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        setattr(attn, name, _linear_like(attn.qkv_proj, w[i * inner:(i + 1) * inner]))
    del attn.qkv_proj
    attn.__class__ = SplitQKVAttention
    if fused_view:
        object.__setattr__(attn, "qkv_proj", FusedView())
    return attn


# upstream's block helpers (the fast path checks that the block's module has them and that its forward uses them)
def _mod_row(vecs, row, dtype):
    return vecs[row].to(dtype)


def _mod_scale_shift(h, shift, scale, segments):
    for a, b, row in segments:
        h[a:b].mul_(1.0 + _mod_row(scale, row, h.dtype)).add_(_mod_row(shift, row, h.dtype))
    return h


def _mod_gate(x, gate, other, segments):
    for a, b, row in segments:
        x[a:b].addcmul_(other[a:b], _mod_row(gate, row, x.dtype))
    return x


class CurrentDiTBlock(h3.DiTBlock):
    """Upstream's ``DiTBlock.forward`` with ``attention=`` (a block replace's attention runs instead of ``attn``)."""

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        attention = self.attn if attention is None else attention
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(t_emb)
        h = _mod_scale_shift(self.norm1(x), shift_msa, scale_msa, mod_segments)
        x = _mod_gate(x, gate_msa, attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options),
                      mod_segments)
        h = _mod_scale_shift(self.norm2(x), shift_mlp, scale_mlp, mod_segments)
        return _mod_gate(x, gate_mlp, self.mlp(h), mod_segments)


def current_block(block, gate_compress: bool = False):
    """``block`` reshaped in place to upstream's DiTBlock, its attention to upstream's Attention."""
    block.__class__ = CurrentDiTBlock
    current_attention(block.attn, gate_compress=gate_compress)
    return block


def current_model(diffusion_model, gate_compress: bool = False, split_qkv: bool = False):
    """Every block and refiner attention of an H3 diffusion model in its current form (split-QKV: float weights)."""
    for block in diffusion_model.blocks:
        current_block(block, gate_compress=gate_compress)
    attentions = [b.attn for b in diffusion_model.token_refiner.blocks]
    for attn in attentions:
        current_attention(attn)
    if split_qkv:
        for attn in attentions + [b.attn for b in diffusion_model.blocks]:
            split_qkv_attention(attn, fused_view=True)
    return diffusion_model


# --- comfy.ops ------------------------------------------------------------------------------------------------
def _int8_tensorwise(weight) -> bool:
    return getattr(weight, "_layout_cls", None) == "TensorWiseINT8Layout"


def eager_input_act(x, input_act, act_weight=None, act_eps=0.0):
    if input_act is None:
        return x
    if input_act == "rms_norm":
        return comfy.rmsnorm.rms_norm(x, act_weight, act_eps)
    return comfy.ops.INPUT_ACT_EAGER[input_act](x)


def _residual_out(out, residual, residual_scale):
    return out if residual is None else torch.addcmul(residual, out, residual_scale)


def extended_linear_input_act(linear, x, input_act, act_weight=None, act_eps=0.0, residual=None,
                              residual_scale=None):
    """0.36's ``linear_input_act``: the activation folded into an int8 tensor-wise quantiser (the host's call; its
    comfy-kitchen takes no norm or residual, so those go eager here), ``residual + residual_scale * out`` after."""
    if _int8_tensorwise(linear.weight) and act_weight is None and input_act in comfy.ops.INPUT_ACT_EAGER:
        out = HOST_LINEAR_INPUT_ACT(linear, x, input_act)
    else:
        out = linear(eager_input_act(x, input_act, act_weight, act_eps))
    return _residual_out(out, residual, residual_scale)


def _prologue_epilogue_forward(self, input, *args, input_act=None, act_weight=None, act_eps=0.0, residual=None,
                               residual_scale=None, **kwargs):
    """The assumed 0.40 Linear forward: an activation before the GEMM (folded into an int8 quantiser as the host's
    ``linear_input_act`` folds it), the gated residual after it."""
    base = type(self).__mro__[1]
    if input_act is not None and _int8_tensorwise(self.weight) and act_weight is None:
        out = HOST_LINEAR_INPUT_ACT(self, input, input_act)  # casts and runs the int8 GEMM itself
    else:
        out = base.forward(self, eager_input_act(input, input_act, act_weight, act_eps), *args, **kwargs)
    return _residual_out(out, residual, residual_scale)


_FUSED_CLASSES: dict = {}


def prologue_epilogue_linear(layer):
    """``layer`` reshaped in place to a Linear whose forward takes prologue/epilogue keywords."""
    cls = type(layer)
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(cls.__name__, (cls,), {"forward": _prologue_epilogue_forward,
                                                          "__module__": cls.__module__})
    layer.__class__ = _FUSED_CLASSES[cls]
    return layer


def consolidated_linear_input_act(linear, x, input_act, act_weight=None, act_eps=0.0, residual=None,
                                  residual_scale=None):
    """``linear_input_act`` over the consolidated forward: everything goes through the layer's own forward."""
    return linear(x, input_act=input_act, act_weight=act_weight, act_eps=act_eps, residual=residual,
                  residual_scale=residual_scale)


def prologue_epilogue_model(diffusion_model):
    """Every ComfyUI Linear of the model with the prologue/epilogue forward (as one ops module gives them all)."""
    for module in list(diffusion_model.modules()):
        if type(module).__name__ == "Linear" and hasattr(module, "weight_function"):
            prologue_epilogue_linear(module)
    return diffusion_model


# --- sampling -------------------------------------------------------------------------------------------------
def sample(patcher, conditioning, *, seed: int = 7, steps: int = 2, size=(64, 64, 5)) -> tuple:
    """One sampling run through ComfyUI's nodes (empty H3 AV latent, euler, simple): (video, audio) latents."""
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    from devkit.comfy import custom_sampling

    latent = EmptyMiniMaxH3LatentAV.execute(*size)[0]
    return tuple(custom_sampling(patcher, conditioning, latent, seed, steps, sampler="euler")()["samples"].unbind())
