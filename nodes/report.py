"""One report per sampling run (the OUTER_SAMPLE wrapper opens and closes it): what the patched attention did, every
number counted or measured; logged and sent as ``REPORT_EVENT`` to the client that queued the prompt. Its payload is
documented in docs/ARCHITECTURE.md ("The run report")."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict

from comfy.model_management import InterruptProcessingException

from .. import kernels

log = logging.getLogger("sage_strided_nhd")

REPORT_EVENT = "sage_strided_nhd.report"
REPORT_SCHEMA = 5
TAKEN_AWAY = "forward_taken_away"  # the note of rule 10 (conflicts.forward_taken_away): the report's status follows it
# the comfy-kitchen layouts the int8 route takes, as the log and the status box name them (web/report_text.js:
# INT8_LAYOUT_LABELS, the same)
INT8_LAYOUTS = {"TensorWiseINT8Layout": "int8 ConvRot", "AsymW4A8Int8Layout": "W4A8"}


class RunReport:
    """Static facts about one patch and what the sampling run in progress did; it never decides (the plan does)."""

    def __init__(self, *, node_id, model_family, path, settings, blocks_patched=0, refiner_blocks_patched=0,
                 replaced_own_patch=False, notes=()):
        self.static = {"node_id": None if node_id is None else str(node_id), "model_family": model_family,
                       "path": path, "layout": settings.layout, "backend_requested": settings.backend,
                       "prep_mode": settings.prep_mode, "block_path": settings.block_path,
                       "blocks_patched": blocks_patched, "refiner_blocks_patched": refiner_blocks_patched,
                       "replaced_own_patch": replaced_own_patch}
        self.patch_notes = [asdict(n) for n in notes]  # decided when the node executed
        self.last: dict | None = None  # the last payload built
        self.begin_run()

    def begin_run(self) -> None:
        self.calls = self.stock_calls = self.head_chunks_max = self.copies = self.projected = self.int8_own = 0
        self.backends = Counter()
        # (backend, code, reason) -> calls: asked for and could not run; passed over unasked; no prepared path
        self.fallbacks, self.skipped, self.prepared_skipped = Counter(), Counter(), Counter()
        self.prepared = Counter()            # (backend, mode) -> calls
        self.compile_events: list[dict] = []
        self.int8_own_layouts = Counter()    # (layout,) -> the int8 route's calls on the pack's quantiser
        self.int8_stock = Counter()          # (layout, reason) -> the route's layouts' calls on stock's quantiser
        self.other_quantized = Counter()     # (layout,) -> calls of other quantized linears: stock's own call
        self.run = {k: self.static[k] for k in ("blocks_patched", "refiner_blocks_patched")} | {"block_path_blocks": 0}
        self.notes: list[dict] = list(self.patch_notes)
        self.status: str | None = None
        self.error: dict | None = None  # what ended a failed run
        self.peak_bytes: int | None = None   # the largest model call's peak allocation above its start
        self.released_bytes: int | None = None   # stock's video embedding handed back in a model call

    def measured_peak(self, nbytes) -> None:  # h3_patch.measured_call
        self.peak_bytes = max(self.peak_bytes or 0, int(nbytes))

    def released(self, nbytes) -> None:  # embedding_release.py
        self.released_bytes = max(self.released_bytes or 0, int(nbytes))

    def record(self, rec) -> None:  # one call through a back-end (its kernels.CallRecord)
        self.calls += 1
        self.backends[rec.backend] += 1
        for s in rec.skipped:
            (self.fallbacks if rec.fell_back(s) else self.skipped)[(s.backend, s.code, s.reason)] += 1
        self.head_chunks_max = max(self.head_chunks_max, rec.head_chunks)
        self.copies += rec.copies
        self.projected += rec.projected_chunks > 0
        if rec.prepared:
            self.prepared[(rec.backend, rec.prepared)] += 1
        if (s := rec.prepared_skipped) is not None:
            self.prepared_skipped[(s.backend, s.code, s.reason)] += 1
        self.compile_events.extend(dict(e) for e in rec.compiled)

    def record_int8(self, problem: str | None, layout: str = "TensorWiseINT8Layout") -> None:
        """A call of a linear in a layout the int8 route takes (``INT8_LAYOUTS``): the pack's quantiser, or why not."""
        if problem is None:
            self.int8_own += 1
            self.int8_own_layouts[(layout,)] += 1
        else:
            self.int8_stock[(layout, problem)] += 1

    def record_layout(self, layout: str) -> None:  # a linear in a layout the int8 route does not take
        self.other_quantized[(layout,)] += 1

    def record_stock(self, code: str, reason: str) -> None:  # a call handed back to ComfyUI's attention (override)
        self.stock_calls += 1
        self.fallbacks[("stock", code, reason)] += 1

    def planned(self, plan) -> None:  # the sampling run's patch.Plan: its notes and block counts
        self.notes = self.patch_notes + [asdict(n) for n in plan.notes]
        if self.static["path"] == "h3_forward_patch":
            self.run = {"blocks_patched": plan.blocks_patched, "refiner_blocks_patched": plan.refiner_blocks_patched,
                        "block_path_blocks": plan.block_path_blocks}

    def ended_by(self, exc: BaseException) -> None:
        if isinstance(exc, (KeyboardInterrupt, InterruptProcessingException)):
            self.status = "interrupted"
        else:
            self.status = "failed"
            self.error = {"type": type(exc).__name__, "message": str(exc)}

    def unsampled(self) -> dict | None:
        """At the end of a prompt the node ran in: where no sampling run used the patched model (a sampler with no
        step to take returns before any wrapper runs: denoise 0), the report says so; None where a run reported."""
        if self.last is not None:
            return None
        self.status = "no_model_calls"
        return self.finish_run()

    def payload(self) -> dict:
        reason = ("backend", "code", "reason")
        status = self.status or ("not_active" if any(n["code"] == TAKEN_AWAY for n in self.notes) else
                                 "ok" if self.calls or self.stock_calls else "no_attention_calls")
        p = {"schema": REPORT_SCHEMA, "prompt_id": getattr(_prompt_server(), "last_prompt_id", None), **self.static,
             **self.run, "status": status, "error": self.error, "attention_calls": self.calls,
             "backends_ran": dict(self.backends), "stock_calls": self.stock_calls,
             "fallbacks": _rows(self.fallbacks, reason), "skipped": _rows(self.skipped, reason),
             "prepared": _rows(self.prepared, ("backend", "mode"), "calls"),
             "prepared_skipped": _rows(self.prepared_skipped, reason), "head_chunks_max": self.head_chunks_max,
             "projected_by_chunks": self.projected,
             "copies_per_call": round(self.copies / self.calls, 3) if self.calls else 0.0,
             "compile_events": list(self.compile_events), "int8_own_quantizer_calls": self.int8_own,
             "int8_own_layouts": _rows(self.int8_own_layouts, ("layout",)),
             "int8_stock_quantizer": _rows(self.int8_stock, ("layout", "reason")),
             "other_quantized_linears": _rows(self.other_quantized, ("layout",)),
             "comfy_kitchen": _asked(lambda: kernels.kitchen_release_status(), "comfy-kitchen's release",
                                     release=None, route="stock") if self.int8_own or self.int8_stock else None,
             "int8_gemm": _asked(lambda: kernels.gemm_status(), "the int8 GEMM", kernel="comfy_kitchen")
             if self.int8_own else None,
             "memory": None if self.peak_bytes is None and self.released_bytes is None else {
                 "peak_bytes": self.peak_bytes, "released_bytes": self.released_bytes},
             "notes": list(self.notes)}
        p["messages"] = _messages(p)
        return p

    def finish_run(self) -> dict:
        """The payload, logged and sent to the client that queued the prompt (None: every client) where one runs."""
        p = self.last = self.payload()
        level = logging.WARNING if p["status"] != "ok" or p["fallbacks"] else logging.INFO
        for line in p["messages"]:
            log.log(level, "[Sage Strided NHD] %s", line)
        if (server := _prompt_server()) is not None:
            try:
                server.send_sync(REPORT_EVENT, p, getattr(server, "client_id", None))
            except Exception as exc:  # a UI problem must never fail the sampling run
                log.warning("[Sage Strided NHD] could not send the report to the UI: %s", exc)
        return p


