"""Import this pack the way ComfyUI imports a custom node pack: as a package with relative imports.

The repo's ``nodes/`` package must not become the top-level ``nodes`` module (that name is
ComfyUI's own), so the repo is mounted under a package name of its own. Its ``__init__.py`` (the
ComfyUI entry point) is not run: the benchmark only needs the patch function and ``kernels``.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sage_strided_nhd_pack"


def _package() -> types.ModuleType:
    pkg = sys.modules.get(PACKAGE)
    if pkg is None:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [str(REPO_ROOT)]
        pkg.__file__ = str(REPO_ROOT / "__init__.py")
        sys.modules[PACKAGE] = pkg
    return pkg


def kernels():
    _package()
    return importlib.import_module(f"{PACKAGE}.kernels")


def h3_patch():
    """The node's H3 patch module (needs comfy importable)."""
    _package()
    return importlib.import_module(f"{PACKAGE}.nodes.h3_patch")


def patch_model(model_patcher, layout: str, backend: str, patch_refiner: bool = True):
    """A clone of ``model_patcher`` patched exactly as the node patches it: (clone, summary)."""
    return h3_patch().patch_model(model_patcher, layout=layout, backend=backend, patch_refiner=patch_refiner)
