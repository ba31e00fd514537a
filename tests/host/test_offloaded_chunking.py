"""The block fast path's token chunks where ComfyUI casts a linear's weight per call (nodes/chunking.py's cast once),
in a real ComfyUI 0.33 host on the CPU: which linears are chunked and how (``Chunking``: resident, cast once, whole
and why), and blocks whose qkv, fc1 and fc2 weights are offloaded or patched by a LoRA weight function: each weight
cast once per block (every cast counted, the qkv's held until the attention has returned), every chunk run on it,
the block's output stock's bit for bit. The int8 ConvRot route's cast once runs in an interpreted subprocess, as in
tests/host/test_int8_route.py.

On the CPU the weights and the compute share one device: a layer marked as ComfyUI's low-VRAM load marks an offloaded
one (``comfy_cast_weights``) stands for an offloaded layer (the ``offloaded`` fixture tells ``weight_resident`` so).
"""

from __future__ import annotations

import contextlib
import gc
import types
import weakref
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from devkit import h3 as dh
from devkit.interpreted import run_interpreted

CONFIG = dh.INT8_TINY_H3
SEQ = 100


@pytest.fixture(scope="module")
def bf16_model(pack):
    return dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "bf16")


@pytest.fixture(scope="module")
def int8_block(pack):
    model = dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "int8_convrot")
    return model.model.diffusion_model.blocks[0]


@pytest.fixture
def offloaded(pack, monkeypatch):
    """Layers with ``comfy_cast_weights`` count as offloaded: each call casts their weight from another device."""
    rules = pack.nodes.chunking
    resident = rules.weight_resident
    monkeypatch.setattr(rules, "weight_resident", lambda layer, device: (
        not getattr(layer, "comfy_cast_weights", False) and resident(layer, device)))


def linear(rows=32, cols=16, device="cpu", **state):
    """A ComfyUI Linear (comfy.ops.disable_weight_init, as a bf16 H3 loads) with a random bf16 weight."""
    import comfy.ops

    layer = comfy.ops.disable_weight_init.Linear(cols, rows, bias=False, dtype=torch.bfloat16)
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)).bfloat16()
    layer.weight = torch.nn.Parameter(weight.to(device), requires_grad=False)
    for name, value in state.items():
        setattr(layer, name, value)
    return layer


# --- the decisions ---------------------------------------------------------------------------------------------
def test_each_linear_is_resident_cast_once_or_whole_with_the_reason(pack):
    rules = pack.nodes.chunking
    x = torch.empty(20, 16, dtype=torch.bfloat16)
    assert rules.linear_chunking(linear(), x) == (rules.RESIDENT, None)
    # the legacy low-VRAM load: the weight on another device, cast by each call (``comfy_cast_weights``)
    assert rules.linear_chunking(linear(device="meta", comfy_cast_weights=True), x) == (rules.CAST_ONCE, None)
    # DynamicVRAM: each call's cast maps the layer's pages (``_v``); a LoRA weight function applied by each cast
    assert rules.linear_chunking(linear(comfy_cast_weights=True, _v=(None, 0, 1)), x) == (rules.CAST_ONCE, None)
    assert rules.linear_chunking(linear(weight_function=[lambda w: w * 2]), x) == (rules.CAST_ONCE, None)

    def declined(layer, rows=x, input_act=None):
        mode, why = rules.linear_chunking(layer, rows, input_act)
        assert mode is None and why
        return why

    assert "as it lies" in declined(linear(device="meta"))  # no cast in its forward: not one to enter once
    replaced = linear(device="meta", comfy_cast_weights=True)
    replaced.forward = types.MethodType(lambda self, t: t, replaced)
    assert "replaced the layer's forward" in declined(replaced)

    import comfy.ops

    class OwnForward(comfy.ops.disable_weight_init.Linear):  # another forward (cublas_ops, a 0.40 prologue...)
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)
    assert "OwnForward.forward is not comfy.ops' Linear forward" in declined(
        linear(device="meta", comfy_cast_weights=True, __class__=OwnForward))
    offloaded = linear(device="meta", comfy_cast_weights=True)
    assert "torch.float32 activations" in declined(offloaded, x.float())
    assert "meta GEMMs" in declined(offloaded, x.to("meta"))
    assert "linear_input_act('swiglu')" in declined(offloaded, x, "swiglu")


