"""Test-only ComfyUI nodes, copied into the host's custom_nodes by tests/host_fixtures.py; at the end, stand-ins
for the loaders that run MiniMax H3's forward themselves (rule 10).

No text encoder weights exist on the test machines, so the graphs take a seeded random
conditioning; the sampled latents are written to safetensors so the tests can compare
every bit. Other nodes stand in for "other packs" and core nodes that also replace attention
(test_host_server.py, test_compose.py).
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


class SageNHDTestLowVramBlockPatch:
    """Stands in for KJNodes' "MiniMax H3 Low VRAM Attention" (the behaviour its source shows): every
    DiT block forward replaced by one that hands the normed input to ``self.attn`` in a one-element
    list, and every attention forward by a stock-equal one that takes such a list, marked
    ``_uses_optimized_attention`` and named ``minimax_attn_lowmem_forward``; an attention forward another
    node already set is kept. Counts its block calls under <output>/<name>.json."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "name": ("STRING", {"default": "low_vram"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing/sage_nhd"

    def patch(self, model, name):
        import types
        from comfy.ldm.minimax import model as h3

        def minimax_block_lowmem_forward(block, x, t_emb, mod_segments, rope_freqs, transformer_options={}):
            _count(name, "block_calls")
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj(t_emb)
            h = [h3._mod_scale_shift(block.norm1(x), shift_msa, scale_msa, mod_segments)]
            x = h3._mod_gate(x, gate_msa, block.attn(h, rope_freqs=rope_freqs, transformer_options=transformer_options),
                             mod_segments)
            h = h3._mod_scale_shift(block.norm2(x), shift_mlp, scale_mlp, mod_segments)
            return h3._mod_gate(x, gate_mlp, block.mlp(h), mod_segments)

        def minimax_attn_lowmem_forward(attn, x, rope_freqs=None, transformer_options={}):
            return type(attn).forward(attn, x.pop() if isinstance(x, list) else x, rope_freqs, transformer_options)

        minimax_attn_lowmem_forward._uses_optimized_attention = True
        m = model.clone()
        for i, block in enumerate(m.get_model_object("diffusion_model").blocks):
            m.add_object_patch(f"diffusion_model.blocks.{i}.forward",
                               types.MethodType(minimax_block_lowmem_forward, block))
            key = f"diffusion_model.blocks.{i}.attn.forward"
            if key not in m.object_patches:
                m.add_object_patch(key, types.MethodType(minimax_attn_lowmem_forward, block.attn))
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





