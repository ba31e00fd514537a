"""In-process tests of nodes/: ComfyUI importable (found through COMFYUI_PATH), no server.

They skip with the reason when no ComfyUI host is found.
"""

from __future__ import annotations

import sys

import pytest
import torch

from host_fixtures import patcher_for, tiny_h3_model, tiny_wan_model

S = 12


@pytest.fixture
def pack(comfy_inprocess):
    torch.set_grad_enabled(False)  # ComfyUI samples without autograd; in-place rope requires it
    yield comfy_inprocess
    torch.set_grad_enabled(True)


def rope_table(model, seq=S):
    import comfy.ldm.minimax.model as h3
    pos = torch.rand(seq, 3, generator=torch.Generator().manual_seed(5)) * 7
    return h3.rope_rotation_table(model.rope_freqs(pos, "cpu"), torch.float32)


def assert_same(a, b, what):
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a - b).abs().max().item()
    assert torch.equal(a, b), f"{what}: max abs difference {diff}"


def make_patch(pack, backend="sdpa", path="h3_forward_patch", layout="strided_nhd", prep_mode="exact"):
    """The node's per-clone state without a clone: settings, a report and the node's own chain."""
    settings = pack.nodes.patch.Settings(layout=layout, backend=backend, prep_mode=prep_mode)
    report = pack.nodes.report.RunReport(node_id="1", model_family="test", path=path, settings=settings)
    plan = pack.nodes.patch.Plan(pack.kernels.BackendChain.for_choice(backend))
    return pack.nodes.patch.InstalledPatch(settings, report, None, plan)


def settings(pack, layout="strided_nhd", backend="auto", patch_refiner=True, **more):
    return pack.nodes.patch.Settings(layout=layout, backend=backend, patch_refiner=patch_refiner, **more)


def outer_sample_wrapper(pack, clone):
    from comfy.patcher_extension import WrappersMP
    (wrapper,) = clone.get_wrappers(WrappersMP.OUTER_SAMPLE, pack.nodes.patch.WRAPPER_KEY)
    return wrapper


# --- the H3 forward ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["strided_nhd", "hnd"])
@pytest.mark.parametrize("with_rope", [True, False])
def test_h3_patched_forward_equals_stock_forward_bit_for_bit(pack, layout, with_rope):
    model = tiny_h3_model(seed=3)
    attn = model.blocks[1].attn
    x = torch.randn(S, 64, generator=torch.Generator().manual_seed(9))
    kwargs = {"rope_freqs": rope_table(model)} if with_rope else {}
    stock = attn(x.clone(), **kwargs)
    patch = make_patch(pack, layout=layout)
    patched = pack.nodes.h3_patch.H3AttentionForward(attn, "blocks.1.attn.forward", patch)
    assert_same(patched(x.clone(), **kwargs), stock, f"{layout}, rope={with_rope}")
    assert patch.report.calls == 1 and dict(patch.report.backends) == {"sdpa": 1}


def test_h3_forward_takes_its_input_handed_over_in_a_list(pack):
    """A block forward may hand the normed input over in a one-element list (KJNodes' Low VRAM
    Attention does): the forward empties it, so the input is freed after the qkv projection (rule 8)."""
    model = tiny_h3_model(seed=3)
    attn = model.blocks[0].attn
    x = torch.randn(S, 64, generator=torch.Generator().manual_seed(9))
    handed = [x.clone()]
    ours = pack.nodes.h3_patch.H3AttentionForward(attn, "blocks.0.attn.forward", make_patch(pack))
    assert_same(ours(handed, rope_freqs=rope_table(model)), attn(x.clone(), rope_freqs=rope_table(model)), "handed")
    assert handed == []


def test_a_known_stock_equal_forward_is_taken_over_and_others_are_refused(pack):
    def minimax_attn_lowmem_forward(x, rope_freqs=None, transformer_options={}):
        return x

    minimax_attn_lowmem_forward._uses_optimized_attention = True
    mp = patcher_for(tiny_h3_model())
    mp.add_object_patch("diffusion_model.blocks.0.attn.forward", minimax_attn_lowmem_forward)
    clone, _ = pack.nodes.h3_patch.patch_model(mp, settings(pack))
    assert pack.nodes.conflicts.is_own(clone.object_patches["diffusion_model.blocks.0.attn.forward"])
    del minimax_attn_lowmem_forward._uses_optimized_attention  # the same name without the mark: refused
    with pytest.raises(pack.nodes.conflicts.PatchConflictError, match="minimax_attn_lowmem_forward"):
        pack.nodes.h3_patch.patch_model(mp, settings(pack))