def test_torch_compile_keeps_resident_mlp_chunks_and_nothing_cast_once(pack, monkeypatch):
    rules = pack.nodes.chunking
    x = torch.empty(20, 16, dtype=torch.bfloat16)
    resident = SimpleNamespace(fc1=linear(32, 16), fc2=linear(16, 16))
    cast = SimpleNamespace(fc1=linear(32, 16, device="meta", comfy_cast_weights=True), fc2=linear(16, 16))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert rules.mlp_chunking(resident, x, 8) == rules.Chunking(rows=8, modes=(rules.RESIDENT, rules.RESIDENT))
    assert "torch.compile" in rules.mlp_chunking(cast, x, 8).reason and rules.mlp_chunking(cast, x, 8).rows is None
    assert "torch.compile" in rules.projection_chunking(linear(48, 16), x, 8).reason


def test_mlp_chunking_gives_each_linears_mode_or_why_it_runs_whole(pack, monkeypatch):
    import comfy.model_management

    rules = pack.nodes.chunking
    x = torch.empty(20, 16, dtype=torch.bfloat16)
    fc1, fc2 = linear(32, 16, device="meta", comfy_cast_weights=True), linear(16, 16, device="meta",
                                                                             comfy_cast_weights=True)
    assert rules.mlp_chunking(SimpleNamespace(fc1=fc1, fc2=linear(16, 16)), x, 8) == rules.Chunking(
        rows=8, modes=(rules.CAST_ONCE, rules.RESIDENT))
    both = SimpleNamespace(fc1=fc1, fc2=fc2)
    for streams in (0, 2):  # none: each cast allocates its own; two: consecutive casts take the other's buffer
        monkeypatch.setattr(comfy.model_management, "NUM_STREAMS", streams)
        assert rules.mlp_chunking(both, x, 8) == rules.Chunking(rows=8, modes=(rules.CAST_ONCE, rules.CAST_ONCE))
    monkeypatch.setattr(comfy.model_management, "NUM_STREAMS", 1)  # --async-offload 1: one buffer for every cast
    assert "one offload stream" in rules.mlp_chunking(both, x, 8).reason
    assert rules.mlp_chunking(SimpleNamespace(fc1=fc1, fc2=linear(16, 16)), x, 8).rows == 8  # one cast held: fine
    assert rules.mlp_chunking(both, x, 32) == rules.Chunking()  # one chunk: whole, nothing declined
    plain = SimpleNamespace(fc1=linear(32, 16), fc2=linear(16, 16, device="meta"))
    assert rules.mlp_chunking(plain, x, 8).reason.startswith("fc2: ")
    assert rules.projection_chunking(fc1, x, 8) == rules.Chunking(rows=8, modes=(rules.CAST_ONCE,))
    assert rules.projection_chunking(linear(48, 16, device="meta"), x, 8).rows is None


def test_int8_linears_cast_once_where_the_route_takes_their_calls(pack, int8_block, monkeypatch):
    """The int8 ConvRot fc1 and fc2 (SwiGLU folded into its quantiser) cast once where ``stock_quantizer_reason``
    gives the pack's quantiser the call, asked on a chunk's shape (fc2's input: [rows, 2 * ffn]); else whole."""
    rules = pack.nodes.chunking
    mlp = int8_block.mlp
    for layer in (mlp.fc1, mlp.fc2):
        monkeypatch.setattr(layer, "_v", (None, 0, 1), raising=False)  # each call casts (DynamicVRAM)
    x = torch.randn(100, CONFIG["hidden_size"]).bfloat16()
    assert rules.mlp_chunking(mlp, x, 30, routes={}).reason == "fc1: not on a CUDA device"
    asked = []
    monkeypatch.setattr(pack.kernels, "int8_call_problem",
                        lambda rows, input_act=None: asked.append((tuple(rows.shape), input_act)))
    assert rules.mlp_chunking(mlp, x, 30, routes={}) == rules.Chunking(rows=30, modes=(rules.CAST_ONCE,) * 2)
    rows = pack.kernels.token_chunks(100, 30)[0][1]
    assert asked == [((rows, CONFIG["hidden_size"]), None), ((rows, 2 * CONFIG["ffn_hidden_size"]), "swiglu")]
    monkeypatch.setattr(mlp.fc1, "weight_function", [lambda w: w])  # a LoRA: stock's forward dequantises
    assert "would not run the int8 GEMM" in rules.mlp_chunking(mlp, x, 30, routes={}).reason


