"""One cell of the VRAM-budget benchmark, a process of its own that ``benchmarks.vram_budget`` starts: one budget, one
clip length, every variant sampled in turn on the same model. The start-up follows ComfyUI's ``main.py``
(``devkit.aimdo_emulation`` has the steps), the ballast (``benchmarks.ballast``) before aimdo's devices; not
``--highvram``: ComfyUI's own model management loads the weights it can and streams the rest every step.
"""

from __future__ import annotations

import gc
import time
import traceback
from pathlib import Path

from devkit import aimdo_emulation as startup
from devkit.comfy import custom_sampling, on_each_step

from .step_timeline import StepTimeline

# comfy-aimdo's "VRAM grow failed": its weight cast buffer could not grow on the card (DynamicVRAM's out of memory)
OOM_MARKS = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA_ERROR_OUT_OF_MEMORY", "VRAM grow failed")


class Recorder(startup.Recorder):
    def stage(self, name: str) -> None:
        print(f"[budget-cell {time.strftime('%H:%M:%S')}] {name}", flush=True)
        super().stage(name)


def error_record(exc: BaseException) -> dict:
    import torch

    first = (str(exc).strip().splitlines() or [""])[0]
    oom = isinstance(exc, torch.OutOfMemoryError) or any(m in str(exc) for m in OOM_MARKS)
    return {"type": type(exc).__name__, "message": first[:500], "oom": oom,
            "where": "".join(traceback.format_tb(exc.__traceback__)[-2:])[-800:]}


def tensor_bytes(t) -> int:
    qdata = getattr(t, "_qdata", None)  # a QuantizedTensor: its int8 data and its scale
    if qdata is not None:
        scale = getattr(getattr(t, "_params", None), "scale", None)
        return qdata.numel() * qdata.element_size() + (scale.numel() * scale.element_size() if scale is not None else 0)
    return t.numel() * t.element_size()


class TransferCounter:
    """Bytes of host tensors ComfyUI copies to the card through ``cast_to`` (the legacy ModelPatcher's per-call
    cast) and ``cast_to_gathered`` (DynamicVRAM's and the cast buffers' gathered copies, file slices included), from
    its making on."""

    def __init__(self):
        import comfy.model_management as mm

        self.bytes = 0
        cast_to, gathered = mm.cast_to, mm.cast_to_gathered

        def counted_cast_to(weight, dtype=None, device=None, *args, **kwargs):
            if device is not None and getattr(device, "type", str(device)) == "cuda" and weight.device.type == "cpu":
                self.bytes += tensor_bytes(weight)
            return cast_to(weight, dtype, device, *args, **kwargs)

        def counted_gathered(tensors, r, non_blocking=False, stream=None, r2=None):
            if any(d is not None and d.device.type == "cuda" for d in (r, r2)):
                self.bytes += sum(tensor_bytes(t) for t in tensors if t is not None and t.device.type == "cpu")
            return gathered(tensors, r, non_blocking=non_blocking, stream=stream, r2=r2)

        mm.cast_to, mm.cast_to_gathered = counted_cast_to, counted_gathered