# --- stand-ins for other packs and core nodes that also replace attention (tests/host/test_compose.py) ---
def _count(name, key="calls"):
    """Count one call in <output>/<name>.json (tiny test runs only)."""
    path = os.path.join(folder_paths.get_output_directory(), f"{name}.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[key] = data.get(key, 0) + 1
    with open(path, "w") as f:
        json.dump(data, f)


class SageNHDTestForeignOverride:
    """Stands in for a node that installs an optimized_attention_override ("Patch Sage Attention",
    core "Model Attention Backend"). chain_previous: fall back to the override that was there."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "name": ("STRING", {"default": "foreign_override"}),
                             "chain_previous": ("BOOLEAN", {"default": False})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing/sage_nhd"

    def patch(self, model, name, chain_previous):
        m = model.clone()
        to = m.model_options.setdefault("transformer_options", {})
        previous = to.get("optimized_attention_override") if chain_previous else None

        def other_backend_override(func, *args, **kwargs):
            _count(name)
            if previous is not None:
                return previous(func, *args, **kwargs)
            return func(*args, **kwargs)

        to["optimized_attention_override"] = other_backend_override
        return (m,)


class _StandInComfyAttention(torch.nn.Module):
    """The interface of current ComfyUI's ComfyAttention: ``config`` and ``function``."""

    def __init__(self, config, function):
        super().__init__()
        self.config = config
        self.function = function


class SageNHDTestAttentionPreference:
    """Gives blocks of the loaded H3 a comfy_attention module declaring a preference, as a checkpoint
    with ``<attn>.comfy_attention.config`` does on current ComfyUI. Mutates the loaded model: use it
    only with a checkpoint file of its own. config "" removes the preference again."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "config": ("STRING", {"default": '{"attention": "comfy_kitchen_int8"}'}),
                             "blocks": ("STRING", {"default": "0,1"}), "name": ("STRING", {"default": "preferred"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing/sage_nhd"

    def patch(self, model, config, blocks, name):
        from comfy.ldm.modules.attention import attention_pytorch
        config = json.loads(config) if config else None
        wanted = {int(b) for b in blocks.split(",") if b.strip()}

        def attention_comfy_kitchen_int8(*args, **kwargs):  # what ComfyUI sets for that config (stand-in)
            _count(name)
            return attention_pytorch(*args, **kwargs)

        dm = model.get_model_object("diffusion_model")
        for i, block in enumerate(dm.blocks):
            if i in wanted and config is not None:
                block.attn.comfy_attention = _StandInComfyAttention(config, attention_comfy_kitchen_int8)
            else:
                block.attn.comfy_attention = _StandInComfyAttention(None, None)
        return (model.clone(),)


class SageNHDTestComfyAttentionFunction:
    """Stands in for a node that object-patches ``blocks.{i}.attn.comfy_attention.function``.
    kind: "foreign" (some other pack's function) or "comfy_kitchen_int8" (ComfyUI's, by name)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "kind": (["foreign", "comfy_kitchen_int8"],),
                             "block": ("INT", {"default": 0, "min": 0, "max": 100})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing/sage_nhd"

    def patch(self, model, kind, block):
        from comfy.ldm.modules.attention import attention_pytorch

        def other_pack_attention(*args, **kwargs):
            return attention_pytorch(*args, **kwargs)

        def attention_comfy_kitchen_int8(*args, **kwargs):
            return attention_pytorch(*args, **kwargs)

        m = model.clone()
        fn = other_pack_attention if kind == "foreign" else attention_comfy_kitchen_int8
        m.add_object_patch(f"diffusion_model.blocks.{block}.attn.comfy_attention.function", fn)
        return (m,)


def make_attention_override(name, previous):
    """Same shape as core Model Sparse Attention's override: its own kernel for the calls it takes,
    ``previous`` (or ``func``) for the rest. Here every other call is "sparse"."""
    state = {"n": 0}

    def override(func, q, k, v, heads, **kwargs):
        state["n"] += 1
        if state["n"] % 2:
            _count(name, "sparse")
            return func(q, k, v, heads, **kwargs)  # stands in for the sparse kernel
        _count(name, "dense")
        return func(q, k, v, heads, **kwargs) if previous is None else previous(func, q, k, v, heads, **kwargs)

    return override


class SageNHDTestSparseAttention:
    """Stands in for core "Model Sparse Attention" (BlockSparseAttention): an override that chains the
    previous one and reinstalls itself on top every step (ON_PREPARE_STATE key block_sparse_attention),
    and on H3 block replaces that pass their own attention= to the blocks not in dense_blocks."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "name": ("STRING", {"default": "sparse"}),
                             "dense_blocks": ("STRING", {"default": "1"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing/sage_nhd"

    def patch(self, model, name, dense_blocks):
        import inspect

        import comfy.ldm.minimax.model as h3
        import comfy.patcher_extension
        installed = []

        def install(transformer_options):
            current = transformer_options.get("optimized_attention_override")
            if any(current is o for o in installed):
                return
            o = make_attention_override(name, current)
            installed.append(o)
            transformer_options["optimized_attention_override"] = o

        m = model.clone()
        install(m.model_options.setdefault("transformer_options", {}))
        m.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE, "block_sparse_attention",
                                lambda patcher, timestep, model_options: install(model_options["transformer_options"]))
        dm = model.get_model_object("diffusion_model")
        if type(dm).__name__ != "MiniMaxH3Model":
            return (m,)
        dense = {int(b) for b in dense_blocks.split(",") if b.strip()}
        takes_attention = "attention" in inspect.signature(h3.DiTBlock.forward).parameters

        def block_patch_for(block, i):
            def attention(h, rope_freqs=None, transformer_options={}):  # stands in for the sparse producer
                _count(name, "block_sparse")
                return type(block.attn).forward(block.attn, h, rope_freqs=rope_freqs, transformer_options=transformer_options)

            def block_patch(args, extra):
                if i in dense:
                    return extra["original_block"](args)
                if takes_attention:  # current ComfyUI: DiTBlock.forward(..., attention=None)
                    return extra["original_block"]({**args, "attention": attention})
                if "attention" in inspect.signature(block.forward).parameters:  # 0.33 + a block forward taking it
                    return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                         transformer_options=args["transformer_options"], attention=attention)}
                # ComfyUI 0.33 has no attention= on the block: the same computation with this attention
                x, t_emb, segs, rope = args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"]
                shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj(t_emb)
                hh = h3._mod_scale_shift(block.norm1(x), shift_msa, scale_msa, segs)
                x = h3._mod_gate(x, gate_msa, attention(hh, rope_freqs=rope,
                                                        transformer_options=args["transformer_options"]), segs)
                hh = h3._mod_scale_shift(block.norm2(x), shift_mlp, scale_mlp, segs)
                return {"img": h3._mod_gate(x, gate_mlp, block.mlp(hh), segs)}

            return block_patch

        for i, block in enumerate(dm.blocks):
            m.set_model_patch_replace(block_patch_for(block, i), "dit", "double_block", i)
        return (m,)


class SageNHDTestRaiseWhileSampling:
    """Raises inside the diffusion model on its n-th call: an interrupt or another error."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "kind": (["interrupt", "error"],),
                             "at_call": ("INT", {"default": 2, "min": 1, "max": 1000})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing/sage_nhd"

    def patch(self, model, kind, at_call):
        import comfy.model_management
        import comfy.patcher_extension
        state = {"n": 0}

        def wrapper(executor, *args, **kwargs):
            state["n"] += 1
            if state["n"] == at_call:
                state["n"] = 0
                if kind == "interrupt":
                    raise comfy.model_management.InterruptProcessingException()
                raise RuntimeError("stand-in failure while sampling")
            return executor(*args, **kwargs)

        m = model.clone()
        m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "sage_nhd_test_raise", wrapper)
        return (m,)


