"""One report per sampling run: what the patched attention actually did.

The patched forwards (H3) and the attention override (other models) record every
call's ``kernels.CallRecord`` here. An OUTER_SAMPLE wrapper on the patched clone
opens a run before sampling and closes it after, so the report goes out exactly
once per sampling run: one log line, and one UI event. Every number in it is counted
during the run; nothing is a constant standing in for a measurement.

UI event
--------
Sent with ``PromptServer.instance.send_sync(REPORT_EVENT, payload, client_id)`` to the
client that queued the prompt (every client when the prompt has none). ``REPORT_EVENT = "sage_strided_nhd.report"``; payload (all keys
always present, JSON types)::

    {
      "schema": 2,                         # bumped when a key changes meaning
      "node_id": "12" | null,              # graph id of the node that made the patch
      "prompt_id": "..." | null,           # ComfyUI prompt being executed, when known
      "model_family": "MiniMaxH3",         # ComfyUI model class (model_base) of the patched model
      "path": "h3_forward_patch" | "attention_override",
      "layout": "strided_nhd" | "hnd",
      "backend_requested": "auto" | "sage2" | "sage1" | "comfy_kitchen_int8" | "sdpa",
      "prep_mode": "exact" | "fused" | "rotated",   # the node's sage2_prep (used only by a fast path)
      "blocks_patched": 50,                # H3 DiT blocks whose forward is this node's while sampling (0 on the override path)
      "refiner_blocks_patched": 2,         # H3 text refiner blocks, the same way (0 when off / override path)
      "attention_calls": 100,              # calls through the pack's attention this run
      "backends_ran": {"sdpa": 100},       # back-end that actually ran -> number of calls
      "stock_calls": 0,                    # override path: calls handed back to ComfyUI's own attention
      "fallbacks": [{"backend": "sage2", "reason": "...", "count": 100}],   # a requested or preferred
                                           # back-end that could not take calls, and why;
                                           # "stock": calls handed to ComfyUI's own attention
      "skipped_unavailable": [{"backend": "sage2", "reason": "..."}],     # auto only: back-ends not
                                           # installed/usable on this machine (normal, not a fallback)
      "head_chunks_max": 1,                # >1: a call was split over heads to stay within int32 offsets
      "copies_per_call": 0.0,              # tensor copies the pack's dataflow made, mean per call (measured)
      "fast_path": "sage2 prepared operands (exact) x100" | null,   # the back-end's prepared-operand path, calls
      "fast_path_skipped": [{"reason": "...", "count": 100}],      # why no fast path ran, when one was looked for
      "compile_events": [{"backend": "fa4", "key": "...", "seconds": 1.5}],   # JIT compiles the run triggered
      "replaced_own_patch": false,         # the input model already carried this node's patch; it was replaced
      "status": "ok" | "no_attention_calls" | "interrupted" | "failed",
      "notes": ["..."],                    # decisions taken while sampling: composed with / refused another
                                           # patch, the checkpoint's attention preference honoured or overridden
      "messages": ["..."]                  # human-readable lines (also logged)
    }
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("sage_strided_nhd")

REPORT_EVENT = "sage_strided_nhd.report"
REPORT_SCHEMA = 2
WRAPPER_KEY = "sage_strided_nhd"


class RunReport:
    """Static facts about one patch plus counters for the sampling run in progress.

    ``inspector(model_patcher, model_options) -> dict`` (set by the patch) runs when sampling
    starts, sees the whole patch stack of the model being sampled, and returns
    ``blocks_patched``/``refiner_blocks_patched``/``notes`` for this run, or raises
    ``conflicts.PatchConflictError`` to refuse it.
    """

    def __init__(self, *, node_id, model_family, path, layout, backend_requested, prep_mode="exact",
                 blocks_patched=0, refiner_blocks_patched=0, replaced_own_patch=False, inspector=None):
        self.static = {
            "node_id": None if node_id is None else str(node_id),
            "model_family": model_family,
            "path": path,
            "layout": layout,
            "backend_requested": backend_requested,
            "prep_mode": prep_mode,
            "blocks_patched": blocks_patched,
            "refiner_blocks_patched": refiner_blocks_patched,
            "replaced_own_patch": replaced_own_patch,
        }
        self.inspector = inspector
        self.last: dict | None = None  # the last payload built, for tests and callers
        self._reset()

    @property
    def sent(self) -> list[dict]:
        """Compatibility view: the last payload only (``[]`` before the first run)."""
        return [] if self.last is None else [self.last]

    def _reset(self):
        self.calls = 0
        self.backends = Counter()
        self.fallbacks = Counter()
        self.skipped_unavailable = {}
        self.stock_calls = 0
        self.head_chunks_max = 0
        self.copies = 0
        self.fast_paths = Counter()
        self.fast_path_skipped = Counter()
        self.compile_events: list[dict] = []
        self.run = {"blocks_patched": self.static["blocks_patched"],
                    "refiner_blocks_patched": self.static["refiner_blocks_patched"]}
        self.notes: list[str] = []
        self.status: str | None = None
        self.error: str | None = None

    # --- per call (called outside any traced region, see h3_patch/override) ------------------------
    def record(self, rec) -> None:
        """One call through a back-end; every field read from its ``kernels.CallRecord``."""
        self.calls += 1
        self.backends[rec.backend] += 1
        for s in rec.skipped:
            if rec.requested == "auto" and s.kind == "unavailable":
                # auto passing over what this machine lacks is the normal choice, not a fallback
                self.skipped_unavailable[s.backend] = s.reason
            else:
                self.fallbacks[(s.backend, s.reason)] += 1
        self.head_chunks_max = max(self.head_chunks_max, rec.head_chunks)
        self.copies += rec.copies
        if rec.fast_path:
            self.fast_paths[rec.fast_path] += 1
        if rec.fast_path_skipped:
            self.fast_path_skipped[rec.fast_path_skipped] += 1
        self.compile_events.extend(dict(e) for e in rec.compiled)

    def record_stock(self, reason: str) -> None:
        """One call handed back to ComfyUI's own attention function (override path)."""
        self.stock_calls += 1
        self.fallbacks[("stock", reason)] += 1

    def payload(self) -> dict:
        n = self.calls
        if self.status is not None:
            status = self.status
        else:
            status = "ok" if (self.calls or self.stock_calls) else "no_attention_calls"
        p = {
            "schema": REPORT_SCHEMA,
            "prompt_id": _current_prompt_id(),
            **self.static,
            **self.run,
            "attention_calls": n,
            "backends_ran": dict(self.backends),
            "stock_calls": self.stock_calls,
            "fallbacks": [{"backend": b, "reason": r, "count": c} for (b, r), c in self.fallbacks.items()],
            "skipped_unavailable": [{"backend": b, "reason": r} for b, r in self.skipped_unavailable.items()],
            "head_chunks_max": self.head_chunks_max,
            "copies_per_call": round(self.copies / n, 3) if n else 0.0,
            "fast_path": "; ".join(f"{k} x{c}" for k, c in self.fast_paths.items()) or None,
            "fast_path_skipped": [{"reason": r, "count": c} for r, c in self.fast_path_skipped.items()],
            "compile_events": list(self.compile_events),
            "status": status,
            "notes": list(self.notes),
        }
        p["messages"] = _messages(p, self.error)
        return p

    # --- run boundaries -------------------------------------------------------------------------
    def begin_run(self) -> None:
        self._reset()

    def inspect(self, model_patcher, model_options) -> None:
        """The stack check at sampling time (may raise PatchConflictError)."""
        if self.inspector is None or model_patcher is None:
            return
        found = self.inspector(model_patcher, model_options if model_options is not None else model_patcher.model_options)
        self.notes.extend(found.pop("notes", []))
        self.run.update(found)

    def finish_run(self) -> dict:
        p = self.payload()
        self.last = p
        level = logging.WARNING if p["status"] != "ok" or p["fallbacks"] else logging.INFO
        for line in p["messages"]:
            log.log(level, "[Sage Strided NHD] %s", line)
        send_to_ui(p)
        return p

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        """ComfyUI OUTER_SAMPLE wrapper: brackets one sampling run; exceptions pass through unchanged."""
        self.begin_run()
        try:
            guider = getattr(executor, "class_obj", None)
            self.inspect(getattr(guider, "model_patcher", None), getattr(guider, "model_options", None))
            return executor(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, _interrupt_types()):
                self.status = "interrupted"
            else:
                self.status = "failed"
                self.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.finish_run()


