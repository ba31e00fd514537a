"""MiniMax H3 sampling under comfy-aimdo's malloc graph (the "Comfy Compiler"), as current ComfyUI runs it.

One process per variant (stock ComfyUI attention, or this pack's node in one configuration)::

    python -m devkit.aimdo_emulation --variant sage2_exact --blocks 4 --steps 4 --seq 8192 --out r.json

The sequence, and the current upstream ComfyUI file each step mirrors (read with the search tools,
Comfy-Org/ComfyUI; paraphrased, not copied):

1. ``cuda_malloc.py``: PYTORCH_CUDA_ALLOC_CONF gets ``backend:cudaMallocAsync`` (on by default for
   +cu torch, always for cu130 and later) before torch is imported; ``expandable_segments:True`` is
   dropped. comfy-aimdo's compiler only sees the async allocator's calls (cuMemAllocAsync).
2. ``main.py``: ``comfy_aimdo.control.init(...)`` loads the library before torch is imported.
3. ``main.py``: the ComfyUI imports bring torch in; ``comfy.model_management`` initialises CUDA at
   import (it asks torch for the device's memory). Here: ``devkit.comfy.import_comfyui`` (the host).
4. ``main.py``: ``comfy_aimdo.control.init_devices((index, headroom) for every torch device)``: this
   installs aimdo's allocator hooks into the loaded libcuda.
5. Sampling (``comfy/samplers.py``): the OUTER_SAMPLE wrappers run around the whole sampling run (this
   node plans and reports there); the model's object patches are applied; ``extra_conds``
   (``comfy/model_base.py``) refines the text once per run with the token refiner, outside any graph,
   and builds the packed layout; then one model forward per step.
6. Each forward (``comfy/ldm/minimax/model.py`` ``MiniMaxH3Model.forward``): the output buffers are
   allocated, then ``comfy.model_prefetch.malloc_graph_begin``: the first forward of a run records
   (``comfy_aimdo.malloc_graph.record(current_stream, assert_graph_breaks)``), later ones ``push()``;
   the wrapped ``_forward`` runs; its outputs are copied into the buffers and dropped;
   ``malloc_graph_end`` pops (a pop result of 2 is a graph break).
7. Inside ``_forward`` (``comfy/model_prefetch.py`` ``prefetch_queue_pop(..., malloc_scope="block")``):
   ``graph.iterate("block")`` before every DiT block and ``graph.iterate(None)`` after the loop, before
   the final layer; a True result is a break of the block scope that closed.
8. The node's end (``execution.py`` -> ``cleanup_prefetch_queues`` -> ``cleanup_malloc_graph``): an
   active graph is aborted, its rogue count added up, the graph destroyed. The next run records anew.

The host is the ComfyUI tree at $COMFYUI_PATH (0.33 in this repo's tests): its own H3 model, helpers and
``_forward`` run; its ``comfy.model_prefetch`` gets current upstream's entry points for the sampling run
(``prefetch_queue_pop`` with the block scopes, ``pause_malloc_graph``, ``malloc_graph_enabled``).
Weights are plain device tensors made before sampling (a fully loaded model), outside every graph.

What comfy-aimdo 0.5.5 enforces (its ``src/malloc-graph.c``; the wheel's aimdo.so has the same calls, and
its free hook asks the rogue list, then the graph, then the real ``cuMemFreeAsync``):
an allocation made in a scope must be freed in that scope, or stay alive until the forward's last pop
(it is then handed off as a "rogue"). Freeing it in another scope, or after its scope closed while the
forward is still open, marks the graph failed; from then on a free of any graph allocation goes to the
real ``cuMemFreeAsync`` with an address aimdo mapped itself, and torch's CUDAMallocAsyncAllocator
``free_impl`` aborts the process with "CUDA error: invalid argument"; a later pop raises
"aimdo memory compile error". A differing allocation sequence in a replayed scope is a graph break.

``--no-aimdo`` replaces the graph by ``StandInGraph``, which applies those rules to the allocations an
``AllocationTracer`` sees (for CPU runs: ``--device cpu --tiny``; on CUDA it explains a failure without
aborting). Importing this module imports neither torch nor comfy-aimdo. The JSON is rewritten at every
stage, so a process that aborts still leaves where it was.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import hashlib
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

ASYNC_BACKEND = "backend:cudaMallocAsync"
COMPILE_ERROR = "aimdo memory compile error"


@dataclasses.dataclass(frozen=True)
class Variant:
    """This pack's node in one configuration (the ``nodes.patch.Settings`` it is patched with).
    ``same_bits_as``: the stock ComfyUI attention (``sage`` or ``sdpa``) whose output it must reproduce
    bit for bit on the same machine (None: it need not)."""

    layout: str = "strided_nhd"
    backend: str = "sage2"
    prep: str = "exact"
    prepared: bool = True
    block_path: str = "exact"
    same_bits_as: str | None = "sage"

    def settings(self) -> dict:
        """Keyword arguments of ``nodes.patch.Settings``."""
        return {"layout": self.layout, "backend": self.backend, "prep_mode": self.prep, "prepared": self.prepared,
                "block_path": self.block_path}


# name -> Variant; None: stock ComfyUI attention (no patch)
VARIANTS: dict[str, Variant | None] = {
    "stock": None,
    "sage2_exact": Variant(),
    "sage2_rotated": Variant(prep="rotated", same_bits_as=None),
    "sage2_noprepared": Variant(prepared=False),  # plain sageattn: the prepared path switched off
    # the pack's sdpa asks cuDNN attention first on Hopper, stock's attention_pytorch FlashAttention:
    # from about 12,000 tokens different kernels with other rounding (kernels/backends/sdpa.py);
    # the CPU check holds it to stock's bits
    "sdpa": Variant(backend="sdpa", same_bits_as=None),
    "hnd": Variant(layout="hnd"),  # the HND baseline never takes a prepared path
    "sage2_exact_attention_only": Variant(block_path="attention_only"),
}
# The GPU check's packed length: past the block fast path's largest chunk (nodes.patch.Settings: MLP
# 12,800 rows for float weights, 8,192 for int8, qkv 8,192), so every chunked allocation is under the graph
CHECK_SEQ = 14000
WEIGHT_FORMATS = ("bf16", "int8_convrot")  # devkit.h3.WEIGHT_FORMATS (not imported here: it imports torch)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m devkit.aimdo_emulation", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", required=True, choices=list(VARIANTS))
    p.add_argument("--blocks", type=int, default=4, help="DiT blocks (num_layers of the H3 config)")
    p.add_argument("--steps", type=int, default=4, help="sampling steps (model forwards) per run")
    p.add_argument("--seq", type=int, default=8192, help="packed sequence length (text + audio + video rows)")
    p.add_argument("--text-tokens", type=int, default=None, help="text rows (default min(256, seq // 16))")
    p.add_argument("--weights", default="bf16", choices=WEIGHT_FORMATS, help="weight format (devkit.h3.build_model)")
    p.add_argument("--warmup-runs", type=int, default=1,
                   help="sampling runs before the measured one (first-call compiles and caches settle there)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="the tiny H3 config (devkit.h3.TINY_H3) instead of the full one")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (with --no-aimdo)")
    p.add_argument("--no-aimdo", action="store_true",
                   help="no comfy-aimdo: the stand-in graph applies its rules to the traced allocations")
    p.add_argument("--assert-graph-breaks", action="store_true", help="ComfyUI's flag: a graph break is an error")
    p.add_argument("--comfyui", default=None, help="ComfyUI tree (default: $COMFYUI_PATH, else <repo>/.comfyui)")
    p.add_argument("--stock-attention", default="auto", choices=("auto", "sage", "sdpa"),
                   help="ComfyUI's attention flag: sage (--use-sage-attention), sdpa (--use-pytorch-cross-attention), "
                        "auto: sage when CUDA and sageattention are there")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        p.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    if args.device == "cpu" and not args.no_aimdo:
        p.error("comfy-aimdo's malloc graph needs CUDA: use --no-aimdo with --device cpu")
    if args.blocks < 1 or args.steps < 1 or args.warmup_runs < 0:
        p.error("--blocks and --steps must be at least 1, --warmup-runs at least 0")
    return args


# --- 1-4: start-up in ComfyUI's order --------------------------------------------------------------
def cuda_malloc_env(environ=os.environ) -> str:
    """PYTORCH_CUDA_ALLOC_CONF as ``cuda_malloc.py`` leaves it for a CUDA torch: expandable segments
    dropped, the cudaMallocAsync backend appended (once)."""
    conf = environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in conf:
        conf = conf.replace("expandable_segments:True", "").strip(",")
    if ASYNC_BACKEND not in conf:
        conf = f"{conf},{ASYNC_BACKEND}" if conf else ASYNC_BACKEND
    environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return conf


def init_aimdo_library():
    """``main.py`` before torch: ``comfy_aimdo.control.init`` (the newest protocol this comfy-aimdo takes)."""
    if "torch" in sys.modules:
        raise RuntimeError("torch was imported before comfy-aimdo was initialised; run this as a fresh process")
    import comfy_aimdo.control as control

    for kwargs in ({"simple_vram_headroom": None, "nvml_pressure": True}, {"simple_vram_headroom": None}, {}):
        try:
            ok = control.init(**kwargs)
            break
        except TypeError:  # an older comfy-aimdo protocol, as main.py falls back
            continue
    if not ok:
        raise RuntimeError("comfy_aimdo.control.init() returned False: the comfy-aimdo library did not load")
    return control


def init_aimdo_devices(control):
    """``main.py`` after the imports: ``init_devices`` for every CUDA device with no extra headroom (ComfyUI's
    default --vram-headroom 0); this hooks libcuda's allocation calls. Returns ``comfy_aimdo.malloc_graph``."""
    import comfy.model_management as mm

    devices = [d for d in mm.get_all_torch_devices() if d.type == "cuda"]
    try:
        ok = control.init_devices((d.index, 0) for d in devices)
    except TypeError:  # comfy-aimdo 0.4.9 protocol
        ok = control.init_devices(d.index for d in devices)
    if not ok:
        raise RuntimeError(f"comfy_aimdo.control.init_devices({[d.index for d in devices]}) returned False (it needs "
                           "libcuda loaded: CUDA initialised by the ComfyUI imports)")
    try:
        import comfy_aimdo.malloc_graph as malloc_graph
    except ImportError as exc:
        raise RuntimeError(f"this comfy-aimdo has no malloc_graph (0.5 or later needed): {exc}") from exc
    return malloc_graph


