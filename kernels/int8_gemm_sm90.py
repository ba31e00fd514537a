"""The int8 GEMM's Hopper kernel, warp-specialised, in Gluon (Triton's tile language with explicit layouts, shared
memory, barriers and warp partitions). Same int32 sums and the same epilogue steps as ``int8_gemm``'s portable
kernel, its bits twin: the CPU tests check that one under the interpreter, tests/gpu ties this one to it and to
comfy-kitchen's CUTLASS GEMM bit for bit.

One loader warp streams both operands through TMA into a ring of shared-memory stages, ahead of the MMAs and across
tile boundaries (while the epilogue runs). Two MMA warpgroups share each 128 x 256 output tile: asynchronous
``wgmma`` (int8 x int8 -> exact int32), one stage in flight, each stage handed back to the loader once the MMA that
read it is done. The epilogue (CUTLASS's fp32 steps, bf16) goes out through shared memory and a TMA store that
overlaps the next tile's MMAs. TMA zero-fills reads past the edges (the sums stay exact) and clips the store.
Coordinates are element indices (< 2**31 rows and columns); addresses are 64-bit.

Measured (H100, Triton 3.6) against a two-consumer ping-pong of 128 x 128 tiles (one warpgroup each, main loops
taking turns so one's epilogue hides behind the other's MMAs): this cooperative tiling was 1-6% faster at H3's four
linears, so only it is kept (docs/BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses

try:  # Gluon is experimental; int8_gemm.GLUON_TRITON names the Triton releases this file was measured with
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6's name; later releases' name
    GLUON_ERROR = None
except Exception as exc:  # noqa: BLE001 - whatever stops the import means the kernel is not here
    gluon = gl = GluonDescriptor = cta_barrier = None
    GLUON_ERROR = f"Triton's Gluon is not importable ({type(exc).__name__}: {exc})"


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """The warp-specialised kernel's tiling: output tile, K step, ring depth, M tiles per L2 group."""
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 6
    group_m: int = 8

    @property
    def shared_bytes(self) -> int:
        """The ring, the output tile and the barriers: within Hopper's 227 KiB a block."""
        return (self.stages * (self.block_m + self.block_n) * self.block_k + self.block_m * self.block_n * 2
                + 2 * 8 * self.stages)


SM90 = WsConfig()       # H100 / H200: the fastest of the tilings measured (docs/BENCHMARKS.md)
MMA_WARPS = 8           # two warpgroups, 64 rows each; an int32 64 x 256 accumulator is 128 registers a thread
LOADER_REGS = 40        # the loader warp holds a few scalars
MAX_REGS = 168          # 12 warps (the MMA warpgroups and the loader's) x 32 threads x 168 <= 65,536
GATED_ROWS = 32         # rows of the residual a gated epilogue reads at a time (32 x 256: 32 values a thread)


