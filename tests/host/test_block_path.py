"""The H3 block fast path (nodes/h3_block.py) in a real ComfyUI 0.33 host, on the CPU.

A narrow H3 with the real head geometry (2 x 128 heads, rope on 96 dims) in both weight formats the
users load (bf16; int8_tensorwise + convrot through ComfyUI's mixed_precision_ops): every block
output must equal stock's bit for bit, with MLP chunks that cut modulation segments, with an
``attention=`` from a block replace, and with the attention-only setting. Blocks the fast path does
not know keep the attention-only patch, and the plan says why.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from devkit import h3 as dh

CONFIG = dh.INT8_TINY_H3
SEQ = 100


@pytest.fixture(scope="module", params=dh.WEIGHT_FORMATS)
def model(request, pack):
    return dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, request.param)


def patched_call(pack, base, index, inputs, **settings):
    """Block ``index`` of ``base`` with the node's patch applied: (output, the forward that ran, patch)."""
    if "mlp_chunk_tokens" in settings:  # the same rows per MLP chunk whatever the weight format
        settings.setdefault("int8_mlp_chunk_tokens", settings["mlp_chunk_tokens"])
    s = pack.nodes.patch.Settings(backend="sdpa", **settings)
    clone, patch = pack.nodes.h3_patch.patch_model(base, s)
    x, t_emb, segments, rope, *attention = inputs
    clone.patch_model(load_weights=False)
    try:
        block = clone.model.diffusion_model.blocks[index]
        forward = vars(block).get("forward")
        extra = {"attention": attention[0]} if attention else {}
        out = block(x.clone(), t_emb, segments, rope, transformer_options={}, **extra)
    finally:
        clone.unpatch_model(unpatch_weights=False)
    return out, forward, patch


def stock_call(base, index, inputs):
    x, t_emb, segments, rope = inputs[:4]
    return base.model.diffusion_model.blocks[index](x.clone(), t_emb, segments, rope, transformer_options={})


@pytest.mark.parametrize("chunk", [7, 30, 8192])
def test_fast_path_gives_stock_bits(pack, model, chunk):
    inputs = dh.random_block_inputs(model.model.diffusion_model.blocks[1], SEQ, seed=chunk, dtype=torch.bfloat16)
    want = stock_call(model, 1, inputs)
    got, forward, _ = patched_call(pack, model, 1, inputs, mlp_chunk_tokens=chunk)
    assert isinstance(forward, pack.nodes.h3_block.H3BlockForward)
    assert torch.equal(got, want), f"max abs {(got.float() - want.float()).abs().max().item()}"


@pytest.mark.parametrize("chunk", [30, 8192])
def test_per_token_modulation_rows_give_stock_bits(pack, model, chunk):
    """Current ComfyUI gives rows under a partial denoise mask their own timestep: the video segment's
    mod row is a per-token index tensor. The fast path modulates each token with its own row (stock's
    bits), also where an MLP chunk cuts that segment; a kernel reading one row for all would differ."""
    inputs = dh.random_block_inputs(model.model.diffusion_model.blocks[1], SEQ, seed=21 + chunk,
                                    dtype=torch.bfloat16, masked=True)
    assert torch.is_tensor(inputs[2][-1][2]) and inputs[2][-1][2].unique().numel() == 2
    want = stock_call(model, 1, inputs)
    got, forward, _ = patched_call(pack, model, 1, inputs, mlp_chunk_tokens=chunk)
    assert isinstance(forward, pack.nodes.h3_block.H3BlockForward)
    assert torch.equal(got, want), f"max abs {(got.float() - want.float()).abs().max().item()}"


def test_attention_from_a_block_replace_runs_inside_the_block(pack, model):
    block = model.model.diffusion_model.blocks[0]
    calls = []

    def attention(h, rope_freqs=None, transformer_options={}):  # what Model Sparse Attention passes
        calls.append(h.shape)
        return type(block.attn).forward(block.attn, h, rope_freqs=rope_freqs, transformer_options=transformer_options)

    inputs = dh.random_block_inputs(block, SEQ, seed=5, dtype=torch.bfloat16)
    want = stock_call(model, 0, inputs)
    got, _, patch = patched_call(pack, model, 0, (*inputs, attention), mlp_chunk_tokens=16)
    assert calls == [torch.Size([SEQ, CONFIG["hidden_size"]])] and patch.report.calls == 0
    assert torch.equal(got, want)


def test_attention_only_setting_keeps_the_stock_block(pack, model):
    inputs = dh.random_block_inputs(model.model.diffusion_model.blocks[0], SEQ, seed=6, dtype=torch.bfloat16)
    got, forward, patch = patched_call(pack, model, 0, inputs, block_path="attention_only")
    assert forward is None or not pack.nodes.ownership.is_own(forward)
    assert patch.report.calls == 1 and torch.equal(got, stock_call(model, 0, inputs))