def aimdo_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("comfy-aimdo")
    except Exception:  # noqa: BLE001  (a source checkout has no metadata)
        try:
            from comfy_aimdo import _version
            return _version.__version__
        except Exception:  # noqa: BLE001
            return None


def stock_flag(choice: str, cuda: bool) -> str:
    if choice == "auto":
        choice = "sage" if cuda and importlib.util.find_spec("sageattention") is not None else "sdpa"
    return "use_sage_attention" if choice == "sage" else "use_pytorch_cross_attention"


# --- the stand-in graph: comfy-aimdo's rules without an allocator -----------------------------------
class _Event:
    """A node of the recorded allocation tree: alloc (key: bytes), free (key: its alloc event), call (key:
    scope name; ``scope``: the scope's own tree), end. Children are the recorded alternatives after it."""

    __slots__ = ("kind", "key", "parent", "children", "scope")

    def __init__(self, kind: str, key=None, parent=None):
        self.kind, self.key, self.parent, self.children = kind, key, parent, []
        self.scope = _Event("scope") if kind == "call" else None

    def find(self, kind: str, key=None):
        return next((e for e in self.children if e.kind == kind and e.key == key), None)

    def add(self, kind: str, key=None):
        event = _Event(kind, key, self)
        self.children.append(event)
        return event

    def sever(self) -> None:
        """Take this event out of the tree (its children move up), as aimdo does for an escaped allocation."""
        siblings = self.parent.children
        at = siblings.index(self)
        siblings[at:at + 1] = self.children
        for child in self.children:
            child.parent = self.parent
        self.children = []


