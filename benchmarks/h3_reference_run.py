"""Reproduce the reference report for MiniMax H3: stock vs HND vs strided NHD, in ComfyUI's own H3 code.

Run from the repo root, with a ComfyUI that has MiniMax H3 at ``$COMFYUI_PATH`` (default ./.comfyui):

    python -m benchmarks.h3_reference_run --out benchmarks/results/h200-sage2.json --backend auto

With no ``--checkpoint`` it builds the full-size H3 DiT (50 blocks, hidden 5376, 56x128 heads, bf16)
with seeded random weights directly on the GPU, and a seeded random text conditioning of 100
tokens, so 1344x768x124 packs exactly 37,810 tokens. On an H200 the whole run takes about 4-5
minutes (model build ~10 s, blocks ~20 s, 2-step ABBA ~50 s, 12-step ~140 s).

What it measures (written to the JSON after every section, so a failure keeps the rest):

- ``isolated_attention_layout``: block 0's attention alone through ``kernels.attention_from_fused_qkv``.
- ``real_block_results``: blocks 0 / 24 / 49 of the real model, variants timed interleaved rep by
  rep (p50), outputs compared, peak extra memory per variant. Stock ComfyUI attention is the third
  variant (ComfyUI's flag for the same kernel: ``--use-sage-attention`` for sage, ...).
- ``profiler_block_recapture``: CUDA kernels launched by one block forward per variant (torch.profiler).
- ``sampling_2_step`` / ``sampling_12_step``: ComfyUI's sampling nodes as the bundled workflows wire
  them (RandomNoise 440420, KSamplerSelect res_multistep, BasicScheduler simple, BasicGuider,
  SamplerCustomAdvanced, EmptyMiniMaxH3LatentAV), HND and strided NHD in ABBA order; seconds,
  video/audio checksums, peak allocated/reserved bytes.
- ``peak_memory_long_sequence`` (``--memory-at TOKENS``, last): peak extra memory of one block per
  variant at the frame count whose packed token count is closest to TOKENS; no timing.
- ``validation``: bit-exact or the measured difference per item; outputs finite; patches reverted.

Variants beside stock and the layouts (``hnd`` and ``strided_nhd`` run the node's default block path,
``exact``): ``--variant NAME=LAYOUT:BACKEND:PREP[:noprepared][:whole_qkv][:qkvN][:mlpN][:attention_only]``, and the peer,
KJNodes' MiniMax H3 nodes from a checkout given with ``--kjnodes DIR`` (``benchmarks/peer.py``;
its code never enters this repository). ``--peer-table`` sets up stock, strided NHD, strided NHD on
the attention-only block path and the peer's variants in one interleaved run. The peer calls
ComfyUI's ``optimized_attention``, so its numbers stand beside the pack's only where stock runs the
pack's kernel (the stock flag below; ``validation.peer_attention`` says so).

The patch is the node's own (``nodes/h3_patch.patch_model`` on a ModelPatcher clone); stock is no patch.
Layout: ``--layout ab`` (default) measures both layouts in one process; ``--layout strided_nhd|hnd``
(or ``H3_SAGE_QKV_LAYOUT=strided_nhd|hnd``, the reference system's switch) measures one.

Other useful forms:

    python -m benchmarks.h3_reference_run --skip-12-step                     # ~2 minutes
    python -m benchmarks.h3_reference_run --sections blocks,profiler         # ~1 minute
    python -m benchmarks.h3_reference_run --checkpoint /models/h3.safetensors # real weights
    python -m benchmarks.h3_reference_run --tiny --device cpu --backend sdpa  # seconds, any machine
    python -m benchmarks.h3_reference_run --peer-table --kjnodes ~/ComfyUI-KJNodes --blocks 2 \
        --sections blocks,profiler --memory-at 120000                         # the pack against KJNodes

Prints progress per rep and per sampling step, and a short table last. With ``$OUT`` set, the
JSON and PNG are also copied there. The tables in docs/BENCHMARKS.md are made from the JSON with
``python -m benchmarks.results_table``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from devkit import comfy as comfy_host
from devkit import h3 as h3_model
from devkit.backends import describe_backends
from devkit.pack import kernels as pack_kernels
from devkit.pack import submodule

from . import peer, schema
from .prep_passes import norm_modulate_tiling
from .prep_passes import tiling as norm_rope_tiling
from . import sections as sec
from .report import LAYOUTS, Report, correctness_table, equality_verdict, text_table

SECTIONS = ("isolated", "blocks", "profiler", "sampling_2_step", "sampling_12_step")
MEMORY_SECTION = "memory"  # only with --memory-at; runs last (past the int32 line stock's attention may fault)
VARIANT_USAGE = ("NAME=LAYOUT:BACKEND:PREP[:noprepared][:whole_qkv][:stock_int8q][:qkvN][:mlpN]"
                 "[:attention_only|:fused_block]")
# whole_qkv: the qkv projection always made whole (no token chunks), to measure what the chunks cost;
# stock_int8q: int8 ConvRot linears on stock's activation quantiser, to measure the pack's beside it;
# qkvN / mlpN: N rows per qkv-projection / MLP chunk (the settings' qkv_chunk_tokens; mlp_chunk_tokens and
# int8_mlp_chunk_tokens, whichever the weights use)
CHUNK_FLAG = re.compile(r"(qkv|mlp)([1-9][0-9]*)")
CHUNK_SETTINGS = {"qkv": ("qkv_chunk_tokens",), "mlp": ("mlp_chunk_tokens", "int8_mlp_chunk_tokens")}
VARIANT_FLAGS = {"noprepared": ("prepared", False), "attention_only": ("block_path", "attention_only"),
                 "fused_block": ("block_path", "fused"), "whole_qkv": ("qkv_chunk_tokens", 2**62),
                 "stock_int8q": ("own_int8_quantizer", False)}
ATTENTION_ONLY = "attention_only"  # --peer-table's strided NHD variant on the attention-only block path
LAYOUT_ENV = "H3_SAGE_QKV_LAYOUT"
REFERENCE_COPY = Path(__file__).resolve().parent / "reference" / "gb10-strided-nhd-results.json"

# The reference report's keys that each of our sections makes; a run not asked for a section is not
# checked for its keys (the rest every run makes).
REFERENCE_KEYS_BY_SECTION = {
    "isolated": ("isolated_attention_layout", "validation.isolated_attention", "dataflow.removed_copies_per_block"),
    "blocks": ("real_block_results", "validation.blocks_0_24_49"),
    "profiler": ("nsight_block_recapture",),
    "sampling_2_step": ("sampling_2_step", "validation.full_50_block_two_step_trajectory"),
    "sampling_12_step": ("sampling_12_step", "validation.canonical_12_step_trajectory"),
}


def timed_blocks(n_blocks: int) -> list[int]:
    """The blocks the block section times: first, middle and last (0, 24, 49 of the full model)."""
    return sorted({0, (n_blocks - 1) // 2, n_blocks - 1})


def validation_names(n_blocks: int) -> dict[str, str]:
    """Reference validation item -> this run's name for it, named for what ran: the blocks compared and
    the block count of the model sampled (the full 50-block model keeps the reference's names)."""
    return {"blocks_0_24_49": "blocks_" + "_".join(str(b) for b in timed_blocks(n_blocks)),
            "full_50_block_two_step_trajectory": f"full_{n_blocks}_block_two_step_trajectory"}


def reference_for(data: dict, reference: dict) -> dict:
    """What a report of ours is checked against: the reference cut to the sections the run was asked
    to make (``sections_requested``), its validation items renamed as the run names them."""
    ref = copy.deepcopy(reference)
    asked = data.get("sections_requested", SECTIONS)
    for section, keys in REFERENCE_KEYS_BY_SECTION.items():
        if section in asked:
            continue
        for key in keys:
            *parents, last = key.split(".")
            node = ref
            for part in parents:
                node = node.get(part, {})
            node.pop(last, None)
    n_blocks = (data.get("model") or {}).get("blocks")
    if n_blocks and "validation" in ref:
        names = validation_names(n_blocks)
        ref["validation"] = {names.get(k, k): v for k, v in ref["validation"].items()}
    return ref


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.h3_reference_run",
                                description="MiniMax H3 reference run: stock vs HND vs strided NHD attention.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/h3-<device>-<backend>.json)")
    p.add_argument("--layout", choices=("ab",) + LAYOUTS,
                   help=f"layouts to measure (default: ${LAYOUT_ENV} if set, else ab = both)")
    p.add_argument("--backend", default="auto", help="attention back-end of the patch: auto, sage2, sage1, "
                   "comfy_kitchen_int8, sdpa (stock ComfyUI runs the same kernel through its own flag)")
    p.add_argument("--prep", default="exact", help="prepared-path mode of the layout variants "
                   "(exact, fused, rotated, fused_rotated; only where a back-end has a prepared path)")
    add_model_options(p)
    p.add_argument("--norm-rope-tiling", type=norm_rope_tiling, metavar="TOKENS,HEADS,WARPS,QK_FIRST",
                   help="run the pack's RMSNorm+RoPE pass with this tiling instead of qk_transform.NORM_ROPE_CONFIG "
                        "(every tiling gives the same bits; benchmarks/prep_passes.py times them)")
    p.add_argument("--norm-modulate-tiling", type=norm_modulate_tiling, metavar="WARPS|ROWS,COLS,WARPS",
                   help="run fused mode's norm + modulation passes with this tiling instead of "
                        "h3_block_fused.NORM_MODULATE_TILING")
    p.add_argument("--compile-blocks", action="store_true",
                   help="also time block 0 of stock, strided_nhd and the fused_block variants under torch.compile "
                        "(inductor), interleaved")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma list of {', '.join(SECTIONS)} ({MEMORY_SECTION}: added by --memory-at)")
    p.add_argument("--skip-12-step", action="store_true")
    p.add_argument("--reps", type=int, default=9, help="timed reps per block and variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--queued-reps", type=int, default=0, help="with the blocks section: also time block 0 "
                   "enqueued behind a GPU busy wait, this many reps (GPU time without host gaps, host enqueue time)")
    p.add_argument("--attention-reps", type=int, default=10)
    p.add_argument("--reps-2-step", type=int, default=2, help="2-step runs per layout (2 = ABBA)")
    p.add_argument("--reps-12-step", type=int, default=1, help="12-step runs per layout (2 = ABBA)")
    p.add_argument("--no-stock", action="store_true", help="leave stock ComfyUI out of blocks, profiler and memory")
    p.add_argument("--stock-sampling", action="store_true", help="also sample with stock attention, interleaved with the layouts")
    p.add_argument("--no-chart", action="store_true")
    add_variant_options(p)
    args = p.parse_args(argv)
    # --layout, else the preset's one layout, else the reference system's switch, else both
    args.layout = args.layout or ("strided_nhd" if args.peer_table else None) or os.environ.get(LAYOUT_ENV) or "ab"
    if args.layout not in ("ab",) + LAYOUTS:
        p.error(f"{LAYOUT_ENV}={args.layout!r}: expected one of {', '.join(LAYOUTS)}")
    args.sections = parse_sections(p, args)
    args.variants = [parse_variant(p, spec) for spec in args.variant]
    parse_peer_options(p, args)
    shape = (64, 64, 5, 8) if args.tiny else (1344, 768, 124, 100)
    for name, default in zip(("width", "height", "frames", "text_tokens"), shape):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def add_model_options(p) -> None:
    """The model measured, where, and at which shape."""
    p.add_argument("--checkpoint", help="H3 diffusion-model checkpoint (default: random full-size weights)")
    p.add_argument("--weights", choices=h3_model.WEIGHT_FORMATS, default="bf16",
                   help="random model only: the linears' format (int8_convrot: as the bundled workflows' checkpoint "
                        "stores qkv/out/fc1/fc2, loaded with ComfyUI's mixed_precision_ops)")
    p.add_argument("--comfyui", help="ComfyUI source tree (default: $COMFYUI_PATH, else ./.comfyui)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true",
                   help=f"a {h3_model.TINY_H3['num_layers']}-block narrow H3 at 64x64x5 (tests, CPU)")
    p.add_argument("--blocks", type=int, help="random model only: this many DiT blocks instead of the config's "
                   "(a quick smoke run at full width)")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--frames", type=int)
    p.add_argument("--text-tokens", type=int)
    p.add_argument("--seed", type=int, default=440420, help="noise seed (the reference's)")
    p.add_argument("--weight-seed", type=int, default=0, help="seed of the random weights and text states")


