"""Every Triton kernel the runtime launches compiles ahead of time, without a GPU, for each architecture users run
(devkit/triton_aot.py: sm80, sm89, sm90, sm100, sm120, sm121, down to a cubin), wherever the runtime launches it;
and the list it compiles (devkit/triton_targets.py) is the runtime's: the kernels its source launches, and the
specialisations a small interpreted run of each pass at H3's geometry launches, as a GPU would launch them.

The builds (marked ``aot``, about two minutes on two cores) are CI's own step: scripts/test.sh leaves them out and
.ci/run runs them after it (``pytest tests/unit/test_triton_aot.py -m aot``); the declaration checks run in both."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from devkit import triton_targets
from devkit.interpreted import run_interpreted
from devkit.pack import REPO_ROOT

try:
    import triton  # noqa: F401  (torch's Linux wheels bring it: CI must have it)
    TRITON_MISSING = None
except Exception as exc:  # pragma: no cover - depends on the install
    TRITON_MISSING = f"triton not importable ({type(exc).__name__}: {exc})"


@pytest.fixture(autouse=True)
def _needs_triton():
    if TRITON_MISSING:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must compile the Triton kernels: {TRITON_MISSING}")
        pytest.skip(TRITON_MISSING)


# Each pass at H3's widths, head_dim and rope prefix (FULL_H3), with few rows: no constexpr depends on the row count.
INTERPRETED = r"""
    from comfyui_sage_strided_nhd.kernels import h3_block, int8_activation, int8_gemm, qk_transform, sage2_quant
    from devkit import triton_targets
    from devkit.h3 import FULL_H3
    from devkit.rope import make_rope_table

    hidden, ffn, heads, d = (FULL_H3[k] for k in ("hidden_size", "ffn_hidden_size", "num_attention_heads",
                                                  "attention_head_dim"))
    g = torch.Generator().manual_seed(0)
    bf16 = lambda *shape: torch.randn(*shape, generator=g).bfloat16()
    with triton_targets.recorded_launches() as launches:
        for width, act in ((hidden, None), (heads * d, None), (2 * ffn, "swiglu")):
            int8_activation.quantize_rows(bf16(2, width), act)
        for params in ((hidden,), (2, hidden)):
            int8_activation.quantize_rows(bf16(2, hidden), modulation=[(0, 2, bf16(*params), bf16(*params))])
            h3_block.scale_shift_(bf16(2, hidden), bf16(*params), bf16(*params))
            h3_block.gated_residual_(bf16(2, hidden), bf16(2, hidden), bf16(*params))
        h3_block.swiglu(bf16(2, 2 * ffn))
        kernel = int8_gemm.choice("cpu", 64, 48)
        for bias in (None, bf16(48)):  # the route's GEMM: tensor-wise scale, with and without a bias
            xq, w = torch.ones(3, 64, dtype=torch.int8), torch.ones(48, 64, dtype=torch.int8)
            int8_gemm.int8_gemm(xq, torch.ones(3, 1), w, torch.tensor(1e-3), bias, kernel=kernel)
        int8_gemm.int8_gemm(xq, torch.ones(3, 1), w, torch.tensor(1e-3), residual=bf16(3, 48), gate=bf16(48),
                            kernel=kernel)
        rot = triton_targets.ROPE_AXES * 2 * FULL_H3["rope_inv_freq_len"]
        for table_dtype in (torch.bfloat16, torch.float32):
            qkv = bf16(1, 16, 3, 2, d)  # 16 tokens, 2 heads: strided views of one fused buffer
            qk_transform.norm_rope_pass(qkv[:, :, 0], qkv[:, :, 1], make_rope_table(16, rot, table_dtype),
                                        bf16(d), bf16(d), 1e-5)
        q, k, v = bf16(1, 256, 3, 1, d).unbind(2)
        for mode in sage2_quant.MODES:
            sage2_quant.quantize_operands(q, k, v, mode=mode)
            rows = sage2_quant.RowOperands(256, 1, q.device, mode=mode)
            rows.add_q_rows(q[:, :128])
            rows.add_q_rows(q[:, 128:])
            rows.add_k(k)
            rows.add_v(v)
    report([[l.module, l.kernel, [list(a) for a in l.signature], [list(c) for c in l.constexprs], l.num_warps]
            for l in launches])
"""


@pytest.fixture(scope="module")
def interpreted_launches():
    return [triton_targets.Launch(m, k, tuple(map(tuple, sig)), tuple(map(tuple, consts)), warps)
            for m, k, sig, consts, warps in run_interpreted(INTERPRETED)]


def _keys(launches) -> set:
    return {launch.key for launch in launches}


def test_declared_kernels_are_the_ones_the_runtime_source_launches():
    declared = {(launch.module, launch.kernel) for launch in triton_targets.declared(triton_targets.ARCHS[0])}
    sites = triton_targets.launch_sites()
    assert sites, "no launch site found: the scan of kernels/ and nodes/ is broken"
    assert declared == sites, (f"launched but not declared: {sorted(sites - declared)}; "
                               f"declared but never launched: {sorted(declared - sites)}")


@pytest.mark.parametrize("arch", triton_targets.ARCHS)
def test_declared_specialisations_are_the_ones_the_passes_launch(interpreted_launches, arch):
    """The interpreted run's launches, with each interpreter-only flag at its GPU value, are the declared ones."""
    launched = _keys(triton_targets.on_gpu(launch, arch) for launch in interpreted_launches)
    declared = _keys(triton_targets.declared(arch))
    assert launched == declared, (f"launched, not declared: {sorted(launched - declared)}\n"
                                  f"declared, not launched: {sorted(declared - launched)}")


def test_every_declaration_names_each_kernel_parameter_once_and_itself_uniquely():
    kernels = triton_targets.jit_kernels()
    launches = triton_targets.declared(triton_targets.ARCHS[0])
    for launch in launches:
        fn = kernels[launch.module, launch.kernel]
        assert list(triton_targets.full_signature(fn, launch)) == fn.arg_names
    names = [launch.name for launch in launches]
    assert len(set(names)) == len(names), f"two declared launches share a name: {names}"


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    """``python -m devkit.triton_aot`` for every architecture, as CI runs it: (its output, its results)."""
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "devkit.triton_aot", "--json", str(out)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the AOT tool failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    print(proc.stdout)
    return proc.stdout, json.loads(out.read_text())["results"]


@pytest.mark.aot
def test_aot_builds_every_declared_launch_for_every_architecture(aot):
    stdout, results = aot
    want = {(launch.name, arch) for arch in triton_targets.ARCHS for launch in triton_targets.declared(arch)}
    assert {(r["name"], r["arch"]) for r in results} == want
    for arch in triton_targets.ARCHS:
        assert f"sm{arch}" in stdout.splitlines()[1], "the table has a column per architecture"


@pytest.mark.aot
def test_every_kernel_builds_wherever_the_runtime_launches_it(aot):
    stdout, results = aot
    broken = [f"{r['name']} on sm{r['arch']}: {r['error']}" for r in results if r["launched"] and not r["ok"]]
    assert not broken, ("kernels the runtime launches that do not build (fix them, or gate them there with a "
                        "reason):\n  " + "\n  ".join(broken) + f"\n\n{stdout}")


@pytest.mark.aot
def test_no_build_gate_is_stale(aot):
    stdout, results = aot
    stale = [f"{r['name']} on sm{r['arch']}: gated ({r['gate']}) but builds" for r in results
             if r["build_gate"] and r["ok"]]
    assert not stale, "\n  ".join(["build gates on kernels that now build (lift them):", *stale]) + f"\n\n{stdout}"
