"""The frontend extension's source: registered once, text never put into HTML, names in step with
the node and the kernels, and the status-line formatting (node's own test runner)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WEB = ROOT / "web"
JS = {p.name: p.read_text(encoding="utf-8") for p in sorted(WEB.glob("*.js"))}


def js_string_constant(source: str, name: str) -> str:
    m = re.search(rf'export const {name} = "([^"]+)";', source)
    assert m, f"{name} not found"
    return m.group(1)


def test_one_extension_registered_once():
    calls = [name for name, src in JS.items() for _ in re.finditer(r"\bapp\.registerExtension\(", src)]
    assert calls == ["sage_strided_nhd.js"]


def test_web_directory_declared_once():
    init = (ROOT / "__init__.py").read_text(encoding="utf-8")
    assert re.search(r'^WEB_DIRECTORY = "\./web"$', init, re.M)
    comfy = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["comfy"]
    assert "web" not in {k.lower() for k in comfy}, "pyproject must not declare web too"


@pytest.mark.parametrize("name", sorted(JS))
def test_no_html_sinks(name):
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "DOMParser", "eval("):
        assert sink not in JS[name], f"{name} uses {sink}"


def test_event_name_matches_the_node():
    report_py = (ROOT / "nodes" / "report.py").read_text(encoding="utf-8")
    node_event = re.search(r'^REPORT_EVENT = "([^"]+)"$', report_py, re.M).group(1)
    assert js_string_constant(JS["report_text.js"], "REPORT_EVENT") == node_event


def test_node_type_matches_the_node():
    node_py = (ROOT / "nodes" / "sage_node.py").read_text(encoding="utf-8")
    assert f'node_id="{js_string_constant(JS["report_text.js"], "NODE_TYPE")}"' in node_py


def test_setting_offers_exactly_the_kernels_back_end_choices():
    from comfyui_sage_strided_nhd import kernels  # here only: the other checks read source files

    m = re.search(r"export const BACKEND_CHOICES = \[([^\]]*)\];", JS["report_text.js"])
    assert tuple(re.findall(r'"([^"]+)"', m.group(1))) == tuple(kernels.BACKEND_CHOICES)


def test_status_formatting_unit_tests():
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail("CI=true and node is not installed (apt-get install nodejs): the status formatting is untested")
        pytest.skip("node is not installed (apt-get install nodejs)")
    proc = subprocess.run([node, "--test", "tests/browser/report_text.test.mjs"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^# pass [1-9]", proc.stdout, re.M) and re.search(r"^# fail 0$", proc.stdout, re.M)


def payload_doc() -> str:
    """The UI payload as documented in docs/ARCHITECTURE.md ("The run report")."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8").split("\n## The run report\n")[1]
    return doc.split("```")[1]


def report_payload_keys() -> list[str]:
    """Top-level keys of the UI payload as documented."""
    doc = payload_doc()
    first = re.search(r'^( +)"schema":', doc, re.M)
    assert first, "payload schema not found in docs/ARCHITECTURE.md"
    return re.findall(rf'^{first.group(1)}"(\w+)":', doc, re.M)


def test_every_report_key_is_shown_or_deliberately_not():
    keys = report_payload_keys()
    assert {"backends_ran", "fallbacks", "status"} <= set(keys), keys
    not_shown = set(re.findall(r"^  (\w+): \"", JS["report_text.js"].split("KEYS_NOT_SHOWN = {")[1].split("};")[0], re.M))
    source = JS["report_text.js"] + JS["sage_strided_nhd.js"]
    unhandled = [k for k in keys if k not in not_shown and not re.search(rf"\.{k}\b", source)]
    assert not unhandled, f"report keys neither rendered by web/report_text.js nor in KEYS_NOT_SHOWN: {unhandled}"


def js_object_block(source: str, name: str) -> str:
    """The body of ``export const NAME = { ... };`` in a JS source."""
    m = re.search(rf"^export const {name} = \{{\n(.*?)^\}};$", source, re.M | re.S)
    assert m, f"{name} not found"
    return m.group(1)


def python_dict_constant(path: Path, name: str) -> dict:
    """A module-level dict literal, read with ast: no import of the runtime (torch, ComfyUI) needed."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {path}")


def test_reason_labels_mirror_the_kernels_reason_codes():
    codes = python_dict_constant(ROOT / "kernels" / "backends" / "base.py", "REASON_CODES")
    assert codes and all(isinstance(k, str) and isinstance(v, str) for k, v in codes.items())
    labels = {}
    for line in js_object_block(JS["report_text.js"], "REASON_LABELS").splitlines():
        if not line.strip():
            continue
        m = re.fullmatch(r'  (\w+): "([^"\\]*)",', line)
        assert m, f"REASON_LABELS line not in the form `  code: \"label\",`: {line!r}"
        assert m.group(1) not in labels, f"REASON_LABELS lists {m.group(1)} twice"
        labels[m.group(1)] = m.group(2)
    assert sorted(labels) == sorted(codes), "REASON_LABELS (web/report_text.js) and REASON_CODES (kernels) name different codes"
    assert labels == codes, "REASON_LABELS and REASON_CODES give different labels"


def test_reasons_are_looked_up_not_parsed():
    """The short forms come from the codes: no regex runs over the Python side's sentences."""
    src = JS["report_text.js"]
    assert "SHORT_REASONS" not in src
    calls = re.findall(r"(\w*)\.(?:match|matchAll|test|exec|search)\(", src)
    assert all(c == "TEMPLATE_NAME" for c in calls), f"regex calls in report_text.js: {calls}"
    for gone in ("copies_avoided_per_call", "remaining_copies", "formatCopiesAvoided", "asObject", "fast_path"):
        assert gone not in src, f"schema-1/2 leftover in web/report_text.js: {gone}"