def test_h3_training_mode_uses_out_of_place_rope_and_matches_stock(pack):
    import comfy.model_management as mm
    model = tiny_h3_model(seed=4)
    attn = model.blocks[0].attn
    x = torch.randn(S, 64, generator=torch.Generator().manual_seed(10))
    table = rope_table(model)
    patched = pack.nodes.h3_patch.H3AttentionForward(attn, "blocks.0.attn.forward", make_patch(pack))
    old = mm.in_training
    mm.in_training = True
    try:
        stock = attn(x.clone(), rope_freqs=table)
        ours = patched(x.clone(), rope_freqs=table)
    finally:
        mm.in_training = old
    assert_same(ours, stock, "training mode")


# --- structure check -----------------------------------------------------------------------------
def test_structure_check_accepts_comfyui_h3_attention(pack):
    model = tiny_h3_model()
    for block in list(model.blocks) + list(model.token_refiner.blocks):
        assert pack.nodes.h3_patch.structure_problems(block.attn) == []


def test_structure_check_names_each_difference(pack):
    sp = pack.nodes.h3_patch.structure_problems
    attn = tiny_h3_model().blocks[0].attn
    attn.q_norm.weight = torch.nn.Parameter(torch.ones(16), requires_grad=False)
    assert any("q_norm.weight is [16], expected [head_dim=32]" in p for p in sp(attn))

    attn = tiny_h3_model().blocks[0].attn
    attn.heads = 3
    problems = sp(attn)
    assert any(p.startswith("qkv_proj.weight is [192, 64]") for p in problems), problems
    assert any(p.startswith("out_proj.weight is [64, 64]") for p in problems), problems

    attn = tiny_h3_model().blocks[0].attn
    del attn.out_proj
    assert sp(attn) == ["no out_proj.weight"]

    import comfy.ldm.minimax.model as h3

    class NewAttention(h3.Attention):
        def forward(self, x, rope_freqs=None, mask=None, transformer_options={}):
            return super().forward(x, rope_freqs, transformer_options)

    attn = tiny_h3_model().blocks[0].attn
    attn.__class__ = NewAttention
    assert any("forward" in p and "'mask'" in p for p in sp(attn)), sp(attn)


def test_patch_refuses_changed_structure_and_leaves_the_model_alone(pack):
    model = tiny_h3_model()
    model.blocks[1].attn.head_dim = 16
    mp = patcher_for(model)
    with pytest.raises(pack.nodes.h3_patch.H3StructureError, match=r"diffusion_model\.blocks\.1\.attn: .*head_dim=16"):
        pack.nodes.h3_patch.patch_model(mp, settings(pack, backend="sdpa"))
    assert mp.object_patches == {} and "optimized_attention_override" not in mp.model_options["transformer_options"]


# --- patching a ModelPatcher ---------------------------------------------------------------------
def test_patch_model_patches_a_clone_only(pack):
    mp = patcher_for(tiny_h3_model())
    clone, patch = pack.nodes.h3_patch.patch_model(mp, settings(pack))
    assert clone is not mp and mp.object_patches == {} and mp.wrappers == {}
    keys = sorted(clone.object_patches)
    assert keys == sorted([f"diffusion_model.blocks.{i}.attn.forward" for i in range(2)]
                          + [f"diffusion_model.blocks.{i}.forward" for i in range(2)]  # the block fast path
                          + [f"diffusion_model.token_refiner.blocks.{i}.attn.forward" for i in range(2)]
                          + ["diffusion_model.video_patch_proj.forward"])  # the video embedding's release
    assert patch.report.static["blocks_patched"] == 2 and patch.report.static["refiner_blocks_patched"] == 2
    attention_only, _ = pack.nodes.h3_patch.patch_model(mp, settings(pack, block_path="attention_only"))
    assert not any(k.endswith("blocks.0.forward") for k in attention_only.object_patches)

    clone2, patch2 = pack.nodes.h3_patch.patch_model(mp, settings(pack, "hnd", "sdpa", patch_refiner=False))
    assert all(".token_refiner." not in k for k in clone2.object_patches)
    assert patch2.report.static["refiner_blocks_patched"] == 0


def test_bad_settings_are_refused(pack):
    mp = patcher_for(tiny_h3_model())
    Settings = pack.nodes.patch.Settings
    with pytest.raises(ValueError, match="unknown layout 'nhd'"):
        pack.nodes.patch_any_model(mp, Settings(layout="nhd"))
    with pytest.raises(ValueError, match="unknown back-end 'sage3'"):
        Settings(backend="sage3")
    with pytest.raises(ValueError, match="unknown sage2_prep mode 'fused'"):  # removed values: the node maps them
        Settings(prep_mode="fused")
    with pytest.raises(ValueError, match="unknown block path 'fused'"):
        Settings(block_path="fused")
    with pytest.raises(ValueError, match="unknown layout 'NHD'"):  # one vocabulary, validated in one place
        Settings(layout="NHD")


