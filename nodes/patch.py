"""What the node installs on one ``ModelPatcher.clone()``: its settings, the run report, and the
plan of the sampling run in progress: a value decided once when sampling starts (conflicts.py, on
the patch stack actually sampled) and read by the patched forwards. The report only records."""

from __future__ import annotations

from dataclasses import dataclass, field

from comfy.patcher_extension import WrappersMP

from .. import kernels
from .report import RunReport

NODE = "Sage Strided NHD Attention"
WRAPPER_KEY = "sage_strided_nhd"
# MiniMax H3 block forward: the block fast path with stock's bits (exact) or with more passes merged
# (fused, not bit-identical), or the attention-only patch
BLOCK_PATHS = ("exact", "fused", "attention_only")


@dataclass(frozen=True)
class Settings:
    """The node's inputs, validated once here."""

    layout: str = "strided_nhd"
    backend: str = "auto"
    prep_mode: str = "exact"
    patch_refiner: bool = True
    block_path: str = "exact"
    # block fast path: rows per MLP chunk (not node inputs), by weight format. cuBLAS's bf16 fc1/fc2 lose
    # 2-6 % in chunks under ~12k rows, comfy-kitchen's int8 fc1 runs ~8 % faster in 8k-row chunks than
    # whole (benchmarks/mlp_split.py, H100); 12,800 gives three 12,608-row chunks at 37,810 tokens
    mlp_chunk_tokens: int = 12800
    int8_mlp_chunk_tokens: int = 8192
    qkv_chunk_tokens: int = 8192  # H3 attention: rows per qkv-projection chunk on a prepared path (not a node input)
    # block fast path: int8 ConvRot linears quantise their input with the pack's pass (stock's bits;
    # not a node input: False measures stock's quantiser beside it)
    own_int8_quantizer: bool = True

    def __post_init__(self):
        for what, value, valid in (("layout", self.layout, kernels.LAYOUTS), ("block path", self.block_path, BLOCK_PATHS),
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


@dataclass(frozen=True)
class Plan:
    """One sampling run's decisions: the chain each patched module's calls use, and the notes."""

    default: kernels.BackendChain
    chains: dict = field(default_factory=dict)   # module key -> BackendChain, where it differs from default
    notes: tuple[Note, ...] = ()
    blocks_patched: int = 0
    refiner_blocks_patched: int = 0
    block_path_blocks: int = 0   # H3 blocks whose forward is the block fast path (the rest: attention only)

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

    def install(self, clone) -> None:
        clone.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
        clone.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, self.outer_sample_wrapper)

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
            return executor(*args, **kwargs)
        except BaseException as exc:
            self.report.ended_by(exc)
            raise
        finally:
            self.report.finish_run()
