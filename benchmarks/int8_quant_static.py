"""The pack's int8 ConvRot activation quantiser without a GPU: compiled for sm90 here, read from its
machine code, for H3's four quantised inputs.

    python -m benchmarks.int8_quant_static [--out static.json]

Per width (qkv and fc1: 5,376, fc1's with the block's modulation applied first; out: 7,168; fc2: the
SwiGLU of 28,672 -> 14,336) and warp count this
compiles ``kernels.int8_activation._quantize_rows_kernel`` for sm90 as a launch specialises it and
reads the cubin (benchmarks/sm90_static.py's tools): registers, stack (spills), shared memory and the
instructions of one row's program. The kernel has no loop, so the listing is what each thread issues;
a row costs ``listing x threads`` thread instructions. Two times follow for 37,810 rows: the issue
floor (every scheduler issuing one warp instruction a cycle, at the clock of the committed Nsight
profile) and the bytes-moved floor at 4.0 TB/s; the kernel's time is at least the larger. comfy-kitchen's
CUDA kernel measured 3.18 ms for a block's three 5,376- and 7,168-wide calls and 2.56 ms for the SwiGLU
call at 37,810 rows on an H200 (benchmarks/results/block-path/h200-2026-12-04-norm-rope, profiler section). Times on the GPU:
tests/gpu/test_int8_activation_gpu.py prints them beside comfy-kitchen's."""

from __future__ import annotations

import collections

from benchmarks.sm90_static import SCHEDULERS, _run_tool, instructions, opcode, pass_reader_cli, resources

ROWS = 37810
HBM_BYTES_PER_S = 4.0e12
# (name, quantised width, SwiGLU folded in, modulation folded in)
H3_INPUTS = (("qkv_proj input", 5376, False, False), ("fc1 input, modulation folded in", 5376, False, True),
             ("out_proj input", 7168, False, False), ("fc2 input (SwiGLU)", 14336, True, False))
SIGNATURE = dict(X="*bf16", S1="*bf16", B="*bf16", Q="*i8", SCALE="*fp32", K="i32", stride_x="i64", stride_p="i64",
                 stride_q="i64", inv_127="fp32", bf16_max="fp32")
DIVISIBLE_BY_16 = ("X", "S1", "B", "Q", "SCALE", "K", "stride_x", "stride_q")  # H3's widths and buffers


def compile_sm90(width: int, swiglu: bool, warps: int, arch: int = 90, modulation: bool = False):
    """The kernel as a launch for ``width`` specialises it, compiled for sm90 (or ``arch``); ``modulation``:
    the variant that applies the block's modulation to its input first."""
    import triton
    from triton.backends.compiler import GPUTarget

    from devkit.pack import submodule

    ia = submodule("kernels.int8_activation")
    kernel = ia._quantize_rows_kernel
    names = list(kernel.arg_names)
    g1, g2, g3 = ia.row_tiles(width // ia.GROUP)
    source = triton.compiler.ASTSource(
        kernel, signature={n: SIGNATURE.get(n, "constexpr") for n in names},
        constexprs={"SWIGLU": swiglu, "MOD": modulation, "G1": g1, "G2": g2, "G3": g3, "EMULATE": False},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE_BY_16})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def analyse(width: int, swiglu: bool, warps: int, clock_hz: float, modulation: bool = False) -> dict:
    kernel = compile_sm90(width, swiglu, warps, modulation=modulation)
    cubin = kernel.asm["cubin"]
    listing, _ = instructions(_run_tool("nvdisasm", ["-c"], cubin))
    per_row = len(listing) * 32 * warps
    moved = ROWS * width * (2 * (2 if swiglu else 1) + 1)  # bf16 in (gate and up), int8 out
    return {"width": width, "swiglu": swiglu, "modulation": modulation, "warps": warps, **resources(cubin), "shared_bytes": int(kernel.metadata.shared),
            "instructions_per_thread": len(listing), "thread_instructions_per_row": per_row,
            "issue_floor_ms": per_row * ROWS / 32 / (SCHEDULERS * clock_hz) * 1e3,
            "bytes_floor_ms": moved / HBM_BYTES_PER_S * 1e3,
            "mix": dict(collections.Counter(opcode(i) for i in listing).most_common(10))}


def table(clock: float) -> list[dict]:
    from devkit.pack import submodule

    row_warps = submodule("kernels.int8_activation").row_warps
    results = []
    print(f"| input | width | warps | registers | stack | shared | instr. a thread | floor at {ROWS:,} rows: issue / bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for name, width, swiglu, modulation in H3_INPUTS:
        default = row_warps(width)
        for warps in sorted({default, 2 * default}):
            r = analyse(width, swiglu, warps, clock, modulation)
            results.append(dict(r, input=name, default=warps == default))
            print(f"| {name} | {width:,} | {warps}{' (default)' if warps == default else ''} | {r['registers']} | "
                  f"{r['stack_bytes']} | {r['shared_bytes']:,} | {r['instructions_per_thread']} | "
                  f"{r['issue_floor_ms']:.3f} / {r['bytes_floor_ms']:.3f} ms |")
    return results


def main(argv=None) -> list[dict]:
    return pass_reader_cli(__doc__, argv, table)


if __name__ == "__main__":
    main()