def compiled_variant_names(args) -> tuple[str, ...]:
    """--compile-blocks' variants: stock, strided_nhd and the --variant ones on the fused block path."""
    return ("stock", "strided_nhd", *(v["name"] for v in args.variants if v.get("block_path") == "fused"))


def add_variant_options(p) -> None:
    """The variants beside stock and the layouts: the pack's own, the peer's, and the memory section."""
    p.add_argument("--variant", action="append", default=[], metavar=VARIANT_USAGE,
                   help="an extra patched variant timed beside stock and the layouts in blocks, profiler and "
                        "memory, e.g. nhd_fused=strided_nhd:sage2:fused, sdpa=strided_nhd:sdpa:exact, "
                        "today=strided_nhd:sage2:exact:noprepared, attn=strided_nhd:sage2:exact:attention_only (flags after PREP, any order: noprepared = the "
                        "back-end's prepared path switched off; whole_qkv = the qkv projection made whole, never "
                        "in token chunks; attention_only or fused_block = block_path attention_only or fused "
                        "instead of the node's default exact). Repeatable.")
    p.add_argument("--kjnodes", type=Path, metavar="DIR",
                   help="a ComfyUI-KJNodes checkout: adds the peer's variants " + ", ".join(peer.VARIANTS)
                        + " (its nodes/minimax_nodes.py, nodes at their defaults) wherever variants take part")
    p.add_argument("--peer-table", action="store_true",
                   help=f"preset: stock, strided_nhd (block_path exact), {ATTENTION_ONLY} (strided_nhd, block_path "
                        "attention_only) and, with --kjnodes, the peer's variants, all interleaved; sampling sections "
                        "sample them all with stock")
    p.add_argument("--sample-variants", metavar="all|NAME,...",
                   help="extra variants (--variant, --kjnodes) that also sample, interleaved with the layouts")
    p.add_argument("--memory-at", type=int, metavar="TOKENS",
                   help="adds the memory section: peak extra memory of one block per variant at the frame count "
                        "whose packed token count is closest to TOKENS (e.g. 120000); no timing")


