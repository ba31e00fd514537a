// Turns the report the Sage Strided NHD Attention node sends after each run into short
// plain-text lines for the node's status box. Pure functions only: no DOM, no ComfyUI import,
// so the formatting can be tested on its own (tests/browser/report_text.test.mjs).
//
// The lines come summary first (what ran, the layout, fallbacks and skips in short form, what the
// layout saved), then the details (every full reason, notes). The node shows the first
// STATUS_VISIBLE_LINES in a fixed-height box that scrolls for the rest, and the whole text as the
// box's tooltip: nothing is cut off, and the node never changes size.

export const NODE_TYPE = "SageStridedNHDAttention";
export const REPORT_EVENT = "sage_strided_nhd.report";
// Mirrors kernels.BACKEND_CHOICES; tests/unit/test_web_extension.py checks it against the kernels.
export const BACKEND_CHOICES = ["auto", "sage2", "fa4", "sdpa", "comfy_kitchen_int8", "sage1"];
// Lines of the status box visible without scrolling (a typical run fits).
export const STATUS_VISIBLE_LINES = 6;

// Report keys (nodes/report.py) the status does not show, and why; every other key is rendered
// (tests/unit/test_web_extension.py checks that against the schema in nodes/report.py).
export const KEYS_NOT_SHOWN = {
  schema: "format version, not news for the user",
  prompt_id: "the run it belongs to is the one just queued",
  remaining_copies: "old payloads only; the README explains the copies left",
};

const MAX_SHORT_REASON_CHARS = 40;

function text(value, fallback = "?") {
  if (value === undefined || value === null || value === "") return fallback;
  return String(value);
}

function isNumber(value) {
  return typeof value === "number" && Number.isFinite(value);
}

function shorten(s, max) {
  return s.length > max ? s.slice(0, max - 1) + "…" : s;
}

// Short forms of the reasons the back-ends give (kernels/backends/*.py); the full reason is always
// shown too, in the details.
const SHORT_REASONS = [
  [/triton is not installed/i, () => "needs Triton"],
  [/sageattention is 1\.x/i, () => "only 1.x installed"],
  [/sageattention is 2\.x/i, () => "2.x installed, use sage2"],
  [/not importable|no module named|not installed/i, () => "not installed"],
  [/no CUDA device|needs a CUDA device/i, () => "needs CUDA"],
  [/compute capability (\d+)\.(\d+)/i, (m) => `no kernel for sm${m[1]}${m[2]}`],
  [/has no int8_attention/i, () => "no int8_attention"],
  [/int8_attention_is_available failed/i, () => "availability check failed"],
  [/unavailable on this GPU/i, () => "unavailable on this GPU"],
  [/head_dim (\d+)/i, (m) => `head_dim ${m[1]} unsupported`],
  [/dtype (\S+) not in/i, (m) => `${m[1].replace(/^torch\./, "")} unsupported`],
  [/masks? (are|is) not supported/i, () => "no mask support"],
  [/must be contiguous/i, () => "needs contiguous last dim"],
];

