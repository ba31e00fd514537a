"""The format matrix's GGUF row: a GGUF-quantized tiny H3 through ComfyUI-GGUF's ops, with the node, on the CPU.

ComfyUI-GGUF (city96/ComfyUI-GGUF) is on no package registry, so CI cannot install it. ``devkit/gguf_h3.py`` stands
in for it as read at 795e45156ece99afbc3efef911e63fcb46e6a20d: the tiny H3's weights written as a real GGUF file with
the ``gguf`` package's writer and quantizers (the block linears in Q8_0, Q4_0 or BF16; embedding, time and output
layers F16; 1-D tensors F32, as its tools store them), read back with ``gguf.GGUFReader`` into tensors that keep the
file's data, GGML type and logical shape, and loaded through ``comfy.sd.load_diffusion_model_state_dict`` with ops
whose ``Linear`` dequantizes a quantized weight on every call (ComfyUI-GGUF's GGMLOps). Upstream refuses the
``minimax_h3`` architecture; the fork and pull request that add it change only that check.

For each type: one block forward with the node's patch gives stock's bits, chunked and whole, as the CPU gives it and
with the int8 route's checks answered yes (test_format_matrix.route_open): the route is never reached, since a GGUF
weight is not a layout it knows. Then a real ComfyUI server samples the file through a loader node (this stand-in
copied into custom_nodes): stock's latents bit for bit, and the report read back from the websocket and the log.

The report names the GGUF linears (stock's call, counted by type), and the MLP runs a GGUF linear whole: its weight
is dequantized by each call, so token chunks would dequantize it once per chunk instead of once per call.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from devkit import h3 as dh
from host_fixtures import (ComfyServer, _install_into_host, h3_graph, import_comfy, patch_inputs, require_host,
                           run_ahead)
from test_format_matrix import SETTINGS, block_forward, route_open, stock_forward

CONFIG = dh.INT8_TINY_H3
SEQ = 100
QTYPES = ("Q8_0", "Q4_0", "BF16")  # gguf quantizes these (it has no quantizer for the K-quants)
BLOCK_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2", "adaln_proj.linear")
LOADER = "SageNHDTestUnetLoaderGGUF"
LOADER_FILE = "sage_nhd_test_gguf_loader.py"  # devkit/gguf_h3.py as a custom node
STEPS = 2


def gguf_file(qtype: str) -> str:
    return f"sage_nhd_test_h3_tiny_{qtype.lower()}.gguf"


def write_file(qtype: str, path) -> dict:
    from devkit import gguf_h3

    return gguf_h3.write_gguf(dh.tiny_h3_model(seed=4, config=CONFIG).state_dict(), path, qtype)


@pytest.fixture(scope="module")
def gguf_h3(pack):
    from devkit import gguf_h3

    return gguf_h3


@pytest.fixture(scope="module", params=QTYPES)
def case(request, pack, gguf_h3, tmp_path_factory):
    """One type's file and model, stock's block output, and the node's on the CPU and with the route open, each with
    the number of dequantizations the forward made."""
    import comfy.model_management as mm

    qtype = request.param
    path = tmp_path_factory.mktemp("gguf") / gguf_file(qtype)
    stored = write_file(qtype, path)
    with torch.inference_mode(False):  # loaded as a loader node loads: plain tensors, not inference ones
        model = gguf_h3.load_model(path, dtype=torch.bfloat16)  # the GPU's compute dtype (the CPU's would be fp32)
        mm.load_models_gpu([model], force_full_load=True)
    inputs = dh.random_block_inputs(model.model.diffusion_model.blocks[1], SEQ, seed=3, dtype=torch.bfloat16)
    dequantized = []
    with pytest.MonkeyPatch.context() as mp:
        real = gguf_h3.dequantize
        mp.setattr(gguf_h3, "dequantize", lambda t, *args: dequantized.append(t.shape) or real(t, *args))
        want = stock_forward(model, inputs)
        stock_dequantized, runs = len(dequantized), {}
        for name, settings in SETTINGS.items():
            dequantized.clear()
            runs[name, "cpu"] = (*block_forward(pack, model, inputs, **settings), [], len(dequantized))
            with route_open(pack) as reached:
                runs[name, "route_open"] = (*block_forward(pack, model, inputs, **settings), reached, None)
    return dict(qtype=qtype, path=path, stored=stored, model=model, want=want, runs=runs,
                stock_dequantized=stock_dequantized)


def test_the_file_loads_as_comfyui_ggufs_ops_hold_it(case, gguf_h3):
    """Block linears keep the file's quantized data (logical shape, GGML type) in the ops' Linear and decode to what
    gguf quantized; embedding and output layers hold F16 arrays; norms load as plain tensors."""
    import comfy.ops
    import gguf

    dm = case["model"].model.diffusion_model
    qtype = gguf.GGMLQuantizationType[case["qtype"]]
    source = dh.tiny_h3_model(seed=4, config=CONFIG).state_dict()
    for name in BLOCK_LINEARS:
        layer = dm.get_submodule(f"blocks.1.{name}")
        w = layer.weight
        assert isinstance(layer, comfy.ops.manual_cast.Linear) and layer.comfy_cast_weights, type(layer).__mro__
        assert isinstance(w, gguf_h3.GGUFTensor) and w.tensor_type == qtype and w.dtype == torch.uint8, (name, w)
        assert case["stored"][f"blocks.1.{name}.weight"] == qtype
        assert w.shape == (layer.out_features, layer.in_features), (name, w.shape)
        want = gguf.quants.dequantize(gguf.quants.quantize(source[f"blocks.1.{name}.weight"].numpy(), qtype), qtype)
        assert torch.equal(gguf_h3.dequantize(w, torch.float32, "cpu"), torch.from_numpy(want)), name
    assert dm.video_patch_proj.weight.tensor_type == gguf.GGMLQuantizationType.F16
    assert type(dm.blocks[1].norm1.weight) is torch.nn.Parameter


def test_block_path_gives_stock_bits(case):
    want = case["want"]
    for (settings, mode), (got, forward, *_) in case["runs"].items():
        assert forward == "H3BlockForward", f"{settings}/{mode}: block forward {forward}"
        assert torch.equal(got, want), (f"{case['qtype']} {settings}/{mode}: max abs "
                                        f"{(got.float() - want.float()).abs().max().item()}")


def test_gguf_linears_take_stocks_call_never_the_int8_route(case):
    """With the route's device, release and row checks answered yes, no GGUF linear reaches it; none is counted as an
    int8 linear and the block is not declined."""
    for (settings, mode), (_, _, payload, reached, _) in case["runs"].items():
        where = f"{case['qtype']} {settings}/{mode}"
        assert reached == [], (where, reached)
        assert payload["int8_own_quantizer_calls"] == 0 and payload["int8_stock_quantizer"] == [], (where, payload)
        assert payload["comfy_kitchen"] is None and payload["int8_gemm"] is None, where
        assert payload["notes"] == [] and payload["status"] == "ok", (where, payload["notes"])


def test_report_names_the_gguf_linears_as_stocks_call(case):
    for (settings, mode), (_, _, payload, _, _) in case["runs"].items():
        rows = {r["layout"]: r["count"] for r in payload["other_quantized_linears"]}
        named = [layout for layout in rows if case["qtype"] in layout]
        assert len(named) == 1 and rows[named[0]] >= 4, (settings, mode, rows)  # qkv, out, fc1, fc2


def test_mlp_chunks_dequantize_a_gguf_weight_once(case):
    *_, dequantized = case["runs"]["chunked", "cpu"]
    assert dequantized == case["stock_dequantized"], (dequantized, case["stock_dequantized"])


# --- through a real ComfyUI server ---------------------------------------------------------------------------------
def _gguf_host(folder) -> None:
    """The files, the pack, the helper nodes and the GGUF loader node in the host (before any server reads them)."""
    host = require_host()
    import_comfy(host)
    for qtype in QTYPES:
        target = host / "models" / "diffusion_models" / gguf_file(qtype)
        write_file(qtype, folder / target.name)
        os.replace(folder / target.name, target)  # whole, or not there: another server may be listing the folder
    _install_into_host(host)
    source = Path(__file__).resolve().parents[2] / "devkit" / "gguf_h3.py"
    node = host / "custom_nodes" / LOADER_FILE
    if not node.is_file() or node.read_bytes() != source.read_bytes():
        shutil.copyfile(source, folder / LOADER_FILE)
        os.replace(folder / LOADER_FILE, node)


@run_ahead(prepare=_gguf_host)
def gguf_server_runs(folder):
    """Its own server (the session's may have started before the loader node was there): per type, stock's graph and
    the node's through the GGUF loader: (ok, why not, reports, latents), and the server's log."""
    server = ComfyServer(require_host(), sys.executable, folder)
    try:
        try:
            server.start()
        except RuntimeError as exc:
            pytest.fail(f"the ComfyUI host did not start: {exc}")
        runs = {}
        for qtype in QTYPES:
            for patched in (False, True):
                name = f"gguf_{qtype}_{'node' if patched else 'stock'}"
                graph = h3_graph(patch=patch_inputs("strided_nhd", "sdpa") if patched else None, name=name)
                graph["1"] = {"class_type": LOADER, "inputs": {"unet_name": gguf_file(qtype)}}
                run = server.run_graph(graph)
                runs[qtype, patched] = (run.ok, f"{run.error_message()}\n{server.log_tail()}", run.reports,
                                        run.latent("9") if run.ok else None)
        return runs, server.log_path.read_text(errors="replace")
    finally:
        server.stop()


@pytest.mark.parametrize("qtype", QTYPES)
def test_server_samples_the_gguf_h3_with_stocks_latents_and_reports_it(gguf_server_runs, qtype):
    runs, log = gguf_server_runs
    (ok, why, stock_reports, stock), (node_ok, node_why, reports, got) = runs[qtype, False], runs[qtype, True]
    assert ok and node_ok, why if not ok else node_why
    assert stock_reports == [] and len(reports) == 1, (stock_reports, reports)
    assert stock.keys() == got.keys() == {"stream0", "stream1"}
    for stream in stock:
        assert torch.isfinite(stock[stream]).all() and stock[stream].abs().max() > 0, stream
        assert torch.equal(got[stream], stock[stream]), (
            f"{qtype} {stream}: max abs {(got[stream].double() - stock[stream].double()).abs().max().item()}")
    other = runs[QTYPES[(QTYPES.index(qtype) + 1) % len(QTYPES)], False][3]
    assert not torch.equal(other["stream0"], stock["stream0"]), "another type's file samples other latents"

    r = reports[0]
    assert r["model_family"] == "MiniMaxH3" and r["path"] == "h3_forward_patch" and r["status"] == "ok", r
    assert r["blocks_patched"] == 2 and r["refiner_blocks_patched"] == 2 and r["notes"] == [], r
    assert r["backends_ran"] == {"sdpa": r["attention_calls"]} and r["attention_calls"] >= 2 * STEPS, r
    assert r["int8_own_quantizer_calls"] == 0 and r["int8_stock_quantizer"] == [], r
    assert r["comfy_kitchen"] is None and r["int8_gemm"] is None, r
    named = [m for m in r["messages"] if m.startswith(f"GGUF {qtype} linears: stock's call")]
    assert len(named) == 1, r["messages"]  # counted by type, not as int8 linears
    for message in r["messages"]:
        assert f"[Sage Strided NHD] {message}\n" in log, message
