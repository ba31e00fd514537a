// Headless Chromium against a running ComfyUI with this pack installed.
//
//   node tests/browser/ui_test.mjs --url http://127.0.0.1:PORT --graph small_graph.json --out test-artifacts \
//     --mode classic|nodes2
//
// --mode picks the frontend's canvas: the classic canvas, or "Modern Node Design (Nodes 2.0)"
// (setting Comfy.VueNodes.Enabled), where nodes are DOM elements laid out around their content and
// advanced inputs hide behind the node's "Show advanced inputs" button.
// Checks: the UI loads with no console error from the pack; the extension and its setting are
// registered; a new node takes the default back-end from the setting, a loaded workflow keeps its
// saved one; the template browser shows the four workflows with whole (not cut off) titles and
// their thumbnails; each bundled UI workflow turns into exactly its API twin in the real frontend;
// in each bundled workflow, the longest report the pack can produce (fixtures/longest_report.json),
// delivered through the frontend's websocket handler as the server sends it, leaves the layout
// intact: the node keeps its size, no two node boxes intersect, the node stays inside its group,
// no group header is covered, and every line of the status is reachable (box not clipped, text
// scrolls with the mouse wheel, whole text in the tooltip); the A/B widget (layout) shows without
// any toggle, every input can be reached (in Nodes 2.0 through a "Show advanced inputs" button that
// can be clicked, and the layout checks again with the advanced inputs shown); a small graph runs and the node's
// status is cleared before the run and then shows the back-end that ran. Writes results.json and
// screenshots (one per workflow) into --out. Exit code 0 only when every check passed.
import { chromium } from "playwright-core";
import { mkdirSync, readFileSync, writeFileSync, readdirSync } from "node:fs";
import { join, resolve } from "node:path";
import { REASON_LABELS } from "../../web/report_text.js";
import { CHROMIUM_ARGS, NODE_TYPE, arg } from "./cli.mjs";

const PACK = "comfyui-sage-strided-nhd";
const SETTING = "SageStridedNHD.DefaultBackend";


const url = arg("url");
const out = resolve(arg("out", "test-artifacts"));
const smallGraph = JSON.parse(readFileSync(arg("graph"), "utf8"));
const apiDir = resolve(arg("workflows", "workflows"), "api");
const browserPath = arg("chromium", "/usr/bin/chromium");
const longestReport = JSON.parse(readFileSync(new URL("./fixtures/longest_report.json", import.meta.url), "utf8"));
const REPORT_EVENT = "sage_strided_nhd.report";
const MODE = arg("mode", "classic");
if (!["classic", "nodes2"].includes(MODE)) throw new Error(`--mode must be classic or nodes2, got ${MODE}`);
const NODES2 = MODE === "nodes2";
const VUE_NODES_SETTING = "Comfy.VueNodes.Enabled";
// the node's inputs a user sets; layout is the one each bundled A/B pair differs in
const INPUTS = ["layout", "backend", "patch_text_refiner", "sage2_prep", "block_path"];
const AB_WIDGET = "layout";
const results = { mode: MODE, advanced: {} };
const slug = (name) => name.replace(/[^A-Za-z0-9]+/g, "-").replace(/^-|-$/g, "").toLowerCase();
mkdirSync(out, { recursive: true });

const checks = [];
function check(name, ok, detail = "") {
  checks.push({ name, ok: Boolean(ok), detail: String(detail) });
  console.log(`${ok ? "ok  " : "FAIL"} ${name}${detail && !ok ? `: ${detail}` : ""}`);
}

const fromPack = (s) => /sage[-_ ]?strided[-_ ]?nhd|SageStridedNHD|sage_nhd/i.test(s ?? "");
const consoleErrors = [];
const packProblems = [];

// Press Escape until no dialog is visible (the first-start template browser among them).
async function closeDialogs(page) {
  for (let i = 0; i < 5 && await page.locator('[role="dialog"]').first().isVisible().catch(() => false); i++) {
    await page.keyboard.press("Escape");
    await page.waitForTimeout(300);
  }
}

