"""The bundled workflows: the four reference A/B runs, in UI and API format.

Static checks need nothing but the JSON. The checks against a real ComfyUI (its /object_info and
/workflow_templates) use the host fixtures and are skipped, with the reason, when there is no host.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from pathlib import Path

import pytest



ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "workflows"
API_DIR = WORKFLOWS / "api"
# ComfyUI 0.33's template browser shows a custom node's template by its file name alone (as the
# card title, one line, cut with an ellipsis where it does not fit), so the names read as short titles:
# "H3 2-step strided NHD" and its A/B twin "H3 2-step HND".
NAME = re.compile(r"^H3 (?P<steps>\d+)-step (?P<layout>strided NHD|HND)$")
LAYOUT_OF = {"strided NHD": "strided_nhd", "HND": "hnd"}
LAYOUT_NAME = {v: k for k, v in LAYOUT_OF.items()}


def workflow_name(steps: int, layout: str) -> str:
    """The file stem of the bundled workflow for ``steps`` and ``layout`` ("strided_nhd" | "hnd")."""
    return f"H3 {steps}-step {LAYOUT_NAME[layout]}"

OUR_NODE = "SageStridedNHDAttention"
FRONTEND_ONLY = {"MarkdownNote", "Note", "PrimitiveNode", "Reroute"}
REFERENCE = {"seed": 440420, "width": 1344, "height": 768, "length": 124, "fps": 24}
OFFICIAL_MODELS = {
    "UNETLoader": {"unet_name": "minimax_h3_fl2va_pruned_int8_convrot.safetensors"},
    "CLIPLoader": {"clip_name": "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "type": "minimax"},
}
OFFICIAL_VAES = {"minimax_h3_video_vae_fp16.safetensors", "minimax_h3_audio_vae_fp32.safetensors"}
TEMPLATE_NODE_SET = {
    "UNETLoader", "CLIPLoader", "VAELoader", "MiniMaxH3ImageToVideo", "BasicGuider", "RandomNoise",
    "KSamplerSelect", "BasicScheduler", "SamplerCustomAdvanced", "VAEDecode", "VAEDecodeAudio",
    "CreateVideo", "SaveVideo",
}
EXPECTED = {(2, "strided_nhd"), (2, "hnd"), (12, "strided_nhd"), (12, "hnd")}


def ui_files():
    return sorted(WORKFLOWS.glob("*.json"))


def api_files():
    return sorted(API_DIR.glob("*.json"))


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def parse_name(path: Path) -> tuple[int, str]:
    m = NAME.match(path.stem)
    assert m, f"{path.name}: name must say steps and layout, like 'H3 12-step strided NHD.json'"
    return int(m["steps"]), LAYOUT_OF[m["layout"]]


def api_nodes_of(api: dict, class_type: str) -> list[dict]:
    return [n for n in api.values() if n["class_type"] == class_type]


def one(api: dict, class_type: str) -> dict:
    found = api_nodes_of(api, class_type)
    assert len(found) == 1, f"expected one {class_type}, found {len(found)}"
    return found[0]["inputs"]


# --- static: the set of files ---------------------------------------------------------------------

def test_four_reference_runs_in_both_formats():
    ui = {parse_name(p) for p in ui_files()}
    api = {parse_name(p) for p in api_files()}
    assert ui == EXPECTED, f"UI workflows: {sorted(ui)}"
    assert api == EXPECTED, f"API workflows: {sorted(api)}"
    assert [p.name for p in ui_files()] == [p.name for p in api_files()]


@pytest.mark.parametrize("path", api_files(), ids=lambda p: p.stem)
def test_api_workflow_reproduces_the_named_reference_run(path):
    steps, layout = parse_name(path)
    api = load(path)
    assert {n["class_type"] for n in api.values()} == TEMPLATE_NODE_SET | {OUR_NODE}
    assert one(api, "RandomNoise")["noise_seed"] == REFERENCE["seed"]
    cond = one(api, "MiniMaxH3ImageToVideo")
    assert (cond["width"], cond["height"], cond["length"]) == (
        REFERENCE["width"], REFERENCE["height"], REFERENCE["length"])
    assert one(api, "CreateVideo")["fps"] == REFERENCE["fps"]
    sched = one(api, "BasicScheduler")
    assert sched["steps"] == steps and sched["denoise"] == 1.0
    ours = one(api, OUR_NODE)
    assert ours["layout"] == layout
    for loader, expected in OFFICIAL_MODELS.items():
        inputs = one(api, loader)
        for key, value in expected.items():
            assert inputs[key] == value, f"{loader}.{key}"
    assert {n["inputs"]["vae_name"] for n in api_nodes_of(api, "VAELoader")} == OFFICIAL_VAES


@pytest.mark.parametrize("path", api_files(), ids=lambda p: p.stem)
def test_api_workflow_puts_our_node_between_loader_and_guider_and_scheduler(path):
    api = load(path)
    [(our_id, ours)] = [(k, n) for k, n in api.items() if n["class_type"] == OUR_NODE]
    loader_id = next(k for k, n in api.items() if n["class_type"] == "UNETLoader")
    assert ours["inputs"]["model"] == [loader_id, 0]
    for consumer in ("BasicGuider", "BasicScheduler"):
        assert one(api, consumer)["model"] == [our_id, 0], f"{consumer} must take the patched model"
    # nothing else sees the unpatched model
    users = [k for k, n in api.items() for v in n["inputs"].values() if v == [loader_id, 0]]
    assert users == [our_id]


def test_ab_twins_differ_only_in_layout_and_output_name():
    for steps in (2, 12):
        a = load(API_DIR / f"{workflow_name(steps, 'strided_nhd')}.json")
        b = load(API_DIR / f"{workflow_name(steps, 'hnd')}.json")
        assert a.keys() == b.keys()
        diffs = sorted((a[k]["class_type"], name) for k in a for name in a[k]["inputs"]
                       if a[k]["inputs"][name] != b[k]["inputs"].get(name))
        assert diffs == [(OUR_NODE, "layout"), ("SaveVideo", "filename_prefix")], diffs
        assert one(a, "SaveVideo")["filename_prefix"] != one(b, "SaveVideo")["filename_prefix"]


def test_2_and_12_step_runs_differ_only_in_steps_and_output_name():
    for layout in ("strided_nhd", "hnd"):
        a = load(API_DIR / f"{workflow_name(2, layout)}.json")
        b = load(API_DIR / f"{workflow_name(12, layout)}.json")
        diffs = sorted((a[k]["class_type"], name) for k in a for name in a[k]["inputs"]
                       if a[k]["inputs"][name] != b[k]["inputs"].get(name))
        assert diffs == [("BasicScheduler", "steps"), ("SaveVideo", "filename_prefix")], diffs


# --- static: UI format ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", ui_files(), ids=lambda p: p.stem)
def test_ui_links_are_consistent(path):
    wf = load(path)
    nodes = {n["id"]: n for n in wf["nodes"]}
    assert len(nodes) == len(wf["nodes"]), "duplicate node ids"
    assert wf["last_node_id"] >= max(nodes)
    link_ids = [link[0] for link in wf["links"]]
    assert len(set(link_ids)) == len(link_ids), "duplicate link ids"
    assert wf["last_link_id"] >= max(link_ids)
    for link_id, src, src_slot, dst, dst_slot, typ in wf["links"]:
        assert src in nodes and dst in nodes, f"link {link_id} joins missing nodes"
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        assert link_id in out["links"], f"link {link_id} missing from node {src} output {out['name']}"
        assert inp["link"] == link_id, f"link {link_id} missing from node {dst} input {inp['name']}"
        assert out["type"] == inp["type"] == typ, f"link {link_id}: {out['type']} -> {inp['type']} as {typ}"
    # and the reverse: every link a node claims is in the list
    for n in wf["nodes"]:
        for out in n.get("outputs", []):
            for link_id in out.get("links") or []:
                assert link_id in link_ids, f"node {n['id']} claims unknown link {link_id}"
        for inp in n.get("inputs", []):
            if inp.get("link") is not None:
                assert inp["link"] in link_ids, f"node {n['id']} input {inp['name']} has unknown link"


@pytest.mark.parametrize("path", ui_files(), ids=lambda p: p.stem)
def test_ui_workflow_explains_the_ab_and_the_sampler_choice(path):
    steps, layout = parse_name(path)
    wf = load(path)
    notes = "\n".join(n["widgets_values"][0] for n in wf["nodes"] if n["type"] == "MarkdownNote")
    twin = "hnd" if layout == "strided_nhd" else "strided_nhd"
    assert workflow_name(steps, twin) in notes, "the note must name the A/B twin"
    assert "res_multistep" in notes and "simple" in notes and "template" in notes, \
        "the note must say which sampler/scheduler is used and where it comes from"
    assert str(REFERENCE["seed"]) in notes
    titles = " ".join(g["title"] for g in wf["groups"])
    assert layout in titles and f"{steps} steps" in titles
    # every node except the notes sits inside a group, so the A/B structure is visible
    for n in wf["nodes"]:
        if n["type"] == "MarkdownNote":
            continue
        x, y = n["pos"]
        assert any(gx <= x <= gx + gw and gy <= y <= gy + gh for gx, gy, gw, gh in (g["bounding"] for g in wf["groups"])), \
            f"node {n['id']} ({n['type']}) is outside every group"


@pytest.mark.parametrize("path", ui_files(), ids=lambda p: p.stem)
def test_ui_and_api_have_the_same_nodes_and_links(path):
    ui, api = load(path), load(API_DIR / path.name)
    ui_nodes = {str(n["id"]): n for n in ui["nodes"] if n["type"] not in FRONTEND_ONLY}
    assert {k: n["type"] for k, n in ui_nodes.items()} == {k: n["class_type"] for k, n in api.items()}
    ui_edges = {(str(dst), ui_nodes[str(dst)]["inputs"][dst_slot]["name"], str(src), src_slot)
                for _, src, src_slot, dst, dst_slot, _ in ui["links"]}
    api_edges = {(k, name, v[0], v[1]) for k, n in api.items() for name, v in n["inputs"].items()
                 if isinstance(v, list)}
    assert ui_edges == api_edges


# --- against a real ComfyUI -----------------------------------------------------------------------

LINK_TYPES_NOT_WIDGETS = {"MODEL", "CLIP", "VAE", "CONDITIONING", "LATENT", "IMAGE", "AUDIO", "VIDEO", "NOISE",
                          "GUIDER", "SAMPLER", "SIGMAS"}


def input_specs(defn: dict) -> dict[str, tuple[str, dict, bool]]:
    """name -> (type, options, required) from one /object_info entry."""
    specs = {}
    for section, required in (("required", True), ("optional", False)):
        for name, spec in (defn["input"].get(section) or {}).items():
            typ, opts = spec[0], (spec[1] if len(spec) > 1 else {})
            specs[name] = (typ, opts, required)
    return specs


def combo_options(typ, opts) -> list | None:
    if isinstance(typ, list):
        return typ
    if typ == "COMBO":
        return opts.get("options", [])
    if typ == "COMFY_DYNAMICCOMBO_V3":
        return [o["key"] for o in opts.get("options", [])]
    return None


def value_problem(name, value, typ, opts, model_files) -> str | None:
    """Why ``value`` is not valid for an input of this type, or None."""
    options = combo_options(typ, opts)
    if options is not None:
        if value in options:
            return None
        if name in MODEL_FILE_INPUTS and value in model_files:
            # The test host has none of the (tens of GB) model files, so its file list cannot hold them:
            # a file input is valid when it names one of the official files.
            return None
        return f"{name}={value!r} not among {options[:8]}"
    if typ == "INT" or typ == "FLOAT":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (typ == "INT" and not isinstance(value, int)):
            return f"{name}={value!r} is not {typ}"
        if "min" in opts and value < opts["min"]:
            return f"{name}={value} < min {opts['min']}"
        if "max" in opts and value > opts["max"]:
            return f"{name}={value} > max {opts['max']}"
        if typ == "INT" and opts.get("step", 1) > 1 and (value - opts.get("min", 0)) % opts["step"]:
            return f"{name}={value} is off the step grid ({opts.get('min', 0)} + k*{opts['step']})"
        return None
    if typ == "BOOLEAN":
        return None if isinstance(value, bool) else f"{name}={value!r} is not a boolean"
    if typ == "STRING":
        return None if isinstance(value, str) else f"{name}={value!r} is not a string"
    return f"{name}: unexpected widget type {typ}"


MODEL_FILE_INPUTS = {"unet_name", "clip_name", "vae_name"}
MODEL_FILES = {v for d in OFFICIAL_MODELS.values() for k, v in d.items() if k in MODEL_FILE_INPUTS} | OFFICIAL_VAES


def api_problems(api: dict, object_info: dict) -> list[str]:
    problems = []
    for node_id, node in api.items():
        cls = node["class_type"]
        if cls not in object_info:
            problems.append(f"node {node_id}: {cls} is not a node type of this ComfyUI")
            continue
        specs = input_specs(object_info[cls])
        for name in node["inputs"]:
            if name not in specs:
                problems.append(f"node {node_id} {cls}: unknown input {name!r}")
        for name, (typ, opts, required) in specs.items():
            if name not in node["inputs"]:
                if required:
                    problems.append(f"node {node_id} {cls}: required input {name!r} missing")
                continue
            value = node["inputs"][name]
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                src = api.get(value[0])
                if src is None:
                    problems.append(f"node {node_id} {cls}.{name}: links to missing node {value[0]}")
                    continue
                outputs = object_info.get(src["class_type"], {}).get("output", [])
                if not 0 <= value[1] < len(outputs):
                    problems.append(f"node {node_id} {cls}.{name}: output slot {value[1]} of {src['class_type']} missing")
                elif outputs[value[1]] != typ and typ != "*":
                    problems.append(f"node {node_id} {cls}.{name}: gets {outputs[value[1]]}, wants {typ}")
                continue
            problem = value_problem(name, value, typ, opts, MODEL_FILES)
            if problem:
                problems.append(f"node {node_id} {cls}: {problem}")
    return problems


def ui_widget_names(defn: dict) -> list[str]:
    """The order the frontend stores widgets_values in: widget inputs in schema order, plus the
    extra 'control_after_generate' value after seed-like inputs."""
    names = []
    order = defn.get("input_order") or {s: list(defn["input"].get(s) or {}) for s in ("required", "optional")}
    specs = input_specs(defn)
    for section in ("required", "optional"):
        for name in order.get(section, []):
            typ, opts, _ = specs[name]
            if isinstance(typ, str) and typ in LINK_TYPES_NOT_WIDGETS:
                continue
            names.append(name)
            if opts.get("control_after_generate"):
                names.append("control_after_generate")
    return names


def ui_problems(ui: dict, api: dict, object_info: dict) -> list[str]:
    """Every UI node's widget values, read in the frontend's order, must equal its API twin's inputs."""
    problems = []
    for n in ui["nodes"]:
        if n["type"] in FRONTEND_ONLY:
            continue
        if n["type"] not in object_info:
            problems.append(f"UI node {n['id']}: {n['type']} is not a node type of this ComfyUI")
            continue
        defn = object_info[n["type"]]
        names = ui_widget_names(defn)
        values = n.get("widgets_values", [])
        if len(values) > len(names):
            problems.append(f"UI node {n['id']} {n['type']}: {len(values)} widget values for widgets {names}")
            continue
        api_inputs = api[str(n["id"])]["inputs"]
        for name, value in zip(names, values):
            if name == "control_after_generate":
                if value != "fixed":
                    problems.append(f"UI node {n['id']} {n['type']}: seed control is {value!r}, must be 'fixed'")
                continue
            if api_inputs.get(name) != value:
                problems.append(f"UI node {n['id']} {n['type']}.{name}: UI {value!r} != API {api_inputs.get(name)!r}")
        outputs = defn.get("output", [])
        for slot, out in enumerate(n.get("outputs", [])):
            if slot >= len(outputs) or outputs[slot] != out["type"]:
                problems.append(f"UI node {n['id']} {n['type']}: output {slot} is {out['type']}, server says "
                                f"{outputs[slot] if slot < len(outputs) else 'none'}")
        specs = input_specs(defn)
        for inp in n.get("inputs", []):
            if inp["name"] not in specs:
                problems.append(f"UI node {n['id']} {n['type']}: unknown input {inp['name']!r}")
            elif specs[inp["name"]][0] != inp["type"] and not (inp.get("widget")):
                problems.append(f"UI node {n['id']} {n['type']}.{inp['name']}: {inp['type']} vs server "
                                f"{specs[inp['name']][0]}")
    return problems


