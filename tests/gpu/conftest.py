"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import importlib
import importlib.util

import pytest


@pytest.fixture(scope="module")
def kitchen_pack():
    """The pack with its kernels imported, where comfy-kitchen (stock's kernels, the reference) is installed."""
    if importlib.util.find_spec("comfy_kitchen") is None:
        pytest.skip("needs comfy-kitchen")
    from devkit.pack import import_pack

    pack = import_pack()
    importlib.import_module(pack.__name__ + ".kernels")
    return pack