def _rows(counter: Counter, keys: tuple, count: str = "count") -> list[dict]:
    return [dict(zip(keys, k), **{count: n}) for k, n in counter.items()]


def _messages(p: dict) -> list[str]:
    """The report as log lines: what was patched, how the run ended, then (when calls ran) what they did."""
    where = (f"{p['blocks_patched']} H3 blocks + {p['refiner_blocks_patched']} refiner blocks"
             if p["path"] == "h3_forward_patch" else "ComfyUI optimized_attention override")
    lines = [f"{p['model_family']}: {where}, layout {p['layout']}, back-end requested {p['backend_requested']}"]
    notes = [n["text"] for n in p["notes"] if n["code"] != TAKEN_AWAY or p["status"] != "not_active"]
    if p["status"] == "no_model_calls":
        return lines + notes + [NO_MODEL_CALLS]
    if p["status"] == "not_active":  # the calls that still came (H3's text refiner, run by ComfyUI's conditioning)
        taken = next(n["text"] for n in p["notes"] if n["code"] == TAKEN_AWAY)
        lines += notes + [f"not active: {taken}. {NOT_ACTIVE}"]
        return lines + (_attention_lines(p) if p["attention_calls"] else [])
    if p["path"] == "h3_forward_patch":
        lines.append(f"block fast path on {p['block_path_blocks']} of {p['blocks_patched']} blocks "
                     f"(block_path {p['block_path']}); the others: attention only")
    if p["memory"] is not None:
        lines.append(memory_line(p["memory"]))
    if p["status"] == "interrupted":
        lines.append("the sampling run was interrupted; the counts below cover the part that ran")
    elif p["status"] == "failed":
        lines.append(f"the sampling run failed: {p['error']['type']}: {p['error']['message']}")
    lines += notes
    if p["status"] == "no_attention_calls":
        return lines + ["no attention call went through the patch: this model does not call ComfyUI's "
                        "optimized_attention, so the node changed nothing. Remove it from this workflow."
                        if p["path"] == "attention_override" else
                        f"no attention call went through the patched H3 forwards this run: {NO_CALLS_CAUSE}"
                        if p["blocks_patched"] + p["refiner_blocks_patched"] else
                        "no attention call went through the patched H3 forwards this run"]
    lines += _attention_lines(p) + _int8_lines(p)
    lines += [f"compiled {e.get('backend')} kernel {e.get('key')} in {e.get('seconds')} s" for e in p["compile_events"]]
    if p["attention_calls"]:
        lines.append(f"copies made by the pack's dataflow: {p['copies_per_call']} per call")
    if p["replaced_own_patch"]:
        lines.append("the input model already had this node's patch: it was replaced by this one")
    return lines


