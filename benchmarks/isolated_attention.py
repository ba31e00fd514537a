"""Isolated attention: HND baseline vs strided NHD, per back-end and sequence length.

    python -m benchmarks.isolated_attention --seq 8192 37810 --out report.json            # GPU, every available back-end
    python -m benchmarks.isolated_attention --device cpu --seq 64 256 --heads 4 --out r.json  # CPU smoke run (sdpa)

The table in docs/BENCHMARKS.md is made from the JSON by ``python -m benchmarks.results_table``.

One timed call is the whole attention of a block: views (or the baseline's copies)
of a fused qkv buffer [S, 3*H*D], comfy-kitchen RMSNorm+RoPE in place, the
back-end, and the token-major output for out_proj. The two layouts alternate rep
by rep on the same data, so drift hits both alike. Each rep starts from a fresh
copy of the pristine buffer (norm+rope works in place), made outside the timing.
Writes JSON keyed by back-end then S, with the reference report's
``isolated_attention_layout`` fields plus medians, spread and peak extra memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from devkit.backends import describe_backends
from devkit.pack import kernels as _kernels
from devkit.rope import make_rope_table

kernels = _kernels()
AUTO_ORDER, BACKENDS = kernels.AUTO_ORDER, kernels.BACKENDS
BackendChain, QKNorm = kernels.BackendChain, kernels.QKNorm
attention_from_fused_qkv = kernels.attention_from_fused_qkv

LAYOUTS = ("hnd", "strided_nhd")


def make_inputs(seq, heads, head_dim, rot_dim, device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    qkv = torch.randn(seq, 3 * heads * head_dim, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
    table = make_rope_table(seq, rot_dim, dtype=dtype, device=device, generator=g)
    qw = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(device=device, dtype=dtype)
    kw = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(device=device, dtype=dtype)
    return qkv, table, qw, kw


class Timer:
    """CUDA events on a GPU, a synchronised host clock elsewhere."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            result = fn()
            end.record()
            torch.cuda.synchronize()
            return result, start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - t0


def measure(backend, seq, args):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    pristine, table, qw, kw = make_inputs(seq, args.heads, args.head_dim, args.rot_dim, device, dtype, args.seed)
    work = torch.empty_like(pristine)
    chain = BackendChain.for_choice(backend)
    timer = Timer(device)
    cuda = device.type == "cuda"

    def call(layout):
        norm = QKNorm(rope_table=table, q_weight=qw, k_weight=kw, eps=1e-5)  # applied once: one per call
        return attention_from_fused_qkv(work, args.heads, args.head_dim, chain=chain, layout=layout, norm=norm)

    times = {layout: [] for layout in LAYOUTS}
    peak = {}
    outputs = {}
    records = {}
    for rep in range(args.warmup + args.reps):
        for layout in LAYOUTS:
            work.copy_(pristine)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            (out, rec), seconds = timer(lambda: call(layout))
            if rec.backend != backend:
                skipped = [(s.backend, s.reason) for s in rec.skipped]
                raise RuntimeError(f"{backend} did not run ({skipped}); refusing to report it")
            if cuda:
                peak[layout] = max(peak.get(layout, 0), torch.cuda.max_memory_allocated() - base)
            if rep == 0:
                outputs[layout], records[layout] = out.float().cpu(), dataclasses.asdict(rec)
            if rep >= args.warmup:
                times[layout].append(seconds)
            del out
    diff = (outputs["hnd"] - outputs["strided_nhd"]).abs()
    finite = bool(torch.isfinite(outputs["strided_nhd"]).all() and torch.isfinite(outputs["hnd"]).all())
    med = {layout: statistics.median(times[layout]) for layout in LAYOUTS}
    return {
        "hnd_mean_seconds": statistics.fmean(times["hnd"]),
        "strided_nhd_mean_seconds": statistics.fmean(times["strided_nhd"]),
        "hnd_median_seconds": med["hnd"],
        "strided_nhd_median_seconds": med["strided_nhd"],
        "hnd_min_max_seconds": [min(times["hnd"]), max(times["hnd"])],
        "strided_nhd_min_max_seconds": [min(times["strided_nhd"]), max(times["strided_nhd"])],
        "speedup": med["hnd"] / med["strided_nhd"],
        "speedup_basis": "median",
        "max_abs_difference": diff.max().item(),
        "mean_abs_difference": diff.mean().item(),
        "bit_identical": bool(torch.equal(outputs["hnd"], outputs["strided_nhd"])),
        "finite": finite,
        "hnd_peak_extra_bytes": peak.get("hnd"),
        "strided_nhd_peak_extra_bytes": peak.get("strided_nhd"),
        "records": records,
        "reps": args.reps,
    }


