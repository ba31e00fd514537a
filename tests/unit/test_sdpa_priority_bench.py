"""The SDPA priority benchmark: it names the kernel each order ran and sees when the orders' bits differ."""

from __future__ import annotations

import json

import torch

from benchmarks import sdpa_priority as bench

CPU = torch.device("cpu")


def test_reproduced_names_the_lone_kernels_with_the_same_bits():
    out = torch.tensor([1.0, 2.0])
    lone = {"A": out.clone(), "B": torch.tensor([1.0, 2.5]), "C": None, "D": out.clone()}
    assert bench.reproduced(out, lone) == ["A", "D"]
    assert bench.reproduced(torch.tensor([0.0, 0.0]), lone) == []


def test_views_are_strided_slices_of_one_fused_buffer():
    q, k, v = bench.strided_views(64, 2, 16, CPU)
    assert q.shape == (1, 2, 64, 16) and not q.is_contiguous()
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


def test_cpu_smoke_run_reports_the_kernels_and_same_bits(tmp_path):
    # on the CPU neither cuDNN nor memory-efficient attention exists: both orders fall to the CPU flash kernel
    out = tmp_path / "sdpa.json"
    bench.main(["--device", "cpu", "--seq", "128", "--heads", "2", "--head-dim", "32", "--reps", "2",
                "--out", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    assert row["ran"] == {"stock": ["FLASH_ATTENTION"], "pack": ["FLASH_ATTENTION"]}
    assert row["stock_vs_pack"]["bit_exact"] and set(row["unavailable"]) == {"CUDNN_ATTENTION", "EFFICIENT_ATTENTION"}
    assert set(row["times"]) == {"stock", "pack"}


def test_orders_on_different_kernels_are_reported_as_differing(monkeypatch):
    monkeypatch.setitem(bench.ORDERS, "pack", ("MATH",))  # not a lone kernel here; other rounding than flash
    row = bench.compare(128, 2, 32, CPU, reps=1, warmup=0)
    assert row["ran"]["pack"] == [] and row["ran"]["stock"] == ["FLASH_ATTENTION"]
    assert not row["stock_vs_pack"]["bit_exact"] and row["stock_vs_pack"]["max_abs_difference"] > 0