def test_mlp_runs_whole_where_chunks_would_cost_or_change_bits(pack):
    def chunk_rows(*args):
        return pack.nodes.chunking.mlp_chunking(*args).rows

    layer = SimpleNamespace(weight=torch.empty(1), weight_function=[])
    mlp = SimpleNamespace(fc1=layer, fc2=layer)
    x = torch.empty(20, 4, dtype=torch.bfloat16)
    assert chunk_rows(mlp, x, 8) == 8 and chunk_rows(mlp, x, 32) is None   # short sequences: whole
    assert chunk_rows(mlp, x.float(), 8) is None                             # fp32 GEMMs split by rows differ
    # a weight each call would cast (offloaded, DynamicVRAM, a LoRA weight function) on a layer whose forward is not
    # comfy.ops' Linear, whose cast the cast once mirrors: each chunk would cast it again, so the MLP runs whole
    # (comfy.ops' own layers cast once per block: tests/host/test_offloaded_chunking.py)
    offloaded = SimpleNamespace(fc1=SimpleNamespace(weight=torch.empty(1, device="meta")), fc2=layer)
    assert chunk_rows(offloaded, x, 8) is None
    lora = SimpleNamespace(fc1=SimpleNamespace(weight=torch.empty(1), weight_function=[abs]), fc2=layer)
    assert chunk_rows(lora, x, 8) is None
    dynamic = SimpleNamespace(weight=torch.empty(1, device="meta"), _v=(None, 0, 1), weight_function=[])
    assert chunk_rows(SimpleNamespace(fc1=dynamic, fc2=dynamic), x, 8) is None
    assert "comfy.ops' Linear forward" in pack.nodes.chunking.mlp_chunking(
        SimpleNamespace(fc1=dynamic, fc2=dynamic), x, 8).reason
    foreign = SimpleNamespace(fc1=layer, fc2=layer, forward=lambda h: h)     # another node's MLP forward
    assert chunk_rows(foreign, x, 8) is None


def test_token_chunks_only_where_each_output_row_depends_on_its_own_input_row(pack):
    """An fp8 weight whose activation scale ComfyUI takes from the whole input (no ``input_scale``)
    would change its bits in token chunks: its MLP and qkv projection run whole."""
    from comfy.quant_ops import QuantizedTensor

    rules = pack.nodes.chunking
    w = torch.randn(8, 8).bfloat16()
    fp8 = QuantizedTensor.from_float(w, "TensorCoreFP8Layout")
    int8 = QuantizedTensor.from_float(w, "TensorWiseINT8Layout")

    def layer(weight, **extra):
        return SimpleNamespace(weight=weight, weight_function=[], **extra)
    assert rules.rows_independent(layer(w)) and rules.rows_independent(layer(int8))  # int8: a per-row quantiser
    assert not rules.rows_independent(layer(fp8))
    assert rules.rows_independent(layer(fp8, input_scale=torch.tensor(0.5)))    # a fixed activation scale
    x = torch.empty(20, 8, dtype=torch.bfloat16)
    assert rules.projection_chunking(layer(w), x, 8).rows == 8
    assert rules.projection_chunking(layer(w), x, 32).rows is None
    assert rules.projection_chunking(layer(fp8), x, 8).rows is None
    assert rules.projection_chunking(layer(w), x.float(), 8).rows is None
    assert rules.mlp_chunking(SimpleNamespace(fc1=layer(fp8), fc2=layer(w)), x, 8).rows is None


def test_mlp_chunk_rows_follow_the_weight_format(pack):
    """int8 tensor-wise MLPs take int8_mlp_chunk_tokens, every other format mlp_chunk_tokens."""
    from comfy.quant_ops import QuantizedTensor

    w = torch.randn(8, 8).bfloat16()
    settings = pack.nodes.patch.Settings(mlp_chunk_tokens=300, int8_mlp_chunk_tokens=200)
    setting = pack.nodes.chunking.mlp_chunk_setting
    for weight, rows in ((w, 300), (QuantizedTensor.from_float(w, "TensorWiseINT8Layout"), 200),
                         (QuantizedTensor.from_float(w, "TensorCoreFP8Layout"), 300)):
        layer = SimpleNamespace(weight=weight)
        assert setting(settings, SimpleNamespace(fc1=layer, fc2=layer)) == rows
    defaults = pack.nodes.patch.Settings()
    assert (defaults.mlp_chunk_tokens, defaults.int8_mlp_chunk_tokens) == (12800, 8192)
    with pytest.raises(ValueError, match="int8_mlp_chunk_tokens must be a positive int"):
        pack.nodes.patch.Settings(int8_mlp_chunk_tokens=0)