def start(args, recorder: Recorder):
    """ComfyUI's start-up with the budget in place: (torch, device, stock flag, ballast the caller holds or None)."""
    result = recorder.result
    cuda = args.device != "cpu"
    dynamic = cuda and args.loader == "dynamic"
    if cuda:
        result["pytorch_cuda_alloc_conf"] = startup.cuda_malloc_env()
    if dynamic:
        recorder.stage("comfy_aimdo.control.init")
        control = startup.init_aimdo_library()
        result["comfy_aimdo"] = startup.aimdo_version()
    import torch

    from devkit import comfy as comfy_host

    device = torch.device(args.device)
    stock_flag = startup.stock_flag("auto", cuda)
    recorder.stage("ComfyUI imports")
    root = comfy_host.find_comfyui(args.comfyui)
    flags = comfy_host.import_comfyui(root, cpu=not cuda, stock_flag=stock_flag, extra_flags={"highvram": False})
    result.update(comfyui={"path": str(root), "version": comfy_host.comfyui_version(root), "flags": flags},
                  stock_attention=comfy_host.stock_attention_name(), torch=str(torch.__version__))
    ballast = None
    if cuda:
        from .ballast import occupy

        recorder.stage("ballast")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if args.budget is not None:
            ballast, result["budget"] = occupy(index, args.budget)
        else:
            free, total = torch.cuda.mem_get_info(index)
            result["budget"] = {"budget_gib": None, "card_total_bytes": total, "free_after_bytes": free}
        result.update(gpu=torch.cuda.get_device_name(device), allocator_backend=torch.cuda.get_allocator_backend())
    else:
        result["budget"] = {"budget_gib": args.budget, "emulated": False, "why": "no device memory on a CPU"}
    import comfy.utils

    for name in ("PROGRESS_THROTTLE_MIN_INTERVAL", "PROGRESS_THROTTLE_MIN_PERCENT"):
        if hasattr(comfy.utils, name):
            setattr(comfy.utils, name, 0)  # the progress hook sees every step's end, however short (the CPU tests')
    result["loader"] = "legacy"
    if dynamic:
        recorder.stage("comfy_aimdo.control.init_devices")
        startup.init_aimdo_devices(control)
        import comfy.memory_management
        import comfy.model_patcher

        # main.py's two assignments once aimdo's devices are up
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
        result["loader"] = "dynamic"
    return torch, device, stock_flag, ballast


def _peer_variant(args, base, stock_flag: str, result: dict):
    """KJNodes' lowest-memory chain (``peer.LOW_MEMORY``; without its sage patch where stock runs no SageAttention
    or the patch refuses this one)."""
    from . import peer

    module = peer.load_module(args.kjnodes)
    nodes = (peer.LOW_MEMORY if stock_flag == "use_sage_attention" else peer.LOW_MEMORY_WITHOUT_SAGE)["kj_lowmem"]
    try:
        clone, applied = peer.make_variant(module, base, nodes, args.kjnodes)
    except RuntimeError as exc:  # its sage patch refuses this SageAttention: the rest of the combination runs
        if peer.MEM_EFF_SAGE not in nodes:
            raise
        result.setdefault("notes", []).append(f"KJNodes' {peer.MEM_EFF_SAGE} refused: {exc}")
        clone, applied = peer.make_variant(module, base, peer.LOW_MEMORY_WITHOUT_SAGE["kj_lowmem"], args.kjnodes)
    result["kjnodes"] = {"nodes": applied, "checkout": str(args.kjnodes),
                         "commit": peer.describe(args.kjnodes, module, None)["git_commit"]}
    return clone


