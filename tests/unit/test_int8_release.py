"""The int8 route against the comfy-kitchen release installed here, on the CPU (scripts/test_kitchen_releases.sh
runs this file against each verified release in turn), and the decision for a release outside the verified set.

- The release table and its gating: a verified release routes, another is self-checked with the newest verified
  form not newer than it, the reasons come back whole.
- The self-check's decision with a fake stock and a fake route or GEMM: equal bits let the route run, a bit
  mismatch, a decline or an exception keep stock's quantiser with the reason; decided once per device.
- Per release: the CUDA backend's private names exist with the arguments the route passes; stock's own CUDA
  ``int8_linear``, run on the CPU with a recording stand-in for its extension, takes the fused ConvRot quantiser
  the pack reproduces and the CUTLASS GEMM exactly for the rows the route takes, and calls that GEMM with the
  operands the route's ``gemm`` passes; comfy-kitchen's eager ConvRot is the rotation the pack's oracle applies.
  No reference with the CUDA kernel's arithmetic ships with comfy-kitchen (its eager and Triton quantisers
  rotate by a Hadamard matmul in the input dtype and divide exactly), so the quantiser's bits per release are the
  GPU tests' (tests/gpu/test_int8_release_gpu.py, tests/gpu/test_int8_activation_gpu.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from types import SimpleNamespace

import pytest
import torch

from devkit import int8_oracle
from devkit.interpreted import run_interpreted
from devkit.pack import submodule

route = submodule("kernels.int8_linear")
kitchen = submodule("kernels.kitchen")
gpu = submodule("kernels.gpu")
kernels = submodule("kernels")


@pytest.fixture(autouse=True)
def fresh_answers(monkeypatch):
    """Each test its own per-device answers (the self-check's decisions among them)."""
    monkeypatch.setattr(gpu, "ANSWERS", gpu.DeviceAnswers())


@pytest.fixture
def fresh_release(monkeypatch):
    """``installed(version)`` pretends comfy-kitchen ``version`` is installed (None: none is) with its CUDA
    extension loaded (where int8_linear looks it up); the caches are cleared after."""
    real_kitchen_cuda = kitchen.kitchen_cuda

    def installed(version):
        def fake_version(name):
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        monkeypatch.setattr(importlib.metadata, "version", fake_version)
        kitchen.installed_release.cache_clear()
        real_kitchen_cuda.cache_clear()
        if version is not None:  # the backend stands in loaded, whichever release is really installed
            for module in (route, kitchen):
                monkeypatch.setattr(module, "kitchen_cuda", lambda: (SimpleNamespace(), None))
    yield installed
    kitchen.installed_release.cache_clear()
    real_kitchen_cuda.cache_clear()


# --- the release table and its gating ----------------------------------------------------------------------------
def test_verified_releases_are_the_table():
    assert kitchen.KITCHEN_VERSIONS == ("0.2.31", "0.2.36", "0.2.40")
    assert kitchen.VERIFIED_VERSIONS == ("0.2.31", "0.2.40")  # 0.2.36: read from its code, not yet run on a GPU
    for version in kitchen.KITCHEN_VERSIONS:
        assert kitchen.release_for(version) == (kitchen.RELEASES[version], version in kitchen.VERIFIED_VERSIONS)
    # the two-row GEMV and the aligned out-dtype bias came together (0.2.36)
    assert [(r.min_rows, r.bias_in_out_dtype) for r in kitchen.RELEASES.values()] == [
        (2, False), (3, True), (3, True)]


@pytest.mark.parametrize("version,form", [("0.2.41", "0.2.40"), ("0.3.0.dev1", "0.2.40"), ("0.2.38", "0.2.36"),
                                          ("0.2.33", "0.2.31"), ("0.2.20", "0.2.31"), ("0.2.41rc1", "0.2.40")])
def test_another_release_takes_the_nearest_verified_form_unverified(version, form):
    assert kitchen.release_for(version) == (kitchen.RELEASES[form], False)


def test_not_installed_keeps_stocks_quantiser(fresh_release):
    fresh_release(None)
    assert route.kitchen_cuda() == kitchen.kitchen_cuda() == (None, "comfy-kitchen is not installed")
    assert kernels.kitchen_release_status() == {"release": None, "route": "stock",
                                                "reason": "comfy-kitchen is not installed"}


def test_a_verified_release_routes_without_a_self_check(fresh_release, monkeypatch):
    fresh_release("0.2.40")
    monkeypatch.setattr(route, "self_check", lambda *a: pytest.fail("a verified release was self-checked"))
    assert route.release_problem(torch.device("cuda", 0)) is None
    assert kernels.kitchen_release_status("cuda:0") == {"release": "0.2.40", "route": "verified", "reason": None}


def test_fewer_rows_than_the_release_gemm_takes_keep_stocks_call(fresh_release, monkeypatch):
    monkeypatch.setattr(route.int8_activation, "quantize_takes", lambda x, act=None: True)
    x = lambda rows: torch.zeros(rows, 512, dtype=torch.bfloat16)  # noqa: E731
    fresh_release("0.2.31")
    assert route.int8_rows_problem(x(1)) == (
        "1 row: comfy-kitchen 0.2.31 runs a GEMV for fewer than 2 rows, not its CUTLASS GEMM")
    assert route.int8_rows_problem(x(2)) is None
    assert route._call_shape_problem(x(1), None) is None  # the calls' form, not their row count
    fresh_release("0.2.40")
    assert route.int8_rows_problem(x(2)) == (
        "2 rows: comfy-kitchen 0.2.40 runs a GEMV for fewer than 3 rows, not its CUTLASS GEMM")
    assert route._call_shape_problem(x(2), "swiglu") is None
    assert route.int8_rows_problem(x(3)) is None


def test_cpu_calls_never_self_check(fresh_release, monkeypatch):
    fresh_release("9.9.9")
    monkeypatch.setattr(route, "self_check", lambda *a: pytest.fail("self-checked on the CPU"))
    assert route.int8_call_problem(torch.zeros(4, 512, dtype=torch.bfloat16)) == "not on a CUDA device"
    assert kernels.kitchen_release_status("cpu") == {
        "release": "9.9.9", "route": "stock", "reason": "no CUDA device to self-check the release on"}


# --- the self-check's decision -----------------------------------------------------------------------------------
TINY = (route.Sample(3, 256, 8), route.Sample(5, 256, 4, "swiglu"), route.Sample(3, 256, 8, bias=True))


def fake_stock(x, w, w_scale, bias, input_act=None):
    """A deterministic stand-in for stock's int8_linear: the oracle's quantiser and GEMM."""
    q, s = int8_oracle.quantize_rows_convrot(x, input_act)
    return int8_oracle.int8_linear(q, s, w, w_scale, bias, x.dtype)


def checking(monkeypatch, route_fn, stock_fn=fake_stock):
    """The self-check takes ``route_fn`` for the route and ``stock_fn`` for stock's call on the tiny samples; ->
    ``check()``, the check run now (``route.self_check`` on the CPU, with the fewest rows 3)."""
    monkeypatch.setattr(route, "samples", lambda min_rows: TINY)
    monkeypatch.setattr(route, "routed_or_reason", route_fn)
    monkeypatch.setattr(route, "stock_int8_linear", stock_fn)
    return lambda: route.self_check("cpu", 3)


def test_equal_bits_let_the_route_run_decided_once(fresh_release, monkeypatch):
    calls = []
    check = checking(monkeypatch, lambda *a, **k: (calls.append(1), fake_stock(*a, **k))[1])
    fresh_release("0.2.99")
    assert route.release_problem("cpu") is None and len(calls) == len(TINY)
    assert route.release_problem("cpu") is None and len(calls) == len(TINY)  # decided for the device
    assert check() is None and len(calls) == 2 * len(TINY)  # self_check: checked again


def test_a_bit_mismatch_keeps_stocks_quantiser_with_the_count(monkeypatch):
    def one_bit_off(x, w, w_scale, bias, input_act=None):
        out = fake_stock(x, w, w_scale, bias, input_act)
        if input_act == "swiglu":
            out.view(torch.int16)[0, 0] ^= 1  # the lowest bit of one output
        return out
    why = checking(monkeypatch, one_bit_off)()
    assert why == "1 of 20 outputs differ from stock's on 5 x 256 swiglu -> 4"


def test_an_exception_or_a_decline_keeps_stocks_quantiser_with_the_reason(monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("cutlass_int8_dequant(): incompatible function arguments")
    assert checking(monkeypatch, broken)() == (
        "TypeError on 3 x 256 -> 8: cutlass_int8_dequant(): incompatible function arguments")
    assert checking(monkeypatch, fake_stock, stock_fn=broken)().startswith("TypeError on 3 x 256")
    declines = checking(monkeypatch, lambda *a, **k: "CUTLASS declined the shape")
    assert declines() == "the route declined 3 x 256 -> 8: CUTLASS declined the shape"


def test_the_failed_check_is_the_calls_whole_reason(fresh_release, monkeypatch):
    fresh_release("0.2.99")
    checking(monkeypatch, lambda *a, **k: "CUTLASS declined the shape")
    why = route.release_problem(torch.device("cpu"))
    assert why == ("comfy-kitchen 0.2.99 is not a release the route was verified on (0.2.31, 0.2.40), and on "
                   "this device the route did not give stock's bits in its self-check: the route declined "
                   "3 x 256 -> 8: CUTLASS declined the shape")


def test_status_reports_each_devices_decision(fresh_release, monkeypatch):
    fresh_release("0.2.41")
    monkeypatch.setattr(route, "self_check", lambda *a: pytest.fail("a decided device was checked again"))
    gpu.ANSWERS.decide("kitchen_release", torch.device("cuda", 0), lambda: None)
    gpu.ANSWERS.fail("kitchen_release", torch.device("cuda", 1), "3 of 9 outputs differ")
    assert kernels.kitchen_release_status("cuda:0") == {"release": "0.2.41", "route": "self_checked", "reason": None}
    status = kernels.kitchen_release_status(torch.device("cuda", 1))
    assert status["route"] == "stock" and status["reason"].endswith("self-check: 3 of 9 outputs differ")


def test_samples_are_h3_widths_the_quantiser_takes_with_the_fewest_rows():
    for min_rows in (2, 3):
        got = route.samples(min_rows)
        assert {s.width for s in got} == {5376, 7168, 14336} and min(s.rows for s in got) == min_rows
        assert {s.input_act for s in got} == {None, "swiglu"} and any(s.bias for s in got)
        assert any(s.rows % 64 for s in got)  # rows off the GEMM's tiles


INTERPRETED = r"""
    from comfyui_sage_strided_nhd.kernels import int8_linear as route, kitchen, int8_activation
    from devkit import int8_oracle
    # the samples the runtime checks are ones the pack's quantiser takes
    takes = [int8_activation.quantize_takes(torch.empty(s.rows, s.width * (2 if s.input_act else 1),
             dtype=torch.bfloat16), s.input_act) for s in route.samples(route.installed_release()[1].min_rows)]
    gemm_calls = []

    def gemm(xq, xs, qdata, w_scale, bias, out_dtype, residual=None, *, kernel):
        gemm_calls.append(xq.shape[0])
        return int8_oracle.int8_linear(xq, xs, qdata, w_scale, bias, out_dtype)

    def stock(x, w, w_scale, bias, input_act=None):
        q, s = int8_oracle.quantize_rows_convrot(x, input_act)
        return int8_oracle.int8_linear(q, s, w, w_scale, bias, x.dtype)

    def nudged(x, w, w_scale, bias, input_act=None):
        out = stock(x, w, w_scale, bias, input_act)
        out.view(torch.int16)[-1, -1] ^= 1
        return out

    route.gemm = gemm  # the GEMM a CPU lacks; its caller (the quantiser and the call) is the route's own
    route.int8_weight_problem = lambda *a, **k: None  # the CPU's registry never picks comfy-kitchen's CUDA backend
    min_rows = route.installed_release()[1].min_rows
    route.samples = lambda rows: (route.Sample(rows, 256, 8), route.Sample(7, 1280, 16, "swiglu"),
                                  route.Sample(5, 512, 8, bias=True))
    route.stock_int8_linear = stock
    same = route.self_check("cpu", min_rows)
    route.stock_int8_linear = nudged
    differs = route.self_check("cpu", min_rows)
    route.stock_int8_linear = stock
    few = route.self_check("cpu", min_rows - 1)  # fewer rows than the GEMM takes
    report({"takes": takes, "same": same, "differs": differs, "few": few,
            "gemm_rows": gemm_calls[:3]})
"""


def test_the_routes_own_quantiser_passes_the_check_a_differing_stock_fails_it():
    """The real route (the pack's quantiser under the interpreter, its call into the GEMM, a CPU GEMM for
    CUTLASS) against a fake stock with the CUDA steps: the check passes; a stock one bit off fails it."""
    got = run_interpreted(INTERPRETED)
    min_rows = route.installed_release()[1].min_rows
    assert got["takes"] == [True] * 4
    assert got["same"] is None and got["gemm_rows"] == [min_rows, 7, 5]
    assert got["differs"] == f"1 of {8 * min_rows} outputs differ from stock's on {min_rows} x 256 -> 8"
    version = route.installed_release()[0]
    assert got["few"] == (f"the route declined {min_rows - 1} x 256 -> 8: {min_rows - 1} row{'s' * (min_rows > 2)}: "
                          f"comfy-kitchen {version} runs a GEMV for fewer than {min_rows} rows, not its CUTLASS GEMM")


# --- per release: the installed comfy-kitchen's CUDA backend as the route calls it -----------------------------------
@pytest.fixture(scope="module")
def cuda_backend():
    cuda, why = route.kitchen_cuda()
    assert cuda is not None, why  # its extension imports without a GPU
    return cuda


def test_private_names_exist_with_the_arguments_the_route_passes(cuda_backend):
    version, release, _ = route.installed_release()
    assert version in kitchen.KITCHEN_VERSIONS, f"comfy-kitchen {version} is not in {kitchen.KITCHEN_VERSIONS}"
    cpu, x = torch.device("cpu"), torch.zeros(4, 512, dtype=torch.bfloat16)
    calls = {"_convrot_fused_shared_memory_fits": (x, 512, 256), "_cuda_device_supports_cutlass_int8_dequant": (x,),
             "_cuda_device_is_turing": (0,), "_prefer_cublas_int8_fallback": (4, 8, 512, 0),
             "_int8_weight_scale_arg": (torch.ones(()), cpu), "_empty_cuda_tensor": (cpu, torch.bfloat16),
             "_wrap_for_dlpack": (x,)}
    if release.bias_in_out_dtype:
        calls[kitchen.BIAS_HELPER] = (torch.ones(8), cpu, torch.bfloat16)
    assert set(calls) | {"_DISABLE_CUTLASS_INT8"} == set(kitchen.CUDA_HELPERS) | (
        {kitchen.BIAS_HELPER} if release.bias_in_out_dtype else set())
    for name, args in calls.items():
        inspect.signature(getattr(cuda_backend, name)).bind(*args)  # raises TypeError where they moved
    assert isinstance(cuda_backend._DISABLE_CUTLASS_INT8, bool)
    doc = cuda_backend._C.cutlass_int8_dequant.__doc__.splitlines()[0]
    assert re.findall(r"(\w+): ", doc) == ["a", "b", "xs", "ws", "bias", "d", "out_dtype_code", "stream_ptr"], doc
    assert doc.endswith("-> bool")
    assert {dtype: cuda_backend.DTYPE_TO_CODE[dtype] for dtype in kitchen.DTYPE_CODES} == kitchen.DTYPE_CODES
    registry = importlib.import_module("comfy_kitchen").registry
    inspect.signature(registry.get_capable_backend).bind("int8_linear", {})


KITCHENS = submodule("kernels.int8_gemm").GemmChoice("comfy_kitchen", "the route's GEMM on a GPU without the pack's")


class RecordingExtension:
    """comfy-kitchen's ``_C`` for a CPU run of its CUDA ``int8_linear``: each call recorded, every GEMM taken."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args))
            return True
        return record


@pytest.fixture
def recording(cuda_backend, monkeypatch):
    """Stock's CUDA int8_linear and the route's gemm runnable on the CPU: the extension recorded, the device
    queries answered as on an sm90 GPU, DLPack capsules left as the tensors."""
    ext = RecordingExtension()
    monkeypatch.setattr(cuda_backend, "_C", ext)
    monkeypatch.setattr(cuda_backend, "_wrap_for_dlpack", lambda t: t)
    monkeypatch.setattr(cuda_backend, "_cuda_device_supports_cutlass_int8_dequant", lambda t: True)
    monkeypatch.setattr(cuda_backend, "_cuda_device_should_use_turing_kernels", lambda i: False)
    monkeypatch.setattr(cuda_backend, "_cuda_device_is_turing", lambda i: False)
    if hasattr(cuda_backend, "_max_dynamic_shared_memory_per_block"):
        monkeypatch.setattr(cuda_backend, "_max_dynamic_shared_memory_per_block", lambda t: 227 * 1024)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=1234))
    return ext


def operands_equal(a, b, values: bool = True) -> bool:
    """The same operand: a tensor of the same dtype and shape and (``values``) contents, or an equal value."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and (not values or a.numel() == 0 or a.data_ptr() == b.data_ptr() or torch.equal(a, b)))
    return a == b


def describe(operand) -> str:
    if isinstance(operand, torch.Tensor):
        return f"{operand.dtype} {tuple(operand.shape)} {operand.flatten()[:4].tolist()}"
    return repr(operand)


@pytest.mark.parametrize("act", [None, "swiglu"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_stock_takes_the_fused_quantiser_and_cutlass_exactly_for_the_routes_rows(recording, cuda_backend, act,
                                                                                with_bias, gen):
    release = route.installed_release()[1]
    k, n = 512, 24
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    w_scale = torch.tensor(3e-3)
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    for rows in (1, 2, 3, 5, 130):
        recording.calls.clear()
        x = torch.randn(rows, k * (2 if act else 1), generator=gen).bfloat16()
        cuda_backend.int8_linear(x, w, w_scale, bias, torch.bfloat16, convrot=True, convrot_groupsize=256,
                                 input_act=act)
        names = [name for name, _ in recording.calls]
        assert ("cutlass_int8_dequant" in names) == (rows >= release.min_rows), (rows, names)
        if rows < release.min_rows:
            continue
        assert names == ["quantize_int8_rowwise_convrot64", "cutlass_int8_dequant"], names
        quantise = recording.calls[0][1]
        assert quantise[0] is x and quantise[3:6] == (256, False, 2 if act == "swiglu" else 0)  # group, stochastic, act
        stock_gemm = recording.calls[1][1]
        recording.calls.clear()
        route.gemm(quantise[1], quantise[2], w, w_scale, bias, torch.bfloat16, kernel=KITCHENS)
        [(name, routed)] = recording.calls
        assert name == "cutlass_int8_dequant" and len(routed) == len(stock_gemm)
        for i, (mine, theirs) in enumerate(zip(routed, stock_gemm)):  # operand 5: the output, not yet written
            assert operands_equal(mine, theirs, values=i != 5), (
                f"GEMM operand {i} differs at {rows} rows: the route's {describe(mine)}, stock's {describe(theirs)}")


# --- per release: comfy-kitchen's own definitions of the ConvRot quantiser -------------------------------------------
def test_oracle_rotation_is_comfy_kitchens_hadamard(gen):
    """The staged butterflies are comfy-kitchen's ConvRot rotation (its eager backend: a product with
    the normalised 256 x 256 Hadamard matrix), up to fp32 rounding."""
    eager = importlib.import_module("comfy_kitchen.backends.eager")
    x = torch.randn(6, 1024, generator=gen, dtype=torch.float64).float()
    want = eager.rotate_int8_convrot_weight(x.double(), 256)
    assert torch.allclose(int8_oracle.convrot(x).double(), want, atol=1e-5, rtol=1e-5)


def test_oracle_quantiser_is_within_one_step_of_comfy_kitchens_eager_one(gen):
    """comfy-kitchen's eager quantiser (a Hadamard product in bf16, IEEE division, no fast math) lands within one
    int8 step of the CUDA steps, with scales equal to bf16 rounding."""
    eager = importlib.import_module("comfy_kitchen.backends.eager")
    from comfy_kitchen.tensor.int8_utils import _build_hadamard
    x = (2 * torch.randn(8, 512, generator=gen)).bfloat16()
    h = _build_hadamard(256, device=x.device, dtype=x.dtype)
    q_e, s_e = eager.quantize_and_rotate_rowwise(x, h, 256)
    q_o, s_o = int8_oracle.quantize_rows_convrot(x)
    assert (q_e.int() - q_o.int()).abs().max() <= 1
    assert torch.allclose(s_e.float().reshape(-1), s_o.reshape(-1), rtol=1e-2)