def test_column_products_only_for_a_plain_product(pack, model):
    """Q, K and V by column blocks only where the projection is ``x @ weight.T`` as it stands."""
    rules = pack.nodes.chunking
    inner = CONFIG["num_attention_heads"] * CONFIG["attention_head_dim"]
    qkv = model.model.diffusion_model.blocks[0].attn.qkv_proj
    x = torch.randn(40, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(3)).bfloat16()
    columns = rules.column_products(qkv, x, inner)
    if not isinstance(qkv.weight, torch.nn.Parameter) or qkv.weight.dtype != torch.bfloat16:
        assert columns is None  # int8 weights: the module's own quantised product, by rows
        return
    whole = qkv(x)
    torch.testing.assert_close(torch.cat([project(x) for project in columns], 1), whole)  # the GPU checks the bits
    w = qkv.weight
    for layer in (SimpleNamespace(weight=w, bias=torch.zeros(3 * inner)),              # a bias
                  SimpleNamespace(weight=w.float()),                                   # cast per call
                  SimpleNamespace(weight=w, weight_function=[abs]),                    # a LoRA hook
                  SimpleNamespace(weight=w, comfy_cast_weights=True),                  # offloaded or cast
                  SimpleNamespace(weight=w[:inner])):                                  # not a fused qkv
        assert rules.column_products(layer, x, inner) is None


def test_a_restored_mlp_forward_is_not_another_nodes(pack, model):
    """ComfyUI unpatches an object patch by setting the original bound method on the module: the
    fast path must still chunk that MLP (a benchmark found it did not)."""
    mlp = model.model.diffusion_model.blocks[0].mlp
    x = torch.empty(40, CONFIG["hidden_size"], dtype=torch.bfloat16)
    saved = vars(mlp).get("forward")
    try:
        mlp.forward = type(mlp).forward.__get__(mlp)  # what unpatch_model leaves behind
        assert pack.nodes.chunking.mlp_chunking(mlp, x, 8).rows == 8
        mlp.forward = lambda h: h
        assert pack.nodes.chunking.mlp_chunking(mlp, x, 8).rows is None
    finally:
        if saved is None:
            vars(mlp).pop("forward", None)
        else:
            mlp.forward = saved


def test_unknown_block_structure_keeps_the_attention_only_patch(pack, monkeypatch):
    import comfy.ldm.minimax.model as h3

    class ChangedBlock(h3.DiTBlock):
        def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, scale=1.0):
            return super().forward(x, t_emb, mod_segments, rope_freqs, transformer_options)

    dm = dh.tiny_h3_model()
    for block in dm.blocks:
        block.__class__ = ChangedBlock
    mp = dh.patcher_for(dm)
    clone, patch = pack.nodes.h3_patch.patch_model(mp, pack.nodes.patch.Settings(backend="sdpa"))
    assert not any(k.endswith(".0.forward") and ".attn." not in k for k in clone.object_patches)
    plan = patch.planner(clone, clone.model_options)
    assert plan.block_path_blocks == 0 and plan.blocks_patched == 2
    off = [n.text for n in plan.notes if n.code == "block_path_off"]
    assert off and "forward(" in off[0] and "scale" in off[0], plan.notes


@pytest.mark.parametrize("masked", [False, True])
def test_fast_path_adds_no_graph_break_under_torch_compile(pack, model, masked):
    """torch._dynamo.explain of one block: the fast path breaks the graph exactly where the
    attention-only patch does (the attention, kept out of the graph on purpose), nowhere else; also
    with per-token modulation rows."""
    block = model.model.diffusion_model.blocks[0]
    inputs = dh.random_block_inputs(block, SEQ, seed=9, dtype=torch.bfloat16, masked=masked)
    breaks = {}
    for path in ("exact", "attention_only"):
        clone, _ = pack.nodes.h3_patch.patch_model(
            model, pack.nodes.patch.Settings(backend="sdpa", block_path=path, mlp_chunk_tokens=30,
                                             int8_mlp_chunk_tokens=30))
        clone.patch_model(load_weights=False)
        try:
            torch._dynamo.reset()
            x, t_emb, segments, rope = inputs
            explained = torch._dynamo.explain(lambda b: b(x.clone(), t_emb, segments, rope, transformer_options={}))(block)
        finally:
            clone.unpatch_model(unpatch_weights=False)
        breaks[path] = [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    assert len(breaks["exact"]) == len(breaks["attention_only"]), breaks
    assert all("_attend" in reason for reason in breaks["exact"]), breaks["exact"]


def test_a_patched_norm_runs_as_stock_runs_it(pack, model):
    """A norm with a LoRA-style weight function (here: one that changes the weight) is called as the
    model has it: the fast path's block output is stock's with the same patched norms, bit for bit."""
    block = model.model.diffusion_model.blocks[1]
    inputs = dh.random_block_inputs(block, SEQ, seed=12, dtype=torch.bfloat16)
    unpatched = stock_call(model, 1, inputs)
    saved = {name: getattr(block, name).weight_function for name in ("norm1", "norm2")}
    try:
        for name in saved:
            getattr(block, name).weight_function = [lambda w: w * 1.5]
        want = stock_call(model, 1, inputs)
        got, forward, _ = patched_call(pack, model, 1, inputs, mlp_chunk_tokens=30)
    finally:
        for name, functions in saved.items():
            getattr(block, name).weight_function = functions
    assert isinstance(forward, pack.nodes.h3_block.H3BlockForward)
    assert not torch.equal(want, unpatched), "the weight function must change the output for the check to count"
    assert torch.equal(got, want), f"max abs {(got.float() - want.float()).abs().max().item()}"
