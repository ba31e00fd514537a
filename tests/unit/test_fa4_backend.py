"""The fa4 back-end without a GPU: availability reasons, what it takes, fallback, compile events.

``flash_attn.cute`` is replaced through ``sys.modules``: ``None`` blocks the import (absent),
a fake module stands in for an installed one. Each test makes its own ``Fa4Backend`` since
availability is probed once per instance.
"""

from __future__ import annotations

import logging
import sys
import time
import types

import pytest
import torch

from comfyui_sage_strided_nhd import kernels
from comfyui_sage_strided_nhd.kernels import chain as chain_module
from comfyui_sage_strided_nhd.kernels.backends import AUTO_ORDER, BACKENDS, INT32_MAX_OFFSET, fa4
from comfyui_sage_strided_nhd.kernels.backends.fa4 import Fa4Backend
from comfyui_sage_strided_nhd.kernels.backends.sdpa import SdpaBackend
from comfyui_sage_strided_nhd.kernels.chain import Skip
from devkit.backends import describe_backends


def fused_views(gen, s=40, h=4, d=64, dtype=torch.bfloat16):
    qkv = torch.randn(s, 3 * h * d, generator=gen).to(dtype)
    return kernels.dataflow.split_fused_qkv(qkv, h, d)


class FakeCompileCache:
    """Stands in for flash_attn.cute.cache_utils.JITCache: a dict of compiled kernels."""

    def __init__(self):
        self.cache = {}


def fake_fa4_module(sleep=0.0):
    """A flash_attn.cute look-alike: flash_attn_func is SDPA, compiling once per (dtype, head_dim)."""
    calls = []

    def _flash_attn_fwd():  # only carries the cache, like the real interface function
        pass

    _flash_attn_fwd.compile_cache = FakeCompileCache()

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        calls.append({"shape": tuple(q.shape), "strides": q.stride(), "scale": softmax_scale, "causal": causal})
        key = (q.dtype, q.shape[-1])
        if key not in _flash_attn_fwd.compile_cache.cache:
            time.sleep(sleep)
            _flash_attn_fwd.compile_cache.cache[key] = object()
        out = SdpaBackend()(q, k, v, layout="NHD", scale=softmax_scale).contiguous()
        return out, None

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = _flash_attn_fwd
    interface.flash_attn_func = flash_attn_func
    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_func = flash_attn_func
    module.interface = interface
    module.calls = calls
    return module


@pytest.fixture
def absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)


@pytest.fixture
def fake(monkeypatch):
    module = fake_fa4_module()
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", module.interface)
    return module


def with_gpu(monkeypatch, capability):
    monkeypatch.setattr(fa4.gpu, "capability", lambda device: capability)


def test_registered_between_sage2_and_sdpa_in_auto_order():
    assert AUTO_ORDER == ("sage2", "fa4", "sdpa", "comfy_kitchen_int8", "sage1")
    assert isinstance(BACKENDS["fa4"], Fa4Backend)
    assert set(BACKENDS) == set(AUTO_ORDER)
    assert "fa4" in kernels.BACKEND_CHOICES
    b = Fa4Backend()
    assert b.takes_mask is False and b.dtypes == (torch.float16, torch.bfloat16) and b.compile_events == []


def test_absent_module_says_how_to_install_it(absent, monkeypatch):
    with_gpu(monkeypatch, (9, 0))
    verdict = Fa4Backend().available()
    assert not verdict
    assert verdict.reason == "flash-attn-4 not installed (pip install flash-attn-4)"
    assert verdict.code == "not_installed"


def test_installed_without_cuda_is_unavailable(fake, monkeypatch):
    with_gpu(monkeypatch, None)
    verdict = Fa4Backend().available()
    assert verdict.reason == "no CUDA device" and verdict.code == "no_cuda"


@pytest.mark.parametrize("capability", [(7, 5), (6, 1), (13, 0)])
def test_arches_without_an_fa4_kernel(capability, fake, monkeypatch):
    with_gpu(monkeypatch, capability)
    verdict = Fa4Backend().available()
    assert not verdict
    assert verdict.reason == f"no fa4 kernel for compute capability {capability[0]}.{capability[1]}"
    assert verdict.code == "gpu_arch"


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)])
def test_dispatched_arches_are_available(capability, fake, monkeypatch):
    with_gpu(monkeypatch, capability)
    b = Fa4Backend()
    assert b.available()
    # 64-bit indexing is only trusted where it was run past 2**31; elsewhere the chain chunks heads.
    assert b.max_element_offset == (None if capability == (9, 0) else INT32_MAX_OFFSET)


def test_a_module_that_raises_on_import_is_a_one_line_reason(monkeypatch):
    with_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(fa4, "_installed", lambda: True)

    def broken(name, *a, **k):
        raise RuntimeError("No CTK flavor installed: expected _cutlass_ir.cu13\nsecond line")

    monkeypatch.setattr(fa4.importlib, "import_module", broken)
    verdict = Fa4Backend().available()
    assert verdict.reason == (
        "flash_attn.cute not importable (RuntimeError: No CTK flavor installed: expected _cutlass_ir.cu13)")
    assert verdict.code == "not_installed"


