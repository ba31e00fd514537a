"""Sequence parallel (Ulysses) H3 on N GPUs of one host vs the strided NHD path on 1 GPU.

    python3 -m benchmarks.sequence_parallel --world 2              # H200s: full H3, 1344x768x124, NCCL
    python3 -m benchmarks.sequence_parallel --world 4
    python3 -m benchmarks.sequence_parallel --world 2 --device cpu --tiny   # CPU smoke test over gloo

One process per rank (torch.multiprocessing spawn, rendezvous on 127.0.0.1). Every rank builds
the same random-weight H3 (same seed, drawn on its own GPU) with ComfyUI's own model code and
patches it twice: the single-GPU baseline (this pack's strided NHD patch, ``--backend``) and the
sequence-parallel clone on top of it (nodes/sequence_parallel.py, same kernel chain).

Sections, each rank in lock step:
1. block: real inputs of one DiT block (captured from a full single-GPU forward at the run's
   shape). Baseline = the block on all S rows on one GPU; sequence parallel = the same block on
   S/N rows per rank with Ulysses attention, timed in the steady state (rows already sharded)
   and once with the first block's scatter and the last block's all-gather included. Max abs
   difference of the full gathered output vs the baseline.
2. sampling: ComfyUI's sampler nodes (RandomNoise, KSamplerSelect, BasicScheduler, BasicGuider,
   SamplerCustomAdvanced), ``--steps`` steps, same seed. Rank 0 samples the baseline alone
   while the other ranks wait; then every rank samples with the sequence-parallel clone.
   Max abs difference of the final video/audio latents, and the speedup.

Results: a short table printed last; the full JSON under ``$OUT`` when set (else under
benchmarks/results/). NVLink SHARP multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as the machines it is meant for require.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import comfy_host, measure
from .h3_model import FULL_H3, TINY_H3, build_random_model, packed_token_count, random_conditioning
from .pack import PACKAGE, _package

DIST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Tiny H3 with 8 heads, so 1, 2, 4 and 8 ranks all split it; head_dim 32 fits a 24-dim rotation.
TINY_SP_H3 = dict(TINY_H3, num_attention_heads=8, attention_head_dim=32, rope_inv_freq_len=4)
TEXT_TOKENS = 100
BLOCK_INDEX = 24


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks = GPUs (must divide 56 for H3: 2, 4, 7, 8)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny H3 (8 heads) for a smoke test")
    p.add_argument("--width", type=int, default=None, help="default 1344 (tiny: 128)")
    p.add_argument("--height", type=int, default=None, help="default 768 (tiny: 64)")
    p.add_argument("--frames", type=int, default=None, help="default 124 (tiny: 5)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--backend", default="auto", help="kernel on every rank (kernels.BACKEND_CHOICES)")
    p.add_argument("--reps", type=int, default=None, help="block reps (default 8 on GPU, 2 on CPU)")
    p.add_argument("--seed", type=int, default=440420)
    p.add_argument("--sections", default="block,sampling")
    p.add_argument("--comfyui", default=None, help="ComfyUI tree (default $COMFYUI_PATH or .comfyui)")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.width = args.width or (128 if tiny else 1344)
    args.height = args.height or (64 if tiny else 768)
    args.frames = args.frames or (5 if tiny else 124)
    args.reps = args.reps or (8 if args.device == "cuda" else 2)
    args.sections = [s for s in args.sections.split(",") if s]
    if args.device == "cuda" and args.world > torch.cuda.device_count():
        p.error(f"--world {args.world} needs {args.world} GPUs; {torch.cuda.device_count()} visible")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[sp] {message}", flush=True)


# --- one rank ------------------------------------------------------------------------------------
def _rank_main(rank: int, world: int, args, port: int, result_dir: str) -> None:
    os.environ.update(DIST_ENV)
    if args.device == "cuda":
        torch.cuda.set_device(rank)  # before ComfyUI is imported: it takes the current device
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = run_rank(rank, world, args, device)
        if rank == 0:
            Path(result_dir, "result.json").write_text(json.dumps(result, indent=1))
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, world: int, args, device: torch.device) -> dict:
    root = comfy_host.find_comfyui(args.comfyui)
    comfy_host.import_comfyui(root, cpu=device.type == "cpu", stock_flag=None)
    _package()
    kernels = importlib.import_module(f"{PACKAGE}.kernels")
    h3_patch = importlib.import_module(f"{PACKAGE}.nodes.h3_patch")
    sp = importlib.import_module(f"{PACKAGE}.nodes.sequence_parallel")
    if rank != 0:
        importlib.import_module(f"{PACKAGE}.nodes.report")._prompt_server = lambda: None  # rank 0 reports

    config = TINY_SP_H3 if args.tiny else FULL_H3
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    log(rank, f"building {'tiny' if args.tiny else 'full'} H3 on {world} x {device.type} ({dtype})")
    base = build_random_model(config, device, dtype, args.seed)
    single, _ = h3_patch.patch_model(base, "strided_nhd", args.backend)
    parallel, summary = sp.patch_model(single, world)
    tokens = packed_token_count(args.width, args.height, args.frames, TEXT_TOKENS)
    bench = types.SimpleNamespace(  # what benchmarks.sections' sampling helpers read
        device=device, seed=args.seed, width=args.width, height=args.height, frames=args.frames,
        conditioning=random_conditioning(TEXT_TOKENS, config["text_dim"], args.seed),
        log=lambda m: log(rank, m), latent_source="")
    result = {"world": world, "device": _device_name(device), "torch": torch.__version__,
              "dist_backend": dist.get_backend(), "env": {k: os.environ.get(k) for k in DIST_ENV},
              "model": "tiny" if args.tiny else "full", "config": config, "dtype": str(dtype),
              "shape": [args.width, args.height, args.frames], "packed_tokens": tokens["total"],
              "backend_requested": args.backend, "sequence_parallel": summary["sequence_parallel"]}
    if "block" in args.sections:
        result["block"] = block_section(rank, world, args, bench, single, parallel, sp)
    if "sampling" in args.sections:
        result["sampling"] = sampling_section(rank, args, bench, single, parallel)
        sent = summary["report"].sent  # the run report of the sequence-parallel sampling (this rank)
        result["sampling"]["sp_report"] = {k: sent[-1][k] for k in ("attention_calls", "backends_ran", "fallbacks",
                                                                     "copies_per_call", "messages")} if sent else None
    return result


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# --- block -----------------------------------------------------------------------------------------
def capture_block_input(bench, single, index: int) -> tuple:
    """Inputs of block ``index`` in one single-GPU forward at the run's shape (real activations)."""
    import comfy.model_management as mm
    from .sections import empty_av_latent

    mm.load_models_gpu([single], force_full_load=True)
    dm = single.model.diffusion_model
    latent = empty_av_latent(bench)["samples"]
    gen = torch.Generator().manual_seed(bench.seed)
    video, audio = (torch.randn(t.shape, generator=gen).to(bench.device) for t in latent.unbind())
    context = bench.conditioning[0][0].to(bench.device, dtype=dm.dtype)
    kept = {}

    def keep(module, args, kwargs):
        x, t_emb, segments, rope = args[:4]
        kept["inputs"] = (x.clone(), t_emb, segments, rope)

    hook = dm.blocks[index].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            dm(x=[video, audio], timestep=torch.tensor([1000.0], device=bench.device), context=context,
               transformer_options=single.model_options["transformer_options"], minimax_payload={})
    finally:
        hook.remove()
    return kept["inputs"]


