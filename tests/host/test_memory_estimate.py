"""ComfyUI's memory estimate for a clone whose H3 blocks run the block fast path (nodes/memory.py), in a real ComfyUI
0.33 host on the CPU: the clone's sampling is prepared on the pack's estimate of one model call (batch x2 and x1, as
``estimate_memory`` asks), the shared model, the input model and other clones keep stock's, anything missing keeps
stock's, and the report says what ComfyUI was told. The pack gives its estimate on CUDA load devices only: the tests
that need it add the CPU to ``memory.ESTIMATED_DEVICES``. The peak per model call: CUDA's counters, faked here."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from devkit import h3 as dh

CONFIG = dh.INT8_TINY_H3
SIZE = (64, 64, 5)  # the empty AV latent's width, height and frames (current_comfyui_standins.sample)
TEXT_TOKENS = 8


@pytest.fixture(scope="module")
def pack(comfy_inprocess):
    torch.set_grad_enabled(False)
    yield comfy_inprocess
    torch.set_grad_enabled(True)


@pytest.fixture
def loads(monkeypatch):
    """What each sampling preparation told ComfyUI: patcher -> (memory_required, minimum_memory_required)."""
    import comfy.model_management as mm

    told, load = {}, mm.load_models_gpu

    def recording(models, *args, **kwargs):
        told[models[0]] = (kwargs.get("memory_required"), kwargs.get("minimum_memory_required"))
        return load(models, *args, **kwargs)

    monkeypatch.setattr(mm, "load_models_gpu", recording)
    return told


@pytest.fixture
def on_cpu(pack, monkeypatch):
    monkeypatch.setattr(pack.nodes.memory, "ESTIMATED_DEVICES", ("cuda", "cpu"))


def model():
    return dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "bf16")


def settings(pack, **more):
    return pack.nodes.patch.Settings(backend="sdpa", **more)


def sample(cur, patcher):
    return cur.sample(patcher, dh.random_conditioning(TEXT_TOKENS, CONFIG["text_dim"], 3), steps=1, size=SIZE)


def packed_latent_elements() -> int:
    """The sampler's packed latent [B, 1, N]: video and audio elements side by side."""
    from comfy_extras.nodes_minimax_h3 import EmptyMiniMaxH3LatentAV

    return sum(math.prod(t.shape[1:]) for t in EmptyMiniMaxH3LatentAV.execute(*SIZE)[0]["samples"].unbind())


def stocks(patcher) -> tuple:
    n = packed_latent_elements()
    return tuple(type(patcher.model).memory_required(patcher.model, [b, 1, n]) for b in (2, 1))


def packs_model_call(embedding_released: bool = True) -> int:
    """The pack's bytes of one model call here: bf16, the tiny model's dimensions, sdpa (no prepared path), the
    video embedding handed back at the first block unless a compiled forward keeps it."""
    tokens = dh.packed_token_count(*SIZE, TEXT_TOKENS)["total"]
    dims = dict(hidden=CONFIG["hidden_size"], heads=2, head_dim=128, ffn=CONFIG["ffn_hidden_size"])
    from comfyui_sage_strided_nhd import kernels

    peak = kernels.block_peak_bytes(tokens, prepared=False, **dims)  # a full load (a CPU): the weights as they lie
    return kernels.model_call_bytes(tokens, peak, hidden=dims["hidden"], embedding_released=embedding_released)


def released_embedding_bytes() -> int:
    """Stock's video embedding of one model call here: every video row, bf16."""
    return dh.packed_token_count(*SIZE, TEXT_TOKENS)["video"] * CONFIG["hidden_size"] * 2


def test_the_clone_is_loaded_on_the_packs_estimate_and_every_other_model_on_stocks(pack, cur, loads, on_cpu):
    base = model()
    other = base.clone()
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    attention_only, attention_patch = pack.nodes.h3_patch.patch_model(base, settings(pack, block_path="attention_only"))
    for patcher in (base, clone, other, attention_only, clone):
        sample(cur, patcher)
    per_call = packs_model_call()
    assert loads[clone] == (2 * per_call, per_call) and per_call != stocks(base)[1]
    for patcher in (base, other, attention_only):
        assert loads[patcher] == stocks(base), "another model was told the pack's estimate"
    assert "memory_required" not in vars(base.model), "the shared model kept the clone's estimate"
    assert patch.report.last["memory"] == {"peak_bytes": None, "estimate_bytes": per_call, "estimate_by": "pack",
                                           "released_bytes": released_embedding_bytes()}
    assert pack.nodes.report.memory_line(patch.report.last["memory"]) in patch.report.last["messages"]
    # the attention-only clone's blocks are stock's: ComfyUI's own estimate stood, and the report says so
    assert attention_patch.report.last["memory"] == {"peak_bytes": None, "estimate_bytes": int(stocks(base)[1]),
                                                     "estimate_by": "comfyui", "released_bytes": None}


