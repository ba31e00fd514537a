"""The reference run for MiniMax H3 in ComfyUI's own H3 code: stock ComfyUI, the pack's layouts and KJNodes' H3
nodes (``benchmarks/peer.py``) side by side, one JSON report in the reference's shape, written as each section
ends. With no ``--checkpoint`` the full-size H3 gets seeded random weights and 100 random text tokens (1344x768x124
packs 37,810 tokens). Stock runs the pack's kernel through its own flag (``--use-sage-attention`` for sage2).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import sys
import time
from pathlib import Path

import torch

from devkit import comfy as comfy_host
from devkit import h3 as h3_model
from devkit.backends import describe_backends
from devkit.pack import kernels as pack_kernels
from devkit.pack import submodule

from . import peer, results_table
from . import sections as sec
from .measure import device_facts
from .report import (CUDA_ONLY, LAYOUTS, Report, check_against_reference, correctness_table, equality_verdict,
                     first_contact_table, load_reference, text_table)

SECTIONS = ("isolated", "blocks", "profiler", "sampling_2_step", "sampling_12_step")
MEMORY_SECTION = "memory"  # only with --memory-at; runs last (past the int32 line stock's attention may fault)
ATTENTION_ONLY = "attention_only"  # --peer-table's strided NHD variant on the attention-only block path
WEIGHT_SEED = 0  # the random weights'; the random text states' is the next
REFERENCE_COPY = Path(__file__).resolve().parent / "reference" / "gb10-strided-nhd-results.json"
# --first-contact: packed tokens -> the clip packing them (width, height, frames, text tokens); the free GPU memory
# 2 full-width blocks at that length need, with room (short of it stock's attention can fall back to a slower kernel)
FIRST_CONTACT_SHAPES = {37810: (1344, 768, 124, 100), 8192: (992, 480, 56, 101)}
FIRST_CONTACT_NEEDS = {37810: 14 * 2**30, 8192: 7 * 2**30}
FULL_MODEL_FREE = 80 * 2**30  # the 50-block model (38 GB in bf16) and its activations at 37,810 tokens
# --first-contact's formats past bf16 and int8_convrot: fp8 scaled and W4A8, where this comfy-kitchen has the layout
FIRST_CONTACT_KITCHEN_FORMATS = ("float8_e4m3fn", "asym_w4a8_int8")

# The reference report's keys each section makes (a run is checked only for the sections it was asked for)
REFERENCE_KEYS_BY_SECTION = {
    "isolated": ("isolated_attention_layout", "validation.isolated_attention", "dataflow.removed_copies_per_block"),
    "blocks": ("real_block_results", "validation.blocks_0_24_49"),
    "profiler": ("nsight_block_recapture",),
    "sampling_2_step": ("sampling_2_step", "validation.full_50_block_two_step_trajectory"),
    "sampling_12_step": ("sampling_12_step", "validation.canonical_12_step_trajectory"),
}


def timed_blocks(n_blocks: int) -> list[int]:
    return sorted({0, (n_blocks - 1) // 2, n_blocks - 1})


def validation_names(n_blocks: int) -> dict[str, str]:
    """Reference validation item -> this run's name for it: the blocks compared, the blocks sampled."""
    return {"blocks_0_24_49": "blocks_" + "_".join(str(b) for b in timed_blocks(n_blocks)),
            "full_50_block_two_step_trajectory": f"full_{n_blocks}_block_two_step_trajectory"}


def reference_for(data: dict, reference: dict) -> dict:
    """The reference cut to the sections the run was asked for, its validation items named as the run names them."""
    ref = copy.deepcopy(reference)
    asked = data.get("sections_requested", SECTIONS)
    for key in [k for section, keys in REFERENCE_KEYS_BY_SECTION.items() if section not in asked for k in keys]:
        parent, _, last = key.rpartition(".")  # a top-level key, or one a level down
        (ref[parent] if parent else ref).pop(last, None)
    n_blocks = (data.get("model") or {}).get("blocks")
    if n_blocks and "validation" in ref:
        names = validation_names(n_blocks)
        ref["validation"] = {names.get(k, k): v for k, v in ref["validation"].items()}
    return ref