def test_keys_not_shown_are_keys_of_the_schema():
    not_shown = set(re.findall(r"^  (\w+): \"", js_object_block(JS["report_text.js"], "KEYS_NOT_SHOWN"), re.M))
    assert not_shown, "KEYS_NOT_SHOWN not parsed"
    stale = not_shown - set(report_payload_keys())
    assert not stale, f"KEYS_NOT_SHOWN names keys the payload no longer has: {sorted(stale)}"


def test_longest_report_fixture_is_a_payload_of_the_documented_schema():
    fixture = json.loads((ROOT / "tests" / "browser" / "fixtures" / "longest_report.json").read_text(encoding="utf-8"))
    assert fixture.pop("_comment")
    assert list(fixture) and set(fixture) == set(report_payload_keys()), \
        sorted(set(fixture) ^ set(report_payload_keys()))
    assert fixture["schema"] == int(re.search(r'^ +"schema": (\d+),', payload_doc(), re.M).group(1))
    codes = python_dict_constant(ROOT / "kernels" / "backends" / "base.py", "REASON_CODES")
    for key in ("fallbacks", "skipped", "prepared_skipped"):
        for entry in fixture[key]:
            assert entry["code"] in codes and entry["reason"], (key, entry)
    assert all(isinstance(n, dict) and n["code"] and n["text"] for n in fixture["notes"])


def test_status_box_has_a_fixed_height_and_never_resizes_the_node():
    src = JS["sage_strided_nhd.js"]
    assert "setSize" not in src, "the status must not grow the node (it would leave its group in the workflows)"
    assert re.search(r"getMinHeight: \(\) => STATUS_BOX_PX \+ 2 \* MARGIN_PX", src)
    assert re.search(r"getMaxHeight: \(\) => STATUS_BOX_PX \+ 2 \* MARGIN_PX", src)
    assert 'overflowY: "auto"' in src and 'pointerEvents: "auto"' in src, "a long report must scroll"
    assert "el.title = body" in src, "the whole report must be the tooltip"
    # Nodes 2.0 sizes the node around its content: the box's own height is fixed, not 100% of a frame
    for prop in ("height", "minHeight", "maxHeight"):
        assert re.search(rf"^    {prop}: `\$\{{STATUS_BOX_PX\}}px`,$", src, re.M), prop
    assert 'height: "100%"' not in src
    # ... and hands the wheel to the canvas unless the focused element under the pointer captures it
    assert 'el.dataset.captureWheel = "true"' in src and "el.tabIndex = -1" in src


def test_kitchen_route_labels_cover_the_reports_routes():
    routes = python_dict_constant(ROOT / "nodes" / "report.py", "KITCHEN_ROUTES")
    labels = set(re.findall(r"^  (\w+): \"", js_object_block(JS["report_text.js"], "KITCHEN_ROUTE_LABELS"), re.M))
    assert labels and labels == set(routes), (sorted(labels), sorted(routes))


def test_a_route_that_did_not_run_reads_the_same_in_the_log_and_the_status_box():
    """Where no int8 linear took the route (a CPU), both say so in the same words, for the same routes."""
    texts = python_dict_constant(ROOT / "nodes" / "report.py", "KITCHEN_UNRUN")
    labels = dict(re.findall(r'^  (\w+): "([^"]+)",$', js_object_block(JS["report_text.js"], "KITCHEN_UNRUN_LABELS"), re.M))
    assert labels and labels == texts, (labels, texts)
    assert set(texts) < set(python_dict_constant(ROOT / "nodes" / "report.py", "KITCHEN_ROUTES"))
    assert not any("verified for the int8 route" in t for t in texts.values())


def test_a_run_with_no_model_call_reads_the_same_in_the_log_the_status_box_and_the_help_page():
    """The node ran but no sampling run used its model (denoise 0): the log line, the box's line and the help page
    say it in the same words."""
    logged = python_dict_constant(ROOT / "nodes" / "report.py", "NO_MODEL_CALLS")  # a str literal reads the same way
    m = re.search(r"^export const NO_MODEL_CALLS = ((?:\s*\+?\s*\"[^\"]*\")+);$", JS["report_text.js"], re.M)
    assert m, "NO_MODEL_CALLS not found in report_text.js"
    shown = "".join(re.findall(r'"([^"]*)"', m.group(1)))
    assert shown == logged and "denoise 0" in logged, (shown, logged)
    assert "`ran: ${NO_MODEL_CALLS}`" in JS["report_text.js"]
    assert f"`ran: {logged.split(' (')[0]}" in HELP.read_text(encoding="utf-8")


