// Unit tests of web/report_text.js: the text the node's status line shows for a report.
// Run: node --test tests/browser/report_text.test.mjs
import { test } from "node:test";
import assert from "node:assert/strict";

import { formatBackendsRan, formatReport, pickNodeForReport } from "../../web/report_text.js";

const REPORT = {
  schema: 1,
  node_id: "2",
  prompt_id: "p1",
  model_family: "MiniMaxH3",
  path: "h3_forward_patch",
  layout: "strided_nhd",
  backend_requested: "auto",
  blocks_patched: 50,
  refiner_blocks_patched: 2,
  attention_calls: 104,
  backends_ran: { sage1: 4, sdpa: 100 },
  stock_calls: 0,
  fallbacks: [],
  head_chunks_max: 1,
  copies_per_call: 0,
  copies_avoided_per_call: { vs_stock: 2, vs_hnd: 4 },
  remaining_copies: [],
  replaced_own_patch: false,
  status: "ok",
  messages: [],
};

test("a clean run names layout, request, the back-ends that ran and the copies avoided", () => {
  const lines = formatReport(REPORT);
  assert.deepEqual(lines, [
    "MiniMaxH3: 50 blocks + 2 refiner",
    "layout: strided_nhd · asked: auto",
    "ran: sdpa ×100, sage1 ×4",
    "fallbacks: none",
    "copies avoided per block: 4 vs hnd, 2 vs stock",
  ]);
});

test("each fallback gets its own line with back-end, count and reason", () => {
  const lines = formatReport({
    ...REPORT,
    fallbacks: [
      { backend: "sage2", reason: "sageattention 2 is not installed", count: 104 },
      { backend: "sage1", reason: "head_dim 80 not supported", count: 3 },
    ],
  });
  assert.ok(lines.includes("fallback from sage2 ×104: sageattention 2 is not installed"), lines.join("\n"));
  assert.ok(lines.includes("fallback from sage1 ×3: head_dim 80 not supported"), lines.join("\n"));
  assert.ok(!lines.includes("fallbacks: none"));
});

test("back-ends auto skipped as unavailable are named apart from fallbacks", () => {
  const lines = formatReport({ ...REPORT, skipped_unavailable: [
    { backend: "sage2", reason: "no CUDA device" }, { backend: "comfy_kitchen_int8", reason: "no CUDA device" }] });
  assert.ok(lines.includes("auto skipped (unavailable): sage2, comfy_kitchen_int8"), lines.join("\n"));
  assert.ok(lines.includes("fallbacks: none"));
});

test("a very long reason is shortened, not dropped", () => {
  const lines = formatReport({ ...REPORT, fallbacks: [{ backend: "sage2", reason: "x".repeat(500), count: 1 }] });
  const line = lines.find((l) => l.startsWith("fallback from sage2"));
  assert.ok(line.length <= 140 && line.endsWith("…"), line);
});

test("markup from the server stays literal text", () => {
  const lines = formatReport({ ...REPORT, layout: "<img src=x onerror=alert(1)>" });
  assert.ok(lines.includes("layout: <img src=x onerror=alert(1)> · asked: auto"));
});

test("no attention calls is said plainly", () => {
  const lines = formatReport({ ...REPORT, status: "no_attention_calls", backends_ran: {}, attention_calls: 0 });
  assert.ok(lines.some((l) => l.startsWith("ran: nothing")), lines.join("\n"));
});

test("override path, stock hand-backs, head chunks and a replaced patch are all shown", () => {
  const lines = formatReport({
    ...REPORT,
    path: "attention_override",
    model_family: "SDXL",
    stock_calls: 7,
    head_chunks_max: 3,
    replaced_own_patch: true,
  });
  assert.equal(lines[0], "SDXL: attention override");
  assert.ok(lines.includes("handed back to ComfyUI attention: ×7"));
  assert.ok(lines.includes("split over heads: up to 3 chunks (int32 offsets)"));
  assert.ok(lines.some((l) => l.startsWith("copies avoided per call:")));
  assert.ok(lines.includes("replaced an earlier patch of this node on the same model"));
});

test("missing fields give question marks instead of throwing", () => {
  const lines = formatReport({});
  assert.ok(lines.length >= 4);
  assert.ok(lines.every((l) => typeof l === "string"));
  assert.deepEqual(formatReport(null), formatReport({}));
});

test("back-ends with zero calls are left out", () => {
  assert.equal(formatBackendsRan({ sage2: 0, sdpa: 2 }), "sdpa ×2");
  assert.equal(formatBackendsRan(undefined), "");
});

test("reports find their node by id, subgraph id, or the only node there is", () => {
  const a = { id: 2 }, b = { id: 7 };
  const byId = new Map([["2", a], ["7", b]]);
  assert.equal(pickNodeForReport("7", byId, [a, b]), b);
  assert.equal(pickNodeForReport("5:2", byId, [a, b]), a);
  assert.equal(pickNodeForReport("99", byId, [a, b]), null);
  assert.equal(pickNodeForReport(null, new Map([["2", a]]), [a]), a);
});
