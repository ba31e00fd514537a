// Headless Chromium against a running ComfyUI with this pack installed.
//
//   node tests/browser/ui_test.mjs --url http://127.0.0.1:PORT --graph small_graph.json --out test-artifacts
//
// Checks: the UI loads with no console error from the pack; the extension and its setting are
// registered; a new node takes the default back-end from the setting, a loaded workflow keeps its
// saved one; each bundled UI workflow turns into exactly its API twin in the real frontend; a small
// graph runs and the node's status line is cleared before the run and then shows the back-end that
// ran. Writes results.json and screenshots into --out. Exit code 0 only when every check passed.
import { chromium } from "playwright-core";
import { mkdirSync, readFileSync, writeFileSync, readdirSync } from "node:fs";
import { join, resolve } from "node:path";

const PACK = "comfyui-sage-strided-nhd";
const NODE_TYPE = "SageStridedNHDAttention";
const SETTING = "SageStridedNHD.DefaultBackend";
const CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
  "--disable-component-update", "--disable-sync", "--no-first-run"];

function arg(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? process.argv[i + 1] : fallback;
}

const url = arg("url");
const out = resolve(arg("out", "test-artifacts"));
const smallGraph = JSON.parse(readFileSync(arg("graph"), "utf8"));
const apiDir = resolve(arg("workflows", "workflows"), "api");
const browserPath = arg("chromium", "/usr/bin/chromium");
mkdirSync(out, { recursive: true });

const checks = [];
function check(name, ok, detail = "") {
  checks.push({ name, ok: Boolean(ok), detail: String(detail) });
  console.log(`${ok ? "ok  " : "FAIL"} ${name}${detail && !ok ? `: ${detail}` : ""}`);
}

const fromPack = (s) => /sage[-_ ]?strided[-_ ]?nhd|SageStridedNHD|sage_nhd/i.test(s ?? "");
const consoleErrors = [];
const packProblems = [];

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

try {
  await page.goto(url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(
    () => window.app?.graph && window.app?.extensionManager?.setting && window.LiteGraph,
    null, { timeout: 120_000 });
  await page.waitForFunction(
    () => window.app.extensions?.some((e) => e.name === "SageStridedNHD.Status"), null, { timeout: 30_000 });
  check("extension registered once", await page.evaluate(
    () => window.app.extensions.filter((e) => e.name === "SageStridedNHD.Status").length === 1));

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
    return { id: node.id, backend, layout, status: status?.element?.textContent ?? null,
      saved: node.serialize().widgets_values };
  }, NODE_TYPE);
  check("node can be added", added.id !== undefined && added.layout === "strided_nhd", JSON.stringify(added));
  check("new node takes the default back-end from the setting", added.backend === "sdpa", added.backend);
  check("new node shows an idle status", (added.status ?? "").startsWith("not run yet"), added.status);
  check("status line is not saved with the workflow",
    JSON.stringify(added.saved) === JSON.stringify(["strided_nhd", "sdpa", true]), JSON.stringify(added.saved));
  await page.screenshot({ path: join(out, "node-added.png") });

  // --- the template browser shows the pack's workflows ---
  await page.evaluate(() => window.app.extensionManager.command.execute("Comfy.BrowseTemplates"));
  const category = page.getByText(PACK.slice(0, 18), { exact: false }).first();
  await category.waitFor({ timeout: 30_000 });
  await category.click();
  const cardTitles = [];
  for (const name of readdirSync(apiDir).filter((f) => f.endsWith(".json")).map((f) => f.slice(0, -5))) {
    const card = page.getByText(name, { exact: true }).first();
    const seen = await card.waitFor({ timeout: 15_000 }).then(() => true, () => false);
    if (seen) cardTitles.push(name);
  }
  await page.waitForTimeout(500);
  await page.screenshot({ path: join(out, "template-browser.png") });
  check("template browser shows the four workflows under the pack", cardTitles.length === 4, cardTitles.join(", "));
  await page.keyboard.press("Escape");
  await page.waitForTimeout(300);

  // --- every bundled workflow, through the real frontend ---
  const listed = await page.evaluate(async () => (await window.app.api.getWorkflowTemplates()));
  const ours = (listed[PACK] ?? []).slice().sort();
  const expected = readdirSync(apiDir).filter((f) => f.endsWith(".json")).map((f) => f.slice(0, -5)).sort();
  check("template browser lists the pack's workflows", JSON.stringify(ours) === JSON.stringify(expected),
    JSON.stringify(listed));
  for (const name of expected) {
    const api = JSON.parse(readFileSync(join(apiDir, `${name}.json`), "utf8"));
    const result = await page.evaluate(async ({ pack, name }) => {
      const wf = await (await fetch(window.app.api.apiURL(`/workflow_templates/${pack}/${name}.json`))).json();
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
      for (const k of Object.keys(got.inputs)) if (!(k in spec.inputs)) problems.push(`node ${id}: extra input ${k}`);
    }
    for (const id of Object.keys(result.output)) if (!api[id]) problems.push(`extra node ${id}`);
    check(`${name}: frontend turns the UI workflow into its API twin`, problems.length === 0, problems.join("; "));
    check(`${name}: loaded node keeps its saved back-end`, result.backend === "auto", result.backend);
  }
  await page.screenshot({ path: join(out, "workflow-loaded.png") });

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
  check("status shows layout, fallbacks and copies avoided",
    /layout: strided_nhd/.test(run.final) && /^fallbacks: none$|^fallback from/m.test(run.final)
      && /copies avoided per block: /.test(run.final), run.final);
  check("status is plain text (no child elements)", run.children === 0, run.children);
  check("status line is visible on the page", run.visible);
  check("no console error from the pack", packProblems.length === 0, packProblems.join("\n"));
} catch (err) {
  check("browser session completed", false, err.stack ?? err);
  await page.screenshot({ path: join(out, "failure.png") }).catch(() => {});
} finally {
  writeFileSync(join(out, "results.json"), JSON.stringify({ checks, consoleErrors, packProblems, blocked }, null, 2));
  await browser.close();
}
const failed = checks.filter((c) => !c.ok).length;
console.log(`${checks.length - failed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