@pytest.fixture(scope="module")
def object_info(comfy_server):
    return comfy_server.get("/object_info")


def test_our_node_is_on_the_server_with_the_inputs_the_workflows_use(object_info):
    assert OUR_NODE in object_info, "the pack did not load into ComfyUI: see the server log"
    specs = input_specs(object_info[OUR_NODE])
    assert {name for name, (_, _, required) in specs.items() if required} == {
        "model", "layout", "backend", "patch_text_refiner"}
    # optional inputs are left out of the workflows, so they must have a default the node runs with
    for name, (typ, opts, required) in specs.items():
        if not required:
            assert "default" in opts, f"optional input {name} has no default"
    assert object_info[OUR_NODE]["output"] == ["MODEL"]


@pytest.mark.parametrize("path", api_files(), ids=lambda p: p.stem)
def test_api_workflow_is_valid_for_this_comfyui(path, object_info):
    problems = api_problems(load(path), object_info)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", ui_files(), ids=lambda p: p.stem)
def test_ui_workflow_matches_this_comfyui_and_its_api_twin(path, object_info):
    problems = ui_problems(load(path), load(API_DIR / path.name), object_info)
    assert not problems, "\n".join(problems)


def test_validator_catches_broken_workflows(object_info):
    """The checks above can fail: each broken copy must be reported."""
    good = load(API_DIR / f"{workflow_name(2, 'strided_nhd')}.json")

    def broken(edit):
        api = json.loads(json.dumps(good))
        edit(api)
        return api_problems(api, object_info)

    assert broken(lambda a: a["2"]["inputs"].update(layout="nhd_contiguous"))
    assert broken(lambda a: a["6"]["inputs"].update(length=125))           # off the 17k+5 grid
    assert broken(lambda a: a["9"]["inputs"].update(scheduler="nope"))
    assert broken(lambda a: a["2"]["inputs"].update(refiner=True))          # unknown input name
    assert broken(lambda a: a["2"]["inputs"].pop("backend"))                # required input missing
    assert broken(lambda a: a["10"]["inputs"].update(model=["3", 0]))      # CLIP into a MODEL input
    assert broken(lambda a: a["11"]["inputs"].update(noise=["99", 0]))     # dangling link
    assert broken(lambda a: a["4"]["inputs"].update(vae_name="someone_elses_vae.safetensors"))
    assert broken(lambda a: a.__setitem__("16", {"class_type": "NoSuchNode", "inputs": {}}))

    ui = load(WORKFLOWS / f"{workflow_name(2, 'strided_nhd')}.json")
    node = next(n for n in ui["nodes"] if n["type"] == "RandomNoise")
    node["widgets_values"] = [REFERENCE["seed"], "randomize"]
    assert ui_problems(ui, good, object_info)


