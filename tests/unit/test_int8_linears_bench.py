"""benchmarks/int8_linears.py's arithmetic and table on hand-made rows (the GPU measurement itself is the
benchmark's): the block row sums each variant's p50 over the four linears and takes TOPS from their total work, and
the quantiser's GB/s from its total bytes."""

from __future__ import annotations

from benchmarks import int8_linears as bench


def _row(name, ms, identical=True):
    k, n, _ = bench.LINEARS[name]
    return {"linear": name, "tokens": 1000, "in": k, "out": n, "identical_to_stock": identical,
            "stock_layer": {"ms": 2 * ms}, "pack_layer": {"ms": ms}, "kitchen_gemm": {"ms": 1.5 * ms, "tops": 800.0},
            "pack_gemm": {"ms": ms / 2, "tops": 1200.0}, "layer_speedup": 2.0, "gemm_speedup": 3.0,
            "pack_quantiser": bench.quantiser_speed(ms / 4, int(ms * 1e9))}


def test_block_row_sums_the_four_linears():
    rows = [_row(name, ms) for name, ms in zip(bench.LINEARS, (1.0, 2.0, 3.0, 4.0))]
    block = bench.block_sum(rows)
    assert block["pack_layer"]["ms"] == 10.0 and block["stock_layer"]["ms"] == 20.0
    assert block["layer_speedup"] == 2.0 and block["gemm_speedup"] == 3.0
    flops = sum(2 * 1000 * r["in"] * r["out"] for r in rows)
    assert block["pack_gemm"]["tops"] == round(flops / (5.0 / 1e3) / 1e12, 1)
    assert block["identical_to_stock"]
    assert block["pack_quantiser"] == {"ms": 2.5, "bytes": int(10e9), "gbps": 4000}
    assert not bench.block_sum(rows[:3] + [_row("fc2", 4.0, identical=False)])["identical_to_stock"]


def test_table_marks_differing_bits_and_a_missing_pack_gemm():
    rows = [_row("qkv", 1.0), dict(_row("out", 1.0, identical=False))]
    del rows[1]["pack_gemm"], rows[1]["gemm_speedup"]
    lines = bench.table(rows).splitlines()
    assert len(lines) == 4 and lines[2].endswith("| identical |") and lines[3].endswith("| DIFFER |")
    assert "| - | - | - |" in lines[3]
    rows[0]["portable_gemm"] = {"ms": 0.8, "tops": 1000.0}
    assert "| 0.80 (1,000) | identical |" in bench.table(rows).splitlines()[2]
    assert "| 2.000 | 0.25 (4,000) | 1.50 (800) |" in lines[2]
    del rows[0]["pack_quantiser"]
    assert "| 2.000 | - | 1.50 (800) |" in bench.table(rows).splitlines()[2]
    assert "portable_gemm" not in bench.block_sum([_row(name, 1.0) for name in bench.LINEARS][:3] + [rows[0]])