# --- the cast once ---------------------------------------------------------------------------------------------
def test_the_cast_context_keeps_no_input_alive(pack):
    """The qkv's cast is held while the attention runs: its context must not keep the projection's input."""
    layer = linear(comfy_cast_weights=True)
    x = torch.randn(20, 16).bfloat16()
    want, ref = layer(x[:5]), weakref.ref(x)
    with pack.nodes.chunking.cast_once(layer, x) as held:
        assert torch.equal(held(x[:5]), want)
        del x
        gc.collect()
        assert ref() is None


def test_a_held_cast_refuses_a_call_it_was_not_cast_for(pack):
    layer = linear(comfy_cast_weights=True)
    x = torch.randn(20, 16).bfloat16()
    with pack.nodes.chunking.cast_once(layer, x) as held:
        assert torch.equal(held(x[:7]), torch.nn.functional.linear(x[:7], layer.weight))
        with pytest.raises(RuntimeError, match="cast once for torch.bfloat16 rows"):
            held(x.float())
        with pytest.raises(RuntimeError, match="act 'swiglu'"):
            held(x, "swiglu")


def test_shares_memory_finds_two_casts_in_one_buffer(pack):
    from comfy.quant_ops import QuantizedTensor

    layers = pack.nodes.int8_layers
    buffer = torch.empty(4096, dtype=torch.uint8)

    def held(weight, bias=None):
        return layers.HeldCast(lambda rows: rows, weight, bias, torch.empty(0, dtype=torch.bfloat16))
    first, second = buffer[:1024].view(torch.bfloat16), buffer[512:2048].view(torch.bfloat16)
    assert layers.shares_memory(held(first), held(second))
    assert not layers.shares_memory(held(first), held(buffer[1024:2048]))
    assert layers.shares_memory(held(first), held(torch.empty(3), bias=buffer[1000:1100]))
    q = QuantizedTensor.from_float(torch.randn(8, 8).bfloat16(), "TensorWiseINT8Layout")
    assert layers.shares_memory(held(q), held(q._qdata[4:]))
    assert not layers.shares_memory(held(q), held(q._qdata.clone()))


# --- a block ---------------------------------------------------------------------------------------------------
class CastLog:
    """Every stock weight cast of ``block``'s layers in order (``comfy.ops.CastBiasWeightContext`` entered and
    left, by the layer's name), the attention's run between them, and the chunks each held cast ran."""

    def __init__(self, pack, block, monkeypatch):
        import comfy.ops

        names = {id(m): n for n, m in block.named_modules()}
        self.events, self.chunks = [], Counter()
        log = self

        class Logged(comfy.ops.CastBiasWeightContext):
            def __enter__(self):
                self.name = names.get(id(self.slf), "?")
                log.events.append(("cast", self.name))
                return super().__enter__()

            def __exit__(self, *args):
                log.events.append(("left", self.name))
                return super().__exit__(*args)

        monkeypatch.setattr(comfy.ops, "CastBiasWeightContext", Logged)
        attend = pack.nodes.h3_patch._attend
        monkeypatch.setattr(pack.nodes.h3_patch, "_attend",
                            lambda *args, **kwargs: (log.events.append(("attend",)), attend(*args, **kwargs))[1])
        cast_once = pack.nodes.chunking.cast_once

        @contextlib.contextmanager
        def counted(layer, x, input_act=None, record=None, routes=None):
            with cast_once(layer, x, input_act, record, routes) as held:
                yield Counted(held, names[id(layer)], log.chunks)
        monkeypatch.setattr(pack.nodes.chunking, "cast_once", counted)

    def clear(self):
        self.events.clear()
        self.chunks.clear()


