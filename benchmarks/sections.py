"""The measurements of the H3 reference run, one function per report section, each taking the :class:`Bench`.
Variants: ``stock``, the layouts ``hnd`` and ``strided_nhd`` (the node's patch), the extras (the peer's, KJNodes')."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from devkit.aimdo_emulation import object_patches_applied
from devkit.comfy import SAMPLER, SCHEDULER, custom_sampling, on_each_step
from devkit.h3 import packed_token_count

from . import measure
from .isolated_attention import compare_layouts
from .step_timeline import profile_kernels

PROFILED_CALLS = 3  # profiled block calls per variant: kernel counts and times are per call
LATENT = "EmptyMiniMaxH3LatentAV (comfy_extras.nodes_minimax_h3)"  # every latent's node, as the reports name it


@dataclass
class Bench:
    device: torch.device
    base: object                      # the unpatched ModelPatcher (stock)
    clones: dict[str, object]         # layout -> patched ModelPatcher clone
    patches: dict[str, object]        # variant -> the installed patch (nodes.patch.InstalledPatch, its RunReport)
    conditioning: list
    width: int
    height: int
    frames: int
    seed: int
    block_indices: list[int]
    log: Callable[[str], None] = print
    block_inputs: dict[int, tuple] = field(default_factory=dict)
    packed_tokens: int | None = None
    sampling_warmed: bool = False
    outputs_finite: dict[str, bool] = field(default_factory=dict)
    extras: dict[str, object] = field(default_factory=dict)   # name -> patched clone of other settings
    peer: list[str] = field(default_factory=list)             # the extras that are the peer's (KJNodes)
    compiled_blocks: dict[str, object] = field(default_factory=dict)  # variant -> its torch.compile'd block

    @property
    def layouts(self) -> list[str]:
        return list(self.clones)

    @property
    def diffusion_model(self):
        return self.base.model.diffusion_model

    def variants(self, with_stock: bool) -> dict[str, object]:
        return {**({"stock": self.base} if with_stock else {}), **self.clones, **self.extras}


def patches_left_behind(diffusion_model) -> list[str]:
    """Modules whose forward is still replaced on the shared model (ComfyUI restores an object patch by setting
    the saved original back, so only a bound ``forward`` that is not the class's own counts)."""
    return [name for name, module in diffusion_model.named_modules()
            if (forward := vars(module).get("forward")) is not None
            and getattr(forward, "__func__", None) is not type(module).forward]


def ensure_stock_loaded(bench: Bench) -> None:
    """Make ComfyUI hold the unpatched model, so no sampling clone's patches stay applied."""
    import comfy.model_management as mm

    mm.load_models_gpu([bench.base], force_full_load=True)


def empty_av_latent(bench: Bench, shape: tuple[int, int, int] | None = None) -> dict:
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    return EmptyMiniMaxH3LatentAV.execute(*(shape or (bench.width, bench.height, bench.frames)))[0]


class _Captured(Exception):
    """Raised by the last capture hook when the forward is to stop there."""


def stock_block_inputs(bench: Bench, shape, indices: list[int], stop: bool = False) -> tuple[dict, float, tuple]:
    """``({block: (x, t_emb, segments, rope)}, seconds, outputs)`` of one stock forward at ``shape`` (width, height,
    frames; None: the benchmark's). ``stop``: end at the last block wanted (no stock block then runs at a length
    where int32 offsets may overflow and fault the device)."""
    ensure_stock_loaded(bench)
    dm = bench.diffusion_model
    latent = empty_av_latent(bench, shape)["samples"]
    gen = torch.Generator().manual_seed(bench.seed)
    video, audio = (torch.randn(t.shape, generator=gen).to(bench.device) for t in latent.unbind())
    context = bench.conditioning[0][0].to(bench.device, dtype=dm.dtype)
    kept = {}

    def keep(index, args):
        x, t_emb, segments, rope = args[:4]
        kept[index] = (x.clone(), t_emb, segments, rope)  # blocks update x in place
        if stop and len(kept) == len(indices):
            raise _Captured

    hooks = [dm.blocks[i].register_forward_pre_hook(lambda m, a, k, i=i: keep(i, a), with_kwargs=True)
             for i in indices]
    try:
        seconds, out = measure.timed(lambda: dm(x=[video, audio], timestep=torch.tensor([1000.0], device=bench.device),
                                                context=context, transformer_options={}, minimax_payload={}),
                                     bench.device)
    except _Captured:
        seconds, out = None, None
    finally:
        for h in hooks:
            h.remove()
    return kept, seconds, out


def capture_block_inputs(bench: Bench) -> dict:
    """One stock forward at the benchmark shape: the timed blocks' inputs are real activations, the same for all."""
    kept, seconds, out = stock_block_inputs(bench, None, bench.block_indices)
    bench.block_inputs.update(kept)
    bench.packed_tokens = int(bench.block_inputs[bench.block_indices[0]][0].shape[0])
    bench.outputs_finite["stock forward"] = measure.all_finite(*out)
    return {"seconds": seconds, "packed_tokens": bench.packed_tokens, "latent": LATENT,
            "outputs_finite": bench.outputs_finite["stock forward"]}


def _block_call(bench: Bench, patcher, index: int, inputs: tuple | None = None, compiled: str | None = None):
    """``run(meter)``: one forward of block ``index`` with ``patcher``'s patches on a fresh copy of its input (made
    before the meter starts), measured by ``meter(fn, device)``; ``compiled``: the variant's name (torch.compile)."""
    x0, t_emb, segments, rope = inputs or bench.block_inputs[index]
    transformer_options = patcher.model_options.get("transformer_options", {})

    def run(meter=measure.timed):
        with object_patches_applied(patcher):
            block = patcher.model.diffusion_model.blocks[index]
            if compiled is not None and compiled not in bench.compiled_blocks:
                torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
                bench.compiled_blocks[compiled] = torch.compile(block)
            block = bench.compiled_blocks[compiled] if compiled is not None else block
            x = x0.clone()  # blocks update their input in place
            return meter(lambda: block(x, t_emb, segments, rope, transformer_options=transformer_options),
                         bench.device)
    return run


def isolated_attention(bench: Bench, backend: str, reps: int, warmup: int) -> dict:
    """Block 0's attention alone, both layouts, on a random fused qkv buffer with its rope table and norm weights."""
    attn = bench.diffusion_model.blocks[0].attn
    gen = torch.Generator().manual_seed(bench.seed)
    qkv = torch.randn(bench.packed_tokens, 3 * attn.heads * attn.head_dim, generator=gen)
    norm = {"rope_table": bench.block_inputs[bench.block_indices[0]][3], "q_weight": attn.q_norm.weight,
            "k_weight": attn.k_norm.weight, "eps": attn.q_norm.eps}
    result = compare_layouts(qkv.to(bench.device, dtype=attn.qkv_proj.weight.dtype), norm, attn.heads,
                             attn.head_dim, backend, bench.device, reps, warmup,
                             progress=lambda m: bench.log(f"  isolated attention {m}"))
    return dict(result, what="kernels.attention_from_fused_qkv on a [S, 3*H*D] buffer: in-place RMSNorm+RoPE, "
                             "layout (views or copies), back-end, token-major output")


def real_blocks(bench: Bench, reps: int, warmup: int, with_stock: bool, compiled_variants=None) -> list[dict]:
    """p50 of each variant on the timed blocks, interleaved rep by rep; outputs compared. ``compiled_variants``:
    only those, block 0 only, under torch.compile (as ComfyUI's TorchCompileModel; it compiles in the warm-up)."""
    variants = bench.variants(with_stock)
    if compiled_variants is not None:
        variants = {n: p for n, p in variants.items() if n in compiled_variants}
    indices = bench.block_indices if compiled_variants is None else bench.block_indices[:1]
    results = []
    for index in indices:
        bench.log(f"  block {index}: {', '.join(variants)}{' (torch.compile)' if compiled_variants else ''}")
        runners = {name: _block_call(bench, p, index, compiled=name if compiled_variants else None)
                   for name, p in variants.items()}
        times = measure.interleaved_times({n: (lambda r=r: r()[0]) for n, r in runners.items()}, reps, warmup,
                                          progress=lambda m: bench.log(f"    {m}"))
        row, outputs, peaks = {"block": index}, {}, {}
        for name, t in times.items():
            stats = measure.summary(t)
            row[f"{name}_p50_seconds"], row[f"{name}_spread"] = stats["p50_seconds"], stats["spread"]
        for name, run in runners.items():
            peaks[name], outputs[name] = run(measure.peak_extra_bytes)
            bench.outputs_finite[f"block {index} {name}"] = measure.all_finite(outputs[name])
        row["peak_extra_bytes"] = peaks
        if "hnd" in outputs and "strided_nhd" in outputs:
            diff = measure.max_abs_difference(outputs["hnd"], outputs["strided_nhd"])
            row["speedup"] = measure.speedup(row["hnd_p50_seconds"], row["strided_nhd_p50_seconds"])
            row["max_abs_difference"], row["bit_exact"] = diff["max_abs_difference"], diff["bit_exact"]
        for name in [n for n in outputs if n != "stock" and "stock" in outputs]:
            diff = measure.max_abs_difference(outputs["stock"], outputs[name])
            for key in ("max_abs_difference", "bit_exact", "relative_l2"):
                row[f"stock_vs_{name}_{key}"] = diff[key]
            row[f"stock_over_{name}"] = measure.speedup(row["stock_p50_seconds"], row[f"{name}_p50_seconds"])
        results.append(dict(row, reps=reps))
    return results


def kernel_launches(bench: Bench, with_stock: bool) -> dict:
    """CUDA kernels one forward of block 0 launches per variant (torch.profiler), layout copies counted."""
    index = bench.block_indices[0]
    x0, t_emb, segments, rope = bench.block_inputs[index]
    attn = bench.diffusion_model.blocks[index].attn
    large = x0.shape[0] * attn.heads * attn.head_dim

    def profiled(patcher) -> dict:
        options = patcher.model_options.get("transformer_options", {})
        with object_patches_applied(patcher):
            block = patcher.model.diffusion_model.blocks[index]
            inputs = [x0.clone() for _ in range(PROFILED_CALLS + 1)]  # the warm call's and the profiled calls'
            return profile_kernels(lambda: block(inputs.pop(), t_emb, segments, rope, transformer_options=options),
                                   bench.device, large, calls=PROFILED_CALLS)

    counts = {name: profiled(p) for name, p in bench.variants(with_stock).items()}
    result = {"tool": f"torch.profiler (torch {torch.__version__})", "block": index,
              "large_copy_threshold_elements": large, "profiled_calls": PROFILED_CALLS}
    for name, c in counts.items():
        result[f"{name}_kernel_launches"] = c["kernel_launches"]
        bench.log(f"  {name}: {c['kernel_launches']} kernels, {c['large_copy_ops']} large copies, ms {c['kernel_ms']}")
    result["large_copy_ops"] = {n: c["large_copy_ops"] for n, c in counts.items()}
    if "hnd" in counts and "strided_nhd" in counts:
        h, s = counts["hnd"]["kernel_launches"], counts["strided_nhd"]["kernel_launches"]
        result["removed_kernel_launches"] = None if h is None else h - s
        removed = counts["hnd"]["kernels"] - counts["strided_nhd"]["kernels"]
        result["removed_kernels"] = ", ".join(f"{n} x{c}" for n, c in sorted(removed.items())) or "none"
        result["large_bf16_layout_copy_instances_after"] = counts["strided_nhd"]["large_copy_ops"]
    result["kernel_ms_by_family"] = {n: c["kernel_ms"] for n, c in counts.items()}
    return result


def sampling_order(layouts: list[str], reps: int) -> list[str]:
    """HND first, then ABBA: each pair of reps cancels a linear drift (one rep penalises the second, strided NHD)."""
    return [name for rep in range(reps) for name in (layouts if rep % 2 == 0 else layouts[::-1])]


def run_sampling(bench: Bench, patcher, steps: int, label: str, quiet=False) -> tuple[dict, tuple]:
    """One sampling run through ComfyUI's nodes, as the bundled workflows wire them."""
    import comfy.model_management as mm

    sample = custom_sampling(patcher, bench.conditioning, empty_av_latent(bench), bench.seed, steps)
    mm.load_models_gpu([patcher], force_full_load=True)  # swap patches in before the clock starts
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(bench.device)
    step_ends = []
    start = time.perf_counter()

    def progress(value, total):
        step_ends.append(time.perf_counter())
        if not quiet:
            bench.log(f"    {label}: step {value}/{total} at {step_ends[-1] - start:.2f} s")

    with on_each_step(progress):
        seconds, out = measure.timed(sample, bench.device)
    video, audio = out["samples"].unbind()
    run = {"seconds": seconds, "checksums": [float(video.float().sum()), float(audio.float().sum())],
           "step_end_seconds": [t - start for t in step_ends], "finite": measure.all_finite(video, audio)}
    if bench.device.type == "cuda":
        run["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(bench.device))
        run["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(bench.device))
    return run, (video, audio)


def main_variant(bench: Bench) -> str:
    return "strided_nhd" if "strided_nhd" in bench.layouts else bench.layouts[0]


def sampling(bench: Bench, steps: int, reps: int, with_stock: bool, extras: list[str] = ()) -> dict:
    """``steps``-step sampling of the layouts, ``extras`` and stock in ABBA order; seconds, checksums, peaks."""
    sampled = bench.layouts + list(extras) + (["stock"] if with_stock else [])
    order = sampling_order(sampled, reps)  # stock interleaved with the rest, so ratios to it hold too
    every = bench.variants(with_stock=True)
    variants = {name: every[name] for name in sampled}
    if not bench.sampling_warmed:  # one untimed 1-step run each: one-time costs would fall on the first sampled
        for name, patcher in variants.items():
            started = time.perf_counter()
            run_sampling(bench, patcher, 1, f"warm-up {name}", quiet=True)
            bench.log(f"  warm-up {name}: {time.perf_counter() - started:.2f} s (not counted)")
        bench.sampling_warmed = True
    runs, latents = [], {}
    for i, name in enumerate(order):
        label = f"{steps}-step {name} run {i + 1}/{len(order)}"
        bench.log(f"  {label}")
        run, latent = run_sampling(bench, variants[name], steps, label)
        run["variant"] = name
        runs.append(run)
        bench.log(f"  {label}: {run['seconds']:.2f} s, checksums {run['checksums']}")
        if name in latents:
            run["repeat_identical"] = all(torch.equal(a, b) for a, b in zip(latents[name], latent))
        else:
            latents[name] = latent
        bench.outputs_finite[f"{steps}-step {name}"] = run["finite"]
    result = {"sampler": SAMPLER, "scheduler": SCHEDULER, "steps": steps, "seed": bench.seed,
              "guider": "BasicGuider (one model call per step)",
              "nodes": "RandomNoise, KSamplerSelect, BasicScheduler, BasicGuider, SamplerCustomAdvanced",
              "latent": LATENT, "order": order, "runs": runs}
    for name in dict.fromkeys(order):
        mine = [r for r in runs if r["variant"] == name]
        result[f"{name}_seconds"] = sum(r["seconds"] for r in mine) / len(mine)  # ABBA: the mean cancels drift
        result[f"{name}_checksums"] = mine[0]["checksums"]
        for kind in ("allocated", "reserved") if "peak_allocated_bytes" in mine[0] else ():
            result[f"{name}_peak_{kind}_bytes"] = max(r[f"peak_{kind}_bytes"] for r in mine)
    result["checksums"] = result[f"{main_variant(bench)}_checksums"]
    if "hnd" in latents and "strided_nhd" in latents:
        result["speedup"] = measure.speedup(result["hnd_seconds"], result["strided_nhd_seconds"])
        result["latency_reduction"] = 1.0 - result["strided_nhd_seconds"] / result["hnd_seconds"]
        result["identical_video_and_audio"], result["max_abs_difference"] = _latents_compared(
            latents["hnd"], latents["strided_nhd"])
        for kind in ("allocated", "reserved"):
            hnd, nhd = result.get(f"hnd_peak_{kind}_bytes"), result.get(f"strided_nhd_peak_{kind}_bytes")
            result[f"peak_{kind}_bytes_saved"] = None if hnd is None else hnd - nhd
    for name in [n for n in latents if n != "stock"] if "stock" in latents else []:
        same, diff = _latents_compared(latents["stock"], latents[name])
        result.update({f"stock_vs_{name}_identical": same, f"stock_vs_{name}_max_abs_difference": diff,
                       f"stock_over_{name}": measure.speedup(result["stock_seconds"], result[f"{name}_seconds"])})
    return result


def _latents_compared(a: tuple, b: tuple) -> tuple[bool, dict]:
    diffs = [measure.max_abs_difference(x, y) for x, y in zip(a, b)]
    return all(d["bit_exact"] for d in diffs), {"video": diffs[0]["max_abs_difference"],
                                                "audio": diffs[1]["max_abs_difference"]}


MAX_FRAMES = 3600  # EmptyMiniMaxH3LatentAV's largest length


def frames_for_tokens(tokens: int, width: int, height: int, text_tokens: int) -> tuple[int, dict]:
    """The frame count on H3's 17k+5 grid packing closest to ``tokens`` (the shorter on a tie), and its rows."""
    grid = ((frames, packed_token_count(width, height, frames, text_tokens)) for frames in range(5, MAX_FRAMES + 1, 17))
    return min(grid, key=lambda candidate: abs(candidate[1]["total"] - tokens))  # min keeps the first of a tie


def peak_memory_at(bench: Bench, tokens: int, with_stock: bool = True) -> dict:
    """Peak extra memory of one forward of the first timed block per variant at the frame count closest to
    ``tokens`` (its input from a stock forward stopped there); a warm call, then the measured one."""
    frames, rows = frames_for_tokens(tokens, bench.width, bench.height, bench.conditioning[0][0].shape[1])
    index = bench.block_indices[0]
    kept, _, _ = stock_block_inputs(bench, (bench.width, bench.height, frames), [index], stop=True)
    # the pack's main variant, the peer's, the others, stock last: past 2**31 elements a kernel with int32 offsets
    # may fault, and nothing runs after a fault, so the comparison asked for comes first
    main = main_variant(bench)
    others = [n for n in bench.layouts + list(bench.extras) if n != main and n not in bench.peer]
    order = [main, *bench.peer, *others] + (["stock"] if with_stock else [])
    rows_in = int(kept[index][0].shape[0])
    bench.log(f"  {rows_in} tokens ({bench.width}x{bench.height}x{frames}), block {index}: " + ", ".join(order))
    peaks, errors = _peaks_in_order(bench, order, index, kept[index])
    return {"what": "peak memory allocated above the block's input during one block forward",
            "tokens_asked": tokens, "packed_tokens": rows_in, "packed_rows_expected": rows,
            "resolution": [bench.width, bench.height], "frames": frames,
            "block": index, "order": order, "peak_extra_bytes": peaks, "errors": errors, "pack": main}


def _peaks_in_order(bench: Bench, order: list[str], index: int, inputs: tuple) -> tuple[dict, dict]:
    variants = bench.variants(with_stock=True)
    peaks, errors, lost = {}, {}, None
    for name in order:
        peaks[name] = None
        if lost:
            errors[name] = f"not run: the device failed in {lost}'s call"
            continue
        run = _block_call(bench, variants[name], index, inputs)
        try:
            run()  # warm: one-time allocations (cuBLAS workspace, Triton compiles) stay out of the peak
            peaks[name] = run(measure.peak_extra_bytes)[0]
        except Exception as exc:  # recorded; the other variants are still measured
            errors[name] = f"{type(exc).__name__}: {exc}"
            lost = name if "CUDA error" in str(exc) else None
        peak = peaks[name]
        bench.log(f"    {name}: " + (errors.get(name) or ("-" if peak is None else f"{peak / 2**20:,.0f} MiB")))
    return peaks, errors


def sampling_verdict(result: dict, name: str | None = None) -> str:
    """Whether the sampled latents were the same: HND's and strided NHD's, or with ``name`` stock's and its."""
    if name:
        same, diff = result.get(f"stock_vs_{name}_identical"), result.get(f"stock_vs_{name}_max_abs_difference")
        pair = f"stock {result.get('stock_checksums')} vs {name} {result.get(f'{name}_checksums')}"
    else:
        same, diff = result.get("identical_video_and_audio"), result.get("max_abs_difference")
        pair = f"hnd {result.get('hnd_checksums')} vs strided NHD {result.get('strided_nhd_checksums')}"
    if same is None:
        return "not compared" + ("" if name else " (one layout measured)")
    if same:
        return "identical video and audio checksums"
    return f"differ: video max abs {diff['video']:.6g}, audio max abs {diff['audio']:.6g}; checksums {pair}"


def blocks_verdict(rows: list[dict], prefix: str = "") -> str:
    """Whether the blocks' outputs are bit-exact: HND against strided NHD, or with ``prefix`` stock against one."""
    if not rows or f"{prefix}bit_exact" not in rows[0]:
        return "not compared" + ("" if prefix else " (one layout measured)")
    if all(r[f"{prefix}bit_exact"] for r in rows):
        return "bit-exact"
    return "differ: " + ", ".join(f"block {r['block']} max abs {r[f'{prefix}max_abs_difference']:.6g}" for r in rows)
