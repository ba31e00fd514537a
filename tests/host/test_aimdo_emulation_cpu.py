"""devkit/aimdo_emulation.py on the CPU: the Comfy Compiler's sequence with the stand-in graph.

The GPU test (tests/gpu/test_comfy_compiler.py) runs the emulation under comfy-aimdo itself. Here
``--no-aimdo --device cpu --tiny`` runs the same code against the real ComfyUI host: the host's H3
``_forward`` with current upstream's block scopes, the node's patch and its OUTER_SAMPLE wrapper, the
text refiner once per run outside the graph, a warm-up and a measured run (a graph each), and the
stand-in graph fed by the allocation tracer. On the CPU every back-end falls back to sdpa, stock
ComfyUI attention is PyTorch's: every variant must give stock's bits, with no graph break and no rogue.

The stand-in graph itself is checked on small hand-made sequences: it must report a break for a
differing allocation sequence, refuse a pop or push out of turn, and fail on the two lifetime mistakes
comfy-aimdo turns into a process abort (a scope's allocation freed in another scope; one that outlived
its scope freed before the forward ended), including the draft emulation's own: ``iterate(None)``
called after ``_forward`` returned, so its locals were freed inside the last block's scope.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devkit import aimdo_emulation as emu
from host_fixtures import import_pack, require_host, run_ahead

ROOT = Path(__file__).resolve().parents[2]
BLOCKS, STEPS, SEQ = 3, 3, 64
# sage2 falls back to sdpa on the CPU; sage2_noprepared passes Settings(prepared=False) into the plan
VARIANTS = ("stock", "sdpa", "sage2_exact_attention_only", "sage2_noprepared")
# one forward's graph calls (a replayed pass): push, iterate("block") per block, iterate(None), pop
ONE_STEP = ["push", "push(block)"] + ["pop", "push(block)"] * (BLOCKS - 1) + ["pop", "pop"]


def emulate(host: Path, variant: str, out: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTORCH_CUDA_ALLOC_CONF")}
    cmd = [sys.executable, "-m", "devkit.aimdo_emulation", "--variant", variant, "--tiny", "--device", "cpu",
           "--no-aimdo", "--blocks", str(BLOCKS), "--steps", str(STEPS), "--seq", str(SEQ),
           "--comfyui", str(host), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.is_file(), (f"{variant}: no JSON written (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc, json.loads(out.read_text())


@run_ahead  # started when collection ends, beside the other tests (host_fixtures.run_ahead)
def runs(workdir):
    host = require_host()
    return {v: emulate(host, v, workdir / f"{v}.json") for v in VARIANTS}


def test_the_gpu_check_length_takes_every_chunked_path_of_the_block():
    """The GPU check (tests/gpu/test_comfy_compiler.py) runs at emu.CHECK_SEQ: it must pass every chunk
    size the block fast path uses by default, or a chunk's allocations escape the malloc graph."""
    settings = import_pack(require_host()).nodes.patch.Settings()
    for name in ("mlp_chunk_tokens", "int8_mlp_chunk_tokens", "qkv_chunk_tokens"):
        assert emu.CHECK_SEQ > getattr(settings, name), (name, getattr(settings, name), emu.CHECK_SEQ)


def failure_text(proc, data) -> str:
    return "\n".join([str(data.get("error")), *(e.get("traceback", "") for e in data.get("errors", [])),
                      proc.stderr[-3000:]])


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_run_replays_its_graph_with_no_break_and_no_rogue(runs, variant):
    proc, data = runs[variant]
    assert proc.returncode == 0 and data["error"] is None and data["stage"] == "done", failure_text(proc, data)
    assert data["variant"] == variant and data["aimdo"] is False and data["graph_kind"] == "stand-in"
    assert [r["kind"] for r in data["runs"]] == ["warmup0", "measured"]
    for run in data["runs"]:
        assert run["error"] is None and run["breaks_per_step"] == [0] * STEPS, run["break_sites"]
        assert run["graph"]["rogue_count"] == 0 and run["graph"]["abort_error"] is None, run["graph"]
        assert run["graph"]["peak_used"] > 0  # the tracer saw the forward's allocations
        assert len(run["step_seconds"]) == STEPS and run["outputs_finite"] is True
    assert data["breaks_per_step"] == [0] * STEPS and data["rogue_count"] == 0
    assert data["stand_in_calls_last_step"] == ONE_STEP


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_host_and_the_inputs_are_what_the_run_says(runs, variant):
    _, data = runs[variant]
    assert data["rows"] == {"total": SEQ, "text": 4, "audio_t": 6, "latent_t": 3, "latent_h": 8, "latent_w": 8,
                            "video": 48, "audio": 12}
    assert data["config"]["num_layers"] == BLOCKS and data["dtype"] == "torch.float32"
    assert data["stock_attention"] == "attention_pytorch"
    assert data["comfyui"]["flags"] == {"cpu": True, "use_pytorch_cross_attention": True}
    assert "pytorch_cuda_alloc_conf" not in data  # no CUDA: the allocator is left alone