def test_where_the_comfy_compiler_keeps_the_embedding_the_estimate_counts_it(pack, cur, loads, on_cpu, monkeypatch):
    import comfy.model_prefetch

    monkeypatch.setattr(comfy.model_prefetch, "malloc_graph_enabled", lambda device: True, raising=False)
    clone, patch = pack.nodes.h3_patch.patch_model(model(), settings(pack))
    sample(cur, clone)
    kept = packs_model_call(embedding_released=False)
    assert loads[clone] == (2 * kept, kept) and kept > packs_model_call()
    assert patch.report.last["memory"]["released_bytes"] is None


def test_a_cpu_load_device_keeps_stocks_estimate_and_the_report_has_no_estimate(pack, cur, loads):
    base = model()
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    sample(cur, clone)
    assert loads[clone] == stocks(base)
    assert patch.report.last["memory"] == {"peak_bytes": None, "estimate_bytes": None, "estimate_by": None,
                                           "released_bytes": released_embedding_bytes()}


def test_a_preparation_outside_a_sampling_run_keeps_stocks_estimate(pack, loads, on_cpu):
    """prepare_sampling called on its own (no OUTER_SAMPLE: the latent's shapes unknown), as some samplers do."""
    import comfy.model_patcher
    import comfy.sampler_helpers

    base = model()
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    patch.report.begin_run()
    conds = {"positive": comfy.sampler_helpers.convert_cond(dh.random_conditioning(TEXT_TOKENS, CONFIG["text_dim"], 3))}
    options = comfy.model_patcher.create_model_options_clone(clone.model_options)
    options.setdefault("transformer_options", {})
    comfy.sampler_helpers.prepare_model_patcher(clone, conds, options)
    comfy.sampler_helpers.prepare_sampling(clone, [1, 1, packed_latent_elements()], conds, options)
    assert loads[clone] == stocks(base) and patch.report.estimate["by"] == "comfyui"
    assert "memory_required" not in vars(base.model)


def test_the_answer_shows_stocks_signature_to_current_comfyuis_caller(pack, on_cpu):
    """Current ComfyUI (``call_model_memory_required``) passes ``memory_efficient_attention`` only to a
    ``memory_required`` whose signature takes it: the clone's answer shows stock's, and takes what stock takes."""
    import inspect

    base = model()
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    stock = inspect.signature(base.model.memory_required)
    n = packed_latent_elements()
    with pack.nodes.memory.run_estimate(patch, clone, [1, 1, n], {}):
        assert inspect.signature(base.model.memory_required) == stock
        assert base.model.memory_required([1, 1, n], cond_shapes={}) == stocks(base)[1]  # no tokens: stock's
    assert "memory_required" not in vars(base.model)


def test_an_estimate_that_raises_keeps_stocks_and_the_run_samples(pack, cur, loads, on_cpu, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise KeyError("hidden_size")

    monkeypatch.setattr(pack.nodes.memory, "model_call_estimate", broken)
    base = model()
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    sample(cur, clone)
    assert loads[clone] == stocks(base) and patch.report.last["status"] == "ok"
    assert patch.report.last["memory"]["estimate_by"] == "comfyui"
    assert "memory estimate: ComfyUI's own stands (KeyError" in caplog.text


def test_another_patch_of_memory_required_answers_for_itself(pack, cur, loads, on_cpu):
    base = model()
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    clone.add_object_patch("memory_required", lambda input_shape, cond_shapes={}: 12345 * input_shape[0])
    sample(cur, clone)
    assert patch.report.last["memory"]["estimate_bytes"] is None  # neither the pack's estimate nor a record of theirs
    assert pack.nodes.memory.model_call_estimate(patch, clone, {}, None) is None  # and no tokens outside a run


def test_block_replaces_keep_stocks_estimate(pack, cur, loads, on_cpu):
    base = model()
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    clone.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", 0)
    sample(cur, clone)
    assert loads[clone] == stocks(base) and patch.report.last["memory"]["estimate_by"] == "comfyui"


def test_the_weight_forms_follow_how_comfyui_will_load_the_weights(pack, monkeypatch):
    import comfy.model_management as mm

    def patcher(dynamic=False, patches=None):
        return SimpleNamespace(is_dynamic=lambda: dynamic, patches=patches or {}, weight_wrapper_patches={})

    forms = pack.nodes.memory.weight_forms
    cast = [dict(chunked=True, qkv_by_columns=by, cast_weights=True) for by in (True, False)]
    chunked = dict(chunked=True, qkv_by_columns=True, cast_weights=False)
    whole = dict(chunked=False, cast_weights=True)
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NORMAL_VRAM)
    assert forms(patcher(), True, True) == [chunked]                         # a forced full load: on the device
    assert forms(patcher(), True, True, False) == [dict(chunked, qkv_by_columns=False)]   # a weight cast per call
    assert forms(patcher(), False, True) == cast + [whole]                   # a partial load may stream a block
    assert forms(patcher(dynamic=True), False, True) == cast                 # DynamicVRAM: cast once a block
    assert forms(patcher(dynamic=True, patches={"k": []}), False, True) == cast + [whole]   # a LoRA's weight function
    assert forms(patcher(), False, False) == [whole]                         # no chunks (fp32, a CPU)
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.HIGH_VRAM)
    assert forms(patcher(), False, True) == [chunked]


