"""The pack's model of an H3 block's activation memory (kernels/memory_model.py): the peaks measured on an H100, the
phase each comes from, and the geometry it shares with the dataflow (token chunks, SageAttention 2's operands)."""

from __future__ import annotations

import pytest
import torch

from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels import memory_model, sage2_quant

MIB = 2**20


# One full-width block's peak extra memory, measured on an H100 (README "Results", 0.2.40 rows: the sm90 prepared
# path, the settings' chunks; 149,936 tokens: benchmarks.h3_reference_run --memory-at), and the phase the model
# finds it in.
@pytest.mark.parametrize("weights, tokens, measured_mib, phase", [
    ("bf16", 8192, 840, "fc2"),               # the MLP whole (8,192 rows: one chunk)
    ("int8", 8192, 728, "fc2"),               # fc2's int8 input instead of the bf16 SwiGLU
    ("int8", 149936, 5160, "v operand"),      # V beside the three operands; the attention's output as large as V
])
def test_the_model_lands_on_the_peaks_measured_on_an_h100(weights, tokens, measured_mib, phase):
    phases = kernels.block_phases(tokens, weights=weights)
    peak = kernels.block_peak_bytes(tokens, weights=weights)
    assert peak == max(phases.values()) and phases[phase] == peak, {k: v // MIB for k, v in phases.items()}
    assert abs(peak / MIB / measured_mib - 1) < 0.01, f"{peak / MIB:.0f} MiB modelled, {measured_mib} measured"


# At 37,810 tokens the H100 run measured the peak while K's mean was taken beside K's operand: torch's reduction
# staged 133 MiB of partial sums there (a memory trace of the block). The mean now runs before the operand exists,
# so the peak lies between the measured one less that staging and the measured one.
@pytest.mark.parametrize("weights, measured_mib, phase", [
    ("bf16", 1559, "q by chunks"),            # the input, K whole, Q's int8 operand and one Q chunk
    ("int8", 1365, "v operand"),              # V beside the three operands
])
def test_the_model_lies_under_the_peak_measured_with_the_means_staging(weights, measured_mib, phase):
    staging_mib = 133
    phases = kernels.block_phases(37810, weights=weights)
    peak = kernels.block_peak_bytes(37810, weights=weights)
    assert phases[phase] == peak, {k: v // MIB for k, v in phases.items()}
    assert measured_mib - staging_mib - 1 <= peak / MIB <= measured_mib, f"{peak / MIB:.0f} MiB modelled"
    k_operand = phases.get("k operand")
    assert abs((k_operand / MIB + staging_mib) / measured_mib - 1) < 0.01  # the traced peak: K's operand + staging


def test_the_chunks_are_the_dataflows():
    """Q comes by three times the setting's rows on 128-row blocks (sage2 prepare_projected), the MLP by the setting."""
    assert memory_model.first_chunk(37810, 3 * 8192, sage2_quant.K_BLOCK) == 18944
    assert memory_model.first_chunk(37810, 12800) == 12608
    for rows, chunk in ((37810, 8192), (100, 30), (5, 8192)):
        a, b = kernels.token_chunks(rows, chunk)[0]
        assert memory_model.first_chunk(rows, chunk) == b - a


def test_sage2_operand_bytes_are_the_prepared_paths_buffers():
    for seq in (1, 129, 1000):
        nbytes = [t.numel() * t.element_size() for t in sage2_quant._empty_operands(seq, 3, 128, "cpu")]
        assert memory_model.sage2_operand_bytes(seq, 3, 128) == (sum(nbytes[:2]), sum(nbytes[2:]))  # (Q, K and V)


def test_whole_gemms_and_plain_calls_need_more_than_the_fast_paths_chunks():
    chunked = kernels.block_peak_bytes(37810)
    assert kernels.block_peak_bytes(37810, qkv_by_columns=False) > chunked  # whole rows by chunks, K/V copied
    assert kernels.block_peak_bytes(37810, prepared=False) > chunked        # the fused buffer whole, a plain kernel
    assert kernels.block_peak_bytes(37810, chunked=False) > kernels.block_peak_bytes(37810, prepared=False)
    # the MLP whole: fc1's [S, 2*ffn] output beside the SwiGLU
    assert kernels.block_phases(37810, chunked=False)["fc2"] == 37810 * (5376 * 2 + 28672 + 14336) * 2


def test_weights_cast_once_a_block_are_held_through_their_chunks():
    """DynamicVRAM or offloaded weights: the qkv weight through the attention, fc1's and fc2's (and norm2's rows,
    whole) through the MLP; run whole, each cast lies beside its own call only."""
    plain, cast = kernels.block_phases(37810), kernels.block_phases(37810, cast_weights=True)
    qkv, fc1, fc2 = 21504 * 5376 * 2, 28672 * 5376 * 2, 5376 * 14336 * 2
    for phase in ("k projection", "q by chunks", "k operand", "v projection", "v operand", "attention"):
        assert cast[phase] == plain[phase] + qkv
    assert cast["fc2"] == plain["fc2"] + fc1 + fc2 + (37810 - 12608) * 5376 * 2
    whole, whole_cast = kernels.block_phases(8192, chunked=False), kernels.block_phases(8192, chunked=False,
                                                                                       cast_weights=True)
    assert whole_cast["fc1"] == whole["fc1"] + fc1 and whole_cast["fc2"] == whole["fc2"] + fc2
    assert whole_cast["attention"] == whole["attention"]  # the qkv cast went with its call
    int8 = kernels.block_phases(37810, weights="int8", cast_weights=True)
    assert int8["attention"] == kernels.block_phases(37810, weights="int8")["attention"] + 21504 * 5376  # int8 data


def test_the_settings_chunks_move_the_peak():
    assert "q by chunks" not in kernels.block_phases(8192)  # not past the setting's rows: projected whole
    assert "q by chunks" in kernels.block_phases(8193)
    smaller = kernels.block_phases(37810, mlp_chunk_tokens=4096)["fc2"]
    assert smaller < kernels.block_phases(37810)["fc2"]
    assert kernels.block_phases(37810, weights="int8", int8_mlp_chunk_tokens=4096)["fc2"] < kernels.block_phases(
        37810, weights="int8")["fc2"]
    assert kernels.block_phases(1000, act_bytes=4, chunked=False)["fc1"] == 1000 * (5376 + 28672) * 4


def test_a_model_call_holds_what_stocks_forward_keeps_beside_the_block():
    """The residual stream and the video embedding it was assembled from (both [S, hidden]), the fp32 patch rows
    (24 x 2 x 2 a token) and the rope table, through every block. Measured on an H100: a 149,936-token int8 run
    under a 12 GiB budget peaked at 8.71 GiB allocated (the sampler's latents besides)."""
    peak = kernels.block_peak_bytes(37810)
    held = 2 * 37810 * 5376 * 2 + 37810 * 96 * 4 + 37810 * 96 * 2 * 2
    assert kernels.model_call_bytes(37810, peak) == peak + held
    # a tiny block: the embedding's fp32 rows beside their bf16 copy are the larger
    assert kernels.model_call_bytes(10, 1, hidden=64) == 2 * 10 * 64 * 2 + 10 * 96 * 4 + 10 * 96 * 2 * 2 + 10 * 64 * 6
    long = kernels.model_call_bytes(149936, kernels.block_peak_bytes(149936, weights="int8"))
    assert 8.0 < long / 2**30 < 8.71  # below the whole run's peak, which holds the sampler's tensors too
    # the pack hands the video embedding back at the first block: one [S, hidden] less through every block
    released = kernels.model_call_bytes(149936, kernels.block_peak_bytes(149936, weights="int8"),
                                        embedding_released=True)
    assert long - released == 149936 * 5376 * 2
    assert kernels.model_call_bytes(37810, peak, embedding_released=True) == peak + held - 37810 * 5376 * 2


@pytest.mark.parametrize("bad", [dict(weights="fp8"), dict(act_bytes=0), dict(heads=0)])
def test_what_it_cannot_model_is_refused(bad):
    with pytest.raises(ValueError):
        kernels.block_phases(100, **bad)


def test_it_needs_no_device():
    assert isinstance(kernels.block_peak_bytes(10**6, weights="int8"), int) and not torch.cuda.is_initialized()