def parse_sections(parser, args) -> list[str]:
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS + (MEMORY_SECTION,)]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS + (MEMORY_SECTION,))}")
    if args.skip_12_step and "sampling_12_step" in chosen:
        chosen.remove("sampling_12_step")
    if args.memory_at is not None:
        if args.memory_at <= 0:
            parser.error(f"--memory-at {args.memory_at}: expected a positive token count")
        chosen += [] if MEMORY_SECTION in chosen else [MEMORY_SECTION]
    elif MEMORY_SECTION in chosen:
        parser.error(f"section {MEMORY_SECTION} needs --memory-at TOKENS")
    return chosen


def parse_variant(parser, spec: str) -> dict:
    """``NAME=LAYOUT:BACKEND:PREP[:noprepared][:attention_only|:fused_block]`` (flags in any order) as a
    variant dict."""
    name, _, rest = spec.partition("=")
    parts = rest.split(":")
    where = f"--variant {spec!r}: "
    if not re.fullmatch(r"[A-Za-z0-9_]+", name) or len(parts) < 3 or parts[0] not in LAYOUTS:
        parser.error(where + f"expected {VARIANT_USAGE}, NAME letters, digits and _, LAYOUT one of {', '.join(LAYOUTS)}")
    kernels = pack_kernels()
    if parts[1] not in kernels.BACKEND_CHOICES:
        parser.error(where + f"unknown back-end {parts[1]!r}; choose one of {', '.join(kernels.BACKEND_CHOICES)}")
    if parts[2] not in kernels.PREPARED_MODES:
        parser.error(where + f"unknown prepared-path mode {parts[2]!r}; "
                     f"choose one of {', '.join(kernels.PREPARED_MODES)}")
    flags = parts[3:]
    unknown = [f for f in flags if f not in VARIANT_FLAGS and not CHUNK_FLAG.fullmatch(f)]
    block_paths = [f for f in flags if VARIANT_FLAGS.get(f, ("",))[0] == "block_path"]
    if unknown or len(set(flags)) != len(flags) or len(block_paths) > 1:
        parser.error(where + (f"unknown flag(s) {unknown}" if unknown else "a flag given twice" if len(set(flags))
                              != len(flags) else f"one block path at most, got {block_paths}")
                     + f"; flags: {', '.join(VARIANT_FLAGS)}")
    variant = {"name": name, "layout": parts[0], "backend": parts[1], "prep": parts[2], "prepared": True,
               "block_path": "exact"}
    for f in flags:
        if f in VARIANT_FLAGS:
            variant.update([VARIANT_FLAGS[f]])
        else:
            what, rows = CHUNK_FLAG.fullmatch(f).groups()
            variant.update({key: int(rows) for key in CHUNK_SETTINGS[what]})
    return variant


