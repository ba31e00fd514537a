"""The pack on current upstream ComfyUI (0.34-0.47), through stand-ins (tests/current_comfyui_standins.py) built
from the 0.33 host's H3, on the CPU with the sdpa back-end (stock's kernel with --use-pytorch-cross-attention):
each current form patches, samples and gives stock's bits; a split-QKV checkpoint is declined with stock's result
and a note; a block replace's ``attention=`` runs in place of this node's attention; under ``linear_input_act``'s
extended form the block fast path gives stock's bits, and the prologue/epilogue Linear forward keeps stock's calls.
"""

from __future__ import annotations


import pytest
import torch

from devkit import h3 as dh

CONFIG = dh.INT8_TINY_H3
SEQ = 100


def fresh_model(weights: str):
    """A new tiny H3 (its modules get reshaped in place by the stand-ins)."""
    return dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, weights)


def settings(pack, **more):
    return pack.nodes.patch.Settings(backend="sdpa", mlp_chunk_tokens=30, int8_mlp_chunk_tokens=30, **more)


def block_inputs(patcher, seed: int):
    return dh.random_block_inputs(patcher.model.diffusion_model.blocks[1], SEQ, seed=seed, dtype=torch.bfloat16)


def stock_block(patcher, inputs, attention=None):
    x, t_emb, segments, rope = inputs
    extra = {} if attention is None else {"attention": attention}
    return patcher.model.diffusion_model.blocks[1](x.clone(), t_emb, segments, rope, transformer_options={}, **extra)


def patched_block(pack, patcher, inputs, attention=None, **more):
    """Block 1 with the node's patch on: (output, the forward that ran, patch)."""
    clone, patch = pack.nodes.h3_patch.patch_model(patcher, settings(pack, **more))
    clone.patch_model(load_weights=False)
    try:
        block = clone.model.diffusion_model.blocks[1]
        return stock_block(clone, inputs, attention), vars(block).get("forward"), patch
    finally:
        clone.unpatch_model(unpatch_weights=False)


def assert_bits(got, want, what=""):
    assert torch.equal(got, want), f"{what} max abs {(got.float() - want.float()).abs().max().item()}"


def note_codes(patch, patcher):
    plan = patch.planner(patcher, patcher.model_options)
    return [n["code"] for n in patch.report.patch_notes] + [n.code for n in plan.notes]


# --- comfy_attention, to_gate_compress, DiTBlock.forward(..., attention=None) ------------------------------------
@pytest.mark.parametrize("weights", dh.WEIGHT_FORMATS)
def test_current_attention_and_block_take_the_fast_path_with_stock_bits(pack, cur, weights):
    model = fresh_model(weights)
    cur.current_model(model.model.diffusion_model, gate_compress=True)
    assert pack.nodes.h3_block.structure_problems(model.model.diffusion_model.blocks[1]) == []
    inputs = block_inputs(model, seed=31)
    want = stock_block(model, inputs)
    got, forward, patch = patched_block(pack, model, inputs)
    assert isinstance(forward, pack.nodes.h3_block.H3BlockForward) and patch.report.calls == 1
    assert_bits(got, want)


@pytest.mark.parametrize("weights", dh.WEIGHT_FORMATS)
def test_an_attention_passed_by_a_block_replace_runs_in_place_of_this_nodes(pack, cur, weights):
    """Upstream's contract: ``attention=`` replaces ``self.attn`` for that call (Model Sparse Attention passes its
    own, which reads ``to_gate_compress``). The pack leaves that call to it and runs the rest of the block."""
    model = fresh_model(weights)
    cur.current_model(model.model.diffusion_model, gate_compress=True)
    attn, seen = model.model.diffusion_model.blocks[1].attn, []

    def sparse_attention(h, rope_freqs=None, transformer_options={}):
        seen.append(h.shape)
        dense = cur.CurrentAttention.forward(attn, h, rope_freqs=rope_freqs, transformer_options=transformer_options)
        return dense * torch.sigmoid(attn.to_gate_compress(h))  # a VSA-style gate: not this node's attention

    inputs = block_inputs(model, seed=32)
    want = stock_block(model, inputs, sparse_attention)
    got, forward, patch = patched_block(pack, model, inputs, sparse_attention)
    assert isinstance(forward, pack.nodes.h3_block.H3BlockForward)
    assert len(seen) == 2 and patch.report.calls == 0  # stock's call and ours: theirs ran, ours did not
    assert_bits(got, want)
    assert not torch.equal(want, stock_block(model, inputs)), "their attention must change the block's output"


