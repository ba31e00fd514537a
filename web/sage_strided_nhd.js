// ComfyUI frontend extension for the Sage Strided NHD Attention node:
//  - a status line on the node saying which layout and attention back-end actually ran, any
//    fallbacks with their reasons, and how many copies per block the layout avoided;
//  - a setting for the back-end that newly added nodes start with.
// The status line is cleared when a run starts and filled from the report the node sends.
// Server text is only ever written with textContent.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { BACKEND_CHOICES, NODE_TYPE, REPORT_EVENT, formatReport, pickNodeForReport } from "./report_text.js";

const SETTING_DEFAULT_BACKEND = "SageStridedNHD.DefaultBackend";
const STATUS_WIDGET = "sage_nhd_status";

function settingValue(id) {
  const settings = app.extensionManager?.setting;
  if (settings?.get) return settings.get(id);
  return app.ui?.settings?.getSettingValue?.(id);
}

function ourNodes() {
  const graphs = [app.rootGraph ?? app.graph];
  const subgraphs = graphs[0]?.subgraphs;
  if (subgraphs?.values) graphs.push(...subgraphs.values());
  return graphs.flatMap((g) => (g?.nodes ?? []).filter((n) => n.comfyClass === NODE_TYPE || n.type === NODE_TYPE));
}

function statusElement(node) {
  const existing = node.widgets?.find((w) => w.name === STATUS_WIDGET);
  if (existing) return existing.element;
  const el = document.createElement("div");
  el.className = "sage-nhd-status";
  el.dataset.state = "idle";
  Object.assign(el.style, {
    whiteSpace: "pre-wrap",
    fontFamily: "monospace",
    fontSize: "11px",
    lineHeight: "1.35",
    padding: "4px 6px",
    borderRadius: "4px",
    background: "rgba(0, 0, 0, 0.25)",
    color: "var(--input-text, #ddd)",
    overflow: "hidden",
    pointerEvents: "none",
  });
  const widget = node.addDOMWidget(STATUS_WIDGET, "sage_nhd_status", el, {
    serialize: false,
    hideOnZoom: false,
    getValue: () => el.textContent,
    setValue: () => {},
    // room for every line plus two wrapped ones, so nothing is cut off on a narrow node
    getMinHeight: () => 15 * ((Number(el.dataset.lines) || 1) + 2) + 12,
  });
  // Not an input of the node: never saved into the workflow, never sent with the prompt.
  widget.serialize = false;
  return el;
}

function showStatus(node, state, lines) {
  const el = statusElement(node);
  el.dataset.state = state;
  el.textContent = lines.join("\n");
  el.dataset.lines = String(lines.length);
  el.style.borderLeft = `3px solid ${state === "report" ? "#4a4" : state === "fallback" ? "#c93" : "#666"}`;
  const needed = node.computeSize?.();
  if (needed && node.size && needed[1] > node.size[1]) node.setSize?.([node.size[0], needed[1]]);
  node.setDirtyCanvas?.(true, true);
}

function onReport(event) {
  const report = event.detail ?? {};
  const nodes = ourNodes();
  const byId = new Map(nodes.map((n) => [String(n.id), n]));
  const node = pickNodeForReport(report.node_id, byId, nodes);
  if (!node) return;
  node.sageNhdLastReport = report;
  const state = Array.isArray(report.fallbacks) && report.fallbacks.length ? "fallback" : "report";
  showStatus(node, state, formatReport(report));
}

function onRunStart() {
  for (const node of ourNodes()) showStatus(node, "running", ["waiting for this run's report…"]);
}

function onCached(event) {
  // A cached node does not run, so no report comes: say so and keep the last one visible.
  const cached = new Set((event.detail?.nodes ?? []).map(String));
  for (const node of ourNodes()) {
    if (!cached.has(String(node.id))) continue;
    const last = node.sageNhdLastReport;
    showStatus(node, "cached", ["cached: the patched model was reused", ...(last ? formatReport(last) : [])]);
  }
}

function onRunEnded(reason) {
  return () => {
    for (const node of ourNodes()) {
      const el = statusElement(node);
      if (el.dataset.state === "running") showStatus(node, "idle", [`no report: the run ${reason}`]);
    }
  };
}

app.registerExtension({
  name: "SageStridedNHD.Status",
  settings: [
    {
      id: SETTING_DEFAULT_BACKEND,
      category: ["Sage Strided NHD", "New nodes", "Default back-end"],
      name: "Attention back-end for newly added Sage Strided NHD Attention nodes",
      tooltip: "auto picks the fastest back-end this machine has and falls back when one cannot run. " +
        "Nodes in loaded workflows keep their saved value.",
      type: "combo",
      options: BACKEND_CHOICES,
      defaultValue: "auto",
    },
  ],
  nodeCreated(node) {
    if (node.comfyClass !== NODE_TYPE) return;
    // Loaded workflows overwrite this afterwards with their saved value, so only new nodes keep it.
    const wanted = settingValue(SETTING_DEFAULT_BACKEND);
    const backend = node.widgets?.find((w) => w.name === "backend");
    const options = backend?.options?.values;
    if (backend && wanted && (!Array.isArray(options) || options.includes(wanted))) backend.value = wanted;
    showStatus(node, "idle", ["not run yet: the status appears after a run"]);
  },
  setup() {
    api.addEventListener(REPORT_EVENT, onReport);
    api.addEventListener("execution_start", onRunStart);
    api.addEventListener("execution_cached", onCached);
    api.addEventListener("execution_error", onRunEnded("failed before this node reported"));
    api.addEventListener("execution_interrupted", onRunEnded("was interrupted"));
    api.addEventListener("execution_success", onRunEnded("ended without running this node"));
  },
});
