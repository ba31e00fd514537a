"""Build the int8 GEMM's warp-specialised Hopper kernel (kernels/int8_gemm_sm90.py, Gluon) ahead of time for sm90,
down to a cubin, without a GPU (Triton's own ptxas), as its launcher would launch it: the CPU tests' check that it
builds with the installed Triton and is the kernel it says (int8 wgmma, TMA, register reallocation), within shared
memory.

    python -m devkit.gluon_aot        # one line per specialisation: shared bytes, cubin bytes"""

from __future__ import annotations

import sys

from .pack import submodule


def build(bias: bool, per_column: bool):
    """The compiled kernel for one specialisation (a bias or not, one weight scale or one per column)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sm90 = submodule("kernels.int8_gemm_sm90")
    cfg = sm90.SM90
    a_layout, b_layout, c_layout = sm90.descriptor_layouts(cfg)
    signature = {"a_desc": f"tensordesc<i8[{cfg.block_m}, {cfg.block_k}],{a_layout!r}>",
                 "b_desc": f"tensordesc<i8[{cfg.block_n}, {cfg.block_k}],{b_layout!r}>",
                 "out_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_n}],{c_layout!r}>",
                 "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "M": "i32", "N": "i32",
                 "K": "i32"}
    constexprs = {"STAGES": cfg.stages, "GROUP_M": cfg.group_m, "SCALE_PER_COLUMN": per_column, "HAS_BIAS": bias,
                  "LOADER_REGS": sm90.LOADER_REGS}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(signature.values()) if ty.startswith("*")}
    source = GluonASTSource(sm90._int8_gemm_sm90_kernel, signature,
                            {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": sm90.MMA_WARPS, "maxnreg": sm90.MAX_REGS})


def main() -> int:
    for bias in (False, True):
        for per_column in (False, True):
            kernel = build(bias, per_column)
            print(f"bias={bias!s:<5} per_column={per_column!s:<5} shared {kernel.metadata.shared} B, "
                  f"cubin {len(kernel.asm['cubin'])} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