# --- linear_input_act's extended arguments (0.36) ------------------------------------------------------------------
@pytest.mark.parametrize("weights", dh.WEIGHT_FORMATS)
def test_extended_linear_input_act_keeps_stock_bits(pack, cur, weights, monkeypatch):
    import comfy.ops

    monkeypatch.setattr(comfy.ops, "linear_input_act", cur.extended_linear_input_act)
    model = fresh_model(weights)
    cur.current_model(model.model.diffusion_model)
    inputs = block_inputs(model, seed=33)
    got, forward, _ = patched_block(pack, model, inputs)
    assert isinstance(forward, pack.nodes.h3_block.H3BlockForward)
    assert_bits(got, stock_block(model, inputs))


# --- the Linear forward with prologue/epilogue paths (0.40) ------------------------------------------------------
@pytest.mark.parametrize("weights", dh.WEIGHT_FORMATS)
def test_prologue_epilogue_linear_runs_stocks_forward_with_stock_bits(pack, cur, weights, monkeypatch):
    import comfy.ops

    monkeypatch.setattr(comfy.ops, "linear_input_act", cur.consolidated_linear_input_act)
    model = fresh_model(weights)
    cur.prologue_epilogue_model(cur.current_model(model.model.diffusion_model))
    inputs = block_inputs(model, seed=34)
    want = stock_block(model, inputs)
    got, forward, patch = patched_block(pack, model, inputs)
    assert isinstance(forward, pack.nodes.h3_block.H3BlockForward)
    assert_bits(got, want)
    if weights == "int8_convrot":  # the route does not claim a forward it was not checked against
        fc1 = model.model.diffusion_model.blocks[1].mlp.fc1
        reason = pack.nodes.int8_layers.stock_quantizer_reason(fc1, inputs[0])
        assert "prologue/epilogue" in reason and "input_act" in reason
        assert any("prologue/epilogue" in r for (_, r) in patch.report.int8_stock), patch.report.int8_stock


def test_a_block_that_fuses_its_linears_keeps_the_attention_only_patch(pack, cur, monkeypatch):
    """A block whose MLP hands linear_input_act the residual (an epilogue the fast path does not reproduce) keeps
    the attention-only patch, says why, and still gives stock's bits."""
    import comfy.ops

    monkeypatch.setattr(comfy.ops, "linear_input_act", cur.extended_linear_input_act)

    class FusedMLP(type(fresh_model("bf16").model.diffusion_model.blocks[0].mlp)):
        def forward(self, x, residual=None, gate=None):
            return comfy.ops.linear_input_act(self.fc2, self.fc1(x), "swiglu", residual=residual, residual_scale=gate)

    model = fresh_model("bf16")
    for block in model.model.diffusion_model.blocks:
        cur.current_block(block).mlp.__class__ = FusedMLP
    problems = pack.nodes.h3_block.structure_problems(model.model.diffusion_model.blocks[0])
    assert problems == ["MLP.forward fuses into its linears (residual, residual_scale), which the fast path does not"]
    inputs = block_inputs(model, seed=35)
    got, forward, patch = patched_block(pack, model, inputs)
    assert forward is None or not pack.nodes.ownership.is_own(forward)
    assert "block_path_off" in note_codes(patch, model) and patch.report.calls == 1
    assert_bits(got, stock_block(model, inputs))