def test_stock_runs_without_a_patch(runs):
    _, data = runs["stock"]
    assert data["settings"] is None and data["report"] is None and data["backends_ran"] is None


@pytest.mark.parametrize("variant,block_path,prepared", [("sdpa", "exact", True),
                                                         ("sage2_exact_attention_only", "attention_only", True),
                                                         ("sage2_noprepared", "exact", False)])
def test_patched_runs_report_through_the_outer_sample_wrapper(runs, variant, block_path, prepared):
    _, data = runs[variant]
    report = data["report"]
    assert report is not None and report["status"] == "ok" and report["error"] is None, report
    # the DiT blocks every step, the 2 refiner blocks once per run (extra_conds, outside the graph)
    calls = BLOCKS * STEPS + 2
    assert report["attention_calls"] == calls and data["backends_ran"] == {"sdpa": calls}, report
    assert report["blocks_patched"] == BLOCKS and report["refiner_blocks_patched"] == 2
    assert data["settings"]["block_path"] == block_path and data["settings"]["prepared"] is prepared
    assert report["block_path"] == block_path
    assert report["block_path_blocks"] == (BLOCKS if block_path == "exact" else 0), report
    assert data["plan_prepared"] is prepared and data["prepared"] == []  # the settings reached the plan
    # the graph records the forward: stock's video embedding is the forward's and stays (embedding_release.py)
    assert (report["memory"] or {}).get("released_bytes") is None, report["memory"]


def test_patched_steps_give_stock_bits(runs):
    digests = {v: runs[v][1]["output_sha256"] for v in VARIANTS}
    assert digests["stock"] and len(set(digests.values())) == 1, digests
    for v in VARIANTS:  # the warm-up run computed the same as the measured one
        assert {r["output_sha256"] for r in runs[v][1]["runs"]} == {digests[v]}


# --- the stand-in graph on hand-made sequences -------------------------------------------------------
def forward(graph, blocks: list[list[int]], root: list[int] = (), close=True):
    """One pass: ``root`` allocations (freed at the end), then one scope per block allocating and freeing
    the given sizes. Tokens are fresh objects, so passes never share them."""
    tokens = [object() for _ in root]
    for tok, n in zip(tokens, root):
        graph.on_alloc(tok, n)
    broken = []
    for sizes in blocks:
        broken.append(graph.iterate("block"))
        for n in sizes:
            tok = object()
            graph.on_alloc(tok, n)
            graph.on_free(tok)
    broken.append(graph.iterate(None))
    for tok in tokens:
        graph.on_free(tok)
    if close:
        broken.append(graph.pop())
    return broken


def test_stand_in_replays_blocks_and_passes_without_a_break():
    g = emu.StandInGraph()
    assert forward(g, [[100, 200]] * 3, root=[64]) == [False] * 5
    for _ in range(2):
        g.push()
        assert forward(g, [[100, 200]] * 3, root=[64]) == [False] * 5
    assert g.calls[:2] == ["record", "push(block)"] and g.rogue_count == 0 and g.peak_used == 64 + 200