def block_section(rank, world, args, bench, single, parallel, sp) -> dict:
    import comfy.model_management as mm

    dm = single.model.diffusion_model
    index = min(BLOCK_INDEX, len(dm.blocks) - 1)
    x, t_emb, segments, rope = capture_block_input(bench, single, index)
    block = dm.blocks[index]

    def original_block(a):
        return {"img": block(a["img"], a["t_emb"], a["mod_segments"], a["rope_freqs"],
                             transformer_options=a["transformer_options"])}

    def run_baseline():
        return block(x.clone(), t_emb, segments, rope, transformer_options={})

    shard = sp.ulysses.SequenceShard(x.shape[0], world, rank)
    local_x = x[shard.start:shard.stop]
    options = parallel.model_options["transformer_options"]
    scatter_gather = sp.ShardedBlock(0, 0)       # full rows in, full rows out (first + last block)
    steady = sp.ShardedBlock(1, -1)              # local rows in, local rows out (every other block)

    def args_for(h):
        return {"img": h, "t_emb": t_emb, "mod_segments": segments, "rope_freqs": rope,
                "transformer_options": options}

    def run_sp(kind):
        fn = scatter_gather if kind == "scatter_gather" else steady
        h = x.clone() if kind == "scatter_gather" else local_x.clone()
        return fn(args_for(h), {"original_block": original_block})["img"]

    with torch.no_grad():
        mm.load_models_gpu([single], force_full_load=True)
        base_times, base_out = [], None
        for rep in range(args.reps + 1):  # the first rep warms up
            seconds, base_out = measure.timed(run_baseline, bench.device)
            base_times.append(seconds)
        mm.load_models_gpu([parallel], force_full_load=True)  # the Ulysses attention forwards
        times = {"steady": [], "scatter_gather": []}
        outs = {}
        for rep in range(args.reps + 1):
            for kind in times:
                dist.barrier()  # start together: the collectives would make the first rank wait anyway
                seconds, outs[kind] = measure.timed(lambda: run_sp(kind), bench.device)
                times[kind].append(seconds)
        diff = (outs["scatter_gather"].float() - base_out.float()).abs().max().item()
        steady_diff = (outs["steady"].float() - base_out[shard.start:shard.stop].float()).abs().max().item()
    base = measure.summary(base_times[1:])
    result = {"block_index": index, "rows": x.shape[0], "rank_rows": shard.sizes,
              "baseline_1_rank": base, "max_abs_diff": diff, "max_abs_diff_rank_rows_steady": steady_diff,
              "baseline_max_abs": base_out.float().abs().max().item()}
    for kind, ts in times.items():
        s = measure.summary(ts[1:])
        result[f"sp_{kind}"] = s
        result[f"speedup_{kind}"] = base["p50_seconds"] / s["p50_seconds"]
    log(rank, f"block {index}: 1 rank {base['p50_seconds'] * 1e3:.2f} ms, {world} ranks "
              f"{result['sp_steady']['p50_seconds'] * 1e3:.2f} ms ({result['speedup_steady']:.2f}x), "
              f"max abs diff {diff:.3e}")
    return result


