// Turns the report the Sage Strided NHD Attention node sends after each run into short
// plain-text lines for the node's status box. Pure functions only: no DOM, no ComfyUI import,
// so the formatting can be tested on its own (tests/browser/report_text.test.mjs).
//
// The report (schema 5, docs/ARCHITECTURE.md: "The run report") carries its reasons as data: every fallback and skip has
// a short `code` beside the full `reason` sentence. The summary shows the code's label, the details
// show the sentence; nothing here parses the sentences.
//
// The lines come summary first (what ran, the layout, fallbacks and skips in short form, the
// prepared path), then the details (every full reason, the error, notes). The node shows the first
// STATUS_VISIBLE_LINES in a fixed-height box that scrolls for the rest, and the whole text as the
// box's tooltip: nothing is cut off, and the node never changes size.

export const NODE_TYPE = "SageStridedNHDAttention";
export const REPORT_EVENT = "sage_strided_nhd.report";
// Mirrors kernels.BACKEND_CHOICES; tests/unit/test_web_extension.py checks it against the kernels.
export const BACKEND_CHOICES = ["auto", "sage2", "fa4", "sdpa", "comfy_kitchen_int8", "sage1"];
// Lines of the status box visible without scrolling (a typical run fits).
export const STATUS_VISIBLE_LINES = 6;

// Short label of each reason code. Mirrors REASON_CODES in kernels/backends/base.py exactly
// (tests/unit/test_web_extension.py checks that they agree).
export const REASON_LABELS = {
  not_installed: "not installed",
  wrong_version: "other version installed",
  no_cuda: "needs CUDA",
  gpu_arch: "no kernel for this GPU",
  gpu_unavailable: "unavailable on this GPU",
  dtype: "dtype unsupported",
  head_dim: "head_dim unsupported",
  mask: "no mask support",
  strides: "needs contiguous last dim",
  shape: "shape unsupported",
  too_long: "sequence too long",
  raised: "raised an error",
  switched_off: "switched off",
  mode: "mode not offered",
  model_request: "model asked for stock attention",
  no_backend: "no back-end could run",
  self_test_failed: "failed its self-test",
};

// Report keys (nodes/report.py) the status does not show, and why; every other key is rendered
// (tests/unit/test_web_extension.py checks that against the schema in docs/ARCHITECTURE.md).
export const KEYS_NOT_SHOWN = {
  schema: "format version, not news for the user",
  prompt_id: "the run it belongs to is the one just queued",
  messages: "the log's sentences; the status renders the same facts from the data",
};

// What comfy-kitchen's release means for the int8 route (nodes/report.py: KITCHEN_ROUTES has the same keys).
export const KITCHEN_ROUTE_LABELS = {
  verified: "verified for the int8 route",
  self_checked: "self-checked for the int8 route",
  stock: "int8 route off: stock's quantiser runs",
};

// The same releases where no int8 linear took the route this run, a CPU among them: the line says the route did
// not run rather than that it was verified (nodes/report.py: KITCHEN_UNRUN, the same keys and texts).
export const KITCHEN_UNRUN_LABELS = {
  verified: "int8 route not run (a release verified for it)",
  self_checked: "int8 route not run (a release that passed its bits self-check)",
};

// Which int8 GEMM the route ran (nodes/report.py: GEMM_KERNELS has the same keys).
// the Gluon kernel on a Triton release it was not measured with runs (or not) by a first-use bits check
const SELF_CHECKED_GEMM = ", Gluon bits checked on this Triton";
export const GEMM_KERNEL_LABELS = {
  pack_sm90: "the pack's (Gluon, warp-specialised)",
  pack: "the pack's (Triton)",
  comfy_kitchen: "comfy-kitchen's CUTLASS",
};

// The layouts the int8 route takes, as the status box names them (nodes/report.py: INT8_LAYOUTS, the same).
export const INT8_LAYOUT_LABELS = {
  TensorWiseINT8Layout: "int8 ConvRot",
  AsymW4A8Int8Layout: "W4A8",
};

// The node ran but no sampling run used its model (nodes/report.py: NO_MODEL_CALLS, the same words).
export const NO_MODEL_CALLS = "no model call: no sampling run used the patched model (a sampler with no step to take, " +
  "at denoise 0 for one, returns its latent without calling the model)";