class Counted:
    """A held cast that counts the chunks it runs."""

    def __init__(self, held, name, chunks):
        self.held, self.name, self.chunks = held, name, chunks
        self.weight, self.bias = held.weight, held.bias

    def __call__(self, rows, input_act=None, into=None):
        self.chunks[self.name] += 1
        return self.held(rows, input_act, into)


def patched_call(pack, base, index, inputs, **settings):
    s = pack.nodes.patch.Settings(backend="sdpa", **settings)
    clone, patch = pack.nodes.h3_patch.patch_model(base, s)
    x, t_emb, segments, rope = inputs
    clone.patch_model(load_weights=False)
    try:
        block = clone.model.diffusion_model.blocks[index]
        assert isinstance(vars(block).get("forward"), pack.nodes.h3_block.H3BlockForward)
        return block(x.clone(), t_emb, segments, rope, transformer_options={})
    finally:
        clone.unpatch_model(unpatch_weights=False)


def stock_call(base, index, inputs):
    x, t_emb, segments, rope = inputs
    return base.model.diffusion_model.blocks[index](x.clone(), t_emb, segments, rope, transformer_options={})


CHUNKS = dict(mlp_chunk_tokens=30, int8_mlp_chunk_tokens=30, qkv_chunk_tokens=32)  # MLP: 4 chunks of 100 rows


def test_an_offloaded_block_casts_each_weight_once_with_stocks_bits(pack, bf16_model, offloaded, monkeypatch):
    """qkv, fc1, fc2 and norm2 offloaded: the qkv's cast held until the attention returns; norm2's whole (one call
    on every row, before the MLP's casts: no cast between the chunks); fc1's and fc2's held over the 4 chunks."""
    block = bf16_model.model.diffusion_model.blocks[1]
    for layer in (block.attn.qkv_proj, block.mlp.fc1, block.mlp.fc2, block.norm2):
        monkeypatch.setattr(layer, "comfy_cast_weights", True)
    log = CastLog(pack, block, monkeypatch)
    inputs = dh.random_block_inputs(block, SEQ, seed=3, dtype=torch.bfloat16)
    want = stock_call(bf16_model, 1, inputs)
    log.clear()
    got = patched_call(pack, bf16_model, 1, inputs, **CHUNKS)
    assert torch.equal(got, want), f"max abs {(got.float() - want.float()).abs().max().item()}"
    assert log.events == [("cast", "attn.qkv_proj"), ("attend",), ("left", "attn.qkv_proj"),
                          ("cast", "norm2"), ("left", "norm2"),
                          ("cast", "mlp.fc1"), ("cast", "mlp.fc2"), ("left", "mlp.fc2"), ("left", "mlp.fc1")]
    assert log.chunks == {"mlp.fc1": 4, "mlp.fc2": 4}  # the qkv by columns of its cast weight (K/V, then Q)


def test_a_lora_weight_function_runs_once_per_block_with_stocks_bits(pack, bf16_model, monkeypatch):
    """A weight function (ComfyUI's LowVramPatch, a LoRA) on qkv, fc1 and fc2: each call's cast applies it, so
    stock applies it once per call; the fast path once per block, whatever the chunks."""
    block = bf16_model.model.diffusion_model.blocks[1]
    applied = Counter()

    def lora(name):
        def patch(w):
            applied[name] += 1
            return w * 1.5
        return [patch]
    for name in ("attn.qkv_proj", "mlp.fc1", "mlp.fc2"):
        monkeypatch.setattr(block.get_submodule(name), "weight_function", lora(name))
    log = CastLog(pack, block, monkeypatch)
    inputs = dh.random_block_inputs(block, SEQ, seed=4, dtype=torch.bfloat16)
    want = stock_call(bf16_model, 1, inputs)
    assert applied == {"attn.qkv_proj": 1, "mlp.fc1": 1, "mlp.fc2": 1}
    applied.clear()
    log.clear()
    got = patched_call(pack, bf16_model, 1, inputs, **CHUNKS)
    assert torch.equal(got, want), f"max abs {(got.float() - want.float()).abs().max().item()}"
    assert applied == {"attn.qkv_proj": 1, "mlp.fc1": 1, "mlp.fc2": 1}
    assert log.events == [("cast", "attn.qkv_proj"), ("attend",), ("left", "attn.qkv_proj"),
                          ("cast", "mlp.fc1"), ("cast", "mlp.fc2"), ("left", "mlp.fc2"), ("left", "mlp.fc1")]
    assert log.chunks == {"mlp.fc1": 4, "mlp.fc2": 4}


