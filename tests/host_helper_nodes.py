"""Test-only ComfyUI nodes, copied into the host's custom_nodes by tests/host_fixtures.py.

No text encoder weights exist on the test machines, so the graphs take a seeded random
conditioning; the sampled latents are written to safetensors so the tests can compare
every bit. A third node stands in for "another pack" that replaces H3 attention forwards.
"""

import json
import os

import torch
from safetensors.torch import save_file

import folder_paths


class SageNHDTestConditioning:
    """CONDITIONING with a seeded random [1, tokens, dim] context."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31}),
                             "tokens": ("INT", {"default": 8, "min": 1, "max": 4096}),
                             "dim": ("INT", {"default": 32, "min": 1, "max": 8192}),
                             # ignored: a new value makes ComfyUI re-run sampling while the
                             # loaded model stays cached (the same model object across runs)
                             "nonce": ("STRING", {"default": ""})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing/sage_nhd"

    def make(self, seed, tokens, dim, nonce=""):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, dim, generator=g), {}]],)


class SageNHDTestSaveLatentTensors:
    """Every tensor of a LATENT (each stream of a nested AV latent) to <output>/<name>.safetensors."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "name": ("STRING", {"default": "latent"})}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "testing/sage_nhd"

    def save(self, samples, name):
        s = samples["samples"]
        streams = s.unbind() if getattr(s, "is_nested", False) else [s]
        path = os.path.join(folder_paths.get_output_directory(), f"{name}.safetensors")
        save_file({f"stream{i}": t.contiguous().cpu() for i, t in enumerate(streams)}, path)
        return {"ui": {"sage_nhd_latent_file": [path]}}


class SageNHDTestForeignH3Patch:
    """Stands in for another pack: replaces blocks.0.attn.forward with a pass-through object patch."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing/sage_nhd"

    def patch(self, model):
        m = model.clone()
        attn = m.get_model_object("diffusion_model.blocks.0.attn")
        original = type(attn).forward

        def foreign_forward(x, rope_freqs=None, transformer_options={}):
            return original(attn, x, rope_freqs=rope_freqs, transformer_options=transformer_options)

        m.add_object_patch("diffusion_model.blocks.0.attn.forward", foreign_forward)
        return (m,)


class SageNHDTestForwardProbe:
    """Records, while the model runs, which attention modules have a replaced forward.

    A DIFFUSION_MODEL wrapper runs inside every model call, after ComfyUI has applied the
    object patches of the patcher being sampled, and writes <output>/<name>.json.
    """

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "name": ("STRING", {"default": "probe"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "probe"
    CATEGORY = "testing/sage_nhd"

    def probe(self, model, name):
        import comfy.patcher_extension
        path = os.path.join(folder_paths.get_output_directory(), f"{name}.json")

        def wrapper(executor, *args, **kwargs):
            dm = executor.class_obj
            # an unpatched module may hold its own bound forward as an instance attribute
            # (that is how ComfyUI restores object patches): only other callables count
            replaced = sorted(n for n, m in dm.named_modules() if n.endswith("attn") and "forward" in vars(m)
                              and getattr(vars(m)["forward"], "__func__", None) is not type(m).forward)
            with open(path, "w") as f:
                json.dump({"replaced_forwards": replaced}, f)
            return executor(*args, **kwargs)

        m = model.clone()
        m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "sage_nhd_test_probe", wrapper)
        return (m,)


NODE_CLASS_MAPPINGS = {
    "SageNHDTestForwardProbe": SageNHDTestForwardProbe,
    "SageNHDTestConditioning": SageNHDTestConditioning,
    "SageNHDTestSaveLatentTensors": SageNHDTestSaveLatentTensors,
    "SageNHDTestForeignH3Patch": SageNHDTestForeignH3Patch,
}
