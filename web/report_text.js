// Turns the report the Sage Strided NHD Attention node sends after each run into short
// plain-text lines for the node's status line. Pure functions only: no DOM, no ComfyUI import,
// so the formatting can be tested on its own (tests/browser/report_text.test.mjs).

export const NODE_TYPE = "SageStridedNHDAttention";
export const REPORT_EVENT = "sage_strided_nhd.report";
// Mirrors kernels.BACKEND_CHOICES; tests/test_web_extension.py checks it against the server's node definition.
export const BACKEND_CHOICES = ["auto", "sage2", "sage1", "comfy_kitchen_int8", "sdpa"];

const MAX_REASON_CHARS = 140;

function text(value, fallback = "?") {
  if (value === undefined || value === null || value === "") return fallback;
  return String(value);
}

function shorten(s, max = MAX_REASON_CHARS) {
  return s.length > max ? s.slice(0, max - 1) + "…" : s;
}

// "sage2 ×2400, sdpa ×8", biggest first; empty when nothing ran yet.
export function formatBackendsUsed(used) {
  if (!used || typeof used !== "object") return "";
  return Object.entries(used)
    .filter(([, calls]) => Number(calls) > 0)
    .sort((a, b) => Number(b[1]) - Number(a[1]))
    .map(([name, calls]) => `${name} ×${Number(calls)}`)
    .join(", ");
}

// The status lines for one report. Every value is turned into a string here: the caller puts the
// result into textContent, never into HTML.
export function formatReport(report) {
  const r = report && typeof report === "object" ? report : {};
  const lines = [];
  const family = r.model_family ? `${text(r.model_family)} · ` : "";
  const blocks = r.blocks_patched !== undefined ? `${text(r.blocks_patched)} blocks patched` : "blocks patched: ?";
  lines.push(`${family}${blocks}`);
  lines.push(`layout: ${text(r.layout)} · asked: ${text(r.backend_requested)}`);

  const ran = formatBackendsUsed(r.backends_used);
  lines.push(ran ? `ran: ${ran}` : "ran: no attention call recorded yet");

  const fallbacks = Array.isArray(r.fallbacks) ? r.fallbacks : [];
  if (fallbacks.length === 0) {
    lines.push("fallbacks: none");
  } else {
    for (const fb of fallbacks) {
      const f = fb && typeof fb === "object" ? fb : { reason: fb };
      lines.push(shorten(`fallback from ${text(f.backend)}: ${text(f.reason, "no reason given")}`));
    }
  }
  lines.push(`copies avoided: ${text(r.copies_avoided_per_block)} per block`);
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