def test_casts_that_share_a_buffer_leave_the_mlp_to_stocks_calls(pack, bf16_model, offloaded, monkeypatch):
    """Where fc2's cast lay in fc1's memory (one offload buffer reused), nothing ran on them: both are left and the
    MLP runs whole, as stock calls it (each weight cast again), with stock's bits."""
    block = bf16_model.model.diffusion_model.blocks[1]
    for layer in (block.mlp.fc1, block.mlp.fc2):
        monkeypatch.setattr(layer, "comfy_cast_weights", True)
    monkeypatch.setattr(pack.nodes.int8_layers, "shares_memory", lambda a, b: True)
    log = CastLog(pack, block, monkeypatch)
    inputs = dh.random_block_inputs(block, SEQ, seed=5, dtype=torch.bfloat16)
    want = stock_call(bf16_model, 1, inputs)
    log.clear()
    got = patched_call(pack, bf16_model, 1, inputs, **CHUNKS)
    assert torch.equal(got, want)
    assert log.events == [("attend",), ("cast", "mlp.fc1"), ("cast", "mlp.fc2"), ("left", "mlp.fc2"),
                          ("left", "mlp.fc1"), ("cast", "mlp.fc1"), ("left", "mlp.fc1"), ("cast", "mlp.fc2"),
                          ("left", "mlp.fc2")]
    assert not log.chunks


# --- the int8 ConvRot route's cast once (interpreted) ------------------------------------------------------------
INT8_SCRIPT = r"""
    sys.path.insert(0, str(__import__("pathlib").Path({root!r}) / "tests"))
    from collections import Counter
    from host_fixtures import import_pack, find_host
    pack = import_pack(find_host())
    torch.backends.mkldnn.enabled = False            # row-independent CPU GEMMs, as in conftest.py
    rules = pack.nodes.chunking
    rules.CHUNKED_DEVICES = ("cuda", "cpu")
    resident = rules.weight_resident                    # comfy_cast_weights: offloaded (see the module docstring)
    rules.weight_resident = lambda layer, device: (
        not getattr(layer, "comfy_cast_weights", False) and resident(layer, device))
    import comfy.ops, comfy_kitchen
    from devkit import h3 as dh, int8_oracle
    ia = pack.kernels.int8_activation

    # the stand-ins of tests/host/test_int8_route.py: stock's CUDA int8_linear and the route's GEMM in torch
    int8_oracle.stand_in_for_cuda_int8_linear(comfy_kitchen)
    pack.kernels.int8_call_problem = lambda x, input_act=None: None if ia.quantize_takes(x, input_act) else "declined"
    pack.kernels.int8_weight_problem = lambda x, qdata, w_scale, bias, input_act=None: None
    declines = set()
    pack.kernels.int8_linear.gemm = int8_oracle.declining_gemm(declines)

    import comfy.model_management
    comfy.model_management.unet_manual_cast = lambda *args, **kwargs: torch.bfloat16
    config = dh.INT8_TINY_H3
    model = dh.build_model(config, torch.device("cpu"), torch.bfloat16, 0, "int8_convrot")
    block = model.model.diffusion_model.blocks[1]
    names = {{id(m): n for n, m in block.named_modules()}}
    casts = Counter()                                # every stock weight cast, stock's calls' and the route's
    cast = comfy.ops.cast_bias_weight

    def counted(s, *args, **kwargs):
        casts[names.get(id(s), "?")] += 1
        return cast(s, *args, **kwargs)
    comfy.ops.cast_bias_weight = counted
    out = {{}}
    for case, offloaded, declined in (("offloaded", ("attn.qkv_proj", "mlp.fc1", "mlp.fc2", "norm2"), ()),
                                      ("k declined", ("attn.qkv_proj", "mlp.fc1", "mlp.fc2"), ("k", 768)),
                                      ("fc1 offloaded", ("mlp.fc1",), ())):
        for name in offloaded:
            block.get_submodule(name).comfy_cast_weights = True
        declines.clear()
        declines.update(declined)
        x, t_emb, segments, rope = dh.random_block_inputs(block, 100, seed=7, dtype=torch.bfloat16)
        casts.clear()
        want = block(x.clone(), t_emb, segments, rope, transformer_options={{}})
        stock_casts = dict(casts)
        settings = pack.nodes.patch.Settings(backend="sdpa", block_path="exact", mlp_chunk_tokens=30,
                                             int8_mlp_chunk_tokens=30, qkv_chunk_tokens=32)
        clone, patch = pack.nodes.h3_patch.patch_model(model, settings)
        clone.patch_model(load_weights=False)
        casts.clear()
        try:
            got = clone.model.diffusion_model.blocks[1](x.clone(), t_emb, segments, rope, transformer_options={{}})
        finally:
            clone.unpatch_model(unpatch_weights=False)
        for name in offloaded:
            del block.get_submodule(name).comfy_cast_weights
        out[case] = dict(diff=(got.float() - want.float()).abs().max().item(), casts=dict(casts), stock=stock_casts,
                         own=patch.report.int8_own, declined=sorted(r for (_, r) in patch.report.int8_stock))
    report(out)
"""


