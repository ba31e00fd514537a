"""What do the H3 MLP's GEMMs cost when the block fast path takes them by token chunks?

    python -m benchmarks.mlp_split --seq 37810 8192 --chunk 8192 12608 19008 --reps 9

The block fast path runs fc1 (5376 -> 28672) and fc2 (14336 -> 5376) a token chunk at a time
(``Settings.mlp_chunk_tokens`` rows, ``int8_mlp_chunk_tokens`` with int8 weights, split by
``kernels.h3_block.token_chunks``) so the [S, 28672] intermediate never exists whole. Each chunk is
a GEMM of another shape, for which cuBLAS may pick other tiles than for the whole one. This times
each linear whole against the same linear by chunks, interleaved rep by rep, per chunk size, and
checks that the chunks give the whole product's bits (bf16 ``F.linear``; with comfy-kitchen also
its ``int8_linear`` on int8 tensor-wise weights with convrot, as the bundled checkpoint stores
them). Random data at H3's shapes; the SwiGLU between the two linears is left out (it is
elementwise: chunking does not change its cost per row).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from benchmarks.measure import device_timed, interleaved_times, summary
from benchmarks.projection_split import int8_projection, split_parser
from devkit.pack import submodule

h3_block = submodule("kernels.h3_block")

HIDDEN, FFN = 5376, 14336
LINEARS = {"fc1": (HIDDEN, 2 * FFN), "fc2": (FFN, HIDDEN)}  # name: (in features, out features)


def chunk_outputs(linear, x, chunk):
    """The linear of each token chunk, as the block fast path splits the rows."""
    return [linear(x[a:b]) for a, b in h3_block.token_chunks(x.shape[0], chunk)]


def by_chunks(linear, x, chunk):
    """The linear of each token chunk, written into one [S, out] result."""
    parts = chunk_outputs(linear, x, chunk)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def linear_formats(w):
    """{format name: x -> x @ w.T in that format}: bf16 always, int8_convrot with comfy-kitchen."""
    formats = {"bf16": lambda x: F.linear(x, w)}
    int8 = int8_projection()
    if int8 is not None:
        quantise, int8_linear = int8
        qdata, scale = quantise(w)
        formats["int8_convrot"] = lambda x: int8_linear(x, qdata, scale)
    return formats


def tflops(rows, fan_in, fan_out, ms):
    return 2 * rows * fan_in * fan_out / (ms * 1e-3) / 1e12


def check(seq, chunks, reps, warmup, device):
    """One sequence length: per linear and format, bits of each chunking and p50 of whole vs chunks."""
    result = {"seq": seq, "linears": {}}
    for name, (fan_in, fan_out) in LINEARS.items():
        gen = torch.Generator(device=device).manual_seed(seq + fan_out)
        x = torch.randn(seq, fan_in, generator=gen, device=device).to(torch.bfloat16)
        w = (torch.randn(fan_out, fan_in, generator=gen, device=device) * fan_in ** -0.5).to(torch.bfloat16)
        per_format = {}
        for fmt, linear in linear_formats(w).items():
            whole = linear(x)
            same = {c: torch.equal(by_chunks(linear, x, c), whole) for c in chunks}
            del whole
            runners = {"whole": device_timed(lambda: linear(x), device)}
            runners.update({f"chunk {c}": device_timed(lambda c=c: chunk_outputs(linear, x, c), device)
                            for c in chunks})
            times = interleaved_times(runners, reps, warmup)
            ms = {k: summary(v)["p50_seconds"] * 1e3 for k, v in times.items()}
            rate = {k: tflops(seq, fan_in, fan_out, v) for k, v in ms.items()}
            per_format[fmt] = {"bit_identical": {str(c): same[c] for c in chunks}, "p50_ms": ms,
                               "whole_over": {k: ms["whole"] / v for k, v in ms.items()}, "tflops": rate}
            cells = ", ".join(f"{k} {v:.3f} ms ({ms['whole'] / v:.3f}x, {rate[k]:.3g} TFLOP/s)" for k, v in ms.items())
            print(f"S={seq} {name} {fmt}: same bits as whole: "
                  f"{', '.join(f'{c}: {s}' for c, s in same.items())}; p50 {cells}", flush=True)
        result["linears"][name] = per_format
        del x, w
    return result


def main(argv=None):
    parser = split_parser(__doc__)
    parser.add_argument("--device", default="cuda", help="cuda (timings that mean something) or cpu (a smoke run)")
    args = parser.parse_args(argv)
    if any(c <= 0 for c in args.chunk):
        parser.error("--chunk sizes must be positive")
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}", flush=True)
    results = [check(s, args.chunk, args.reps, args.warmup, device) for s in args.seq]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
