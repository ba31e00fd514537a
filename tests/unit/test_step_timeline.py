"""benchmarks.step_timeline: where a step's device time goes, by interval arithmetic on made-up timelines."""

from __future__ import annotations

from benchmarks import results_table
from benchmarks.step_timeline import (HOST_TO_DEVICE, KERNEL, OTHER_COPY, activity_kind, clocks_by_family, summarize,
                                      union)


def test_activities_are_told_apart_by_their_cupti_names():
    assert activity_kind("Memcpy HtoD (Pageable -> Device)") == HOST_TO_DEVICE
    assert activity_kind("Memcpy DtoD (Device -> Device)") == OTHER_COPY
    assert activity_kind("Memset (Device)") == OTHER_COPY
    assert activity_kind("## Call CompiledFxGraph ##") is None
    assert activity_kind("qk_int8_sv_f8_accum_f32_attn_inst_buf") == KERNEL


def test_union_merges_overlaps_and_drops_empty_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]


def test_a_step_splits_into_kernels_exposed_copies_and_idle():
    us = 1e6
    activities = [
        (KERNEL, 0.0 * us, 4.0 * us, "attn_kernel"),   # attention, 4 s
        (KERNEL, 3.0 * us, 5.0 * us, "nvjet_gemm"),    # a GEMM on another stream, overlapping it
        (KERNEL, 6.0 * us, 7.0 * us, "rms_norm"),
        (HOST_TO_DEVICE, 1.0 * us, 2.0 * us, "Memcpy HtoD"),  # hidden behind the attention
        (HOST_TO_DEVICE, 4.5 * us, 6.5 * us, "Memcpy HtoD"),  # 1 s of it with no kernel beside
        (OTHER_COPY, 8.0 * us, 8.5 * us, "Memset"),
        (KERNEL, 9.0 * us, 9.5 * us, "rms_norm"),      # the same kernel again: its seconds summed by name
    ]
    t = summarize(activities, wall_seconds=10.0)
    assert t["seconds"] == {"wall": 10.0, "kernels": 6.5, "host_to_device": 3.0, "host_to_device_exposed": 1.0,
                            "idle": 2.0}  # busy: [0, 7], [8, 8.5] and [9, 9.5]
    assert t["kernel_seconds_by_family"] == {"attention": 4.0, "gemm": 2.0, "other": 1.5}
    assert t["kernel_seconds_by_name"] == {"attn_kernel": 4.0, "nvjet_gemm": 2.0, "rms_norm": 1.5}
    assert list(t["kernel_seconds_by_name"]) == ["attn_kernel", "nvjet_gemm", "rms_norm"]  # longest first
    assert t["kernel_launches"] == 4 and t["host_to_device_copies"] == 2
    line = results_table.timeline_text({"last_step_timeline": t})
    assert line == ("last step 10.00 s: kernels 6.50 s, weight copies 3.00 s (1.00 s not hidden behind kernels), "
                    "idle 2.00 s; attention 4.00 s, gemm 2.00 s, other 1.50 s")
    assert results_table.timeline_text({}) is None


def test_clock_samples_fall_to_the_kernel_running_then():
    """Host seconds map onto the profiler's microseconds through the anchor; a sample between kernels counts for
    the step only."""
    us = 1e6
    activities = [(KERNEL, 100.0, 100.0 + 2 * us, "qk_int8_sv_f8_attn_kernel"),
                  (KERNEL, 100.0 + 2.5 * us, 100.0 + 3 * us, "cutlass_gemm"),
                  (HOST_TO_DEVICE, 100.0, 100.0 + 3 * us, "Memcpy HtoD")]
    anchor = (50.0, 100.0)  # host 50 s is the profiler's 100 us
    samples = [(50.5, 1500, 700.0, 60), (51.5, 1600, 690.0, 62),  # attention
               (52.2, 1900, 300.0, 58),                            # between kernels
               (52.7, 1700, 650.0, 61)]                            # the GEMM
    c = clocks_by_family(activities, samples, anchor)
    assert c["attention"] == {"sm_mhz": 1550.0, "watts": 695.0, "celsius": 61.0, "samples": 2}
    assert c["gemm"] == {"sm_mhz": 1700.0, "watts": 650.0, "celsius": 61.0, "samples": 1}
    assert c["other"] is None
    assert c["step"]["samples"] == 4 and c["step"]["sm_mhz"] == 1675.0
    run = {"last_step_timeline": {"seconds": {"wall": 3.0, "kernels": 2.5, "host_to_device": 3.0,
                                              "host_to_device_exposed": 0.5, "idle": 0.0},
                                  "kernel_seconds_by_family": {"attention": 2.0, "gemm": 0.5, "other": 0.0},
                                  "clocks": c}}
    assert results_table.timeline_text(run).endswith(
        "; attention 2.00 s, gemm 0.50 s, other 0.00 s; SM clock step 1675 MHz 585 W 60 C, "
        "attention 1550 MHz 695 W 61 C, gemm 1700 MHz 650 W 61 C")


def test_a_budget_cell_imports_no_torch_before_comfy_aimdo_starts():
    """comfy-aimdo must be initialised before torch is imported (a budget cell starts as ComfyUI's main.py
    does): importing the cell, and the timeline with it, must not import torch."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, benchmarks.budget_cell; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "False"
