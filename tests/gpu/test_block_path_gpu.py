"""The H3 block fast path on the GPU: one full-width DiT block (hidden 5376, 56 x 128 heads, SwiGLU
14336) in both weight formats must give stock ComfyUI's bits, at two sequence lengths and with MLP
chunks that cut the modulation segments. This is where the bf16 chunked GEMMs (cuBLAS) and the
Triton modulation pass are checked against stock (the CPU tests cannot see either).

Stock runs PyTorch attention (SDPA) and the patch its ``sdpa`` back-end (equal bits): what is tested
is the block's work around the attention. Needs CUDA and the ComfyUI host ($COMFYUI_PATH).
"""

from __future__ import annotations

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
    from devkit.comfy import import_comfyui
    from devkit.pack import import_pack

    import_comfyui(Path(HOST), cpu=False, stock_flag="use_pytorch_cross_attention")
    return import_pack()


@pytest.fixture(scope="module", params=["bf16", "int8_convrot"])
def model(request, pack):
    from devkit import h3 as dh

    config = dict(dh.FULL_H3, num_layers=1, token_refiner_num_layers=1)
    patcher = dh.build_model(config, torch.device("cuda"), torch.bfloat16, 0, request.param)
    yield patcher
    del patcher
    torch.cuda.empty_cache()


@pytest.mark.parametrize("seq,chunk", [(8192, 3000), (37810, 8192)])
def test_full_width_block_gives_stock_bits(pack, model, seq, chunk):
    from devkit import h3 as dh

    block = model.model.diffusion_model.blocks[0]
    x, t_emb, segments, rope = dh.random_block_inputs(block, seq, seed=seq, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = block(x.clone(), t_emb, segments, rope, transformer_options={})
        clone, patch = pack.nodes.h3_patch.patch_model(
            model, pack.nodes.patch.Settings(backend="sdpa", mlp_chunk_tokens=chunk))
        clone.patch_model(load_weights=False)
        try:
            assert isinstance(vars(block).get("forward"), pack.nodes.h3_block.H3BlockForward)
            got = block(x.clone(), t_emb, segments, rope, transformer_options={})
        finally:
            clone.unpatch_model(unpatch_weights=False)
    assert patch.report.calls == 1
    differ = int((got != want).sum())
    assert differ == 0, f"{differ} of {got.numel()} elements differ, max abs {(got.float() - want.float()).abs().max()}"
