"""MiniMax H3 sequence parallel (Ulysses) across the ranks of a torch.distributed group.

How a patched H3 forward runs on every rank (each rank holds the whole model):

* ``_forward`` is untouched: every rank embeds the full packed sequence, builds the
  modulation segments and the rope table, exactly as on one GPU (cheap next to the blocks).
* Every DiT block gets a ComfyUI block replace (``patches_replace["dit"][("double_block", i)]``,
  the hook H3's own block loop offers). The first block's replace keeps only this rank's rows
  of ``x`` (``kernels.ulysses.shard_bounds``), every replace hands the block the rope table
  rows and the modulation segments of those rows (segments re-based to local row indices),
  and the last one all-gathers the rows so the final layer sees the full sequence again.
* Every DiT block's ``attn.forward`` is replaced by :class:`UlyssesAttentionForward`: fused
  qkv of the local rows -> in-place norm+rope -> all-to-all to a head slice -> this pack's
  strided NHD attention -> all-to-all back (``kernels.ulysses``).

Norms, modulation, MLP and residuals are per token, so they run on local rows unchanged.
The text refiner runs once per forward on text only and is not sharded.

Composition with the "Sage Strided NHD Attention" node: apply that node first; this patch
takes its back-end chain (the kernel each rank runs) and replaces its block forwards.
Applied the other way round, that node refuses (this patch is not its own).

Running N ranks: every rank must run the same sampling (same graph, same seed) with the
patched model, so that the collectives line up; :func:`patch_model` refuses a world size
larger than one unless such a group is already initialised in this process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import comfy.model_management
from comfy_api.latest import io

from .. import kernels
from ..kernels import ulysses
from . import conflicts, h3_patch
from .report import RunReport, install_run_report

SP_MARK = "sage_strided_nhd_sequence_parallel"  # on every callable this patch installs
SHARD_KEY = "sage_strided_nhd_sequence_shard"    # transformer_options key: this rank's SequenceShard
H3_WORLD_SIZES = (1, 2, 4, 7, 8)                 # divisors of H3's 56 heads that fit one host

REMAINING_COPIES = h3_patch.REMAINING_COPIES + (
    "sequence parallel: the qkv pack before the all-to-all and the output unpack after it (2 per call);",
    "sequence parallel: the last block all-gathers the rows for the final layer (once per forward).",
)


class SequenceParallelError(RuntimeError):
    """Sequence parallel cannot run with this model, world size or process setup."""


def is_sp(obj) -> bool:
    return bool(getattr(obj, SP_MARK, False))


# --- rows ----------------------------------------------------------------------------------------
def local_segments(segments, start: int, stop: int) -> list[tuple[int, int, int]]:
    """Modulation segments ``(a, b, row)`` (absolute rows) clipped to [start, stop) and re-based to 0."""
    out = []
    for a, b, row in segments:
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            out.append((lo - start, hi - start, row))
    return out


def gather_rows(local: torch.Tensor, shard: ulysses.SequenceShard, group=None) -> torch.Tensor:
    """Every rank's rows back into the full [S, ...] sequence (uneven shards: padded, then trimmed)."""
    longest = max(shard.sizes)
    padded = local
    if local.shape[0] < longest:
        padded = local.new_zeros((longest,) + tuple(local.shape[1:]))
        padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(shard.world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, shard.sizes)])


# --- the patches ---------------------------------------------------------------------------------
class ShardedBlock:
    """Block replace for one H3 DiT block: run it on this rank's rows of the sequence."""

    def __init__(self, index: int, last_index: int, group=None):
        setattr(self, SP_MARK, True)
        self.index = index
        self.last_index = last_index
        self.group = group

    def __call__(self, args: dict, extra: dict) -> dict:
        rope = args["rope_freqs"]
        if rope is None:
            raise SequenceParallelError("H3 block called without a rope table: the sequence cannot be sharded")
        seq_len = rope.shape[1]
        shard = ulysses.SequenceShard(seq_len, dist.get_world_size(self.group), dist.get_rank(self.group))
        h = args["img"]
        if h.shape[0] == seq_len:  # the first block: keep this rank's rows
            h = h[shard.start:shard.stop].clone()
        elif h.shape[0] != shard.local_len:
            raise SequenceParallelError(
                f"block {self.index} got {h.shape[0]} rows: neither the full sequence ({seq_len}) nor rank "
                f"{shard.rank}'s {shard.local_len} rows. Another patch changed the block inputs.")
        options = dict(args["transformer_options"])
        options[SHARD_KEY] = shard
        out = extra["original_block"]({
            **args, "img": h, "transformer_options": options,
            "mod_segments": local_segments(args["mod_segments"], shard.start, shard.stop),
            "rope_freqs": rope[:, shard.start:shard.stop],
        })["img"]
        if self.index == self.last_index:  # the final layer indexes absolute rows
            out = gather_rows(out, shard, self.group)
        return {"img": out}