def _attention_lines(p: dict) -> list[str]:
    """Which back-ends ran the attention calls, which were passed over or fell back, and how the calls ran."""
    lines = [f"{p['attention_calls']} attention calls ran on: "
             + (", ".join(f"{b} x{c}" for b, c in p["backends_ran"].items()) or "none")]
    if p["stock_calls"]:
        lines.append(f"{p['stock_calls']} calls were handed back to ComfyUI's own attention")
    if p["skipped"]:
        lines.append("skipped, not asked for: " + "; ".join(f"{s['backend']} ({s['reason']})" for s in p["skipped"]))
    lines += [f"fallback from {f['backend']} ({f['count']} calls): {f['reason']}" for f in p["fallbacks"]]
    if p["head_chunks_max"] > 1:
        lines.append(f"long sequence: calls split into up to {p['head_chunks_max']} head chunks (int32 offsets)")
    lines += [f"prepared path: {r['backend']} {r['mode']} x{r['calls']}" for r in p["prepared"]]
    lines += [f"no {s['backend']} prepared path ({s['count']} calls): {s['reason']}" for s in p["prepared_skipped"]]
    if p["projected_by_chunks"]:
        lines.append(f"qkv projection taken by token chunks in {p['projected_by_chunks']} calls "
                     "(its fused output never existed whole)")
    return lines


