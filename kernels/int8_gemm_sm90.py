"""The int8 GEMM's Hopper kernel, warp-specialised, in Gluon: ``int8_gemm``'s portable kernel's sums and epilogue
steps, bit for bit (tests/gpu). One loader warp streams both operands by TMA into a ring of shared-memory stages,
across tiles; two MMA warpgroups share each 128 x 256 output tile (async int8 ``wgmma``, one stage in flight); the
epilogue leaves by a TMA store that overlaps the next tile's MMAs (the tilings measured: docs/BENCHMARKS.md)."""

import dataclasses

from .triton_support import grouped_tile

try:  # Gluon is experimental; int8_gemm.GLUON_TRITON names the Triton releases this file was measured with
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.language.core import _aggregate as aggregate  # the Gluon tutorials' import (Triton 3.6 and later)
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # Triton 3.6's name; later releases' name
    GLUON_ERROR = None
except Exception as exc:  # noqa: BLE001 - whatever stops the import means the kernel is not here
    gluon = gl = GluonDescriptor = cta_barrier = None
    GLUON_ERROR = f"Triton's Gluon is not importable ({type(exc).__name__}: {exc})"


@dataclasses.dataclass(frozen=True)
class WsConfig:  # the warp-specialised kernel's tiling
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 6
    group_m: int = 8


SM90 = WsConfig()       # H100 / H200: the fastest of the tilings measured (docs/BENCHMARKS.md)
MMA_WARPS = 8           # two warpgroups, 64 rows each; an int32 64 x 256 accumulator is 128 registers a thread
LOADER_REGS = 40        # the loader warp holds a few scalars
MAX_REGS = 168          # 12 warps (the MMA warpgroups and the loader's) x 32 threads x 168 <= 65,536
GATED_ROWS = 32         # rows of the residual a gated epilogue reads at a time (32 x 256: 32 values a thread)


