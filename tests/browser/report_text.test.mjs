// Unit tests of web/report_text.js: the text the node's status line shows for a report.
// Run: node --test tests/browser/report_text.test.mjs
import { test } from "node:test";
import assert from "node:assert/strict";

import { readFileSync } from "node:fs";

import {
  STATUS_VISIBLE_LINES, sortOurTemplates, formatBackendsRan, formatCopiesAvoided, formatReport, pickNodeForReport, reportState, shortReason,
} from "../../web/report_text.js";

const LONGEST = JSON.parse(readFileSync(new URL("./fixtures/longest_report.json", import.meta.url), "utf8"));

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

test("a clean run names what ran, layout, request and the copies avoided, and fits the box", () => {
  const lines = formatReport(REPORT);
  assert.deepEqual(lines, [
    "ran: sdpa ×100, sage1 ×4",
    "layout: strided_nhd · asked: auto",
    "fallbacks: none",
    "copies avoided per block: 4 vs hnd, 2 vs stock",
    "MiniMaxH3: 50 blocks + 2 refiner",
  ]);
  assert.ok(lines.length <= STATUS_VISIBLE_LINES);
});

test("a typical sage2 run with its fast path fits the box", () => {
  const lines = formatReport({ ...REPORT, backends_ran: { sage2: 104 }, fast_path: "sage2 sm90 fused prep (exact)" });
  assert.deepEqual(lines, [
    "ran: sage2 ×104",
    "layout: strided_nhd · asked: auto",
    "fallbacks: none",
    "fast path: sage2 sm90 fused prep (exact)",
    "copies avoided per block: 4 vs hnd, 2 vs stock",
    "MiniMaxH3: 50 blocks + 2 refiner",
  ]);
  assert.ok(lines.length <= STATUS_VISIBLE_LINES);
});

test("a fallback run: short reason in the summary, the full one below, and it fits the box", () => {
  const lines = formatReport({ ...REPORT, backend_requested: "sage1", backends_ran: { sdpa: 104 },
    fallbacks: [{ backend: "sage1", reason: "no CUDA device", count: 104 }] });
  assert.deepEqual(lines, [
    "ran: sdpa ×104",
    "layout: strided_nhd · asked: sage1",
    "fallback from sage1 ×104: needs CUDA",
    "copies avoided per block: 4 vs hnd, 2 vs stock",
    "MiniMaxH3: 50 blocks + 2 refiner",
    "why sage1 fell back: no CUDA device",
  ]);
  assert.ok(lines.length <= STATUS_VISIBLE_LINES);
  assert.equal(reportState({ ...REPORT, fallbacks: [{ backend: "sage1", reason: "x" }] }), "fallback");
});

test("each fallback gets its own line with back-end, count and reason", () => {
  const lines = formatReport({
    ...REPORT,
    fallbacks: [
      { backend: "sage2", reason: "sageattention 2 is not installed", count: 104 },
      { backend: "sage1", reason: "head_dim 80 not supported", count: 3 },
    ],
  });
  assert.ok(lines.includes("fallback from sage2 ×104: not installed"), lines.join("\n"));
  assert.ok(lines.includes("why sage2 fell back: sageattention 2 is not installed"), lines.join("\n"));
  assert.ok(lines.includes("fallback from sage1 ×3: head_dim 80 unsupported"), lines.join("\n"));
  assert.ok(!lines.includes("fallbacks: none"));
});

test("back-ends auto skipped are named apart from fallbacks, with short reasons", () => {
  const lines = formatReport({ ...REPORT, skipped_unavailable: [
    { backend: "sage2", reason: "sageattention not importable (ModuleNotFoundError: No module named 'sageattention')" },
    { backend: "sage1", reason: "no CUDA device" }] });
  assert.ok(lines.includes("auto skipped: sage2 (not installed), sage1 (needs CUDA)"), lines.join("\n"));
  assert.ok(lines.includes("why sage2 was skipped: sageattention not importable (ModuleNotFoundError: No module named 'sageattention')"));
  assert.ok(lines.includes("fallbacks: none"));
  // old payloads: names only
  assert.ok(formatReport({ ...REPORT, skipped_unavailable: ["sage2"] }).includes("auto skipped: sage2"));
});

test("short forms of every reason the back-ends give", () => {
  const cases = {
    "sageattention not importable (ImportError: libcuda.so.1)": "not installed",
    "installed sageattention is 1.x (PyPI); SageAttention 2 must be built from source or a wheel": "only 1.x installed",
    "installed sageattention is 2.x (use the sage2 back-end)": "2.x installed, use sage2",
    "triton is not installed": "needs Triton",
    "no CUDA device": "needs CUDA",
    "needs a CUDA device, got cpu": "needs CUDA",
    "no SageAttention 2 kernel for compute capability 8.7": "no kernel for sm87",
    "comfy_kitchen not importable (ModuleNotFoundError: x)": "not installed",
    "this comfy_kitchen has no int8_attention": "no int8_attention",
    "comfy_kitchen reports int8_attention unavailable on this GPU/build": "unavailable on this GPU",
    "int8_attention_is_available failed (RuntimeError: boom)": "availability check failed",
    "head_dim 80 not in [64, 128]": "head_dim 80 unsupported",
    "dtype torch.float32 not in ['torch.float16']": "float32 unsupported",
    "attention masks are not supported": "no mask support",
    "last dim of q, k, v must be contiguous": "needs contiguous last dim",
  };
  for (const [reason, short] of Object.entries(cases)) assert.equal(shortReason(reason), short, reason);
  assert.ok(shortReason("x".repeat(500)).length <= 40);
  assert.equal(shortReason(undefined), "no reason given");
});

