// The node's help page in ComfyUI's own node docs panel, headless Chromium against a running ComfyUI with the pack.
//
//   node tests/browser/help_page.mjs --url http://127.0.0.1:PORT --out test-artifacts/browser/help --chromium PATH
//
// The frontend fetches a custom node's help from /extensions/<pack folder>/docs/<node id>/<locale>.md, then
// /extensions/<pack folder>/docs/<node id>.md, the pack folder read from the node's python_module; the server
// serves it from the pack's WEB_DIRECTORY. Checks: that URL, computed as the frontend computes it, answers with
// the page; selecting the node and clicking the selection toolbox's info button opens the panel with the page
// rendered (its headings, an input, a report line). Writes results.json and help-panel.png into --out.
import { chromium } from "playwright-core";
import { mkdirSync, writeFileSync } from "node:fs";
import { join, resolve } from "node:path";
import { CHROMIUM_ARGS, NODE_TYPE, arg } from "./cli.mjs";

const url = arg("url");
const out = resolve(arg("out", "test-artifacts/browser/help"));
mkdirSync(out, { recursive: true });

const checks = [];
function check(name, ok, detail = "") {
  checks.push({ name, ok: Boolean(ok), detail: String(detail) });
  console.log(`${ok ? "ok  " : "FAIL"} ${name}${detail && !ok ? `: ${detail}` : ""}`);
}

const browser = await chromium.launch({ executablePath: arg("chromium", "/usr/bin/chromium"), headless: true,
  args: CHROMIUM_ARGS });
const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
const origin = new URL(url).origin;
await page.route("**/*", (route) => {
  const target = route.request().url();
  const local = target.startsWith(origin) || target.startsWith("data:") || target.startsWith("blob:");
  return local ? route.continue() : route.abort();  // only the local ComfyUI is reached
});
const helpRequests = [];
page.on("response", (r) => {
  if (r.url().includes("/docs/")) helpRequests.push(`${r.status()} ${new URL(r.url()).pathname}`);
});

try {
  await page.goto(url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app?.graph && window.app?.extensionManager?.setting && window.LiteGraph,
    null, { timeout: 120_000 });
  // the URL as the frontend builds it: /extensions/<python_module's second part>/docs/<node id>.md
  const served = await page.evaluate(async (type) => {
    const info = await (await fetch(window.app.api.apiURL(`/object_info/${type}`))).json();
    const module = info[type].python_module;
    const path = `/extensions/${module.split(".")[1]}/docs/${type}.md`;
    const r = await fetch(window.app.api.fileURL(path));
    return { module, path, status: r.status, type: r.headers.get("content-type"), text: await r.text() };
  }, NODE_TYPE);
  check("the node's python_module names the pack folder", /^custom_nodes\.[^.]+$/.test(served.module), served.module);
  check(`the help page is served at ${served.path}`, served.status === 200 && !/text\/html/.test(served.type ?? "")
    && served.text.startsWith("# Sage Strided NHD Attention"),
  `${served.status} ${served.type} ${served.text.slice(0, 80)}`);

  // the first-start template browser can open late: close every dialog before touching the canvas
  await page.waitForTimeout(1500);
  for (let i = 0; i < 5 && await page.locator('[role="dialog"]').first().isVisible().catch(() => false); i++) {
    await page.keyboard.press("Escape");
    await page.waitForTimeout(300);
  }
  const at = await page.evaluate((type) => {
    const { app, LiteGraph } = window;
    app.graph.clear();
    const node = LiteGraph.createNode(type);
    node.pos = [300, 200];
    app.graph.add(node);
    app.canvas.ds.scale = 1;
    app.canvas.ds.offset[0] = 0;
    app.canvas.ds.offset[1] = 0;
    app.canvas.setDirty(true, true);
    const r = app.canvas.canvas.getBoundingClientRect();
    return [r.left + node.pos[0] + 60, r.top + node.pos[1] - LiteGraph.NODE_TITLE_HEIGHT / 2];
  }, NODE_TYPE);
  await page.waitForTimeout(500);
  await page.mouse.click(at[0], at[1]);  // select the node by its title, as a user does
  const info = page.locator('[data-testid="info-button"]').first();
  const shown = await info.waitFor({ state: "visible", timeout: 15_000 }).then(() => true, () => false);
  check("selecting the node shows the toolbox's info button", shown);
  helpRequests.length = 0;  // from here on, only what the panel fetched
  if (shown) await info.click();
  const panel = page.locator("h1, h2").filter({ hasText: "The status box" }).first();
  const rendered = await panel.waitFor({ state: "visible", timeout: 20_000 }).then(() => true, () => false);
  await page.screenshot({ path: join(out, "help-panel.png") });
  const seen = rendered ? await panel.evaluate((h) => {
    let root = h.parentElement;
    while (root && !root.querySelector("li code")) root = root.parentElement;
    return { headings: [...root.querySelectorAll("h1, h2, h3")].map((x) => x.textContent.trim()),
      cells: [...root.querySelectorAll("li code")].map((x) => x.textContent.trim()) };
  }) : { headings: [], cells: [] };
  check("the docs panel renders the help page's headings",
    ["Sage Strided NHD Attention", "Inputs", "The status box"].every((h) => seen.headings.includes(h)),
    JSON.stringify(seen.headings));
  check("the docs panel renders its lists (an input, a report line)",
    seen.cells.includes("sage2_prep") && seen.cells.includes("comfy-kitchen 0.2.40: verified for the int8 route"),
    JSON.stringify(seen.cells.slice(0, 12)));
  check("the panel fetched the page from the pack's web directory",
    helpRequests.includes(`200 ${served.path}`), JSON.stringify(helpRequests));
} catch (err) {
  check("browser session completed", false, err.stack ?? err);
  await page.screenshot({ path: join(out, "failure.png") }).catch(() => {});
} finally {
  writeFileSync(join(out, "results.json"), JSON.stringify({ checks, helpRequests }, null, 2));
  await browser.close();
}
const failed = checks.filter((c) => !c.ok).length;
console.log(`${checks.length - failed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