if gl is not None:
    @gluon.jit
    def _tile_origin(tile, tiles_m, tiles_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """The first row and column of output tile ``tile``: GROUP_M row tiles share each column tile's weights while
        they are in L2 (the portable kernel's order)."""
        tiles_per_group = GROUP_M * tiles_n
        first_m = (tile // tiles_per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        row0 = (first_m + (tile % tiles_per_group) % group_rows) * BLOCK_M
        col0 = ((tile % tiles_per_group) // group_rows) * BLOCK_N
        return row0, col0

    @gluon.jit
    def _loader(a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K, GROUP_M: gl.constexpr):
        """One warp: every K step of every tile of this program, in order, into the next free stage."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_ring.type.shape[0]
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        step = 0
        for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            row0, col0 = _tile_origin(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
            for ks in range(gl.cdiv(K, BLOCK_K)):
                slot = step % STAGES
                # a stage starts free: its first wait is on the phase before the first
                mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, ks * BLOCK_K], ready.index(slot), a_ring.index(slot))
                tma.async_copy_global_to_shared(b_desc, [col0, ks * BLOCK_K], ready.index(slot), b_ring.index(slot))
                step += 1

    @gluon.jit
    def _mul_rn(a, b):
        """``a * b`` rounded on its own (``.rn``: never contracted into an FMA)."""
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _add_gated_residual(c_smem, out_ptr, gate_ptr, row0, col0, M, N, stride_out, ROWS: gl.constexpr):
        """The product in ``c_smem`` (bf16, as stock's output holds it) replaced by ``residual + product * gate``,
        the residual read from where the tile goes, ROWS rows at a time in 16-byte vectors (coalesced, few
        registers: the accumulator is dead by now)."""
        BLOCK_M: gl.constexpr = c_smem.type.shape[0]
        BLOCK_N: gl.constexpr = c_smem.type.shape[1]
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                warps_per_cta=[gl.num_warps(), 1], order=[1, 0])
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        gate = gl.expand_dims(gl.load(gate_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
        cta_barrier()  # every warp's product is in c_smem
        for r in gl.static_range(0, BLOCK_M, ROWS):
            rows = row0 + r + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
            ok = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
            at = gl.expand_dims(rows.to(gl.int64) * stride_out, 1) + gl.expand_dims(cols, 0)
            residual = gl.load(out_ptr + at, mask=ok, other=0.0).to(gl.float32)
            part = c_smem.slice(r, ROWS, dim=0)
            # the product of two bf16 values is exact in fp32: fused into an FMA or not, one rounding
            part.store((residual + part.load(layout).to(gl.float32) * gate).to(gl.bfloat16))

    @gluon.jit
    def _mma_and_epilogue(a_ring, b_ring, ready, empty, c_smem, out_desc, out_ptr, x_scale_ptr, w_scale_ptr,
                          bias_ptr, gate_ptr, M, N, K, stride_out, GROUP_M: gl.constexpr,
                          SCALE_PER_COLUMN: gl.constexpr, HAS_BIAS: gl.constexpr, GATED: gl.constexpr,
                          GATED_ROWS: gl.constexpr):
        """The MMA warpgroups: every tile of this program, its K steps off the ring, then its epilogue. GATED: the
        output is the residual, ``out += bf16(product) * gate`` (stock's ``addcmul_``: one rounding, the product of
        two bf16 values being exact in fp32)."""
        BLOCK_M: gl.constexpr = c_smem.type.shape[0]
        BLOCK_N: gl.constexpr = c_smem.type.shape[1]
        BLOCK_K: gl.constexpr = a_ring.type.shape[2]
        STAGES: gl.constexpr = a_ring.type.shape[0]
        # m64 n128 k32 wgmma atoms (Triton 3.6 lowers no int8 n256), two warpgroups stacked along M
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                             instr_shape=[16, min(BLOCK_N, 128), 32])
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        zeros = gl.zeros((BLOCK_M, BLOCK_N), gl.int32, acc_layout)
        step = 0
        for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            row0, col0 = _tile_origin(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
            acc = zeros
            done = 0
            for ks in range(k_steps):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                acc = warpgroup_mma(a_ring.index(slot), b_ring.index(slot).permute((1, 0)), acc, use_acc=ks > 0,
                                    is_async=True)
                # the MMA before this one has finished reading its stage: hand that stage back to the loader
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                mbarrier.arrive(empty.index(done), count=1, pred=ks > 0)
                done = slot
                step += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index(done), count=1)

            # CUTLASS's epilogue: acc times the row's scale, then times the weight's scale plus the bias in one
            # rounding (a plain product without a bias), then bf16
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            x_scale = gl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
            t = _mul_rn(acc.to(gl.float32), gl.expand_dims(x_scale, 1))
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            if SCALE_PER_COLUMN:
                w_scale = gl.expand_dims(gl.load(w_scale_ptr + cols, mask=cols < N, other=0.0), 0)
            else:
                w_scale = gl.load(w_scale_ptr)
            if HAS_BIAS:
                bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
                y = gl.fma(t, w_scale, gl.expand_dims(bias, 0))
            else:
                y = _mul_rn(t, w_scale)
            tma.store_wait(0)  # the previous tile's store has left c_smem
            c_smem.store(y.to(gl.bfloat16))
            if GATED:
                _add_gated_residual(c_smem, out_ptr, gate_ptr, row0, col0, M, N, stride_out, GATED_ROWS)
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [row0, col0], c_smem)
        tma.store_wait(0)

    @gluon.jit
    def _int8_gemm_sm90_kernel(a_desc, b_desc, out_desc, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr, M,
                               N, K, stride_out, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                               SCALE_PER_COLUMN: gl.constexpr, HAS_BIAS: gl.constexpr, GATED: gl.constexpr,
                               GATED_ROWS: gl.constexpr, LOADER_REGS: gl.constexpr):
        a_ring = gl.allocate_shared_memory(gl.int8, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_ring = gl.allocate_shared_memory(gl.int8, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_smem = gl.allocate_shared_memory(gl.bfloat16, out_desc.block_type.shape, out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_mma_and_epilogue, (a_ring, b_ring, ready, empty, c_smem, out_desc, out_ptr, x_scale_ptr, w_scale_ptr,
                                 bias_ptr, gate_ptr, M, N, K, stride_out, GROUP_M, SCALE_PER_COLUMN, HAS_BIAS, GATED,
                                 GATED_ROWS)),
            (_loader, (a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K, GROUP_M)),
        ], [1], [LOADER_REGS])


def descriptor_layouts(cfg: WsConfig):
    """The shared-memory layouts of the A, B and output tiles (128-byte swizzles: what wgmma and TMA want)."""
    return (gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], gl.int8),
            gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], gl.int8),
            gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_n], gl.bfloat16))


def launch(cfg: WsConfig, xq, x_scale, qdata, w_scale, bias, out, programs: int, gate=None) -> None:
    """Run the kernel: xq [m, k] and qdata [n, k] int8, contiguous, 16-byte aligned, k a multiple of 16; x_scale [m]
    and w_scale [1] or [n] fp32; bias [n] bf16 or None; out bf16 [m, n], last dim contiguous, 16-byte aligned start
    and row pitch (the TMA store's); gate [n] bf16 or None (then ``out`` is the residual the product is added to)."""
    m, k = xq.shape
    n = qdata.shape[0]
    a_layout, b_layout, c_layout = descriptor_layouts(cfg)
    a_desc = GluonDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k], a_layout)
    b_desc = GluonDescriptor.from_tensor(qdata, [cfg.block_n, cfg.block_k], b_layout)
    out_desc = GluonDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n], c_layout)
    _int8_gemm_sm90_kernel[(programs,)](
        a_desc, b_desc, out_desc, out, x_scale, w_scale, bias if bias is not None else x_scale,
        gate if gate is not None else x_scale, m, n, k, out.stride(0), STAGES=cfg.stages, GROUP_M=cfg.group_m,
        SCALE_PER_COLUMN=w_scale.numel() > 1, HAS_BIAS=bias is not None, GATED=gate is not None,
        GATED_ROWS=GATED_ROWS, LOADER_REGS=LOADER_REGS, num_warps=MMA_WARPS, maxnreg=MAX_REGS)
