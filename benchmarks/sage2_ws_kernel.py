"""The Gluon kernel of the warp-specialised attention prototype (``benchmarks/sage2_ws.py`` has the
design, the configs and the launcher). Imported only to compile or JIT-launch it, so the prototype's
configs, its ahead-of-time launch and the harness load on any Triton, with or without this Gluon API.

Its barrier protocol (which waits, arrivals, loads and products, in which order, with which parities)
is modelled in tests/unit/test_sage2_ws_protocol.py and run there under random schedules: change the
two together.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate

from benchmarks.sage2_prototype import FP8_OFFSET

_OFFSET = gl.constexpr(FP8_OFFSET)  # log2(448): SageAttention's fp8 offset of the running max


@gluon.constexpr_function
def _mma_layout(n):
    # one warpgroup, m64 rows, n columns an instruction; the k (32) fits 8-bit operands
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])


@gluon.jit
def _to_5d(x, ROW: gl.constexpr):
    """[M, U, 4] (ROW: [M]) in the layouts _softmax_block slices them to -> broadcastable [M, U, 16, 4, 2]."""
    if ROW:
        x = gl.expand_dims(gl.expand_dims(x, 1), 2)
    return gl.expand_dims(gl.expand_dims(x, 2), 4)


@gluon.jit
def _softmax_block(s, qsc, m_i, KS_head, n0, S, p_layout: gl.constexpr, MASKED: gl.constexpr):
    """Block scores (int32 [ROWS, N], token order) -> (P as e4m3 in V's position order, alpha, m); the
    row sums come from the tensor cores with the P.V (``_pv``).

    Column 128u + 8x + 2g + b has K scale g of 128-key block u, and in the wgmma accumulator each
    thread's columns of a 128-key block share g: the row max is taken on the unscaled scores per
    (row, u, g), scaled once, and exp2's argument is one FFMA a score with both scales' product."""
    M: gl.constexpr = s.shape[0]
    N: gl.constexpr = s.shape[1]
    U: gl.constexpr = N // 128
    row_layout: gl.constexpr = m_i.type.layout
    f = s.to(gl.float32)  # the integer-add trick issues one more a score here and ran no faster in Triton
    if MASKED:
        col = n0 + gl.arange(0, N, layout=gl.SliceLayout(0, s.type.layout))
        f = gl.where((col < S)[None, :], f, float("-inf"))
    f5 = gl.reshape(f, [M, U, 16, 4, 2])
    gmax = gl.max(gl.max(f5, 4), 2)  # [M, U, 4]
    g_layout: gl.constexpr = gmax.type.layout
    u = gl.arange(0, U, layout=gl.SliceLayout(1, gl.SliceLayout(0, g_layout)))
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, g_layout)))
    ks_at = KS_head + (n0 // 128 + u)[:, None] * 4 + g[None, :]
    if MASKED:  # a 256-key tail block may reach past the last K-scale block
        ks = gl.load(ks_at, mask=((n0 // 128 + u) * 128 < S)[:, None], other=0.0)
    else:
        ks = gl.load(ks_at)
    scaled = gmax * ks[None, :, :]
    if MASKED:  # a group with no valid key: -inf times a zero scale would be NaN
        scaled = gl.where(gmax == float("-inf"), float("-inf"), scaled)
    q5: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, g_layout))
    qsc_g = gl.convert_layout(qsc, q5)
    m_new = gl.maximum(gl.convert_layout(m_i, q5), gl.max(gl.max(scaled, 2), 1) * qsc_g - _OFFSET)
    mult = gl.expand_dims(gl.expand_dims(qsc_g, 1), 2) * gl.expand_dims(ks, 0)  # [M, U, 4]
    arg5 = f5 * _to_5d(mult, False) - _to_5d(m_new, True)
    if MASKED:
        arg5 = gl.where(f5 == float("-inf"), float("-inf"), arg5)
    p = gl.exp2(gl.reshape(arg5, [M, N]))
    m_new = gl.convert_layout(m_new, row_layout)
    alpha = gl.exp2(m_i - m_new)
    # token 8a + 2t + b of each 16 to V's position 4t + 2a + b (SageAttention's V layout): a relabelling
    # of the accumulator's registers, which then are fp8 wgmma's A operand as they stand
    p = gl.reshape(gl.permute(gl.reshape(p, [M, N // 16, 2, 4, 2]), (0, 1, 3, 2, 4)), [M, N])
    return gl.convert_layout(p, p_layout).to(gl.float8e4nv), alpha, m_new


@gluon.jit
def _issue(turn, which, t, PINGPONG: gl.constexpr):
    """Wait for this consumer's t-th turn to issue products (consumer 0 goes first)."""
    if PINGPONG:
        mbarrier.wait(turn.index(which), (t & 1) ^ (1 - which))


@gluon.jit
def _issued(turn, which, PINGPONG: gl.constexpr):
    """Hand the turn to the other consumer."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - which), count=1)


@gluon.jit
def _qk(q_tile, k_smem, st):
    N: gl.constexpr = k_smem.shape[1]
    return warpgroup_mma(q_tile, k_smem.index(st).permute((1, 0)),
                         gl.zeros([q_tile.shape[0], N], gl.int32, layout=_mma_layout(128)), use_acc=False,
                         is_async=True)


@gluon.jit
def _pv(p, ring, st, acc):
    """A fresh fp32 P.V (SageAttention's "inst_buf": fp8 wgmma accumulates with fewer bits than fp32)
    and P . ones [N, 16], whose 16 equal columns are the rows' sums of the e4m3 P."""
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, ones = ring
    pv = warpgroup_mma(p, v_smem.index(st).permute((1, 0)), gl.zeros_like(acc), use_acc=False, is_async=True)
    return pv, _row_sums(p, ones)


@gluon.jit
def _row_sums(p, ones):
    sums: gl.constexpr = _mma_layout(16)
    p16 = gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=sums, k_width=4))
    return warpgroup_mma(p16, ones.permute((1, 0)), gl.zeros([p.shape[0], 16], gl.float32, layout=sums),
                         use_acc=False, is_async=True)


