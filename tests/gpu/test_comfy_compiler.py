"""The pack under ComfyUI's "Comfy Compiler" (comfy-aimdo's malloc graph), against stock attention.

Current ComfyUI (0.34+) runs every sampling forward inside a comfy-aimdo allocation graph.
``devkit/aimdo_emulation.py`` drives it as ComfyUI does (its docstring has the sequence), for 4
full-width H3 blocks x 4 steps at S = 14,000 (two chunks of the MLP and of the qkv projection in both
formats): a warm-up sampling run, then the measured one, each a graph of its own, in a fresh process
per variant (comfy-aimdo is initialised before torch): stock ComfyUI attention, and the node with
sage2 (prepared path exact / rotated, and switched off), sdpa, layout hnd,
all with block_path exact, and sage2 exact with block_path attention_only. Checked on each variant's
JSON (not only its exit status):

- no error, every stage done (a process that aborted, as comfy-aimdo makes one that frees a graph
  allocation in the wrong scope, leaves its last stage and the Python stack in the message);
- graph breaks of the measured run, per step, no more than stock's at that step;
- the variants that compute stock's function on the same kernel give stock's output bits;
- the report: status ok, every DiT block call and the 2 refiner calls counted, the prepared mode ran
  where sm90 and SageAttention 2 allow it.

When a variant fails under comfy-aimdo, it is run again with the stand-in graph on the GPU
(``--no-aimdo``), whose message names the allocation and the scopes at fault.

Weight formats: $COMFY_COMPILER_WEIGHTS (comma list of bf16, int8_convrot; default bf16). Results:
one JSON per variant under $OUT/comfy_compiler/ (or a temporary folder) and a row per check in
$OUT/comfy_compiler_checks.jsonl (or ./comfy_compiler_checks.jsonl).

Skipped without CUDA, without comfy-aimdo (0.5+, with ``malloc_graph``) or without a ComfyUI host;
the sage2 and hnd variants also without SageAttention.
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

from devkit.aimdo_emulation import CHECK_SEQ, VARIANTS, WEIGHT_FORMATS
from devkit.comfy import find_host

ROOT = Path(__file__).resolve().parents[2]
BLOCKS, STEPS, SEQ = 4, 4, CHECK_SEQ  # past every chunk size of the block fast path
TIMEOUT_S = 300  # a variant takes well under a minute; a machine's first Triton compiles add to it
WEIGHTS = [w.strip() for w in os.environ.get("COMFY_COMPILER_WEIGHTS", "bf16").split(",") if w.strip()]
SAGE = importlib.util.find_spec("sageattention") is not None
MAX_DIAGNOSES = 3  # failed variants re-run with the stand-in graph (each costs another process)


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("comfy_aimdo") is None:
        return "needs comfy-aimdo (pip install 'comfy-aimdo>=0.5'), ComfyUI's malloc-graph allocator"
    if importlib.util.find_spec("comfy_aimdo.malloc_graph") is None:
        return "the installed comfy-aimdo has no malloc_graph (0.5 or later needed)"
    if find_host() is None:
        where = os.environ.get("COMFYUI_PATH") or f"{ROOT / '.comfyui'} (COMFYUI_PATH unset)"
        return f"no ComfyUI host with MiniMax H3 at {where}: set COMFYUI_PATH"
    unknown = sorted(set(WEIGHTS) - set(WEIGHT_FORMATS))
    if unknown:
        return f"COMFY_COMPILER_WEIGHTS names unknown weight formats {unknown}"
    return None


SKIP = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def needs_sage(name: str) -> bool:
    spec = VARIANTS[name]
    return spec is not None and spec.backend == "sage2"


def command(variant: str, weights: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "devkit.aimdo_emulation", "--variant", variant, "--blocks", str(BLOCKS),
            "--steps", str(STEPS), "--seq", str(SEQ), "--weights", weights, "--warmup-runs", "1",
            "--comfyui", str(find_host()), "--out", str(out), *extra]


def log_result(row):
    path = os.path.join(os.environ.get("OUT", "."), "comfy_compiler_checks.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print(row)


def results_dir(tmp_path_factory) -> Path:
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "comfy_compiler"
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("comfy_compiler")


def emulate(cmd: list[str], out: Path, name: str) -> dict:
    """One emulation process; its JSON (or what is known when none was written) with the exit status."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the emulation sets what ComfyUI's cuda_malloc.py sets
    env.pop("PYTORCH_ALLOC_CONF", None)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-6000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = "timeout", f"timed out after {TIMEOUT_S} s: {str(exc.stdout or '')[-3000:]}"
    data = json.loads(out.read_text()) if out.is_file() else {"variant": name, "stage": "no JSON written"}
    data.update(returncode=rc, output_tail=tail, command=" ".join(cmd[1:]))
    return data


_results: dict[tuple[str, str], dict] = {}


@pytest.fixture(scope="module")
def run_variant(tmp_path_factory):
    """``run_variant(name, weights)``: the emulation's result for that variant (run once per module)."""
    workdir = results_dir(tmp_path_factory)

    def run(name: str, weights: str) -> dict:
        if (name, weights) not in _results:
            out = workdir / f"{weights}-{name}.json"
            data = emulate(command(name, weights, out), out, name)
            if not ran_ok(data) and sum("stand_in" in r for r in _results.values()) < MAX_DIAGNOSES:
                data["stand_in"] = diagnose(name, weights, workdir)
            _results[(name, weights)] = data
            log_result(summary_row(data))
        return _results[(name, weights)]
    return run


