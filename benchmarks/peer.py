"""The peer: KJNodes' MiniMax H3 patches, from a ComfyUI-KJNodes checkout named at run time.

None of the peer's code is in this repository. ``--kjnodes DIR`` names a checkout of
kijai/ComfyUI-KJNodes; its ``nodes/minimax_nodes.py`` is imported by file path, under stub packages
for the checkout and its ``nodes/`` folder: the file's own imports (comfy, comfy_api, server, a
relative import of a sibling module) resolve in the benchmark's ComfyUI, and the KJ pack's
``__init__.py`` (which imports every node of the pack) never runs.

Each variant is made as a graph makes it: the node's ``execute`` on the stock ModelPatcher (then the
next node's on that output), every input at the node's own default, read from its schema.
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
# variant -> the peer's nodes, chained in this order on the stock model
VARIANTS = {"kj_lowvram": (LOW_VRAM,), "kj_lowvram_chunkff": (LOW_VRAM, CHUNK_FF)}


def check_checkout(checkout) -> Path:
    """``checkout/nodes/minimax_nodes.py``, or FileNotFoundError saying what is missing."""
    path = Path(checkout).expanduser().resolve() / PEER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {PEER_FILE} under {checkout} (expected a ComfyUI-KJNodes checkout)")
    return path


def _stub_package(name: str, folder: Path) -> None:
    """An empty package whose submodules are found in ``folder``; its ``__init__.py`` is not run."""
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_loader(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    module.__path__ = [str(folder)]
    sys.modules[name] = module


def load_module(checkout):
    """The peer's ``minimax_nodes`` module (needs ComfyUI imported first: it imports comfy at the top)."""
    path = check_checkout(checkout)
    name = f"{PACKAGE}.nodes.minimax_nodes"
    if name in sys.modules:
        return sys.modules[name]
    _stub_package(PACKAGE, path.parent.parent)
    _stub_package(f"{PACKAGE}.nodes", path.parent)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def node_defaults(node_cls) -> dict:
    """The node's inputs other than the model, at their schema defaults (what a new node starts with)."""
    schema = node_cls.define_schema()
    return {i.id: i.default for i in schema.inputs
            if i.id != "model" and getattr(i, "default", None) is not None}


def make_variant(module, base, nodes: tuple[str, ...]):
    """``(patched clone, [{node, display_name, inputs}])``: each node's ``execute`` on the previous output."""
    model, applied = base, []
    for node in nodes:
        cls = getattr(module, node)
        inputs = node_defaults(cls)
        model = cls.execute(model, **inputs)[0]  # io.NodeOutput: the MODEL output first
        applied.append({"node": node, "display_name": cls.define_schema().display_name, "inputs": inputs})
    if model is base:
        raise RuntimeError(f"{' then '.join(nodes)} returned the model unpatched (the peer did not see H3 blocks)")
    return model, applied


def make_variants(module, base) -> tuple[dict, dict]:
    """``({variant: clone}, {variant: nodes applied})`` for every variant in ``VARIANTS``."""
    clones, applied = {}, {}
    for name, nodes in VARIANTS.items():
        clones[name], applied[name] = make_variant(module, base, nodes)
    return clones, applied


def describe(checkout, module, stock_attention) -> dict:
    """Where the peer came from (file hash, git commit when the checkout is a git work tree) and the
    attention its forwards call: it must be the function stock ComfyUI's H3 calls."""
    path = check_checkout(checkout)
    attention = getattr(module, "optimized_attention", None)
    return {"checkout": str(path.parent.parent), "file": str(PEER_FILE),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "git_commit": _git_commit(path.parent.parent),
            "attention": getattr(attention, "__name__", repr(attention)),
            "same_attention_as_stock": attention is stock_attention}


def _git_commit(checkout: Path) -> str | None:
    """HEAD of the checkout when it is the top of its own git work tree (not a folder inside another repo)."""
    try:
        out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != checkout.resolve():
        return None
    return lines[1]
