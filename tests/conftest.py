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


def pytest_collection_modifyitems(session, config, items):
    from host_fixtures import uses_a_run_ahead

    items.sort(key=uses_a_run_ahead)  # stable: the tests that wait for a run started ahead last, in their order


def pytest_collection_finish(session):
    from host_fixtures import start_runs_ahead

    if not session.config.option.collectonly:
        start_runs_ahead(session.items)


def pytest_sessionfinish(session, exitstatus):
    from host_fixtures import finish_runs_ahead

    finish_runs_ahead()


def pytest_configure(config):
    config.addinivalue_line("markers", "aot: the ahead-of-time builds for every architecture (CI's own step, "
                                       ".ci/run; scripts/test.sh runs the rest)")


@pytest.fixture
def gen():
    """A fresh seeded generator per test: every check draws its own random inputs."""
    g = torch.Generator().manual_seed(1234)
    return g


# --- a real ComfyUI (host tests and the browser test) ----------------------------------------------
@pytest.fixture(scope="session")
def comfy_inprocess():
    """ComfyUI importable in this process (CPU, PyTorch attention) and the pack with its nodes."""
    from host_fixtures import import_comfy, import_pack, require_host

    host = require_host()
    try:
        import_comfy(host)
        pack = import_pack(host)
    except Exception as exc:  # a broken host is a failure, not a skip
        pytest.fail(f"ComfyUI at {host} found but not importable: {type(exc).__name__}: {exc}")
    # The block fast path's token chunks need GEMMs whose rows do not depend on the row count: CUDA's
    # (tests/gpu), and PyTorch's own CPU GEMM, not oneDNN's (on AMX CPUs). In this process the CPU is
    # such a device, so the chunked paths run here and their bits are checked against stock's.
    torch.backends.mkldnn.enabled = False
    pack.nodes.chunking.CHUNKED_DEVICES = ("cuda", "cpu")
    return pack


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory):
    """One real ComfyUI server per test session on 127.0.0.1 with the pack and the helper nodes."""
    from host_fixtures import require_host, start_server

    server = start_server(require_host(), tmp_path_factory.mktemp("comfyui"))
    yield server
    server.stop()
