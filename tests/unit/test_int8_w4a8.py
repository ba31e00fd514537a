"""W4A8 linears on the int8 route (kernels/int8_w4a8.py), on the CPU, with real ``AsymW4A8Int8Layout`` weights made by
comfy-kitchen's own quantize (0.2.40 has the layout; scripts/test_kitchen_releases.sh runs this file against it).

- The operands: comfy-kitchen's decode of the codes to its int8 grid, with ``s_channel``, are the layout's weight: its
  public dequantize is their product, ConvRot-rotated, bit for bit.
- The linear: comfy-kitchen's ``w4a8_int8_linear`` is that decode then its int8 ConvRot linear. With that int8 linear
  taken as its CUDA steps (devkit/int8_oracle.py, as the int8 tests take stock's), the pack's quantiser (interpreted)
  and its call into the GEMM give comfy-kitchen's W4A8 output bit for bit, with a bias, for each form the route takes.
- Stock's dispatch, run on the CPU with a recording extension: the rows and forms where comfy-kitchen's CUDA build
  quantises with the convrot64 kernel the pack mirrors are the ones the route takes; every other form is declined
  with its reason. Whether its chunked GEMM gives the pack's GEMM bits is the device's first-use check (a GPU's).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from types import SimpleNamespace

import pytest
import torch

from devkit.interpreted import run_interpreted
from devkit.pack import submodule

w4a8 = submodule("kernels.int8_w4a8")
RELEASE = importlib.metadata.version("comfy-kitchen")
ckt = pytest.importorskip("comfy_kitchen.tensor")
if not hasattr(ckt, "AsymW4A8Int8Layout"):
    pytest.skip(f"comfy-kitchen {RELEASE} has no AsymW4A8Int8Layout (0.2.40 has): not covered on this release "
                "(a skip, not a pass)", allow_module_level=True)
# the route declines a release it does not mirror (test_another_release_is_declined); the rest is that release's
mirrored = pytest.mark.skipif(RELEASE not in w4a8.READ_RELEASES, reason=(
    f"comfy-kitchen {RELEASE} is not a release the W4A8 route mirrors ({', '.join(w4a8.READ_RELEASES)}): its checks "
    "run against those (scripts/test_kitchen_releases.sh); a skip, not a pass"))

N, K = 64, 512  # K: a multiple of the group (16) and of the ConvRot group (256)
FORMS = {"codebook": {}, "uniform4": {"codebook": False}, "six_bit": {"bits": 6}}  # the forms the route takes
DECLINED = {"asymmetric": ({"symmetric": False, "codebook": False}, "an asymmetric W4A8 weight"),
            "fp32_scales": ({"scale_dtype": torch.float32}, "torch.float32 W4A8 group scales"),
            "group_32": ({"group_size": 32}, "W4A8 groups of 32 with ConvRot groups of 256")}


def made(seed: int = 0, **options):
    """A W4A8 QuantizedTensor of comfy-kitchen's own quantize."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)).bfloat16()
    qdata, params = ckt.AsymW4A8Int8Layout.quantize(w, **options)
    return ckt.QuantizedTensor(qdata, "AsymW4A8Int8Layout", params)


@mirrored
@pytest.mark.parametrize("form", FORMS)
def test_operands_are_the_layouts_weight(form):
    eager = importlib.import_module("comfy_kitchen.backends.eager")
    weight = made(**FORMS[form])
    int8_weight, s_channel = w4a8.operands(weight)
    assert int8_weight.dtype == torch.int8 and int8_weight.shape == (N, K) and s_channel.shape == (N,)
    p = weight._params
    want = ckt.dequantize_w4a8_int8_weight(weight._qdata, p.scale, p.s_channel, p.codebook, group_size=p.group_size)
    scaled = (int8_weight.float() * s_channel.float()[:, None]).bfloat16()
    assert torch.equal(eager.rotate_int8_convrot_weight(scaled, 256).bfloat16(), want)


INTERPRETED = r"""
    import comfy_kitchen.tensor as ckt
    from comfy_kitchen.backends.eager import w4a8_int8 as eager_w4a8
    from comfyui_sage_strided_nhd.kernels import int8_linear as route, int8_w4a8 as w4a8
    from devkit import int8_oracle
    route.gemm = int8_oracle.declining_gemm(set())  # the GEMM a CPU lacks: the CUDA epilogue's steps
    eager_w4a8.int8_linear = int8_oracle.cuda_int8_linear  # stock's int8 linear as its CUDA steps
    out = {}
    for seed, (name, options) in enumerate(FORMS):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(64, 512, generator=g).bfloat16()
        x, bias = (2 * torch.randn(37, 512, generator=g)).bfloat16(), torch.randn(64, generator=g).bfloat16()
        qdata, params = ckt.AsymW4A8Int8Layout.quantize(w, **options)
        weight = ckt.QuantizedTensor(qdata, "AsymW4A8Int8Layout", params)
        want = eager_w4a8.w4a8_int8_linear(x, qdata, params.scale, params.s_channel, params.codebook, bias=bias,
                                           group_size=params.group_size, out_dtype=x.dtype)
        got = route.int8_linear_routed(x, *w4a8.operands(weight), bias, kernel=route.choice(x.device, 512, 64))
        out[name] = [int((got.view(torch.int16) != want.view(torch.int16)).sum()), want.numel()]
    report(out)
"""


