// ComfyUI frontend extension for the Sage Strided NHD Attention node:
//  - a status box on the node saying which layout and attention back-end actually ran, any
//    fallbacks and skips with their reasons, the prepared path and the copies the dataflow made;
//  - a setting for the back-end that newly added nodes start with;
//  - the pack's templates listed in natural order in the template browser.
// The status box has a fixed height (STATUS_VISIBLE_LINES lines, a typical run fits), so the node
// never grows when a report arrives and the bundled workflows keep their layout; a longer report
// scrolls inside the box, and the whole text is also the box's tooltip. Nothing is cut off.
// The box is cleared when a run starts and filled from the report the node sends.
// Server text is only ever written with textContent (and the title attribute).

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import {
  BACKEND_CHOICES, NODE_TYPE, REPORT_EVENT, STATUS_VISIBLE_LINES, formatReport, pickNodeForReport, reportState,
  sortOurTemplates,
} from "./report_text.js";

const SETTING_DEFAULT_BACKEND = "SageStridedNHD.DefaultBackend";
const STATUS_WIDGET = "sage_nhd_status";
const LINE_PX = 15;
const PAD_PX = 4;
const NEW_NODE_WIDTH_PX = 380;
const MARGIN_PX = 6; // around the box, inside the node (the frontend's default is 10)
// The widget's height on the node, the same for every report: the node's size never depends on it.
// (no bottom padding, so the last visible line is a whole one)
const STATUS_BOX_PX = STATUS_VISIBLE_LINES * LINE_PX + PAD_PX;
const STATE_COLOURS = { report: "#4a4", fallback: "#c93", interrupted: "#c93", failed: "#c44", no_calls: "#c93" };

// The template browser lists a pack's workflows in the server's directory order: list ours in natural
// order ("2 steps" before "12 steps", HND beside strided NHD). Only this pack's list is touched.
if (typeof api.getWorkflowTemplates === "function" && !api.getWorkflowTemplates.sageNhdSorted) {
  const listTemplates = api.getWorkflowTemplates.bind(api);
  const sorted = async (...args) => sortOurTemplates(await listTemplates(...args));
  sorted.sageNhdSorted = true;
  api.getWorkflowTemplates = sorted;
}

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
  // Nodes 2.0 hands the wheel to the canvas (zoom) unless the element under the pointer holds the focus
  // and asks for it: a click into the box gives it the focus, then the wheel scrolls the report
  el.dataset.captureWheel = "true";
  el.tabIndex = -1;
  Object.assign(el.style, {
    boxSizing: "border-box",
    // a fixed height of its own: the classic canvas sizes the widget's frame from getMinHeight/getMaxHeight
    // below, Nodes 2.0 lays the node out around its content; either way the box never grows with a report
    height: `${STATUS_BOX_PX}px`,
    minHeight: `${STATUS_BOX_PX}px`,
    maxHeight: `${STATUS_BOX_PX}px`,
    flex: "none",
    outline: "none", // focused by a click only to take the wheel: no focus ring
    whiteSpace: "pre-wrap",
    overflowWrap: "anywhere",
    fontFamily: "monospace",
    fontSize: "11px",
    lineHeight: `${LINE_PX}px`,
    padding: `${PAD_PX}px 6px 0 6px`,
    borderRadius: "4px",
    background: "rgba(0, 0, 0, 0.25)",
    color: "var(--input-text, #ddd)",
    // a long report scrolls inside the box (wheel or scrollbar); the text can be selected and copied
    overflowX: "hidden",
    overflowY: "auto",
    scrollbarWidth: "thin",
    userSelect: "text",
    pointerEvents: "auto",
  });
  const widget = node.addDOMWidget(STATUS_WIDGET, "sage_nhd_status", el, {
    serialize: false,
    hideOnZoom: false,
    getValue: () => el.textContent,
    setValue: () => {},
    margin: MARGIN_PX,
    // fixed: the node keeps its size whatever the report says
    getMinHeight: () => STATUS_BOX_PX + 2 * MARGIN_PX,
    getMaxHeight: () => STATUS_BOX_PX + 2 * MARGIN_PX,
  });
  // Not an input of the node: never saved into the workflow, never sent with the prompt.
  widget.serialize = false;
  return el;
}

function showStatus(node, state, lines) {
  const el = statusElement(node);
  const body = lines.join("\n");
  el.dataset.state = state;
  el.dataset.lines = String(lines.length);
  el.textContent = body;
  el.title = body; // the whole report on hover, whatever the box shows
  el.scrollTop = 0;
  el.style.borderLeft = `3px solid ${STATE_COLOURS[state] ?? "#666"}`;
  markOverflow(el);
  node.setDirtyCanvas?.(true, true);
}

// A soft edge at the bottom of the box while more lines are below (scroll, or hover for all).
function markOverflow(el) {
  const update = () => {
    const more = el.scrollHeight - el.scrollTop - el.clientHeight > 1;
    el.dataset.more = more ? "1" : "0";
    el.style.boxShadow = more ? "inset 0 -12px 8px -8px rgba(255, 255, 255, 0.28)" : "none";
  };
  if (!el.dataset.overflowWatched) {
    el.dataset.overflowWatched = "1";
    el.addEventListener("scroll", update, { passive: true });
  }
  requestAnimationFrame(update);
}

function onReport(event) {
  const report = event.detail ?? {};
  const nodes = ourNodes();
  const byId = new Map(nodes.map((n) => [String(n.id), n]));
  const node = pickNodeForReport(report.node_id, byId, nodes);
  if (!node) return;
  node.sageNhdLastReport = report;
  showStatus(node, reportState(report), formatReport(report));
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
    // New nodes start wide enough for a typical report's lines without wrapping (the bundled
    // workflows save this width; a loaded workflow's saved size replaces it).
    if (node.size) node.size[0] = Math.max(node.size[0], NEW_NODE_WIDTH_PX);
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
