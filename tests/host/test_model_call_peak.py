"""The peak per model call of an H3 clone (``h3_patch.measured_call``, in the clone's APPLY_MODEL wrapper), in a real
ComfyUI 0.33 host on the CPU: CUDA's allocator counters are faked here. The report's ``memory`` object and its line;
ComfyUI's own memory estimate stands for every model (the node adds no PREPARE_SAMPLING wrapper)."""

from __future__ import annotations

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


def model():
    return dh.build_model(CONFIG, torch.device("cpu"), torch.bfloat16, 0, "bf16")


def settings(pack, **more):
    return pack.nodes.patch.Settings(backend="sdpa", **more)


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
    assert memory == {"peak_bytes": int(2.2 * gib), "released_bytes": None}
    assert pack.nodes.report.memory_line(memory) == "model call needed: 2.2 GiB"
    patch.report.released(1.5 * gib)
    assert pack.nodes.report.memory_line(patch.report.payload()["memory"]) == (
        "model call needed: 2.2 GiB; 1.5 GiB of stock's video embedding handed back")
    assert pack.nodes.report.memory_line({"peak_bytes": None, "released_bytes": 385 * 2**20}) == (
        "385 MiB of stock's video embedding handed back")
    # a small model's embedding: in KiB, never "0.0 MiB handed back"
    assert pack.nodes.report.memory_line({"peak_bytes": None, "released_bytes": 40 * 2**10}) == (
        "40 KiB of stock's video embedding handed back")
    assert pack.nodes.report.memory_line({"peak_bytes": None, "released_bytes": None}) == ""
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


def test_a_sampled_run_reports_the_released_embedding_and_the_clone_loads_on_stocks_estimate(pack, cur, monkeypatch):
    """On the CPU no peak is measured: the report's memory object and its log line carry the released embedding.
    ComfyUI loads the clone on the same memory estimate as the input model (its own)."""
    import comfy.model_management as mm

    told, load = {}, mm.load_models_gpu

    def recording(models, *args, **kwargs):
        told[models[0]] = (kwargs.get("memory_required"), kwargs.get("minimum_memory_required"))
        return load(models, *args, **kwargs)

    monkeypatch.setattr(mm, "load_models_gpu", recording)
    base = model()
    clone, patch = pack.nodes.h3_patch.patch_model(base, settings(pack))
    for patcher in (base, clone):
        cur.sample(patcher, dh.random_conditioning(TEXT_TOKENS, CONFIG["text_dim"], 3), steps=1, size=SIZE)
    assert told[clone] == told[base] and told[base][0]
    video_rows = dh.packed_token_count(*SIZE, TEXT_TOKENS)["video"]
    memory = patch.report.last["memory"]
    assert memory == {"peak_bytes": None, "released_bytes": video_rows * CONFIG["hidden_size"] * 2}
    assert pack.nodes.report.memory_line(memory) in patch.report.last["messages"]


def test_the_wrapper_kinds_each_path_adds(pack):
    from comfy.patcher_extension import WrappersMP
    from host_fixtures import patcher_for, tiny_wan_model

    h3, _ = pack.nodes.h3_patch.patch_model(model(), settings(pack))
    override, _ = pack.nodes.sage_node.patch_any_model(patcher_for(tiny_wan_model()), settings(pack))
    added = {h3: (WrappersMP.OUTER_SAMPLE, WrappersMP.APPLY_MODEL), override: (WrappersMP.OUTER_SAMPLE,)}
    for clone, kinds in added.items():
        for kind in (WrappersMP.OUTER_SAMPLE, WrappersMP.PREPARE_SAMPLING, WrappersMP.APPLY_MODEL):
            assert len(clone.get_wrappers(kind, pack.nodes.patch.WRAPPER_KEY)) == (kind in kinds), kind
    assert set(pack.nodes.patch.WRAPPER_KINDS) == {WrappersMP.OUTER_SAMPLE, WrappersMP.APPLY_MODEL}