def parse_peer_options(parser, args) -> None:
    """--peer-table's variants, --kjnodes' checkout, the variant names (unique), --sample-variants."""
    if args.peer_table:
        if args.no_stock:
            parser.error("--peer-table compares with stock: leave out --no-stock")
        args.variants.insert(0, {"name": ATTENTION_ONLY, "layout": "strided_nhd", "backend": args.backend,
                                 "prep": args.prep, "prepared": True, "block_path": "attention_only"})
        args.stock_sampling = True
        args.sample_variants = args.sample_variants or "all"
    if args.kjnodes is not None:
        try:
            peer.check_checkout(args.kjnodes)
        except FileNotFoundError as exc:
            parser.error(f"--kjnodes: {exc}")
    args.peer_variants = list(peer.VARIANTS) if args.kjnodes is not None else []
    taken = ["stock", *LAYOUTS, *args.peer_variants]
    for v in args.variants:
        if v["name"] in taken:
            parser.error(f"--variant {v['name']!r}: the name is taken (" + ", ".join(dict.fromkeys(taken)) + ")")
        taken.append(v["name"])
    extras = [v["name"] for v in args.variants] + args.peer_variants
    asked = [n.strip() for n in (args.sample_variants or "").split(",") if n.strip()]
    args.sampled_extras = extras if asked == ["all"] else asked
    unknown = [n for n in args.sampled_extras if n not in extras]
    if unknown:
        parser.error(f"--sample-variants: no variant {unknown}; extra variants here: {', '.join(extras) or 'none'}")


