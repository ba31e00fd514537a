"""The H3 block fast path on the GPU: one full-width DiT block (hidden 5376, 56 x 128 heads, SwiGLU
14336) in both weight formats must give stock ComfyUI's bits, at two sequence lengths and with MLP
chunks that cut the modulation segments. This is where the bf16 chunked GEMMs (cuBLAS) and the
Triton modulation pass are checked against stock (the CPU tests cannot see either).

Stock runs SageAttention (``--use-sage-attention``) and the patch its ``sage2`` back-end, whose
prepared path gives SageAttention's bits (SDPA does not serve here: on the GPU it picks its kernel by
the strides, so stock's HND views and the patch's NHD views can get different kernels). Needs CUDA,
SageAttention 2 and the ComfyUI host ($COMFYUI_PATH).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HOST = os.environ.get("COMFYUI_PATH")


@pytest.fixture(scope="module")
def pack():
    if not HOST or not (Path(HOST) / "comfy").is_dir():
        pytest.skip("needs the ComfyUI host: set COMFYUI_PATH")
    if importlib.util.find_spec("sageattention") is None:
        pytest.skip("needs SageAttention 2 (stock and the patch must run the same kernel)")
    from devkit.comfy import import_comfyui
    from devkit.pack import import_pack

    import_comfyui(Path(HOST), cpu=False, stock_flag="use_sage_attention")
    pack = import_pack()
    importlib.import_module(pack.__name__ + ".nodes.h3_patch")  # the ComfyUI glue, now that comfy imports
    return pack


@pytest.fixture(scope="module", params=["bf16", "int8_convrot"])
def model(request, pack):
    from devkit import h3 as dh

    config = dict(dh.FULL_H3, num_layers=1, token_refiner_num_layers=1)
    patcher = dh.build_model(config, torch.device("cuda"), torch.bfloat16, 0, request.param)
    yield patcher
    del patcher
    torch.cuda.empty_cache()


@pytest.mark.parametrize("one_pass_modulation", [True, False])
@pytest.mark.parametrize("seq,chunk", [(8192, 3000), (37810, None)])  # None: the settings' defaults
def test_full_width_block_gives_stock_bits(pack, model, seq, chunk, one_pass_modulation, monkeypatch):
    """Without the one-pass modulation: stock's mul_/add_ there (which piece differs, if one does)."""
    from devkit import h3 as dh

    rows = {} if chunk is None else dict(mlp_chunk_tokens=chunk, int8_mlp_chunk_tokens=chunk, qkv_chunk_tokens=chunk)
    settings = pack.nodes.patch.Settings(backend="sage2", **rows)

    if not one_pass_modulation:
        monkeypatch.setattr(pack.kernels.h3_block, "fusable", lambda h: False)

    block = model.model.diffusion_model.blocks[0]
    x, t_emb, segments, rope = dh.random_block_inputs(block, seq, seed=seq, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = block(x.clone(), t_emb, segments, rope, transformer_options={})
        clone, patch = pack.nodes.h3_patch.patch_model(model, settings)
        clone.patch_model(load_weights=False)
        try:
            assert isinstance(vars(block).get("forward"), pack.nodes.h3_block.H3BlockForward)
            got = block(x.clone(), t_emb, segments, rope, transformer_options={})
        finally:
            clone.unpatch_model(unpatch_weights=False)
    assert patch.report.calls == 1 and patch.report.projected == 1  # the qkv projection came by token chunks
    import comfy.ops
    if isinstance(block.mlp.fc1.weight, comfy.ops.QuantizedTensor):  # int8: each linear on the pack's quantiser
        # MLP chunks; the qkv input is quantised once (by columns), out_proj's whole
        n = -(-seq // settings.int8_mlp_chunk_tokens)
        assert patch.report.int8_own == 2 * n + 2 and not patch.report.int8_stock, dict(patch.report.int8_stock)
    differ = int((got != want).sum())
    assert differ == 0, f"{differ} of {got.numel()} elements differ, max abs {(got.float() - want.float()).abs().max()}"


# --- the pieces the fast path assumes give stock's bits: each checked on its own ---------------------
def _rows_split(fn, x, chunk):
    return torch.cat([fn(x[a:b]) for a, b in [(i, min(i + chunk, x.shape[0])) for i in range(0, x.shape[0], chunk)]])


def _differ(a, b) -> int:
    return int((a != b).sum())


def test_modulation_pass_gives_stocks_bits_on_cuda(pack):
    from comfyui_sage_strided_nhd.kernels import h3_block

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(37810, 5376, device="cuda", generator=g).bfloat16() * 3
    scale1 = 1.0 + torch.randn(5376, device="cuda", generator=g).bfloat16()
    shift = torch.randn(5376, device="cuda", generator=g).bfloat16()
    want = h.clone()
    want[100:514].mul_(scale1).add_(shift)
    got = h.clone()
    h3_block.scale_shift_(got[100:514], scale1, shift)
    assert _differ(got, want) == 0


def test_per_token_modulation_passes_give_stocks_bits_on_cuda(pack):
    """A partial denoise mask gives per-token modulation rows: both passes compile and keep stock's bits."""
    from comfyui_sage_strided_nhd.kernels import h3_block

    g = torch.Generator(device="cuda").manual_seed(3)
    rows = 4099
    h = torch.randn(rows, 5376, device="cuda", generator=g).bfloat16() * 3
    scale1 = 1.0 + torch.randn(rows, 5376, device="cuda", generator=g).bfloat16()
    shift = torch.randn(rows, 5376, device="cuda", generator=g).bfloat16()
    got = h.clone()
    h3_block.scale_shift_(got, scale1, shift)
    assert _differ(got, h.clone().mul_(scale1).add_(shift)) == 0
    other = torch.randn(rows, 5376, device="cuda", generator=g).bfloat16()
    gate = torch.randn(rows, 5376, device="cuda", generator=g).bfloat16()
    got = h.clone()
    h3_block.gated_residual_(got, other, gate)
    assert _differ(got, h.clone().addcmul_(other, gate)) == 0


def test_swiglu_pass_gives_stocks_bits_on_cuda(pack):
    """torch's CUDA silu (expf, an IEEE division) then mul_, against the one pass, on fc1's full width."""
    from comfyui_sage_strided_nhd.kernels import h3_block

    g = torch.Generator(device="cuda").manual_seed(2)
    u = (torch.randn(37810, 2 * 14336, device="cuda", generator=g) * 3).bfloat16()
    u[:5] = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e-30], device="cuda").bfloat16()[:, None]  # edges of exp
    gate, up = u.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate).mul_(up)
    assert _differ(h3_block.swiglu(u), want) == 0


