"""A warp-specialised sm90 attention kernel on the pack's prepared operands (issue 21, stage 2), in Gluon.

Why a second prototype: the Triton prototype (``benchmarks/sage2_prototype.py``) reaches
SageAttention's sm90 kernel (0.95-1.05x) and no further, because Triton on Hopper cannot give one
CTA warpgroups that run independently. SageAttention's own profile says why that matters: at 37,810
tokens its time (43.6 ms) is the sum of the tensor pipe's floor (21.0 ms) and the XU pipe's floor
(21.7 ms, one exp2 a score): the softmax's exponentials and the products do not overlap. Gluon,
Triton's explicit-layout language (in every Triton wheel since 3.4, ``triton.experimental.gluon``),
writes that structure directly:

* one CTA = 128 query rows of one head = two **consumer** warpgroups of 64 rows (``gl.warp_specialize``),
  sharing one ring of ``stages`` K/V tiles loaded by TMA, each tile with its own ready barrier (K's
  and V's apart, so Q.K^T can start before V lands) and one "empty" barrier both consumers release;
* each consumer runs the Triton prototype's arithmetic (``m64n128w4s3_cvt_groupk_tma``: int8 Q.K^T in
  int32, to float, both scales once per (row, K-scale group), online softmax with SageAttention's
  fp8 offset, P rounded to e4m3 and relabelled to V's stored positions with no data movement, a fresh
  fp32 P.V a block added to the rescaled accumulator), **software-pipelined**: block j+1's Q.K^T and
  block j's P.V are issued together, and block j+1's softmax runs while block j's P.V works;
* **ping-pong** (``pingpong``): the consumers take turns to issue their products (an mbarrier each
  way), so one warpgroup's softmax runs while the other's products occupy the tensor cores
  (FlashAttention-3's schedule);
* the row sums on the tensor cores, as the Triton prototype's ``_mmasum``: P . ones [N, 16] issued
  with P.V, the normaliser then being the sum of the e4m3 P that meets V. (The first cut also offered
  them on the CUDA cores, as the unrounded P's sums: on the H200, 2026-12-05, that variant gave wrong
  rows, a relative error of 0.15 at 128 tokens and NaN at 300, though it compiled with no spills and
  its loop read right; the cause was not found, and it was removed.)

There is no producer warp: with one (and ``setmaxnreg`` to move registers to the consumers) ptxas
serialises every wgmma of the consumer worker partition for want of registers. The consumers load
instead: once both have released a block's stage, consumer 0 issues the next K tile and consumer 1
the next V tile, predicated rather than branched on, because P must reach its wgmma in the basic
block where it is converted (across a branch or a loop iteration its bytes are unpacked and
repacked, +128 instructions a block). docs/BENCHMARKS.md has the machine-code reading.

Operands and output are the prototype's (``sage2_prototype`` docstring; devkit/sage2_oracle.py):
int8 Q/K [H, S, D] with SageAttention's per-thread scales, e4m3 V [H, D, S_pad] in SageAttention's
16-token permuted order, per-channel V scales; bf16 out [S, H, D]. The kernel's parameters are the
prototype kernel's, so ``benchmarks.triton_aot`` builds it ahead of time the same way. Offsets are
64-bit (each head's base pointer is formed in int64; TMA coordinates are 32-bit element indices within
one head, below 2**31 for any S).

The Gluon code is ``benchmarks/sage2_ws_kernel.py``, imported only to compile or JIT-launch it: the
configs, the ahead-of-time launch and the harness load on any Triton.

Status: a prototype in benchmarks/; no back-end imports it. On the H200 it runs at 0.83-0.90x
SageAttention's sm90 kernel (8 warps an SM against its 12; docs/BENCHMARKS.md has the profile).
Compiled and read here without a GPU (``tests/unit/test_sage2_ws.py``); Gluon has no CPU
interpreter, so its results and times come only from a GPU: ``tests/gpu/test_sage2_prototype_gpu.py``
and ``python -m benchmarks.sage2_prototype --configs ws ...`` (the ``ws_*`` configs run through the
prototype's harness beside SageAttention).
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks import sage2_prototype as proto

D = proto.D
ROWS = 64  # query rows a consumer warpgroup owns (one m64 wgmma row block)
CONSUMERS = 2
NUM_WARPS = 4  # each partition's warps: the default partition (consumer 0) and consumer 1


@dataclass(frozen=True)
class WsConfig:
    """One warp-specialised variant."""

    block_n: int = 128  # keys a block
    stages: int = 3  # K/V ring depth: block b + stages is loaded once block b is retired
    pingpong: bool = True  # consumers take turns to issue their products
    overlap_pv: bool = True  # a block's softmax runs while the previous block's P.V is in flight

    @property
    def block_m(self) -> int:
        return ROWS * CONSUMERS


# names end in _mmasum like the Triton prototype's configs whose row sums are products with ones
WS_CONFIGS = {
    "ws_n128s4_pp_mmasum": WsConfig(stages=4),
    "ws_n128s3_pp_mmasum": WsConfig(),
    "ws_n128s2_pp_mmasum": WsConfig(stages=2),
    "ws_n128s3_mmasum": WsConfig(pingpong=False),
    "ws_n128s3_pp_serial_mmasum": WsConfig(overlap_pv=False),
}
WS_DEFAULT = "ws_n128s4_pp_mmasum"


def ws_constexprs(cfg: WsConfig) -> dict:
    """The kernel's compile-time arguments for ``cfg``."""
    return dict(BLOCK_N=cfg.block_n, STAGES=cfg.stages, PINGPONG=cfg.pingpong, OVERLAP=cfg.overlap_pv)


def gluon_problem() -> str | None:
    """Why this Triton cannot compile the kernel (no Triton, no Gluon, another Gluon API), or None."""
    try:
        import benchmarks.sage2_ws_kernel  # noqa: F401
    except Exception as exc:  # an older Gluon fails at definition time, not only at import
        return f"the warp-specialised prototype needs Triton's Gluon (3.8's API): {type(exc).__name__}: {exc}"
    return None


def _kernel():
    problem = gluon_problem()
    if problem:
        raise RuntimeError(problem)
    from benchmarks.sage2_ws_kernel import _ws_kernel
    return _ws_kernel


def compile_sm90(cfg: WsConfig):
    """The kernel compiled for sm90 (no GPU needed), with a real launch's specialisations: every pointer
    and the operands' padded lengths divisible by 16, the sequence length left unspecialised."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from benchmarks.triton_aot import DIVISIBLE_BY_16, SIGNATURE

    kernel = _kernel()
    names = list(kernel.arg_names)
    signature = {n: SIGNATURE.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE_BY_16}
    source = GluonASTSource(kernel, signature=signature, constexprs=ws_constexprs(cfg), attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS))


def ws_attention(ops: dict, sm_scale: float, config: str | WsConfig = WS_DEFAULT, aot=None):
    """Attention from prepared operands -> bf16 [S, H, D], by the warp-specialised kernel (sm90 only).
    ``aot``: a ``benchmarks.triton_aot.Cubins`` holding the named config's cubin."""
    cfg = WS_CONFIGS[config] if isinstance(config, str) else config
    out, grid, values = proto.launch_arguments(ops, sm_scale, cfg.block_m)
    if aot is not None:
        return proto.launch_ahead_of_time(aot, config, grid, values, out)
    kernel = _kernel()
    proto.scratch_allocator()
    kernel[grid](*values, **ws_constexprs(cfg), num_warps=NUM_WARPS)
    return out