@pytest.fixture(scope="module")
def int8_runs(comfy_inprocess):
    from devkit.pack import REPO_ROOT
    return run_interpreted(INT8_SCRIPT.format(root=str(REPO_ROOT)))


# mixed_precision_ops' layers cast on every call, the norms and adaln_proj too: stock's block casts each once
STOCK_CASTS = dict.fromkeys(("adaln_proj.linear", "norm1", "attn.qkv_proj", "attn.out_proj", "norm2", "mlp.fc1",
                             "mlp.fc2"), 1)


def test_int8_route_casts_each_offloaded_weight_once_with_stocks_bits(int8_runs):
    """qkv by columns on its weight cast once, fc1 and fc2 each cast once for their 4 chunks, every call on the
    pack's quantiser: the casts stock's block makes, no more (norm2 once: the MLP's rows normed whole)."""
    run = int8_runs["offloaded"]
    assert run["diff"] == 0.0 and run["declined"] == []
    assert run["casts"] == run["stock"] == STOCK_CASTS
    assert run["own"] == 1 + 1 + 4 + 4  # qkv quantised once, out_proj, fc1 and fc2 per chunk


def test_int8_projection_by_rows_on_the_weight_cast_once(int8_runs):
    """CUTLASS declining the K product: the projection goes by rows on the held cast (stock's int8 linear on it,
    the wide product declined too), with stock's bits and one cast."""
    run = int8_runs["k declined"]
    assert run["diff"] == 0.0 and run["casts"] == run["stock"] == STOCK_CASTS
    assert run["declined"] == ["CUTLASS declined an int8 GEMM of 100 x 256 x 256", "CUTLASS declined the shape"]


def test_a_resident_fc2_beside_an_offloaded_fc1_keeps_its_own_calls(int8_runs):
    """fc1 cast once, fc2 resident: its call per chunk (a cast that moves nothing), as on the resident path; the
    resident qkv by columns on its weight as stored (no cast)."""
    run = int8_runs["fc1 offloaded"]
    assert run["diff"] == 0.0 and run["own"] == 1 + 1 + 4 + 4 and run["declined"] == []
    uncast_qkv = {name: n for name, n in STOCK_CASTS.items() if name != "attn.qkv_proj"}
    assert run["casts"] == {**uncast_qkv, "mlp.fc2": 4}