def test_int8_layout_labels_are_the_reports():
    """The route's layouts read the same in the log and the status box (int8 ConvRot, W4A8)."""
    names = python_dict_constant(ROOT / "nodes" / "report.py", "INT8_LAYOUTS")
    labels = dict(re.findall(r'^  (\w+): "([^"]+)",$', js_object_block(JS["report_text.js"], "INT8_LAYOUT_LABELS"), re.M))
    assert labels == names and set(names) == {"TensorWiseINT8Layout", "AsymW4A8Int8Layout"}, (labels, names)


def test_gemm_kernel_labels_cover_the_reports_kernels():
    kernels = python_dict_constant(ROOT / "nodes" / "report.py", "GEMM_KERNELS")
    labels = set(re.findall(r"^  (\w+): \"", js_object_block(JS["report_text.js"], "GEMM_KERNEL_LABELS"), re.M))
    assert labels and labels == set(kernels), (sorted(labels), sorted(kernels))


# --- the node's help page (web/docs/<node id>.md, ComfyUI's node docs panel) ----------------------------------------
HELP = WEB / "docs" / "SageStridedNHDAttention.md"


def status_line_starts() -> set[str]:
    """The fixed start of every line the status box can show: each pushed line's text up to its first ``${``, the
    headlines, and the idle states of the extension."""
    src = JS["report_text.js"] + JS["sage_strided_nhd.js"]
    starts = {m.group(2).split("${")[0] for m in re.finditer(r'(?:lines|details)\.push\(\s*([`"])((?:(?!\1).)*)\1', src)}
    starts |= {m.group(2).split("${")[0]
               for m in re.finditer(r'showStatus\([^,]+,\s*"\w+",\s*\[\s*([`"])((?:(?!\1).)*)\1', src)}
    starts |= set(re.findall(r'return "(run \w+: [^"]+)";', src))
    return {s.rstrip(" ×") for s in starts if len(s.strip()) > 3} | COMPOSED_LINES


# lines report_text.js composes from parts (the extractor above sees only a line's literal start)
COMPOSED_LINES = {"fallback from", "to ComfyUI attention", "fell back:", "was skipped:",
                  "why calls went to ComfyUI attention:", "why the int8 route is off:",
                  "why not the warp-specialised int8 GEMM:", "why comfy-kitchen's int8 GEMM runs:", "compiled in",
                  "compiled for", "blocks + ", "attention override", "model call needed:",
                  "of stock's video embedding handed back", "linears on the pack's quantiser:"}


def test_help_page_names_every_input_with_its_values():
    text = HELP.read_text(encoding="utf-8")
    schema = (ROOT / "nodes" / "sage_node.py").read_text(encoding="utf-8")
    inputs = re.findall(r'io\.\w+\.Input\("(\w+)"', schema)
    assert inputs == ["model", "layout", "backend", "patch_text_refiner", "sage2_prep", "block_path"], inputs
    section = text.split("## Inputs")[1].split("\n## ")[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^- \*\*`(\w+)`\*\*.*(?:\n  .*)*", section, re.M)}
    assert set(inputs) <= set(rows), sorted(set(inputs) - set(rows))
    from comfyui_sage_strided_nhd import kernels
    tree = ast.parse((ROOT / "nodes" / "patch.py").read_text(encoding="utf-8"))  # nodes/ imports ComfyUI: read it
    (BLOCK_PATHS,) = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "BLOCK_PATHS" for t in n.targets)]
    for name, values in (("layout", kernels.LAYOUTS), ("backend", kernels.BACKEND_CHOICES),
                         ("sage2_prep", tuple(kernels.PREPARED_MODES)), ("block_path", BLOCK_PATHS)):
        assert all(f"`{v}`" in rows[name] for v in values), (name, values, rows[name])


def test_help_page_explains_every_line_the_status_box_can_show():
    text = HELP.read_text(encoding="utf-8")
    starts = status_line_starts()
    assert len(starts) > 20, sorted(starts)
    missing = sorted(s for s in starts if s not in text)
    assert not missing, f"status lines the help page does not explain: {missing}"
    labels = {}
    for table in ("REASON_LABELS", "KITCHEN_ROUTE_LABELS", "KITCHEN_UNRUN_LABELS", "GEMM_KERNEL_LABELS",
                  "INT8_LAYOUT_LABELS"):
        labels[table] = re.findall(r'^  \w+: "([^"]+)",$', js_object_block(JS["report_text.js"], table), re.M)
    missing = {t: [label for label in found if label not in text] for t, found in labels.items()}
    assert all(labels.values()) and not any(missing.values()), missing