@dataclasses.dataclass(eq=False)
class _State:
    """One open scope: where it is in its recorded tree, whether it records, whether it diverged."""

    cursor: _Event
    recording: bool
    name: str
    broken: bool = False


class StandInGraph:
    """``comfy_aimdo.malloc_graph.MallocGraph`` without an allocator (``--no-aimdo``), fed by an
    ``AllocationTracer``. Same calls (push/pop/iterate/abort/pause/resume, the stats), same answers:

    - the first pass records a tree of allocation events per scope; a repeated scope name at the same
      place replays the same tree (so every DiT block replays block 0's); a later pass (``push()``)
      replays from the root. An allocation, free or scope the tree does not have at that point makes
      that scope record from there: its pop returns True (a graph break).
    - an allocation freed in another scope than the one that made it, or after its scope closed while
      the pass is open, or freed while the graph is paused, fails the graph (RuntimeError with
      "aimdo memory compile error"; on a GPU that is the process abort described in the module text);
      allocations still alive at the pass's last pop become rogues (counted, freed whenever).
    - a pop or push out of turn raises "aimdo memory compile error", as the real one does.
    """

    def __init__(self, tracer=None, assert_breaks: bool = False):
        self.root = _Event("scope")
        self.states = [_State(self.root, True, "forward")]
        self.active, self.complete, self.paused, self.aborted = True, False, False, False
        self.assert_breaks, self.failure = assert_breaks, None
        self.live: dict = {}        # token -> (alloc event, owning state, bytes): graph allocations alive
        self.escaped: dict = {}     # token -> scope name: alive after their scope closed, pass still open
        self.rogues: set = set()    # handed off at a pass's end
        self.rogue_count = self.used = self.peak_used = 0
        self.virtual_bytes = self.physical_bytes = None  # no address space behind the stand-in
        self.calls = ["record"]
        self._scopes: list = []
        self._opened: dict = {}     # scope name -> index of the last one this pass opened (for messages)
        self.tracer = tracer
        if tracer is not None:
            tracer.sink = self

    # allocation events (from the tracer)
    def on_alloc(self, token, nbytes: int) -> None:
        if not self.active or self.paused or self.failure:
            return  # an ordinary allocation: not the graph's
        state = self.states[-1]
        event = None if state.recording else state.cursor.find("alloc", nbytes)
        if event is None:
            self._diverge(state, f"a {nbytes}-byte allocation")
            event = state.cursor.add("alloc", nbytes)
        state.cursor = event
        self.live[token] = (event, state, nbytes)
        self.used += nbytes
        self.peak_used = max(self.peak_used, self.used)

    def on_free(self, token) -> None:
        if token in self.rogues:
            self.rogues.discard(token)
            return
        if token in self.escaped:
            self._fail(f"an allocation of scope {self.escaped.pop(token)} outlived it and was freed in scope "
                       f"{self.states[-1].name} before the forward ended")
        entry = self.live.pop(token, None)
        if entry is None:
            return  # made outside the graph (or while paused): comfy-aimdo lets it go
        event, owner, nbytes = entry
        self.used -= nbytes
        state = self.states[-1]
        if self.paused:
            self._fail(f"a {nbytes}-byte allocation of scope {owner.name} was freed while the graph was paused")
        if owner is not state:
            self._fail(f"a {nbytes}-byte allocation of scope {owner.name} was freed in scope {state.name}")
        free = None if state.recording else state.cursor.find("free", event)
        if free is None:
            self._diverge(state, "a free")
            free = state.cursor.add("free", event)
        state.cursor = free

    def _diverge(self, state: _State, what: str) -> None:
        if state.recording:
            return
        if self.assert_breaks:
            self._fail(f"{what} in scope {state.name} differs from the recorded sequence (assert_graph_breaks)")
        state.recording = state.broken = True

    def _fail(self, why: str) -> None:
        self.failure = why
        raise RuntimeError(f"{COMPILE_ERROR} (stand-in graph: {why}; under comfy-aimdo this marks the graph failed "
                           "and the next free of a graph allocation aborts with 'CUDA error: invalid argument')")

    def _check(self, call: str, need_active: bool = True) -> None:
        if self.tracer is not None:
            self.tracer.poll()
        if self.failure or (need_active and not self.active):
            why = self.failure or "no pass is open"
            raise RuntimeError(f"{COMPILE_ERROR} (stand-in graph: {call}: {why})")

    # MallocGraph's calls
    def push(self, name=None) -> None:
        self.calls.append(f"push({name})" if name else "push")
        if name is None:
            self._check("push()", need_active=False)
            if not self.complete or self.active:
                raise RuntimeError(f"{COMPILE_ERROR} (stand-in graph: push() with no completed pass to replay)")
            self.states, self.active, self.complete = [_State(self.root, False, "forward")], True, False
            self._opened = {}
            return
        self._check(f"push({name!r})")
        parent = self.states[-1]
        call = parent.cursor.find("call", name)
        recording = call is None
        if recording:
            self._diverge(parent, f"scope {name!r}")
            call = parent.cursor.add("call", name)  # the parent's cursor stays: the next same-named scope replays it
        self._opened[name] = self._opened.get(name, -1) + 1
        self.states.append(_State(call.scope, recording, f"{name}{self._opened[name]}"))
        self._scopes.append(None)

    def pop(self) -> bool:
        self.calls.append("pop")
        self._check("pop()")
        state = self.states[-1]
        end = None if state.recording else state.cursor.find("end")
        if end is None:
            self._diverge(state, "the end of the scope")
            end = state.cursor.add("end")
        state.cursor = end
        for token in [t for t, (_, owner, _) in self.live.items() if owner is state]:
            event, _, nbytes = self.live.pop(token)
            self.used -= nbytes
            event.sever()
            self.escaped[token] = state.name
            self.rogue_count += 1
        self.states.pop()
        if self._scopes:
            self._scopes.pop()
        if not self.states:
            self._end_pass()
        return state.broken

    def _end_pass(self) -> None:
        self.rogues.update(self.escaped)
        self.escaped.clear()
        self.active, self.complete = False, True

    def iterate(self, name=None) -> bool:
        """The same scope bookkeeping as MallocGraph.iterate: close the open scope of that name, open the next."""
        broken = False
        if name is None:
            if self._scopes:
                broken = self.pop()
            return broken
        if self._scopes and self._scopes[-1] == name:
            broken = self.pop()
        self.push(name)
        self._scopes[-1] = name
        return broken

    def abort(self) -> None:
        self.calls.append("abort")
        if self.aborted:
            return
        if not self.active:
            raise RuntimeError(f"{COMPILE_ERROR} (stand-in graph: abort() with no pass open)")
        self.rogue_count += len(self.live)
        self.rogues.update(self.live)
        self.live.clear()
        self._end_pass()
        self.states, self._scopes, self.complete, self.aborted = [], [], False, True

    def pause(self, sync=False) -> None:
        self._check("pause()")
        self.paused = True

    def resume(self, sync=False) -> None:
        self._check("resume()")
        self.paused = False


