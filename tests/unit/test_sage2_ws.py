"""The warp-specialised Gluon attention prototype (benchmarks/sage2_ws.py), read from its sm90 machine code.

Gluon has no CPU interpreter, so what can be checked without a GPU is what ptxas made of the kernel:
Triton compiles it for sm90 here and its wheel's nvdisasm lists the SASS. Each config must keep what the
design is for: two consumer warpgroups (eight warps, no register reallocation, which made ptxas
serialise every wgmma of the worker partition), each with its own main loop of int8 Q.K^T and fp8 P.V
wgmmas; the scores' wait leaving the P.V and the row sums in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x2``), so the softmax
runs beside it; P handed to its wgmma as the conversion packs it (no byte shuffling); no spills; the
ping-pong turn as one more barrier wait a block. The numbers come from the H200
(tests/gpu/test_sage2_prototype_gpu.py).
"""

from __future__ import annotations

import collections

import pytest

from benchmarks import sage2_ws as ws
from benchmarks import sm90_static as static

if ws.gluon_problem():
    pytest.skip(ws.gluon_problem(), allow_module_level=True)


def read(name: str) -> dict:
    kernel = ws.compile_sm90(ws.WS_CONFIGS[name])
    cubin = kernel.asm["cubin"]
    listing, labels = static.instructions(static._run_tool("nvdisasm", ["-c"], cubin))
    return {"kernel": kernel, "resources": static.resources(cubin), "listing": listing,
            "loops": static.product_loops(listing, labels)}


@pytest.fixture(scope="module")
def compiled():
    static.triton_tool("nvdisasm")  # SystemExit with the reason when this Triton has no CUDA tools
    return {name: read(name) for name in ws.WS_CONFIGS}


def mix(loop):
    return collections.Counter(static.opcode(i) for i in loop)


def test_two_consumer_warpgroups_with_the_kernels_whole_register_budget(compiled):
    for name, r in compiled.items():
        assert r["kernel"].metadata.num_warps == ws.CONSUMERS * ws.NUM_WARPS, name
        assert not any("SETMAXREG" in i for i in r["listing"]), name
        # a few bytes of stack at most (the row sums' product: 8, outside the loops; checked there below)
        assert r["resources"]["registers"] <= 255 and r["resources"]["stack_bytes"] <= 16, (name, r["resources"])
        assert len(r["loops"]) == ws.CONSUMERS, name


def test_each_consumer_loop_issues_both_products_and_keeps_p_v_in_flight(compiled):
    """k32 steps over D = 128 (Q.K^T) and over 128 keys (P.V, and P . ones for the row sums); the
    scores' wait leaves the two products issued after them in flight; the row sums add nothing a score
    on the CUDA cores."""
    for name, r in compiled.items():
        for loop in r["loops"]:
            m = mix(loop)
            shapes = collections.Counter(i.split()[0] for i in loop if static.opcode(i) in ("IGMMA", "QGMMA"))
            expect = {"IGMMA.64x128x32.S8.S8": 4, "QGMMA.64x128x32.F32.E4M3.E4M3": 4,
                      "QGMMA.64x16x32.F32.E4M3.E4M3": 4}
            assert shapes == expect, (name, shapes)
            # sorted: the loop's listing may start anywhere in its body
            waits = sorted(i for i in loop if i.startswith("WARPGROUP.DEPBAR"))
            assert waits == ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "WARPGROUP.DEPBAR.LE gsb0, 0x2"], (name, waits)
            assert not (m["LDL"] or m["STL"]), (name, m)
            assert m["FADD"] <= 4, (name, m["FADD"])


def test_p_reaches_its_wgmma_as_the_conversion_packs_it(compiled):
    """64 P elements a thread: 32 two-element e4m3 conversions, then one PRMT per four-byte register;
    a layout the conversion does not match would unpack bytes (sign-extending PRMTs, shifts, masks)."""
    for name, r in compiled.items():
        for loop in r["loops"]:
            m = mix(loop)
            assert m["F2FP"] == 32 and m["PRMT"] <= 16 and m["SHF"] <= 4, (name, m)


def test_ping_pong_is_one_more_barrier_wait_a_block(compiled):
    def waits(loop):
        return sum("TRYWAIT" in i for i in loop)

    with_turns = [waits(loop) for loop in compiled["ws_n128s3_pp_mmasum"]["loops"]]
    without = [waits(loop) for loop in compiled["ws_n128s3_mmasum"]["loops"]]
    assert [a - b for a, b in zip(with_turns, without)] == [1, 1], (with_turns, without)


def test_instructions_a_score_stay_at_sageattentions_level(compiled):
    """SageAttention's sm90 kernel issues 8.97-9.06 thread instructions a score (Nsight Compute); this
    design's gain is to be the overlap, so it must not pay for it in instructions."""
    for name, r in compiled.items():
        for loop in r["loops"]:
            per_score = len(loop) * 32 * ws.NUM_WARPS / (ws.ROWS * ws.WS_CONFIGS[name].block_n)
            assert per_score <= 9.5, (name, per_score)


def test_configs_are_consistent():
    assert ws.WS_DEFAULT in ws.WS_CONFIGS
    for name, cfg in ws.WS_CONFIGS.items():
        assert cfg.block_n == 128 and cfg.block_m == 128 and 2 <= cfg.stages <= 4, name