@gluon.jit
def _scores_ready(s):
    """Wait for the next block's Q.K^T, issued before this block's P.V and row sums, which stay in flight."""
    return warpgroup_mma_wait(num_outstanding=2, deps=(s, ))


@gluon.jit
def _load_tile(desc, smem, ready, coord, pred=True):
    """One TMA tile into ``smem`` signalling ``ready`` (predicated rather than branched on: no branch
    may stand between P's cast and its wgmma)."""
    mbarrier.expect(ready, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, coord, ready, smem, pred=pred)


@gluon.jit
def _load_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, STAGES: gl.constexpr):
    """Key block b's K and V tiles into ring stage b % STAGES, each with its own ready barrier."""
    N: gl.constexpr = k_smem.shape[1]
    st = b % STAGES
    _load_tile(k_desc, k_smem.index(st), k_ready.index(st), [b * N, 0])
    _load_tile(v_desc, v_smem.index(st), v_ready.index(st), [0, b * N])


@gluon.jit
def _retire_pv(prods, acc, l_i, alpha, b, kv_empty, STAGES: gl.constexpr):
    """Wait for block b's P.V and row sums, release b's ring stage, add them to the rescaled accumulator
    and normaliser."""
    pv, rs = warpgroup_mma_wait(num_outstanding=0, deps=(prods[0], prods[1]))
    l_i = l_i * alpha + gl.convert_layout(gl.max(rs, 1), l_i.type.layout)
    mbarrier.arrive(kv_empty.index(b % STAGES), count=1)
    return acc * alpha[:, None] + pv, l_i