def _tensor_leaves(obj):
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _storage_key(tensor):
    """The StorageImpl's address of a plain tensor (None for tensor subclasses without storage)."""
    try:
        return tensor.untyped_storage()._cdata
    except Exception:  # noqa: BLE001  (wrapper subclasses such as QuantizedTensor have no storage)
        return None


def make_tracer(device_type: str):
    """An ``AllocationTracer`` (a TorchDispatchMode, so torch is imported only here)."""
    import weakref

    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllocationTracer(TorchDispatchMode):
        """Every new storage an op creates on ``device_type`` -> ``sink.on_alloc(token, bytes)``; every traced
        storage found freed (its weak reference expired, or resized to nothing while the tensor that made it
        lives: ``untyped_storage().resize_(0)`` frees the memory at once; checked before each op and each graph
        call) -> ``sink.on_free(token)``, oldest first. Temporaries inside a custom op or a C++ kernel are not
        seen."""

        def __init__(self):
            super().__init__()
            self.sink, self.live, self.count = None, {}, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.poll()
            kwargs = kwargs or {}
            inputs = {_storage_key(t) for t in _tensor_leaves((args, kwargs))}
            out = func(*args, **kwargs)
            for t in _tensor_leaves(out):
                key = _storage_key(t)
                if key is not None and key not in inputs and key not in self.live and t.device.type == device_type:
                    self._track(t, key)
            return out

        def _track(self, tensor, key) -> None:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                return
            self.count += 1
            self.live[key] = (StorageWeakRef(storage), self.count, weakref.ref(tensor))
            if self.sink is not None:
                self.sink.on_alloc(key, storage.nbytes())

        def poll(self) -> None:
            gone = sorted((seq, key) for key, (ref, seq, made) in self.live.items()
                          if ref.expired() or ((t := made()) is not None and t.untyped_storage().nbytes() == 0))
            for _, key in gone:
                del self.live[key]
                if self.sink is not None:
                    self.sink.on_free(key)

    return AllocationTracer()


def graph_stats(graph) -> dict | None:
    if graph is None:
        return None
    out = {}
    for k in ("peak_used", "virtual_bytes", "physical_bytes", "rogue_count"):
        value = getattr(graph, k, None)
        out[k] = None if value is None else int(value)
    return out


# --- 6-8: comfy/model_prefetch.py's compiler driver --------------------------------------------------
class _PauseGraph:
    """``pause_malloc_graph()``: allocations inside are ordinary ones (buffers kept across steps)."""

    def __init__(self, compiler, sync=False):
        self.compiler, self.sync = compiler, sync

    def __enter__(self):
        if self.compiler.graph is not None and self.compiler.active:
            self.compiler.graph.pause(sync=self.sync)

    def __exit__(self, *exc):
        if self.compiler.graph is not None and self.compiler.active:
            self.compiler.graph.resume(sync=self.sync)