def test_cpu_tensors_are_not_taken(fake, monkeypatch, gen):
    with_gpu(monkeypatch, (9, 0))
    b = Fa4Backend()
    q, k, v = fused_views(gen)
    verdict = b.supports(q, k, v, layout="NHD")
    assert verdict.reason == "needs a CUDA device, got cpu" and verdict.code == "no_cuda"


def supports_on_gpu(b, q, k, v, monkeypatch, layout="NHD", mask=None):
    """supports() as if the tensors lived on a GPU (the shared device rule is tested above)."""
    monkeypatch.setattr(b, "needs_cuda", False)
    return b.supports(q, k, v, layout=layout, mask=mask)


def test_unsupported_dtype_head_dim_and_mask(fake, monkeypatch, gen):
    with_gpu(monkeypatch, (9, 0))
    b = Fa4Backend()
    assert b.available()
    q, k, v = fused_views(gen, dtype=torch.float32)
    verdict = supports_on_gpu(b, q, k, v, monkeypatch)
    assert "dtype torch.float32 not in" in verdict.reason and verdict.code == "dtype"
    q, k, v = fused_views(gen, d=68)
    verdict = supports_on_gpu(b, q, k, v, monkeypatch)
    assert verdict.reason == "head_dim 68 not supported on compute capability 9.0 (multiples of 8 up to 256)"
    assert verdict.code == "head_dim"
    q, k, v = fused_views(gen, d=64)
    mask = torch.zeros(1, 1, 40, 40, dtype=torch.bool)
    verdict = supports_on_gpu(b, q, k, v, monkeypatch, mask=mask)
    assert verdict.reason == "attention masks are not supported" and verdict.code == "mask"
    assert supports_on_gpu(b, q, k, v, monkeypatch)
    assert supports_on_gpu(b, *(t.transpose(1, 2) for t in (q, k, v)), monkeypatch, layout="HND")


@pytest.mark.parametrize("capability,head_dim,ok", [
    ((9, 0), 256, True), ((9, 0), 192, True), ((10, 0), 192, False), ((10, 0), 256, True),
    ((10, 0), 128, True), ((8, 6), 256, False), ((12, 0), 128, True), ((12, 0), 160, False)])
def test_head_dims_follow_the_arch(capability, head_dim, ok, fake, monkeypatch, gen):
    with_gpu(monkeypatch, capability)
    b = Fa4Backend()
    assert b.available()
    q, k, v = fused_views(gen, s=8, h=1, d=head_dim)
    assert bool(supports_on_gpu(b, q, k, v, monkeypatch)) is ok


def test_grouped_heads_must_divide(fake, monkeypatch, gen):
    with_gpu(monkeypatch, (9, 0))
    b = Fa4Backend()
    b.available()
    q = torch.randn(1, 8, 6, 64, dtype=torch.bfloat16)
    kv = torch.randn(1, 8, 4, 64, dtype=torch.bfloat16)
    verdict = supports_on_gpu(b, q, kv, kv, monkeypatch)
    assert verdict.reason == "6 query heads do not group over 4 key heads" and verdict.code == "shape"


def test_chain_for_fa4_on_cpu_falls_back_to_sdpa_and_records_why(absent, monkeypatch, gen, caplog):
    monkeypatch.setitem(BACKENDS, "fa4", Fa4Backend())
    monkeypatch.setattr(chain_module, "_logged", set())  # each distinct skip is logged once per process
    q, k, v = fused_views(gen, dtype=torch.float32)
    chain = kernels.BackendChain.for_choice("fa4")
    assert [b.name for b in chain.backends][:2] == ["fa4", "sage2"]
    with caplog.at_level(logging.WARNING, logger="sage_strided_nhd"):
        out, rec = chain.run(q, k, v, layout="NHD")
    assert rec.requested == "fa4" and rec.backend == "sdpa"
    assert rec.skipped[0] == Skip("fa4", "not_installed", "flash-attn-4 not installed (pip install flash-attn-4)",
                                  "unavailable")
    assert any("fa4 skipped (flash-attn-4 not installed" in r.getMessage() for r in caplog.records)
    assert torch.equal(out, SdpaBackend()(q, k, v, layout="NHD"))


def test_installed_fa4_on_a_cpu_machine_falls_back_with_the_device_reason(fake, monkeypatch, gen):
    with_gpu(monkeypatch, None)
    monkeypatch.setitem(BACKENDS, "fa4", Fa4Backend())
    q, k, v = fused_views(gen, dtype=torch.float32)
    out, rec = kernels.BackendChain.for_choice("fa4").run(q, k, v, layout="NHD")
    assert rec.backend == "sdpa" and rec.skipped[0] == Skip("fa4", "no_cuda", "no CUDA device", "unavailable")