def environment(device):
    info = {"device": "cpu", "torch": torch.__version__}
    if torch.device(device).type == "cuda":
        cap = torch.cuda.get_device_capability()
        info.update(device=torch.cuda.get_device_name(), compute_capability=f"SM{cap[0]}{cap[1]}")
    return info


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 37810])
    p.add_argument("--backends", nargs="+", choices=list(AUTO_ORDER), help="default: every available one")
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


def main(argv=None):
    args = parse_args(argv)
    if args.rot_dim > args.head_dim or args.rot_dim % 2:
        sys.exit(f"--rot-dim must be even and at most --head-dim ({args.head_dim})")
    availability = describe_backends(args.device)
    names = args.backends or [row["name"] for row in availability if row["available"]]
    report = {"environment": environment(args.device), "heads": args.heads, "head_dim": args.head_dim,
              "dtype": args.dtype, "backends_available": availability, "results": {}}
    for name in names:
        verdict = BACKENDS[name].available()
        if not verdict:
            report["results"][name] = {"skipped": verdict.reason}
            continue
        report["results"][name] = {}
        for seq in args.seq:
            try:
                row = measure(name, seq, args)
            except Exception as exc:  # keep measuring the rest; the JSON says what failed
                row = {"error": f"{type(exc).__name__}: {exc}"}
            report["results"][name][str(seq)] = row
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=2)
            print_row(name, seq, row)
    print_table(report)
    return report


def print_row(name, seq, row):
    if "error" in row:
        print(f"{name:>20} S={seq:<7} ERROR {row['error']}", flush=True)
    else:
        print(f"{name:>20} S={seq:<7} hnd {row['hnd_median_seconds'] * 1e3:9.3f} ms  "
              f"nhd {row['strided_nhd_median_seconds'] * 1e3:9.3f} ms  x{row['speedup']:.3f}", flush=True)


def print_table(report):
    env = report["environment"]
    print(f"\nisolated attention, {env['device']} ({env.get('compute_capability', '')}), torch {env['torch']}, "
          f"{report['heads']}x{report['head_dim']} {report['dtype']}")
    print(f"{'backend':>20} {'S':>7} {'hnd ms':>9} {'nhd ms':>9} {'speedup':>8} {'max|diff|':>10} "
          f"{'hnd peak MiB':>12} {'nhd peak MiB':>12}")
    for name, rows in report["results"].items():
        if "skipped" in rows:
            print(f"{name:>20} skipped: {rows['skipped']}")
            continue
        for seq, row in rows.items():
            if "error" in row:
                print(f"{name:>20} {seq:>7} error: {row['error']}")
                continue
            mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
            print(f"{name:>20} {seq:>7} {row['hnd_median_seconds'] * 1e3:9.3f} "
                  f"{row['strided_nhd_median_seconds'] * 1e3:9.3f} {row['speedup']:8.3f} "
                  f"{row['max_abs_difference']:10.3g} {mib(row['hnd_peak_extra_bytes']):>12} "
                  f"{mib(row['strided_nhd_peak_extra_bytes']):>12}")


if __name__ == "__main__":
    main()
