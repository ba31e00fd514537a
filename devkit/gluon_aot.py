"""Build the int8 GEMM's warp-specialised Hopper kernel (kernels/int8_gemm_sm90.py, Gluon) ahead of time for sm90,
down to a cubin, without a GPU (Triton's own ptxas), as its launcher would launch it: the CPU tests' check that it
builds with the installed Triton and is the kernel it says (int8 wgmma, TMA, register reallocation), within shared
memory.

    python -m devkit.gluon_aot        # one line per specialisation: shared bytes, cubin bytes"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .pack import submodule


@functools.cache  # one build per specialisation in a process (the tests ask for some twice)
def build(bias: bool, per_column: bool, gated: bool = False):
    """The compiled kernel for one specialisation (a bias or not, one weight scale or one per column, a gated
    residual added in the epilogue or not)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sm90 = submodule("kernels.int8_gemm_sm90")
    cfg = sm90.SM90
    a_layout, b_layout, c_layout = sm90.descriptor_layouts(cfg)
    signature = {"a_desc": f"tensordesc<i8[{cfg.block_m}, {cfg.block_k}],{a_layout!r}>",
                 "b_desc": f"tensordesc<i8[{cfg.block_n}, {cfg.block_k}],{b_layout!r}>",
                 "out_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_n}],{c_layout!r}>",
                 "out_ptr": "*bf16", "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16",
                 "gate_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_out": "i32"}
    constexprs = {"STAGES": cfg.stages, "GROUP_M": cfg.group_m, "SCALE_PER_COLUMN": per_column, "HAS_BIAS": bias,
                  "GATED": gated, "GATED_ROWS": sm90.GATED_ROWS, "LOADER_REGS": sm90.LOADER_REGS}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    names = list(signature)
    # pointers 16-byte aligned, the output's width and row pitch multiples of 16 elements, as the JIT specialises them
    # at H3's widths
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
             if ty.startswith("*") or name in ("N", "stride_out")}
    source = GluonASTSource(sm90._int8_gemm_sm90_kernel, signature,
                            {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": sm90.MMA_WARPS, "maxnreg": sm90.MAX_REGS})


def spilled_bytes(kernel) -> int:
    """Bytes of registers ``kernel`` spills at its register cap (ptxas's report on its PTX)."""
    from triton.backends.nvidia.compiler import get_ptxas

    sm90 = submodule("kernels.int8_gemm_sm90")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f"--maxrregcount={sm90.MAX_REGS}",
                                 str(ptx), "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True,
                                check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def main() -> int:
    for bias in (False, True):
        for per_column in (False, True):
            for gated in (False, True):
                kernel = build(bias, per_column, gated)
                print(f"bias={bias!s:<5} per_column={per_column!s:<5} gated={gated!s:<5} shared "
                      f"{kernel.metadata.shared} B, cubin {len(kernel.asm['cubin'])} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