@pytest.mark.parametrize("weights", ["bf16", "int8_convrot"])
def test_block_pieces_give_the_same_bits_split_by_rows(pack, weights):
    """RMSNorm, fc1, the SwiGLU-quantising fc2 and the attention's qkv projection of the real model,
    whole vs in 7,616-row chunks."""
    import comfy.ops
    from devkit import h3 as dh

    config = dict(dh.FULL_H3, num_layers=1, token_refiner_num_layers=1)
    model = dh.build_model(config, torch.device("cuda"), torch.bfloat16, 0, weights)
    block = model.model.diffusion_model.blocks[0]
    x = torch.randn(37810, 5376, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).bfloat16()
    with torch.inference_mode():
        pieces = {"norm2": block.norm2, "fc1": block.mlp.fc1, "qkv_proj": block.attn.qkv_proj,
                  "fc2_swiglu": lambda t: comfy.ops.linear_input_act(block.mlp.fc2, t, "swiglu")}
        inputs = {"norm2": x, "fc1": x, "qkv_proj": x, "fc2_swiglu": block.mlp.fc1(x)}
        differing = {name: _differ(fn(inputs[name]), _rows_split(fn, inputs[name], 7616)) for name, fn in pieces.items()}
    print(f"rows split, {weights}: elements that differ {differing}")
    assert all(n == 0 for n in differing.values()), differing