# --- sampling --------------------------------------------------------------------------------------
def sampling_section(rank, args, bench, single, parallel) -> dict:
    from .sections import run_sampling

    result = {"steps": args.steps}
    base_latents = None
    if rank == 0:  # the single-GPU baseline; the other ranks wait at the barrier
        result["baseline_1_rank"], base_latents = run_sampling(bench, single, args.steps, "1 rank")
    dist.barrier()
    run, latents = run_sampling(bench, parallel, args.steps, f"{dist.get_world_size()} ranks")
    result["sp"] = run
    if rank == 0:
        result["max_abs_diff"] = {name: (a.float() - b.float()).abs().max().item()
                                  for name, a, b in zip(("video", "audio"), latents, base_latents)}
        result["baseline_max_abs"] = {name: b.float().abs().max().item()
                                      for name, b in zip(("video", "audio"), base_latents)}
        result["speedup"] = result["baseline_1_rank"]["seconds"] / run["seconds"]
    return result


# --- the run ---------------------------------------------------------------------------------------
def table(result: dict) -> str:
    rows = [f"sequence parallel H3, {result['world']} x {result['device']} ({result['dist_backend']}), "
            f"{result['model']} model, {result['shape'][0]}x{result['shape'][1]}x{result['shape'][2]}, "
            f"S = {result['packed_tokens']}",
            f"{'measurement':<34}{'1 rank':>12}{'N ranks':>12}{'speedup':>9}{'max abs diff':>14}"]
    b = result.get("block")
    if b:
        rows.append(f"{'block ' + str(b['block_index']) + ' (steady, p50)':<34}{b['baseline_1_rank']['p50_seconds'] * 1e3:>10.2f}ms"
                    f"{b['sp_steady']['p50_seconds'] * 1e3:>10.2f}ms{b['speedup_steady']:>8.2f}x"
                    f"{b['max_abs_diff_rank_rows_steady']:>14.3e}")
        rows.append(f"{'block + scatter/all-gather (p50)':<34}{b['baseline_1_rank']['p50_seconds'] * 1e3:>10.2f}ms"
                    f"{b['sp_scatter_gather']['p50_seconds'] * 1e3:>10.2f}ms{b['speedup_scatter_gather']:>8.2f}x"
                    f"{b['max_abs_diff']:>14.3e}")
    s = result.get("sampling")
    if s:
        d = s["max_abs_diff"]
        rows.append(f"{str(s['steps']) + '-step sampling':<34}{s['baseline_1_rank']['seconds']:>11.2f}s"
                    f"{s['sp']['seconds']:>11.2f}s{s['speedup']:>8.2f}x"
                    f"{max(d.values()):>14.3e}")
        rep = s.get("sp_report") or {}
        rows.append(f"  rank 0 attention: {rep.get('attention_calls')} calls on {rep.get('backends_ran')}, "
                    f"{rep.get('copies_per_call')} copies per call")
        rows.append(f"  latent max abs: video {s['baseline_max_abs']['video']:.3f}, audio "
                    f"{s['baseline_max_abs']['audio']:.3f}; diff video {d['video']:.3e}, audio {d['audio']:.3e}")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(DIST_ENV)  # inherited by the spawned ranks
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(_rank_main, args=(args.world, args, free_port(), result_dir), nprocs=args.world,
                           join=True, start_method="spawn")
        result = json.loads(Path(result_dir, "result.json").read_text())
    result["wall_seconds"] = time.perf_counter() - started
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"sequence_parallel_{result['model']}_{args.device}_world{args.world}.json"
    (out_dir / name).write_text(json.dumps(result, indent=1))
    print(f"[sp] full results: {out_dir / name}")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
