"""The pack's int8 ConvRot activation quantiser against comfy-kitchen's CUDA kernel, which stock's int8
linears run: the same int8 values and fp32 scales on H3's inputs (qkv and fc1: 5,376 wide, out: 7,168,
fc2: the SwiGLU of a 28,672-wide fc1 output) at 8,192 and 37,810 rows, with rows of 64-bit offsets (a SwiGLU
input past 2**31 elements), and the whole route (quantiser + comfy-kitchen's GEMM) against stock's
``int8_linear``, bit for bit. On a mismatch the message says whether the differences follow the
division or the exponential (the two fast-math instructions). Times are printed beside comfy-kitchen's,
not asserted. Needs CUDA and comfy-kitchen with its CUDA extension
(tests/gpu/test_int8_release_gpu.py checks the release)."""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, INNER, FFN = 5376, 7168, 14336  # H3's hidden size, heads x head_dim, MLP width


@pytest.fixture(scope="module")
def pack(kitchen_pack):
    importlib.import_module(kitchen_pack.__name__ + ".kernels.int8_linear")
    cuda, why = kitchen_pack.kernels.int8_linear.kitchen_cuda()
    if cuda is None:
        pytest.skip(why)
    return kitchen_pack


def rows(m, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (2 * torch.randn(m, k, generator=g, device="cuda")).bfloat16()
    x[0] = 0
    x[1, :4] = torch.tensor([3e4, -3e4, 1e-4, 7.0], device="cuda").bfloat16()  # an outlier row
    return x


def kitchen_quantize(x, act):
    from comfy_kitchen.backends import cuda

    return cuda.quantize_int8_rowwise_convrot64(x, 256, 0, act)


@pytest.mark.parametrize("m,width,act", [(8192, HIDDEN, None), (37810, HIDDEN, None), (37810, INNER, None),
                                         (8192, 2 * FFN, "swiglu"), (37810, 2 * FFN, "swiglu")])
def test_quantiser_gives_comfy_kitchens_cuda_bits(pack, m, width, act):
    ia = pack.kernels.int8_activation
    x = rows(m, width, seed=m + width)
    q, s = ia.quantize_rows(x, act)
    want_q, want_s = kitchen_quantize(x, act)
    torch.cuda.synchronize()
    bad_q, bad_s = int((q != want_q).sum()), int((s != want_s).sum())
    assert (bad_q, bad_s) == (0, 0), (
        f"{bad_q} int8 values and {bad_s} scales differ; largest value difference "
        f"{int((q.int() - want_q.int()).abs().max())}, rows with a scale difference {int((s != want_s).sum())}")


def test_quantiser_past_int32_offsets(pack):
    """A SwiGLU input of 75,000 x 28,672 (2.15e9 elements): its last rows read past 2**31."""
    ia = pack.kernels.int8_activation
    m = 75_000
    x = torch.empty(m, 2 * FFN, dtype=torch.bfloat16, device="cuda")
    x.normal_(generator=torch.Generator(device="cuda").manual_seed(5))
    q, s = ia.quantize_rows(x[-64:].contiguous(), "swiglu")  # the tail alone: small offsets
    q_all, s_all = ia.quantize_rows(x, "swiglu")
    assert torch.equal(q_all[-64:], q) and torch.equal(s_all[-64:], s)


@pytest.mark.parametrize("m,n,k,act", [(8192, 3 * INNER, HIDDEN, None), (37810, HIDDEN, INNER, None),
                                       (8192, HIDDEN, FFN, "swiglu")])
def test_route_gives_stocks_int8_linear_bits(pack, m, n, k, act):
    import comfy_kitchen as ck

    route = pack.kernels.int8_linear
    g = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    w_scale = torch.tensor(3e-3, device="cuda")
    x = rows(m, k * (2 if act else 1), seed=k)
    got = route.routed_or_reason(x, w, w_scale, None, input_act=act)
    want = ck.int8_linear(x, w, w_scale, None, torch.bfloat16, convrot=True, convrot_groupsize=256, input_act=act)
    assert not isinstance(got, str), got
    assert torch.equal(got, want)
