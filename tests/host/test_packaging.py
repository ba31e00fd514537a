"""Comfy Registry / ComfyUI-Manager metadata, and a pack that imports without optional kernels."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from host_fixtures import find_host

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
REQUIRED_DEPS = {"torch", "sageattention", "comfy-kitchen", "safetensors"}


def dep_name(spec: str) -> str:
    return re.split(r"[<>=!~ ;\[]", spec.strip(), maxsplit=1)[0].lower()


def requirements() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_registry_project_fields():
    assert PROJECT["name"] == "comfyui-sage-strided-nhd"
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*([-_.][A-Za-z0-9]+)*", PROJECT["name"]) and len(PROJECT["name"]) < 100
    assert PROJECT["version"] == "0.1.0"
    assert len(PROJECT["description"]) > 40
    assert PROJECT["license"] == {"file": "LICENSE"}
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")
    assert PROJECT["urls"]["Repository"].startswith("https://")


def test_registry_tool_comfy_fields():
    comfy = PYPROJECT["tool"]["comfy"]
    for key in ("PublisherId", "DisplayName", "Icon"):
        assert isinstance(comfy.get(key), str) and comfy[key].strip(), key
    assert comfy["Icon"].endswith("web/icon.svg") and (ROOT / "web" / "icon.svg").is_file()


def test_dependencies_torch_unpinned_and_no_frontend_pin():
    deps = PROJECT["dependencies"]
    assert {dep_name(d) for d in deps} == REQUIRED_DEPS
    assert "torch" in deps, "torch belongs to ComfyUI: list it without a version"
    assert not any(dep_name(d).startswith("comfyui-frontend") for d in deps + requirements())


def test_requirements_txt_matches_pyproject():
    assert sorted(requirements()) == sorted(PROJECT["dependencies"])


def test_pack_imports_without_sageattention_or_triton():
    """Both kernels missing: the pack still imports and says why they are unavailable."""
    host = find_host()
    if host is None:
        pytest.skip("no ComfyUI host (run scripts/setup_comfyui_host.sh or set COMFYUI_PATH)")
    code = f"""
import sys
sys.modules["sageattention"] = None   # makes `import sageattention` raise ImportError
sys.modules["triton"] = None
sys.path.insert(0, {str(ROOT / 'tests')!r})
sys.path.insert(0, {str(ROOT)!r})
from host_fixtures import import_pack
pack = import_pack(__import__("pathlib").Path({str(host)!r}))
assert [n.__name__ for n in pack.nodes.NODES] == ["SageStridedNHDAttention"], pack.nodes.NODES
from devkit.backends import describe_backends
status = {{b["name"]: b for b in describe_backends("cpu")}}
for name in ("sage2", "sage1"):
    assert not status[name]["available"] and status[name]["reason"], status[name]
assert status["sdpa"]["available"], status["sdpa"]
print("ok", status["sage2"]["reason"])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "COMFYUI_PATH": str(host)})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def test_executing_the_node_imports_no_optional_kernel_package(tmp_path):
    """Back-ends are probed when sampling starts, not when the node executes (flash-attn-4's import
    alone takes ~7 s). A stand-in ``flash_attn.cute`` on the path shows whether anything imports it
    (finding it imports only the empty parent package); sageattention cannot be checked this way, ComfyUI itself imports it at start-up."""
    host = find_host()
    if host is None:
        pytest.skip("no ComfyUI host (run scripts/setup_comfyui_host.sh or set COMFYUI_PATH)")
    stub = tmp_path / "flash_attn" / "cute"
    stub.mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (stub / "__init__.py").write_text("def flash_attn_func(*a, **k):\n    raise RuntimeError('stand-in')\n")
    code = f"""
import sys
sys.path.insert(0, {str(tmp_path)!r})
sys.path.insert(0, {str(ROOT / 'tests')!r})
from host_fixtures import import_pack, patcher_for, tiny_h3_model, tiny_wan_model
pack = import_pack(__import__("pathlib").Path({str(host)!r}))
import torch
torch.cuda.is_available = lambda: True  # as on an H200: where an fa4 probe would import it
torch.cuda.get_device_capability = lambda *a: (9, 0)
for backend in ("auto", "sage2", "fa4"):
    settings = pack.nodes.patch.Settings(layout="strided_nhd", backend=backend)
    pack.nodes.patch_any_model(patcher_for(tiny_h3_model()), settings)
    pack.nodes.patch_any_model(patcher_for(tiny_wan_model()), settings)
print("imported", sorted(m for m in sys.modules if m.startswith("flash_attn.cute")))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "COMFYUI_PATH": str(host)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "imported []" in proc.stdout, proc.stdout
