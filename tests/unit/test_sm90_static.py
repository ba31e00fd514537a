"""The device-free sm90 reading of the attention prototype (benchmarks/sm90_static.py).

The parser is checked on a hand-written listing; the prototype itself is compiled for sm90 here (no
GPU: Triton targets sm90 and runs the ptxas/nvdisasm its wheel carries), and its main loop must be
Hopper's wgmma for both products with no spills. The estimates must give SageAttention's own
profiled time back from its own instruction count.
"""

from __future__ import annotations

import pytest

from benchmarks import sage2_prototype as proto
from benchmarks import sm90_static as static

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   FFMA.FTZ R3, R4, R5, R6 ;
        /*0040*/              @!P1 MUFU.EX2 R3, R3 ;
        /*0050*/                   IGMMA.64x128x32.S8.S8 R24, gdesc[UR4], R24 ;
        /*0060*/                   BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""


def test_the_main_loop_is_the_longest_backward_branch():
    listing, labels = static.instructions(LISTING)
    assert len(listing) == 8 and labels == {".L_x_0": 1, ".L_x_1": 3}
    loop = static.main_loop(listing, labels)
    assert [static.opcode(i) for i in loop] == ["FFMA", "MUFU", "IGMMA", "BRA"]
    with pytest.raises(ValueError, match="no loop"):
        static.main_loop(listing[:1], {})


def test_out_of_line_retries_after_the_exit_are_not_loops():
    """A TMA kernel waits on an mbarrier with a retry block placed after EXIT that branches back into
    the body: the span from that label to the retry is not a loop, however long."""
    listing, labels = static.instructions(LISTING + """
.L_x_2:
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR25+0x1a020], R104 ;
        /*0090*/              @!P1 BRA `(.L_x_2) ;
        /*00a0*/                   BRA `(.L_x_0) ;
""")
    loop = static.main_loop(listing, labels)
    assert [static.opcode(i) for i in loop] == ["FFMA", "MUFU", "IGMMA", "BRA"]


def test_product_loops_are_the_innermost_loops_that_issue_both_products():
    """A warp-specialised kernel: each partition's main loop, inside the loop its worker warps wait in;
    a loop with one product only (the last P.V) and the enclosing loop are not product loops."""
    listing, labels = static.instructions("""
.L_x_0:
        /*0000*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
.L_x_1:
        /*0010*/                   IGMMA.64x128x32.S8.S8 R88, gdesc[UR8], RZ ;
        /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, R152, gdesc[UR12], RZ ;
        /*0030*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, R152, gdesc[UR12], RZ ;
        /*0050*/               @P2 BRA `(.L_x_2) ;
.L_x_3:
        /*0060*/                   FFMA R3, R4, R5, R6 ;
        /*0070*/                   IGMMA.64x128x32.S8.S8 R88, gdesc[UR8], RZ ;
        /*0080*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, R152, gdesc[UR12], RZ ;
        /*0090*/               @P3 BRA `(.L_x_3) ;
        /*00a0*/               @P4 BRA `(.L_x_0) ;
        /*00b0*/                   EXIT ;
""")
    loops = static.product_loops(listing, labels)
    assert [[static.opcode(i) for i in loop] for loop in loops] == [["IGMMA", "QGMMA", "BRA"],
                                                                    ["FFMA", "IGMMA", "QGMMA", "BRA"]]


def test_estimates_give_sageattentions_profiled_time_back():
    profile = static.profiled_kernel()
    assert set(profile) == set(static.H3_SEQS)
    for seq, k in profile.items():
        assert 1.5e9 < k["clock_hz"] < 2.1e9 and 0.3 < k["issue"] < 1.0
        est = static.estimates(k["per_element"], profile)[seq]
        assert est["at_sage_issue_rate_ms"] == pytest.approx(k["ms"], rel=1e-6)
        assert est["issue_floor_ms"] == pytest.approx(k["ms"] * k["issue"], rel=1e-6)