def first_contact_plan(free_bytes: int | None) -> dict:
    """What ``--first-contact`` runs given the CUDA GPU's free bytes (None: no GPU): the block job at each length
    that fits (and the full model past FULL_MODEL_FREE); where none fits, the CPU job; ``why``: the memory."""
    free = free_bytes or 0
    lengths = [t for t, need in FIRST_CONTACT_NEEDS.items() if need <= free]
    out = ", ".join(f"{t:,} tokens need {n / 2**30:.0f} GiB" for t, n in FIRST_CONTACT_NEEDS.items() if n > free)
    why = "no CUDA GPU" if free_bytes is None else f"{free_bytes / 2**30:.1f} GiB free" + (out and f"; {out}")
    if lengths:  # bf16, int8_convrot, then the kitchen formats whose layout this comfy-kitchen has
        import comfy_kitchen.tensor as ckt

        formats = list(h3_model.WEIGHT_FORMATS) + [f for f in FIRST_CONTACT_KITCHEN_FORMATS
                                                   if hasattr(ckt, h3_model.KITCHEN_FORMATS[f][0])]
    return {"job": "blocks" if lengths else "tiny_cpu", "why": why, "free_bytes": free_bytes, "lengths": lengths,
            "formats": formats if lengths else ["bf16"], "blocks": 2,
            "full_model": bool(lengths) and free_bytes > FULL_MODEL_FREE}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.h3_reference_run",
                                description="MiniMax H3 reference run: stock vs HND vs strided NHD attention.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/h3-<device>-<backend>.json)")
    p.add_argument("--layout", choices=("ab",) + LAYOUTS, help="layouts to measure (default: ab)")
    p.add_argument("--backend", default="auto", choices=pack_kernels().BACKEND_CHOICES)
    p.add_argument("--checkpoint", help="H3 diffusion-model checkpoint (default: random full-size weights)")
    p.add_argument("--weights", choices=h3_model.WEIGHT_FORMATS + FIRST_CONTACT_KITCHEN_FORMATS, default="bf16",
                   help="random model only: the linears' format")
    p.add_argument("--comfyui", help="ComfyUI source tree (default: $COMFYUI_PATH, else ./.comfyui)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a narrow H3 of a few blocks at 64x64x5 (tests, CPU)")
    p.add_argument("--blocks", type=int, help="random model only: this many DiT blocks instead of the config's")
    for name in ("width", "height", "frames", "text_tokens"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int)
    p.add_argument("--seed", type=int, default=440420, help="noise seed (the reference's)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list ({MEMORY_SECTION}: see --memory-at)")
    p.add_argument("--compile-blocks", action="store_true", help="also time block 0 under torch.compile")
    p.add_argument("--reps", type=int, default=9, help="timed reps per block and variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attention-reps", type=int, default=10)
    p.add_argument("--reps-2-step", type=int, default=2, help="2-step runs per layout (2 = ABBA)")
    p.add_argument("--reps-12-step", type=int, default=1, help="12-step runs per layout (2 = ABBA)")
    p.add_argument("--no-stock", action="store_true", help="leave stock ComfyUI out of blocks, profiler and memory")
    p.add_argument("--stock-sampling", action="store_true", help="also sample stock and the extra variants")
    p.add_argument("--memory-at", type=int, metavar="TOKENS",
                   help="adds the memory section: each variant's peak memory in one block at about TOKENS")
    p.add_argument("--kjnodes", type=Path, metavar="DIR", help="a ComfyUI-KJNodes checkout: adds the peer's variants")
    p.add_argument("--peer-table", action="store_true", help=f"stock, strided_nhd, {ATTENTION_ONLY} and the peer")
    p.add_argument("--first-contact", action="store_true", help="the README's first command: picks its own run")
    args = p.parse_args(argv)
    args.first_contact_plan = None
    if args.first_contact:
        apply_first_contact(p, args)
    check_options(p, args)
    shape = (64, 64, 5, 8) if args.tiny else (1344, 768, 124, 100)
    for name, default in zip(("width", "height", "frames", "text_tokens"), shape):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def apply_first_contact(parser, args) -> None:
    if args.checkpoint or args.peer_table or args.kjnodes:
        parser.error("--first-contact picks its own run: leave out --checkpoint, --peer-table, --kjnodes")
    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    plan = args.first_contact_plan = first_contact_plan(torch.cuda.mem_get_info(args.device)[0] if cuda else None)
    if plan["job"] == "blocks":
        args.layout, args.blocks, args.sections, args.weights = "strided_nhd", plan["blocks"], "", plan["formats"][0]
    else:  # the main job as it ran on the CPU before this option: a tiny H3 sampled, stock and both layouts
        args.tiny, args.device, args.sections, args.stock_sampling = True, "cpu", "sampling_2_step", True


