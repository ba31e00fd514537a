"""The block fast path's fused passes (kernels/h3_block_fused.py) run by their Triton kernels on the
CPU under ``TRITON_INTERPRET=1`` (a subprocess: the flag must be set before the kernels are
decorated); the norm + modulation pass in both its tilings (one row a program, two sweeps over rows). Each result must be its fp32 definition rounded once: within one bf16/fp16 step of the
float64 value, on row blocks that are views of a larger tensor (one modulation segment), with and
without the norm weight; the residual stream written in place keeps stock's ``addcmul_`` values."""

from __future__ import annotations

import pytest

from devkit.interpreted import run_interpreted

INTERPRETED = r"""
    import itertools
    from comfyui_sage_strided_nhd.kernels import h3_block_fused as f
    g = torch.Generator().manual_seed(0)

    def steps(got, ref, size):
        # max |got - ref| over what one rounding allows: half the output dtype's step at |ref|, plus
        # fp32 arithmetic's error on terms of `size` (a sum that cancels has a small step)
        fi = torch.finfo(got.dtype)
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(fi.smallest_normal)))) * fi.eps
        return ((got.double() - ref).abs() / (ulp / 2 + 2.0 ** -20 * size)).max().item()

    def norm_ref(x, w, scale, shift):
        y = torch.nn.functional.rms_norm(x.double(), x.shape[-1:], w, 1e-6) * (1 + scale.double())
        return y + shift.double(), y.abs() + shift.double().abs()

    out = {}
    # the one-row kernel (rows in up to three power-of-two pieces: 1030 = 1024 + 4 + 2, padded; 5120 = 4096 +
    # 1024; H3's 5376 = 4096 + 1024 + 256), then the two-sweep one (4 rows a program, 256 columns a sweep)
    for tiling, dtype in itertools.product((None, (4, 256, 4)), (torch.bfloat16, torch.float16)):
        f.NORM_MODULATE_TILING = tiling
        for rows, cols, weighted in ((5, 1030, True), (3, 5120, False), (1, 64, True), (2, 5376, True)):
            full = (torch.randn(rows + 4, cols, generator=g) * 3).to(dtype)
            other = torch.randn(rows, cols, generator=g).to(dtype)
            w = torch.randn(cols, generator=g).to(dtype) if weighted else None
            scale, shift, gate = (torch.randn(cols, generator=g).to(dtype) for _ in range(3))
            x = full[2:2 + rows]
            assert f._kernel_takes(x)
            h = torch.empty(rows + 4, cols, dtype=dtype)[1:1 + rows]
            f.norm_modulate(x, w, scale, shift, 1e-6, h)
            wd = w.double() if weighted else None
            key = f"{tiling}-{dtype}-{rows}x{cols}-{'w' if weighted else 'now'}"
            out[key + "-norm_modulate"] = steps(h, *norm_ref(x, wd, scale, shift))
            want_x = x.clone().addcmul_(other, gate)
            xr = x.clone()
            f.residual_norm_modulate_(xr, other, gate, w, scale, shift, 1e-6, h)
            out[key + "-residual_norm_modulate"] = steps(h, *norm_ref(xr, wd, scale, shift))
            out[key + "-residual_changed_values"] = int((xr != want_x).sum())
            # one modulation row per token (current ComfyUI under a partial denoise mask)
            scale, shift, gate = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(3))
            want_x = x.clone().addcmul_(other, gate)
            xr = x.clone()
            f.residual_norm_modulate_(xr, other, gate, w, scale, shift, 1e-6, h)
            out[key + "-per-token-residual_norm_modulate"] = steps(h, *norm_ref(xr, wd, scale, shift))
            out[key + "-per-token-residual_changed_values"] = int((xr != want_x).sum())
    for dtype in (torch.bfloat16, torch.float16):
        u = (torch.randn(7, 2 * 1500, generator=g) * 3).to(dtype)
        want = torch.nn.functional.silu(u[:, :1500].double()) * u[:, 1500:].double()
        out[f"{dtype}-swiglu"] = steps(f.swiglu(u), want, want.abs())
    report(out)
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(INTERPRETED)


def test_fused_passes_round_once(interpreted):
    rounded = {k: v for k, v in interpreted.items() if not k.endswith("changed_values")}
    assert len(rounded) == 50
    assert all(v <= 1.0 for v in rounded.values()), rounded


def test_fused_residual_keeps_stocks_values(interpreted):
    changed = {k: v for k, v in interpreted.items() if k.endswith("changed_values")}
    assert len(changed) == 32 and all(v == 0 for v in changed.values()), changed
