"""What a published package or a ComfyUI-Manager scan of the repository sees: the runtime, the web
extension and the workflows, and one node."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_TOP_LEVEL = {"__init__.py", "nodes", "kernels", "web", "workflows", "pyproject.toml", "requirements.txt",
                     "README.md", "LICENSE", "node_list.json"}


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def ignore_patterns() -> list[str]:
    lines = (ROOT / ".comfyignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    # gitwildmatch as comfy-cli applies it, for the forms used here: "dir/" and file names
    for p in patterns:
        if p.endswith("/") and (path.startswith(p) or f"/{p}" in f"/{path}"):
            return True
        if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(Path(path).name, p):
            return True
    return False


def test_published_archive_holds_only_the_runtime_web_and_workflows():
    patterns = ignore_patterns()
    shipped = [f for f in tracked_files() if not ignored(f, patterns)]
    tops = {f.split("/", 1)[0] for f in shipped}
    assert tops <= SHIPPED_TOP_LEVEL, f"would ship: {sorted(tops - SHIPPED_TOP_LEVEL)}"
    assert {"__init__.py", "nodes", "kernels", "web", "workflows"} <= tops
    assert not [f for f in shipped if f.startswith(("tests/", "benchmarks/", "devkit/", "scripts/"))]


# The patterns ComfyUI-Manager's scanner applies to every .py file of a repository, plus its node_list.json.
MAPPING_PATTERNS = [r"_CLASS_MAPPINGS\s*=\s*{", r"^[^=]*_CLASS_MAPPINGS\[[\"']", r"@register_node\("]


def test_a_manager_scan_credits_the_pack_with_its_one_node():
    hits = []
    for f in tracked_files():
        if f.endswith(".py"):
            text = (ROOT / f).read_text(encoding="utf-8")
            hits += [f for p in MAPPING_PATTERNS if re.search(p, text, re.MULTILINE)]
    assert hits == [], f"a scan would credit the pack with node mappings in {sorted(set(hits))}"
    listed = json.loads((ROOT / "node_list.json").read_text())
    assert list(listed) == ["SageStridedNHDAttention"]