# Built from the class names (no mapping literal), so a ComfyUI-Manager scan of the repository does not
# credit the pack with these test-only nodes (tests/unit/test_published_contents.py).
class SageNHDTestChunkFeedForward:
    """Stands in for KJNodes' "MiniMax H3 Chunk FeedForward" (the behaviour its source shows): every
    block's ``mlp.forward`` replaced by one that runs ComfyUI's MLP over token chunks. Counts its calls."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "name": ("STRING", {"default": "chunk_ff"}),
                             "chunks": ("INT", {"default": 2, "min": 1, "max": 64})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing/sage_nhd"

    def patch(self, model, name, chunks):
        import types

        import comfy.ops

        def minimax_mlp_chunked_forward(mlp, x):
            _count(name, "mlp_calls")
            return torch.cat([comfy.ops.linear_input_act(mlp.fc2, mlp.fc1(c), "swiglu")
                              for c in torch.chunk(x, chunks, dim=0)])

        m = model.clone()
        for i, block in enumerate(m.get_model_object("diffusion_model").blocks):
            m.add_object_patch(f"diffusion_model.blocks.{i}.mlp.forward",
                               types.MethodType(minimax_mlp_chunked_forward, block.mlp))
        return (m,)


class SageNHDTestComboValue:
    """Stands in for a primitive node of another pack whose output links to a combo input: its text as a COMBO
    value (the value reaches the linked input only when this node runs)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("STRING", {"default": "exact"})}}

    RETURN_TYPES = ("COMBO",)
    FUNCTION = "give"
    CATEGORY = "testing/sage_nhd"

    def give(self, value):
        return (value,)


