"""Shared test setup: the repo root on sys.path, and small builders for attention inputs."""

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


def make_rope_table(seq: int, rot_dim: int, dtype=torch.float32, device="cpu", generator=None):
    """[1, S, 1, rot/2, 2, 2] rotation matrices [[cos, -sin], [sin, cos]] at random angles."""
    angles = torch.rand(seq, rot_dim // 2, generator=generator, dtype=torch.float64) * 6.28
    c, s = angles.cos(), angles.sin()
    table = torch.stack([c, -s, s, c], dim=-1).reshape(1, seq, 1, rot_dim // 2, 2, 2)
    return table.to(dtype=dtype, device=device)


@pytest.fixture
def gen():
    """A fresh seeded generator per test: every check draws its own random inputs."""
    g = torch.Generator().manual_seed(1234)
    return g