def diagnose(name: str, weights: str, workdir: Path) -> dict:
    """The same variant with the stand-in graph on the GPU: its error names the scope rule broken."""
    out = workdir / f"{weights}-{name}-stand-in.json"
    data = emulate(command(name, weights, out, "--no-aimdo"), out, name)
    return {k: data.get(k) for k in ("error", "stage", "breaks_per_step", "break_sites", "rogue_count")}


def ran_ok(data: dict) -> bool:
    return data.get("returncode") == 0 and data.get("error") is None and data.get("stage") == "done"


def summary_row(data: dict) -> dict:
    keys = ("variant", "weights", "returncode", "stage", "error", "breaks_per_step", "break_sites",
            "graph_breaks_total", "rogue_count", "graph", "peak_memory", "backends_ran", "prepared", "output_sha256",
            "step_seconds", "seconds_total", "stock_attention", "gpu", "comfy_aimdo", "allocator_backend", "settings")
    row = {"check": "comfy_compiler", **{k: data.get(k) for k in keys}}
    row["warmup"] = [{k: r.get(k) for k in ("kind", "breaks_per_step", "break_sites", "graph")}
                     for r in data.get("runs", [])[:-1]]
    row["report"] = data.get("report")
    if not ran_ok(data):
        row["output_tail"], row["stand_in"] = data.get("output_tail"), data.get("stand_in")
    return row


def assert_ran(data: dict) -> None:
    assert ran_ok(data), (
        f"{data.get('variant')}: exit {data.get('returncode')} at stage {data.get('stage')!r}, error "
        f"{data.get('error')}\nstand-in graph on the GPU says: {data.get('stand_in')}\n"
        f"{''.join(e.get('traceback', '') for e in data.get('errors', []))}\n{data.get('output_tail')}")
    assert data["graph_kind"] == "comfy_aimdo.malloc_graph" and data["allocator_backend"] == "cudaMallocAsync", data
    assert [r["kind"] for r in data["runs"]] == ["warmup0", "measured"], data["runs"]
    assert len(data["breaks_per_step"]) == STEPS and data["outputs_finite"], data


def stock_kind(stock: dict) -> str:
    """The stock attention the stock run used: sage (--use-sage-attention) or sdpa (PyTorch's)."""
    return {"attention_sage": "sage", "attention_pytorch": "sdpa"}.get(stock["stock_attention"], stock["stock_attention"])


@pytest.mark.parametrize("weights", WEIGHTS)
def test_stock_runs_under_the_malloc_graph(run_variant, weights):
    data = run_variant("stock", weights)
    assert_ran(data)
    assert data["report"] is None  # no patch
    assert data["pytorch_cuda_alloc_conf"].endswith("backend:cudaMallocAsync")


VARIANT_NAMES = [name for name in VARIANTS if name != "stock"]


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_pack_under_the_malloc_graph_breaks_no_more_than_stock(run_variant, variant, weights):
    if needs_sage(variant) and not SAGE:
        pytest.skip("needs SageAttention (sageattention importable)")
    stock = run_variant("stock", weights)
    assert_ran(stock)
    data = run_variant(variant, weights)
    assert_ran(data)
    mine, theirs = data["breaks_per_step"], stock["breaks_per_step"]
    assert all(m <= t for m, t in zip(mine, theirs)), (
        f"{variant}: graph breaks per step {mine} (sites {data['break_sites']}), stock {theirs} "
        f"(sites {stock['break_sites']})")
    if VARIANTS[variant].same_bits_as == stock_kind(stock):
        assert data["output_sha256"] == stock["output_sha256"], (
            f"{variant} computes stock's function with stock's kernel ({stock['stock_attention']}) but its "
            f"output differs from stock's")
    check_report(data)


def check_report(data: dict) -> None:
    spec = VARIANTS[data["variant"]]
    report = data["report"]
    assert report is not None and report["status"] == "ok", report
    assert report["attention_calls"] == BLOCKS * STEPS + 2, report  # DiT blocks every step, refiner once
    assert data["plan_prepared"] is spec.prepared, data["plan_prepared"]
    # the block fast path ran on every DiT block (block_path exact) or on none (attention_only)
    assert report["block_path_blocks"] == (0 if spec.block_path == "attention_only" else BLOCKS), report
    # the graph records the forward: stock's video embedding is the forward's and stays (embedding_release.py)
    assert (report["memory"] or {}).get("released_bytes") is None, report["memory"]
    if spec.backend == "sdpa":
        assert set(data["backends_ran"]) == {"sdpa"}, data["backends_ran"]
        return
    assert data["backends_ran"].get("sage2", 0) >= BLOCKS * STEPS, (data["backends_ran"], report["fallbacks"])
    ok, why = sage2_prepared_here()
    calls = sum(r["calls"] for r in data["prepared"] if r["backend"] == "sage2" and r["mode"] == spec.prep)
    if spec.layout == "hnd" or not spec.prepared:
        assert calls == 0, data["prepared"]
    elif ok:
        assert calls >= BLOCKS * STEPS, (data["prepared"], report["prepared_skipped"])
    else:
        log_result({"check": "comfy_compiler_prepared_not_checked", "variant": data["variant"], "reason": why})


def sage2_prepared_here() -> tuple[bool, str]:
    """Whether the sage2 prepared path can run on this machine (sm90 and SageAttention 2), and why not."""
    from comfyui_sage_strided_nhd.kernels.backends import BACKENDS

    if torch.cuda.get_device_capability() != (9, 0):
        return False, f"needs sm90 (H100/H200), got {torch.cuda.get_device_capability()}"
    available = BACKENDS["sage2"].available()
    if not available:
        return False, available.reason
    q = torch.empty(1, 128, 1, 128, dtype=torch.bfloat16, device="cuda")
    verdict = BACKENDS["sage2"].prepared_verdict(q, q, q)
    return bool(verdict), verdict.reason
