"""torch.compile (ComfyUI's TorchCompileModel, inductor) with the node, in a real ComfyUI server.

Its own server, started with ``TORCH_LOGS=recompiles`` so dynamo logs every recompile and
the guard that failed. Three consecutive prompts per variant (stock + compile, compile
before the node, compile after the node) on one loaded tiny H3, 2 steps each: no recompile
may name pack state, prompts after the first of a variant recompile no more often than
stock + compile does, and node + compile latents equal stock + compile. The first prompt of a
variant may recompile more often than stock's: the pack's attention runs outside the compiled graph
(``_attend`` is skipped), so the frames around it are compiled on their own and meet the run's shapes
one by one; each such recompile must be for a shape (dynamo then marks that size dynamic), never
for a value or for pack state. Needs a C++ compiler for inductor on the CPU (skipped with the reason
when there is none).
"""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest
import torch

from host_fixtures import (H3_CKPT, ComfyServer, _install_into_host, h3_graph, import_comfy, patch_inputs, require_host,
                           run_ahead, tiny_h3_model, write_checkpoint)

STEPS = 2  # a second model call per prompt: pack state that changes per call would show as a recompile
PACK_WORDS = ("sage", "report", "calls", "H3AttentionForward", "H3BlockForward", "AttentionOverride", "_attend", "run_chain", "comfyui_sage")
ORDERS = ("stock", "compile_then_node", "node_then_compile")
PROMPTS = 3  # per variant


def _compile_host(folder) -> None:
    """What the server needs, made in this process before the tests start: a C++ compiler for inductor, the tiny
    checkpoint, the pack and the helper nodes in the host."""
    host = require_host()
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor on the CPU needs a C++ compiler (g++), none found")
    import_comfy(host)
    write_checkpoint(tiny_h3_model(seed=1), host / "models" / "diffusion_models" / H3_CKPT)
    _install_into_host(host)


@run_ahead(prepare=_compile_host)  # started when collection ends, beside the other tests (host_fixtures.run_ahead)
def compile_prompts(folder):
    """Its own server, logging every recompile, with a cold inductor cache (real compiles): per (variant, prompt)
    whether it ran (else why), the node's reports, the latent and the recompiles it logged."""
    env = dict(os.environ, TORCH_LOGS="recompiles", TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor_cache"))
    server = ComfyServer(require_host(), sys.executable, folder, env=env)
    try:
        try:
            server.start()
        except RuntimeError as exc:
            pytest.fail(f"the ComfyUI host did not start: {exc}")
        prompts, seen = {}, 0
        for order in ORDERS:
            for i in range(PROMPTS):
                run = server.run_graph(compile_graph(f"compile_{order}_{i}", order), timeout=600)
                found = recompiles(server.log_path.read_text(errors="replace"))
                prompts[order, i] = (run.ok, f"{run.error_message()}\n{server.log_tail()}", run.reports,
                                     run.latent("9") if run.ok else None, found[seen:])
                seen = len(found)
        return prompts
    finally:
        server.stop()


def recompiles(log: str) -> list[str]:
    """Each recompile dynamo logged: its "[__recompiles]" lines (the function and the guards that failed)."""
    out: list[list[str]] = []
    for line in log.splitlines():
        if "[__recompiles]" not in line:
            continue
        text = line.split("[__recompiles]", 1)[1]
        if "Recompiling function" in text:
            out.append([text.strip()])
        elif out:
            out[-1].append(text.rstrip())
    return ["\n".join(block) for block in out]


def failed_guards(blocks: list[str]) -> list[str]:
    """The guards whose failure caused ``blocks``' recompiles, without their ids and source comments."""
    out = []
    for block in blocks:
        for line in block.splitlines():
            m = re.match(r"^\s*- \d+/\d+: (.*)$", line)
            if m:
                out.append(m.group(1).split("#", 1)[0].strip())
    return out


def compile_graph(name: str, order: str) -> dict:
    compile_node = ("TorchCompileModel", {"backend": "inductor"})
    if order == "stock":
        return h3_graph(patch=None, name=name, steps=STEPS, extra_model_nodes=[compile_node])
    if order == "compile_then_node":
        return h3_graph(patch=patch_inputs("strided_nhd", "sdpa"), name=name, steps=STEPS, extra_model_nodes=[compile_node])
    g = h3_graph(patch=patch_inputs("strided_nhd", "sdpa"), name=name, steps=STEPS)  # node, then compile
    g["7"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["3", 0], "backend": "inductor"}}
    g["6"]["inputs"]["model"] = ["7", 0]
    return g


def test_compiled_patched_model_adds_no_recompile_and_matches_compiled_stock(compile_prompts):
    latents, new = {}, {}
    assert len(compile_prompts) == len(ORDERS) * PROMPTS
    for (order, i), (ok, why, reports, latent, found) in compile_prompts.items():
        assert ok, f"{order} prompt {i} failed: {why}"
        if order != "stock":
            assert len(reports) == 1 and reports[0]["status"] == "ok" and reports[0]["attention_calls"] > 0, reports
            assert reports[0]["backends_ran"] == {"sdpa": reports[0]["attention_calls"]}
        latents[order, i], new[order, i] = latent, found

    # the failed guards themselves ("- 7/2: <guard>  # <source>  # <file>"), not the user stack traces under them
    guards = [line for blocks in new.values() for block in blocks for line in block.splitlines()
              if re.match(r"^\s*- \d+/\d+: ", line)]
    for guard in guards:
        for word in PACK_WORDS:
            assert word not in guard, f"a recompile was triggered by pack state ({word!r}):\n{guard}"
    stock_later = sum(len(new[("stock", i)]) for i in (1, 2))
    stock_first = set(failed_guards(new[("stock", 0)]))
    for order in ("compile_then_node", "node_then_compile"):
        extra = [g for g in failed_guards(new[(order, 0)]) if g not in stock_first]
        # for a shape, or because this server compiled the model before without the node's forwards on it
        unexplained = [g for g in extra if " size mismatch at index " not in g
                       and not re.fullmatch(r"not ___dict_contains\('forward', .*\.__dict__\)", g)]
        assert not unexplained, f"{order}: first-prompt recompiles stock's first prompt has not, neither for a " \
                                "shape nor for the node's forwards:\n" + "\n".join(unexplained)
    for order in ("compile_then_node", "node_then_compile"):
        later = sum(len(new[(order, i)]) for i in (1, 2))
        assert later <= stock_later, f"{order}: {later} recompiles on prompts 2-3 vs stock {stock_later}:\n" \
                                     + "\n".join(b for i in (1, 2) for b in new[(order, i)])

    base = latents[("stock", 0)]
    for key, got in latents.items():
        for stream in base:
            assert torch.equal(got[stream], base[stream]), \
                f"{key} {stream} differs from stock + compile, max abs {(got[stream] - base[stream]).abs().max().item()}"