def log(message: str) -> None:
    print(f"[h3-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def device_facts(device: torch.device) -> dict:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"device": torch.cuda.get_device_name(device), "compute_capability": f"SM{major}{minor}"}
    return {"device": f"CPU ({platform.machine()})", "compute_capability": "cpu"}


def resolve_backend(kernels, choice: str, device: torch.device) -> str:
    """The back-end ``auto`` (or a named choice) will run first here."""
    if choice not in kernels.BACKEND_CHOICES:
        raise SystemExit(f"unknown --backend {choice!r}; choose one of {', '.join(kernels.BACKEND_CHOICES)}")
    rows = describe_backends(device)
    if choice != "auto":
        row = next(r for r in rows if r["name"] == choice)
        if not row["available"]:
            log(f"requested back-end {choice} is not available here ({row['reason']}); the chain will fall back")
        return choice
    for row in rows:
        if row["available"]:
            return row["name"]
    raise SystemExit("no attention back-end is available on " + str(device))


def default_out(facts: dict, backend: str) -> Path:
    slug = facts["device"].split("(")[0].strip().lower().replace("nvidia ", "").replace(" ", "-") or "device"
    return Path("benchmarks/results") / f"h3-{slug}-{backend}.json"


# Settings fields a variant may set (benchmark variants, not node inputs; absent: the default)
SETTING_OVERRIDES = ("qkv_chunk_tokens", "mlp_chunk_tokens", "int8_mlp_chunk_tokens", "own_int8_quantizer")


def patch_model(model_patcher, layout: str, backend: str, prep_mode: str = "exact", prepared: bool = True,
                block_path: str = "exact", **overrides):
    """A clone of ``model_patcher`` patched exactly as the node patches it: (clone, installed patch).
    ``prepared=False`` switches the chain's prepared paths off; ``overrides``: ``SETTING_OVERRIDES``
    (rows per qkv-projection / MLP chunk, int8 linears on stock's quantiser), None meaning the default."""
    unknown = set(overrides) - set(SETTING_OVERRIDES)
    if unknown:
        raise ValueError(f"unknown setting override(s) {sorted(unknown)}")
    extra = {k: v for k, v in overrides.items() if v is not None}
    settings = submodule("nodes.patch").Settings(layout=layout, backend=backend, prep_mode=prep_mode,
                                                 block_path=block_path, **extra)
    clone, patch = submodule("nodes.h3_patch").patch_model(model_patcher, settings)
    patch.plan.default.prepared = prepared  # the plan of every run starts from this chain
    return clone, patch


def last_payload(report):
    """The node's report of the last sampling run of a patched clone (None before any run)."""
    last = getattr(report, "last", None)
    if last is None and report.calls:  # blocks-only runs: the calls recorded outside any sampling run
        last = report.payload()
    return last


def backends_that_ran(patches: dict) -> tuple[str, list, dict]:
    """Back-ends the patched forwards ran in each layout's last sampling run (from the node's own run
    report), their fallbacks, and the back-ends per layout."""
    payloads = {layout: last_payload(patch.report) for layout, patch in patches.items()}
    payloads = {layout: p for layout, p in payloads.items() if p is not None}
    by_layout, fallbacks = {}, []
    for layout, payload in payloads.items():
        by_layout[layout] = "+".join(f"{b} x{n}" for b, n in sorted(payload["backends_ran"].items())) or "none"
        for run in payload["prepared"]:
            by_layout[layout] += f" [prepared path: {run['backend']} {run['mode']} x{run['calls']}]"
        fallbacks += payload["fallbacks"]
    ran = sorted({b for p in payloads.values() for b in p["backends_ran"]})
    return "+".join(ran) or "none", fallbacks, by_layout


def set_tilings(args) -> dict:
    """Apply --norm-rope-tiling / --norm-modulate-tiling to the pack's modules; the tilings that run."""
    qk_transform, fused = submodule("kernels.qk_transform"), submodule("kernels.h3_block_fused")
    if args.norm_rope_tiling is not None:
        qk_transform.NORM_ROPE_CONFIG = args.norm_rope_tiling
    if args.norm_modulate_tiling is not None:
        fused.NORM_MODULATE_TILING = args.norm_modulate_tiling
    return {"norm_rope": list(qk_transform.NORM_ROPE_CONFIG), "norm_modulate": fused.NORM_MODULATE_TILING}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    facts = device_facts(device)
    # ComfyUI must be imported after its flags are set; the stock flag needs the resolved back-end,
    # and kernels/ has no ComfyUI import, so it can be asked first.
    kernels = pack_kernels()
    backend_first = resolve_backend(kernels, args.backend, device)
    out = args.out or default_out(facts, backend_first)
    report = Report(out)
    report.update(tilings=set_tilings(args))
    layouts = list(LAYOUTS) if args.layout == "ab" else [args.layout]
    report.update(**facts, torch=str(torch.__version__), attention=backend_first, attention_requested=args.backend,
                  resolution=[args.width, args.height], frames=args.frames, packed_tokens=None,
                  seed=args.seed, feature_flag=f"{LAYOUT_ENV}=strided_nhd", layout=args.layout,
                  layouts_measured=layouts, sections_requested=list(args.sections),
                  backends_here=describe_backends(device))
    log(f"{facts['device']} ({facts['compute_capability']}), torch {torch.__version__}, back-end {args.backend} "
        f"-> {backend_first}, layouts {layouts}, sections {args.sections}; writing {out}")

    bench = None
    try:
        root = comfy_host.find_comfyui(args.comfyui)
        flags = comfy_host.import_comfyui(root, cpu=device.type == "cpu",
                                          stock_flag=comfy_host.STOCK_FLAG_FOR_BACKEND[backend_first])
        report.update(comfyui={"path": str(root), "version": comfy_host.comfyui_version(root), "flags": flags},
                      stock_attention=comfy_host.stock_attention_name())
        bench = build_bench(args, device, layouts, report)
    except Exception as exc:
        report.fail("setup", exc)
        copy_to_out([str(out)])
        log(f"setup failed: {type(exc).__name__}: {exc}")
        raise

    try:
        run_sections(args, bench, kernels, backend_first, report)
    finally:
        finish(args, bench, report, out)
    return 1 if report.data["errors"] else 0


def build_bench(args, device, layouts, report) -> sec.Bench:
    dtype = torch.bfloat16
    started = time.perf_counter()
    if args.checkpoint:
        log(f"loading {args.checkpoint}")
        base = h3_model.load_checkpoint_model(args.checkpoint)
        config = h3_model.model_config_of(base)
        source = f"checkpoint {args.checkpoint}"
    else:
        config = dict(h3_model.TINY_H3 if args.tiny else h3_model.FULL_H3)
        if args.blocks:
            config["num_layers"] = args.blocks
        log(f"building {'tiny' if args.tiny else 'full-size'} H3 with random {args.weights} weights on {device}")
        base = h3_model.build_model(config, device, dtype, args.weight_seed, args.weights)
        source = f"random {args.weights} weights (seed {args.weight_seed}, N(0, 1/fan_in), norms 1, biases 0)"
    build_seconds = time.perf_counter() - started
    dm = base.model.diffusion_model
    conditioning = h3_model.random_conditioning(args.text_tokens, config["text_dim"], args.weight_seed + 1)
    expected = h3_model.packed_token_count(args.width, args.height, args.frames, args.text_tokens)
    n_blocks = len(dm.blocks)
    block_indices = timed_blocks(n_blocks)
    clones, extras, patches, settings = build_variants(args, base, layouts)
    if args.kjnodes is not None:
        extras.update(build_peer_variants(args, base, report))
        settings.update({name: {"peer": report.data["peer"]["variants"][name]} for name in args.peer_variants})
    static = {k: v for k, v in patches[layouts[0]].report.static.items() if k != "layout"}
    report.update(
        model={"source": source, "class": type(dm).__name__, "blocks": n_blocks, "config": config,
               "dtype": str(dm.dtype),
               "parameters": sum(p.numel() for p in dm.parameters()), "build_seconds": build_seconds},
        text_tokens=args.text_tokens, packed_rows_expected=expected, variant_settings=settings,
        patch=dict(static, function="nodes.h3_patch.patch_model", patch_refiner=True),
        dataflow={
            "qkv_input": "projection-strided NHD views with no Q/K/V materialization",
            "qk_transform": "in-place Comfy Kitchen RMSNorm and RoPE on strided views",
            "attention_output": "contiguous back-end NHD output viewed token-major for out_proj",
            "removed_copies_per_block": None,
        })
    log(f"model ready in {build_seconds:.1f} s: {n_blocks} blocks, blocks timed {block_indices}, "
        f"expected packed tokens {expected['total']}")
    return sec.Bench(device=device, base=base, clones=clones, patches=patches, extras=extras,
                     conditioning=conditioning,
                     width=args.width, height=args.height, frames=args.frames, seed=args.seed,
                     block_indices=block_indices, log=log, peer=list(args.peer_variants))


def build_variants(args, base, layouts) -> tuple[dict, dict, dict, dict]:
    """The pack's variants: (layout clones, extra clones, patches, settings per variant)."""
    specs = [{"name": layout, "layout": layout, "backend": args.backend, "prep": args.prep, "prepared": True,
              "block_path": "exact"} for layout in layouts] + args.variants  # exact: the node's default
    clones, extras, patches, settings = {}, {}, {}, {}
    for v in specs:
        overrides = {k: v.get(k) for k in SETTING_OVERRIDES}
        clone, patches[v["name"]] = patch_model(base, v["layout"], v["backend"], prep_mode=v["prep"],
                                                prepared=v["prepared"], block_path=v["block_path"], **overrides)
        (clones if v["name"] in layouts else extras)[v["name"]] = clone
        settings[v["name"]] = {k: v[k] for k in ("layout", "backend", "prep", "prepared", "block_path")}
        settings[v["name"]].update({k: x for k, x in overrides.items() if x is not None})
    return clones, extras, patches, settings


def build_peer_variants(args, base, report) -> dict:
    """KJNodes' variants, each made by its nodes' ``execute`` on the stock model; what was loaded and the
    attention the peer calls go to ``report["peer"]``."""
    import comfy.ldm.minimax.model as h3

    module = peer.load_module(args.kjnodes)
    clones, applied = peer.make_variants(module, base)
    facts = peer.describe(args.kjnodes, module, h3.optimized_attention)
    report.update(peer=dict(facts, variants=applied))
    chains = ", ".join(f"{name} = {' + '.join(a['node'] for a in nodes)}" for name, nodes in applied.items())
    log(f"peer: {facts['checkout']}/{facts['file']} (commit {facts['git_commit'] or 'unknown'}), its attention "
        f"{facts['attention']}; variants {chains}")
    return clones


def _section(report: Report, name: str, fn):
    """Run one section; record its result or its error; never let it take the others down."""
    log(f"section {name}")
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            result = fn()
    except Exception as exc:
        log(f"section {name} FAILED: {type(exc).__name__}: {exc}")
        report.fail(name, exc)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None
    report.section(name, result)
    log(f"section {name} done in {time.perf_counter() - started:.1f} s")
    return result


def run_sections(args, bench: sec.Bench, kernels, backend: str, report: Report) -> None:
    with_stock = not args.no_stock
    captured = _section(report, "capture", lambda: sec.capture_block_inputs(bench))
    if captured is None:
        return
    expected = report.data["packed_rows_expected"]["total"]
    names = validation_names(len(bench.diffusion_model.blocks))
    report.update(packed_tokens=bench.packed_tokens)
    report.validation("packed_tokens", f"{bench.packed_tokens} as expected" if bench.packed_tokens == expected
                      else f"{bench.packed_tokens}, expected {expected}")

    if "isolated" in args.sections:
        iso = _section(report, "isolated_attention_layout",
                       lambda: sec.isolated_attention(bench, kernels, args.backend, args.attention_reps, args.warmup))
        if iso and "bit_exact" in iso:
            report.validation("isolated_attention", equality_verdict(iso))
            report.data["dataflow"]["removed_copies_per_block"] = iso["copies"]["hnd"] - iso["copies"]["strided_nhd"]
    if bench.peer:
        report.validation("peer_attention", peer_kernel_verdict(report.data, backend))
    if "blocks" in args.sections:
        run_blocks(args, bench, report, names["blocks_0_24_49"])
        if args.queued_reps > 0:
            _section(report, "queued_block", lambda: sec.queued_blocks(bench, args.queued_reps, args.warmup, with_stock))
    if args.compile_blocks:
        sec.ensure_stock_loaded(bench)
        _section(report, "compiled_block_results", lambda: sec.real_blocks(
            bench, args.reps, max(args.warmup, 2), True, compiled_variants=compiled_variant_names(args)))
    if "profiler" in args.sections:
        sec.ensure_stock_loaded(bench)
        _section(report, "profiler_block_recapture", lambda: sec.kernel_launches(bench, with_stock, torch.__version__))
        if args.compile_blocks:
            _section(report, "profiler_compiled_block", lambda: sec.kernel_launches(
                bench, True, torch.__version__, compiled_variants=compiled_variant_names(args)))
    for steps, key, item in ((2, "sampling_2_step", names["full_50_block_two_step_trajectory"]),
                             (12, "sampling_12_step", "canonical_12_step_trajectory")):
        if key in args.sections:
            run_sampling_section(args, bench, report, steps, key, item)
    if MEMORY_SECTION in args.sections:  # last: past the int32 line stock's attention may fault the device
        sec.ensure_stock_loaded(bench)
        _section(report, "peak_memory_long_sequence", lambda: sec.peak_memory_at(bench, args.memory_at, with_stock))


def run_blocks(args, bench: sec.Bench, report: Report, item: str) -> None:
    sec.ensure_stock_loaded(bench)
    rows = _section(report, "real_block_results",
                    lambda: sec.real_blocks(bench, args.reps, args.warmup, not args.no_stock))
    if not rows:
        return
    report.validation(item, sec.blocks_verdict(rows))
    report.validation("blocks_compared", ", ".join(str(r["block"]) for r in rows))
    if not args.no_stock:
        for name in bench.variants(with_stock=False):
            report.validation(f"blocks_stock_vs_{name}", sec.stock_blocks_verdict(rows, name))


def run_sampling_section(args, bench: sec.Bench, report: Report, steps: int, key: str, item: str) -> None:
    reps = args.reps_2_step if steps == 2 else args.reps_12_step
    result = _section(report, key, lambda: sec.sampling(bench, steps, reps, args.stock_sampling, args.sampled_extras))
    if not result:
        return
    report.validation(item, sec.trajectory_verdict(result))
    repeats = [r.get("repeat_identical") for r in result["runs"] if "repeat_identical" in r]
    if repeats:
        report.validation(f"{key}_repeat_runs", "identical" if all(repeats) else "differ between repeats")
    if args.stock_sampling:
        for name in [n for n in dict.fromkeys(result["order"]) if n != "stock"]:
            report.validation(f"{key}_stock_vs_{name}", sec.stock_sampling_verdict(result, name))


def peer_kernel_verdict(data: dict, backend: str) -> str:
    """Whether the peer's numbers stand beside the pack's: its forwards call ComfyUI's optimized_attention,
    so it runs stock's kernel, which must be the pack's (stock started with the flag for that back-end)."""
    facts, stock = data["peer"], data.get("stock_attention", "?")
    flag = comfy_host.STOCK_FLAG_FOR_BACKEND.get(backend)
    if not facts["same_attention_as_stock"]:
        return f"NOT comparable: the peer calls {facts['attention']}, stock ComfyUI {stock}"
    if flag is None:
        return (f"NOT comparable: the pack runs {backend}, which stock ComfyUI has no flag for; "
                f"the peer and stock call {stock}")
    return f"same kernel: the peer and stock call {stock} (--{flag.replace('_', '-')}), the pack runs {backend}"


def finish(args, bench, report: Report, out: Path) -> None:
    data = report.data
    if bench is not None:
        after_the_runs(bench, report)
    artifacts = [str(out)]
    if not args.no_chart:
        try:
            from .plot import write_chart
            artifacts.append(str(write_chart(data, out.with_suffix(".png"))))
            data["chart"] = artifacts[-1]
        except ImportError:
            data["chart"] = "not written: matplotlib is not installed (make it later: python -m benchmarks.plot JSON)"
        except Exception as exc:
            data["chart"] = f"not written: {type(exc).__name__}: {exc}"
    data["source_artifacts"] = artifacts
    if REFERENCE_COPY.is_file():
        allow = schema.CUDA_ONLY if args.device == "cpu" else set()
        problems = schema.check_against_reference(data, reference_for(data, schema.load_reference(REFERENCE_COPY)),
                                                  allow_null=allow)
        data["reference_schema"] = "follows the reference report's keys and types" if not problems else problems
    report.write()
    copy_to_out(artifacts)
    if bench is not None:
        release(bench)
    print()
    if args.device == "cpu":
        # a CPU proves the dataflow (same latents, which kernel ran), not the pack's speed
        print(correctness_table(data))
        print("(CPU run: timings in the report are not the pack's speed; GPU results are in docs/BENCHMARKS.md)")
    else:
        print(text_table(data))
    if data["errors"]:
        print("errors in: " + ", ".join(data["errors"]))
    print(f"report: {out}")


def after_the_runs(bench: sec.Bench, report: Report) -> None:
    """What ran per variant (the node's own run reports; the peer calls stock's attention), and the
    checks that the shared model is left unpatched and every output was finite."""
    data = report.data
    data["attention"], data["attention_fallbacks"], by_layout = backends_that_ran(bench.patches)
    peer_ran = {name: f"{data.get('stock_attention', '-')} (KJNodes' forward)" for name in bench.peer}
    data["attention_by_variant"] = dict(by_layout, stock=data.get("stock_attention", "-"), **peer_ran)
    try:
        sec.ensure_stock_loaded(bench)  # ComfyUI unpatches the last sampled clone when stock loads
        left = sec.patches_left_behind(bench.diffusion_model)
    except Exception as exc:
        left = [f"could not check: {type(exc).__name__}: {exc}"]
    report.validation("patch_reverted", "no attention forward left patched on the shared model" if not left
                      else f"still patched: {left[:3]}{'...' if len(left) > 3 else ''}")
    bad = [k for k, ok in bench.outputs_finite.items() if not ok]
    report.validation("outputs_finite", f"all {len(bench.outputs_finite)} outputs finite" if not bad
                      else f"non-finite values in: {', '.join(bad)}")


def copy_to_out(paths: list[str]) -> None:
    """Also leave the files under $OUT (the GPU machine hands that folder back)."""
    out_dir = os.environ.get("OUT")
    if not out_dir:
        return
    for path in paths:
        src = Path(path)
        dest = Path(out_dir) / src.name
        if src.is_file() and src.resolve() != dest.resolve():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)


def release(bench: sec.Bench) -> None:
    """Drop the model while ComfyUI's modules are alive (ModelPatcher.__del__ needs them)."""
    import comfy.model_management as mm

    mm.current_loaded_models.clear()
    bench.clones.clear()
    bench.patches.clear()
    bench.block_inputs.clear()
    bench.base = None
    gc.collect()


if __name__ == "__main__":
    sys.exit(main())