class Compiler:
    """The malloc graph of this thread as ``comfy/model_prefetch.py`` drives it: begin/end around each
    forward, the block scopes ``prefetch_queue_pop`` opens, pausing, and the cleanup at the node's end.
    ``make_graph(assert_breaks)``: record a new graph (comfy-aimdo's, or a StandInGraph)."""

    def __init__(self, make_graph, assert_breaks: bool = False):
        self.make_graph, self.assert_breaks = make_graph, assert_breaks
        self.graph, self.active = None, False
        self.breaks = 0
        self.sites: list[str] = []   # this forward's break sites: the scopes whose pop said "broken"
        self.block = -1              # the open block scope's index (-1: none)

    def begin(self) -> None:
        """malloc_graph_begin: record on the first forward, push on the later ones."""
        self.sites, self.block = [], -1
        if self.graph is None:
            self.graph = self.make_graph(self.assert_breaks)
        else:
            self.graph.push()
        with contextlib.suppress(ImportError):
            import comfy_kitchen as ck
            if hasattr(ck, "set_allocation_context"):  # newer comfy-kitchen keeps its caches out of the graph
                ck.set_allocation_context(_PauseGraph(self))
        self.active = True

    def end(self) -> None:
        """malloc_graph_end: pop; a failing pop drops the graph without an abort (its native state is gone)."""
        if self.graph is None or not self.active:
            return
        try:
            broken = self.graph.pop()
        except Exception:
            self.graph, self.active = None, False
            raise
        self.active = False
        self._mark(broken, "forward")

    def block_scope(self, module) -> None:
        """prefetch_queue_pop(None, device, module, malloc_scope="block"): iterate("block"), or None after the loop."""
        if self.graph is None or not self.active:
            return
        closing = f"block{self.block}" if self.block >= 0 else None
        self.block = self.block + 1 if module is not None else -1
        self._mark(self.graph.iterate("block" if module is not None else None), closing)

    def _mark(self, broken, where) -> None:
        if broken:
            self.breaks += 1
            self.sites.append(where or "?")

    def pause(self, sync=False) -> _PauseGraph:
        return _PauseGraph(self, sync)

    def cleanup(self) -> dict | None:
        """cleanup_malloc_graph: abort an active graph (a failure is only logged upstream), count its rogues,
        destroy it. Returns the graph's stats and the abort's failure, if any."""
        graph, self.graph = self.graph, None
        if graph is None:
            return None
        abort_error = None
        if self.active:
            self.active = False
            try:
                graph.abort()
            except Exception as exc:  # noqa: BLE001  (upstream logs a warning and goes on)
                abort_error = f"{type(exc).__name__}: {exc}"
        stats = graph_stats(graph) | {"abort_error": abort_error}
        del graph  # MallocGraph.__del__ destroys the native graph
        return stats


class _NoPrefetch(list):
    """make_prefetch_queue's answer when no weights stream (upstream: None). Not None, so that the 0.33
    host's ``_forward`` makes its after-the-loop ``prefetch_queue_pop(queue, device, None)`` call."""


NO_PREFETCH = _NoPrefetch()
HOOK_NAMES = ("make_prefetch_queue", "prefetch_queue_pop", "pause_malloc_graph", "malloc_graph_enabled")


@contextlib.contextmanager
def upstream_prefetch_hooks(compiler: Compiler):
    """Current upstream's ``comfy.model_prefetch`` entry points on the host's module while a run samples."""
    import comfy.model_prefetch as prefetch

    def prefetch_queue_pop(queue, device, module, dtype=None, core=None, enable_graph=False, generator=None,
                           malloc_scope="block"):
        if queue is not None and queue is not NO_PREFETCH:
            raise RuntimeError("the emulation streams no weights: a real prefetch queue is not expected")
        if malloc_scope is not None:
            compiler.block_scope(module)
        if core is not None:
            core()

    missing = object()
    saved = {name: getattr(prefetch, name, missing) for name in HOOK_NAMES}
    prefetch.make_prefetch_queue = lambda queue, device, transformer_options: NO_PREFETCH
    prefetch.prefetch_queue_pop = prefetch_queue_pop
    prefetch.pause_malloc_graph = compiler.pause
    prefetch.malloc_graph_enabled = lambda device: True
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(prefetch, name)
            else:
                setattr(prefetch, name, value)


