"""The sage2 self-test on the CPU, through fakes of SageAttention installed by monkeypatching.

A healthy fake computes with SDPA (the sm90 binding on the dequantised operands the pack prepared); broken fakes
behave as broken builds do: output never written (SageAttention 2.2.0's release tag on Hopper), the wrong shape,
an error, an op declared with other arguments, the tag's fake implementation standing in for the op. A broken one
must take sage2 off for that device with the reason in the chain's skip record and the log, and the chain must run
the next back-end; a healthy one keeps sage2; either way the self-test runs once per device.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from comfyui_sage_strided_nhd.kernels import sage2_quant
from comfyui_sage_strided_nhd.kernels.backends import sage2, sage2_binding, sage2_selftest
from comfyui_sage_strided_nhd.kernels.backends.base import YES, AttentionBackend, no
from comfyui_sage_strided_nhd.kernels.backends.sdpa import SdpaBackend
from comfyui_sage_strided_nhd.kernels.chain import BackendChain
from devkit import sage2_oracle

CPU = torch.device("cpu")
CALLS = {"sageattn": 0, "sm90": 0}
PREPARED_CHECKS = {f"sm90 binding, prepared {mode}" for mode in sage2_quant.MODES}


# --- fakes of SageAttention's entry points ---------------------------------------------------------------
def sdpa_sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kwargs):
    """A healthy ``sageattn``: SDPA in the caller's layout."""
    CALLS["sageattn"] += 1
    nhd = tensor_layout == "NHD"
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) if nhd else t for t in (q, k, v)), scale=sm_scale)
    return out.transpose(1, 2).contiguous() if nhd else out


def unwritten_sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kwargs):
    """The 2.2.0 tag on Hopper: the output is allocated, the kernel never launched (fresh memory: zeros here)."""
    CALLS["sageattn"] += 1
    return torch.zeros(q.shape, dtype=q.dtype)


def head_major_sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kwargs):
    """Right values, wrong shape: always head-major."""
    out = sdpa_sageattn(q, k, v, tensor_layout, is_causal, sm_scale)
    return out.transpose(1, 2) if tensor_layout == "NHD" else out


def raising_sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kwargs):
    CALLS["sageattn"] += 1
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


def keywordless_sageattn(q, k, v, tensor_layout="HND", is_causal=False):
    """An older signature: the pack's ``sm_scale`` would be refused."""
    return sdpa_sageattn(q, k, v, tensor_layout, is_causal)


def unscaled_sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kwargs):
    """Drops ``sm_scale``: another problem's attention, close but not the pack's."""
    return sdpa_sageattn(q, k, v, tensor_layout, is_causal, None)


def _attend_dequantised(query, key, value, output, query_scale, key_scale, value_scale, sm_scale):
    ops = {"q_int8": query[0].permute(1, 0, 2), "k_int8": key[0].permute(1, 0, 2), "v_fp8": value[0].permute(1, 0, 2),
           "q_scale": query_scale, "k_scale": key_scale, "v_scale": value_scale}
    qd, kd, vd = sage2_oracle.dequantize_operands(ops)
    output.copy_(F.scaled_dot_product_attention(qd[None], kd[None], vd[None], scale=sm_scale).transpose(1, 2))


@torch.library.custom_op("sage2_selftest_fakes::healthy", mutates_args=("output",))
def healthy_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
               query_scale: torch.Tensor, key_scale: torch.Tensor, value_scale: torch.Tensor, tensor_layout: int,
               is_causal: int, qk_quant_gran: int, sm_scale: float, return_lse: int) -> torch.Tensor:
    CALLS["sm90"] += 1
    _attend_dequantised(query, key, value, output, query_scale, key_scale, value_scale, sm_scale)
    return torch.empty(0)


@torch.library.custom_op("sage2_selftest_fakes::unwritten", mutates_args=("output",))
def unwritten_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                 query_scale: torch.Tensor, key_scale: torch.Tensor, value_scale: torch.Tensor, tensor_layout: int,
                 is_causal: int, qk_quant_gran: int, sm_scale: float, return_lse: int) -> torch.Tensor:
    CALLS["sm90"] += 1
    return torch.empty(0)  # returns its lse and never launches the kernel


