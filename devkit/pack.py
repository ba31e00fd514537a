"""Import the repository as the package ComfyUI would load, under one name everywhere.

The repo's ``nodes/`` must never become the top-level ``nodes`` module (that is ComfyUI's), so
the pack is mounted as ``comfyui_sage_strided_nhd``. Its ``__init__.py`` has no side effects
(ComfyUI imports happen inside the entry point), so importing it needs no ComfyUI.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACK_MODULE = "comfyui_sage_strided_nhd"


def import_pack():
    """The pack package (``.kernels`` importable at once; ``.nodes`` needs ComfyUI importable)."""
    module = sys.modules.get(PACK_MODULE)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(PACK_MODULE, REPO_ROOT / "__init__.py",
                                                  submodule_search_locations=[str(REPO_ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_MODULE] = module
    spec.loader.exec_module(module)
    return module


def submodule(name: str):
    """A module of the pack by its dotted name inside it, e.g. ``kernels`` or ``nodes.h3_patch``."""
    import_pack()
    return importlib.import_module(f"{PACK_MODULE}.{name}")


def kernels():
    return submodule("kernels")