const browser = await chromium.launch({ executablePath: browserPath, headless: true, args: CHROMIUM_ARGS });
const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
// Only the local ComfyUI may be reached: anything else (e.g. the frontend looking up model
// download links from a workflow's notes) is aborted here, never sent.
const allowedOrigin = new URL(url).origin;
const blocked = [];
await page.route("**/*", (route) => {
  const target = route.request().url();
  if (target.startsWith(allowedOrigin) || target.startsWith("data:") || target.startsWith("blob:")) return route.continue();
  blocked.push(target);
  return route.abort();
});
page.on("console", (msg) => {
  if (msg.type() !== "error") return;
  const where = msg.location()?.url ?? "";
  const entry = `${msg.text()} @ ${where}`;
  consoleErrors.push(entry);
  if (fromPack(msg.text()) || fromPack(where)) packProblems.push(`console: ${entry}`);
});
page.on("pageerror", (err) => {
  const entry = `${err.message}\n${err.stack ?? ""}`;
  consoleErrors.push(entry);
  if (fromPack(entry)) packProblems.push(`uncaught: ${entry}`);
});
page.on("response", (r) => {
  if (r.status() >= 400 && fromPack(r.url())) packProblems.push(`HTTP ${r.status()} ${r.url()}`);
});

// The report goes through the frontend's own websocket message handler, exactly as the server's
// send_sync delivers it (falling back to the api object's dispatch when there is no socket).
async function deliverReport(report) {
  await page.evaluate(({ type, data }) => {
    const api = window.app.api;
    if (api.socket) api.socket.dispatchEvent(new MessageEvent("message", { data: JSON.stringify({ type, data }) }));
    else api.dispatchCustomEvent(type, data);
  }, { type: REPORT_EVENT, data: report });
}

const intersects = (a, b) => a[0] < b[0] + b[2] && b[0] < a[0] + a[2] && a[1] < b[1] + b[3] && b[1] < a[1] + a[3];
const inside = (a, b) => a[0] >= b[0] && a[1] >= b[1] && a[0] + a[2] <= b[0] + b[2] && a[1] + a[3] <= b[1] + b[3];
const TOL = 1.5;
const grown = (r, t) => [r[0] - t, r[1] - t, r[2] + 2 * t, r[3] + 2 * t];

// Where everything is, in graph units: each node's box (in Nodes 2.0 together with its drawn element's
// box, so a node that grows on the page is caught), the groups, and the status box on the screen.
async function measure(home) {
  return page.evaluate(({ type, home, nodes2 }) => {
    const { app, LiteGraph } = window;
    const nodes = app.graph.nodes;
    const node = nodes.find((n) => n.type === type);
    const canvasRect = app.canvas.canvas.getBoundingClientRect();
    const { scale, offset } = app.canvas.ds;
    const toGraph = (r) => [(r.left - canvasRect.left) / scale - offset[0], (r.top - canvasRect.top) / scale - offset[1],
      r.width / scale, r.height / scale];
    const union = (a, b) => {
      const x = Math.min(a[0], b[0]), y = Math.min(a[1], b[1]);
      return [x, y, Math.max(a[0] + a[2], b[0] + b[2]) - x, Math.max(a[1] + a[3], b[1] + b[3]) - y];
    };
    const drawn = (n) => {
      const el = nodes2 ? document.querySelector(`[data-node-id="${n.id}"]`) : null;
      const r = el?.getBoundingClientRect();
      return r && r.width > 0 ? toGraph(r) : null;
    };
    const box = (n) => {
      const b = n.getBounding();
      const d = drawn(n);
      return d ? union([b[0], b[1], b[2], b[3]], d) : [b[0], b[1], b[2], b[3]];
    };
    const groups = (app.graph.groups ?? app.graph._groups ?? []).map((gr) => {
      const b = gr._bounding ?? gr.bounding;
      const titleH = gr.titleHeight ?? LiteGraph.NODE_TITLE_HEIGHT;
      return { title: gr.title, box: [b[0], b[1], b[2], b[3]], header: [b[0], b[1], b[2], titleH] };
    });
    const el = node.widgets.find((w) => w.name === "sage_nhd_status").element;
    const style = getComputedStyle(el);
    const elRect = el.getBoundingClientRect();
    const frame = el.parentElement.getBoundingClientRect();
    const sage = box(node);
    const nodeScreen = [canvasRect.left + (sage[0] + offset[0]) * scale, canvasRect.top + (sage[1] + offset[1]) * scale,
      sage[2] * scale, sage[3] * scale];
    return {
      size: [...node.size], drawnHeight: drawn(node)?.[3] ?? null, scale,
      text: el.textContent, title: el.title, state: el.dataset.state,
      nodes: nodes.map((n) => ({ id: String(n.id), type: n.type, title: n.title, box: box(n) })),
      groups, home: groups.find((gr) => gr.title === home) ?? null, sage, nodeScreen,
      el: { clientHeight: el.clientHeight, scrollHeight: el.scrollHeight, clientWidth: el.clientWidth,
        scrollWidth: el.scrollWidth, overflowY: style.overflowY, pointerEvents: style.pointerEvents,
        visible: elRect.height > 0 && style.display !== "none" && style.visibility !== "hidden",
        rect: [elRect.left, elRect.top, elRect.width, elRect.height], frame: [frame.left, frame.top, frame.width, frame.height],
        center: [elRect.left + elRect.width / 2, elRect.top + elRect.height / 2] },
    };
  }, { type: NODE_TYPE, home, nodes2: NODES2 });
}

