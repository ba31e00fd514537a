"""Fixtures shared by the host tests (a module may override them)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def pack(comfy_inprocess):
    """The pack with ComfyUI importable in this process (CPU)."""
    return comfy_inprocess
