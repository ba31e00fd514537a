"""The bf16 block passes without a GPU: compiled for sm90 here, read from their machine code, with
``round_bf16``'s two forms (integer operations, or the hardware's ``cvt.rn.bf16x2.f32``).

    python -m benchmarks.passes_static [--out static.json]

Per pass (the exact path's RMSNorm+RoPE, modulation, gated residual and SwiGLU; ``fused`` mode's
norm+modulation and SwiGLU) this compiles the Triton kernel as a launch at H3's shapes specialises it
(benchmarks/sm90_static.py's tools) and reads the cubin: registers, spills, and the instructions one
thread issues (a loop's body counted once per trip). Two floors follow for 37,810 tokens: issue (every
scheduler issuing one warp instruction a cycle, at the clock of the committed Nsight profile) and
bytes moved at 4.0 TB/s; a pass takes at least the larger. Static counts, not a timing: on an H100
neither form was consistently faster (within 4% either way; docs/BENCHMARKS.md, 2026-12-05), the
elementwise passes streaming 2.5-2.9 TB/s and RMSNorm+RoPE 2.1 TB/s in both forms.
tests/gpu/test_norm_rope_gpu.py and tests/gpu/test_block_path_gpu.py check the bits on the GPU,
``benchmarks.prep_passes`` times the passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.int8_quant_static import HBM_BYTES_PER_S
from benchmarks.sm90_static import (SCHEDULERS, _run_tool, instructions, loop_spans, pass_reader_cli, print_table,
                                    resources)

TOKENS, HIDDEN, HEADS, HEAD_DIM, ROT_HALF, FFN = 37810, 5376, 56, 128, 48, 14336
BF16 = "*bf16"


@dataclass
class Pass:
    """One kernel launch pattern: its signature and constexprs, its grid at 37,810 tokens, the trips of
    its loop (1: none), the bytes it moves, and its warps."""
    name: str
    kernel: str  # module.attribute under kernels/
    signature: dict
    constexprs: dict
    programs: int
    trips: int
    bytes_moved: int
    warps: int
    divisible: tuple = field(default=())


def block_passes() -> list[Pass]:
    from devkit.pack import submodule

    h3_block, fused = submodule("kernels.h3_block"), submodule("kernels.h3_block_fused")
    qk = submodule("kernels.qk_transform")
    tokens, heads, warps, _ = qk.NORM_ROPE_CONFIG
    br, bc = h3_block.BLOCK_ROWS, h3_block.BLOCK_COLS
    tiles = -(-TOKENS // br) * -(-HIDDEN // bc)
    row = TOKENS * HIDDEN * 2  # one [S, hidden] bf16 tensor
    rows = dict(rows="i32", cols="i32")
    t1, t2, t3 = submodule("kernels.triton_support").row_tiles(HIDDEN)
    norm_signature = dict(x_ptr=BF16, other_ptr=BF16, gate_ptr=BF16, w_ptr=BF16, scale_ptr=BF16, shift_ptr=BF16,
                          h_ptr=BF16, cols="i32", stride_x="i64", stride_o="i64", stride_h="i64", stride_p="i64",
                          eps="fp32")
    norm_aligned = ("x_ptr", "other_ptr", "h_ptr", "stride_x", "stride_o", "stride_h")
    swiglu_signature = dict(u_ptr=BF16, y_ptr=BF16, rows="i32", half="i32", stride_u="i64", stride_y="i64")
    swiglu_aligned = ("u_ptr", "y_ptr", "stride_u", "stride_y")
    swiglu_bytes = 3 * TOKENS * FFN * 2  # both halves read, the product written
    return [
        Pass("RMSNorm+RoPE on Q and K (exact)", "qk_transform._norm_rope_kernel",
             dict(Q=BF16, K=BF16, T="*fp32", QW=BF16, KW=BF16, S="i32", H="i32", sqs="i64", sqh="i64", sks="i64",
                  skh="i64", sts="i64", stp="i64", str_="i64", stc="i64", eps="fp32"),
             dict(D=HEAD_DIM, P=ROT_HALF, PP=64, TAIL=HEAD_DIM - 2 * ROT_HALF, TP=32, R=tokens, HG=heads,
                  QK_FIRST=qk.NORM_ROPE_CONFIG[3], EMULATE=False),
             -(-TOKENS // tokens) * -(-HEADS // heads), heads, 4 * TOKENS * HEADS * HEAD_DIM * 2, warps,
             ("Q", "K", "T", "QW", "KW", "sqs", "sqh", "sks", "skh")),
        Pass("modulation (exact)", "h3_block._scale_shift_kernel",
             dict(h_ptr=BF16, scale_ptr=BF16, shift_ptr=BF16, **rows, stride_row="i64"),
             dict(PER_ROW=False, BLOCK_R=br, BLOCK_C=bc), tiles, 1, 2 * row, 4, ("h_ptr", "stride_row")),
        Pass("gated residual (exact)", "h3_block._gated_residual_kernel",
             dict(x_ptr=BF16, y_ptr=BF16, gate_ptr=BF16, **rows, stride_x="i64", stride_y="i64"),
             dict(PER_ROW=False, BLOCK_R=br, BLOCK_C=bc), tiles, 1, 3 * row, 4, ("x_ptr", "y_ptr", "stride_x", "stride_y")),
        Pass("SwiGLU (exact)", "h3_block._swiglu_exact_kernel", swiglu_signature,
             dict(EMULATE=False, BLOCK_R=br, BLOCK_C=bc), -(-TOKENS // br) * -(-FFN // bc), 1, swiglu_bytes, 4,
             swiglu_aligned),
        Pass("norm + modulation (fused)", "h3_block_fused._norm_modulate_kernel", norm_signature,
             dict(RESIDUAL=False, WEIGHT=True, T1=t1, T2=t2, T3=t3), TOKENS, 1, 2 * row,
             fused.norm_modulate_warps(HIDDEN), norm_aligned),
        Pass("gated residual + norm + modulation (fused)", "h3_block_fused._norm_modulate_kernel", norm_signature,
             dict(RESIDUAL=True, WEIGHT=True, T1=t1, T2=t2, T3=t3), TOKENS, 1, 4 * row,
             fused.norm_modulate_warps(HIDDEN), norm_aligned),
        Pass("SwiGLU (fused)", "h3_block_fused._swiglu_kernel", swiglu_signature,
             dict(BLOCK_R=fused.SWIGLU_ROWS, BLOCK_C=fused.SWIGLU_COLS),
             -(-TOKENS // fused.SWIGLU_ROWS) * -(-FFN // fused.SWIGLU_COLS), 1, swiglu_bytes, 4, swiglu_aligned),
    ]


def compile_pass(p: Pass, hardware_bf16: bool, arch: int = 90):
    """``p``'s kernel compiled for ``arch`` with ``round_bf16``'s hardware form or its integer form."""
    import triton
    from triton.backends.compiler import GPUTarget

    from devkit.pack import submodule

    module, attr = p.kernel.split(".")
    kernel = getattr(submodule(f"kernels.{module}"), attr)
    names = list(kernel.arg_names)
    source = triton.compiler.ASTSource(
        kernel, signature={n: p.signature.get(n, "constexpr") for n in names},
        constexprs=dict(p.constexprs, HW_BF16=hardware_bf16),
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in p.divisible})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": p.warps})


def analyse(p: Pass, hardware_bf16: bool, clock_hz: float) -> dict:
    cubin = compile_pass(p, hardware_bf16).asm["cubin"]
    listing, labels = instructions(_run_tool("nvdisasm", ["-c"], cubin))
    loops = loop_spans(listing, labels)
    body = max((b - a + 1 for a, b in loops), default=0)
    per_thread = len(listing) + (p.trips - 1) * body  # the loop's body once per trip
    warp_instructions = per_thread * p.warps * p.programs
    return {"pass": p.name, "hardware_bf16": hardware_bf16, **resources(cubin), "listing": len(listing),
            "loop_body": body, "trips": p.trips, "instructions_per_thread": per_thread,
            "issue_floor_ms": warp_instructions / (SCHEDULERS * clock_hz) * 1e3,
            "bytes_floor_ms": p.bytes_moved / HBM_BYTES_PER_S * 1e3}


def table(clock: float) -> list[dict]:
    pairs = [(p.name, *(analyse(p, hw, clock) for hw in (False, True))) for p in block_passes()]
    print_table(["pass", "registers: integer / hardware", "instr. a thread", f"issue floor at {TOKENS:,} tokens",
                 "bytes floor"],
                [[name, f"{old['registers']} / {new['registers']}",
                  f"{old['instructions_per_thread']} -> {new['instructions_per_thread']} "
                  f"({new['instructions_per_thread'] / old['instructions_per_thread'] - 1:+.0%})",
                  f"{old['issue_floor_ms']:.3f} -> {new['issue_floor_ms']:.3f} ms", f"{old['bytes_floor_ms']:.3f} ms"]
                 for name, old, new in pairs])
    return [r for _, old, new in pairs for r in (old, new)]


def main(argv=None) -> list[dict]:
    return pass_reader_cli(__doc__, argv, table)


if __name__ == "__main__":
    main()