// No two nodes intersect, no group header is covered, the node stays inside its group, the status box is whole.
function checkGeometry(label, g) {
  const overlaps = [];
  for (let i = 0; i < g.nodes.length; i++) {
    for (let j = i + 1; j < g.nodes.length; j++) {
      if (intersects(g.nodes[i].box, g.nodes[j].box)) overlaps.push(`${g.nodes[i].title ?? g.nodes[i].type} x ${g.nodes[j].title ?? g.nodes[j].type}`);
    }
  }
  const covered = [];
  for (const gr of g.groups) {
    for (const n of g.nodes) if (intersects(gr.header, n.box)) covered.push(`"${gr.title}" by ${n.title ?? n.type}`);
  }
  check(`${label}: no two node boxes intersect`, overlaps.length === 0, overlaps.join("; "));
  check(`${label}: no group header is covered by a node`, covered.length === 0, covered.join("; "));
  check(`${label}: the node stays inside its group, below the header`,
    g.home && inside(g.sage, g.home.box) && g.sage[1] >= g.home.box[1] + g.home.header[3],
    `node ${JSON.stringify(g.sage)} group ${JSON.stringify(g.home)}`);
  // the box itself is whole: drawn, inside the node and not cut by its frame, no text past its right edge
  check(`${label}: status box is drawn inside the node and not cut off`,
    g.el.visible && inside(g.el.rect, grown(g.nodeScreen, TOL)) && g.el.rect[3] <= g.el.frame[3] + TOL
      && g.el.scrollWidth <= g.el.clientWidth,
    JSON.stringify({ el: g.el, node: g.nodeScreen }));
}

// Every line of the status can be read: it all fits, or the box scrolls (with the real mouse wheel, after a
// click into the box, as Nodes 2.0 asks) to its last line while the canvas keeps its zoom.
async function checkStatusReadable(label, g) {
  let reachable = g.el.scrollHeight <= g.el.clientHeight;
  let detail = `scrollHeight ${g.el.scrollHeight} clientHeight ${g.el.clientHeight} overflowY ${g.el.overflowY} pointerEvents ${g.el.pointerEvents}`;
  if (!reachable && ["auto", "scroll"].includes(g.el.overflowY) && g.el.pointerEvents !== "none") {
    await page.mouse.click(g.el.center[0], g.el.center[1]);
    for (let i = 0; i < 40; i++) await page.mouse.wheel(0, 120);
    await page.waitForTimeout(300);
    const end = await page.evaluate((type) => {
      const node = window.app.graph.nodes.find((n) => n.type === type);
      const el = node.widgets.find((w) => w.name === "sage_nhd_status").element;
      return { top: el.scrollTop, client: el.clientHeight, height: el.scrollHeight, scale: window.app.canvas.ds.scale };
    }, NODE_TYPE);
    reachable = end.top > 0 && end.top + end.client >= end.height - 1 && end.scale === g.scale;
    detail += `; after the wheel: scrollTop ${end.top}, canvas scale ${end.scale} (was ${g.scale})`;
  }
  check(`${label}: every line of the status can be read (fits, or scrolls to the end with the wheel)`, reachable, detail);
  check(`${label}: the whole status is the box's tooltip`, g.title === g.text && g.text.length > 0, g.title.slice(0, 120));
}