# --- a checkpoint with separate q, k, v projections --------------------------------------------------------------
def test_a_split_qkv_checkpoint_is_declined_without_touching_its_fused_view(pack, cur):
    model = fresh_model("bf16")
    cur.current_model(model.model.diffusion_model, split_qkv=True)  # FusedView raises if the pack reads it
    clone, patch = pack.nodes.h3_patch.patch_model(model, settings(pack))
    assert not any(pack.nodes.ownership.is_own(v) for v in clone.object_patches.values())
    (note,) = patch.report.patch_notes
    assert note["code"] == "separate_qkv_declined" and "4 of 4 H3 attention modules" in note["text"]
    assert "q_proj/k_proj/v_proj" in note["text"] and "stock ComfyUI runs every block" in note["text"]


# --- sampling ----------------------------------------------------------------------------------------------------
def conditioning():
    return dh.random_conditioning(8, CONFIG["text_dim"], 3)


def sample_both(pack, cur, model, **more):
    """(stock latents, the node's latents, the node's report payload) from the same model."""
    want = cur.sample(model, conditioning())
    clone, patch = pack.nodes.h3_patch.patch_model(model, settings(pack, **more))
    got = cur.sample(clone, conditioning())
    return want, got, patch.report.last


def assert_latents(got, want):
    for name, a, b in zip(("video", "audio"), got, want):
        assert_bits(a, b, name)


@pytest.mark.parametrize("weights", dh.WEIGHT_FORMATS)
def test_every_current_form_together_samples_stock_latents(pack, cur, weights, monkeypatch):
    import comfy.ops

    monkeypatch.setattr(comfy.ops, "linear_input_act", cur.consolidated_linear_input_act)
    model = fresh_model(weights)
    cur.prologue_epilogue_model(cur.current_model(model.model.diffusion_model, gate_compress=True))
    want, got, report = sample_both(pack, cur, model)
    assert_latents(got, want)
    assert report["status"] == "ok" and report["block_path_blocks"] == 2 and report["backends_ran"].get("sdpa")


def test_a_split_qkv_checkpoint_samples_stock_latents_and_the_report_says_why(pack, cur):
    model = fresh_model("bf16")
    cur.current_model(model.model.diffusion_model, split_qkv=True)
    want, got, report = sample_both(pack, cur, model)
    assert_latents(got, want)
    assert report["status"] == "no_attention_calls" and report["blocks_patched"] == 0
    assert [n["code"] for n in report["notes"]] == ["separate_qkv_declined"]
    assert any("separate q/k/v projections" in line for line in report["messages"])


def test_a_block_replace_passing_attention_samples_stock_latents(pack, cur):
    """Block 1 replaced as Model Sparse Attention replaces it on current ComfyUI (the block wrap forwards its
    ``attention=``): its attention runs there, this node's everywhere else, and the latents are stock's."""
    model = fresh_model("bf16")
    dm = cur.current_model(model.model.diffusion_model, gate_compress=True)
    calls = []

    def replace(args, extra):
        attn = dm.blocks[1].attn

        def theirs(h, rope_freqs=None, transformer_options={}):
            calls.append(h.shape[0])
            return cur.CurrentAttention.forward(attn, h, rope_freqs, transformer_options) * 0.5

        block = dm.blocks[1]  # upstream's block_wrap: block(..., attention=args.get("attention"))
        return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                             transformer_options=args["transformer_options"], attention=theirs)}

    model.set_model_patch_replace(replace, "dit", "double_block", 1)
    want, got, report = sample_both(pack, cur, model)
    assert_latents(got, want)
    assert calls and len(calls) % 2 == 0  # stock's run and the node's each called it per step
    assert report["block_path_blocks"] == 2 and "block_replaces" in [n["code"] for n in report["notes"]]
    # this node ran the other block and the refiner only: one call per step fewer than a run without the replace
    steps = len(calls) // 2
    assert report["attention_calls"] == steps * (len(dm.blocks) - 1) + len(dm.token_refiner.blocks)