def test_workflow_templates_lists_the_four_ui_workflows(comfy_server):
    templates = comfy_server.get("/workflow_templates")
    ours = [name for pack, names in templates.items() for name in names
            if pack == "comfyui-sage-strided-nhd"]
    assert sorted(ours) == sorted(p.stem for p in ui_files()), templates
    # and the frontend can fetch each one (and its thumbnail) where the template browser looks
    for p in ui_files():
        where = f"/api/workflow_templates/comfyui-sage-strided-nhd/{urllib.parse.quote(p.stem)}"
        served = comfy_server.get(f"{where}.json")
        assert served == load(p)
        with urllib.request.urlopen(f"{comfy_server.url}{where}.jpg") as r:
            assert r.status == 200 and r.read(3) == b"\xff\xd8\xff"


# The card's title is one line of 14 px semibold Inter (`line-clamp-1 text-sm font-semibold`) in a card of
# the grid `minmax(15rem, 1fr)`: 224 px of title on the narrowest card. Measured in headless Chromium with
# ComfyUI's frontend 1.49.6: "H3 12-step strided NHD" takes 160 px; the old "MiniMax H3 - 12 steps -
# strided NHD" took 246 px and was cut. 22 characters leave room for a wider fallback font.
MAX_TITLE_CHARS = 22