def _int8_lines(p: dict) -> list[str]:
    """Whose quantiser the route's linears ran on, by layout; comfy-kitchen's release, and the route's GEMM."""
    lines = [f"{INT8_LAYOUTS.get(r['layout'], r['layout'])} linears: {r['count']} calls quantised by the pack's pass "
             "(stock's bits)" for r in p["int8_own_layouts"]]
    lines += [f"{INT8_LAYOUTS.get(r['layout'], r['layout'])} linears on stock's quantiser ({r['count']} calls): "
              f"{r['reason']}" for r in p["int8_stock_quantizer"]]
    lines += [f"{r['layout']} linears: stock's call ({r['count']} calls; the int8 route takes "
              f"{' and '.join(INT8_LAYOUTS.values())} only)" for r in p["other_quantized_linears"]]
    if (status := p["comfy_kitchen"]) is not None:  # its release, and whether the route ran (not on a CPU) or why not
        route = KITCHEN_ROUTES.get(status.get("route"), f"int8 route {status.get('route')}")
        if not p["int8_own_quantizer_calls"] and status.get("route") in KITCHEN_UNRUN:
            route = KITCHEN_UNRUN[status["route"]]
        lines.append(f"comfy-kitchen {status.get('release') or '(release unknown)'}: {route}"
                     + (f" ({status['reason']})" if status.get("reason") else ""))
    if (gemm := p["int8_gemm"]) is not None:  # "int8 GEMM: the pack's (Triton)", or comfy-kitchen's CUTLASS (why)
        kernel = GEMM_KERNELS.get(gemm.get("kernel"), str(gemm.get("kernel")))
        kernel += SELF_CHECKED_GEMM if gemm.get("release") == "self_checked" else ""
        lines.append(f"int8 GEMM: {kernel}" + (f" ({gemm['reason']})" if gemm.get("reason") else ""))
    return lines


# the node ran but no sampling run used its model (web/report_text.js: NO_MODEL_CALLS, the same words)
NO_MODEL_CALLS = ("no model call: no sampling run used the patched model (a sampler with no step to take, "
                  "at denoise 0 for one, returns its latent without calling the model)")
# after "not active: <who> runs the model's forward (<how it shows>)." (rule 10)
NOT_ACTIVE = ("This node's patches are not reached through that forward: remove the node, or load the model with "
              "ComfyUI's own loader to run the pack")
# the H3 forwards were installed and no call reached them (web/report_text.js: NO_CALLS_CAUSE, the same words)
NO_CALLS_CAUSE = ("likely cause: something runs the model's forward without them that the checks at sampling start "
                  "cannot see (a loader's DIFFUSION_MODEL wrapper that does not call the model, a forward set on the "
                  "model while it samples, block replaces that skip the blocks' attention)")

# comfy-kitchen's release and the int8 route, the route's GEMM (web/report_text.js: KITCHEN_ROUTE_LABELS,
# GEMM_KERNEL_LABELS, the same keys)
KITCHEN_ROUTES = {"verified": "verified for the int8 route", "self_checked": "passed the int8 route's bits self-check",
                  "stock": "int8 route off, stock's quantiser runs"}
# the same releases where no int8 linear took the route this run (web/report_text.js: KITCHEN_UNRUN_LABELS)
KITCHEN_UNRUN = {"verified": "int8 route not run (a release verified for it)",
                 "self_checked": "int8 route not run (a release that passed its bits self-check)"}
# the Gluon kernel on a Triton release it was not measured with runs (or not) by a first-use bits check
SELF_CHECKED_GEMM = ", Gluon bits checked on this Triton"
GEMM_KERNELS = {"pack_sm90": "the pack's (Gluon, warp-specialised)", "pack": "the pack's (Triton)",
                "comfy_kitchen": "comfy-kitchen's CUTLASS"}


def _asked(ask, what: str, **on_error) -> dict:
    """``ask()`` as a dict, or ``on_error`` with the error as its reason: a report never fails the sampling run."""
    try:
        return dict(ask())
    except Exception as exc:
        return {**on_error, "reason": f"asking for {what} raised {type(exc).__name__}: {exc}"}


def byte_size(nbytes) -> str:
    """"2.3 GiB" from a GiB up, "840 MiB" from a MiB up, "96 KiB" below (one decimal under 10 MiB or 10 KiB)."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    unit, size = ("MiB", 2**20) if nbytes >= 2**20 else ("KiB", 2**10)
    return f"{nbytes / size:.{1 if nbytes < 10 * size else 0}f} {unit}"


def memory_line(memory: dict) -> str:
    """"model call needed: 2.2 GiB" where the peak was measured; "; 1.5 GiB of stock's video embedding handed back"
    where the first block released it."""
    peak, released = memory.get("peak_bytes"), memory.get("released_bytes")
    return "; ".join(p for p in (peak is not None and f"model call needed: {byte_size(peak)}",
                                 released and f"{byte_size(released)} of stock's video embedding handed back") if p)


def _prompt_server():
    try:
        from server import PromptServer
    except Exception:  # not inside a ComfyUI server (tests, benchmarks)
        return None
    return getattr(PromptServer, "instance", None)