// "sageattention not importable (ModuleNotFoundError: ...)" -> "not installed".
export function shortReason(reason) {
  const full = text(reason, "no reason given");
  for (const [pattern, make] of SHORT_REASONS) {
    const m = full.match(pattern);
    if (m) return make(m);
  }
  return shorten(full.split(/[;(:]/)[0].trim() || full, MAX_SHORT_REASON_CHARS);
}

// "sage2 ×2400, sdpa ×8", most calls first; empty when nothing ran.
export function formatBackendsRan(ran) {
  if (!ran || typeof ran !== "object") return "";
  return Object.entries(ran)
    .filter(([, calls]) => Number(calls) > 0)
    .sort((a, b) => Number(b[1]) - Number(a[1]))
    .map(([name, calls]) => `${name} ×${Number(calls)}`)
    .join(", ");
}

// "4 vs hnd, 2 vs stock"; a null (unknown) side is left out; "" when nothing is known.
export function formatCopiesAvoided(avoided) {
  if (!avoided || typeof avoided !== "object") return "";
  const parts = [];
  if (isNumber(avoided.vs_hnd)) parts.push(`${avoided.vs_hnd} vs hnd`);
  if (isNumber(avoided.vs_stock)) parts.push(`${avoided.vs_stock} vs stock`);
  return parts.join(", ");
}

function asObject(value, key) {
  return value && typeof value === "object" ? value : { [key]: value };
}

// The headline for runs that did not simply finish ("" when they did).
function statusHeadline(status) {
  if (status === "interrupted") return "run interrupted: counts cover the steps that ran";
  if (status === "failed") return "run failed: counts cover the calls before the error";
  return "";
}

// Which look the status box takes: report | fallback | interrupted | failed | no_calls.
export function reportState(report) {
  const r = report && typeof report === "object" ? report : {};
  if (r.status === "interrupted" || r.status === "failed") return r.status;
  if (r.status === "no_attention_calls") return "no_calls";
  return Array.isArray(r.fallbacks) && r.fallbacks.length ? "fallback" : "report";
}

// The status lines for one report (schema documented in nodes/report.py). Every value is turned
// into a string here: the caller puts the result into textContent, never into HTML.
export function formatReport(report) {
  const r = report && typeof report === "object" ? report : {};
  const lines = [];
  const details = [];

  const headline = statusHeadline(r.status);
  if (headline) lines.push(headline);
  if (r.status === "failed") {
    const error = r.error ?? (Array.isArray(r.messages) ? r.messages.find((m) => /failed:/.test(String(m))) : undefined);
    if (error) details.push(`error: ${text(error)}`);
  }

  if (r.status === "no_attention_calls") {
    lines.push("ran: nothing: no attention call went through the patch");
  } else {
    lines.push(`ran: ${formatBackendsRan(r.backends_ran) || "none"}`);
  }
  const prep = r.prep_mode && r.prep_mode !== "exact" ? ` · prep: ${text(r.prep_mode)}` : "";
  lines.push(`layout: ${text(r.layout)} · asked: ${text(r.backend_requested)}${prep}`);
  if (Number(r.stock_calls) > 0) lines.push(`handed back to ComfyUI attention: ×${Number(r.stock_calls)}`);

  const fallbacks = (Array.isArray(r.fallbacks) ? r.fallbacks : []).map((fb) => asObject(fb, "reason"));
  if (fallbacks.length === 0) lines.push("fallbacks: none");
  for (const f of fallbacks) {
    const count = f.count !== undefined && f.count !== null ? ` ×${text(f.count)}` : "";
    const reason = text(f.reason, "no reason given");
    const stock = f.backend === "stock"; // calls handed to ComfyUI's own attention
    lines.push(`${stock ? "to ComfyUI attention" : `fallback from ${text(f.backend)}`}${count}: ${shortReason(reason)}`);
    if (shortReason(reason) !== reason) {
      details.push(`${stock ? "why calls went to ComfyUI attention" : `why ${text(f.backend)} fell back`}: ${reason}`);
    }
  }

  const skipped = (Array.isArray(r.skipped_unavailable) ? r.skipped_unavailable : []).map((sk) => asObject(sk, "backend"));
  if (skipped.length) {
    lines.push("auto skipped: " + skipped.map((s) => (
      s.reason ? `${text(s.backend)} (${shortReason(s.reason)})` : text(s.backend))).join(", "));
    for (const s of skipped) {
      if (s.reason && shortReason(s.reason) !== String(s.reason)) details.push(`why ${text(s.backend)} was skipped: ${s.reason}`);
    }
  }

  if (r.fast_path) lines.push(`fast path: ${text(r.fast_path)}`);
  if (Number(r.head_chunks_max) > 1) lines.push(`split over heads: up to ${Number(r.head_chunks_max)} chunks (int32 offsets)`);

  for (const sk of Array.isArray(r.fast_path_skipped) ? r.fast_path_skipped : []) {
    const s = asObject(sk, "reason");
    const count = s.count !== undefined && s.count !== null ? ` ×${text(s.count)}` : "";
    const reason = text(s.reason, "no reason given");
    lines.push(`no fast path${count}: ${shortReason(reason)}`);
    if (shortReason(reason) !== reason) details.push(`why no fast path: ${reason}`);
  }

  const per = r.path === "attention_override" ? "call" : "block";
  const avoided = formatCopiesAvoided(r.copies_avoided_per_call);
  if (avoided) lines.push(`copies avoided per ${per}: ${avoided}`);
  else if (isNumber(r.copies_per_call) && Number(r.attention_calls) > 0) lines.push(`copies made per ${per}: ${r.copies_per_call}`);

  for (const ev of Array.isArray(r.compile_events) ? r.compile_events : []) {
    const e = asObject(ev, "backend");
    const secs = Number(e.seconds);
    lines.push(`${text(e.backend)} compiled${Number.isFinite(secs) ? ` in ${secs.toFixed(1)} s` : ""}`);
    if (e.key) details.push(`${text(e.backend)} compiled for ${text(e.key)}`);
  }

  const where = r.path === "attention_override"
    ? "attention override"
    : `${text(r.blocks_patched)} blocks + ${text(r.refiner_blocks_patched, "0")} refiner`;
  lines.push(`${text(r.model_family, "model ?")}: ${where}`);
  if (r.replaced_own_patch) lines.push("replaced an earlier patch of this node on the same model");
  for (const note of Array.isArray(r.notes) ? r.notes : []) {
    if (note !== undefined && note !== null && note !== "") lines.push(`note: ${text(note)}`);
  }
  return [...lines, ...details];
}

// The bundled workflows' names, as the template browser shows them ("MiniMax H3 - 2 steps - HND").
export const TEMPLATE_NAME = /^MiniMax H3 - \d+ steps - /;

// Natural order ("2 steps" before "12 steps"), as the template browser's own A-Z sort compares.
export function sortTemplateNames(names) {
  return [...names].sort((a, b) => a.localeCompare(b, "en", { numeric: true, sensitivity: "base" }));
}

// The server lists a pack's templates in directory order (unsorted); the browser's default view
// keeps that order. Sort only this pack's list (found by its names), leave every other pack's alone.
export function sortOurTemplates(byModule) {
  if (!byModule || typeof byModule !== "object") return byModule;
  const out = { ...byModule };
  for (const [module, names] of Object.entries(out)) {
    if (Array.isArray(names) && names.length && names.every((n) => TEMPLATE_NAME.test(String(n)))) {
      out[module] = sortTemplateNames(names);
    }
  }
  return out;
}

// Which node a report belongs to. Reports carry the prompt's node id ("12", or "5:12" inside a
// subgraph); a report that matches no node is shown on the only node of our type, if there is one.
export function pickNodeForReport(nodeId, nodesById, ourNodes) {
  const id = nodeId === undefined || nodeId === null ? "" : String(nodeId);
  if (nodesById.has(id)) return nodesById.get(id);
  const last = id.includes(":") ? id.split(":").pop() : null;
  if (last !== null && nodesById.has(last)) return nodesById.get(last);
  return ourNodes.length === 1 ? ourNodes[0] : null;
}
