"""Helpers for tests that need a real ComfyUI ("host"); the fixtures built on them are in conftest.py.

The host is found through ``COMFYUI_PATH`` (falling back to ``<repo>/.comfyui``, where
``scripts/setup_comfyui_host.sh`` puts one). Without a host every test using these
fixtures is SKIPPED with the reason; nothing passes vacuously.

- ``comfy_inprocess``: ComfyUI importable in this process (CPU, PyTorch attention), and
  the pack loaded as a package (``import_pack``) without name clashes with ComfyUI's own
  ``nodes`` module.
- ``comfy_server``: one real ComfyUI server per test session on 127.0.0.1 and a free port,
  started ``--cpu --use-pytorch-cross-attention`` with the pack and the test helper nodes
  (tests/host_helper_nodes.py) in custom_nodes, and tiny random-weight H3 and Wan
  checkpoints in models/diffusion_models. ``run_graph`` queues an API graph over HTTP,
  collects the pack's report events from the websocket, and returns the history entry.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from devkit.comfy import find_host, import_comfyui
from devkit.h3 import TINY_H3, TINY_WAN, patcher_for, tiny_h3_model, tiny_wan_model, write_checkpoint  # noqa: F401  (re-exported for tests)
from devkit.net import free_port
from devkit.pack import submodule
from devkit.pack import import_pack as devkit_import_pack

ROOT = Path(__file__).resolve().parents[1]
PACK_DIR_NAME = "comfyui-sage-strided-nhd"
HELPER_NODES = "sage_nhd_test_helpers.py"
REPORT_EVENT = "sage_strided_nhd.report"
H3_CKPT = "sage_nhd_test_h3_tiny.safetensors"
WAN_CKPT = "sage_nhd_test_wan_tiny.safetensors"
SERVER_START_TIMEOUT_S = 240


# --- finding the host --------------------------------------------------------------------------
def require_host() -> Path:
    """The ComfyUI host. Without one: a failure under CI (the host tests are the pack's proof), else a skip."""
    host = find_host()
    if host is None:
        where = os.environ.get("COMFYUI_PATH") or f"{ROOT / '.comfyui'} (COMFYUI_PATH unset)"
        message = (f"no ComfyUI host with MiniMax H3 at {where}: run scripts/setup_comfyui_host.sh "
                   "or set COMFYUI_PATH")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return host


# --- ComfyUI in this process -------------------------------------------------------------------
def import_comfy(host: Path) -> None:
    """Make ComfyUI importable here, on the CPU with PyTorch attention (same SDPA kernel as the pack)."""
    import_comfyui(host, cpu=True, stock_flag="use_pytorch_cross_attention")


def import_pack(host: Path | None = None):
    """The repo loaded as one package (as ComfyUI loads it), with ComfyUI importable for ``pack.nodes``."""
    if host is not None:
        import_comfy(host)
    submodule("nodes")  # sets pack.nodes (and .kernels)
    return devkit_import_pack()


# --- a real ComfyUI server ---------------------------------------------------------------------
class ComfyServer:
    """A ComfyUI server process on 127.0.0.1 and the HTTP/websocket calls the tests need."""

    def __init__(self, host: Path, python: str, workdir: Path, env: dict | None = None):
        self.host, self.python, self.workdir, self.env = host, python, workdir, env  # env: None = this process's
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output_dir = workdir / "output"
        self.log_path = workdir / "comfyui.log"
        self.proc = None

    def start(self) -> None:
        for d in (self.output_dir, self.workdir / "temp", self.workdir / "user"):
            d.mkdir(parents=True, exist_ok=True)
        cmd = [self.python, "main.py", "--cpu", "--use-pytorch-cross-attention", "--listen", "127.0.0.1",
               "--port", str(self.port), "--disable-auto-launch", "--disable-api-nodes",
               "--output-directory", str(self.output_dir), "--temp-directory", str(self.workdir / "temp"),
               "--user-directory", str(self.workdir / "user"), "--preview-method", "none"]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=self.host, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.time() + SERVER_START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.get("/system_stats")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer within {SERVER_START_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if getattr(self, "log", None):
            self.log.close()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path} -> {e.code}: {e.read().decode(errors='replace')}") from None

    def refused(self, graph: dict) -> dict:
        """POST ``graph`` (API format) to /prompt where ComfyUI's validation must refuse it: the body of its
        400 answer (``error`` and ``node_errors``). Nothing is queued."""
        req = urllib.request.Request(self.url + "/prompt", data=json.dumps({"prompt": graph}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raise AssertionError(f"the graph was queued, not refused: {r.read().decode(errors='replace')}")
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            assert e.code == 400, f"POST /prompt -> {e.code}: {body}"
            return json.loads(body)

    def run_graph(self, graph: dict, timeout: float = 300) -> "GraphRun":
        """Queue ``graph`` (API format), wait for it, return the history entry and our report events."""
        client_id = uuid.uuid4().hex
        events = _EventCollector(self.port, client_id)
        events.start()
        try:
            prompt_id = self.post("/prompt", {"prompt": graph, "client_id": client_id})["prompt_id"]
            deadline = time.time() + timeout
            while time.time() < deadline:
                hist = self.get(f"/history/{prompt_id}")
                if prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
                    entry = hist[prompt_id]
                    if entry["status"].get("status_str") in ("success", "error"):
                        events.wait_idle(prompt_id)
                        return GraphRun(entry, events.reports(), self)
                time.sleep(0.2)
            raise AssertionError(f"graph did not finish within {timeout}s:\n{self.log_tail()}")
        finally:
            events.stop()


class GraphRun:
    def __init__(self, entry: dict, reports: list[dict], server: ComfyServer):
        self.entry, self.reports, self.server = entry, reports, server

    @property
    def ok(self) -> bool:
        return self.entry["status"]["status_str"] == "success"

    def error_message(self) -> str:
        for kind, data in self.entry["status"].get("messages", []):
            if kind == "execution_error":
                return f"{data.get('exception_type')}: {data.get('exception_message')}"
        return ""

    def cached_nodes(self) -> set[str]:
        """Nodes ComfyUI did not run again but took from its cache."""
        for kind, data in self.entry["status"].get("messages", []):
            if kind == "execution_cached":
                return set(data.get("nodes", []))
        return set()

    def probe(self, name: str) -> list[str]:
        """Attention modules whose forward was replaced while this graph sampled (probe=True)."""
        return json.loads((self.server.output_dir / f"{name}_probe.json").read_text())["replaced_forwards"]

    def latent(self, node_id: str) -> dict:
        """The tensors a SageNHDTestSaveLatentTensors node wrote."""
        from safetensors.torch import load_file
        assert self.ok, f"graph failed: {self.error_message()}\n{self.server.log_tail()}"
        path = self.entry["outputs"][node_id]["sage_nhd_latent_file"][0]
        return load_file(path)


class _EventCollector:
    """Collects this client's websocket messages (our report events and execution state)."""

    def __init__(self, port: int, client_id: str):
        self.port, self.client_id = port, client_id
        self.messages: list[dict] = []
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._thread.start()
        self._ready.wait(timeout=30)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)

    def reports(self) -> list[dict]:
        return [m["data"] for m in list(self.messages) if m.get("type") == REPORT_EVENT]

    def wait_idle(self, prompt_id: str, timeout: float = 10):
        # the "executing node=None" message closes a prompt; our events come before it
        deadline = time.time() + timeout
        while time.time() < deadline:
            for m in list(self.messages):
                d = m.get("data") or {}
                if m.get("type") in ("executing", "execution_error") and d.get("prompt_id") == prompt_id \
                        and (m["type"] == "execution_error" or d.get("node") is None):
                    return
            time.sleep(0.05)

    def _run(self):
        import aiohttp

        async def main():
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(f"http://127.0.0.1:{self.port}/ws?clientId={self.client_id}") as ws:
                    self._ready.set()
                    while not self._stop.is_set():
                        try:
                            msg = await ws.receive(timeout=0.2)
                        except asyncio.TimeoutError:
                            continue
                        if msg.type == aiohttp.WSMsgType.TEXT:
                            self.messages.append(json.loads(msg.data))
                        elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                            break
        try:
            asyncio.run(main())
        finally:
            self._ready.set()


def _install_into_host(host: Path) -> None:
    """The pack (a link to this repo) and the test helper nodes in the host's custom_nodes."""
    custom = host / "custom_nodes"
    custom.mkdir(exist_ok=True)
    link = custom / PACK_DIR_NAME
    if not (link.exists() and link.resolve() == ROOT):
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)
        link.symlink_to(ROOT, target_is_directory=True)
    helpers = Path(__file__).with_name("host_helper_nodes.py").read_bytes()
    if not (custom / HELPER_NODES).is_file() or (custom / HELPER_NODES).read_bytes() != helpers:
        (custom / HELPER_NODES).write_bytes(helpers)  # written once: a server starting beside may be reading it


def start_server(host: Path, workdir: Path) -> "ComfyServer":
    """A started ComfyUI server with the tiny checkpoints, the pack and the helper nodes installed."""
    import_comfy(host)  # to build the checkpoints with ComfyUI's own model classes
    models = host / "models" / "diffusion_models"
    write_checkpoint(tiny_h3_model(seed=1), models / H3_CKPT)
    write_checkpoint(tiny_wan_model(seed=2), models / WAN_CKPT)
    _install_into_host(host)
    server = ComfyServer(host, sys.executable, workdir)
    try:
        server.start()
    except RuntimeError as exc:
        server.stop()
        pytest.fail(f"ComfyUI host at {host} did not start: {exc}")
    return server


# --- what a run gives back: latents compared bit for bit, the one report, the status box's text -------------------
def assert_latents_equal(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), f"{what}: streams {sorted(a)} vs {sorted(b)}"
    for name in a:
        diff = (a[name].double() - b[name].double()).abs().max().item()
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs, max abs {diff}"


def assert_meaningful(latents: dict):
    for name, t in latents.items():
        assert torch.isfinite(t).all(), f"{name} has non-finite values"
        assert t.abs().max() > 0, f"{name} is all zeros"


def only_report(run) -> dict:
    assert run.ok, f"graph failed: {run.error_message()}\n{run.server.log_tail()}"
    assert len(run.reports) == 1, f"expected one report for one sampling run, got {len(run.reports)}"
    return run.reports[0]


def status_box_lines(payload: dict, tmp_path: Path) -> list[str]:
    """The lines the node's status box shows for ``payload``: web/report_text.js run by node."""
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail("CI=true and node is not installed: the status box text is unchecked")
        pytest.skip("node is not installed (apt-get install nodejs)")
    report = tmp_path / "report.json"
    report.write_text(json.dumps(payload))
    script = ("import { formatReport } from " + json.dumps((ROOT / "web" / "report_text.js").as_uri()) + ";"
              "import { readFileSync } from 'node:fs';"
              "process.stdout.write(JSON.stringify(formatReport(JSON.parse(readFileSync(process.argv[1], 'utf8')))));")
    proc = subprocess.run([node, "--input-type=module", "-e", script, str(report)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# --- graphs ------------------------------------------------------------------------------------
def h3_graph(*, patch: dict | None, name: str, seed: int = 7, steps: int = 2, extra_model_nodes: list | None = None,
             probe: bool = False):
    """UNETLoader(tiny H3) -> [extra nodes] -> [our node] -> KSampler -> save latent tensors (node "9").

    ``patch``: inputs of SageStridedNHDAttention, or None for stock attention.
    ``name`` names the output file and is the conditioning's nonce, so every run samples
    anew (ComfyUI would otherwise reuse a cached result) on the same cached model.
    ``extra_model_nodes``: [(class_type, extra_inputs)] applied to the model before our node.
    ``probe``: record which attention forwards are replaced while sampling (``GraphRun.probe()``).
    """
    g = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": H3_CKPT, "weight_dtype": "default"}}}
    model = ["1", 0]
    for i, (cls, inputs) in enumerate(extra_model_nodes or []):
        nid = f"2{i}"
        g[nid] = {"class_type": cls, "inputs": dict(inputs, model=model)}
        model = [nid, 0]
    if patch is not None:
        g["3"] = {"class_type": "SageStridedNHDAttention", "inputs": dict(patch, model=model)}
        model = ["3", 0]
    if probe:
        g["8"] = {"class_type": "SageNHDTestForwardProbe", "inputs": {"model": model, "name": f"{name}_probe"}}
        model = ["8", 0]
    g["4"] = {"class_type": "SageNHDTestConditioning", "inputs": {"seed": 3, "tokens": 8, "dim": TINY_H3["text_dim"],
                                                               "nonce": name}}
    g["5"] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 64, "height": 64, "length": 5}}
    g["6"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["4", 0], "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}}
    g["9"] = {"class_type": "SageNHDTestSaveLatentTensors", "inputs": {"samples": ["6", 0], "name": name}}
    return g


def wan_graph(*, patch: dict | None, name: str, seed: int = 7, steps: int = 2):
    g = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": WAN_CKPT, "weight_dtype": "default"}}}
    model = ["1", 0]
    if patch is not None:
        g["3"] = {"class_type": "SageStridedNHDAttention", "inputs": dict(patch, model=model)}
        model = ["3", 0]
    g["4"] = {"class_type": "SageNHDTestConditioning", "inputs": {"seed": 3, "tokens": 8, "dim": TINY_WAN["text_dim"],
                                                               "nonce": name}}
    g["5"] = {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 32, "height": 32, "length": 5, "batch_size": 1}}
    g["6"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["4", 0], "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}}
    g["9"] = {"class_type": "SageNHDTestSaveLatentTensors", "inputs": {"samples": ["6", 0], "name": name}}
    return g


def patch_inputs(layout="strided_nhd", backend="sdpa", refiner=True) -> dict:
    return {"layout": layout, "backend": backend, "patch_text_refiner": refiner}


# --- runs started ahead ------------------------------------------------------------------------
# The slowest host fixtures each wait for a tool run in its own process (a benchmark, the aimdo emulation or a server
# on a tiny H3). Declared with ``run_ahead``, such a run is queued when collection ends (if a selected test uses it)
# for worker threads, one per core but this process's; the tests that wait for such runs go last (conftest.py), so
# the workers go through the queue while this process runs the rest. A run no worker took yet when its first test
# asks for it runs in this process.
AHEAD_WORKERS = max(1, (os.cpu_count() or 2) - 1)
_AHEAD: dict = {}    # fixture name -> (fn(folder), prepare(folder) or None)
_STARTED: dict = {}  # fixture name -> its Future
_FOLDERS: list = []
_POOL: list = []
_OUTCOMES = (Exception, pytest.skip.Exception, pytest.fail.Exception)


def run_ahead(fn=None, *, prepare=None):
    """A session fixture named as ``fn``, whose value is ``fn(folder)`` (a fresh folder), started ahead;
    ``prepare(folder)`` runs first, in this process's thread: what must not happen beside the tests (ComfyUI imported
    here, files the session's server reads)."""
    if fn is None:
        return lambda f: run_ahead(f, prepare=prepare)
    if _AHEAD.setdefault(fn.__name__, (fn, prepare))[0] is not fn:
        raise ValueError(f"two runs ahead are named {fn.__name__}")

    @pytest.fixture(scope="session", name=fn.__name__)
    def fixture():
        future = _STARTED.get(fn.__name__)
        if future is None or future.cancel():  # not taken by a worker yet: run it here
            folder = getattr(future, "folder", None) or _folder(fn.__name__)
            if prepare is not None and future is None:
                prepare(folder)
            return fn(folder)
        return future.result()
    return fixture


def uses_a_run_ahead(item) -> bool:
    return any(name in _AHEAD for name in getattr(item, "fixturenames", ()))


def _folder(name: str) -> Path:
    import tempfile

    _FOLDERS.append(Path(tempfile.mkdtemp(prefix=f"pytest-ahead-{name}-")))
    return _FOLDERS[-1]


def start_runs_ahead(items) -> None:
    """Prepare and queue the runs the selected ``items`` use, in the order they are first used."""
    import concurrent.futures

    wanted = dict.fromkeys(n for item in items for n in getattr(item, "fixturenames", ()) if n in _AHEAD)
    if not wanted:
        return
    _POOL.append(concurrent.futures.ThreadPoolExecutor(AHEAD_WORKERS, thread_name_prefix="run-ahead"))
    for name in wanted:
        (fn, prepare), folder = _AHEAD[name], _folder(name)
        try:
            if prepare is not None:
                prepare(folder)
        except _OUTCOMES as exc:  # a skip or a failure: each test that uses the run gets it
            _STARTED[name] = concurrent.futures.Future()
            _STARTED[name].set_exception(exc)
            continue
        _STARTED[name] = _POOL[0].submit(fn, folder)
        _STARTED[name].folder = folder  # where a run taken back from the queue runs


def finish_runs_ahead() -> None:
    """Drop the runs no test took (one in progress ends first), then their folders."""
    for pool in _POOL:
        pool.shutdown(wait=True, cancel_futures=True)
    for folder in _FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)