@mirrored
def test_the_pack_gives_comfy_kitchens_w4a8_output_bit_for_bit():
    got = run_interpreted(INTERPRETED.replace("FORMS", repr(list(FORMS.items()))))
    assert list(got) == list(FORMS)
    for form, (differ, total) in got.items():
        assert differ == 0 and total == 37 * N, f"{form}: {differ} of {total} outputs differ from comfy-kitchen's"


# --- the forms and rows the route takes ------------------------------------------------------------------------------
@mirrored
def test_each_declined_form_says_why():
    x = torch.zeros(600, K, dtype=torch.bfloat16)
    for name, (options, reason) in DECLINED.items():
        assert w4a8.weight_problem(x, made(**options), None).startswith(reason), name
    weight = made()
    packed = SimpleNamespace(_qdata=weight._qdata, _params=SimpleNamespace(
        **{f.name: getattr(weight._params, f.name) for f in dataclasses.fields(weight._params)} | {"mma_packed": True}))
    assert "packed for comfy-kitchen's GEMV kernels" in w4a8.weight_problem(x, packed, None)
    assert w4a8.weight_problem(x[:, :256], weight, None) == (
        "a W4A8 weight for 512-wide torch.bfloat16 rows called on torch.bfloat16 (600, 256)")
    for form, options in FORMS.items():  # past the form's checks: the CPU's registry picks no CUDA backend
        assert w4a8.weight_problem(x, made(**options), None) == (
            "comfy-kitchen would not run its CUDA w4a8_int8_linear for this call"), form


def test_another_release_is_declined(monkeypatch):
    monkeypatch.setattr(w4a8, "installed_release", lambda: ("0.2.41", None, False))
    assert w4a8.weight_problem(torch.zeros(600, K, dtype=torch.bfloat16), made(), None) == (
        "comfy-kitchen 0.2.41's W4A8 linear is not one the route mirrors (0.2.40)")


@mirrored
def test_fewer_rows_than_the_convrot64_kernel_takes_keep_stocks_call():
    assert w4a8.rows_problem(torch.zeros(512, K, dtype=torch.bfloat16)) is None
    assert w4a8.rows_problem(torch.zeros(511, K, dtype=torch.bfloat16)) == (
        f"511 rows: comfy-kitchen {RELEASE} runs its fused W4A8 kernels for fewer than 512 rows, with a quantiser "
        "of its own")


class RecordingExtension:
    """comfy-kitchen's ``_C`` for a CPU run of its CUDA ``w4a8_int8_linear``: each call's name recorded, all taken."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: (self.calls.append(name), True)[1]


@mirrored
@pytest.mark.parametrize("form", ["codebook", "six_bit", "fp32_scales"])
def test_stock_quantises_with_convrot64_exactly_for_the_rows_and_forms_the_route_takes(monkeypatch, form):
    cuda = importlib.import_module("comfy_kitchen.backends.cuda")
    ext = RecordingExtension()
    monkeypatch.setattr(cuda, "_C", ext)
    monkeypatch.setattr(cuda, "_wrap_for_dlpack", lambda t: t)
    monkeypatch.setattr(cuda, "_cuda_device_l2_bytes", lambda index: 50 << 20, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=1))
    routed = form in FORMS
    weight = made(**(FORMS[form] if routed else DECLINED[form][0]))
    p = weight._params
    for rows in (8, 100, 511, 512, 700):
        ext.calls.clear()
        x = torch.randn(rows, K).bfloat16()
        cuda.w4a8_int8_linear(x, weight._qdata, p.scale, p.s_channel, p.codebook, bias=torch.ones(N).bfloat16(),
                              group_size=p.group_size, out_dtype=torch.bfloat16)
        convrot64 = ext.calls[:1] == ["quantize_int8_rowwise_convrot64"]
        assert convrot64 == (routed and rows >= w4a8.MIN_ROWS), (form, rows, ext.calls)
        if convrot64:
            assert ext.calls == ["quantize_int8_rowwise_convrot64", "w4a8_codebook_gemm_chunked"]
