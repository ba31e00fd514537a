"""SageAttention 2's sm90 kernel (the sage2 back-end's ``attend`` on prepared operands) with its heads split into
launches of different sizes, each split run on its own long enough for the card to settle the clock its power cap
leaves it (interleaved, they would share one): ms a call, SM clock, power, temperature (NVML: needs nvidia-ml-py),
and whether the output has the first split's bits. What ``LAUNCH_HEADS`` rests on (docs/BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from devkit.pack import submodule

from .step_timeline import ClockSampler

HEADS, HEAD_DIM = 56, 128


def prepared(seq: int, seed: int = 1):
    """The back-end's prepared operands (exact mode) of random Q, K (with a channel mean, as K has) and V."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, seq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    k += 0.5 * torch.randn(1, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    return submodule("kernels.backends.sage2").Sage2Backend().prepare(q, k, v, mode="exact")


def run_split(backend, p, out, per_launch: int, calls: int) -> dict:
    """``calls`` timed calls of one split back to back, the clock sampled over them (the first quarter dropped)."""
    sage2 = submodule("kernels.backends.sage2")
    saved = sage2.LAUNCH_HEADS, sage2.LAUNCH_SPLIT_TOKENS
    sage2.LAUNCH_HEADS, sage2.LAUNCH_SPLIT_TOKENS = per_launch, 0  # per_launch heads a launch, at any length
    try:
        backend.attend(p, out)
        torch.cuda.synchronize()
        sampler = ClockSampler(torch.device("cuda"))
        sampler.start()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
        events[0].record()
        for i in range(calls):
            backend.attend(p, out)
            events[i + 1].record()
        torch.cuda.synchronize()
        samples = sampler.stop()
    finally:
        sage2.LAUNCH_HEADS, sage2.LAUNCH_SPLIT_TOKENS = saved
    settled = samples[len(samples) // 4:]
    ms = sorted(a.elapsed_time(b) for a, b in zip(events, events[1:]))

    def mean(column: int):
        return round(sum(s[column] for s in settled) / len(settled), 1) if settled else None
    return {"launches": -(-HEADS // per_launch), "heads_per_launch": per_launch, "ms_median": round(ms[calls // 2], 2),
            "ms_min": round(ms[0], 2), "sm_mhz": mean(1), "watts": mean(2), "celsius": mean(3),
            "clock_samples": len(settled), "clock_problem": sampler.problem}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=149936)
    ap.add_argument("--heads-per-launch", type=int, nargs="+", default=[56, 14, 7, 28, 56])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", help="JSON lines, one per split")
    args = ap.parse_args(argv)
    binding = submodule("kernels.backends.sage2_binding")
    op, why = binding.sm90_attention_op() if torch.cuda.is_available() else (None, "needs a CUDA GPU")
    if op is None:
        print(f"[Sage Strided NHD] attention launches: {why}", file=sys.stderr)
        return 2
    backend, p = submodule("kernels.backends.sage2").Sage2Backend(), prepared(args.tokens)
    out = torch.empty(1, args.tokens, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    first, rows = None, []
    for per_launch in args.heads_per_launch:
        split = run_split(backend, p, out, per_launch, args.calls)
        first = out.clone() if first is None else first
        rows.append({"tokens": args.tokens, "gpu": torch.cuda.get_device_name(), **split,
                     "bits_as_first": bool(torch.equal(out, first))})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
