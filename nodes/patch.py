"""What the node installs on one ``ModelPatcher.clone()``: its settings, the run report, and the plan of the
sampling run in progress (decided once when sampling starts, read by the patched forwards)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from comfy.patcher_extension import WrappersMP

from .. import kernels
from .report import RunReport

NODE = "Sage Strided NHD Attention"
WRAPPER_KEY = "sage_strided_nhd"
# every kind of ComfyUI wrapper a patch of this node adds (the H3 patch: both); a clone sheds them all first
WRAPPER_KINDS = (WrappersMP.OUTER_SAMPLE, WrappersMP.APPLY_MODEL)
# MiniMax H3 block forward: the block fast path with stock's bits (exact), or the attention-only patch
BLOCK_PATHS = ("exact", "attention_only")
# Node input values that earlier releases offered: a saved workflow that carries one still runs, on the
# nearest value offered now (the report notes it). input name -> {removed value: value that runs}
REMOVED_VALUES = {"block_path": {"fused": "exact"}, "sage2_prep": {"fused": "exact", "fused_rotated": "rotated"}}


@dataclass(frozen=True)
class Settings:
    """The node's inputs, validated once here."""

    layout: str = "strided_nhd"
    backend: str = "auto"
    prep_mode: str = "exact"
    patch_refiner: bool = True
    block_path: str = "exact"
    # Not node inputs: rows per MLP chunk by weight format (cuBLAS's bf16 GEMMs lose speed under ~12k rows;
    # comfy-kitchen's int8 fc1 is fastest in 8k-row chunks), rows per qkv-projection chunk, the back-ends' prepared
    # paths (False: plain calls), the report's peak per model call (False, for a caller that measures a whole run's
    # peak: measuring resets the device's peak statistics at each model call).
    mlp_chunk_tokens: int = 12800
    int8_mlp_chunk_tokens: int = 8192
    qkv_chunk_tokens: int = 8192
    prepared: bool = True
    measure_peak: bool = True

    def __post_init__(self):
        for what, value, valid in (("layout", self.layout, kernels.LAYOUTS),
                                   ("block path", self.block_path, BLOCK_PATHS),
                                   ("back-end", self.backend, kernels.BACKEND_CHOICES),
                                   ("sage2_prep mode", self.prep_mode, tuple(kernels.PREPARED_MODES))):
            if value not in valid:
                raise ValueError(f"{NODE}: unknown {what} {value!r}; choose one of {', '.join(valid)}")
        for name in ("mlp_chunk_tokens", "int8_mlp_chunk_tokens", "qkv_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{NODE}: {name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Note:
    """A decision taken when sampling started: a short code and the sentence."""

    code: str
    text: str


# the values these node inputs offer now (a removed value still runs, mapped: REMOVED_VALUES)
OFFERED_VALUES = {"sage2_prep": tuple(kernels.PREPARED_MODES), "block_path": BLOCK_PATHS}


def value_problem(name: str, value) -> str | None:
    """Why ``value`` cannot run as node input ``name`` (a sentence naming the input and the values it takes), or None.
    A removed value can run (``current_value`` maps it). Anything but text (a JSON object, a list, None) is refused."""
    offered = ", ".join(OFFERED_VALUES[name])
    if not isinstance(value, str):
        what = {dict: "a JSON object", list: "a list", type(None): "no value"}.get(type(value),
                                                                                f"a {type(value).__name__}")
        shown = "" if value is None else f" {repr(value) if len(repr(value)) <= 60 else repr(value)[:59] + '…'}"
        return f"{name} takes one of {offered} (text); it got {what}{shown}"
    if value in OFFERED_VALUES[name] or value in REMOVED_VALUES[name]:
        return None
    return f"{name} {value!r} is not one of {offered}"


def current_value(name: str, value) -> tuple[str, Note | None]:
    """A node input's value as it runs now: a removed value mapped to its replacement, with the note. A value that
    cannot run raises ValueError naming the input and the values it takes."""
    problem = value_problem(name, value)
    if problem is not None:
        raise ValueError(f"{NODE}: {problem}")
    runs = REMOVED_VALUES[name].get(value)
    if runs is None:
        return value, None
    return runs, Note("removed_value", f"{name} {value!r} was removed from the node: this workflow runs {runs!r}")


@dataclass(frozen=True)
class Plan:
    """One sampling run's decisions: the chain each patched module's calls use, and the notes."""

    default: kernels.BackendChain
    chains: MappingProxyType = field(default_factory=dict)  # key -> chain where not default; read-only once made
    notes: tuple[Note, ...] = ()
    blocks_patched: int = 0
    refiner_blocks_patched: int = 0
    block_path_blocks: int = 0   # H3 blocks whose forward is the block fast path (the rest: attention only)
    # the run's int8 routes (``int8_layers.route``), decided at each layer's first call: a new plan, new answers
    int8_routes: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "chains", MappingProxyType(dict(self.chains)))

    def chain_for(self, key: str) -> kernels.BackendChain:
        return self.chains.get(key, self.default)


class InstalledPatch:
    """The node's state on one clone. ``planner(model_patcher, model_options) -> Plan`` runs when
    sampling starts (it may raise ``conflicts.PatchConflictError``)."""

    def __init__(self, settings: Settings, report: RunReport, planner, plan: Plan):
        self.settings = settings
        self.report = report
        self.planner = planner
        self.plan = plan  # before the first sampling run: the node's own chain everywhere

    def wrappers(self) -> dict:  # by kind: here OUTER_SAMPLE (the H3 patch adds its own)
        return {WrappersMP.OUTER_SAMPLE: self.outer_sample_wrapper}

    def install(self, clone) -> None:
        """``wrappers()`` on the clone, in place of any this node left there."""
        for kind in WRAPPER_KINDS:
            clone.remove_wrappers_with_key(kind, WRAPPER_KEY)
        for kind, wrapper in self.wrappers().items():
            clone.add_wrapper_with_key(kind, WRAPPER_KEY, wrapper)

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        """ComfyUI OUTER_SAMPLE wrapper: plan, sample, report; exceptions pass through unchanged."""
        self.report.begin_run()
        try:
            guider = getattr(executor, "class_obj", None)
            patcher = getattr(guider, "model_patcher", None)
            if patcher is not None:
                options = getattr(guider, "model_options", None)
                self.plan = self.planner(patcher, options if options is not None else patcher.model_options)
                self.report.planned(self.plan)
                # each chain's back-ends check themselves on the model's device (once a process), in order up to the
                # first that can run there, as a first call would, but before the model forward: SageAttention's
                # self-test then allocates nothing inside a block or a graph the Comfy Compiler records
                device = getattr(patcher, "load_device", None)
                for chain in (self.plan.default, *self.plan.chains.values()) if device is not None else ():
                    next((b for b in chain.backends if b.available(device)), None)
            return executor(*args, **kwargs)
        except BaseException as exc:
            self.report.ended_by(exc)
            raise
        finally:
            self.report.finish_run()
