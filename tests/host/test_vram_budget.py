"""The VRAM-budget benchmark (benchmarks/vram_budget.py, budget_cell.py, ballast.py) on the CPU: a tiny H3
checkpoint, one cell per budget in its own process, stock, the pack and the peer's stand-in sampled through
ComfyUI's nodes, the latents compared, the table printed. The budget itself needs a GPU (tests/gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import ballast, budget_cell, peer, results_table, vram_budget
from host_fixtures import import_comfy, require_host, run_ahead
from peer_stand_in import write_stand_in

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--device", "cpu", "--width", "256", "--height", "128", "--text-tokens", "16"]


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    host = require_host()
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, "-m", "benchmarks.vram_budget", "--comfyui", str(host), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@run_ahead  # started when collection ends, beside the other tests (host_fixtures.run_ahead)
def budget_run(tmp):
    checkpoint = tmp / "tiny.safetensors"
    made = run("--make-checkpoint", str(checkpoint), "--tiny", "--device", "cpu")
    assert made.returncode == 0 and checkpoint.is_file(), made.stdout[-2000:] + made.stderr[-2000:]
    kj = write_stand_in(tmp / "kjnodes", mem_eff=False)
    out = tmp / "budget.json"
    proc = run("--checkpoint", str(checkpoint), "--kjnodes", str(kj), "--budgets", "12,full", "--tokens", "600",
               "--steps", "2", "--out", str(out), *SMALL)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), out


def test_each_budget_is_a_cell_with_every_variant(budget_run):
    proc, data, _ = budget_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [c["budget_gib"] for c in data["cells"]] == [12.0, None]
    for cell in data["cells"]:
        assert cell["stage"] == "done" and cell["returncode"] == 0
        assert list(cell["runs"]) == list(vram_budget.VARIANTS)  # every variant by default, stock last
        assert cell["packed_rows"]["total"] == 530 and cell["model"]["blocks"] == 2
        assert cell["loader"] == "legacy"  # no comfy-aimdo on a CPU
        for run_ in cell["runs"].values():
            assert "error" not in run_ and run_["finite"]
            assert len(run_["step_end_seconds"]) == 2 and run_["seconds_per_step"] > 0


def test_the_pack_and_the_peer_give_stocks_latents(budget_run):
    _, data, _ = budget_run
    for cell in data["cells"]:
        assert cell["runs"]["pack"]["vs_stock"] == {"identical": True, "max_abs_difference": 0.0}
        assert cell["runs"]["kjnodes"]["vs_stock"]["identical"]


def test_the_pack_run_carries_the_nodes_report(budget_run):
    _, data, _ = budget_run
    report = data["cells"][0]["runs"]["pack"]["report"]
    assert report["model_family"] == "MiniMaxH3" and report["block_path_blocks"] == 2


def test_the_peer_runs_its_lowest_memory_chain_and_says_so(budget_run):
    _, data, _ = budget_run
    cell = data["cells"][0]
    # stock runs no SageAttention on a CPU: the peer's chain leaves its sage patch out
    assert [n["node"] for n in cell["kjnodes"]["nodes"]] == list(peer.LOW_MEMORY_WITHOUT_SAGE["kj_lowmem"])


def test_the_table_reads_the_json(budget_run):
    proc, _, out = budget_run
    table = subprocess.run([sys.executable, "-m", "benchmarks.results_table", "--budget", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert lines[0].startswith("| card | tokens | stock |") and lines[4] == ""
    assert lines[6].startswith("- 12 GiB, 530 tokens: pack ") and "stock's bits" in lines[6]
    assert lines[2].startswith("| 12 GiB | 530 |") and lines[3].startswith("| whole card | 530 |")
    assert lines[2].count(" s |") == 3 and lines[2].rstrip().endswith("x |")
    assert "| 12 GiB | 530 |" in proc.stdout  # the run printed it too


# --- the pieces -------------------------------------------------------------------------------------------

def test_ballast_leaves_the_budget():
    assert ballast.ballast_bytes(80 * ballast.GIB, 12) == 68 * ballast.GIB
    assert ballast.ballast_bytes(80 * ballast.GIB, 0.5) == int(79.5 * ballast.GIB)
    for bad in (0, -1, 80, 96):
        with pytest.raises(ValueError):
            ballast.ballast_bytes(80 * ballast.GIB, bad)


def test_the_checkpoint_is_a_safetensors_file_written_tensor_by_tensor(tmp_path):
    import torch
    from safetensors.torch import load_file, safe_open

    from devkit.h3 import write_safetensors

    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b.weight": torch.randint(-127, 127, (7,), dtype=torch.int8),
               "b.weight_scale": torch.tensor(0.5), "c": torch.arange(3, dtype=torch.uint8)}
    asked = []

    def named():
        asked.append(1)
        yield from tensors.items()

    size = write_safetensors(tmp_path / "x.safetensors", named, {"seed": "1"})
    assert size == (tmp_path / "x.safetensors").stat().st_size and len(asked) == 2
    loaded = load_file(tmp_path / "x.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"seed": "1"}


def test_budgets_and_variants_are_checked():
    assert vram_budget.parse_budgets("12, 16,full") == [12.0, 16.0, None]
    with pytest.raises(Exception):
        vram_budget.parse_budgets("0")
    with pytest.raises(SystemExit):
        vram_budget.parse_args(["--checkpoint", "x", "--variants", "stock,other"])
    with pytest.raises(SystemExit):
        vram_budget.parse_args(["--checkpoint", "x"])  # the kjnodes variant without a checkout
    with pytest.raises(SystemExit):
        vram_budget.parse_args(["--checkpoint", "x", "--variants", "stock", "--steps", "1"])


def test_a_run_that_failed_shows_why_and_has_no_ratio():
    done = {"seconds_per_step": 2.0}
    oom = {"error": {"type": "OutOfMemoryError", "message": "CUDA out of memory", "oom": True}}
    other = {"error": {"type": "RuntimeError", "message": "x", "oom": False}}
    outcome = results_table.budget_outcome
    assert outcome(done) == "2.00 s" and outcome(None) == "not run"
    assert outcome(oom) == "out of memory" and outcome(other) == "error (RuntimeError)"
    assert results_table.budget_ratio({"seconds_per_step": 3.0}, done) == 1.5
    assert results_table.budget_ratio(oom, done) is None and results_table.budget_ratio(done, oom) is None


def test_a_variant_whose_process_died_is_told_apart_from_one_not_run():
    pack = {"seconds_per_step": 2.0, "peak_allocated_bytes": 2**30, "copied_bytes_per_step": 0}
    died = {"name": "x", "budget_gib": 24.0, "packed_rows": {"total": 149936}, "returncode": -6,
            "stage": "sample stock", "runs": {"pack": pack}}
    assert results_table.budget_runs(died) == {"pack": pack, "stock": {"crashed": -6}}
    row = results_table.budget_markdown([{"cells": [died]}])[-1]
    assert row == "| 24 GiB | 149,936 | process died | not run | 2.00 s |  |  |"
    assert "stock: the process died while sampling (exit code -6)" in results_table.budget_details({"cells": [died]})[0]
    for fine in ({**died, "returncode": 0}, {**died, "stage": "done"}, {**died, "stage": "sample pack"}):
        assert "crashed" not in results_table.budget_runs(fine).get("stock", {})


def test_out_of_memory_is_told_apart():
    import torch

    def oom(exc) -> bool:
        return budget_cell.error_record(exc)["oom"]

    assert oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.11 GiB"))
    assert oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not oom(RuntimeError("shape mismatch"))
    record = budget_cell.error_record(RuntimeError("CUDA error: out of memory\nmore"))
    assert record["oom"] and record["message"] == "CUDA error: out of memory"


def test_the_transfer_counter_counts_host_tensors_bound_for_a_gpu(monkeypatch):
    import_comfy(require_host())
    import torch

    import comfy.model_management as mm

    seen = []
    monkeypatch.setattr(mm, "cast_to", lambda w, dtype=None, device=None, *a, **k: seen.append("cast") or w)
    monkeypatch.setattr(mm, "cast_to_gathered", lambda t, r, non_blocking=False, stream=None, r2=None: seen.append("g"))
    counter = budget_cell.TransferCounter()
    gpu = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    weight, bias = torch.zeros(4, 8), torch.zeros(4)
    mm.cast_to(weight, None, torch.device("cpu"))          # stays on the host: not counted
    mm.cast_to(weight, None, SimpleNamespace(type="cuda"))  # 128 bytes to the card
    mm.cast_to_gathered([weight, None, bias], None, r2=gpu)  # 144 more
    mm.cast_to_gathered([weight], torch.zeros(1))           # into host memory: not counted
    assert counter.bytes == 128 + 144 and seen == ["cast", "cast", "g", "g"]


def test_the_peer_keeps_the_rest_of_its_chain_when_its_sage_patch_refuses(tmp_path):
    import_comfy(require_host())
    from devkit.h3 import patcher_for, tiny_h3_model

    base = patcher_for(tiny_h3_model())
    try:
        for works in (True, False):
            _forget_the_peer()  # each checkout loads afresh
            kj = write_stand_in(tmp_path / f"kj-{works}", mem_eff=works)
            result = {}
            clone = budget_cell._peer_variant(SimpleNamespace(kjnodes=kj), base, "use_sage_attention", result)
            nodes = [n["node"] for n in result["kjnodes"]["nodes"]]
            if works:
                assert nodes == list(peer.LOW_MEMORY["kj_lowmem"]) and "notes" not in result
            else:
                assert nodes == list(peer.LOW_MEMORY_WITHOUT_SAGE["kj_lowmem"])
                assert "refused" in result["notes"][0]
            assert clone is not base
    finally:
        _forget_the_peer()


def _forget_the_peer() -> None:
    for name in [n for n in sys.modules if n == peer.PACKAGE or n.startswith(peer.PACKAGE + ".")]:
        del sys.modules[name]