@gluon.jit
def _refill(b, n_blocks, ring, WHICH: gl.constexpr, STAGES: gl.constexpr):
    """Once both consumers have released block b, block b + STAGES takes its stage: consumer 0 loads
    its K tile, consumer 1 its V tile, so the two loops carry the same work."""
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, ones = ring
    N: gl.constexpr = k_smem.shape[1]
    st = b % STAGES
    more = b + STAGES < n_blocks
    mbarrier.wait(kv_empty.index(st), (b // STAGES) & 1, pred=more)
    if WHICH == 0:
        _load_tile(k_desc, k_smem.index(st), k_ready.index(st), [(b + STAGES) * N, 0], pred=more)
    else:
        _load_tile(v_desc, v_smem.index(st), v_ready.index(st), [0, (b + STAGES) * N], pred=more)


@gluon.jit
def _issue_next(j, p, acc, q_tile, ring, turn, WHICH: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """Once block j+1's K and block j's V have landed, on this consumer's turn: block j+1's Q.K^T and
    block j's P.V (with its row sums) issued together; returns block j+1's scores, waited for, and the
    P.V still in flight."""
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, ones = ring
    mbarrier.wait(k_ready.index((j + 1) % STAGES), ((j + 1) // STAGES) & 1)
    mbarrier.wait(v_ready.index(j % STAGES), (j // STAGES) & 1)
    _issue(turn, WHICH, j + 1, PINGPONG)
    s = _qk(q_tile, k_smem, (j + 1) % STAGES)
    pv = _pv(p, ring, j % STAGES, acc)
    _issued(turn, WHICH, PINGPONG)
    return _scores_ready(s), pv


@gluon.jit
def _steady_block(j, n_blocks, s, pv_prev, acc, l_i, m_i, alpha_prev, q_tile, ring, turn, qsc, KS_head, S,
                  p_layout: gl.constexpr, WHICH: gl.constexpr, STAGES: gl.constexpr,
                  PINGPONG: gl.constexpr, OVERLAP: gl.constexpr):
    """Block j (full, not the last): its softmax while block j-1's P.V runs, then block j+1's Q.K^T and
    block j's P.V issued together; returns with block j+1's scores and block j's P.V in flight."""
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, ones = ring
    N: gl.constexpr = k_smem.shape[1]
    if not OVERLAP:
        acc, l_i = _retire_pv(pv_prev, acc, l_i, alpha_prev, j - 1, kv_empty, STAGES)
        _refill(j - 1, n_blocks, ring, WHICH, STAGES)
    p, alpha, m_i = _softmax_block(s, qsc, m_i, KS_head, j * N, S, p_layout, False)
    if OVERLAP:
        acc, l_i = _retire_pv(pv_prev, acc, l_i, alpha_prev, j - 1, kv_empty, STAGES)
        _refill(j - 1, n_blocks, ring, WHICH, STAGES)
    s, pv = _issue_next(j, p, acc, q_tile, ring, turn, WHICH, STAGES, PINGPONG)
    return s, pv, acc, l_i, m_i, alpha


@gluon.jit
def _consumer(q_smem, q_bar, ring, turn, QS, KS_head, VS, O, h, m0, S, H, NQS, qk_scale, WHICH: gl.constexpr,
              STAGES: gl.constexpr, PINGPONG: gl.constexpr, OVERLAP: gl.constexpr):
    """One warpgroup's 64 query rows against every key block. Products are issued at n_blocks + 1 turns:
    block 0's Q.K^T, then each block's P.V together with the next block's Q.K^T, then the last P.V."""
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, ones = ring
    N: gl.constexpr = k_smem.shape[1]
    Dh: gl.constexpr = k_smem.shape[2]
    layout: gl.constexpr = _mma_layout(128)
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=4)
    rows = m0 + WHICH * 64 + gl.arange(0, 64, layout=rows_l).to(gl.int64)
    qsc = gl.load(QS + h * NQS + rows // 16 * 8 + rows % 8, mask=rows < S, other=0.0) * qk_scale
    n_blocks = gl.cdiv(S, N)
    last = n_blocks - 1
    mbarrier.wait(q_bar, 0)
    q_tile = q_smem.index(WHICH)
    mbarrier.wait(k_ready.index(0), 0)
    _issue(turn, WHICH, 0, PINGPONG)
    s = _qk(q_tile, k_smem, 0)
    _issued(turn, WHICH, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    m_i = gl.full([64], float("-inf"), gl.float32, layout=rows_l)
    l_i = gl.zeros([64], gl.float32, layout=rows_l)
    acc = gl.zeros([64, Dh], gl.float32, layout=layout)
    if last > 0:
        # block 0 (full): softmax, then block 1's Q.K^T and block 0's P.V
        p, alpha, m_i = _softmax_block(s, qsc, m_i, KS_head, 0, S, p_layout, False)
        s, pv = _issue_next(0, p, acc, q_tile, ring, turn, WHICH, STAGES, PINGPONG)
        for j in range(1, last):
            s, pv, acc, l_i, m_i, alpha = _steady_block(j, n_blocks, s, pv, acc, l_i, m_i, alpha, q_tile, ring,
                                                        turn, qsc, KS_head, S, p_layout, WHICH, STAGES,
                                                        PINGPONG, OVERLAP)
        # the last block (partial or not): its softmax after the previous P.V
        acc, l_i = _retire_pv(pv, acc, l_i, alpha, last - 1, kv_empty, STAGES)
        _refill(last - 1, n_blocks, ring, WHICH, STAGES)
        p, alpha, m_i = _softmax_block(s, qsc, m_i, KS_head, last * N, S, p_layout, True)
    else:  # one block, the only one, partial
        p, alpha, m_i = _softmax_block(s, qsc, m_i, KS_head, 0, S, p_layout, True)
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    _issue(turn, WHICH, last + 1, PINGPONG)
    pv = _pv(p, ring, last % STAGES, acc)
    _issued(turn, WHICH, PINGPONG)
    acc, l_i = _retire_pv(pv, acc, l_i, alpha, last, kv_empty, STAGES)  # nothing left to load
    c = gl.arange(0, Dh, layout=gl.SliceLayout(0, layout))
    vs = gl.load(VS + h * Dh + c)
    o = acc / l_i[:, None] * vs[None, :]
    gl.store(O + rows[:, None] * (H * Dh) + h * Dh + c[None, :], o.to(gl.bfloat16), mask=(rows < S)[:, None])


@aggregate
class _Schedule:
    """The compile-time choices, as one value: constexprs in a plain tuple reach warp_specialize's
    partitions as runtime values, in an aggregate they stay constexprs."""
    STAGES: gl.constexpr
    PINGPONG: gl.constexpr
    OVERLAP: gl.constexpr


@gluon.jit
def _v_descriptor(V_head, LPAD, Dh: gl.constexpr, BLOCK_N: gl.constexpr):
    """One head's V [D, S_pad] (zero past the padded length) as TMA tiles of [D, BLOCK_N]."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Dh, BLOCK_N], gl.float8e4nv)
    return tma.make_tensor_descriptor(V_head, shape=[Dh, LPAD], strides=[LPAD, 1], block_shape=[Dh, BLOCK_N],
                                      layout=layout)


@gluon.jit
def _consumer_0(q_smem, q_bar, ring, turn, QS, KS_head, VS, O, h, m0, S, H, NQS, qk_scale, V_head, LPAD, sched):
    _consumer(q_smem, q_bar, ring, turn, QS, KS_head, VS, O, h, m0, S, H, NQS, qk_scale, 0, sched.STAGES,
              sched.PINGPONG, sched.OVERLAP)


@gluon.jit
def _consumer_1(q_smem, q_bar, ring, turn, QS, KS_head, VS, O, h, m0, S, H, NQS, qk_scale, V_head, LPAD, sched):
    """Consumer 1 loads the V tiles of its refills through a descriptor it makes itself: a descriptor
    written by other warps needs the tensormap acquire fence in the warps that use it, and Gluon emits
    that fence where the descriptor is made."""
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, ones = ring
    own = (k_desc, _v_descriptor(V_head, LPAD, k_smem.shape[2], k_smem.shape[1]), k_smem, v_smem, k_ready, v_ready,
           kv_empty, ones)
    _consumer(q_smem, q_bar, own, turn, QS, KS_head, VS, O, h, m0, S, H, NQS, qk_scale, 1, sched.STAGES,
              sched.PINGPONG, sched.OVERLAP)


@gluon.jit
def _ws_kernel(Q, QS, K, KS, V, VS, O, S, H, NQS, NKS, LPAD, qk_scale, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, PINGPONG: gl.constexpr, OVERLAP: gl.constexpr):
    Dh: gl.constexpr = 128
    m0 = gl.program_id(0) * 128
    h = gl.program_id(1).to(gl.int64)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, Dh], gl.int8)
    k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, Dh], gl.int8)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Dh, BLOCK_N], gl.float8e4nv)
    # one head's operands; zero past S (Q, K) and past the padded length (V)
    q_desc = tma.make_tensor_descriptor(Q + h * S * Dh, shape=[S, Dh], strides=[Dh, 1], block_shape=[64, Dh],
                                        layout=q_layout)
    k_desc = tma.make_tensor_descriptor(K + h * S * Dh, shape=[S, Dh], strides=[Dh, 1],
                                        block_shape=[BLOCK_N, Dh], layout=k_layout)
    V_head = V + h * Dh * LPAD
    v_desc = _v_descriptor(V_head, LPAD, Dh, BLOCK_N)
    q_smem = gl.allocate_shared_memory(gl.int8, [2, 64, Dh], q_layout)
    k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, Dh], k_layout)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, Dh, BLOCK_N], v_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a stage
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    # [16, N] e4m3 ones (K-major for the n16 product that sums P's rows)
    ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([16, BLOCK_N], gl.float8e4nv)
    ones = gl.allocate_shared_memory(gl.float8e4nv, [16, BLOCK_N], ones_layout,
                                     gl.full([16, BLOCK_N], 1.0, gl.float8e4nv,
                                             layout=gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])))
    fence_async_shared()
    # the first loads, before the consumers fork: both Q tiles and the ring's first STAGES key blocks
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [m0, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [m0 + 64, 0], q_bar, q_smem.index(1))
    n_blocks = gl.cdiv(S, BLOCK_N)
    for b in gl.static_range(STAGES):
        if b < n_blocks:
            _load_block(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, b, STAGES)
    ring = (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_empty, ones)
    args = (q_smem, q_bar, ring, turn, QS, KS + h * NKS, VS, O, h, m0, S, H, NQS, qk_scale, V_head, LPAD,
            _Schedule(STAGES, PINGPONG, OVERLAP))
    # two consumer warpgroups and no producer warps: every warp keeps the kernel's full register
    # budget (ptxas serialises the wgmmas of a setmaxnreg worker partition for want of registers)
    gl.warp_specialize([(_consumer_0, args), (_consumer_1, args)], [4])
