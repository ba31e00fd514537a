"""The prototype built ahead of time (benchmarks/triton_aot): what a launch on another machine relies on.

The GPU side (loading the cubin through CuPy, launching it) runs in tests/gpu/test_sage2_prototype_gpu.py
with SAGE2_PROTOTYPE_AOT set; here: the build's manifest, the parameter list Triton's PTX declares, and
the packing of each launch value into the width the kernel reads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import sage2_prototype as proto
from benchmarks import triton_aot as aot

triton = pytest.importorskip("triton")


def test_build_writes_a_cubin_and_a_manifest_with_the_launch_abi(tmp_path):
    name = "m128n256w8s2_cvt_groupk_mmasum"
    manifest = aot.build(tmp_path, [name])
    entry = manifest["configs"][name]
    assert (tmp_path / entry["cubin"]).read_bytes()[:4] == b"\x7fELF"
    assert json.loads((tmp_path / aot.MANIFEST).read_text()) == manifest
    assert manifest["arguments"] == ["Q", "QS", "K", "KS", "V", "VS", "O", "S", "H", "NQS", "NKS", "LPAD", "qk_scale"]
    assert entry["parameters"] == len(manifest["arguments"]) + aot.SCRATCH_POINTERS
    assert entry["num_warps"] == proto.CONFIGS[name].num_warps and entry["shared"] > 48 * 1024
    assert manifest["triton"] == triton.__version__
    assert entry["global_scratch_size"] == 0  # pointer loads: no descriptors to keep


def test_tma_configs_record_the_scratch_their_descriptors_need(tmp_path):
    entry = aot.build(tmp_path, ["m64n128w4s3_cvt_groupk_tma"])["configs"]["m64n128w4s3_cvt_groupk_tma"]
    assert entry["global_scratch_size"] >= 2 * 128 and entry["global_scratch_align"] >= 64  # K and V descriptors


def test_warp_specialised_configs_build_with_the_same_launch_abi(tmp_path):
    """The Gluon kernel takes the Triton prototype's arguments; its launch is both partitions' warps and
    the scratch for its three in-kernel descriptors (Q, K, V)."""
    from benchmarks import sage2_ws

    if sage2_ws.gluon_problem():
        pytest.skip(sage2_ws.gluon_problem())
    name = sage2_ws.WS_DEFAULT
    manifest = aot.build(tmp_path, [name])
    entry = manifest["configs"][name]
    assert entry["parameters"] == len(manifest["arguments"]) + aot.SCRATCH_POINTERS
    assert entry["num_warps"] == sage2_ws.CONSUMERS * sage2_ws.NUM_WARPS
    assert entry["global_scratch_size"] >= 3 * 128 and entry["shared"] > 100 * 1024


def test_ptx_parameter_count_reads_the_named_entry():
    ptx = (".visible .entry other(\n .param .u64 a\n)\n"
           ".visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n\t.param .u32 k_param_1,\n"
           "\t.param .f32 k_param_2\n)\n{")
    assert aot.ptx_parameter_count(ptx, "k") == 3
    with pytest.raises(ValueError, match="no .entry missing"):
        aot.ptx_parameter_count(ptx, "missing")


def test_kernel_arguments_pack_pointers_ints_and_floats_at_the_kernels_widths():
    t = torch.empty(4, dtype=torch.int8)
    names = ["Q", "S", "qk_scale"]
    packed = aot.kernel_arguments((t, 37810, 0.125), names)
    assert [type(v) for v in packed] == [np.uint64, np.int32, np.float32, np.uint64, np.uint64]
    assert int(packed[0]) == t.data_ptr() and int(packed[1]) == 37810 and float(packed[2]) == 0.125
    assert int(packed[3]) == int(packed[4]) == 0  # no global scratch, the null profile scratch
    assert int(aot.kernel_arguments((t, 1, 1.0), names, global_scratch=4096)[3]) == 4096
    with pytest.raises(ValueError, match="does not fit"):
        aot.kernel_arguments((t, 2**31, 1.0), names)
    with pytest.raises(ValueError, match="2 values for the 3 arguments"):
        aot.kernel_arguments((t, 1), names)