def sample(torch, device, patcher, conditioning, args, counter: TransferCounter) -> tuple[dict, tuple | None]:
    """One ``args.steps``-step run of ``patcher`` from a cold start (nothing of the model on the card): seconds per
    step (after the first, which also loads), weight bytes copied to the card, torch's peaks and the card's least
    free memory at a step's end (comfy-aimdo's weight pages are not torch's), the error if any."""
    import comfy.model_management as mm
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    latent = EmptyMiniMaxH3LatentAV.execute(args.width, args.height, args.frames)[0]
    sampling = custom_sampling(patcher, conditioning, latent, args.seed, args.steps)
    ends, streamed, free = [], [], []
    timeline = StepTimeline(device) if cuda and args.timeline else None
    run, latents = {"steps": args.steps}, None
    start_bytes, start = counter.bytes, time.perf_counter()

    def progress(value, total):
        if cuda:
            torch.cuda.synchronize(device)
            free.append(torch.cuda.mem_get_info(device)[0])
        ends.append(time.perf_counter() - start)
        streamed.append(counter.bytes - start_bytes)
        print(f"    step {value}/{total} at {ends[-1]:.2f} s, {streamed[-1] / 2**30:.2f} GiB copied", flush=True)
        if timeline is not None and value == total:
            run["last_step_timeline"] = timeline.stop()
        elif timeline is not None and value == total - 1:
            timeline.start()  # the last step: where its time goes

    try:
        with on_each_step(progress):
            out = sampling()
        if cuda:
            torch.cuda.synchronize(device)
        run["seconds"] = time.perf_counter() - start
        latents = tuple(t.detach().to("cpu", copy=True) for t in out["samples"].unbind())
        run["finite"] = all(bool(torch.isfinite(t.float()).all()) for t in latents)
    except Exception as exc:  # noqa: BLE001  (recorded; the next variant still runs)
        run["error"] = error_record(exc)
    finally:
        if timeline is not None:
            timeline.close()  # a run that failed inside its last step: the profiler stops, nothing recorded
    run["step_end_seconds"], run["copied_bytes_at_step_end"] = ends, streamed
    later = len(ends) - 1  # the steps after the first
    run["seconds_per_step"] = (ends[-1] - ends[0]) / later if later > 0 and "error" not in run else None
    run["copied_bytes_per_step"] = int((streamed[-1] - streamed[0]) / later) if later > 0 else None
    if cuda:
        run["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        run["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        run["least_free_bytes"] = min(free, default=None)
    return run, latents


def run_cell(args) -> int:
    result = {"budget_gib": args.budget, "tokens_asked": args.tokens[0], "frames": args.frames, "width": args.width,
              "height": args.height, "steps": args.steps, "variants": list(args.variants), "runs": {}}
    recorder = Recorder(args.cell_out, result)
    try:
        torch, device, stock_flag, ballast = start(args, recorder)
        from devkit import h3 as h3_model
        from devkit.pack import submodule

        from .measure import max_abs_difference

        counter = TransferCounter()
        recorder.stage("load the checkpoint")
        base = h3_model.load_checkpoint_model(str(args.checkpoint))
        result["model"] = {"checkpoint": str(args.checkpoint), "bytes": Path(args.checkpoint).stat().st_size,
                           "patcher": type(base).__name__, "blocks": len(base.model.diffusion_model.blocks)}
        variants, patches = {}, {}  # stock, the node at its defaults and KJNodes
        for name in args.variants:
            if name == "stock":
                variants[name] = base
            elif name == "pack":
                # measure_peak off: the cell reads every variant's peak the same way, over the whole run
                settings = submodule("nodes.patch").Settings(measure_peak=False)
                variants[name], patches[name] = submodule("nodes.h3_patch").patch_model(base, settings)
            elif name == "kjnodes":
                variants[name] = _peer_variant(args, base, stock_flag, result)
        dm = base.model.diffusion_model
        conditioning = h3_model.random_conditioning(args.text_tokens, dm.condition_proj.weight.shape[1], args.seed + 1)
        result["packed_rows"] = h3_model.packed_token_count(args.width, args.height, args.frames, args.text_tokens)
        latents = {}
        for name, patcher in variants.items():
            recorder.stage(f"sample {name}")
            run, latents[name] = sample(torch, device, patcher, conditioning, args, counter)
            if name in patches:
                run["report"] = patches[name].report.last
            result["runs"][name] = run
            recorder.write()
        for name in [n for n in latents if n != "stock"]:
            if latents.get("stock") is not None and latents[name] is not None:
                diffs = [max_abs_difference(x, y) for x, y in zip(latents["stock"], latents[name])]
                result["runs"][name]["vs_stock"] = {"identical": all(d["bit_exact"] for d in diffs),
                                                    "max_abs_difference": max(d["max_abs_difference"] for d in diffs)}
        recorder.stage("done")
        del ballast  # held to here: the budget stays in place for every run
        return 0
    except Exception as exc:  # noqa: BLE001  (the cell's JSON says where it stopped)
        result["error"] = error_record(exc)
        recorder.write()
        traceback.print_exc()
        return 1
