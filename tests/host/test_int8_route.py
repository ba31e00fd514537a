"""The int8 ConvRot linears of the H3 block fast path through the pack's quantiser (nodes/int8_layers.py),
in a real ComfyUI 0.33 host on the CPU, with the quantiser's Triton kernel under the interpreter.

The route exists for comfy-kitchen's CUDA int8_linear, which a CPU does not have. So here stock's
int8_linear is comfy-kitchen's CUDA steps written in torch (devkit/int8_oracle.py: the convrot64
quantiser and an exact integer GEMM with its dequantising epilogue), and the route's GEMM is that same
GEMM: what is checked is the wiring (which layers take the route, with which activation, how their
weights are cast, the chunks, fc1's modulation folded into its quantiser, the report), bit for bit
against stock's block. The report must count every call the route took: a route that took none would
also equal stock.

The nodes reach the route through the ``kernels`` package's face (``kernels.int8_call_problem``, ...),
so the stand-ins for what a CPU lacks replace those names there; the GEMM and the block's own
modulation pass are replaced in their modules (kernels.int8_linear.gemm, kernels.h3_block.scale_shift_),
where the routed calls look them up.
"""

from __future__ import annotations

import pytest

from devkit.interpreted import run_interpreted

SCRIPT = r"""
    sys.path.insert(0, str(__import__("pathlib").Path({root!r}) / "tests"))
    from host_fixtures import import_pack, find_host
    pack = import_pack(find_host())
    torch.backends.mkldnn.enabled = False            # row-independent CPU GEMMs, as in conftest.py
    pack.nodes.chunking.CHUNKED_DEVICES = ("cuda", "cpu")
    import comfy_kitchen
    from devkit import h3 as dh, int8_oracle
    route = pack.kernels.int8_linear
    ia = pack.kernels.int8_activation

    int8_oracle.stand_in_for_cuda_int8_linear(comfy_kitchen)  # stock's CUDA int8_linear, in torch
    takes = lambda x, input_act=None: None if ia.quantize_takes(x, input_act) else "declined"
    pack.kernels.int8_call_problem = takes
    pack.kernels.int8_weight_problem = lambda x, qdata, w_scale, bias, input_act=None: None
    widths = []  # output columns of each GEMM the route ran
    modulated = []  # modulation passes run on their own (not folded into a quantiser)
    block_ops = pack.kernels.h3_block
    own_pass = block_ops.scale_shift_
    block_ops.scale_shift_ = lambda h, scale1, shift: (modulated.append(h.shape[0]), own_pass(h, scale1, shift))[1]
    gated = []  # gated residual passes run on their own (not added in a GEMM's epilogue)
    own_gated = block_ops.gated_residual_
    block_ops.gated_residual_ = lambda x, other, gate: (gated.append(x.shape[0]), own_gated(x, other, gate))[1]

    declines = set()  # output widths CUTLASS "declines" (stock would take cuBLAS); "k": the qkv weight's K rows
    route.gemm = int8_oracle.declining_gemm(declines, widths)

    # loaded as on a GPU: int8 weights computing in bf16 (on the CPU ComfyUI picks fp32 compute, and
    # linear_input_act then dequantises fc2's weight instead of running the int8 kernels)
    import comfy.model_management
    comfy.model_management.unet_manual_cast = lambda *args, **kwargs: torch.bfloat16
    config = dh.INT8_TINY_H3
    model = dh.build_model(config, torch.device("cpu"), torch.bfloat16, 0, "int8_convrot")
    assert model.model.diffusion_model.blocks[1].mlp.fc2.weight._params.orig_dtype == torch.bfloat16
    out = {{}}
    for chunk, qkv_chunk, declined, masked in ((30, 8192, (), False), (8192, 8192, (), False), (30, 32, (), False),
                                               (30, 32, ("k", 768), False), (30, 8192, (), True),
                                               (30, 8192, (1024,), False)):
        inputs = dh.random_block_inputs(model.model.diffusion_model.blocks[1], 100, seed=chunk, dtype=torch.bfloat16,
                                        masked=masked)
        x, t_emb, segments, rope = inputs
        want = model.model.diffusion_model.blocks[1](x.clone(), t_emb, segments, rope, transformer_options={{}})
        widths.clear()
        modulated.clear()
        gated.clear()
        declines.clear()
        declines.update(declined)
        settings = pack.nodes.patch.Settings(backend="sdpa", block_path="exact", mlp_chunk_tokens=chunk,
                                             int8_mlp_chunk_tokens=chunk, qkv_chunk_tokens=qkv_chunk)
        clone, patch = pack.nodes.h3_patch.patch_model(model, settings)
        clone.patch_model(load_weights=False)
        try:
            got = clone.model.diffusion_model.blocks[1](x.clone(), t_emb, segments, rope, transformer_options={{}})
        finally:
            clone.unpatch_model(unpatch_weights=False)
        diff = (got.float() - want.float()).abs().max().item()
        stock_reasons = {{key[1]: n for key, n in patch.report.int8_stock.items()}}  # keys: (layout, reason)
        out[f"exact {{chunk}} {{qkv_chunk}}{{' declined' if declined else ''}}{{' masked' if masked else ''}}"] = [
            diff, patch.report.int8_own, stock_reasons, sorted(set(widths)), len(modulated), len(gated)]
    report(out)
"""