def test_describe_backends_lists_fa4_with_its_reason(absent, monkeypatch):
    monkeypatch.setitem(BACKENDS, "fa4", Fa4Backend())
    rows = {r["name"]: r for r in describe_backends("cpu")}
    assert list(rows) == list(AUTO_ORDER)
    assert rows["fa4"] == {"name": "fa4", "available": False, "code": "not_installed",
                           "reason": "flash-attn-4 not installed (pip install flash-attn-4)"}
    assert rows["sdpa"] == {"name": "sdpa", "available": True, "code": "", "reason": ""}


def test_describe_backends_gives_an_available_fa4_the_device_reason(fake, monkeypatch):
    with_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(BACKENDS, "fa4", Fa4Backend())
    assert {r["name"]: r for r in describe_backends()}["fa4"] == {
        "name": "fa4", "available": True, "code": "", "reason": ""}
    assert {r["name"]: r for r in describe_backends("cpu")}["fa4"] == {
        "name": "fa4", "available": False, "code": "no_cuda", "reason": "needs a CUDA device, got cpu"}


def test_calls_pass_the_strided_views_as_they_are_and_record_compiles_once(fake, monkeypatch, gen):
    """The fake kernel runs on CPU: the back-end hands over the fused views (no copy) in NHD and
    transposed views in HND, and a compile event appears only when the compile cache grows."""
    with_gpu(monkeypatch, (9, 0))
    b = Fa4Backend()
    assert b.available()
    q, k, v = fused_views(gen, s=40, h=4, d=64)
    out = b(q, k, v, layout="NHD", scale=0.1)
    assert fake.calls[-1] == {"shape": (1, 40, 4, 64), "strides": q.stride(), "scale": 0.1, "causal": False}
    assert q.stride(1) == 3 * 4 * 64  # the fused row stride reached the kernel
    assert out.is_contiguous() and out.shape == q.shape
    assert torch.equal(out, SdpaBackend()(q, k, v, layout="NHD", scale=0.1).contiguous())
    assert len(b.compile_events) == 1
    event = b.compile_events[0]
    assert set(event) == {"key", "seconds"} and isinstance(event["seconds"], float)
    assert "flash_attn_fwd x1" in event["key"] and "bfloat16 head_dim 64" in event["key"] and "S=40" in event["key"]

    # Other sequence lengths, another call site, the HND layout: same kernel, no new compile.
    for s in (17, 93):
        b(*fused_views(gen, s=s, h=4, d=64), layout="NHD")
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out_hnd = b(qh, kh, vh, layout="HND")
    assert fake.calls[-1]["shape"] == (1, 40, 4, 64)  # HND went in as [B,S,H,D] views
    assert torch.equal(out_hnd.transpose(1, 2), b(q, k, v, layout="NHD"))
    assert len(b.compile_events) == 1
    b(*fused_views(gen, s=40, h=4, d=64, dtype=torch.float16), layout="NHD")  # a new dtype compiles
    assert len(b.compile_events) == 2 and "float16" in b.compile_events[1]["key"]


def test_without_a_readable_cache_a_slow_call_counts_as_a_compile(monkeypatch, gen):
    module = fake_fa4_module(sleep=0.6)
    module.interface = None
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    with_gpu(monkeypatch, (9, 0))
    b = Fa4Backend()
    assert b.available()
    q, k, v = fused_views(gen)
    b(q, k, v, layout="NHD")
    b(q, k, v, layout="NHD")
    assert len(b.compile_events) == 1 and b.compile_events[0]["seconds"] >= 0.6
    assert "(timed)" in b.compile_events[0]["key"]


def test_the_chain_runs_fa4_through_the_dataflow(fake, monkeypatch, gen):
    """With fa4 'available' (fake kernel, device rule lifted) the strided dataflow uses it copy-free."""
    with_gpu(monkeypatch, (9, 0))
    b = Fa4Backend()
    monkeypatch.setattr(b, "needs_cuda", False)
    monkeypatch.setitem(BACKENDS, "fa4", b)
    qkv = torch.randn(40, 3 * 4 * 64, generator=gen).to(torch.bfloat16)
    chain = kernels.BackendChain.for_choice("fa4")
    identity = lambda x: x  # noqa: E731
    outs = {}
    for layout in ("strided_nhd", "hnd"):
        norm = kernels.QKNorm(q_norm=identity, k_norm=identity)  # one per call: applied at most once
        outs[layout], rec = kernels.attention_from_fused_qkv(qkv.clone(), 4, 64, chain=chain, layout=layout,
                                                             norm=norm)
        assert rec.backend == "fa4" and rec.skipped == () and norm.applied
        assert rec.prepared == "" and rec.prepared_skipped is None  # fa4 has no prepared path
    assert rec.copies == 3  # the HND baseline's three input copies; fa4's output is already token-major
    assert torch.equal(outs["strided_nhd"], outs["hnd"])
