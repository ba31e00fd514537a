"""Shared test setup: the repo root on sys.path, the pack importable under its one name, shared fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from devkit.pack import import_pack  # noqa: E402

import_pack()  # the pack is importable as comfyui_sage_strided_nhd in every test


@pytest.fixture
def gen():
    """A fresh seeded generator per test: every check draws its own random inputs."""
    g = torch.Generator().manual_seed(1234)
    return g
