"""The frontend extension in a real browser: headless Chromium (Debian's) driven by playwright-core,
against a real ComfyUI server with the pack installed. The checks themselves are in
tests/browser/ui_test.mjs; screenshots and results.json land in test-artifacts/browser/<mode>/.
Each check runs in both of the frontend's canvas modes: the classic canvas and "Modern Node Design
(Nodes 2.0)", where nodes are DOM elements laid out around their content.

Without Chromium, node or the npm packages (``npm ci`` in tests/browser), or without a ComfyUI host:
skipped with the reason, except under CI (``CI=true``), where that is a failure with the reason:
the browser test is the proof that the node's status reads cleanly in the real frontend.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from host_fixtures import h3_graph, patch_inputs

ROOT = Path(__file__).resolve().parents[2]
BROWSER_DIR = ROOT / "tests" / "browser"
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(reason: str):
    """A missing tool: a failure under CI, a skip elsewhere."""
    if in_ci():
        pytest.fail(f"CI=true and the browser test cannot run: {reason}")
    pytest.skip(reason)


def browser_tools_or_skip() -> str:
    node = shutil.which("node")
    if node is None:
        missing("node is not installed (apt-get install nodejs)")
    if not Path(CHROMIUM).exists():
        missing(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)")
    if not (BROWSER_DIR / "node_modules" / "playwright-core").is_dir():
        missing("playwright-core is not installed: run `npm ci` in tests/browser")
    return node


@pytest.mark.parametrize("mode", ["classic", "nodes2"])
def test_extension_in_headless_chromium(comfy_server, tmp_path, mode):
    node = browser_tools_or_skip()
    artifacts = ARTIFACTS / mode
    # a nonce per mode: the same prompt again would come from ComfyUI's cache, with no run and no report
    graph = h3_graph(patch=patch_inputs(layout="strided_nhd", backend="auto"), name=f"browser_small_graph_{mode}")
    graph_file = tmp_path / "small_graph.json"
    graph_file.write_text(json.dumps(graph))
    if artifacts.exists():
        shutil.rmtree(artifacts)
    proc = subprocess.run(
        [node, str(BROWSER_DIR / "ui_test.mjs"), "--url", comfy_server.url, "--graph", str(graph_file),
         "--workflows", str(ROOT / "workflows"), "--out", str(artifacts), "--chromium", CHROMIUM,
         "--mode", mode],
        cwd=BROWSER_DIR, capture_output=True, text=True, timeout=480)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"browser checks failed:\n{report}\nserver log:\n{comfy_server.log_tail(30)}"
    results = json.loads((artifacts / "results.json").read_text())
    assert results["mode"] == mode and results["checks"] and all(c["ok"] for c in results["checks"])
    assert (artifacts / "after-run.png").stat().st_size > 10_000
    # every bundled workflow had its layout, inputs and A/B widget checked in this mode
    names = [wf.stem for wf in sorted((ROOT / "workflows").glob("*.json"))]
    for name in names:
        for what in ("the A/B widget (layout) shows", "no two node boxes intersect", "can be reached",
                     "every line of the status can be read"):
            assert any(c["name"].startswith(f"{mode} {name}") and what in c["name"] for c in results["checks"]), \
                (name, what)
    if mode == "nodes2":  # the advanced inputs hide behind the button, and were reached through it
        assert all(results["advanced"][f"{mode} {n}"]["hiddenUntilAsked"] == ["sage2_prep", "block_path"]
                   for n in names), results["advanced"]
    # one screenshot per bundled workflow, with the longest report on the node
    for wf in sorted((ROOT / "workflows").glob("*.json")):
        shot = artifacts / f"workflow-{re.sub(r'[^a-z0-9]+', '-', wf.stem.lower()).strip('-')}.png"
        assert shot.is_file() and shot.stat().st_size > 10_000, f"no screenshot {shot.name}"


def test_help_page_in_the_node_docs_panel(comfy_server):
    """The node's help page (web/docs/SageStridedNHDAttention.md) as ComfyUI's frontend finds it: served from the
    pack's web directory at the URL the frontend builds from the node's python_module, and rendered in the node
    docs panel that the selection toolbox's info button opens (tests/browser/help_page.mjs)."""
    node = browser_tools_or_skip()
    artifacts = ARTIFACTS / "help"
    if artifacts.exists():
        shutil.rmtree(artifacts)
    proc = subprocess.run([node, str(BROWSER_DIR / "help_page.mjs"), "--url", comfy_server.url, "--out", str(artifacts),
                           "--chromium", CHROMIUM], cwd=BROWSER_DIR, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"help page checks failed:\n{proc.stdout}{proc.stderr}\nserver log:\n" \
                                 f"{comfy_server.log_tail(30)}"
    results = json.loads((artifacts / "results.json").read_text())
    assert len(results["checks"]) == 6 and all(c["ok"] for c in results["checks"]), results["checks"]
    assert results["helpRequests"][-1] == "200 /extensions/comfyui-sage-strided-nhd/docs/SageStridedNHDAttention.md"
    assert (artifacts / "help-panel.png").stat().st_size > 10_000
