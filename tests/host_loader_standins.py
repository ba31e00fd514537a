"""Test-only ComfyUI nodes shaped like the loaders that run MiniMax H3's forward themselves (rule 10), copied into
the host's custom_nodes by tests/host_fixtures.py beside tests/host_helper_nodes.py.

Each leaves on the model what the real loader leaves (read from their public sources, written anew here); each runs
stock ComfyUI's H3 on a replica of the model (the real ones run it in workers or other processes), so a run through
them gives stock's latents and no call ever reaches a patch set on the model ComfyUI samples:

- SGLang Diffusion's ComfyUI plugin, integrated mode (sglang ``ComfyUI_SGLDiffusion/core/generator.py``):
  ``comfyui_model.diffusion_model = self.executor``, a ``MiniMaxH3Executor(SGLDiffusionExecutor(torch.nn.Module))``
  whose ``forward(x, timestep, context, **kwargs)`` refuses any ComfyUI model patch (an
  ``optimized_attention_override`` included) and sends the step to its worker. Stand-in: that class chain, the same
  refusal, set as an object patch of ``diffusion_model`` on a clone (the cached model stays stock's).
- Raylight (``raylight/distributed_modules/usp.py``, MiniMaxH3): in each Ray worker
  ``model._forward = types.MethodType(usp_dit_forward, model)`` and ``block.attn.forward =
  types.MethodType(usp_attn_forward, block.attn)`` on the modules themselves. Stand-in: the same on a copy of the
  model under a new ModelPatcher (a worker's own model), the functions named and placed as Raylight's.
- The MiniMax H3 Multi-GPU Loader (Ulysses SP, ``MiniMaxH3SPUNETLoader``): ``model.add_object_patch(
  "diffusion_model._forward", sp_entry)``, ``sp_entry`` a closure in ``MiniMaxH3SPUNETLoader.execute`` that runs the
  sequence-parallel mirror of ``_forward`` (its own block and attention functions) on every rank's replica.
- A DIFFUSION_MODEL wrapper that runs a replica instead of calling the model: nothing on the model shows it.
"""

import types

import torch

import comfy.patcher_extension
import comfy.sd
from comfy.ldm.minimax.model import Attention, MiniMaxH3Model


def _worker_model(model):
    """A new ModelPatcher of the same weights, loaded as a loader's worker loads the checkpoint."""
    return comfy.sd.load_diffusion_model_state_dict(model.model.diffusion_model.state_dict())


def _replica(model):
    return _worker_model(model).model.diffusion_model


class SGLDiffusionExecutor(torch.nn.Module):
    """SGLang's executor in place of the diffusion model (the name is SGLang's: it is what the model shows)."""

    def __init__(self, worker):
        super().__init__()
        self.__dict__["worker"] = worker  # not a submodule: SGLang's weights live in its worker
        self.dtype = worker.dtype
        self.patch_size = worker.patch_size

    def preprocess_text_embeds(self, text_states, *args, **kwargs):
        return self.worker.preprocess_text_embeds(text_states, *args, **kwargs)

    def forward(self, x, timestep, context, **kwargs):
        opts = kwargs.get("transformer_options") or {}
        if opts.get("optimized_attention_override") is not None:  # as SGLang refuses it
            raise ValueError("SGLD integrated mode runs the diffusion model in its worker and cannot apply ComfyUI "
                             "model patches (optimized_attention_override)")
        return MiniMaxH3Model.forward(self.worker, x, timestep, context, **kwargs)


class MiniMaxH3Executor(SGLDiffusionExecutor):
    pass


class SageNHDTestSGLangIntegrated:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing/sage_nhd"

    def load(self, model):
        m = model.clone()
        m.add_object_patch("diffusion_model", MiniMaxH3Executor(_replica(model)))
        return (m,)


def usp_dit_forward(self, *args, **kwargs):  # one rank: the whole sequence
    return MiniMaxH3Model._forward(self, *args, **kwargs)


def usp_attn_forward(self, x, rope_freqs=None, transformer_options={}):
    return Attention.forward(self, x, rope_freqs, transformer_options)


for _fn in (usp_dit_forward, usp_attn_forward):  # where Raylight defines them
    _fn.__module__ = "raylight.diffusion_models.minimax.xdit_context_parallel"


class SageNHDTestRaylight:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing/sage_nhd"

    def load(self, model):
        worker = _worker_model(model)
        dm = worker.model.diffusion_model
        for block in dm.blocks:
            block.attn.forward = types.MethodType(usp_attn_forward, block.attn)
        dm._forward = types.MethodType(usp_dit_forward, dm)
        return (worker,)


class SageNHDTestUlyssesSP:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing/sage_nhd"

    def load(self, model):
        replica = _replica(model)

        def sp_entry(x, timestep, context, transformer_options=None, minimax_payload=None, **kwargs):
            return MiniMaxH3Model._forward(replica, x, timestep, context, transformer_options or {},
                                           minimax_payload=minimax_payload, **kwargs)

        sp_entry.__qualname__ = "MiniMaxH3SPUNETLoader.execute.<locals>.sp_entry"  # as the real loader's closure
        m = model.clone()
        m.add_object_patch("diffusion_model._forward", sp_entry)
        return (m,)


class SageNHDTestWrapperRunsReplica:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing/sage_nhd"

    def load(self, model):
        replica = _replica(model)

        def wrapper(executor, *args, **kwargs):
            return MiniMaxH3Model._forward(replica, *args, **kwargs)

        m = model.clone()
        m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "sage_nhd_test_replica", wrapper)
        return (m,)


NODE_CLASS_MAPPINGS = dict((cls.__name__, cls) for cls in (
    SageNHDTestSGLangIntegrated, SageNHDTestRaylight, SageNHDTestUlyssesSP, SageNHDTestWrapperRunsReplica))