// Each input of the node as the user meets it: shown, on top of everything at its place, and the control there
// is that input's (classic: the canvas's hit test; Nodes 2.0: the element under the pointer is the input's row).
async function inputsOnScreen() {
  return page.evaluate(({ type, inputs, nodes2 }) => {
    const { app, LiteGraph } = window;
    const node = app.graph.nodes.find((n) => n.type === type);
    const out = {};
    if (!nodes2) {
      for (const name of inputs) {
        const w = node.widgets.find((x) => x.name === name);
        if (!w) continue;
        const h = w.computedHeight ?? LiteGraph.NODE_WIDGET_HEIGHT;
        const x = node.pos[0] + node.size[0] * 0.6;
        const y = node.pos[1] + (w.last_y ?? -1e6) + h / 2;
        const shown = node.isWidgetVisible ? node.isWidgetVisible(w) : true;
        out[name] = { shown, reachable: shown && app.graph.getNodeOnPos(x, y) === node && node.getWidgetOnPos(x, y, true) === w,
          value: w.value };
      }
      return out;
    }
    const root = document.querySelector(`[data-node-id="${node.id}"]`);
    const rows = [...root.querySelectorAll(".lg-node-widget")];
    for (const name of inputs) {
      const row = rows.find((r) => r.innerText.split("\n")[0].trim() === name);
      if (!row) { out[name] = { shown: false, reachable: false }; continue; }
      const r = row.getBoundingClientRect();
      const x = r.left + r.width * 0.75, y = r.top + r.height / 2;
      const onPage = x >= 0 && y >= 0 && x <= innerWidth && y <= innerHeight;
      const hit = onPage ? document.elementFromPoint(x, y) : null;
      out[name] = { shown: r.height > 0, reachable: Boolean(hit && row.contains(hit)), value: node.widgets.find((w) => w.name === name)?.value };
    }
    const button = root.querySelector('[data-testid="advanced-inputs-button"]');
    if (button) {
      const b = button.getBoundingClientRect();
      const hit = document.elementFromPoint(b.left + b.width / 2, b.top + b.height / 2);
      out.__button = { text: button.innerText.trim(), center: [b.left + b.width / 2, b.top + b.height / 2],
        clickable: Boolean(hit && button.contains(hit)) };
    }
    return out;
  }, { type: NODE_TYPE, inputs: INPUTS, nodes2: NODES2 });
}

function checkInputs(label, seen, expected) {
  const names = INPUTS.filter((n) => expected.includes(n));
  const bad = names.filter((n) => !seen[n]?.reachable);
  check(`${label}: inputs ${names.join(", ")} can be reached`, bad.length === 0, `${bad.join(", ")}: ${JSON.stringify(seen)}`);
}

