// Turns the report the Sage Strided NHD Attention node sends after each run into short
// plain-text lines for the node's status line. Pure functions only: no DOM, no ComfyUI import,
// so the formatting can be tested on its own (tests/browser/report_text.test.mjs).

export const NODE_TYPE = "SageStridedNHDAttention";
export const REPORT_EVENT = "sage_strided_nhd.report";
// Mirrors kernels.BACKEND_CHOICES; tests/test_web_extension.py checks it against the server's node definition.
export const BACKEND_CHOICES = ["auto", "sage2", "sdpa", "comfy_kitchen_int8", "sage1"];

const MAX_REASON_CHARS = 140;

function text(value, fallback = "?") {
  if (value === undefined || value === null || value === "") return fallback;
  return String(value);
}

function shorten(s, max = MAX_REASON_CHARS) {
  return s.length > max ? s.slice(0, max - 1) + "…" : s;
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

// The status lines for one report (schema 1, documented in nodes/report.py). Every value is turned
// into a string here: the caller puts the result into textContent, never into HTML.
export function formatReport(report) {
  const r = report && typeof report === "object" ? report : {};
  const lines = [];
  const where = r.path === "attention_override"
    ? "attention override"
    : `${text(r.blocks_patched)} blocks + ${text(r.refiner_blocks_patched, "0")} refiner`;
  lines.push(`${text(r.model_family, "model ?")}: ${where}`);
  lines.push(`layout: ${text(r.layout)} · asked: ${text(r.backend_requested)}`);

  if (r.status === "no_attention_calls") {
    lines.push("ran: nothing: no attention call went through the patch");
  } else {
    const ran = formatBackendsRan(r.backends_ran);
    lines.push(`ran: ${ran || "none"}`);
  }
  if (Number(r.stock_calls) > 0) lines.push(`handed back to ComfyUI attention: ×${Number(r.stock_calls)}`);

  const fallbacks = Array.isArray(r.fallbacks) ? r.fallbacks : [];
  if (fallbacks.length === 0) lines.push("fallbacks: none");
  for (const fb of fallbacks) {
    const f = fb && typeof fb === "object" ? fb : { reason: fb };
    const count = f.count !== undefined ? ` ×${text(f.count)}` : "";
    lines.push(shorten(`fallback from ${text(f.backend)}${count}: ${text(f.reason, "no reason given")}`));
  }
  const skipped = Array.isArray(r.skipped_unavailable) ? r.skipped_unavailable : [];
  if (skipped.length) {
    const names = skipped.map((sk) => text(sk && typeof sk === "object" ? sk.backend : sk)).join(", ");
    lines.push(shorten(`auto skipped (unavailable): ${names}`));
  }
  if (Number(r.head_chunks_max) > 1) lines.push(`split over heads: up to ${Number(r.head_chunks_max)} chunks (int32 offsets)`);

  const avoided = r.copies_avoided_per_call && typeof r.copies_avoided_per_call === "object"
    ? r.copies_avoided_per_call : {};
  const per = r.path === "attention_override" ? "call" : "block";
  lines.push(`copies avoided per ${per}: ${text(avoided.vs_hnd)} vs hnd, ${text(avoided.vs_stock)} vs stock`);
  if (r.replaced_own_patch) lines.push("replaced an earlier patch of this node on the same model");
  return lines;
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