# --- weights ComfyUI streams: the legacy low-VRAM load ------------------------------------------------------------
@pytest.fixture(scope="module", params=["bf16", "int8_convrot"])
def offloaded_model(request, pack):
    """One full-width block whose weights ComfyUI's legacy ModelPatcher keeps on the CPU: loaded whole, then unloaded
    as ComfyUI unloads under memory pressure (``partially_unload``): every comfy.ops layer back on the CPU (pinned),
    its weight cast to the GPU by each call (``comfy_cast_weights``)."""
    import comfy.model_management as mm
    from devkit import h3 as dh

    config = dict(dh.FULL_H3, num_layers=1, token_refiner_num_layers=1)
    patcher = dh.build_model(config, torch.device("cuda"), torch.bfloat16, 1, request.param)
    if patcher.is_dynamic():
        pytest.skip("ComfyUI loaded the model for DynamicVRAM; this test is the legacy low-VRAM load's")
    if request.param == "bf16":  # drawn on the device: loaded as a loader node's model is, so it can be unloaded
        mm.load_models_gpu([patcher], force_full_load=True)
    # the GPU tests' highvram keeps the offload device on the GPU: unload to the CPU as a 12-16 GB card's run does
    patcher.partially_unload(torch.device("cpu"), memory_to_free=patcher.model_size())
    yield patcher
    del patcher
    torch.cuda.empty_cache()


def test_offloaded_block_chunks_on_weights_cast_once_with_stock_bits(pack, offloaded_model, monkeypatch):
    """At 20,000 tokens (past every chunk setting) with qkv, fc1 and fc2 on the CPU: the MLP and the qkv projection
    run by token chunks on weights cast once per block (every layer cast exactly as often as stock's block casts it:
    once), and the block's output is stock's bit for bit."""
    from collections import Counter

    import comfy.ops
    from devkit import h3 as dh

    rules = pack.nodes.chunking
    block = offloaded_model.model.diffusion_model.blocks[0]
    for layer in (block.attn.qkv_proj, block.mlp.fc1, block.mlp.fc2):
        assert layer.weight.device.type == "cpu" and layer.comfy_cast_weights, layer
    names = {id(m): n for n, m in block.named_modules()}
    casts = Counter()
    cast = comfy.ops.cast_bias_weight
    monkeypatch.setattr(comfy.ops, "cast_bias_weight",  # every stock cast: the layers' forwards', the route's
                        lambda s, *a, **k: (casts.update([names.get(id(s), "?")]), cast(s, *a, **k))[1])
    plans = []
    for name in ("mlp_chunking", "projection_chunking"):
        decide = getattr(rules, name)
        monkeypatch.setattr(rules, name, lambda *a, _decide=decide, **k: plans.append(_decide(*a, **k)) or plans[-1])

    seq = 20000
    settings = pack.nodes.patch.Settings(backend="sage2")  # 12,800 / 8,192 MLP rows, 8,192 qkv rows
    x, t_emb, segments, rope = dh.random_block_inputs(block, seq, seed=11, dtype=torch.bfloat16,
                                                      device=torch.device("cuda"))
    with torch.inference_mode():
        want = block(x.clone(), t_emb, segments, rope, transformer_options={})
        stock_casts = dict(casts)
        casts.clear()
        clone, patch = pack.nodes.h3_patch.patch_model(offloaded_model, settings)
        clone.patch_model(load_weights=False)
        try:
            assert isinstance(vars(block).get("forward"), pack.nodes.h3_block.H3BlockForward)
            got = block(x.clone(), t_emb, segments, rope, transformer_options={})
        finally:
            clone.unpatch_model(unpatch_weights=False)
    projection, mlp = plans  # the attention decides first
    assert projection == rules.Chunking(rows=settings.qkv_chunk_tokens, modes=(rules.CAST_ONCE,)), projection
    assert mlp == rules.Chunking(rows=rules.mlp_chunk_setting(settings, block.mlp), modes=(rules.CAST_ONCE,) * 2), mlp
    for name in ("attn.qkv_proj", "mlp.fc1", "mlp.fc2"):
        assert stock_casts[name] == casts[name] == 1, (name, stock_casts, dict(casts))
    assert casts == stock_casts  # norm2 too: one call on every row where it casts
    assert patch.report.calls == 1 and patch.report.projected == 1  # the qkv projection came by token chunks
    if isinstance(block.mlp.fc1.weight, comfy.ops.QuantizedTensor):  # every int8 call on the pack's quantiser
        n = -(-seq // settings.int8_mlp_chunk_tokens)
        assert patch.report.int8_own == 2 * n + 2 and not patch.report.int8_stock, dict(patch.report.int8_stock)
    differ = int((got != want).sum())
    assert differ == 0, f"{differ} of {got.numel()} elements differ, max abs {(got.float() - want.float()).abs().max()}"