// In the workflow just loaded: deliver the longest report, then check the layout, the inputs and the text.
async function checkLayoutWithLongestReport(name) {
  const label = `${MODE} ${name}`;
  const before = await page.evaluate((type) => {
    const node = window.app.graph.nodes.find((n) => n.type === type);
    const groups = window.app.graph.groups ?? window.app.graph._groups ?? [];
    const home = groups.find((g) => {
      const [x, y, w, h] = g._bounding ?? g.bounding;
      return node.pos[0] >= x && node.pos[0] <= x + w && node.pos[1] >= y && node.pos[1] <= y + h;
    });
    return { id: String(node.id), size: [...node.size], group: home?.title ?? null };
  }, NODE_TYPE);
  // show the node at 100% so the status box is drawn at its real size, then let the canvas settle
  await page.evaluate((type) => {
    const canvas = window.app.canvas;
    const node = window.app.graph.nodes.find((n) => n.type === type);
    canvas.ds.scale = 1;
    canvas.ds.offset[0] = -node.pos[0] + 560;
    canvas.ds.offset[1] = -node.pos[1] + 300;
    canvas.setDirty(true, true);
  }, NODE_TYPE);
  await page.waitForTimeout(600);
  const idle = await measure(before.group);
  await deliverReport({ ...longestReport, node_id: before.id });
  await page.waitForTimeout(600);
  const g = await measure(before.group);
  check(`${label}: report arrived on the node`, /^ran: sdpa ×1100/m.test(g.text) && g.state === longestReport.status, g.text.slice(0, 200));
  check(`${label}: node keeps its size when the report arrives`,
    JSON.stringify(g.size) === JSON.stringify(idle.size) && g.drawnHeight === idle.drawnHeight,
    `${JSON.stringify([idle.size, idle.drawnHeight])} -> ${JSON.stringify([g.size, g.drawnHeight])}`);
  checkGeometry(label, g);
  await checkStatusReadable(label, g);
  // the short form is the label of each skip's reason code (reasons are data)
  const skipLine = "skipped: " + longestReport.skipped.map((s) => `${s.backend} (${REASON_LABELS[s.code]})`).join(", ");
  check(`${label}: skips shown in short form with their reasons`,
    g.text.split("\n").includes(skipLine) && longestReport.skipped.every((s) => g.text.includes(s.reason)),
    `${skipLine}\n${g.text}`);

  await checkEveryInput(label, name, before.group);
  await page.evaluate((type) => {
    const node = window.app.graph.nodes.find((n) => n.type === type);
    node.widgets.find((w) => w.name === "sage_nhd_status").element.scrollTop = 0;
  }, NODE_TYPE);
  await page.screenshot({ path: join(out, `workflow-${slug(name)}.png`) });
}

// The A/B widget shows without any toggle, with this workflow's value; then every input, the advanced ones
// through the node's own button where the mode hides them, and the layout again with them shown.
async function checkEveryInput(label, name, home) {
  await page.mouse.move(5, 500);
  let seen = await inputsOnScreen();
  const ab = /strided NHD/.test(name) ? "strided_nhd" : "hnd";
  check(`${label}: the A/B widget (${AB_WIDGET}) shows, with the workflow's value`,
    seen[AB_WIDGET]?.reachable && seen[AB_WIDGET].value === ab, JSON.stringify(seen[AB_WIDGET]));
  const hidden = INPUTS.filter((n) => !seen[n]?.shown);
  checkInputs(`${label}: without advanced inputs`, seen, INPUTS.filter((n) => !hidden.includes(n)));
  results.advanced[label] = { hiddenUntilAsked: hidden, button: seen.__button ?? null };
  if (hidden.length) {
    const button = seen.__button;
    check(`${label}: the "Show advanced inputs" button can be clicked`, button?.clickable, JSON.stringify(button));
    if (button?.clickable) {
      await page.mouse.click(button.center[0], button.center[1]);
      await page.waitForTimeout(600);
    }
    await page.mouse.move(5, 500);
    seen = await inputsOnScreen();
    checkInputs(`${label}: with advanced inputs shown`, seen, INPUTS);
    checkGeometry(`${label} (advanced inputs shown)`, await measure(home));
  }
}