// H3: the patched forwards were installed and no call reached them (nodes/report.py: NO_CALLS_CAUSE, the same words).
export const NO_CALLS_CAUSE = "likely cause: something runs the model's forward without them that the checks at " +
  "sampling start cannot see (a loader's DIFFUSION_MODEL wrapper that does not call the model, a forward set on the " +
  "model while it samples, block replaces that skip the blocks' attention)";

// The note of a loader that runs the model's forward itself (nodes/conflicts.py: rule 10).
const TAKEN_AWAY = "forward_taken_away";

const MAX_SHORT_REASON_CHARS = 40;

function text(value, fallback = "?") {
  if (value === undefined || value === null || value === "") return fallback;
  return String(value);
}

// A layout the int8 route takes, named as nodes/report.py names it; a row without one (an older report) is "int8"
function int8Label(layout) {
  return Object.hasOwn(INT8_LAYOUT_LABELS, layout) ? INT8_LAYOUT_LABELS[layout] : text(layout, "int8");
}

function isNumber(value) {
  return typeof value === "number" && Number.isFinite(value);
}

function shorten(s, max) {
  return s.length > max ? s.slice(0, max - 1) + "…" : s;
}

// The entries of a list field that are objects (anything else in the list is ignored, not guessed at).
function objects(list) {
  return Array.isArray(list) ? list.filter((x) => x !== null && typeof x === "object" && !Array.isArray(x)) : [];
}

// " ×N", or "" when the count is missing.
function times(count) {
  return count === undefined || count === null ? "" : ` ×${text(count)}`;
}

