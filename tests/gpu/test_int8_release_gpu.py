"""The int8 route against the comfy-kitchen release installed here, on the GPU: the release self-check (run even
for a verified release) passes and its time is printed; the route equals stock's ``int8_linear`` bit for bit at
H3's widths (qkv 5,376 -> 21,504, out 7,168 -> 5,376, fc2 the SwiGLU of 28,672 -> 5,376) at a few hundred rows,
at 8,192 and at the fewest rows the release's CUTLASS GEMM takes; a biased call (the GEMM's bias operand differs
between releases) too; fewer rows keep stock's call. Run it once per release (scripts/test_kitchen_releases.sh
installs them; PYTHONPATH its folder in front)."""

from __future__ import annotations

import importlib
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, INNER, FFN = 5376, 7168, 14336  # H3's hidden size, heads x head_dim, MLP width
H3_LINEARS = {"qkv": (HIDDEN, 3 * INNER, None), "out": (INNER, HIDDEN, None), "fc2": (FFN, HIDDEN, "swiglu")}


@pytest.fixture(scope="module")
def route(kitchen_pack):
    module = importlib.import_module(kitchen_pack.__name__ + ".kernels.int8_linear")
    cuda, why = module.kitchen_cuda()
    if cuda is None:
        pytest.skip(why)
    return module


def inputs(m, k, n, act, seed, bias=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (2 * torch.randn(m, k * (2 if act else 1), generator=g, device="cuda")).bfloat16()
    x[0] = 0
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    b = torch.randn(n, generator=g, device="cuda").bfloat16() if bias else None
    return x, w, torch.tensor(3e-3, device="cuda"), b


def stock(x, w, w_scale, bias, act):
    import comfy_kitchen as ck

    return ck.int8_linear(x, w, w_scale, bias, torch.bfloat16, convrot=True, convrot_groupsize=256, input_act=act)


def test_release_self_check_passes_and_its_time(route):
    kitchen = importlib.import_module(route.__name__.rsplit(".", 1)[0] + ".kitchen")
    version, release, verified = kitchen.installed_release()
    seconds, problems = [], []
    for _ in range(2):
        start = time.perf_counter()
        problems.append(route.self_check("cuda", release.min_rows))
        seconds.append(time.perf_counter() - start)
    print(f"\n[Sage Strided NHD] comfy-kitchen {version} ({'verified' if verified else 'not verified'}) on "
          f"{torch.cuda.get_device_name()}: self-check {seconds[0] * 1e3:.0f} ms in a fresh process "
          f"(Triton compiles included), {seconds[1] * 1e3:.1f} ms again")
    assert problems == [None, None], problems
    status = route.kitchen_release_status()
    assert status == {"release": version, "route": "verified" if verified else "self_checked", "reason": None}


@pytest.mark.parametrize("rows", [300, 8192])
@pytest.mark.parametrize("linear", list(H3_LINEARS))
def test_route_gives_stocks_bits_at_h3_widths(route, linear, rows):
    k, n, act = H3_LINEARS[linear]
    x, w, w_scale, _ = inputs(rows, k, n, act, seed=rows + k)
    got, want = route.routed_or_reason(x, w, w_scale, None, input_act=act), stock(x, w, w_scale, None, act)
    assert not isinstance(got, str), got
    assert torch.equal(got, want), f"{int((got != want).sum())} of {want.numel()} outputs differ"


def test_route_at_the_fewest_rows_and_with_a_bias(route):
    release = route.installed_release()[1]
    for rows, bias in ((release.min_rows, False), (release.min_rows, True), (300, True)):
        x, w, w_scale, b = inputs(rows, HIDDEN, 1024, None, seed=rows, bias=bias)
        got, want = route.routed_or_reason(x, w, w_scale, b), stock(x, w, w_scale, b, None)
        assert not isinstance(got, str), got
        assert torch.equal(got, want), f"{rows} rows, bias {bias}: {int((got != want).sum())} outputs differ"
    x, w, w_scale, _ = inputs(release.min_rows - 1, HIDDEN, 1024, None, seed=1)
    assert "runs a GEMV" in route.routed_or_reason(x, w, w_scale, None)
