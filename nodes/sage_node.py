"""The "Sage Strided NHD Attention" node: schema and a thin execute. MiniMax H3 gets its attention
forwards replaced (h3_patch.py), any other model an attention override (override.py), on a clone."""

from __future__ import annotations

from comfy.patcher_extension import WrappersMP
from comfy_api.latest import ComfyExtension, io

from .. import kernels
from . import conflicts, h3_patch, override
from .ownership import describe, is_own
from .patch import BLOCK_PATHS, NODE, WRAPPER_KEY, InstalledPatch, Plan, Settings, current_value, value_problem
from .report import RunReport

try:  # ComfyUI's cache providers, whose on_prompt_end is the hook PromptEnd needs (an older ComfyUI has none)
    from comfy_api.latest import Caching
    from comfy_execution import cache_provider

    CacheProvider = Caching.CacheProvider
except ImportError:
    cache_provider, CacheProvider = None, object


def patch_any_model(model_patcher, settings: Settings = Settings(), node_id=None, notes=()):
    """The node's whole job, callable without a graph: ``(clone, patch)``; ``notes`` go to the report (a removed
    input value mapped). Probes no back-end (that happens when sampling starts)."""
    taken = conflicts.forward_taken_away(model_patcher)
    if taken is None:
        path = h3_patch if h3_patch.is_h3_model(model_patcher.get_model_object("diffusion_model")) else override
        return path.patch_model(model_patcher, settings, node_id=node_id, notes=notes)
    # rule 10: another loader runs the model's forward. The clone carries no patch of this node's (an earlier one
    # removed: a loader such as SGLang's refuses any attention override), only its report, which says why
    clone = model_patcher.clone()
    own = [clone.object_patches.pop(k) for k, v in list(clone.object_patches.items()) if is_own(v)]
    options = clone.model_options.get("transformer_options", {})
    if is_own(options.get("optimized_attention_override")):
        own.append(options.pop("optimized_attention_override"))
    path = "h3_forward_patch" if conflicts.h3_base(model_patcher) else "attention_override"
    report = RunReport(node_id=node_id, model_family=type(model_patcher.model).__name__, path=path,
                       settings=settings, replaced_own_patch=bool(own), notes=(*notes, taken))
    default = kernels.BackendChain.for_choice(settings.backend, prepared=settings.prepared)
    patch = InstalledPatch(settings, report, lambda patcher, options: Plan(default), Plan(default))
    patch.install(clone)
    return clone, patch


class SageStridedNHDAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        # widget order is the bundled workflows' (layout, backend, patch_text_refiner, sage2_prep), then block_path
        return io.Schema(
            node_id="SageStridedNHDAttention", display_name=NODE, category="advanced/model_patches", description=(
                "Runs the model's attention on SageAttention (or a fallback) without layout copies: MiniMax H3's "
                "Q/K/V stay views of the fused qkv buffer; other models get an attention override. Patches a copy of "
                "the model only; a report of what ran is sent after each sampling run."),
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to patch. The input model itself is left "
                                                "unchanged."),
                io.Combo.Input("layout", options=list(kernels.LAYOUTS), default="strided_nhd", tooltip=(
                    "strided_nhd: no Q/K/V or output copies. hnd: the reference path with head-major copies, for A/B "
                    "runs.")),
                io.Combo.Input("backend", options=list(kernels.BACKEND_CHOICES), default="auto", tooltip=(
                    "Attention kernel. auto: the fastest one here. A named kernel is tried first; if it cannot run, "
                    "the next one runs and the report says why.")),
                io.Boolean.Input("patch_text_refiner", default=True, tooltip=(
                    "MiniMax H3 only: also patch the 2 text refiner blocks (run once per sampling).")),
                io.Combo.Input("sage2_prep", options=list(kernels.PREPARED_MODES), default="exact", optional=True,
                               advanced=True, tooltip=(
                                   "SageAttention 2's prepared path (H3, strided_nhd, H100/H200). exact: bit-identical "
                                   "to SageAttention. rotated: Q/K rotated before int8 (a little slower, lower error "
                                   "on outliers).")),
                io.Combo.Input("block_path", options=list(BLOCK_PATHS), default="exact", optional=True,
                               advanced=True, tooltip=(
                                   "MiniMax H3 only. exact: the block fast path (one-pass modulation, the MLP in token "
                                   "chunks: less VRAM), bit-identical to stock. attention_only: only the attention "
                                   "forwards are replaced.")),
            ],
            outputs=[io.Model.Output(tooltip="The patched copy of the model.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, sage2_prep="exact", block_path="exact"):
        """Checked here, not against the options, so that a workflow saved with a removed value (``REMOVED_VALUES``)
        still runs. A linked value comes as None, before its node ran: ``execute`` checks the value that arrives."""
        problems = [value_problem(name, value) for name, value in (("sage2_prep", sage2_prep),
                                                                   ("block_path", block_path)) if value is not None]
        return next((p for p in problems if p is not None), True)

    @classmethod
    def execute(cls, model, layout, backend, patch_text_refiner=True, sage2_prep="exact",
                block_path="exact") -> io.NodeOutput:
        # a custom node can hand any object to a MODEL input: what it got, what it needs, what to do
        todo = ("Connect the MODEL output of a diffusion model loader (Load Diffusion Model, Load Checkpoint) or of a "
                "node that passes such a model on.")
        if not callable(getattr(model, "get_model_object", None)):
            raise TypeError(f"{NODE}: the model input got a {describe(type(model))} object, not a diffusion model (a "
                            f"ComfyUI MODEL). {todo}")
        try:
            model.get_model_object("diffusion_model")
        except AttributeError:
            inner = type(getattr(model, "model", None)).__name__
            raise TypeError(f"{NODE}: the model input got a MODEL whose model ({inner}) has no diffusion model: it is "
                            f"not a diffusion model (a text encoder or VAE passed on as a MODEL?). {todo}") from None
        prep_mode, prep_note = current_value("sage2_prep", sage2_prep)
        block_path, block_note = current_value("block_path", block_path)
        settings = Settings(layout=layout, backend=backend, prep_mode=prep_mode, patch_refiner=patch_text_refiner,
                            block_path=block_path)
        notes = tuple(n for n in (prep_note, block_note) if n is not None)
        # the reports of this node's patches the input model carries: this patch replaces them
        wrappers = getattr(model, "wrappers", {}).get(WrappersMP.OUTER_SAMPLE, {}).get(WRAPPER_KEY, [])
        replaced = [w.__self__.report for w in wrappers if hasattr(getattr(w, "__self__", None), "report")]
        clone, patch = patch_any_model(model, settings, node_id=cls.hidden.unique_id, notes=notes)
        PROMPT_END.watch(patch.report, replaced)
        return io.NodeOutput(clone)


class PromptEnd(CacheProvider):
    """A report for every prompt the node ran in: where no sampling run used the patched model (denoise 0), the
    patch's report says so at the prompt's end. ComfyUI's one public hook there is a cache provider's
    ``on_prompt_end``: this is one, registered only while such a prompt runs; it caches nothing."""

    def __init__(self):
        self.reports, self.registered = [], False

    def watch(self, report, replaced=()) -> None:
        self.reports = [r for r in self.reports if r not in replaced] + [report]
        if cache_provider is not None and not self.registered:
            cache_provider.register_cache_provider(self)
            self.registered = True

    def on_prompt_end(self, prompt_id) -> None:
        cache_provider.unregister_cache_provider(self)
        self.registered = False
        reports, self.reports = self.reports, []
        for report in reports:
            report.unsampled()

    async def on_lookup(self, context):
        return None

    async def on_store(self, context, value):
        return None

    def should_cache(self, context, value=None):
        return False


PROMPT_END = PromptEnd()
NODES = [SageStridedNHDAttention]


class SageStridedNHDExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)