def check_options(parser, args) -> None:
    """The layout, the sections, --peer-table's variant and --kjnodes' checkout; the extras sample with stock."""
    args.layout = args.layout or ("strided_nhd" if args.peer_table else "ab")  # --peer-table: its one layout
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS + (MEMORY_SECTION,)]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS + (MEMORY_SECTION,))}")
    if args.memory_at is not None:
        if args.memory_at <= 0:
            parser.error(f"--memory-at {args.memory_at}: expected a positive token count")
        args.sections += [] if MEMORY_SECTION in args.sections else [MEMORY_SECTION]
    elif MEMORY_SECTION in args.sections:
        parser.error(f"section {MEMORY_SECTION} needs --memory-at TOKENS")
    args.variants = {}  # the node's variants past the layouts: name -> its settings
    if args.peer_table:
        if args.no_stock:
            parser.error("--peer-table compares with stock: leave out --no-stock")
        args.variants[ATTENTION_ONLY] = {"layout": "strided_nhd", "backend": args.backend, "block_path": ATTENTION_ONLY}
        args.stock_sampling = True
    if args.kjnodes is not None:
        try:
            peer.check_checkout(args.kjnodes)
        except FileNotFoundError as exc:
            parser.error(f"--kjnodes: {exc}")
    args.peer_variants = list(peer.VARIANTS) if args.kjnodes is not None else []
    args.sampled_extras = list(args.variants) + args.peer_variants if args.stock_sampling else []