// The short label of a reason code; for a code this extension does not know (a newer pack) or a
// missing one, the start of the full reason.
export function shortReason(code, reason) {
  if (typeof code === "string" && Object.hasOwn(REASON_LABELS, code)) return REASON_LABELS[code];
  return shorten(text(reason, "no reason given"), MAX_SHORT_REASON_CHARS);
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

// "sage2 exact ×100, sage2 fused ×4"; empty when no call took a prepared path.
export function formatPrepared(prepared) {
  return objects(prepared)
    .filter((p) => Number(p.calls) > 0)
    .map((p) => `${text(p.backend)}${p.mode ? ` ${text(p.mode)}` : ""} ×${Number(p.calls)}`)
    .join(", ");
}

// "RuntimeError: CUDA out of memory"; "" when there is no error.
export function formatError(error) {
  if (!error || typeof error !== "object") return "";
  const type = text(error.type, "");
  const message = text(error.message, "");
  if (type && message) return `${type}: ${message}`;
  return type || message;
}

// "2.3 GiB" from a GiB up, "840 MiB" from a MiB up, "96 KiB" below, one decimal under 10 MiB or 10 KiB
// (nodes/report.py: byte_size).
export function formatBytes(bytes) {
  const n = Number(bytes);
  if (n >= 2 ** 30) return `${(n / 2 ** 30).toFixed(1)} GiB`;
  const [unit, size] = n >= 2 ** 20 ? ["MiB", 2 ** 20] : ["KiB", 2 ** 10];
  return `${(n / size).toFixed(n < 10 * size ? 1 : 0)} ${unit}`;
}

// "model call needed: 2.2 GiB": the largest model call's peak, then "1.5 GiB of stock's video embedding
// handed back" where the first block released it (nodes/report.py: memory_line); "" without (null).
export function formatMemory(memory) {
  if (!memory || typeof memory !== "object" || Array.isArray(memory)) return "";
  const line = isNumber(memory.peak_bytes) ? `model call needed: ${formatBytes(memory.peak_bytes)}` : "";
  const released = isNumber(memory.released_bytes) && memory.released_bytes > 0
    ? `${formatBytes(memory.released_bytes)} of stock's video embedding handed back` : "";
  return [line, released].filter(Boolean).join("; ");
}

// "comfy-kitchen 0.2.40: verified for the int8 route"; with routeRan false (no int8 linear took the route)
// "comfy-kitchen 0.2.40: int8 route not run (...)"; "" when the report has no int8 linears (null).
export function formatKitchen(status, routeRan = true) {
  if (!status || typeof status !== "object" || Array.isArray(status)) return "";
  const unrun = !routeRan && Object.hasOwn(KITCHEN_UNRUN_LABELS, status.route);
  const labels = unrun ? KITCHEN_UNRUN_LABELS : KITCHEN_ROUTE_LABELS;
  const route = Object.hasOwn(labels, status.route) ? labels[status.route] : `int8 route ${text(status.route)}`;
  return `comfy-kitchen ${text(status.release, "(release unknown)")}: ${route}`;
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
  if (["no_attention_calls", "no_model_calls", "not_active"].includes(r.status)) return "no_calls";
  return Array.isArray(r.fallbacks) && r.fallbacks.length ? "fallback" : "report";
}

// The status lines for one report (schema 5, documented in docs/ARCHITECTURE.md). Every value is turned
// into a string here: the caller puts the result into textContent, never into HTML.
export function formatReport(report) {
  const r = report && typeof report === "object" ? report : {};
  const lines = [];
  const details = [];

  const headline = statusHeadline(r.status);
  if (headline) lines.push(headline);
  // the error first among the details: it is what ended the run
  const error = formatError(r.error);
  if (error) details.push(`error: ${error}`);

  const where = r.path === "attention_override"
    ? "attention override"
    : `${text(r.blocks_patched)} blocks + ${text(r.refiner_blocks_patched, "0")} refiner`;
  // not active: another loader runs the model's forward; who, and what shows it, is that note's text
  const taken = r.status === "not_active" ? objects(r.notes).find((n) => n.code === TAKEN_AWAY) : undefined;
  const notes = objects(r.notes).filter((n) => n.text && n !== taken);
  if (r.status === "not_active") lines.push(`not active: ${text(taken && taken.text)}`);
  if (r.status === "no_model_calls" || (r.status === "not_active" && !(Number(r.attention_calls) > 0))) {
    // nothing ran, so only what was patched follows (no counts, no fallbacks)
    if (r.status === "no_model_calls") lines.push(`ran: ${NO_MODEL_CALLS}`);
    return [...lines, `layout: ${text(r.layout)} · asked: ${text(r.backend_requested)}`,
      `${text(r.model_family, "model ?")}: ${where}`, ...notes.map((n) => `note: ${text(n.text)}`)];
  }
  if (r.status === "no_attention_calls") {
    lines.push("ran: nothing: no attention call went through the patch");
    if (r.path !== "attention_override" && Number(r.blocks_patched) + Number(r.refiner_blocks_patched) > 0) {
      details.push(NO_CALLS_CAUSE);
    }
  } else {
    lines.push(`ran: ${formatBackendsRan(r.backends_ran) || "none"}`);
  }
  const prep = r.prep_mode && r.prep_mode !== "exact" ? ` · prep: ${text(r.prep_mode)}` : "";
  lines.push(`layout: ${text(r.layout)} · asked: ${text(r.backend_requested)}${prep}`);
  if (Number(r.stock_calls) > 0) lines.push(`handed back to ComfyUI attention: ×${Number(r.stock_calls)}`);

  const fallbacks = objects(r.fallbacks);
  if (fallbacks.length === 0) lines.push("fallbacks: none");
  for (const f of fallbacks) {
    const stock = f.backend === "stock"; // calls handed to ComfyUI's own attention
    const what = stock ? "to ComfyUI attention" : `fallback from ${text(f.backend)}`;
    lines.push(`${what}${times(f.count)}: ${shortReason(f.code, f.reason)}`);
    if (f.reason) {
      details.push(`${stock ? "why calls went to ComfyUI attention" : `why ${text(f.backend)} fell back`}: ${text(f.reason)}`);
    }
  }

  // back-ends passed over that were never asked for (auto: those this machine lacks); not fallbacks
  const skipped = objects(r.skipped);
  if (skipped.length) {
    lines.push("skipped: " + skipped.map((s) => `${text(s.backend)} (${shortReason(s.code, s.reason)})`).join(", "));
    for (const s of skipped) {
      if (s.reason) details.push(`why ${text(s.backend)} was skipped: ${text(s.reason)}`);
    }
  }

  const prepared = formatPrepared(r.prepared);
  if (prepared) lines.push(`prepared: ${prepared}`);
  for (const s of objects(r.prepared_skipped)) {
    lines.push(`no prepared path${times(s.count)}: ${shortReason(s.code, s.reason)}`);
    if (s.reason) details.push(`why no ${text(s.backend)} prepared path: ${text(s.reason)}`);
  }

  if (Number(r.head_chunks_max) > 1) lines.push(`split over heads: up to ${Number(r.head_chunks_max)} chunks (int32 offsets)`);
  if (Number(r.projected_by_chunks) > 0) lines.push(`qkv projected by token chunks: ${Number(r.projected_by_chunks)} calls`);
  // the int8 route's calls by layout (a report without them: the total, as "int8")
  const own = objects(r.int8_own_layouts);
  for (const s of own.length ? own : [{ layout: "int8", count: r.int8_own_quantizer_calls }]) {
    const count = Number(s.count);
    if (count > 0) lines.push(`${int8Label(s.layout)} linears on the pack's quantiser: ${count} calls`);
  }
  // the route's calls left to stock's quantiser, by layout
  for (const s of objects(r.int8_stock_quantizer)) {
    const layout = int8Label(s.layout);
    lines.push(`${layout} linears on stock's quantiser${times(s.count)}`);
    if (s.reason) details.push(`why ${layout} linears kept stock's quantiser: ${text(s.reason)}`);
  }
  for (const s of objects(r.other_quantized_linears)) {
    lines.push(`${text(s.layout)} linears: stock's call${times(s.count)}`);
  }
  const kitchen = formatKitchen(r.comfy_kitchen, Number(r.int8_own_quantizer_calls) > 0);
  if (kitchen) lines.push(kitchen);
  if (kitchen && r.comfy_kitchen.reason) {
    details.push(`${r.comfy_kitchen.route === "stock" ? "why the int8 route is off" : "comfy-kitchen"}: ${text(r.comfy_kitchen.reason)}`);
  }

  const gemm = r.int8_gemm;
  if (gemm && typeof gemm === "object" && !Array.isArray(gemm)) {
    const kernel = Object.hasOwn(GEMM_KERNEL_LABELS, gemm.kernel) ? GEMM_KERNEL_LABELS[gemm.kernel] : text(gemm.kernel);
    lines.push(`int8 GEMM: ${kernel}${gemm.release === "self_checked" ? SELF_CHECKED_GEMM : ""}`);
    if (gemm.reason) {
      const why = gemm.kernel === "pack" ? "why not the warp-specialised int8 GEMM" : "why comfy-kitchen's int8 GEMM runs";
      details.push(`${why}: ${text(gemm.reason)}`);
    }
  }

  // one attention call per block on the H3 path, per call of the model on the override path
  const per = r.path === "attention_override" ? "call" : "block";
  if (isNumber(r.copies_per_call) && Number(r.attention_calls) > 0) lines.push(`copies made per ${per}: ${r.copies_per_call}`);

  for (const e of objects(r.compile_events)) {
    lines.push(`${text(e.backend)} compiled${isNumber(e.seconds) ? ` in ${e.seconds.toFixed(1)} s` : ""}`);
    if (e.key) details.push(`${text(e.backend)} compiled for ${text(e.key)}`);
  }

  lines.push(`${text(r.model_family, "model ?")}: ${where}`);
  if (r.path !== "attention_override" && isNumber(r.block_path_blocks)) {
    const off = r.block_path && r.block_path !== "exact" ? ` (block_path ${text(r.block_path)})` : "";
    lines.push(`block fast path: ${r.block_path_blocks} of ${text(r.blocks_patched)} blocks${off}`);
  }
  const memory = formatMemory(r.memory);
  if (memory) lines.push(memory);
  if (r.replaced_own_patch) lines.push("replaced an earlier patch of this node on the same model");

  // notes carry a code too (sparse_composed, preference_honoured, ...); the text says it all
  for (const note of notes) details.push(`note: ${text(note.text)}`);
  return [...lines, ...details];
}

// The bundled workflows' names, as the template browser shows them ("H3 2-step HND").
export const TEMPLATE_NAME = /^H3 \d+-step (strided NHD|HND)$/;

// Natural order ("2-step" before "12-step"), as the template browser's own A-Z sort compares.
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
