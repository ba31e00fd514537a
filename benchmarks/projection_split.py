"""Does the H3 qkv projection give stock's bits when it is split, and what does the split cost?

    python -m benchmarks.projection_split --seq 37810 8192 --reps 9

The attention can take the fused projection by token chunks, keeping only K and V whole (``rows``:
each chunk projected whole, its K/V columns copied into a [S, 2*H*D] buffer), or project K and V for
every token first (the weight's last 2*H*D rows, one GEMM) and Q by token chunks (``columns``), so the
fused [S, 3*H*D] buffer never exists whole. This checks, on the GPU it runs on, that the pieces equal
the fused projection bit for bit (bf16 ``F.linear``; with comfy-kitchen also its ``int8_linear`` on int8 tensor-wise weights with
convrot, as the bundled checkpoint stores them), and times the fused projection against the split
one, interleaved rep by rep. Random data at H3's shapes (hidden 5376, 56 heads of 128).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.measure import event_timed, interleaved_times, summary
from devkit.pack import submodule

h3_block = submodule("kernels.h3_block")

HIDDEN, INNER = 5376, 56 * 128


def int8_projection():
    """(quantise weight, linear) with comfy-kitchen's int8 tensor-wise + convrot GEMM, or None."""
    try:
        import comfy_kitchen as ck
    except Exception:
        return None

    def quantise(w):
        scale = w.float().abs().max() / 127.0
        return (w.float() / scale).round().clamp(-127, 127).to(torch.int8), scale

    def linear(x, qdata, scale):
        return ck.int8_linear(x, qdata, scale, None, x.dtype, convrot=True, convrot_groupsize=256)
    return quantise, linear


def by_columns(linear, x, chunk):
    """(kv [S, 2*INNER], [(a, b, q rows a:b)]): K/V columns for every token, then Q by token chunks."""
    kv = linear(x, INNER, 3 * INNER)
    return kv, [(a, b, linear(x[a:b], 0, INNER)) for a, b in h3_block.token_chunks(x.shape[0], chunk, align=128)]


def by_rows(linear, x, chunk):
    """The same from the fused projection of each token chunk (K/V columns copied out)."""
    kv = x.new_empty(x.shape[0], 2 * INNER)
    qs = []
    for a, b in h3_block.token_chunks(x.shape[0], chunk, align=128):
        part = linear(x[a:b], 0, 3 * INNER)
        kv[a:b].copy_(part[:, INNER:])
        qs.append((a, b, part[:, :INNER]))
    return kv, qs


def check(seq, chunk, reps, warmup, device):
    gen = torch.Generator(device=device).manual_seed(seq)
    x = torch.randn(seq, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
    w = (torch.randn(3 * INNER, HIDDEN, generator=gen, device=device) * HIDDEN ** -0.5).to(torch.bfloat16)
    formats = {"bf16": lambda x, lo, hi: F.linear(x, w[lo:hi])}
    int8 = int8_projection()
    if int8 is not None:
        quantise, int8_linear = int8
        qdata, scale = quantise(w)
        formats["int8_convrot"] = lambda x, lo, hi: int8_linear(x, qdata[lo:hi], scale)
    result = {"seq": seq, "chunk": chunk, "formats": {}}
    for name, linear in formats.items():
        fused = linear(x, 0, 3 * INNER)
        same = {}
        for split, fn in (("rows", by_rows), ("columns", by_columns)):
            kv, qs = fn(linear, x, chunk)
            same[split] = torch.equal(kv, fused[:, INNER:]) and all(torch.equal(q, fused[a:b, :INNER]) for a, b, q in qs)
            del kv, qs
        del fused
        times = interleaved_times({"fused": event_timed(lambda: linear(x, 0, 3 * INNER)),
                                   "rows": event_timed(lambda: by_rows(linear, x, chunk)),
                                   "columns": event_timed(lambda: by_columns(linear, x, chunk))}, reps, warmup)
        ms = {k: summary(v)["p50_seconds"] * 1e3 for k, v in times.items()}
        result["formats"][name] = {"bit_identical": same, "p50_ms": ms,
                                   "fused_over": {k: ms["fused"] / ms[k] for k in ("rows", "columns")}}
        print(f"S={seq} chunk={chunk} {name}: bit-identical to the fused projection: rows {same['rows']}, "
              f"columns {same['columns']}; p50 fused {ms['fused']:.3f} ms, rows {ms['rows']:.3f} ms "
              f"({ms['fused'] / ms['rows']:.3f}x), columns {ms['columns']:.3f} ms ({ms['fused'] / ms['columns']:.3f}x)",
              flush=True)
    return result


def split_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the split benchmarks (this one and ``mlp_split``): lengths, chunk sizes, reps."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[37810, 8192])
    parser.add_argument("--chunk", type=int, nargs="+", default=[8192])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None)
    return parser


def main(argv=None):
    args = split_parser(__doc__).parse_args(argv)
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = [check(s, c, args.reps, args.warmup, device) for s in args.seq for c in args.chunk]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