class FakeCudaCounters:
    """torch.cuda's allocator counters as a model call would move them: ``peaks`` one per call."""

    def __init__(self, start: int, peaks: list[int]):
        self.start, self.peaks, self.resets = start, list(peaks), 0

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.start)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: self._reset())
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peaks.pop(0))

    def _reset(self):
        self.resets += 1


def test_each_model_calls_peak_is_measured_around_it_and_the_largest_reported(pack, monkeypatch):
    from comfy.patcher_extension import WrappersMP

    clone, patch = pack.nodes.h3_patch.patch_model(model(), settings(pack))
    (wrapper,) = clone.get_wrappers(WrappersMP.APPLY_MODEL, pack.nodes.patch.WRAPPER_KEY)
    start, gib = 30 * 2**30, 2**30
    counters = FakeCudaCounters(start, peaks=[start + gib, start + int(2.2 * gib), start + int(1.9 * gib)])
    counters.install(monkeypatch)
    x = SimpleNamespace(device=torch.device("cuda", 0))
    patch.report.begin_run()
    for _ in range(3):
        assert wrapper(lambda x, *args, **kwargs: (args, kwargs), x, 1, c=2) == ((1,), {"c": 2})
    assert counters.resets == 3 and patch.report.peak_bytes == int(2.2 * gib)
    memory = patch.report.payload()["memory"]
    assert memory == {"peak_bytes": int(2.2 * gib), "estimate_bytes": None, "estimate_by": None, "released_bytes": None}
    assert pack.nodes.report.memory_line(memory) == "model call needed: 2.2 GiB"
    patch.report.estimated(2.4 * gib, "comfyui")
    assert pack.nodes.report.memory_line(patch.report.payload()["memory"]) == (
        "model call needed: 2.2 GiB (ComfyUI told 2.4 GiB, its own estimate)")
    patch.report.released(1.5 * gib)
    assert pack.nodes.report.memory_line(patch.report.payload()["memory"]) == (
        "model call needed: 2.2 GiB (ComfyUI told 2.4 GiB, its own estimate); "
        "1.5 GiB of stock's video embedding handed back")
    assert pack.nodes.report.memory_line({"released_bytes": 385 * 2**20}) == (
        "385 MiB of stock's video embedding handed back")
    # a small model's embedding: in KiB, never "0.0 MiB handed back"
    assert pack.nodes.report.memory_line({"released_bytes": 40 * 2**10}) == (
        "40 KiB of stock's video embedding handed back")
    assert [pack.nodes.report.byte_size(n) for n in (2.5 * 2**10, 1023 * 2**10, 2**20, 3.5 * 2**20)] == [
        "2.5 KiB", "1023 KiB", "1.0 MiB", "3.5 MiB"]


def test_no_peak_is_measured_off_cuda_or_when_the_settings_say_so(pack, monkeypatch):
    from comfy.patcher_extension import WrappersMP

    counters = FakeCudaCounters(start=0, peaks=[])
    counters.install(monkeypatch)
    for device, measure in ((torch.device("cpu"), True), (torch.device("cuda", 0), False)):
        clone, patch = pack.nodes.h3_patch.patch_model(model(), settings(pack, measure_peak=measure))
        (wrapper,) = clone.get_wrappers(WrappersMP.APPLY_MODEL, pack.nodes.patch.WRAPPER_KEY)
        assert wrapper(lambda x: "out", SimpleNamespace(device=device)) == "out"
        assert patch.report.peak_bytes is None
    assert counters.resets == 0


def test_the_override_path_adds_no_memory_wrappers(pack):
    from comfy.patcher_extension import WrappersMP
    from host_fixtures import patcher_for, tiny_wan_model

    clone, _ = pack.nodes.sage_node.patch_any_model(patcher_for(tiny_wan_model()), settings(pack))
    for kind in (WrappersMP.PREPARE_SAMPLING, WrappersMP.APPLY_MODEL):
        assert clone.get_wrappers(kind, pack.nodes.patch.WRAPPER_KEY) == []
    assert len(clone.get_wrappers(WrappersMP.OUTER_SAMPLE, pack.nodes.patch.WRAPPER_KEY)) == 1