try {
  await page.goto(url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(
    () => window.app?.graph && window.app?.extensionManager?.setting && window.LiteGraph,
    null, { timeout: 120_000 });
  await page.waitForFunction(
    () => window.app.extensions?.some((e) => e.name === "SageStridedNHD.Status"), null, { timeout: 30_000 });
  check("extension registered once", await page.evaluate(
    () => window.app.extensions.filter((e) => e.name === "SageStridedNHD.Status").length === 1));
  await page.evaluate(({ id, on }) => window.app.extensionManager.setting.set(id, on), { id: VUE_NODES_SETTING, on: NODES2 });
  await page.waitForTimeout(500);
  check(`canvas mode is ${MODE}`, await page.evaluate((id) => window.app.extensionManager.setting.get(id), VUE_NODES_SETTING) === NODES2);

  // --- the setting and a newly added node ---
  const settingDefault = await page.evaluate((id) => window.app.extensionManager.setting.get(id), SETTING);
  check("setting registered with default 'auto'", settingDefault === "auto", settingDefault);
  await page.evaluate((id) => window.app.extensionManager.setting.set(id, "sdpa"), SETTING);
  const added = await page.evaluate((type) => {
    const node = window.LiteGraph.createNode(type);
    window.app.graph.add(node);
    const backend = node.widgets.find((w) => w.name === "backend")?.value;
    const layout = node.widgets.find((w) => w.name === "layout")?.value;
    const status = node.widgets.find((w) => w.name === "sage_nhd_status");
    return { id: node.id, backend, layout, status: status?.element?.textContent ?? null, width: node.size[0],
      saved: node.serialize().widgets_values };
  }, NODE_TYPE);
  check("node can be added", added.id !== undefined && added.layout === "strided_nhd", JSON.stringify(added));
  check("new node takes the default back-end from the setting", added.backend === "sdpa", added.backend);
  check("new node shows an idle status", (added.status ?? "").startsWith("not run yet"), added.status);
  check("new node is wide enough for a typical report", added.width >= 380, added.width);
  check("status line is not saved with the workflow",
    JSON.stringify(added.saved.slice(0, 3)) === JSON.stringify(["strided_nhd", "sdpa", true])
      && !added.saved.some((v) => typeof v === "string" && /not run yet|ran: /.test(v)), JSON.stringify(added.saved));
  await page.screenshot({ path: join(out, "node-added.png") });

  // --- the node is found by the node search box (double-click on the canvas) ---
  // On a slow machine the first-start template browser can open late, and keys typed before the
  // search input has focus are lost, so each attempt closes every dialog first, waits for the
  // search input and types into it; three attempts before the check fails.
  await page.evaluate(() => window.app.graph.clear());
  const hit = page.locator('[role="option"], li, .option-container').filter({ hasText: "Sage Strided NHD Attention" }).first();
  let found = false;
  let searchDetail = "";
  for (let attempt = 0; attempt < 3 && !found; attempt++) {
    await closeDialogs(page);
    await page.mouse.dblclick(800, 500);
    const input = page.locator('[role="dialog"] input:visible').first();
    if (!await input.waitFor({ timeout: 5_000 }).then(() => true, () => false)) {
      searchDetail = `attempt ${attempt + 1}: no search input appeared after the double-click`;
      continue;
    }
    await input.click();
    await input.pressSequentially("Sage Strided", { delay: 30 });
    found = await hit.waitFor({ timeout: 15_000 }).then(() => true, () => false);
    if (!found) {
      searchDetail = `attempt ${attempt + 1}: typed ${JSON.stringify(await input.inputValue().catch(() => "?"))}, ` +
        `options seen: ${JSON.stringify(await page.locator('[role="option"]').allTextContents().catch(() => []))}`;
    }
  }
  await page.screenshot({ path: join(out, "node-search.png") });
  check("node search finds Sage Strided NHD Attention", found, searchDetail);
  await page.keyboard.press("Escape");
  await page.waitForTimeout(300);

  // --- the template browser shows the pack's workflows, titles whole, thumbnails loaded ---
  const expected = readdirSync(apiDir).filter((f) => f.endsWith(".json")).map((f) => f.slice(0, -5)).sort();
  await page.evaluate(() => window.app.extensionManager.command.execute("Comfy.BrowseTemplates"));
  const category = page.getByText(PACK.slice(0, 18), { exact: false }).first();
  await category.waitFor({ timeout: 30_000 });
  await category.click();
  const cards = [];
  for (const name of expected) {
    const card = page.locator(`[data-testid="template-workflow-${name}"]`).first();
    const seen = await card.waitFor({ timeout: 15_000 }).then(() => true, () => false);
    if (!seen) continue;
    await card.locator("img").first().evaluate((img) => img.complete || new Promise((r) => { img.onload = img.onerror = r; }))
      .catch(() => {});
    cards.push(await card.evaluate((el) => {
      const h = el.querySelector("h3");
      const img = el.querySelector("img");
      return { title: h?.textContent?.trim(), whole: h ? h.scrollWidth <= h.clientWidth : false,
        thumb: img ? img.naturalWidth : 0, thumbSquare: img ? img.naturalWidth === img.naturalHeight : false };
    }));
  }
  await page.waitForTimeout(500);
  const order = await page.evaluate(() => [...document.querySelectorAll('[data-testid^="template-workflow-"] h3')]
    .map((h) => h.textContent.trim()));
  const natural = [...expected].sort((a, b) => a.localeCompare(b, "en", { numeric: true, sensitivity: "base" }));
  check("template cards in natural order (2 steps before 12 steps)", JSON.stringify(order) === JSON.stringify(natural),
    JSON.stringify(order));
  await page.screenshot({ path: join(out, "template-browser.png") });
  check("template browser shows the four workflows under the pack",
    JSON.stringify(cards.map((c) => c.title).sort()) === JSON.stringify(expected), JSON.stringify(cards));
  check("template cards show whole titles (not cut off)", cards.length === 4 && cards.every((c) => c.whole),
    JSON.stringify(cards));
  check("template cards show their square thumbnails (title and one-line description)",
    cards.length === 4 && cards.every((c) => c.thumb > 0 && c.thumbSquare), JSON.stringify(cards));
  await page.keyboard.press("Escape");
  await page.waitForTimeout(300);

  // --- every bundled workflow, through the real frontend ---
  const listed = await page.evaluate(async () => (await window.app.api.getWorkflowTemplates()));
  const ours = (listed[PACK] ?? []).slice().sort();
  const objectInfo = await page.evaluate(async () => (await fetch(window.app.api.apiURL("/object_info"))).json());
  check("template browser lists the pack's workflows", JSON.stringify(ours) === JSON.stringify(expected),
    JSON.stringify(listed));
  for (const name of expected) {
    const api = JSON.parse(readFileSync(join(apiDir, `${name}.json`), "utf8"));
    const result = await page.evaluate(async ({ pack, name }) => {
      const wf = await (await fetch(window.app.api.apiURL(`/workflow_templates/${pack}/${encodeURIComponent(name)}.json`))).json();
      await window.app.loadGraphData(wf, true, true, name);
      const prompt = await window.app.graphToPrompt();
      const node = window.app.graph.nodes.find((n) => n.type === "SageStridedNHDAttention");
      return { output: prompt.output, backend: node?.widgets.find((w) => w.name === "backend")?.value };
    }, { pack: PACK, name });
    const problems = [];
    for (const [id, spec] of Object.entries(api)) {
      const got = result.output[id];
      if (!got) { problems.push(`node ${id} missing`); continue; }
      if (got.class_type !== spec.class_type) problems.push(`node ${id}: ${got.class_type} != ${spec.class_type}`);
      for (const [k, v] of Object.entries(spec.inputs)) {
        if (JSON.stringify(got.inputs[k]) !== JSON.stringify(v)) {
          problems.push(`node ${id} ${spec.class_type}.${k}: frontend ${JSON.stringify(got.inputs[k])?.slice(0, 60)} != file ${JSON.stringify(v).slice(0, 60)}`);
        }
      }
      for (const k of Object.keys(got.inputs)) {
        if (k in spec.inputs) continue;
        // an optional input the file leaves out is fine when the frontend sends its default
        const opt = objectInfo[spec.class_type]?.input?.optional?.[k];
        if (!(opt && JSON.stringify(got.inputs[k]) === JSON.stringify(opt[1]?.default))) problems.push(`node ${id}: extra input ${k}`);
      }
    }
    for (const id of Object.keys(result.output)) if (!api[id]) problems.push(`extra node ${id}`);
    check(`${name}: frontend turns the UI workflow into its API twin`, problems.length === 0, problems.join("; "));
    check(`${name}: loaded node keeps its saved back-end`, result.backend === "auto", result.backend);
    await checkLayoutWithLongestReport(name);
  }

  // --- a small graph runs and the status line follows it ---
  await page.evaluate(async (graph) => {
    await window.app.loadApiJson(graph, "sage_nhd_small_graph");
  }, smallGraph);
  await page.evaluate(() => {
    // record every text the status line shows, in order
    const node = window.app.graph.nodes.find((n) => n.type === "SageStridedNHDAttention");
    const el = node.widgets.find((w) => w.name === "sage_nhd_status").element;
    window.__sageNhdStates = [el.textContent];
    new MutationObserver(() => window.__sageNhdStates.push(el.textContent))
      .observe(el, { childList: true, characterData: true, subtree: true });
  });
  await page.evaluate(() => window.app.queuePrompt(0, 1));
  await page.waitForFunction(() => {
    const s = window.__sageNhdStates;
    return s.length && /^ran: |no report|fallback/m.test(s[s.length - 1]);
  }, null, { timeout: 240_000 });
  const run = await page.evaluate(() => {
    const node = window.app.graph.nodes.find((n) => n.type === "SageStridedNHDAttention");
    const el = node.widgets.find((w) => w.name === "sage_nhd_status").element;
    return { states: window.__sageNhdStates, final: el.textContent, children: el.children.length,
      state: el.dataset.state, visible: el.getBoundingClientRect().height > 0 };
  });
  // close any dialog, bring the node into view at 100% and let the canvas draw before the screenshot
  await page.keyboard.press("Escape");
  await page.evaluate(() => {
    const canvas = window.app.canvas;
    const node = window.app.graph.nodes.find((n) => n.type === "SageStridedNHDAttention");
    canvas.ds.scale = 1;
    canvas.ds.offset[0] = -node.pos[0] + 420;
    canvas.ds.offset[1] = -node.pos[1] + 220;
    canvas.setDirty(true, true);
  });
  await page.waitForTimeout(800);
  await page.screenshot({ path: join(out, "after-run.png") });
  const waitingIdx = run.states.findIndex((s) => s.startsWith("waiting for this run's report"));
  const reportIdx = run.states.findIndex((s) => /^ran: /m.test(s));
  check("status is cleared when the run starts", waitingIdx >= 0, JSON.stringify(run.states));
  check("status shows the report after the run", reportIdx > waitingIdx, JSON.stringify(run.states));
  check("status names the back-end that ran", /^ran: sdpa ×\d+/m.test(run.final), run.final);
  check("status shows layout, fallbacks and copies made",
    /layout: strided_nhd/.test(run.final) && /^fallbacks: none$|^fallback from/m.test(run.final)
      && /^copies made per block: /m.test(run.final), run.final);
  check("status is plain text (no child elements)", run.children === 0, run.children);
  check("status line is visible on the page", run.visible);
  check("no console error from the pack", packProblems.length === 0, packProblems.join("\n"));
} catch (err) {
  check("browser session completed", false, err.stack ?? err);
  await page.screenshot({ path: join(out, "failure.png") }).catch(() => {});
} finally {
  // the server's user settings outlive this session: leave them as a fresh install has them
  await page.evaluate(({ ids }) => Promise.all([window.app.extensionManager.setting.set(ids[0], "auto"),
    window.app.extensionManager.setting.set(ids[1], false)]), { ids: [SETTING, VUE_NODES_SETTING] }).catch(() => {});
  writeFileSync(join(out, "results.json"), JSON.stringify({ ...results, checks, consoleErrors, packProblems, blocked }, null, 2));
  await browser.close();
}
const failed = checks.filter((c) => !c.ok).length;
console.log(`${checks.length - failed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