if gl is not None:
    @aggregate
    class TileScheduler:
        """The persistent walk: program p takes output tiles p, p + programs, ... in ``grouped_tile``'s order."""
        tiles_m: gl.tensor
        tiles_n: gl.tensor
        GROUP_M: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, tiles_m, tiles_n, GROUP_M):
            self.tiles_m, self.tiles_n, self.GROUP_M = tiles_m, tiles_n, gl.constexpr(GROUP_M)

        @gluon.jit
        def num_tiles(self):
            return self.tiles_m * self.tiles_n

        @gluon.jit
        def origin(self, tile, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # tile's first row and column
            pid_m, pid_n = grouped_tile(tile, self.tiles_m, self.tiles_n, self.GROUP_M)
            return pid_m * BLOCK_M, pid_n * BLOCK_N

    @aggregate
    class PartitionArgs:
        """What the partitions share: the operands' descriptors, the ring and its barriers (``ready``: a stage was
        loaded; ``empty``: its MMA is done), the output tile's shared memory and the epilogue's operands."""
        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        out_desc: tma.tensor_descriptor
        a_ring: gl.shared_memory_descriptor
        b_ring: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        c_smem: gl.shared_memory_descriptor
        out_ptr: gl.tensor
        x_scale_ptr: gl.tensor
        w_scale_ptr: gl.tensor
        bias_ptr: gl.tensor
        gate_ptr: gl.tensor
        M: gl.tensor
        N: gl.tensor
        K: gl.tensor
        stride_out: gl.tensor
        SCALE_PER_COLUMN: gl.constexpr
        HAS_BIAS: gl.constexpr
        GATED: gl.constexpr  # ``out`` is the residual: ``out += bf16(product) * gate`` (stock's ``addcmul_``)
        GATED_ROWS: gl.constexpr
        GROUP_M: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, descs, rings, c_smem, ptrs, sizes, flags):
            self.a_desc, self.b_desc, self.out_desc = descs
            self.a_ring, self.b_ring, self.ready, self.empty = rings
            self.c_smem = c_smem
            self.out_ptr, self.x_scale_ptr, self.w_scale_ptr, self.bias_ptr, self.gate_ptr = ptrs
            self.M, self.N, self.K, self.stride_out = sizes
            self.SCALE_PER_COLUMN, self.HAS_BIAS, self.GATED, self.GATED_ROWS, self.GROUP_M = (
                gl.constexpr(f) for f in flags)

    @gluon.jit
    def _loader(p):
        """One warp: each K step of each tile of this program into the next free stage."""
        BLOCK_M: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = p.b_desc.block_type.shape[0]
        STAGES: gl.constexpr = p.a_ring.type.shape[0]
        sched = TileScheduler(gl.cdiv(p.M, BLOCK_M), gl.cdiv(p.N, BLOCK_N), p.GROUP_M)
        step = 0
        for tile in range(gl.program_id(0), sched.num_tiles(), gl.num_programs(0)):
            row0, col0 = sched.origin(tile, BLOCK_M, BLOCK_N)
            for ks in range(gl.cdiv(p.K, BLOCK_K)):
                slot = step % STAGES
                # a stage starts free: its first wait is on the phase before the first
                mbarrier.wait(p.empty.index(slot), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(p.ready.index(slot), p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(p.a_desc, [row0, ks * BLOCK_K], p.ready.index(slot),
                                                p.a_ring.index(slot))
                tma.async_copy_global_to_shared(p.b_desc, [col0, ks * BLOCK_K], p.ready.index(slot),
                                                p.b_ring.index(slot))
                step += 1

    @gluon.jit
    def _mul_rn(a, b):  # rounded on its own (.rn: never contracted into an FMA)
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _tile_mma(p, acc, step, k_steps):
        """One tile's K steps off the ring into ``acc``; -> (the sum, the ring's next step)."""
        STAGES: gl.constexpr = p.a_ring.type.shape[0]
        done = 0
        for ks in range(k_steps):
            slot = step % STAGES
            mbarrier.wait(p.ready.index(slot), (step // STAGES) & 1)
            acc = warpgroup_mma(p.a_ring.index(slot), p.b_ring.index(slot).permute((1, 0)), acc, use_acc=ks > 0,
                                is_async=True)
            # the MMA before this one has finished reading its stage: hand that stage back to the loader
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(p.empty.index(done), count=1, pred=ks > 0)
            done = slot
            step += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(p.empty.index(done), count=1)
        return acc, step

    @gluon.jit
    def _epilogue(p, acc, row0, col0):
        """CUTLASS's steps (acc * x_scale, then one rounding of that * w_scale + bias), bf16, out by TMA."""
        BLOCK_M: gl.constexpr = p.c_smem.type.shape[0]
        BLOCK_N: gl.constexpr = p.c_smem.type.shape[1]
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc.type.layout))
        x_scale = gl.load(p.x_scale_ptr + rows, mask=rows < p.M, other=0.0)
        t = _mul_rn(acc.to(gl.float32), gl.expand_dims(x_scale, 1))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))
        if p.SCALE_PER_COLUMN:
            w_scale = gl.expand_dims(gl.load(p.w_scale_ptr + cols, mask=cols < p.N, other=0.0), 0)
        else:
            w_scale = gl.load(p.w_scale_ptr)
        if p.HAS_BIAS:
            bias = gl.load(p.bias_ptr + cols, mask=cols < p.N, other=0.0).to(gl.float32)
            y = gl.fma(t, w_scale, gl.expand_dims(bias, 0))
        else:
            y = _mul_rn(t, w_scale)
        tma.store_wait(0)  # the previous tile's store has left c_smem
        p.c_smem.store(y.to(gl.bfloat16))
        if p.GATED:
            _add_gated_residual(p, row0, col0)
        fence_async_shared()
        tma.async_copy_shared_to_global(p.out_desc, [row0, col0], p.c_smem)

    @gluon.jit
    def _add_gated_residual(p, row0, col0):
        """``c_smem``'s bf16 product replaced by ``residual + product * gate``, the residual read GATED_ROWS rows
        at a time in 16-byte vectors (coalesced; the accumulator is dead by now)."""
        BLOCK_M: gl.constexpr = p.c_smem.type.shape[0]
        BLOCK_N: gl.constexpr = p.c_smem.type.shape[1]
        ROWS: gl.constexpr = p.GATED_ROWS
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                warps_per_cta=[gl.num_warps(), 1], order=[1, 0])
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        gate = gl.expand_dims(gl.load(p.gate_ptr + cols, mask=cols < p.N, other=0.0).to(gl.float32), 0)
        cta_barrier()  # every warp's product is in c_smem
        for r in gl.static_range(0, BLOCK_M, ROWS):
            rows = row0 + r + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
            ok = gl.expand_dims(rows < p.M, 1) & gl.expand_dims(cols < p.N, 0)
            at = gl.expand_dims(rows.to(gl.int64) * p.stride_out, 1) + gl.expand_dims(cols, 0)
            residual = gl.load(p.out_ptr + at, mask=ok, other=0.0).to(gl.float32)
            part = p.c_smem.slice(r, ROWS, dim=0)
            # the product of two bf16 values is exact in fp32: fused into an FMA or not, one rounding
            part.store((residual + part.load(layout).to(gl.float32) * gate).to(gl.bfloat16))

    @gluon.jit
    def _mma_and_epilogue(p):  # the MMA warpgroups
        BLOCK_M: gl.constexpr = p.c_smem.type.shape[0]
        BLOCK_N: gl.constexpr = p.c_smem.type.shape[1]
        BLOCK_K: gl.constexpr = p.a_ring.type.shape[2]
        # m64 n128 k32 wgmma atoms (Triton 3.6 lowers no int8 n256), two warpgroups stacked along M
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                             instr_shape=[16, min(BLOCK_N, 128), 32])
        sched = TileScheduler(gl.cdiv(p.M, BLOCK_M), gl.cdiv(p.N, BLOCK_N), p.GROUP_M)
        k_steps = gl.cdiv(p.K, BLOCK_K)
        zeros = gl.zeros((BLOCK_M, BLOCK_N), gl.int32, acc_layout)
        step = 0
        for tile in range(gl.program_id(0), sched.num_tiles(), gl.num_programs(0)):
            row0, col0 = sched.origin(tile, BLOCK_M, BLOCK_N)
            acc, step = _tile_mma(p, zeros, step, k_steps)
            _epilogue(p, acc, row0, col0)
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
        sizes = (gl.to_tensor(M), gl.to_tensor(N), gl.to_tensor(K), gl.to_tensor(stride_out))  # a 1 is a constexpr
        p = PartitionArgs((a_desc, b_desc, out_desc), (a_ring, b_ring, ready, empty), c_smem,
                          (out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, gate_ptr), sizes,
                          (SCALE_PER_COLUMN, HAS_BIAS, GATED, GATED_ROWS, GROUP_M))
        gl.warp_specialize([(_mma_and_epilogue, (p, )), (_loader, (p, ))], [1], [LOADER_REGS])