def test_stand_in_reports_a_differing_allocation_sequence_as_a_break():
    g = emu.StandInGraph()
    # block 1 replays block 0's recording: a different size breaks block 1 (seen when block 2 opens)
    assert forward(g, [[100], [300], [100]]) == [False, False, True, False, False]
    g.push()
    assert forward(g, [[100], [300], [100]]) == [False] * 5  # both sequences are recorded now
    g.push()
    # a root allocation the recording never had: the root records from there on, and so do the block
    # scopes it opens after it (block 1 replays the new block 0 again: a break there too)
    assert forward(g, [[100], [300], [100]], root=[8]) == [False, False, True, False, True]


def test_stand_in_rejects_a_pop_or_push_out_of_turn():
    g = emu.StandInGraph()
    forward(g, [[100]])
    for call in (g.pop, lambda: g.push("block"), g.abort, g.pause):
        with pytest.raises(RuntimeError, match=emu.COMPILE_ERROR):
            call()
    g.push()
    with pytest.raises(RuntimeError, match=emu.COMPILE_ERROR):
        g.push()  # a second pass while one is open
    forward(g, [[100]])


def test_stand_in_fails_a_free_in_another_scope():
    g = emu.StandInGraph()
    tok = object()
    g.on_alloc(tok, 64)
    g.iterate("block")
    with pytest.raises(RuntimeError, match=r"aimdo memory compile error .*scope forward was freed in scope block0"):
        g.on_free(tok)
    with pytest.raises(RuntimeError, match=emu.COMPILE_ERROR):
        g.iterate(None)  # a failed graph stays failed


def test_stand_in_fails_an_allocation_that_outlived_its_scope_freed_before_the_end():
    g = emu.StandInGraph()
    g.iterate("block")
    out = object()
    g.on_alloc(out, 64)  # a block's output in a fresh buffer
    g.iterate("block")
    with pytest.raises(RuntimeError, match="scope block0 outlived it and was freed in scope block1"):
        g.on_free(out)


def test_stand_in_counts_allocations_alive_at_the_end_as_rogues():
    g = emu.StandInGraph()
    kept = object()
    g.iterate("block")
    g.on_alloc(kept, 64)  # a cache made on first use, kept across steps
    # block 0's recording loses the cache (taken out as a rogue candidate), so block 1, replaying it,
    # breaks once: comfy-aimdo does the same with first-use caches
    assert forward(g, [[100]] * 2) == [False, True, False, False]
    assert g.rogue_count == 1
    g.on_free(kept)  # a rogue may be freed whenever once the pass ended
    g.push()
    forward(g, [[100]] * 3)


def test_stand_in_tolerates_frees_of_allocations_made_outside_the_graph():
    g = emu.StandInGraph()
    forward(g, [[100]])
    outside = object()
    g.on_alloc(outside, 64)  # between passes: an ordinary allocation
    g.push()
    g.iterate("block")
    g.on_free(outside)
    g.iterate(None)
    assert g.pop() is False


def test_assert_graph_breaks_turns_a_break_into_a_failure():
    g = emu.StandInGraph(assert_breaks=True)
    forward(g, [[100]])
    g.push()
    g.iterate("block")
    with pytest.raises(RuntimeError, match="assert_graph_breaks"):
        g.on_alloc(object(), 300)


# --- the tracer and the compiler driver on real tensors ----------------------------------------------
def toy_forward(compiler: emu.Compiler, blocks: int, *, late_iterate=False, fresh_outputs=False):
    """A DiT-like forward: root tensors, one block scope per block, the last scope closed after the loop
    (upstream), or after the inner forward returned (the draft's order, ``late_iterate``); each block
    updates ``h`` in place (stock) or returns a fresh tensor (``fresh_outputs``)."""
    def inner():
        t_emb = torch.ones(64)
        x = torch.zeros(256)
        h = x
        for i in range(blocks):
            compiler.block_scope(i)
            update = h * 2 + t_emb.sum()
            h = update if fresh_outputs else h.add_(update)
            del update
        if not late_iterate:
            compiler.block_scope(None)
        return h.clone()

    out = torch.empty(256)  # as MiniMaxH3Model.forward: the output buffer exists before the graph opens
    compiler.begin()
    graph_out = inner()
    if late_iterate:
        compiler.block_scope(None)
    out.copy_(graph_out)
    del graph_out
    compiler.end()
    return out


def traced_compiler():
    tracer = emu.make_tracer("cpu")
    return tracer, emu.Compiler(lambda assert_breaks: emu.StandInGraph(tracer, assert_breaks))