@pytest.fixture(scope="module")
def routed(comfy_inprocess):
    from devkit.pack import REPO_ROOT
    return run_interpreted(SCRIPT.format(root=str(REPO_ROOT)))


# GEMM widths (output columns) of the narrow H3: qkv 3 x 256, Q, K and V 256 each, out and fc2 256, fc1 1024
def test_exact_block_takes_the_route_with_stocks_bits(routed):
    # qkv (whole) + out + fc1 and fc2 per MLP chunk (30 rows: 4 of 100)
    # ... and no modulation pass of its own: both modulations folded into the quantisers (qkv's, fc1's), both
    # gated residuals into the GEMMs' epilogues (out's, fc2's)
    assert routed["exact 30 8192"] == [0.0, 1 + 1 + 4 + 4, {}, [256, 768, 1024], 0, 0]
    assert routed["exact 8192 8192"] == [0.0, 1 + 1 + 1 + 1, {}, [256, 768, 1024], 0, 0]


def test_per_token_modulation_rows_folded_into_the_quantiser(routed):
    """Rows under a partial denoise mask have their own modulation row: fc1's quantiser applies each
    token's, with stock's bits, where an MLP chunk cuts the segment too. Their gates are per token too: the
    residual is added by its own pass, after the GEMM."""
    *rest, gated = routed["exact 30 8192 masked"]
    assert rest == [0.0, 1 + 1 + 4 + 4, {}, [256, 768, 1024], 0] and gated > 0


def test_qkv_projection_by_columns_on_its_input_quantised_once(routed):
    """Past qkv_chunk_tokens the projection is taken by columns (no prepared path on the CPU: Q and V whole
    beside the K projected ahead): one quantiser call, the 768-wide product never formed."""
    assert routed["exact 30 32"] == [0.0, 1 + 1 + 4 + 4, {}, [256, 1024], 0, 0]


def test_a_declined_gemm_leaves_the_projection_to_stocks_call(routed):
    """CUTLASS declining the K product (as it might a shape): the projection goes by rows, each
    chunk stock's own int8 linear (the whole 768-wide product declined too), with stock's bits."""
    diff, calls, declined, widths, modulated, _ = routed["exact 30 32 declined"]
    assert diff == 0.0 and widths == [256, 1024] and calls == 1 + 1 + 4 + 4
    assert modulated > 0  # the projection by rows takes the modulated rows: the modulation ran first
    assert set(declined) == {"CUTLASS declined an int8 GEMM of 100 x 256 x 256", "CUTLASS declined the shape"}


def test_a_declined_gemm_with_the_modulation_owed_applies_it_once(routed):
    """fc1's GEMM declined after the quantiser was given its rows with the modulation owed: stock's call
    runs on the rows modulated once (per chunk, by the block's own pass), with stock's bits."""
    diff, calls, declined, widths, modulated, gated = routed["exact 30 8192 declined"]
    assert diff == 0.0 and widths == [256, 768] and calls == 1 + 1 + 4
    assert declined == {"CUTLASS declined the shape": 4} and modulated > 0
    assert gated == 0  # fc2 itself is routed: its epilogue still adds the residual