# --- 5: the H3 inputs, as the sampler and extra_conds make them -----------------------------------
def layout_sizes(seq: int, text_tokens: int) -> dict:
    """Text rows, latent frames, latent side and audio frames of an H3 packed sequence of exactly ``seq``
    rows (square latent frames, 2x2 patches)."""
    if text_tokens < 1 or seq - text_tokens < 6:
        raise ValueError(f"--seq {seq} with {text_tokens} text rows leaves too few rows for audio and video")
    budget = seq - text_tokens
    lat = next(side for side in (32, 16, 8, 4, 2) if (side // 2) ** 2 * 2 <= budget)
    frame_rows = (lat // 2) ** 2
    latent_t = max(1, (budget * 4 // 5) // frame_rows)
    video = latent_t * frame_rows
    audio_t = max(1, (budget - video) // 2)
    text = seq - video - 2 * audio_t
    if text < 1:
        raise ValueError(f"cannot pack {seq} rows")
    return {"text": text, "audio_t": audio_t, "latent_t": latent_t, "latent_h": lat, "latent_w": lat,
            "video": video, "audio": 2 * audio_t}


@dataclasses.dataclass
class Inputs:
    latents: list          # [video [1, C, T, H, W], audio [1, C, 2, Ta]], fp32: the sampler's latents
    cross_attn: object     # [1, text, text_dim]: the text encoder's states, before extra_conds
    payload: dict          # minimax_payload as extra_conds builds it (the packed layout, once per run)
    sigmas: list


def make_inputs(dm, seq: int, text_tokens: int, device, seed: int, steps: int) -> tuple[Inputs, dict]:
    import torch
    import comfy.ldm.minimax.model as h3

    s = layout_sizes(seq, text_tokens)
    gen = torch.Generator().manual_seed(seed)
    video = torch.randn(1, dm.latents_dim, s["latent_t"], s["latent_h"], s["latent_w"], generator=gen)
    audio = torch.randn(1, dm.audio_latents_dim, 2, s["audio_t"], generator=gen)
    text = torch.randn(1, s["text"], dm.condition_proj.weight.shape[1], generator=gen)
    layout = h3.PackedLayout(s["text"], s["latent_t"], s["latent_h"], s["latent_w"], s["audio_t"])
    if layout.seq_len != seq:
        raise ValueError(f"the packed layout has {layout.seq_len} rows, asked for {seq}")
    # the model is evaluated at every sigma but the last (0.05: never exactly 0 or 1, t_video != t_audio)
    sigmas = [0.95 - 0.9 * i / steps for i in range(steps + 1)]
    payload = {"seed": seed, "audio_scale": 1.0, "layout": layout}
    return Inputs([video.to(device), audio.to(device)], text, payload, sigmas), s


# --- 5-8: one sampling run ---------------------------------------------------------------------------
@dataclasses.dataclass
class Session:
    args: object
    device: object
    dtype: object
    dm: object
    patcher: object          # the ModelPatcher sampled (the node's clone for a patched variant)
    patch: object            # the node's InstalledPatch, or None
    inputs: Inputs
    compiler: Compiler
    recorder: "Recorder"
    tracer: object = None    # the AllocationTracer feeding a stand-in graph
    torch: object = None


def h3_forward(session: Session, x, timestep, context, transformer_options):
    """``MiniMaxH3Model.forward`` of current upstream (no audio scale): output buffers, begin, the wrapped
    ``_forward`` (the host's own, with the block scopes), copy, end."""
    compiler = session.compiler
    out = [session.torch.empty_like(x[0]), session.torch.empty_like(x[1])]
    compiler.begin()
    graph_out = session.dm(x, timestep, context, transformer_options=transformer_options,
                           minimax_payload=session.inputs.payload)
    out[0].copy_(graph_out[0])
    out[1].copy_(graph_out[1])
    del graph_out
    compiler.end()
    return out


def apply_model(session: Session, x, timestep, context, transformer_options):
    """``BaseModel.apply_model``: the model's APPLY_MODEL wrappers (the node's scope of a model call) around
    ``h3_forward``, in ``_apply_model``'s argument order."""
    from comfy.patcher_extension import WrapperExecutor, WrappersMP, get_all_wrappers

    def forward(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
        return h3_forward(session, x, t, c_crossattn, transformer_options)

    wrappers = get_all_wrappers(WrappersMP.APPLY_MODEL, transformer_options)
    return WrapperExecutor.new_class_executor(forward, session.patcher.model, wrappers).execute(
        x, timestep, None, context, None, transformer_options)


def one_step(session: Session, run: dict, step: int, x, context, sigma: float, transformer_options):
    """One model call as ``model_base._apply_model`` makes it (inputs cast, timestep = sigma * 1000,
    options copied), timed, with this forward's breaks and graph stats."""
    torch = session.torch
    session.recorder.stage(f"{run['kind']} run, step {step}")
    xc = [t.to(session.dtype) for t in x]
    timestep = torch.full((1,), sigma * 1000.0, dtype=torch.float32, device=session.device)
    options = dict(transformer_options, prefetch_dynamic_vbars=False,
                   sample_sigmas=torch.tensor(session.inputs.sigmas, device=session.device),
                   sigmas=timestep / 1000.0)
    sync(session)
    started = time.perf_counter()
    out = apply_model(session, xc, timestep, context, options)
    sync(session)
    run["step_seconds"].append(round(time.perf_counter() - started, 4))
    run["breaks_per_step"].append(len(session.compiler.sites))
    run["break_sites"].append(list(session.compiler.sites))
    run["graph_per_step"].append(graph_stats(session.compiler.graph))
    if isinstance(session.compiler.graph, StandInGraph):
        run["stand_in_calls_last_step"] = session.compiler.graph.calls[-(2 * session.args.blocks + 2):]
    return out


def sample(session: Session, run: dict, model_options: dict):
    """What runs inside the OUTER_SAMPLE wrappers: patch the model, refine the text once (extra_conds,
    outside any graph), then the steps with an Euler update of the fp32 latents between them."""
    torch = session.torch
    with object_patches_applied(session.patcher), torch.inference_mode(), upstream_prefetch_hooks(session.compiler):
        session.recorder.stage(f"{run['kind']} run, extra_conds")
        context = session.dm.preprocess_text_embeds(session.inputs.cross_attn.to(session.device, session.dtype))
        x = [t.clone() for t in session.inputs.latents]
        options = model_options["transformer_options"]
        sigmas = session.inputs.sigmas
        out = None
        with session.tracer if session.tracer is not None else contextlib.nullcontext():
            for step in range(session.args.steps):
                out = one_step(session, run, step, x, context, sigmas[step], options)
                x = [t + (sigmas[step + 1] - sigmas[step]) * o.float() for t, o in zip(x, out)]
        run["output"] = out
    return out


@contextlib.contextmanager
def object_patches_applied(patcher):
    """The patcher's object patches on the model while the steps run (prepare_sampling loads the model)."""
    patcher.patch_model(load_weights=False)
    try:
        yield
    finally:
        patcher.unpatch_model(unpatch_weights=False)


class _Guider:
    """What an OUTER_SAMPLE wrapper reads from ComfyUI's CFGGuider (``executor.class_obj``)."""

    def __init__(self, patcher, model_options: dict):
        self.model_patcher = patcher
        self.model_options = model_options


def sampling_options(patcher) -> dict:
    """The model options of one sampling run as CFGGuider.sample makes them: a clone, with the patcher's
    wrappers and callbacks merged into transformer_options (sampler_helpers.prepare_model_patcher)."""
    import comfy.model_patcher
    import comfy.sampler_helpers

    options = comfy.model_patcher.create_model_options_clone(patcher.model_options)
    options.setdefault("transformer_options", {})
    comfy.sampler_helpers.prepare_model_patcher(patcher, {}, options)
    return options


def sampling_run(session: Session, kind: str) -> dict:
    """One KSampler execution: every OUTER_SAMPLE wrapper of the model around ``sample``, then the node
    boundary's compiler cleanup. Errors are recorded in the run, not raised."""
    from comfy.patcher_extension import WrapperExecutor, WrappersMP, get_all_wrappers

    run = {"kind": kind, "breaks_per_step": [], "break_sites": [], "graph_per_step": [], "step_seconds": [],
           "error": None, "graph": None, "output": None}
    options = sampling_options(session.patcher)
    wrappers = get_all_wrappers(WrappersMP.OUTER_SAMPLE, options, is_model_options=True)
    breaks_before = session.compiler.breaks
    try:
        guider = _Guider(session.patcher, options)
        WrapperExecutor.new_class_executor(lambda: sample(session, run, options), guider, wrappers).execute()
    except BaseException as exc:  # noqa: BLE001  (recorded; the exit status says it failed)
        run["error"] = error_record(exc, session.recorder.result.get("stage"))
        if isinstance(exc, KeyboardInterrupt):
            raise
    finally:
        session.recorder.stage(f"{kind} run, cleanup_malloc_graph")
        run["graph"] = session.compiler.cleanup()
        run["graph_breaks"] = session.compiler.breaks - breaks_before
        if session.tracer is not None:
            session.tracer.poll()
    return run


def error_record(exc: BaseException, stage) -> dict:
    return {"type": type(exc).__name__, "message": str(exc), "stage": stage, "traceback": traceback.format_exc()}


def sync(session: Session) -> None:
    if session.device.type == "cuda":
        session.torch.cuda.synchronize(session.device)


# --- setup ---------------------------------------------------------------------------------------------
class Recorder:
    """The result dict and its JSON file, rewritten at every stage (a process abort leaves the last one)."""

    def __init__(self, path: Path, result: dict):
        self.path, self.result = path, result
        path.parent.mkdir(parents=True, exist_ok=True)

    def stage(self, name: str) -> None:
        self.result["stage"] = name
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


def start_host(args, recorder: Recorder):
    """Steps 1-4: allocator configuration, comfy-aimdo library, the ComfyUI imports (torch, CUDA), the
    aimdo devices. Returns (torch, comfy_aimdo.malloc_graph or None)."""
    result, cuda = recorder.result, args.device != "cpu"
    if cuda:
        result["pytorch_cuda_alloc_conf"] = cuda_malloc_env()
    control = None
    if not args.no_aimdo:
        recorder.stage("comfy_aimdo.control.init")
        control = init_aimdo_library()
        result["comfy_aimdo"] = aimdo_version()
    recorder.stage("ComfyUI imports")
    from devkit import comfy as comfy_host

    root = comfy_host.find_comfyui(args.comfyui)
    flags = comfy_host.import_comfyui(root, cpu=not cuda, stock_flag=stock_flag(args.stock_attention, cuda))
    import torch

    result["comfyui"] = {"path": str(root), "version": comfy_host.comfyui_version(root), "flags": flags}
    result["stock_attention"] = comfy_host.stock_attention_name()
    result["torch"] = str(torch.__version__)
    malloc_graph = None
    if control is not None:
        recorder.stage("comfy_aimdo.control.init_devices")
        malloc_graph = init_aimdo_devices(control)
    if cuda:
        describe_cuda(torch, args, result, aimdo=control is not None)
    return torch, malloc_graph


def describe_cuda(torch, args, result: dict, aimdo: bool) -> None:
    device = torch.device(args.device)
    result["gpu"] = torch.cuda.get_device_name(device)
    result["capability"] = "sm%d%d" % torch.cuda.get_device_capability(device)
    result["allocator_backend"] = torch.cuda.get_allocator_backend()
    if aimdo and result["allocator_backend"] != "cudaMallocAsync":
        raise RuntimeError(f"torch runs the {result['allocator_backend']} allocator: comfy-aimdo's compiler only "
                           "sees cudaMallocAsync (is PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF overriding it?)")


def build_session(args, torch, malloc_graph, recorder: Recorder) -> Session:
    from devkit import h3 as h3_model

    result = recorder.result
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = dict(h3_model.TINY_H3 if args.tiny else h3_model.FULL_H3, num_layers=args.blocks)
    result["config"], result["dtype"] = config, str(dtype)
    recorder.stage("build the model")
    base = h3_model.build_model(config, device, dtype, args.seed, weights=args.weights)
    patcher, patch = patch_variant(base, args.variant, result)
    dm = base.model.diffusion_model
    text_tokens = args.text_tokens if args.text_tokens is not None else min(256, args.seq // 16)
    inputs, sizes = make_inputs(dm, args.seq, text_tokens, device, args.seed + 1, args.steps)
    result["rows"] = {"total": args.seq, **sizes}
    tracer = make_tracer(device.type) if malloc_graph is None else None
    compiler = Compiler(graph_factory(malloc_graph, tracer, device, torch), args.assert_graph_breaks)
    result["graph_kind"] = "comfy_aimdo.malloc_graph" if malloc_graph is not None else "stand-in"
    return Session(args, device, dtype, dm, patcher, patch, inputs, compiler, recorder, tracer, torch)


def graph_factory(malloc_graph, tracer, device, torch):
    """How malloc_graph_begin records: comfy-aimdo on the current stream, or a stand-in on the tracer."""
    if malloc_graph is None:
        return lambda assert_breaks: StandInGraph(tracer, assert_breaks)
    import comfy.model_management as mm

    return lambda assert_breaks: malloc_graph.record(mm.current_stream(device), assert_breaks)


def patch_variant(base, name: str, result: dict):
    """(patcher to sample, the node's patch or None): the node on a clone, its settings in the result."""
    spec = VARIANTS[name]
    if spec is None:
        return base, None
    from devkit.pack import submodule

    # measure_peak off: the run's torch peak is read over the whole run, as for stock (the APPLY_MODEL wrapper
    # would reset it at every model call)
    settings = submodule("nodes.patch").Settings(**spec.settings(), measure_peak=False)
    clone, patch = submodule("nodes").patch_any_model(base, settings)
    result["settings"] = dataclasses.asdict(settings)
    return clone, patch


# --- the runs and the result ---------------------------------------------------------------------------
REPORT_KEYS = ("status", "error", "attention_calls", "backends_ran", "prepared", "prepared_skipped", "fallbacks",
               "skipped", "layout", "backend_requested", "prep_mode", "block_path", "blocks_patched",
               "refiner_blocks_patched", "block_path_blocks", "copies_per_call", "compile_events", "memory", "notes")


def run_all(args, result: dict, recorder: Recorder) -> None:
    torch, malloc_graph = start_host(args, recorder)
    session = build_session(args, torch, malloc_graph, recorder)
    for i in range(args.warmup_runs + 1):
        kind = "measured" if i == args.warmup_runs else f"warmup{i}"
        if kind == "measured" and session.device.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.reset_peak_memory_stats(session.device)
        run = sampling_run(session, kind)
        summarise_run(session, run)
        result["runs"].append(run)
        recorder.write()
        if run["error"] is not None:
            break
    finish(session, result, result["runs"][-1])


def summarise_run(session: Session, run: dict) -> None:
    """The run's output checksum in place of its output tensors."""
    out = run.pop("output", None)
    if out is None:
        return
    torch = session.torch
    digest = hashlib.sha256()
    for t in out:
        digest.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    run["output_sha256"] = digest.hexdigest()
    run["outputs_finite"] = all(bool(torch.isfinite(t).all()) for t in out)


def finish(session: Session, result: dict, run: dict) -> None:
    """The measured (or the failed) run's numbers at the top of the result."""
    for key in ("breaks_per_step", "break_sites", "step_seconds", "output_sha256", "outputs_finite"):
        result[key] = run.get(key)
    result["graph"] = run.get("graph")
    result["graph_breaks_total"] = run.get("graph_breaks")
    result["rogue_count"] = (run.get("graph") or {}).get("rogue_count")
    result["peak_memory"] = peak_memory(session, run)
    payload = session.patch.report.last if session.patch is not None else None
    if payload is not None:
        result["report"] = {k: payload.get(k) for k in REPORT_KEYS}
        result["backends_ran"], result["prepared"] = payload.get("backends_ran"), payload.get("prepared")
        result["plan_prepared"] = session.patch.plan.default.prepared  # the chain the runs planned from
    if isinstance(session.compiler.graph, StandInGraph) or session.tracer is not None:
        result["stand_in_calls_last_step"] = run.get("stand_in_calls_last_step")


def peak_memory(session: Session, run: dict) -> dict:
    graph = run.get("graph") or {}
    out = {"graph_peak_used": graph.get("peak_used"), "graph_physical_bytes": graph.get("physical_bytes"),
           "torch_max_allocated": None}
    if session.device.type == "cuda":
        with contextlib.suppress(Exception):
            out["torch_max_allocated"] = int(session.torch.cuda.max_memory_allocated(session.device))
    return out


def new_result(args) -> dict:
    return {"variant": args.variant, "settings": None, "device": args.device, "blocks": args.blocks,
            "steps": args.steps, "seq": args.seq, "weights": args.weights, "tiny": args.tiny,
            "warmup_runs": args.warmup_runs, "aimdo": not args.no_aimdo, "stage": "start", "runs": [],
            "breaks_per_step": None, "break_sites": None, "graph": None, "report": None, "backends_ran": None,
            "prepared": None, "errors": [], "error": None}


def main(argv=None) -> int:
    args = parse_args(argv)
    faulthandler.enable()  # a C++ abort (std::terminate) still prints the Python stack
    result = new_result(args)
    recorder = Recorder(args.out, result)
    started = time.perf_counter()
    try:
        run_all(args, result, recorder)
    except BaseException as exc:  # noqa: BLE001  (written to the JSON; the exit status says it failed)
        result["errors"].append(error_record(exc, result.get("stage")))
    result["errors"] += [r["error"] for r in result["runs"] if r.get("error")]
    first = result["errors"][0] if result["errors"] else None
    result["error"] = f"{first['type']}: {first['message']}" if first else None
    result["seconds_total"] = round(time.perf_counter() - started, 2)
    recorder.stage("done" if first is None else "failed")
    status = "ok" if first is None else f"FAILED: {result['error']}"
    print(f"[aimdo-emulation] {args.variant}: breaks per step {result['breaks_per_step']}, rogues "
          f"{result.get('rogue_count')}, backends {result['backends_ran']}: {status}", flush=True)
    return 0 if first is None else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the result is written: skip the interpreter's teardown, whose order of freeing tensors and unloading
    # comfy-aimdo is no part of what ComfyUI does between runs (a crash there would only hide the result)
    os._exit(code)