def test_traced_forward_in_upstream_order_replays_cleanly():
    tracer, compiler = traced_compiler()
    with tracer:
        for _ in range(3):
            toy_forward(compiler, 3)
    stats = compiler.cleanup()
    assert compiler.breaks == 0 and stats["rogue_count"] == 0 and stats["peak_used"] > 0, stats


def test_traced_forward_closing_the_last_block_after_return_fails():
    tracer, compiler = traced_compiler()
    with tracer, pytest.raises(RuntimeError, match="scope forward was freed in scope block2"):
        toy_forward(compiler, 3, late_iterate=True)
    assert compiler.cleanup()["abort_error"] is None


def test_traced_forward_with_fresh_block_outputs_fails():
    tracer, compiler = traced_compiler()
    with tracer, pytest.raises(RuntimeError, match="scope block0 outlived it and was freed in scope block1"):
        toy_forward(compiler, 3, fresh_outputs=True)
    compiler.cleanup()


def test_compiler_names_the_scope_that_broke():
    tracer, compiler = traced_compiler()
    with tracer:
        toy_forward(compiler, 3)
        compiler.begin()
        compiler.graph.on_alloc(object(), 12345)  # something the recorded root never had
        compiler.block_scope(0)
        compiler.block_scope(None)
        compiler.end()
    assert compiler.sites == ["forward"] and compiler.breaks == 1


# --- the script's own pieces -------------------------------------------------------------------------
def test_importing_the_script_imports_neither_torch_nor_aimdo():
    code = "import sys, devkit.aimdo_emulation; print('torch' in sys.modules, 'comfy_aimdo' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr


def test_aimdo_init_refuses_after_torch():
    with pytest.raises(RuntimeError, match="before comfy-aimdo"):
        emu.init_aimdo_library()


@pytest.mark.parametrize("before,after", [
    ("", "backend:cudaMallocAsync"),
    ("expandable_segments:True", "backend:cudaMallocAsync"),
    ("garbage_collection_threshold:0.6,expandable_segments:True", "garbage_collection_threshold:0.6,backend:cudaMallocAsync"),
    ("backend:cudaMallocAsync", "backend:cudaMallocAsync"),
])
def test_allocator_configuration_is_cuda_malloc_pys(before, after):
    env = {"PYTORCH_CUDA_ALLOC_CONF": before} if before else {}
    assert emu.cuda_malloc_env(env) == after and env["PYTORCH_CUDA_ALLOC_CONF"] == after


@pytest.mark.parametrize("seq,text", [(8192, 256), (37810, 256), (64, 4), (300, 18), (20, 1)])
def test_layout_sizes_fill_the_sequence(seq, text):
    sizes = emu.layout_sizes(seq, text)
    assert sizes["text"] + sizes["audio"] + sizes["video"] == seq
    assert sizes["text"] >= 1 and sizes["audio_t"] >= 1 and sizes["latent_t"] >= 1
    assert sizes["video"] == sizes["latent_t"] * (sizes["latent_h"] // 2) * (sizes["latent_w"] // 2)


def test_cpu_needs_no_aimdo_flag():
    with pytest.raises(SystemExit):
        emu.parse_args(["--variant", "stock", "--device", "cpu", "--out", "x.json"])


def test_variants_cover_every_prepared_mode_and_block_path_with_settings_the_node_takes():
    pack = import_pack(require_host())
    specs = {k: v for k, v in emu.VARIANTS.items() if v is not None}
    sage2 = [v for v in specs.values() if v.backend == "sage2" and v.layout == "strided_nhd"]
    assert {v.prep for v in sage2} == set(pack.kernels.PREPARED_MODES)
    assert {v.block_path for v in sage2} == set(pack.nodes.patch.BLOCK_PATHS)
    assert specs["sage2_noprepared"].prepared is False and specs["hnd"].layout == "hnd"
    assert specs["sdpa"].backend == "sdpa" and emu.VARIANTS["stock"] is None
    for name, spec in specs.items():  # every variant is settings the node accepts
        assert pack.nodes.patch.Settings(**spec.settings()).prepared is spec.prepared, name