@torch.library.custom_op("sage2_selftest_fakes::raising", mutates_args=("output",))
def raising_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
               query_scale: torch.Tensor, key_scale: torch.Tensor, value_scale: torch.Tensor, tensor_layout: int,
               is_causal: int, qk_quant_gran: int, sm_scale: float, return_lse: int) -> torch.Tensor:
    CALLS["sm90"] += 1
    raise RuntimeError("CUDA error: invalid argument")


@torch.library.custom_op("sage2_selftest_fakes::no_v_scale", mutates_args=("output",))
def no_v_scale_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                  query_scale: torch.Tensor, key_scale: torch.Tensor, tensor_layout: int, is_causal: int,
                  qk_quant_gran: int, sm_scale: float, return_lse: int) -> torch.Tensor:
    CALLS["sm90"] += 1  # another binding's arguments: the pack's call would pass value_scale as tensor_layout
    return torch.empty(0)


def shadowed_binding(*args):
    """What the 2.2.0 tag's sm90_compile exports under the op's name: its fake implementation."""
    return torch.empty(0)


OPS = {name: getattr(torch.ops.sage2_selftest_fakes, name)
       for name in ("healthy", "unwritten", "raising", "no_v_scale")}


@pytest.fixture
def install(monkeypatch):
    """``install(sageattn, op, binding)`` -> a fresh Sage2Backend on those fakes; the CPU stands in for an sm90 GPU."""
    def _install(sageattn=sdpa_sageattn, op="healthy", binding=None, sm90=True):
        CALLS.update(sageattn=0, sm90=0)
        module = types.SimpleNamespace(sageattn=sageattn, sageattn_qk_int8_pv_fp16_cuda=object())
        compiled = types.ModuleType("sageattention.sm90_compile")
        setattr(compiled, sage2_selftest.SM90_OP, healthy_op if binding is None else binding)
        monkeypatch.setitem(sys.modules, "sageattention.sm90_compile", compiled)
        monkeypatch.setattr(sage2, "installed_sageattention", lambda: (module, 2))
        monkeypatch.setattr(sage2.gpu, "capability", lambda device: (9, 0))
        monkeypatch.setattr(sage2_binding, "on_sm90", lambda device: sm90)
        monkeypatch.setattr(sage2, "SELF_TESTED_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(sage2_binding, "sm90_attention_op", lambda: (OPS[op], ""))
        # the Triton passes' bits (tests/unit/test_sage2_quant.py) without the interpreter
        monkeypatch.setattr(sage2_quant, "quantize_operands", sage2_oracle.prepare_reference)
        backend = sage2.Sage2Backend()
        backend.needs_cuda = False  # the fakes run on the CPU
        assert backend.available(), backend.available()  # installed: the process-wide verdict
        return backend
    return _install


def call_inputs(seed=11, s=96, h=3, d=128):
    g = torch.Generator().manual_seed(seed)
    return [t.to(torch.bfloat16) for t in torch.randn(3, 1, s, h, d, generator=g).unbind(0)]


def run_chain(backend):
    q, k, v = call_inputs()
    out, rec = BackendChain("auto", (backend, SdpaBackend())).run(q, k, v, layout="NHD")
    return out, rec, SdpaBackend()(q, k, v, layout="NHD")


# --- a healthy install ---------------------------------------------------------------------------------
def test_healthy_fakes_keep_sage2_and_the_self_test_runs_once(install):
    backend = install()
    _, rec, _ = run_chain(backend)
    assert rec.backend == "sage2" and rec.skipped == (), rec
    test_calls = dict(CALLS)
    # NHD, HND, NHD by two head chunks, then the call; 2 modes x 2 head chunks
    assert test_calls == {"sageattn": 4 + 1, "sm90": 2 * 2}, test_calls
    run_chain(backend)
    assert CALLS == {"sageattn": test_calls["sageattn"] + 1, "sm90": test_calls["sm90"]}, "the self-test ran again"
    assert backend.available(CPU) and backend.device_verdict("cpu") is backend.device_verdict(CPU)


def test_healthy_fakes_pass_every_entry_point_with_margin(install):
    errors = sage2_selftest.measure(install(), CPU)
    assert set(errors) >= PREPARED_CHECKS | {"sageattn NHD on strided views", "sageattn HND",
                                             "sageattn NHD by head chunks"}, errors
    # the prepared checks carry the int8 / fp8 quantisation error of the pack's own operands
    assert max(errors.values()) < sage2_selftest.MAX_RELATIVE_ERROR / 2, errors
    assert min(errors[name] for name in PREPARED_CHECKS) > 1e-3, errors


def test_off_sm90_the_binding_is_neither_probed_nor_called(install):
    backend = install(op="raising", binding=shadowed_binding, sm90=False)
    assert backend.device_verdict(CPU), backend.device_verdict(CPU)
    assert CALLS["sm90"] == 0


# --- broken installs -------------------------------------------------------------------------------------
BROKEN = {
    "sageattn never writes its output": (dict(sageattn=unwritten_sageattn), "sageattn NHD on strided views: worst "
                                                                            "head's relative error 1.000"),
    "sageattn returns head-major output": (dict(sageattn=head_major_sageattn), "returned shape [1, 4, 320, 128]"),
    "sageattn raises": (dict(sageattn=raising_sageattn), "raised RuntimeError: CUDA error: no kernel image"),
    "sageattn takes no sm_scale": (dict(sageattn=keywordless_sageattn), "sageattn takes no sm_scale"),
    "sageattn drops sm_scale": (dict(sageattn=unscaled_sageattn), "worst head's relative error 0."),
    "the sm90 binding never writes": (dict(op="unwritten"), "sm90 binding, prepared exact: worst head's relative "
                                                            "error not finite"),
    "the sm90 binding raises": (dict(op="raising"), "sm90 binding, prepared exact raised RuntimeError"),
    "the sm90 op has other arguments": (dict(op="no_v_scale"), "is declared (query, key, value, output, query_scale, "
                                                               "key_scale, tensor_layout"),
    "the 2.2.0 tag's binding": (dict(binding=shadowed_binding), "plain function, not the registered op"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_install_drops_sage2_on_that_device_and_sdpa_runs(case, install, caplog):
    fakes, says = BROKEN[case]
    backend = install(**fakes)
    with caplog.at_level(logging.INFO, logger="sage_strided_nhd"):
        out, rec, expected = run_chain(backend)
    assert rec.backend == "sdpa" and torch.equal(out, expected), rec
    (skip,) = rec.skipped
    assert (skip.backend, skip.code) == ("sage2", "self_test_failed"), skip
    assert says in skip.reason and "on cpu" in skip.reason, skip.reason
    assert not backend.available(CPU) and backend.available(CPU).reason == skip.reason
    assert any("[Sage Strided NHD] sage2 self-test failed on cpu" in r.getMessage() and says in r.getMessage()
               for r in caplog.records), caplog.text
    calls = dict(CALLS)
    _, again, _ = run_chain(backend)
    assert again.backend == "sdpa" and again.skipped == rec.skipped
    assert CALLS == calls, "the self-test ran again"


def test_the_limit_separates_a_kernel_that_never_wrote_from_a_healthy_one(install):
    healthy = max(sage2_selftest.measure(install(), CPU).values())
    unscaled = sage2_selftest.measure(install(sageattn=unscaled_sageattn, sm90=False), CPU)
    other_problem = install(sageattn=lambda q, k, v, **kw: sdpa_sageattn(v, k, q, **kw), sm90=False)  # as stale memory
    stale = sage2_selftest.measure(other_problem, CPU)
    limit = sage2_selftest.MAX_RELATIVE_ERROR
    assert healthy < limit / 2 < limit < min(unscaled.values()), (healthy, unscaled)
    assert limit < min(stale.values()), stale


# --- per device --------------------------------------------------------------------------------------------
class PerDevice(AttentionBackend):
    """Trusted on cuda:0, not on cuda:1; counts the checks."""

    name = "per_device"
    checked: list

    def _check_available(self):
        return YES

    def _check_device(self, device):
        self.checked.append(str(device))
        return YES if device.index == 0 else no("self_test_failed", f"failed on {device}")


def test_verdicts_are_kept_per_device_and_checked_once():
    backend = PerDevice()
    backend.checked = []
    for _ in range(2):
        assert backend.available("cuda:0") and backend.device_verdict(torch.device("cuda", 0))
        bad = backend.available(torch.device("cuda:1"))
        assert not bad and (bad.code, bad.reason) == ("self_test_failed", "failed on cuda:1")
    assert backend.available()  # the process-wide verdict: installed
    assert backend.checked == ["cuda:0", "cuda:1"]
