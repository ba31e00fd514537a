"""One report per sampling run: what the patched attention actually did.

The patched forwards (H3) and the attention override (other models) record every
call's ``kernels.CallRecord`` here. An OUTER_SAMPLE wrapper on the patched clone
opens a run before sampling and closes it after, so the report goes out exactly
once per sampling run: one log line, and one UI event.

UI event
--------
Sent with ``PromptServer.instance.send_sync(REPORT_EVENT, payload, client_id)`` to the
client that queued the prompt (every client when the prompt has none). ``REPORT_EVENT = "sage_strided_nhd.report"``; payload (all keys
always present, JSON types)::

    {
      "schema": 1,                         # bumped when a key changes meaning
      "node_id": "12" | null,              # graph id of the node that made the patch
      "prompt_id": "..." | null,           # ComfyUI prompt being executed, when known
      "model_family": "MiniMaxH3",         # ComfyUI model class (model_base) of the patched model
      "path": "h3_forward_patch" | "attention_override",
      "layout": "strided_nhd" | "hnd",
      "backend_requested": "auto" | "sage2" | "sage1" | "comfy_kitchen_int8" | "sdpa",
      "blocks_patched": 50,                # H3 DiT blocks (0 on the override path)
      "refiner_blocks_patched": 2,         # H3 text refiner blocks (0 when off / override path)
      "attention_calls": 100,              # calls through the pack's attention this run
      "backends_ran": {"sdpa": 100},       # back-end that actually ran -> number of calls
      "stock_calls": 0,                    # override path: calls handed back to ComfyUI's own attention
      "fallbacks": [{"backend": "sage2", "reason": "...", "count": 100}],   # a requested or usable
                                           # back-end that could not take calls, and why;
                                           # "stock": calls handed to ComfyUI's own attention
      "skipped_unavailable": [{"backend": "sage2", "reason": "..."}],     # auto only: back-ends not
                                           # installed/usable on this machine (normal, not a fallback)
      "head_chunks_max": 1,                # >1: a call was split over heads to stay within int32 offsets
      "copies_per_call": 0.0,              # tensor copies the pack's dataflow made, mean per call
      "copies_avoided_per_call": {"vs_stock": 2.0, "vs_hnd": 4.0},   # per attention call = per block for H3
      "remaining_copies": ["..."],         # copies this path does not remove, in words
      "replaced_own_patch": false,         # the input model already carried this node's patch; it was replaced
      "status": "ok" | "no_attention_calls",
      "messages": ["..."]                  # human-readable lines (also logged)
    }
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("sage_strided_nhd")

REPORT_EVENT = "sage_strided_nhd.report"
REPORT_SCHEMA = 1
WRAPPER_KEY = "sage_strided_nhd"


class RunReport:
    """Static facts about one patch plus counters for the sampling run in progress."""

    def __init__(self, *, node_id, model_family, path, layout, backend_requested, blocks_patched=0,
                 refiner_blocks_patched=0, remaining_copies=(), replaced_own_patch=False):
        self.static = {
            "node_id": None if node_id is None else str(node_id),
            "model_family": model_family,
            "path": path,
            "layout": layout,
            "backend_requested": backend_requested,
            "blocks_patched": blocks_patched,
            "refiner_blocks_patched": refiner_blocks_patched,
            "remaining_copies": list(remaining_copies),
            "replaced_own_patch": replaced_own_patch,
        }
        self.sent: list[dict] = []  # every payload built, for tests and callers
        self._reset()

    def _reset(self):
        self.calls = 0
        self.backends = Counter()
        self.fallbacks = Counter()
        self.skipped_unavailable = {}
        self.stock_calls = 0
        self.head_chunks_max = 0
        self.copies = 0
        self.stock_copies = 0
        self.hnd_copies = 0

    def record(self, rec, *, stock_copies: int, hnd_copies: int) -> None:
        """One call through a back-end. ``stock_copies``/``hnd_copies``: what ComfyUI's own
        attention and the HND reference dataflow would have copied for this same call."""
        self.calls += 1
        self.backends[rec.backend] += 1
        for name, reason in rec.fallbacks:
            if self.static["backend_requested"] == "auto" and not _installed(name):
                # auto skipping what this machine lacks is the normal choice, not a fallback
                self.skipped_unavailable[name] = reason
            else:
                self.fallbacks[(name, reason)] += 1
        self.head_chunks_max = max(self.head_chunks_max, rec.head_chunks)
        self.copies += rec.copies
        self.stock_copies += stock_copies
        self.hnd_copies += hnd_copies

    def record_stock(self, reason: str) -> None:
        """One call handed back to ComfyUI's own attention function (override path)."""
        self.stock_calls += 1
        self.fallbacks[("stock", reason)] += 1

    def payload(self) -> dict:
        n = self.calls
        per = (lambda total: round(total / n, 3)) if n else (lambda total: 0.0)
        status = "ok" if (self.calls or self.stock_calls) else "no_attention_calls"
        p = {
            "schema": REPORT_SCHEMA,
            "prompt_id": _current_prompt_id(),
            **self.static,
            "attention_calls": self.calls,
            "backends_ran": dict(self.backends),
            "stock_calls": self.stock_calls,
            "fallbacks": [{"backend": b, "reason": r, "count": c} for (b, r), c in self.fallbacks.items()],
            "skipped_unavailable": [{"backend": b, "reason": r} for b, r in self.skipped_unavailable.items()],
            "head_chunks_max": self.head_chunks_max,
            "copies_per_call": per(self.copies),
            "copies_avoided_per_call": {"vs_stock": per(self.stock_copies - self.copies),
                                        "vs_hnd": per(self.hnd_copies - self.copies)},
            "status": status,
        }
        p["messages"] = _messages(p)
        return p

    # --- run boundaries -------------------------------------------------------------------------
    def begin_run(self) -> None:
        self._reset()

    def finish_run(self) -> dict:
        p = self.payload()
        self.sent.append(p)
        level = logging.WARNING if p["status"] != "ok" or p["fallbacks"] else logging.INFO
        for line in p["messages"]:
            log.log(level, "[Sage Strided NHD] %s", line)
        send_to_ui(p)
        return p

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        """ComfyUI OUTER_SAMPLE wrapper: brackets one sampling run."""
        self.begin_run()
        try:
            return executor(*args, **kwargs)
        finally:
            self.finish_run()


def _messages(p: dict) -> list[str]:
    lines = []
    where = (f"{p['blocks_patched']} H3 blocks + {p['refiner_blocks_patched']} refiner blocks"
             if p["path"] == "h3_forward_patch" else "ComfyUI optimized_attention override")
    lines.append(f"{p['model_family']}: {where}, layout {p['layout']}, back-end requested {p['backend_requested']}")
    if p["status"] == "no_attention_calls":
        lines.append("no attention call went through the patch: this model does not call ComfyUI's "
                     "optimized_attention, so the node changed nothing. Remove it from this workflow.")
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
    av = p["copies_avoided_per_call"]
    lines.append(f"copies per call: {p['copies_per_call']} made; avoided {av['vs_stock']} vs stock, {av['vs_hnd']} vs hnd")
    if p["replaced_own_patch"]:
        lines.append("the input model already had this node's patch: it was replaced by this one")
    return lines


def _installed(name: str) -> bool:
    from .. import kernels
    backend = kernels.BACKENDS.get(name)
    return bool(backend is not None and backend.available())


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
