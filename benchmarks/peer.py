"""The peer: KJNodes' MiniMax H3 patches, from a ComfyUI-KJNodes checkout named at run time (``--kjnodes DIR``;
none of its code is in this repository). Its ``nodes/minimax_nodes.py`` is imported by file path under stub
packages, so its own imports resolve in the benchmark's ComfyUI and the KJ pack's ``__init__.py`` never runs.
Each variant is made as a graph makes it: the nodes' ``execute`` in turn, every input at its schema default.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
from pathlib import Path

PEER_FILE = Path("nodes") / "minimax_nodes.py"
PACKAGE = "kjnodes_peer"  # the stub package the peer's module lives in (never the KJ pack itself)
LOW_VRAM = "MiniMaxLowVRAMAttention"      # "MiniMax H3 Low VRAM Attention"
CHUNK_FF = "MiniMaxChunkFeedForward"      # "MiniMax H3 Chunk FeedForward"
MEM_EFF_SAGE = "MiniMaxH3MemoryEfficientSageAttentionPatch"  # "MiniMax H3 Mem Eff Sage Attention Patch"
# the peer's nodes that live outside PEER_FILE: node -> its file in the checkout
NODE_FILES = {MEM_EFF_SAGE: Path("nodes") / "ltxv_nodes.py"}
# variant -> the peer's nodes, chained in this order on the stock model
VARIANTS = {"kj_lowvram": (LOW_VRAM,), "kj_lowvram_chunkff": (LOW_VRAM, CHUNK_FF)}
# its lowest-memory combination: its own SageAttention forward (int8/fp8 operands straight from the fused buffer)
# under the Low VRAM block patch (which keeps an attention patch it finds), with the chunked MLP; where stock
# does not run SageAttention the sage patch is left out (LOW_MEMORY_WITHOUT_SAGE)
LOW_MEMORY = {"kj_lowmem": (MEM_EFF_SAGE, LOW_VRAM, CHUNK_FF)}
LOW_MEMORY_WITHOUT_SAGE = {"kj_lowmem": (LOW_VRAM, CHUNK_FF)}


def check_checkout(checkout, file: Path = PEER_FILE) -> Path:
    path = Path(checkout).expanduser().resolve() / file
    if not path.is_file():
        raise FileNotFoundError(f"no {file} under {checkout} (not a ComfyUI-KJNodes checkout, or one too old)")
    return path


def _stub_package(name: str, folder: Path) -> None:
    """An empty package whose submodules are found in ``folder``; its ``__init__.py`` is not run."""
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_loader(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]  # the module's __path__
    sys.modules[name] = importlib.util.module_from_spec(spec)


def _server_for_import() -> None:
    """Some of the peer's files register web routes at import: outside a running ComfyUI a stand-in takes them."""
    try:
        import server
    except Exception:  # noqa: BLE001  (no server module: the file's own import then says so)
        return
    prompt_server = getattr(server, "PromptServer", None)
    if prompt_server is not None and getattr(prompt_server, "instance", None) is None:
        from types import SimpleNamespace

        from aiohttp import web

        prompt_server.instance = SimpleNamespace(routes=web.RouteTableDef(), send_sync=lambda *a, **k: None)


def load_module(checkout, file: Path = PEER_FILE):
    """The peer's ``minimax_nodes`` module, or another of its ``nodes/`` files (ComfyUI imported first)."""
    check_checkout(checkout)  # the checkout's own file first, whichever file is asked for
    path = check_checkout(checkout, file)
    name = f"{PACKAGE}.nodes.{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    _stub_package(PACKAGE, path.parent.parent)
    _stub_package(f"{PACKAGE}.nodes", path.parent)
    _server_for_import()
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def make_variant(module, base, nodes: tuple[str, ...], checkout=None):
    """``(patched clone, [{node, display_name, inputs}])``: each node's ``execute`` on the previous output, every
    input at its schema default."""
    model, applied = base, []
    for node in nodes:
        cls = getattr(load_module(checkout, NODE_FILES[node]) if node in NODE_FILES else module, node)
        schema = cls.define_schema()
        inputs = {i.id: i.default for i in schema.inputs if i.id != "model" and getattr(i, "default", None) is not None}
        model = cls.execute(model, **inputs)[0]  # io.NodeOutput: the MODEL output first
        applied.append({"node": node, "display_name": schema.display_name, "inputs": inputs})
    if model is base:
        raise RuntimeError(f"{' then '.join(nodes)} returned the model unpatched (the peer did not see H3 blocks)")
    return model, applied


def describe(checkout, module, stock_attention) -> dict:
    """Where the peer came from (file hash, git commit) and the attention it calls (it must be stock's)."""
    path = check_checkout(checkout)
    attention = getattr(module, "optimized_attention", None)
    return {"checkout": str(path.parent.parent), "file": str(PEER_FILE),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "git_commit": _git_commit(path.parent.parent),
            "attention": getattr(attention, "__name__", repr(attention)),
            "same_attention_as_stock": attention is stock_attention}


def _git_commit(checkout: Path) -> str | None:
    """HEAD of the checkout when it is the top of its own git work tree."""
    try:
        out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    top_of_its_own = out.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == checkout.resolve()
    return lines[1] if top_of_its_own else None