class UlyssesAttentionForward:
    """Replacement for one H3 DiT ``Attention.forward`` inside the sharded block loop."""

    def __init__(self, attn, *, chain, report: RunReport, group=None):
        setattr(self, SP_MARK, True)
        self.attn = attn
        self.chain = chain
        self.report = report
        self.group = group
        # outside the sharded loop (no shard in transformer_options) the whole sequence is local
        self.unsharded = h3_patch.H3AttentionForward(attn, chain=chain, layout="strided_nhd", report=report)

    def __call__(self, x, rope_freqs=None, transformer_options={}):
        shard = transformer_options.get(SHARD_KEY)
        if shard is None:
            return self.unsharded(x, rope_freqs=rope_freqs, transformer_options=transformer_options)
        attn = self.attn
        qkv = attn.qkv_proj(x)
        norm = {}
        if rope_freqs is not None:
            norm = dict(rope_table=rope_freqs, eps=attn.q_norm.eps,
                        q_weight=comfy.model_management.cast_to(attn.q_norm.weight, device=x.device),
                        k_weight=comfy.model_management.cast_to(attn.k_norm.weight, device=x.device),
                        inplace=not comfy.model_management.in_training)
        else:
            norm = dict(q_norm=attn.q_norm, k_norm=attn.k_norm)
        out, rec = ulysses.ulysses_attention_from_fused_qkv(
            qkv, attn.heads, attn.head_dim, chain=self.chain, seq_len=shard.seq_len, group=self.group, **norm)
        self.report.record(rec, stock_copies=h3_patch.STOCK_COPIES_PER_CALL, hnd_copies=h3_patch.HND_COPIES_PER_CALL)
        return attn.out_proj(out)


class SequenceParallelReport(RunReport):
    """The pack's run report plus the sequence-parallel facts (sent by rank 0 only)."""

    def __init__(self, *, sequence_parallel: dict, **kwargs):
        super().__init__(**kwargs)
        self.static["sequence_parallel"] = sequence_parallel

    def payload(self) -> dict:
        p = super().payload()
        sp = p["sequence_parallel"]
        p["messages"].insert(1, f"sequence parallel (Ulysses) on {sp['world_size']} ranks ({sp['dist_backend']}), "
                                f"{sp['heads_per_rank']} heads per rank, back-end chain from {sp['chain_from']}")
        return p

    def finish_run(self) -> dict:
        if self.static["sequence_parallel"]["rank"] != 0:  # every rank counts; one report reaches the UI
            p = self.payload()
            self.sent.append(p)
            return p
        return super().finish_run()


# --- installing ----------------------------------------------------------------------------------
def _existing_chain(model_patcher, forward_keys, backend: str):
    """The Sage node's chain when it patched these forwards, else a chain for ``backend``.

    Returns (chain, where it came from). Refuses foreign patches and the Sage node's hnd layout.
    """
    found = [model_patcher.object_patches.get(k) for k in forward_keys]
    foreign = [k for k, obj in zip(forward_keys, found) if obj is not None and not (is_sp(obj) or conflicts.is_own(obj))]
    if foreign:
        raise conflicts.PatchConflictError(
            f"Sequence Parallel H3: another node already replaced {len(foreign)} H3 attention forward(s) "
            f"(first: {foreign[0]}). Sequence parallel must own those forwards: remove the other attention node.")
    sage = [obj for obj in found if obj is not None and conflicts.is_own(obj) and not is_sp(obj)]
    if sage:
        if any(getattr(obj, "layout", None) != "strided_nhd" for obj in sage):
            raise SequenceParallelError(
                "Sequence Parallel H3: the Sage Strided NHD Attention node before this one uses layout 'hnd'; "
                "sequence parallel runs the strided NHD path only. Set that node's layout to strided_nhd.")
        return sage[0].chain, "Sage Strided NHD Attention node"
    return kernels.BackendChain.for_choice(backend, model_patcher.load_device), f"this node ({backend})"


def _foreign_block_replaces(model_patcher, n_blocks: int) -> list:
    replaces = model_patcher.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    return [key for key, fn in replaces.items() if not is_sp(fn)]


def check_group(world_size: int, group=None) -> tuple[int, str]:
    """This process's rank in a group of ``world_size`` ranks; refuses when no such group runs here."""
    if not dist.is_initialized():
        raise SequenceParallelError(
            f"Sequence Parallel H3: {world_size} ranks need a torch.distributed process group with one process per "
            "GPU, each running this same graph (same seed). This ComfyUI process has none: ComfyUI runs as one "
            "process and this pack does not start worker processes yet. Run the graph through the pack's "
            "multi-process runner (benchmarks/sequence_parallel.py shows how), or set world size 1.")
    if dist.get_world_size(group) != world_size:
        raise SequenceParallelError(
            f"Sequence Parallel H3: world size {world_size} requested but the process group has "
            f"{dist.get_world_size(group)} ranks")
    return dist.get_rank(group), dist.get_backend(group)