def test_template_names_fit_the_card_and_sort_sensibly():
    """Names are the cards' titles: short enough for one line on the narrowest card, each A/B pair the same
    name up to the layout, and in the browser's A-Z order (numeric, like the frontend's compareAlphabetical)
    the 2-step pair comes before the 12-step pair, each pair side by side."""
    names = [p.stem for p in ui_files()]
    assert all(len(n) <= MAX_TITLE_CHARS for n in names), [(n, len(n)) for n in names]
    for steps in (2, 12):
        a, b = workflow_name(steps, "strided_nhd"), workflow_name(steps, "hnd")
        assert a.removesuffix("strided NHD") == b.removesuffix("HND"), (a, b)
    numeric = sorted(names, key=lambda n: [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", n)])
    assert numeric == [workflow_name(2, "hnd"), workflow_name(2, "strided_nhd"),
                       workflow_name(12, "hnd"), workflow_name(12, "strided_nhd")]


@pytest.mark.parametrize("path", ui_files(), ids=lambda p: p.stem)
def test_thumbnail_is_a_square_jpeg_beside_each_workflow(path):
    """The template card is square and shows the thumbnail above the one-line title."""
    thumb = path.with_suffix(".jpg")
    width, height = jpeg_size(thumb.read_bytes())
    assert width == height >= 256, (thumb.name, width, height)


def jpeg_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a JPEG's start-of-frame segment."""
    assert data[:3] == b"\xff\xd8\xff", "not a JPEG"
    i = 2
    while i + 9 < len(data):
        assert data[i] == 0xFF, "broken JPEG segment"
        marker, length = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if marker in (0xC0, 0xC1, 0xC2):
            return int.from_bytes(data[i + 7:i + 9], "big"), int.from_bytes(data[i + 5:i + 7], "big")
        i += 2 + length
    raise AssertionError("no JPEG frame header")