test("a very long reason is short in the summary and whole in the details", () => {
  const reason = "x".repeat(500);
  const lines = formatReport({ ...REPORT, fallbacks: [{ backend: "sage2", reason, count: 1 }] });
  const line = lines.find((l) => l.startsWith("fallback from sage2"));
  assert.ok(line.length <= 80 && line.endsWith("…"), line);
  assert.ok(lines.includes(`why sage2 fell back: ${reason}`));
});

test("interrupted and failed runs say so first", () => {
  const interrupted = formatReport({ ...REPORT, status: "interrupted" });
  assert.equal(interrupted[0], "run interrupted: counts cover the steps that ran");
  assert.equal(reportState({ ...REPORT, status: "interrupted" }), "interrupted");
  const failed = formatReport({ ...REPORT, status: "failed",
    messages: ["MiniMaxH3: ...", "the sampling run failed: RuntimeError: CUDA out of memory"] });
  assert.equal(failed[0], "run failed: counts cover the calls before the error");
  assert.ok(failed.includes("error: the sampling run failed: RuntimeError: CUDA out of memory"), failed.join("\n"));
  assert.equal(reportState({ ...REPORT, status: "failed" }), "failed");
});

test("notes, fast path, fast-path skips and compile events are shown", () => {
  const lines = formatReport({ ...REPORT, notes: ["composed with another pack's patch", ""],
    fast_path: "sage2 prepared operands (exact) x100",
    fast_path_skipped: [{ reason: "head_dim 80 not in [128]", count: 4 }],
    compile_events: [{ backend: "fa4", key: "sm90 bf16 d128", seconds: 1.83 }, { backend: "sage2" }] });
  assert.ok(lines.includes("note: composed with another pack's patch"));
  assert.ok(!lines.includes("note: "));
  assert.ok(lines.includes("fast path: sage2 prepared operands (exact) x100"));
  assert.ok(lines.includes("no fast path ×4: head_dim 80 unsupported"));
  assert.ok(lines.includes("why no fast path: head_dim 80 not in [128]"));
  assert.ok(lines.includes("fa4 compiled in 1.8 s"));
  assert.ok(lines.includes("fa4 compiled for sm90 bf16 d128"));
  assert.ok(lines.includes("sage2 compiled"));
});

test("copies avoided: an unknown side is left out; without the field the copies made are shown", () => {
  assert.equal(formatCopiesAvoided({ vs_stock: null, vs_hnd: 4 }), "4 vs hnd");
  assert.equal(formatCopiesAvoided({ vs_stock: null, vs_hnd: null }), "");
  assert.equal(formatCopiesAvoided(undefined), "");
  const lines = formatReport({ ...REPORT, copies_avoided_per_call: { vs_stock: null, vs_hnd: 4 } });
  assert.ok(lines.includes("copies avoided per block: 4 vs hnd"), lines.join("\n"));
  const { copies_avoided_per_call, ...withoutAvoided } = REPORT;
  const made = formatReport(withoutAvoided);
  assert.ok(made.includes("copies made per block: 0"), made.join("\n"));
  assert.ok(!made.some((l) => l.startsWith("copies avoided")));
});

test("the longest report keeps every piece of information", () => {
  const lines = formatReport(LONGEST);
  const all = lines.join("\n");
  assert.equal(lines[0], "run interrupted: counts cover the steps that ran");
  for (const f of LONGEST.fallbacks) assert.ok(all.includes(f.reason), f.reason);
  for (const s of LONGEST.skipped_unavailable) assert.ok(all.includes(s.reason), s.reason);
  for (const n of LONGEST.notes) assert.ok(lines.includes(`note: ${n}`), n);
  for (const e of LONGEST.compile_events) assert.ok(all.includes(e.key), e.key);
  assert.ok(lines.includes("split over heads: up to 3 chunks (int32 offsets)"));
  assert.ok(lines.includes("to ComfyUI attention ×7: no mask support"));
  assert.ok(lines.length > STATUS_VISIBLE_LINES, "the fixture must need the box to scroll");
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
  assert.ok(lines.includes("SDXL: attention override"), lines.join("\n"));
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

test("the pack's templates are listed in natural order; other packs' lists are left alone", () => {
  const served = { "comfyui-sage-strided-nhd": ["MiniMax H3 - 12 steps - HND", "MiniMax H3 - 2 steps - strided NHD",
    "MiniMax H3 - 12 steps - strided NHD", "MiniMax H3 - 2 steps - HND"], other: ["b", "a"] };
  assert.deepEqual(sortOurTemplates(served), {
    "comfyui-sage-strided-nhd": ["MiniMax H3 - 2 steps - HND", "MiniMax H3 - 2 steps - strided NHD",
      "MiniMax H3 - 12 steps - HND", "MiniMax H3 - 12 steps - strided NHD"],
    other: ["b", "a"],
  });
  assert.equal(sortOurTemplates(undefined), undefined);
});