def check_devices(world_size: int, device) -> None:
    device = torch.device(device)
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise SequenceParallelError(f"Sequence Parallel H3: {world_size} ranks need {world_size} GPUs; "
                                    f"{torch.cuda.device_count()} visible")


def patch_model(model_patcher, world_size: int, backend: str = "auto", group=None, node_id=None):
    """Patch a clone of an H3 ModelPatcher for sequence parallel over ``group``; returns (clone, summary).

    The input patcher is not modified. Raises ``ValueError`` for a model that is not H3,
    ``kernels.ulysses.SequenceParallelConfigError`` when ``world_size`` does not divide the
    heads, :class:`SequenceParallelError` without a matching process group, and
    ``conflicts.PatchConflictError`` for another pack's patch on the same forwards or blocks.
    """
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    if not h3_patch.is_h3_model(diffusion_model):
        raise ValueError(f"Sequence Parallel H3: {type(diffusion_model).__name__} is not {h3_patch.H3_MODEL_CLASS}")
    if backend not in kernels.BACKEND_CHOICES:
        raise ValueError(f"Sequence Parallel H3: unknown back-end {backend!r}; choose one of {', '.join(kernels.BACKEND_CHOICES)}")
    n_blocks = len(diffusion_model.blocks)
    heads = diffusion_model.blocks[0].attn.heads
    ulysses.check_world_size(heads, world_size)
    check_devices(world_size, model_patcher.load_device)
    if world_size == 1 and not dist.is_initialized():
        # one GPU: nothing to split; the model passes through unchanged (and says so)
        return model_patcher.clone(), {"sequence_parallel": {"world_size": 1, "patched": False}}
    rank, dist_backend = check_group(world_size, group)
    conflicts.check_override(model_patcher)
    prefixes = [f"diffusion_model.blocks.{i}.attn" for i in range(n_blocks)]
    problems = {p: h3_patch.structure_problems(model_patcher.get_model_object(p)) for p in prefixes}
    problems = {p: why for p, why in problems.items() if why}
    if problems:
        first, why = next(iter(problems.items()))
        raise h3_patch.H3StructureError(f"Sequence Parallel H3: {first} differs from the known H3 attention: {'; '.join(why)}")
    chain, chain_from = _existing_chain(model_patcher, [p + ".forward" for p in prefixes], backend)
    foreign = _foreign_block_replaces(model_patcher, n_blocks)
    if foreign:
        raise conflicts.PatchConflictError(
            f"Sequence Parallel H3: another node replaced {len(foreign)} H3 block(s) (first: {foreign[0]}); "
            "sequence parallel shards the block inputs and cannot run under another block replace.")

    clone = model_patcher.clone()
    sp = {"world_size": world_size, "patched": True, "rank": rank, "dist_backend": dist_backend, "heads_per_rank": heads // world_size,
          "chain_from": chain_from, "copies_added_per_call": ulysses.ULYSSES_COPIES_PER_CALL}
    report = SequenceParallelReport(
        sequence_parallel=sp, node_id=node_id, model_family=type(model_patcher.model).__name__,
        path="h3_forward_patch", layout="strided_nhd", backend_requested=chain.requested,
        blocks_patched=n_blocks, refiner_blocks_patched=0, remaining_copies=REMAINING_COPIES)
    for i, prefix in enumerate(prefixes):
        attn = model_patcher.get_model_object(prefix)
        clone.add_object_patch(prefix + ".forward", UlyssesAttentionForward(attn, chain=chain, report=report, group=group))
        clone.set_model_patch_replace(ShardedBlock(i, n_blocks - 1, group), "dit", "double_block", i)
    install_run_report(clone, report)
    return clone, dict(report.static, report=report)


# --- the node ------------------------------------------------------------------------------------
class SequenceParallelH3(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SageStridedNHDSequenceParallelH3",
            display_name="Sequence Parallel H3 (Ulysses)",
            category="advanced/model_patches",
            description=(
                "Splits MiniMax H3's packed sequence across the ranks of a torch.distributed group (one process "
                "per GPU): each rank runs the blocks on its rows and the attention on heads/N heads through "
                "this pack's strided NHD path. Needs every rank to run the same graph; put it after the "
                "Sage Strided NHD Attention node to use that node's kernel."),
            inputs=[
                io.Model.Input("model", tooltip="A MiniMax H3 model (optionally patched by Sage Strided NHD Attention first)."),
                io.Int.Input("world_size", default=2, min=1, max=8,
                             tooltip="Number of GPUs (ranks). Must divide H3's 56 heads: 1, 2, 4, 7 or 8."),
                io.Combo.Input("backend", options=list(kernels.BACKEND_CHOICES), default="auto",
                               tooltip="Attention kernel on each rank, used when no Sage Strided NHD Attention "
                                       "node precedes this one (otherwise that node's choice wins)."),
            ],
            outputs=[io.Model.Output(tooltip="The sequence-parallel copy of the model.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, world_size, backend) -> io.NodeOutput:
        clone, _ = patch_model(model, world_size, backend, node_id=cls.hidden.unique_id)
        return io.NodeOutput(clone)
