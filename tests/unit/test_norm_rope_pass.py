"""The pack's RMSNorm + split-half RoPE pass (kernels/qk_transform.py) on the CPU.

Its Triton kernel runs under ``TRITON_INTERPRET=1`` in a subprocess (the flag must be set before the
kernel is decorated) and must equal, bit for bit, comfy-kitchen's CUDA steps written in torch
(``devkit.rope.kitchen_cuda_norm_rope``, with the interpreter's 1/sqrt for rsqrt): on Q/K views of a
fused qkv buffer, in place, with partial and full rotation, bf16 and fp32 tables, token and head
counts that are no multiple of the program's tile, two tilings of the pass, and a table cut to a token range as the chunked
projection passes it. The GPU test compares the compiled kernel with comfy-kitchen's CUDA kernel.
"""

from __future__ import annotations

import pytest
import torch

from comfyui_sage_strided_nhd import kernels
from devkit.interpreted import run_interpreted
from devkit.rope import make_rope_table


INTERPRETED = r"""
    from comfyui_sage_strided_nhd.kernels import qk_transform
    from devkit.rope import kitchen_cuda_norm_rope, make_rope_table
    g = torch.Generator().manual_seed(0)
    out = {}
    # partial token tiles and head groups (16 tokens, 8 heads a program), tails past the rotated dims
    for seq, heads, d, rot, tdtype, start in (
            (37, 3, 128, 96, torch.bfloat16, 0), (21, 9, 64, 64, torch.float32, 0),
            (18, 2, 32, 16, torch.bfloat16, 5), (45, 6, 128, 96, torch.bfloat16, 0),
            (37, 17, 128, 128, torch.float32, 0)):
        qkv = (3 * torch.randn(seq, 3 * heads * d, generator=g)).bfloat16()
        table = make_rope_table(seq + start, rot, dtype=tdtype, generator=g)[:, start:]
        qw = (1 + 0.3 * torch.randn(d, generator=g)).bfloat16()
        kw = (1 + 0.3 * torch.randn(d, generator=g)).float()
        q, k, v = (t.view(1, seq, heads, d) for t in qkv.split(heads * d, dim=-1))
        want_q, want_k = kitchen_cuda_norm_rope(q, table, qw, 1e-5), kitchen_cuda_norm_rope(k, table, kw, 1e-5)
        v_before = v.clone()
        assert qk_transform.own_pass_takes(q, k, table, qw, kw)
        qk_transform.norm_rope_pass(q, k, table, qw, kw, 1e-5)
        out[f"{seq}x{heads}x{d} rot {rot} {tdtype} from {start}"] = [
            int((q != want_q).sum()), int((k != want_k).sum()), bool(torch.equal(v, v_before))]
    report(out)
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(INTERPRETED)


def test_pass_takes_comfy_kitchens_cuda_steps(interpreted):
    assert len(interpreted) == 5
    for case, (q_differ, k_differ, v_kept) in interpreted.items():
        assert (q_differ, k_differ) == (0, 0), f"{case}: {q_differ} Q and {k_differ} K elements differ"
        assert v_kept, f"{case}: the pass wrote into V"


def test_pass_declines_what_it_was_not_written_for(gen):
    qkv = torch.randn(8, 3 * 2 * 64, generator=gen).bfloat16()
    q, k, _ = (t.view(1, 8, 2, 64) for t in qkv.split(128, dim=-1))
    table, w = make_rope_table(8, 32, dtype=torch.bfloat16), torch.ones(64)
    takes = kernels.qk_transform.own_pass_takes
    assert not takes(q.half(), k.half(), table, w, w)                   # fp16: comfy-kitchen runs
    assert not takes(q, k, table.half(), w, w)                          # an fp16 table
    assert not takes(q[..., :48], k[..., :48], table, w[:48], w[:48])   # head_dim not a multiple of 32
    assert not takes(q, k, table, w, w)                                 # on the CPU without the interpreter


def test_on_the_cpu_comfy_kitchen_runs_and_says_which_implementation(gen):
    """Off CUDA, comfy-kitchen would not run its CUDA kernel, so the pack's pass must not stand in."""
    qkv = torch.randn(8, 3 * 2 * 64, generator=gen).bfloat16()
    q, k, _ = (t.view(1, 8, 2, 64) for t in qkv.split(128, dim=-1))
    table, w = make_rope_table(8, 32, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    backend = kernels.qk_transform.kitchen_backend(q, k, table, w, w, 1e-5, 32)
    assert backend is not None and backend != kernels.qk_transform.KITCHEN_BACKEND


@pytest.mark.parametrize("release, pass_runs", [("0.2.31", True), ("0.2.40", True), ("0.2.36", False),
                                                ("0.2.41", False)])
def test_the_pass_runs_only_on_a_comfy_kitchen_release_it_was_checked_against(gen, monkeypatch, release, pass_runs):
    """Another release's rms_rope_split_half_ may round differently: comfy-kitchen's own kernel runs there."""
    import importlib.metadata

    qk = kernels.qk_transform
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: release if name == "comfy-kitchen" else real(name))
    kernels.kitchen.installed_release.cache_clear()
    monkeypatch.setattr(qk, "own_pass_takes", lambda *a: True)
    monkeypatch.setattr(qk, "kitchen_backend", lambda *a: qk.KITCHEN_BACKEND)
    ran = []
    monkeypatch.setattr(qk, "norm_rope_pass", lambda *a: ran.append("pass"))
    monkeypatch.setattr(qk._kitchen(), "rms_rope_split_half_", lambda *a, **kw: ran.append("comfy-kitchen"))
    try:
        qkv = torch.randn(8, 3 * 2 * 64, generator=gen).bfloat16()
        q, k, _ = (t.view(1, 8, 2, 64) for t in qkv.split(128, dim=-1))
        qk.norm_rope(q, k, make_rope_table(8, 32, dtype=torch.bfloat16), torch.ones(64), torch.ones(64), 1e-5)
    finally:
        kernels.kitchen.installed_release.cache_clear()
    assert ran == (["pass"] if pass_runs else ["comfy-kitchen"])