def descriptor_layouts(cfg: WsConfig):
    """The shared-memory layouts of the A, B and output tiles (128-byte swizzles: what wgmma and TMA want)."""
    return (gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_k], gl.int8),
            gl.NVMMASharedLayout.get_default_for([cfg.block_n, cfg.block_k], gl.int8),
            gl.NVMMASharedLayout.get_default_for([cfg.block_m, cfg.block_n], gl.bfloat16))


def launch(cfg: WsConfig, xq, x_scale, qdata, w_scale, bias, out, programs: int, gate=None) -> None:
    """The kernel on ``int8_gemm._launch``'s operands (``gate``: ``out`` is the residual the product is added to)."""
    (m, k), n = xq.shape, qdata.shape[0]
    a_layout, b_layout, c_layout = descriptor_layouts(cfg)
    a_desc = GluonDescriptor.from_tensor(xq, [cfg.block_m, cfg.block_k], a_layout)
    b_desc = GluonDescriptor.from_tensor(qdata, [cfg.block_n, cfg.block_k], b_layout)
    out_desc = GluonDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n], c_layout)
    _int8_gemm_sm90_kernel[(programs,)](
        a_desc, b_desc, out_desc, out, x_scale, w_scale, bias if bias is not None else x_scale,
        gate if gate is not None else x_scale, m, n, k, out.stride(0), STAGES=cfg.stages, GROUP_M=cfg.group_m,
        SCALE_PER_COLUMN=w_scale.numel() > 1, HAS_BIAS=bias is not None, GATED=gate is not None,
        GATED_ROWS=GATED_ROWS, LOADER_REGS=LOADER_REGS, num_warps=MMA_WARPS, maxnreg=MAX_REGS)
