"""The full MiniMax H3 on smaller cards: stock ComfyUI, the pack and KJNodes' lowest-memory nodes under VRAM budgets
emulated on a big card, with ComfyUI's own model management loading what fits and streaming the rest.

Each (length, budget) cell runs in its own process (``benchmarks.budget_cell``) on a card cut to the budget
(``benchmarks.ballast``), every variant sampled there in turn from a cold start. The checkpoint is the full-size H3
with seeded random weights in the bundled workflows' format (``--make-checkpoint``; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# stock last: past 2**31 elements its attention on the fused qkv buffer may fault the device, and after a fault
# nothing more runs in the process
VARIANTS = ("pack", "kjnodes", "stock")
LOADERS = ("dynamic", "legacy")  # DynamicVRAM (comfy-aimdo), or the estimate-based ModelPatcher
WIDTH, HEIGHT, TEXT_TOKENS, SEED = 1344, 768, 100, 440420  # the bundled workflows' clip (frames from --tokens)


def log(message: str) -> None:
    print(f"[vram-budget {time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_budgets(text: str) -> list[float | None]:
    """``12,16,24,full`` -> [12.0, 16.0, 24.0, None] (GiB; None: the whole card)."""
    out = [None if part.strip() == "full" else float(part) for part in text.split(",")]
    if any(v is not None and v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"a budget must be positive GiB or 'full', got {text!r}")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.vram_budget", description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--checkpoint", type=Path, help="the H3 checkpoint to sample (see --make-checkpoint)")
    what.add_argument("--make-checkpoint", type=Path, metavar="PATH", help="write the random-weight checkpoint")
    p.add_argument("--budgets", type=parse_budgets, default=parse_budgets("12,16,24"), help="GiB, or full; 12,16,24")
    p.add_argument("--tokens", type=lambda text: [int(t) for t in text.split(",") if t.strip()], default=[37810],
                   help="packed tokens per clip, comma separated")
    p.add_argument("--steps", type=int, default=3, help="sampling steps per run (the first is not timed)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma separated, of {', '.join(VARIANTS)}")
    p.add_argument("--kjnodes", type=Path, default=None, help="a ComfyUI-KJNodes checkout (for the kjnodes variant)")
    p.add_argument("--loader", choices=LOADERS, default="dynamic", help="legacy: ComfyUI's --disable-dynamic-vram")
    p.add_argument("--weights", choices=("int8_convrot", "bf16"), default="int8_convrot", help="--make-checkpoint")
    p.add_argument("--blocks", type=int, default=None, help="--make-checkpoint: DiT blocks (default: all 50)")
    p.add_argument("--tiny", action="store_true", help="--make-checkpoint: the tiny H3 config (CPU tests)")
    for name, default in (("width", WIDTH), ("height", HEIGHT), ("text-tokens", TEXT_TOKENS), ("seed", SEED)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda")
    p.add_argument("--comfyui", default=None, help="ComfyUI tree (default: $COMFYUI_PATH, else <repo>/.comfyui)")
    p.add_argument("--timeline", action="store_true", help="profile each run's last step (benchmarks.step_timeline)")
    p.add_argument("--cell-timeout", type=int, default=1800, help="seconds a cell's process may take")
    p.add_argument("--out", type=Path, default=Path("vram-budget.json"))
    # one cell, in its own process (what the parent starts)
    p.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    for name, kind in (("--budget", float), ("--frames", int), ("--cell-out", Path)):
        p.add_argument(name, type=kind, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if "kjnodes" in args.variants and args.checkpoint and args.kjnodes is None:
        p.error("the kjnodes variant needs --kjnodes (a ComfyUI-KJNodes checkout), or leave it out of --variants")
    if args.steps < 2:
        p.error("--steps must be at least 2: the first step loads, the later ones are timed")
    return args


def make_checkpoint(args) -> int:
    """The random-weight H3 in ``args.weights``' format: drawn on the device, quantised a tensor at a time, streamed."""
    import torch

    from devkit import comfy as comfy_host
    from devkit import h3

    cuda = args.device != "cpu"
    comfy_host.import_comfyui(comfy_host.find_comfyui(args.comfyui), cpu=not cuda, stock_flag=None)
    config = dict(h3.TINY_H3 if args.tiny else h3.FULL_H3)
    if args.blocks:
        config["num_layers"] = args.blocks
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.perf_counter()
    model = h3.build_random_model(config, torch.device(args.device), dtype, args.seed).model.diffusion_model
    groupsize = 256 if config["hidden_size"] % 256 == 0 else config["hidden_size"]

    def named_tensors():
        for key, value in model.state_dict().items():
            if args.weights == "int8_convrot":
                yield from h3.int8_convrot_state_dict({key: value}, groupsize).items()
            else:
                yield key, value

    path = args.make_checkpoint
    size = h3.write_safetensors(path, named_tensors, {"source": "benchmarks.vram_budget random weights",
                                                   "seed": str(args.seed), "weights": args.weights})
    log(f"wrote {path}: {size / 2**30:.2f} GiB, {config['num_layers']} blocks, {args.weights}, "
        f"in {time.perf_counter() - started:.0f} s")
    return 0


def run_cells(args) -> int:
    from devkit.aimdo_emulation import Recorder

    from . import results_table
    from .sections import frames_for_tokens

    cells, started = [], time.perf_counter()
    data = {"what": "full H3 sampled under VRAM budgets (benchmarks.vram_budget)", "argv": args.argv,
            "checkpoint": str(args.checkpoint), "loader": args.loader, "steps": args.steps, "cells": cells}
    report = Recorder(args.out, data)
    for tokens in args.tokens:
        frames, rows = frames_for_tokens(tokens, args.width, args.height, args.text_tokens)
        for budget in args.budgets:
            name = f"{rows['total']}-{'full' if budget is None else f'{budget:g}gib'}"
            out = args.out.with_name(f"{args.out.stem}.{name}.cell.json")
            out.unlink(missing_ok=True)
            log(f"cell {name}: {args.width}x{args.height}x{frames} ({rows['total']} tokens), "
                f"budget {'the whole card' if budget is None else f'{budget:g} GiB'}")
            # the cell's process: this run's own options (a repeated option's last value wins), then the cell's
            command = [sys.executable, "-m", "benchmarks.vram_budget", *args.argv, "--cell", "--tokens", str(tokens),
                       "--frames", str(frames), "--cell-out", str(out)]
            command += [] if budget is None else ["--budget", str(budget)]
            try:
                returncode = subprocess.run(command, timeout=args.cell_timeout).returncode
            except subprocess.TimeoutExpired:  # what the cell wrote by then stays; the next cell still runs
                returncode = f"timed out after {args.cell_timeout} s"
            cell = json.loads(out.read_text()) if out.is_file() else {"runs": {}, "tokens_asked": tokens,
                                                                        "budget_gib": budget}
            cell.update(name=name, returncode=returncode)
            cells.append(cell)
            report.write()
            log(results_table.budget_details({"cells": [cell]})[0])
    data["seconds"] = time.perf_counter() - started
    report.write()
    print("\n".join(results_table.budget_markdown([data])))
    return 0 if all(c["returncode"] == 0 for c in cells) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.make_checkpoint:
        return make_checkpoint(args)
    if args.cell:
        from .budget_cell import run_cell

        return run_cell(args)
    if not args.checkpoint.is_file():
        raise SystemExit(f"no checkpoint at {args.checkpoint}: write one with --make-checkpoint {args.checkpoint}")
    return run_cells(args)


if __name__ == "__main__":
    sys.exit(main())
