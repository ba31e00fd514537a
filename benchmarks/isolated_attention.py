"""Isolated attention: HND baseline vs strided NHD, per back-end and sequence length.

    python -m benchmarks.isolated_attention --seq 8192 37810 --out report.json            # GPU, every available back-end
    python -m benchmarks.isolated_attention --device cpu --seq 64 256 --heads 4 --out r.json  # CPU smoke run (sdpa)

One timed call is the whole attention of a block on a fused qkv buffer [S, 3*H*D] (a fresh copy each call, made
outside the timing: norm+rope works in place); the layouts alternate rep by rep. One more call per layout gives its
peak extra memory, output and record. JSON keyed by back-end then S (``benchmarks.results_table --kernels``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

from devkit.backends import describe_backends
from devkit.inputs import fused_attention_inputs
from devkit.pack import kernels as _kernels

from . import measure
from .report import markdown
from .results_table import KERNELS_HEADER, kernel_rows

kernels = _kernels()
LAYOUTS = ("hnd", "strided_nhd")


def layout_calls(pristine: torch.Tensor, norm: dict, heads: int, head_dim: int, backend: str, device):
    """``(timers, once)``: per layout a runner timing one call on a fresh copy of ``pristine``, and ``once(layout)``:
    ``(peak extra bytes, (out, record))``. ``norm``: ``kernels.QKNorm``'s arguments (a QKNorm applies once)."""
    work = torch.empty_like(pristine)
    chain = kernels.BackendChain.for_choice(backend)

    def call(layout):
        return kernels.attention_from_fused_qkv(work, heads, head_dim, chain=chain, layout=layout,
                                                norm=kernels.QKNorm(**norm))

    def timer(layout):
        run = measure.device_timed(lambda: call(layout), device)

        def rep():
            work.copy_(pristine)
            return run()
        return rep

    def once(layout):
        work.copy_(pristine)
        return measure.peak_extra_bytes(lambda: call(layout), device)
    return {layout: timer(layout) for layout in LAYOUTS}, once


def compare_layouts(pristine, norm: dict, heads: int, head_dim: int, backend: str, device, reps: int, warmup: int,
                    progress=None) -> dict:
    """Both layouts timed interleaved, outputs compared; a named ``backend`` that did not run is refused."""
    timers, once = layout_calls(pristine, norm, heads, head_dim, backend, device)
    times = measure.interleaved_times(timers, reps, warmup, progress=progress)
    peak, outputs, records = {}, {}, {}
    for layout in LAYOUTS:
        peak[layout], (out, rec) = once(layout)
        if backend != "auto" and rec.backend != backend:
            raise RuntimeError(f"{backend} did not run ({[(s.backend, s.reason) for s in rec.skipped]}); "
                               "refusing to report it")
        outputs[layout], records[layout] = out.float().cpu(), dataclasses.asdict(rec)
    diff = measure.max_abs_difference(outputs["hnd"], outputs["strided_nhd"])
    row = {}
    for layout in LAYOUTS:
        row.update({f"{layout}_mean_seconds": statistics.fmean(times[layout]),
                    f"{layout}_median_seconds": statistics.median(times[layout]),
                    f"{layout}_min_max_seconds": [min(times[layout]), max(times[layout])],
                    f"{layout}_peak_extra_bytes": peak[layout]})
    return dict(row, speedup=row["hnd_median_seconds"] / row["strided_nhd_median_seconds"], speedup_basis="median",
                max_abs_difference=diff["max_abs_difference"], mean_abs_difference=diff["mean_abs_difference"],
                bit_exact=diff["bit_exact"], finite=measure.all_finite(*outputs.values()), records=records, reps=reps)


def measure_backend(backend: str, seq: int, args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    qkv, table, qw, kw = fused_attention_inputs(seq, args.heads, args.head_dim, args.rot_dim, seed=args.seed,
                                                device=device, weight_mean=1.0, weight_spread=0.1, table_dtype=dtype)
    norm = {"rope_table": table, "q_weight": qw.to(dtype), "k_weight": kw.to(dtype), "eps": 1e-5}
    return compare_layouts(qkv.to(dtype), norm, args.heads, args.head_dim, backend, device, args.reps, args.warmup)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 37810])
    p.add_argument("--backends", nargs="+", choices=list(kernels.backends.AUTO_ORDER),
                   help="default: every available one")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rot-dim", type=int, default=96)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=440420)
    p.add_argument("--out", help="write the JSON report here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.rot_dim > args.head_dim or args.rot_dim % 2:
        sys.exit(f"--rot-dim must be even and at most --head-dim ({args.head_dim})")
    availability = describe_backends(args.device)
    names = args.backends or [row["name"] for row in availability if row["available"]]
    report = {"environment": {**measure.device_facts(args.device), "torch": torch.__version__}, "heads": args.heads, "head_dim": args.head_dim,
              "dtype": args.dtype, "backends_available": availability, "results": {}}
    for name in names:
        verdict = kernels.BACKENDS[name].available()
        if not verdict:
            report["results"][name] = {"skipped": verdict.reason}
            continue
        report["results"][name] = {}
        for seq in args.seq:
            try:
                row = measure_backend(name, seq, args)
            except Exception as exc:  # keep measuring the rest; the JSON says what failed
                row = {"error": f"{type(exc).__name__}: {exc}"}
            report["results"][name][str(seq)] = row
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=2)
            print(f"{name} S={seq}: " + (row.get("error") or f"HND {row['hnd_median_seconds'] * 1e3:.3f} ms, "
                  f"strided NHD {row['strided_nhd_median_seconds'] * 1e3:.3f} ms, speedup {row['speedup']:.3f}x"),
                  flush=True)
    env = report["environment"]
    print(f"\n{env['device']}, torch {env['torch']}, {args.heads}x{args.head_dim} heads {args.dtype}")
    print("\n".join(markdown(KERNELS_HEADER, kernel_rows(report, set()))))
    return report


if __name__ == "__main__":
    main()