@pytest.mark.parametrize("name, value, runs", [("sage2_prep", "fused", "exact"), ("sage2_prep", "fused_rotated", "rotated"),
                                               ("block_path", "fused", "exact")])
def test_a_removed_value_of_an_old_workflow_runs_its_replacement_and_says_so(pack, name, value, runs):
    node = pack.nodes.SageStridedNHDAttention
    assert node.validate_inputs(**{name: value}) is True
    assert "bogus" in node.validate_inputs(**{name: "bogus"})
    assert pack.nodes.patch.current_value(name, runs) == (runs, None)
    got, note = pack.nodes.patch.current_value(name, value)
    assert got == runs and note.code == "removed_value" and repr(value) in note.text and repr(runs) in note.text
    clone, patch = pack.nodes.patch_any_model(patcher_for(tiny_h3_model()), notes=(note,))
    assert {"code": "removed_value", "text": note.text} in patch.report.payload()["notes"]


def test_non_h3_model_takes_the_override_path(pack):
    mp = patcher_for(tiny_wan_model())
    clone, patch = pack.nodes.patch_any_model(mp, settings(pack, "strided_nhd", "auto"))
    assert patch.report.static["path"] == "attention_override" and clone.object_patches == {}
    assert pack.nodes.conflicts.is_own(clone.model_options["transformer_options"]["optimized_attention_override"])
    assert "optimized_attention_override" not in mp.model_options["transformer_options"]


# --- conflict rules ------------------------------------------------------------------------------
def test_own_patch_applied_twice_is_replaced_and_reported(pack):
    mp = patcher_for(tiny_h3_model())
    first, _ = pack.nodes.h3_patch.patch_model(mp, settings(pack, "hnd", "sdpa"))
    second, patch = pack.nodes.h3_patch.patch_model(first, settings(pack, patch_refiner=False))
    assert patch.report.static["replaced_own_patch"] is True
    release = second.object_patches.pop("diffusion_model.video_patch_proj.forward")
    assert release is patch.embedding and release is not first.object_patches["diffusion_model.video_patch_proj.forward"]
    assert sorted(second.object_patches) == sorted(f"diffusion_model.blocks.{i}.{what}forward"
                                                   for i in range(2) for what in ("attn.", ""))
    assert all(f.patch.settings.layout == "strided_nhd" for f in second.object_patches.values())
    from comfy.patcher_extension import WrappersMP
    assert len(second.get_wrappers(WrappersMP.OUTER_SAMPLE, pack.nodes.patch.WRAPPER_KEY)) == 1

    wan = patcher_for(tiny_wan_model())
    o1, _ = pack.nodes.patch_any_model(wan, settings(pack, "hnd", "sdpa"))
    o2, p2 = pack.nodes.patch_any_model(o1, settings(pack, "strided_nhd", "sdpa"))
    assert p2.report.static["replaced_own_patch"] is True
    assert o2.model_options["transformer_options"]["optimized_attention_override"].patch.settings.layout == "strided_nhd"


def test_foreign_object_patch_is_refused(pack):
    mp = patcher_for(tiny_h3_model())

    def other_packs_forward(x, rope_freqs=None, transformer_options={}):
        return x

    mp.add_object_patch("diffusion_model.blocks.1.attn.forward", other_packs_forward)
    with pytest.raises(pack.nodes.conflicts.PatchConflictError,
                       match=r"another node already replaced 1 attention forward.*blocks\.1\.attn\.forward.*other_packs_forward"):
        pack.nodes.h3_patch.patch_model(mp, settings(pack))


@pytest.mark.parametrize("family", ["h3", "wan"])
def test_foreign_attention_override_is_refused(pack, family):
    mp = patcher_for(tiny_h3_model() if family == "h3" else tiny_wan_model())

    def kj_style_override(func, *args, **kwargs):
        return func(*args, **kwargs)

    mp.model_options["transformer_options"]["optimized_attention_override"] = kj_style_override
    with pytest.raises(pack.nodes.conflicts.PatchConflictError, match="another node's attention override .*kj_style_override"):
        pack.nodes.patch_any_model(mp, settings(pack, "strided_nhd", "auto"))


# --- the generic override ------------------------------------------------------------------------
def _qkv(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(3)]


