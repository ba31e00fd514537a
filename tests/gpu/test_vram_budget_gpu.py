"""One budgeted run of the VRAM-budget benchmark (benchmarks/vram_budget.py) on the GPU: sixteen full-width H3 blocks
in the bundled checkpoint's int8 ConvRot format (15 GiB), written as a file and loaded as ComfyUI loads one, sampled at
37,810 tokens on a card cut down to 12 GiB (the GPU tests' own process is given its share besides), so ComfyUI
must stream weights every step. The full 50-block model's cell of that card and length is where stock completes in
the benchmark; on 4 GiB cards with fewer tokens stock ran out of memory (ComfyUI keeps weights resident by stock's
estimate).

Checked on the cell's JSON: the ballast left the budget, stock and the pack both complete, the pack's latents are
stock's bits, weights were copied to the card at every timed step, the pack's peak is below stock's, and the profiled
last step says where its time went.
Loader: DynamicVRAM where comfy-aimdo 0.5+ is installed (ComfyUI's default; the benchmark drives its
``malloc_graph``), else the legacy ModelPatcher.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BUDGET_GIB, TOKENS, BLOCKS = 12, 37810, 16

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def bench(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    from devkit.comfy import find_host

    host = find_host()
    if host is None:
        pytest.skip("needs a ComfyUI host (COMFYUI_PATH)")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, "-m", "benchmarks.vram_budget", "--comfyui", str(host), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def dynamic_vram_loader_available() -> bool:
    """Whether the installed comfy-aimdo has ``malloc_graph`` (0.5+), which the benchmark's DynamicVRAM loader drives."""
    try:
        return importlib.util.find_spec("comfy_aimdo.malloc_graph") is not None
    except ModuleNotFoundError:  # no comfy-aimdo at all
        return False


def budget_beside_this_process() -> float:
    """The budget to ask for, in GiB: ``BUDGET_GIB`` plus what this test process (and any other) holds on the card,
    so that the cell sees what a ``BUDGET_GIB`` card alone would give it (the ballast takes the card's total less
    the budget, and the other GPU tests' process keeps its context and whatever it cannot free)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return round(BUDGET_GIB + (total - free) / 2**30, 3)


@pytest.fixture(scope="module")
def budgeted_cell(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vram_budget")
    budget = budget_beside_this_process()
    checkpoint = tmp / "h3-4-blocks-int8.safetensors"
    made = bench("--make-checkpoint", str(checkpoint), "--blocks", str(BLOCKS))
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    loader = "dynamic" if dynamic_vram_loader_available() else "legacy"
    out = Path(os.environ.get("OUT", tmp)) / "vram_budget_gpu.json"
    proc = bench("--checkpoint", str(checkpoint), "--variants", "pack,stock", "--budgets", str(budget),
                 "--tokens", str(TOKENS), "--steps", "3", "--loader", loader, "--timeline", "--out", str(out))
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    cell = json.loads(out.read_text())["cells"][0]
    assert proc.returncode == 0, json.dumps(cell.get("error") or cell.get("runs"), indent=1)[-3000:]
    return cell, loader, budget


def test_the_card_shows_only_the_budget(budgeted_cell):
    cell, loader, asked = budgeted_cell
    budget = cell["budget"]
    assert cell["loader"] == loader and budget["budget_gib"] == asked
    assert abs(budget["ballast_bytes"] - (budget["card_total_bytes"] - asked * 2**30)) < 2**21  # to 2 MiB pages
    assert budget["free_after_bytes"] <= BUDGET_GIB * 2**30
    assert cell["model"]["bytes"] > BUDGET_GIB * 2**30  # the weights cannot all stay on the card


def test_stock_and_the_pack_complete_streaming_weights(budgeted_cell):
    cell, _, _ = budgeted_cell
    for name in ("stock", "pack"):
        run = cell["runs"][name]
        assert "error" not in run, run.get("error")
        assert run["finite"] and len(run["step_end_seconds"]) == 3
        assert run["copied_bytes_per_step"] > 0, f"{name}: nothing streamed per step"
        assert run["peak_reserved_bytes"] <= BUDGET_GIB * 2**30


def test_the_pack_gives_stocks_bits_with_less_memory(budgeted_cell):
    cell, _, _ = budgeted_cell
    stock, pack = cell["runs"]["stock"], cell["runs"]["pack"]
    assert pack["vs_stock"] == {"identical": True, "max_abs_difference": 0.0}
    assert pack["peak_allocated_bytes"] < stock["peak_allocated_bytes"]
    assert pack["report"]["status"] == "ok" and pack["report"]["block_path_blocks"] == BLOCKS


def test_the_last_step_says_where_its_time_went(budgeted_cell):
    cell, _, _ = budgeted_cell
    for name in ("stock", "pack"):
        run = cell["runs"][name]
        t = run["last_step_timeline"]["seconds"]
        last_step = run["step_end_seconds"][-1] - run["step_end_seconds"][-2]
        assert 0 < t["wall"] <= last_step * 1.01  # the profile starts and stops just after the step ends
        assert 0 < t["kernels"] <= t["wall"] and 0 < t["host_to_device"]  # weights were streamed in that step
        assert 0 <= t["host_to_device_exposed"] <= t["host_to_device"]
        assert t["kernels"] + t["host_to_device_exposed"] + t["idle"] <= t["wall"] * 1.001
        assert run["last_step_timeline"]["kernel_seconds_by_family"]["attention"] > 0