def log(message: str) -> None:
    print(f"[h3-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def resolve_backend(rows: list[dict], choice: str) -> str:
    """The back-end ``choice`` (``auto``: the first available of ``rows``; sdpa always is) runs first here."""
    if choice == "auto":
        return next(row["name"] for row in rows if row["available"])
    row = next(r for r in rows if r["name"] == choice)
    if not row["available"]:
        log(f"requested back-end {choice} is not available here ({row['reason']}); the chain will fall back")
    return choice


def build_bench(args, device, layouts, report) -> sec.Bench:
    """The model (a checkpoint, or random weights), stock's and every variant's patched clone, the conditioning."""
    started = time.perf_counter()
    if args.checkpoint:
        log(f"loading {args.checkpoint}")
        base = h3_model.load_checkpoint_model(args.checkpoint)
        config, source = h3_model.model_config_of(base), f"checkpoint {args.checkpoint}"
    else:
        config = dict(h3_model.TINY_H3 if args.tiny else h3_model.FULL_H3)
        if args.blocks:
            config["num_layers"] = args.blocks
        log(f"building {'tiny' if args.tiny else 'full-size'} H3 with random {args.weights} weights on {device}")
        base = h3_model.build_model(config, device, torch.bfloat16, WEIGHT_SEED, args.weights)
        source = f"random {args.weights} weights (seed {WEIGHT_SEED}, N(0, 1/fan_in), norms 1, biases 0)"
    build_seconds = time.perf_counter() - started
    dm = base.model.diffusion_model
    expected = h3_model.packed_token_count(args.width, args.height, args.frames, args.text_tokens)
    specs = {**{layout: {"layout": layout, "backend": args.backend} for layout in layouts}, **args.variants}
    clones, patches, settings = {}, {}, {}
    for name, spec in specs.items():
        # no peak per model call: it would reset the device's peak statistics, which sampling reads over the run
        chosen = submodule("nodes.patch").Settings(measure_peak=False, **spec)
        clones[name], patches[name] = submodule("nodes.h3_patch").patch_model(base, chosen)
        settings[name] = dataclasses.asdict(chosen)
    extras = {name: clones.pop(name) for name in list(clones) if name not in layouts}
    if args.kjnodes is not None:  # KJNodes' variants, made by its nodes' ``execute`` on the stock model
        import comfy.ldm.minimax.model as h3

        module = peer.load_module(args.kjnodes)
        applied = {}
        for name, nodes in peer.VARIANTS.items():
            extras[name], applied[name] = peer.make_variant(module, base, nodes)
            settings[name] = {"peer": applied[name]}
        facts = peer.describe(args.kjnodes, module, h3.optimized_attention)
        report.update(peer=dict(facts, variants=applied))
        chains = ", ".join(f"{name} = {' + '.join(a['node'] for a in nodes)}" for name, nodes in applied.items())
        log(f"peer: {facts['checkout']}/{facts['file']} (commit {facts['git_commit'] or 'unknown'}), its attention "
            f"{facts['attention']}; variants {chains}")
    static = {k: v for k, v in patches[layouts[0]].report.static.items() if k != "layout"}
    report.update(
        model={"source": source, "class": type(dm).__name__, "blocks": len(dm.blocks), "config": config,
               "dtype": str(dm.dtype), "parameters": sum(p.numel() for p in dm.parameters()),
               "build_seconds": build_seconds},
        weights=None if args.checkpoint else args.weights, text_tokens=args.text_tokens,
        packed_rows_expected=expected, variant_settings=settings,
        patch=dict(static, function="nodes.h3_patch.patch_model", patch_refiner=True),
        dataflow={"qkv_input": "projection-strided NHD views with no Q/K/V materialization",
                  "qk_transform": "in-place Comfy Kitchen RMSNorm and RoPE on strided views",
                  "attention_output": "contiguous back-end NHD output viewed token-major for out_proj",
                  "removed_copies_per_block": None})
    log(f"model ready in {build_seconds:.1f} s: {len(dm.blocks)} blocks, blocks timed {timed_blocks(len(dm.blocks))}, "
        f"expected packed tokens {expected['total']}")
    conditioning = h3_model.random_conditioning(args.text_tokens, config["text_dim"], WEIGHT_SEED + 1)
    return sec.Bench(device=device, base=base, clones=clones, patches=patches, extras=extras,
                     conditioning=conditioning, width=args.width, height=args.height, frames=args.frames,
                     seed=args.seed, block_indices=timed_blocks(len(dm.blocks)), log=log, peer=list(args.peer_variants))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    facts = device_facts(device)
    # ComfyUI is imported after its flags are set; the stock flag needs the resolved back-end
    backends_here = describe_backends(device)
    backend_first = resolve_backend(backends_here, args.backend)
    slug = facts["device"].split("(")[0].strip().lower().replace("nvidia ", "").replace(" ", "-") or "device"
    out = args.out or Path("benchmarks/results") / f"h3-{slug}-{backend_first}.json"
    report = Report(out)
    layouts = list(LAYOUTS) if args.layout == "ab" else [args.layout]
    report.update(**facts, torch=str(torch.__version__), attention=backend_first, attention_requested=args.backend,
                  resolution=[args.width, args.height], frames=args.frames, packed_tokens=None, seed=args.seed,
                  layout=args.layout, layouts_measured=layouts, sections_requested=list(args.sections),
                  backends_here=backends_here, comfy_kitchen=pack_kernels().kitchen_release_status(device))
    plan = args.first_contact_plan
    if plan:
        report.update(first_contact=plan)
        log(f"first contact: the {plan['job']} job ({plan['why']})")
    log(f"{facts['device']} ({facts['compute_capability']}), torch {torch.__version__}, back-end {args.backend} "
        f"-> {backend_first}, layouts {layouts}, sections {args.sections}; writing {out}")
    try:
        root = comfy_host.find_comfyui(args.comfyui)
        flags = comfy_host.import_comfyui(root, cpu=device.type == "cpu",
                                          stock_flag=comfy_host.STOCK_FLAG_FOR_BACKEND[backend_first])
        report.update(comfyui={"path": str(root), "version": comfy_host.comfyui_version(root), "flags": flags},
                      stock_attention=comfy_host.stock_attention_name())
        bench = build_bench(args, device, layouts, report)
    except Exception as exc:
        report.fail("setup", exc)
        log(f"setup failed: {type(exc).__name__}: {exc}")
        raise
    try:
        if plan and plan["job"] == "blocks":
            bench = run_first_contact(args, bench, report)
        else:
            run_sections(args, bench, backend_first, report)
    finally:
        finish(args, bench, report, out)
    return 1 if report.data["errors"] else 0


def _section(report: Report, name: str, fn):
    """Run one section; record its result or its error (never taking the others down)."""
    log(f"section {name}")
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            result = fn()
    except Exception as exc:
        log(f"section {name} FAILED: {type(exc).__name__}: {exc}")
        report.fail(name, exc)
        torch.cuda.empty_cache()  # a no-op where CUDA never started
        return None
    report.section(name, result)
    log(f"section {name} done in {time.perf_counter() - started:.1f} s")
    return result


def run_sections(args, bench: sec.Bench, backend: str, report: Report) -> None:
    """The sections asked for, in order, each followed by its validation items."""
    with_stock = not args.no_stock
    if _section(report, "capture", lambda: sec.capture_block_inputs(bench)) is None:
        return
    expected = report.data["packed_rows_expected"]["total"]
    names = validation_names(len(bench.diffusion_model.blocks))
    report.update(packed_tokens=bench.packed_tokens)
    report.validation("packed_tokens", f"{bench.packed_tokens} as expected" if bench.packed_tokens == expected
                      else f"{bench.packed_tokens}, expected {expected}")
    if "isolated" in args.sections:
        iso = _section(report, "isolated_attention_layout",
                       lambda: sec.isolated_attention(bench, args.backend, args.attention_reps, args.warmup))
        if iso:
            report.validation("isolated_attention", equality_verdict(iso))
            copies = {layout: record["copies"] for layout, record in iso["records"].items()}
            report.data["dataflow"]["removed_copies_per_block"] = copies["hnd"] - copies["strided_nhd"]
    if bench.peer:
        report.validation("peer_attention", peer_kernel_verdict(report.data, backend))
    if "blocks" in args.sections:
        sec.ensure_stock_loaded(bench)
        rows = _section(report, "real_block_results",
                        lambda: sec.real_blocks(bench, args.reps, args.warmup, with_stock))
        if rows:
            report.validation(names["blocks_0_24_49"], sec.blocks_verdict(rows))
            report.validation("blocks_compared", ", ".join(str(r["block"]) for r in rows))
            for name in bench.variants(with_stock=False) if with_stock else ():
                report.validation(f"blocks_stock_vs_{name}", sec.blocks_verdict(rows, f"stock_vs_{name}_"))
    if args.compile_blocks:
        sec.ensure_stock_loaded(bench)
        _section(report, "compiled_block_results", lambda: sec.real_blocks(
            bench, args.reps, max(args.warmup, 2), True, compiled_variants=("stock", *bench.layouts)))
    if "profiler" in args.sections:
        sec.ensure_stock_loaded(bench)
        _section(report, "profiler_block_recapture", lambda: sec.kernel_launches(bench, with_stock))
    sampled = ((2, args.reps_2_step, "sampling_2_step", names["full_50_block_two_step_trajectory"]),
               (12, args.reps_12_step, "sampling_12_step", "canonical_12_step_trajectory"))
    extras = args.sampled_extras
    for steps, reps, key, item in [s for s in sampled if s[2] in args.sections]:
        result = _section(report, key, lambda: sec.sampling(bench, steps, reps, args.stock_sampling, extras))
        if not result:
            continue
        report.validation(item, sec.sampling_verdict(result))
        repeats = [r.get("repeat_identical") for r in result["runs"] if "repeat_identical" in r]
        if repeats:
            report.validation(f"{key}_repeat_runs", "identical" if all(repeats) else "differ between repeats")
        for name in [n for n in dict.fromkeys(result["order"]) if n != "stock"] if args.stock_sampling else ():
            report.validation(f"{key}_stock_vs_{name}", sec.sampling_verdict(result, name))
    if MEMORY_SECTION in args.sections:  # last: past the int32 line stock's attention may fault the device
        _section(report, "peak_memory_long_sequence", lambda: sec.peak_memory_at(bench, args.memory_at, with_stock))


def run_first_contact(args, bench: sec.Bench, report: Report) -> sec.Bench:
    """--first-contact's block job: section ``first_contact_<weights>_<tokens>`` each; returns the last bench."""
    for weights in args.first_contact_plan["formats"]:
        if weights != args.weights:  # the next format's model, built where the last one was
            device, layouts = bench.device, bench.layouts
            release(bench)
            bench = build_bench(argparse.Namespace(**dict(vars(args), weights=weights)), device, layouts, report)
        for tokens in args.first_contact_plan["lengths"]:
            _section(report, f"first_contact_{weights}_{tokens}",
                     lambda w=weights, t=tokens, b=bench: first_contact_blocks(args, b, w, t))
    return bench


def first_contact_blocks(args, bench: sec.Bench, weights: str, tokens: int) -> dict:
    """Blocks 0 and 1 at ``tokens`` (FIRST_CONTACT_SHAPES' clip): stock and the pack interleaved, compared."""
    bench.width, bench.height, bench.frames, text = FIRST_CONTACT_SHAPES[tokens]
    bench.conditioning = h3_model.random_conditioning(text, bench.diffusion_model.condition_proj.in_features,
                                                      WEIGHT_SEED + 1)
    bench.block_inputs.clear()
    sec.capture_block_inputs(bench)
    rows = sec.real_blocks(bench, args.reps, args.warmup, True)
    pack = sec.main_variant(bench)
    payload = last_payload(bench.patches[pack].report) or {}
    return {"weights": weights, "tokens_asked": tokens, "packed_tokens": bench.packed_tokens, "pack": pack,
            "width_height_frames_text": FIRST_CONTACT_SHAPES[tokens], "blocks": rows,
            "pack_ran": backends_that_ran(bench.patches)[2].get(pack, "none"),
            "int8_own_quantizer_calls": payload.get("int8_own_quantizer_calls", 0),
            "int8_stock_quantizer": payload.get("int8_stock_quantizer", [])}


def peer_kernel_verdict(data: dict, backend: str) -> str:
    """Whether the peer's numbers stand beside the pack's: it runs stock's kernel, which must be the pack's."""
    facts, stock = data["peer"], data.get("stock_attention", "?")
    flag = comfy_host.STOCK_FLAG_FOR_BACKEND.get(backend)
    if not facts["same_attention_as_stock"]:
        return f"NOT comparable: the peer calls {facts['attention']}, stock ComfyUI {stock}"
    if flag is None:
        return (f"NOT comparable: the pack runs {backend}, which stock ComfyUI has no flag for; "
                f"the peer and stock call {stock}")
    return f"same kernel: the peer and stock call {stock} (--{flag.replace('_', '-')}), the pack runs {backend}"


def finish(args, bench: sec.Bench, report: Report, out: Path) -> None:
    """What ran per variant, the shared model left unpatched, every output finite; the report written and printed."""
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
    data["source_artifacts"] = [str(out)]
    blocks_job = (args.first_contact_plan or {}).get("job") == "blocks"
    if REFERENCE_COPY.is_file() and not blocks_job:  # the block job's sections are its own
        problems = check_against_reference(data, reference_for(data, load_reference(REFERENCE_COPY)),
                                           allow_null=CUDA_ONLY if args.device == "cpu" else set())
        data["reference_schema"] = "follows the reference report's keys and types" if not problems else problems
    report.write()
    release(bench)
    print()
    if blocks_job:
        print(first_contact_table(data))
    elif args.device == "cpu":
        # a CPU proves the dataflow (same latents, which kernel ran), not the pack's speed
        print(correctness_table(data))
        print("(CPU run: timings in the report are not the pack's speed; GPU results are in docs/BENCHMARKS.md)")
    else:
        print("\n\n".join(t for t in (text_table(data), results_table.run_tables(data, out.stem)) if t))
    if data["errors"]:
        print("errors in: " + ", ".join(data["errors"]))
    print(f"report: {out}")


def last_payload(report):
    """The node's report of the clone's last sampling run, or in a blocks-only run of the calls made outside one."""
    last = getattr(report, "last", None)
    return report.payload() if last is None and report.calls else last


def backends_that_ran(patches: dict) -> tuple[str, list, dict]:
    """Back-ends the patched forwards ran (the node's own run reports), their fallbacks, and those per variant."""
    payloads = {name: p for name, patch in patches.items() if (p := last_payload(patch.report)) is not None}
    by_variant, fallbacks = {}, []
    for name, payload in payloads.items():
        by_variant[name] = "+".join(f"{b} x{n}" for b, n in sorted(payload["backends_ran"].items())) or "none"
        for run in payload["prepared"]:
            by_variant[name] += f" [prepared path: {run['backend']} {run['mode']} x{run['calls']}]"
        fallbacks += payload["fallbacks"]
    ran = sorted({b for p in payloads.values() for b in p["backends_ran"]})
    return "+".join(ran) or "none", fallbacks, by_variant


def release(bench: sec.Bench) -> None:
    """Drop the model while ComfyUI's modules are alive (ModelPatcher.__del__ needs them)."""
    import comfy.model_management as mm

    mm.current_loaded_models.clear()
    bench.clones.clear()
    bench.patches.clear()
    bench.block_inputs.clear()
    bench.base = None
    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