@pytest.fixture(scope="module")
def compiled():
    if proto.triton is None:
        pytest.skip(f"needs Triton: {proto.sq.TRITON_ERROR}")
    static.triton_tool("nvdisasm")  # SystemExit with the reason when this Triton has no CUDA tools
    return {name: static.analyse(name) for name in ("m128n128w8s3", "m128n128w8s3_fold", "m128n128w8s3_cvt_fold",
                                                     "m128n128w8s3_cvt_fold_relabel", "m128n128w8s3_cvt_groupk",
                                                     "m128n256w8s2_cvt_groupk", "m128n256w8s2_cvt_groupk_mmasum")}


def test_the_prototype_compiles_for_sm90_to_wgmma_without_spills(compiled):
    for name, a in compiled.items():
        cfg = proto.CONFIGS[name]
        steps = 4 * cfg.block_n // 128  # m64 x k32 wgmma steps: Q.K over D = 128, P.V over the key block
        pv_steps = steps * (2 if cfg.rowsum_mma else 1)  # and P . ones for the row sums
        assert a.mma == {"IGMMA": steps if cfg.block_n > 128 else 4, "QGMMA": pv_steps}, (name, a.mma)
        assert a.registers <= 255 and not (a.mix.get("LDL") or a.mix.get("STL")), (name, a.mix)  # no spill in the loop
        assert a.stack_bytes == 0 or cfg.block_n == 256, (name, a.stack_bytes)  # 256-key blocks spill outside it
        assert a.per_score_element == a.loop_instructions * 32 * cfg.num_warps / (cfg.block_m * cfg.block_n)
        assert a.mix["MUFU"] >= cfg.block_m * cfg.block_n // (32 * cfg.num_warps)  # one exp2 a score


def test_folding_the_q_scale_removes_one_multiply_a_score(compiled):
    base, fold = compiled["m128n128w8s3"], compiled["m128n128w8s3_fold"]
    per_thread = 128 * 128 // 256
    assert base.mix["FMUL"] - fold.mix["FMUL"] == per_thread
    assert fold.loop_instructions < base.loop_instructions


def test_relabelling_p_removes_the_layout_conversion_before_the_fp8_product(compiled):
    """K in token order and P permuted to V's positions: no shuffles or selects to move P between
    the accumulator and the A-operand layouts (what remains are the row reductions' butterflies)."""
    before, after = compiled["m128n128w8s3_cvt_fold"], compiled["m128n128w8s3_cvt_fold_relabel"]
    assert before.mix.get("SEL", 0) >= 16 and after.mix.get("SEL", 0) < 4, (before.mix, after.mix)
    assert after.mix.get("SHFL", 0) < before.mix["SHFL"]
    assert after.loop_instructions < before.loop_instructions


def test_k_scales_per_group_leave_no_multiply_or_scale_load_a_score(compiled):
    a = compiled["m128n128w8s3_cvt_groupk"]
    scores_a_thread = 128 * 128 // 256
    assert a.mix.get("FMUL", 0) < 8 and a.mix.get("LDS", 0) < 8, a.mix
    assert a.mix["FFMA"] <= 2 * scores_a_thread + 8  # exp2's argument and the accumulator, nothing more
    assert a.per_score_element < 9.0


def test_256_key_blocks_halve_the_rescale_a_score(compiled):
    """The accumulator's rescale-and-add runs once a key block over [M, D]: with 256 keys it costs
    half an FFMA a score instead of one."""
    n128, n256 = compiled["m128n128w8s3_cvt_groupk"], compiled["m128n256w8s2_cvt_groupk"]
    acc_per_thread = 128 * 128 // 256
    for a, keys in ((n128, 128), (n256, 256)):
        scores_per_thread = 128 * keys // 256
        assert 0 <= a.mix["FFMA"] - scores_per_thread - acc_per_thread <= 8, (keys, a.mix["FFMA"])
    assert n256.per_score_element < n128.per_score_element - 1.0


def test_row_sums_on_the_tensor_cores_leave_no_add_a_score(compiled):
    """P . ones replaces the FADD a score of the row sum; the ones are a constant (no shared-memory
    stores in the loop)."""
    before, after = compiled["m128n256w8s2_cvt_groupk"], compiled["m128n256w8s2_cvt_groupk_mmasum"]
    assert before.mix["FADD"] >= 128 and after.mix.get("FADD", 0) <= 4, (before.mix["FADD"], after.mix.get("FADD"))
    assert after.mix.get("STS", 0) == 0 and after.per_score_element < 7.0