def _interrupt_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [KeyboardInterrupt]
    try:
        import comfy.model_management
        types.append(comfy.model_management.InterruptProcessingException)
    except Exception:  # not inside ComfyUI
        pass
    return tuple(types)


def _messages(p: dict, error: str | None = None) -> list[str]:
    lines = []
    where = (f"{p['blocks_patched']} H3 blocks + {p['refiner_blocks_patched']} refiner blocks"
             if p["path"] == "h3_forward_patch" else "ComfyUI optimized_attention override")
    lines.append(f"{p['model_family']}: {where}, layout {p['layout']}, back-end requested {p['backend_requested']}")
    if p["status"] == "interrupted":
        lines.append("the sampling run was interrupted; the counts below cover the part that ran")
    elif p["status"] == "failed":
        lines.append(f"the sampling run failed: {error or 'unknown error'}")
    lines.extend(p["notes"])
    if p["status"] == "no_attention_calls":
        if p["path"] == "attention_override":
            lines.append("no attention call went through the patch: this model does not call ComfyUI's "
                         "optimized_attention, so the node changed nothing. Remove it from this workflow.")
        else:
            lines.append("no attention call went through the patched H3 forwards this run")
        return lines
    ran = ", ".join(f"{b} x{c}" for b, c in p["backends_ran"].items()) or "none"
    lines.append(f"{p['attention_calls']} attention calls ran on: {ran}")
    if p["stock_calls"]:
        lines.append(f"{p['stock_calls']} calls were handed back to ComfyUI's own attention")
    if p["skipped_unavailable"]:
        lines.append("auto skipped, not available here: " + "; ".join(
            f"{s['backend']} ({s['reason']})" for s in p["skipped_unavailable"]))
    for f in p["fallbacks"]:
        lines.append(f"fallback from {f['backend']} ({f['count']} calls): {f['reason']}")
    if p["head_chunks_max"] > 1:
        lines.append(f"long sequence: calls split into up to {p['head_chunks_max']} head chunks to stay within int32 offsets")
    if p["fast_path"]:
        lines.append(f"fast path: {p['fast_path']}")
    for s in p["fast_path_skipped"]:
        lines.append(f"no fast path ({s['count']} calls): {s['reason']}")
    for e in p["compile_events"]:
        lines.append(f"compiled {e.get('backend')} kernel {e.get('key')} in {e.get('seconds')} s")
    if p["attention_calls"]:
        lines.append(f"copies made by the pack's dataflow: {p['copies_per_call']} per call")
    if p["replaced_own_patch"]:
        lines.append("the input model already had this node's patch: it was replaced by this one")
    return lines


def _current_prompt_id():
    server = _prompt_server()
    return getattr(server, "last_prompt_id", None) if server is not None else None


def _prompt_server():
    try:
        from server import PromptServer
    except Exception:  # not inside a ComfyUI server (tests, benchmarks)
        return None
    return getattr(PromptServer, "instance", None)


def send_to_ui(payload: dict) -> bool:
    """Send the report to the ComfyUI front end; False when no server is running."""
    server = _prompt_server()
    if server is None:
        return False
    try:
        # to the client that queued the prompt (None: every client)
        server.send_sync(REPORT_EVENT, payload, getattr(server, "client_id", None))
    except Exception as exc:  # a UI problem must never fail the sampling run
        log.warning("[Sage Strided NHD] could not send the report to the UI: %s", exc)
        return False
    return True


def install_run_report(model_patcher, report: RunReport) -> None:
    """Attach ``report`` to a (cloned) ModelPatcher: one run report per sampling run."""
    import comfy.patcher_extension

    model_patcher.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
    model_patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY,
                                       report.outer_sample_wrapper)