class SageNHDTestNotADiffusionModel:
    """Stands in for a custom node that hands something other than a diffusion model to a MODEL input: ComfyUI's
    CLIP or VAE object (made without weights), or a MODEL around a text encoder's module (no diffusion_model)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "kind": (["clip", "vae", "text_encoder_model"],)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "give"
    CATEGORY = "testing/sage_nhd"

    def give(self, model, kind):
        import comfy.model_patcher
        import comfy.sd

        # a ModelPatcher around a small module: what a CLIP's or a VAE's .patcher is (ComfyUI reads it on outputs)
        patcher = comfy.model_patcher.ModelPatcher(torch.nn.Linear(4, 4), model.load_device, model.offload_device)
        if kind == "text_encoder_model":
            return (patcher,)
        cls = {"clip": comfy.sd.CLIP, "vae": comfy.sd.VAE}[kind]
        wrong = cls.__new__(cls)
        wrong.patcher = patcher
        return (wrong,)


# --- loaders that run MiniMax H3's forward themselves (rule 10) ----------------------------------------
# Each leaves on the model what the real loader leaves (read from their public sources, written anew here); each runs
# stock ComfyUI's H3 on a replica of the model (the real ones run it in workers or other processes), so a run through
# them gives stock's latents and no call ever reaches a patch set on the model ComfyUI samples:
#
# - SGLang Diffusion's ComfyUI plugin, integrated mode (sglang ``ComfyUI_SGLDiffusion/core/generator.py``):
#   ``comfyui_model.diffusion_model = self.executor``, a ``MiniMaxH3Executor(SGLDiffusionExecutor(torch.nn.Module))``
#   whose ``forward(x, timestep, context, **kwargs)`` refuses any ComfyUI model patch (an
#   ``optimized_attention_override`` included) and sends the step to its worker. Stand-in: that class chain, the same
#   refusal, set as an object patch of ``diffusion_model`` on a clone (the cached model stays stock's).
# - Raylight (``raylight/distributed_modules/usp.py``, MiniMaxH3): in each Ray worker
#   ``model._forward = types.MethodType(usp_dit_forward, model)`` and ``block.attn.forward =
#   types.MethodType(usp_attn_forward, block.attn)`` on the modules themselves. Stand-in: the same on a copy of the
#   model under a new ModelPatcher (a worker's own model), the functions named and placed as Raylight's.
# - The MiniMax H3 Multi-GPU Loader (Ulysses SP, ``MiniMaxH3SPUNETLoader``): ``model.add_object_patch(
#   "diffusion_model._forward", sp_entry)``, ``sp_entry`` a closure in ``MiniMaxH3SPUNETLoader.execute`` that runs the
#   sequence-parallel mirror of ``_forward`` (its own block and attention functions) on every rank's replica.
# - A DIFFUSION_MODEL wrapper that runs a replica instead of calling the model: nothing on the model shows it.
def _worker_model(model):
    """A new ModelPatcher of the same weights, loaded as a loader's worker loads the checkpoint."""
    import comfy.sd

    return comfy.sd.load_diffusion_model_state_dict(model.model.diffusion_model.state_dict())


def _replica(model):
    return _worker_model(model).model.diffusion_model


class _ModelLoaderStandIn:
    """A stand-in loader node: MODEL in, the loader's MODEL out (``load``)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing/sage_nhd"


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
        from comfy.ldm.minimax.model import MiniMaxH3Model

        return MiniMaxH3Model.forward(self.worker, x, timestep, context, **kwargs)


class MiniMaxH3Executor(SGLDiffusionExecutor):
    pass


class SageNHDTestSGLangIntegrated(_ModelLoaderStandIn):
    def load(self, model):
        m = model.clone()
        m.add_object_patch("diffusion_model", MiniMaxH3Executor(_replica(model)))
        return (m,)


def usp_dit_forward(self, *args, **kwargs):  # one rank: the whole sequence
    from comfy.ldm.minimax.model import MiniMaxH3Model

    return MiniMaxH3Model._forward(self, *args, **kwargs)


def usp_attn_forward(self, x, rope_freqs=None, transformer_options={}):
    from comfy.ldm.minimax.model import Attention

    return Attention.forward(self, x, rope_freqs, transformer_options)


for _fn in (usp_dit_forward, usp_attn_forward):  # where Raylight defines them
    _fn.__module__ = "raylight.diffusion_models.minimax.xdit_context_parallel"


class SageNHDTestRaylight(_ModelLoaderStandIn):
    def load(self, model):
        import types

        worker = _worker_model(model)
        dm = worker.model.diffusion_model
        for block in dm.blocks:
            block.attn.forward = types.MethodType(usp_attn_forward, block.attn)
        dm._forward = types.MethodType(usp_dit_forward, dm)
        return (worker,)


class SageNHDTestUlyssesSP(_ModelLoaderStandIn):
    def load(self, model):
        from comfy.ldm.minimax.model import MiniMaxH3Model

        replica = _replica(model)

        def sp_entry(x, timestep, context, transformer_options=None, minimax_payload=None, **kwargs):
            return MiniMaxH3Model._forward(replica, x, timestep, context, transformer_options or {},
                                           minimax_payload=minimax_payload, **kwargs)

        sp_entry.__qualname__ = "MiniMaxH3SPUNETLoader.execute.<locals>.sp_entry"  # as the real loader's closure
        m = model.clone()
        m.add_object_patch("diffusion_model._forward", sp_entry)
        return (m,)


class SageNHDTestWrapperRunsReplica(_ModelLoaderStandIn):
    def load(self, model):
        import comfy.patcher_extension
        from comfy.ldm.minimax.model import MiniMaxH3Model

        replica = _replica(model)

        def wrapper(executor, *args, **kwargs):
            return MiniMaxH3Model._forward(replica, *args, **kwargs)

        m = model.clone()
        m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "sage_nhd_test_replica", wrapper)
        return (m,)


# --- H3 checkpoints whose attention has no fused qkv_proj (the node declines their blocks) -------------------------
class FusedView:
    """A read-only fused ``qkv_proj`` laid over separate projections (no submodule), as split-QKV loaders do."""

    def __init__(self, *projections):
        self.projections = projections

    def __call__(self, x):
        return torch.cat([p(x) for p in self.projections], dim=-1)


def split_linear(layer, parts: int):
    """``layer``'s weight rows in ``parts`` new Linears of the same class (as a split checkpoint loads them)."""
    out = []
    for rows in layer.weight.chunk(parts, dim=0):
        new = type(layer)(rows.shape[1], rows.shape[0], bias=False, dtype=rows.dtype)
        new.weight = torch.nn.Parameter(rows.clone(), requires_grad=False)
        out.append(new)
    return out


