"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import sys

import pytest
import torch


@pytest.fixture(scope="module")
def kitchen_pack():
    """The pack with its kernels imported, where comfy-kitchen (stock's kernels, the reference) is installed."""
    if importlib.util.find_spec("comfy_kitchen") is None:
        pytest.skip("needs comfy-kitchen")
    from devkit.pack import import_pack

    pack = import_pack()
    importlib.import_module(pack.__name__ + ".kernels")
    return pack


@pytest.fixture(autouse=True)
def release_device_memory():
    """After each test: drop the traceback pytest keeps of a failure (``sys.last_*``, for post-mortem
    debugging), which holds the failed test's frames and so its GPU tensors, and return the cached
    blocks. One test running out of memory then does not run the next ones out of memory too."""
    yield
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
