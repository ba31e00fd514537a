"""Fixtures shared by the host tests (a module may override them)."""

from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module")
def pack(comfy_inprocess):
    """The pack with ComfyUI importable in this process (CPU)."""
    return comfy_inprocess


@pytest.fixture(scope="module")
def cur(pack):
    """The current-ComfyUI stand-ins (tests/current_comfyui_standins.py), importable once the host is."""
    return importlib.import_module("current_comfyui_standins")