def separate_qkv(attn):
    q, k, v = split_linear(attn.qkv_proj, 3)
    del attn._modules["qkv_proj"]
    attn.q_proj, attn.k_proj, attn.v_proj = q, k, v
    attn.qkv_proj = FusedView(q, k, v)


def keyless(attn):
    """The "Keyless" H3 attention: one packed ``qv_proj``, no K projection (here K reads Q's columns)."""
    q, _, v = split_linear(attn.qkv_proj, 3)
    qv = type(attn.qkv_proj)(q.weight.shape[1], 2 * q.weight.shape[0], bias=False, dtype=q.weight.dtype)
    qv.weight = torch.nn.Parameter(torch.cat([q.weight, v.weight]), requires_grad=False)
    del attn._modules["qkv_proj"]
    attn.qv_proj = qv
    attn.qkv_proj = lambda x: (lambda q_, v_: torch.cat([q_, q_, v_], dim=-1))(*qv(x).chunk(2, dim=-1))


ATTENTION_VARIANTS = {"separate_qkv": separate_qkv, "keyless": keyless}


def rewrite_attention(diffusion_model, variant: str) -> None:
    """Every attention module of the H3 DiT and its text refiner rewritten as a checkpoint of ``variant`` loads."""
    for block in list(diffusion_model.blocks) + list(diffusion_model.token_refiner.blocks):
        ATTENTION_VARIANTS[variant](block.attn)


class SageNHDTestAttentionVariant(_ModelLoaderStandIn):
    """Stands in for a loader of an H3 variant checkpoint: the same weights under a new ModelPatcher, every attention
    module rewritten (separate q/k/v projections, or the "Keyless" packed qv_proj); the cached model stays stock's."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "variant": (list(ATTENTION_VARIANTS),)}}

    def load(self, model, variant):
        worker = _worker_model(model)
        rewrite_attention(worker.model.diffusion_model, variant)
        return (worker,)


NODE_CLASS_MAPPINGS = dict((cls.__name__, cls) for cls in (
    SageNHDTestComboValue, SageNHDTestNotADiffusionModel,
    SageNHDTestForwardProbe, SageNHDTestConditioning, SageNHDTestSaveLatentTensors, SageNHDTestForeignH3Patch,
    SageNHDTestForeignOverride, SageNHDTestAttentionPreference, SageNHDTestComfyAttentionFunction,
    SageNHDTestSparseAttention, SageNHDTestRaiseWhileSampling, SageNHDTestLowVramBlockPatch,
    SageNHDTestChunkFeedForward, SageNHDTestAttentionVariant, SageNHDTestSGLangIntegrated, SageNHDTestRaylight,
    SageNHDTestUlyssesSP, SageNHDTestWrapperRunsReplica))