@pytest.mark.parametrize("layout", ["strided_nhd", "hnd"])
@pytest.mark.parametrize("skip_reshape,skip_output_reshape", [(False, False), (True, False), (True, True), (False, True)])
def test_override_matches_comfyui_pytorch_attention(pack, layout, skip_reshape, skip_output_reshape):
    from comfy.ldm.modules.attention import attention_pytorch
    b, h, s, d = 2, 3, 10, 16
    q, k, v = _qkv((b, h, s, d) if skip_reshape else (b, s, h * d), seed=1)
    patch = make_patch(pack, path="attention_override", layout=layout)
    override = pack.nodes.override.AttentionOverride(patch)
    kw = dict(skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    expected = attention_pytorch(q, k, v, h, **kw)
    got = override(attention_pytorch, q, k, v, h, **kw)
    assert_same(got, expected, f"override {layout} {kw}")
    assert patch.report.calls == 1 and patch.report.stock_calls == 0


def test_override_takes_masks_like_comfyui(pack):
    from comfy.ldm.modules.attention import attention_pytorch
    b, h, s, d = 1, 2, 8, 16
    q, k, v = _qkv((b, s, h * d), seed=2)
    mask = torch.zeros(s, s)
    mask[:, -3:] = float("-inf")
    override = pack.nodes.override.AttentionOverride(make_patch(pack, path="attention_override"))
    assert_same(override(attention_pytorch, q, k, v, h, mask=mask), attention_pytorch(q, k, v, h, mask=mask), "mask")


def test_override_hands_gqa_back_to_comfyui_and_counts_it(pack):
    calls = []

    def stock(q, k, v, heads, **kwargs):
        calls.append(kwargs)
        return "stock result"

    patch = make_patch(pack, path="attention_override")
    override = pack.nodes.override.AttentionOverride(patch)
    q, k, v = _qkv((1, 8, 64), seed=3)
    assert override(stock, q, k, v, 4, enable_gqa=True) == "stock result"
    assert calls[0]["enable_gqa"] is True
    p = patch.report.payload()
    assert p["stock_calls"] == 1 and p["fallbacks"][0]["backend"] == "stock" and "enable_gqa" in p["fallbacks"][0]["reason"]
    assert p["fallbacks"][0]["code"] == "model_request"


# --- back-ends that cannot run here ----------------------------------------------------------------
def test_missing_sageattention_falls_back_and_the_report_says_why(pack, monkeypatch):
    backends = [pack.kernels.BACKENDS[n] for n in ("sage1", "sage2")]
    for b in backends:
        b.__dict__.pop("_availability", None)  # re-probe with sageattention hidden
    monkeypatch.setitem(sys.modules, "sageattention", None)  # import sageattention -> ImportError
    try:
        mp = patcher_for(tiny_h3_model(seed=6))
        clone, patch = pack.nodes.h3_patch.patch_model(mp, settings(pack, backend="sage1"))
        report = patch.report
        model = mp.model.diffusion_model
        x = torch.randn(S, 64, generator=torch.Generator().manual_seed(1))
        stock = model.blocks[0].attn(x.clone(), rope_freqs=rope_table(model))
        ours = clone.object_patches["diffusion_model.blocks.0.attn.forward"](x.clone(), rope_freqs=rope_table(model))
        assert_same(ours, stock, "sage1 requested, sageattention missing")
        p = report.payload()
        assert p["backends_ran"] == {"sdpa": 1}
        reasons = {f["backend"]: (f["code"], f["reason"]) for f in p["fallbacks"]}
        assert reasons["sage1"][0] == "not_installed" and "not importable" in reasons["sage1"][1], reasons
    finally:
        for b in backends:
            b.__dict__.pop("_availability", None)


# --- the run report ------------------------------------------------------------------------------
def test_report_is_sent_once_per_sampling_run(pack):
    mp = patcher_for(tiny_h3_model(seed=2))
    clone, patch = pack.nodes.h3_patch.patch_model(mp, settings(pack, backend="sdpa"), node_id="17")
    report = patch.report
    wrapper = outer_sample_wrapper(pack, clone)
    model = mp.model.diffusion_model
    fwd = clone.object_patches["diffusion_model.blocks.0.attn.forward"]

    def sampling_run():
        for _ in range(3):  # three "steps" through one patched block
            fwd(torch.randn(S, 64), rope_freqs=rope_table(model))
        return "latent"

    assert wrapper(sampling_run) == "latent"
    first = report.last
    assert wrapper(sampling_run) == "latent"
    assert report.last is not first  # the last payload only, no growth
    p = report.last
    assert p["schema"] == 5 and p["attention_calls"] == 3 and p["node_id"] == "17" and p["status"] == "ok"
    assert p["copies_per_call"] == 0.0 and p["backends_ran"] == {"sdpa": 3} and p["error"] is None
    assert p["prepared"] == [] and p["prepared_skipped"] == [] and p["compile_events"] == [] and p["notes"] == []
    assert p["comfy_kitchen"] is None  # no int8 ConvRot linear ran


def test_backends_check_themselves_on_the_models_device_before_the_model_runs(pack, monkeypatch):
    """sage2's self-test must run when sampling starts, outside any block (and any graph the Comfy Compiler records)."""
    import types

    mp = patcher_for(tiny_h3_model(seed=2))
    clone, patch = pack.nodes.h3_patch.patch_model(mp, settings(pack, backend="sdpa"))
    sdpa = pack.kernels.BACKENDS["sdpa"]
    events = []
    monkeypatch.setattr(type(sdpa), "_check_device", lambda self, device: events.append(("checked", str(device))) or
                        pack.kernels.backends.base.YES)
    monkeypatch.setitem(sdpa.__dict__, "_device_verdicts", {})

    class Executor:
        class_obj = types.SimpleNamespace(model_patcher=clone, model_options=clone.model_options)

        def __call__(self):
            events.append(("sampled", None))
            return "latent"

    fa4 = pack.kernels.BACKENDS["fa4"]
    monkeypatch.delitem(fa4.__dict__, "_availability", raising=False)  # its import may cost seconds: never asked
    monkeypatch.setattr(type(fa4), "_check_available", lambda self: pytest.fail("a back-end after sdpa was probed"))
    assert outer_sample_wrapper(pack, clone)(Executor()) == "latent"
    assert events == [("checked", str(clone.load_device)), ("sampled", None)]


def test_model_without_optimized_attention_calls_reports_that_nothing_changed(pack, caplog):
    class NoAttention(torch.nn.Module):  # e.g. a model that computes attention itself
        def forward(self, x):
            return torch.softmax(x @ x.T, -1) @ x

    mp = patcher_for(NoAttention())
    clone, patch = pack.nodes.patch_any_model(mp, settings(pack, "strided_nhd", "auto"))
    wrapper = outer_sample_wrapper(pack, clone)
    with caplog.at_level("WARNING", logger="sage_strided_nhd"):
        wrapper(lambda: mp.model.diffusion_model(torch.randn(4, 4)))
    p = patch.report.last
    assert p["status"] == "no_attention_calls" and p["attention_calls"] == 0
    assert "does not call ComfyUI's optimized_attention" in caplog.text


def test_node_schema_has_tooltips_and_defaults(pack):
    schema = pack.nodes.SageStridedNHDAttention.GET_SCHEMA()
    assert schema.node_id == "SageStridedNHDAttention" and schema.display_name == "Sage Strided NHD Attention"
    assert schema.category.startswith("advanced/model_patches")
    assert [i.id for i in schema.inputs] == ["model", "layout", "backend", "patch_text_refiner", "sage2_prep",
                                             "block_path"]
    assert all(i.tooltip for i in schema.inputs)
    defaults = {i.id: getattr(i, "default", None) for i in schema.inputs}
    assert defaults["layout"] == "strided_nhd" and defaults["backend"] == "auto" and defaults["patch_text_refiner"] is True
    prep, block = schema.inputs[-2:]
    assert defaults["sage2_prep"] == "exact" and prep.optional and list(prep.options) == list(pack.kernels.PREPARED_MODES)
    assert defaults["block_path"] == "exact" and block.optional and list(block.options) == ["exact", "attention_only"]
    advanced = {i.id for i in schema.inputs if getattr(i, "advanced", None)}
    # most users should not touch these; layout is the A/B pair's one difference, so it always shows
    assert advanced == {"sage2_prep", "block_path"}


# --- schema 5: what the report reads from the records ------------------------------------------
def test_report_reads_skip_kinds_and_codes_from_the_records(pack):
    k = pack.kernels
    report = make_patch(pack, backend="auto").report
    skipped = (k.chain.Skip("sage2", "no_cuda", "no CUDA device", "unavailable"),
               k.chain.Skip("comfy_kitchen_int8", "no_cuda", "needs CUDA", "unsupported"),
               k.chain.Skip("sage1", "raised", "raised RuntimeError: x", "raised"))
    report.record(k.CallRecord("auto", backend="sdpa", skipped=skipped, head_chunks=2, copies=1,
                               prepared_skipped=k.chain.Skip("sage2", "gpu_arch", "not sm90", "unsupported"),
                               compiled=({"backend": "fa4", "key": "k1", "seconds": 1.5},)))
    report.record(k.CallRecord("sage2", backend="sage2", prepared="exact",
                               skipped=(k.chain.Skip("fa4", "no_cuda", "no CUDA device", "unavailable"),)))
    p = report.payload()
    # auto: a back-end this machine lacks is passed over; one it has that cannot take the call is a fallback.
    # A named back-end (sage2 here): only it can fall back; fa4 was passed over, never asked for.
    assert sorted((s["backend"], s["code"], s["count"]) for s in p["skipped"]) == [
        ("fa4", "no_cuda", 1), ("sage2", "no_cuda", 1)]
    assert sorted((f["backend"], f["code"], f["count"]) for f in p["fallbacks"]) == [
        ("comfy_kitchen_int8", "no_cuda", 1), ("sage1", "raised", 1)]
    assert p["head_chunks_max"] == 2 and p["copies_per_call"] == 0.5 and p["backends_ran"] == {"sdpa": 1, "sage2": 1}
    assert p["prepared"] == [{"backend": "sage2", "mode": "exact", "calls": 1}]
    assert p["prepared_skipped"] == [{"backend": "sage2", "code": "gpu_arch", "reason": "not sm90", "count": 1}]
    assert p["compile_events"] == [{"backend": "fa4", "key": "k1", "seconds": 1.5}]
    assert any("compiled fa4 kernel k1" in m for m in p["messages"])
    assert any("prepared path: sage2 exact x1" in m for m in p["messages"])


LONG_INT8_REASON = "comfy-kitchen 0.2.41 is not a release this route was written for (0.2.31, 0.2.36, 0.2.40)"


def test_int8_reasons_stay_whole_and_comfy_kitchens_release_is_reported(pack, monkeypatch):
    asked = []

    def fake_status(device=None):
        asked.append(device)
        return {"release": "0.2.41", "route": "stock", "reason": LONG_INT8_REASON}

    monkeypatch.setattr(pack.kernels, "kitchen_release_status", fake_status, raising=False)
    report = make_patch(pack).report
    report.record(pack.kernels.CallRecord("sdpa", backend="sdpa"))
    for reason in (None, LONG_INT8_REASON, LONG_INT8_REASON, "not on a CUDA device"):
        report.record_int8(reason)
    p = report.payload()
    assert p["int8_own_quantizer_calls"] == 1
    int8 = "TensorWiseINT8Layout"
    assert p["int8_stock_quantizer"] == [{"layout": int8, "reason": LONG_INT8_REASON, "count": 2},
                                         {"layout": int8, "reason": "not on a CUDA device", "count": 1}]
    assert p["comfy_kitchen"] == {"release": "0.2.41", "route": "stock", "reason": LONG_INT8_REASON} and asked
    assert f"int8 ConvRot linears on stock's quantiser (2 calls): {LONG_INT8_REASON}" in p["messages"]
    assert (f"comfy-kitchen 0.2.41: int8 route off, stock's quantiser runs ({LONG_INT8_REASON})" in p["messages"]), \
        p["messages"]

    monkeypatch.setattr(pack.kernels, "kitchen_release_status",
                        lambda device=None: {"release": "0.2.40", "route": "verified", "reason": None})
    assert "comfy-kitchen 0.2.40: verified for the int8 route" in report.payload()["messages"]


def test_the_int8_routes_calls_are_counted_and_named_by_layout(pack, monkeypatch):
    """int8 ConvRot and W4A8 calls on the pack's quantiser: one count and one log line per layout."""
    monkeypatch.setattr(pack.kernels, "gemm_status", lambda: {"kernel": "pack", "reason": None}, raising=False)
    report = make_patch(pack).report
    report.record(pack.kernels.CallRecord("sdpa", backend="sdpa"))
    for layout in ("AsymW4A8Int8Layout", "AsymW4A8Int8Layout", "TensorWiseINT8Layout"):
        report.record_int8(None, layout=layout)
    report.record_int8(None)  # a caller that names no layout: int8 ConvRot's (the qkv projection by columns)
    p = report.payload()
    assert p["int8_own_quantizer_calls"] == 4 and p["int8_own_layouts"] == [
        {"layout": "AsymW4A8Int8Layout", "count": 2}, {"layout": "TensorWiseINT8Layout", "count": 2}]
    for line in ("W4A8 linears: 2 calls quantised by the pack's pass (stock's bits)",
                 "int8 ConvRot linears: 2 calls quantised by the pack's pass (stock's bits)"):
        assert line in p["messages"], p["messages"]


def test_comfy_kitchen_status_that_cannot_be_had_is_said_not_raised(pack, monkeypatch):
    report = make_patch(pack).report
    report.record_int8("not on a CUDA device")

    def broken(device=None):
        raise RuntimeError("no release metadata")

    monkeypatch.setattr(pack.kernels, "kitchen_release_status", broken, raising=False)
    status = report.payload()["comfy_kitchen"]
    assert status["release"] is None and status["route"] == "stock" and "no release metadata" in status["reason"]
    monkeypatch.delattr(pack.kernels, "kitchen_release_status", raising=False)  # a kernels without it
    status = report.payload()["comfy_kitchen"]
    assert status["release"] is None and status["route"] == "stock" and status["reason"]


def test_h3_forward_hands_the_fused_buffer_over_and_passes_prep_mode(pack, monkeypatch):
    model = tiny_h3_model(seed=3)
    attn = model.blocks[0].attn
    seen = {}
    real = pack.kernels.attention_from_fused_qkv

    def spy(qkv, *args, **kwargs):
        seen["handed"] = isinstance(qkv, list) and len(qkv) == 1
        seen["prepared_mode"] = kwargs.get("prepared_mode")
        return real(qkv, *args, **kwargs)

    monkeypatch.setattr(pack.kernels, "attention_from_fused_qkv", spy)
    patch = make_patch(pack, prep_mode="rotated")
    fwd = pack.nodes.h3_patch.H3AttentionForward(attn, "blocks.0.attn.forward", patch)
    x = torch.randn(S, 64, generator=torch.Generator().manual_seed(9))
    assert_same(fwd(x.clone(), rope_freqs=rope_table(model)), attn(x.clone(), rope_freqs=rope_table(model)),
                "rotated prep without a prepared path")
    assert seen == {"handed": True, "prepared_mode": "rotated"} and patch.report.calls == 1


@pytest.mark.parametrize("exc,status", [("interrupt", "interrupted"), ("keyboard", "interrupted"), ("error", "failed")])
def test_interrupted_and_failed_runs_reraise_unchanged_and_report_the_status(pack, exc, status):
    import comfy.model_management as mm
    mp = patcher_for(tiny_h3_model(seed=2))
    clone, patch = pack.nodes.h3_patch.patch_model(mp, settings(pack, backend="sdpa"))
    wrapper = outer_sample_wrapper(pack, clone)
    error = {"interrupt": mm.InterruptProcessingException(), "keyboard": KeyboardInterrupt(),
             "error": ValueError("boom")}[exc]

    def sampling_run():
        raise error

    with pytest.raises(BaseException) as caught:
        wrapper(sampling_run)
    assert caught.value is error
    p = patch.report.last
    assert p["status"] == status
    if status == "failed":
        assert p["error"] == {"type": "ValueError", "message": "boom"}
        assert any("failed: ValueError: boom" in m for m in p["messages"])
    else:
        assert p["error"] is None


def test_preference_resolution_through_the_comfy_attention_interface(pack):
    conflicts = pack.nodes.conflicts
    model = tiny_h3_model()

    class ComfyAttention(torch.nn.Module):  # the interface of current ComfyUI's ComfyAttention
        def __init__(self, config=None, function=None):
            super().__init__()
            self.config, self.function = config, function

    def attention_comfy_kitchen_int8(*a, **k):
        pass

    def some_other_packs_attention(*a, **k):
        pass

    model.blocks[0].attn.comfy_attention = ComfyAttention({"attention": "comfy_kitchen_int8"}, attention_comfy_kitchen_int8)
    model.blocks[1].attn.comfy_attention = ComfyAttention(None, some_other_packs_attention)
    mp = patcher_for(model)
    assert conflicts.preference(mp, "diffusion_model.blocks.0.attn")[0] == "comfy_kitchen_int8"
    assert conflicts.preference(mp, "diffusion_model.token_refiner.blocks.0.attn") == (None, "", None)  # 0.33
    with pytest.raises(conflicts.PatchConflictError, match="some_other_packs_attention"):
        conflicts.preference(mp, "diffusion_model.blocks.1.attn")
    with pytest.raises(conflicts.PatchConflictError, match=r"blocks\.1\.attn\.comfy_attention\.function"):
        pack.nodes.h3_patch.patch_model(mp, settings(pack))


# --- rule 10: a loader or node that runs the model's forward itself (conflicts.forward_taken_away) ---------------
class MiniMaxH3(torch.nn.Module):
    """Stands in for comfy.model_base.MiniMaxH3 (rule 10 reads the BaseModel's class name)."""


def h3_patcher(dm):
    holder = MiniMaxH3()
    holder.diffusion_model = dm
    import comfy.model_patcher
    return comfy.model_patcher.ModelPatcher(holder, torch.device("cpu"), torch.device("cpu"))


class SGLDiffusionExecutor(torch.nn.Module):
    """SGLang's integrated mode puts an executor of this name where the diffusion model was."""

    def forward(self, x):
        return x


class FSDPWrapped(torch.nn.Module):
    """A block behind a proxy (an FSDP1-style wrapper): the DiTBlock is not what the model holds."""

    def __init__(self, block):
        super().__init__()
        self.inner = block


def test_a_stock_model_and_one_carrying_this_nodes_patches_are_not_taken_away(pack):
    import comfy.ldm.minimax.model as h3

    dm = tiny_h3_model(seed=3)
    mp = h3_patcher(dm)
    assert pack.nodes.conflicts.forward_taken_away(mp) is None
    dm._forward = dm._forward  # how ComfyUI restores an object patch: the class's own function, bound
    assert pack.nodes.conflicts.forward_taken_away(mp) is None
    clone, _ = pack.nodes.patch_any_model(mp, settings(pack, backend="sdpa"))
    clone.patch_model()  # this node's forwards applied on the modules, as while it samples
    try:
        assert pack.nodes.conflicts.forward_taken_away(clone) is None
        assert isinstance(dm.blocks[0].attn.forward, pack.nodes.h3_patch.H3AttentionForward)
    finally:
        clone.unpatch_model()
    assert h3.MiniMaxH3Model._forward.__qualname__ == "MiniMaxH3Model._forward"


@pytest.mark.parametrize("how", ["proxy_block", "class_forward", "instance_forward", "object_patch"])
def test_a_taken_forward_leaves_the_model_unpatched_and_the_report_says_not_active(pack, how, monkeypatch):
    import comfy.ldm.minimax.model as h3

    def theirs(self, *args, **kwargs):  # another loader's forward
        return None

    dm = tiny_h3_model(seed=3)
    mp = h3_patcher(dm)
    if how == "proxy_block":
        dm.blocks[0] = FSDPWrapped(dm.blocks[0])
        said = "another loader or node runs the model's forward (1 of 2 DiT blocks are test_node_unit.FSDPWrapped"
    elif how == "class_forward":
        monkeypatch.setattr(h3.MiniMaxH3Model, "_forward", theirs)
        said = "another loader or node runs the model's forward (MiniMaxH3Model._forward replaced on the class by "
    elif how == "instance_forward":
        dm.forward = theirs.__get__(dm)
        said = "another loader or node runs the model's forward (diffusion_model.forward set on the model by "
    else:
        mp = mp.clone()
        mp.add_object_patch("diffusion_model._forward", theirs)
        said = "another loader or node runs the model's forward (an object patch of diffusion_model._forward: "
    note = pack.nodes.conflicts.forward_taken_away(mp)
    assert note.code == "forward_taken_away" and note.text.startswith(said), note
    assert note.text.endswith("theirs)" if how != "proxy_block" else "objects, not ComfyUI's DiTBlock)"), note

    clone, patch = pack.nodes.patch_any_model(mp, settings(pack, backend="sdpa"))
    assert not [k for k, v in clone.object_patches.items() if pack.nodes.ownership.is_own(v)]
    assert outer_sample_wrapper(pack, clone)(lambda: "latent") == "latent"
    p = patch.report.last
    assert p["status"] == "not_active" and p["path"] == "h3_forward_patch" and p["blocks_patched"] == 0, p
    assert p["messages"][-1].startswith(f"not active: {note.text}. "), p["messages"]


def test_sglang_executor_on_any_model_gets_no_override_and_an_earlier_one_is_removed(pack):
    """SGLang's executor refuses every ComfyUI attention override: the node leaves none on the clone."""
    mp = patcher_for(tiny_wan_model(seed=2))
    first, _ = pack.nodes.patch_any_model(mp, settings(pack, backend="sdpa"))  # an earlier patch of this node
    first.add_object_patch("diffusion_model", SGLDiffusionExecutor())
    clone, patch = pack.nodes.patch_any_model(first, settings(pack, backend="sdpa"))
    assert "optimized_attention_override" not in clone.model_options.get("transformer_options", {})
    assert patch.report.static["path"] == "attention_override" and patch.report.static["replaced_own_patch"]
    (note,) = patch.report.patch_notes
    assert note["text"] == ("SGLang Diffusion's integrated mode runs the model's forward (the diffusion model is a "
                            "test_node_unit.SGLDiffusionExecutor object)"), note
