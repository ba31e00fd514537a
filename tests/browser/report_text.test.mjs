// Unit tests of web/report_text.js: the text the node's status box shows for a report (schema 5,
// docs/ARCHITECTURE.md: "The run report"). Run: node --test tests/browser/report_text.test.mjs
import { test } from "node:test";
import assert from "node:assert/strict";

import { readFileSync } from "node:fs";

import {
  GEMM_KERNEL_LABELS, INT8_LAYOUT_LABELS, KEYS_NOT_SHOWN, KITCHEN_ROUTE_LABELS, KITCHEN_UNRUN_LABELS, NO_CALLS_CAUSE, NO_MODEL_CALLS, REASON_LABELS,
  STATUS_VISIBLE_LINES,
  formatBackendsRan,
  formatBytes, formatError, formatKitchen, formatMemory, formatPrepared, formatReport,
  pickNodeForReport, reportState, shortReason, sortOurTemplates,
} from "../../web/report_text.js";

const LONGEST = JSON.parse(readFileSync(new URL("./fixtures/longest_report.json", import.meta.url), "utf8"));

// A clean auto run on an H200 with SageAttention 2 installed: every key present, as the node sends it.
const REPORT = {
  schema: 5,
  node_id: "2",
  prompt_id: "p1",
  model_family: "MiniMaxH3",
  path: "h3_forward_patch",
  layout: "strided_nhd",
  backend_requested: "auto",
  prep_mode: "exact",
  blocks_patched: 50,
  refiner_blocks_patched: 2,
  replaced_own_patch: false,
  status: "ok",
  error: null,
  attention_calls: 104,
  backends_ran: { sage2: 104 },
  stock_calls: 0,
  fallbacks: [],
  skipped: [],
  prepared: [{ backend: "sage2", mode: "exact", calls: 104 }],
  prepared_skipped: [],
  head_chunks_max: 1,
  copies_per_call: 0.0,
  compile_events: [],
  int8_own_quantizer_calls: 0,
  int8_own_layouts: [],
  int8_stock_quantizer: [],
  comfy_kitchen: null,
  int8_gemm: null,
  memory: null,
  notes: [],
  messages: ["MiniMaxH3: 50 H3 blocks + 2 refiner blocks, layout strided_nhd, back-end requested auto"],
};

const show = (lines) => lines.join("\n");

test("a typical sage2 run: what ran, layout, the prepared path, and it fits the box", () => {
  const lines = formatReport(REPORT);
  assert.deepEqual(lines, [
    "ran: sage2 ×104",
    "layout: strided_nhd · asked: auto",
    "fallbacks: none",
    "prepared: sage2 exact ×104",
    "copies made per block: 0",
    "MiniMaxH3: 50 blocks + 2 refiner",
  ]);
  assert.ok(lines.length <= STATUS_VISIBLE_LINES);
  assert.equal(reportState(REPORT), "report");
});

test("a fallback run: the code's label in the summary, the full reason below, and it fits the box", () => {
  const lines = formatReport({ ...REPORT, backend_requested: "sage1", backends_ran: { sdpa: 104 }, prepared: [],
    fallbacks: [{ backend: "sage1", code: "no_cuda", reason: "no CUDA device", count: 104 }] });
  assert.deepEqual(lines, [
    "ran: sdpa ×104",
    "layout: strided_nhd · asked: sage1",
    "fallback from sage1 ×104: needs CUDA",
    "copies made per block: 0",
    "MiniMaxH3: 50 blocks + 2 refiner",
    "why sage1 fell back: no CUDA device",
  ]);
  assert.ok(lines.length <= STATUS_VISIBLE_LINES);
  assert.equal(reportState({ ...REPORT, fallbacks: [{ backend: "sage1", code: "no_cuda", reason: "x", count: 1 }] }), "fallback");
});

test("every reason code renders its own label, in fallbacks, skips and prepared skips", () => {
  assert.ok(Object.keys(REASON_LABELS).length >= 16);
  for (const [code, label] of Object.entries(REASON_LABELS)) {
    const reason = `a full sentence for ${code} (details: 1.2; x)`;
    assert.equal(shortReason(code, reason), label, code);
    const lines = formatReport({
      ...REPORT,
      fallbacks: [{ backend: "fa4", code, reason, count: 5 }],
      skipped: [{ backend: "sage1", code, reason, count: 7 }],
      prepared_skipped: [{ backend: "sage2", code, reason, count: 6 }],
    });
    assert.ok(lines.includes(`fallback from fa4 ×5: ${label}`), `${code}\n${show(lines)}`);
    assert.ok(lines.includes(`skipped: sage1 (${label})`), `${code}\n${show(lines)}`);
    assert.ok(lines.includes(`no prepared path ×6: ${label}`), `${code}\n${show(lines)}`);
    // the sentence is never parsed, only shown whole in the details
    assert.ok(lines.includes(`why fa4 fell back: ${reason}`), code);
    assert.ok(lines.includes(`why sage1 was skipped: ${reason}`), code);
    assert.ok(lines.includes(`why no sage2 prepared path: ${reason}`), code);
  }
});

test("the label comes from the code, not from the words of the reason", () => {
  // a reason that reads like another code's still gets its own code's label
  assert.equal(shortReason("dtype", "sageattention not importable (ModuleNotFoundError)"), "dtype unsupported");
  assert.equal(shortReason("no_cuda", ""), "needs CUDA");
});

test("an unknown or missing code falls back to the start of the reason", () => {
  const reason = "a newer pack's reason that this extension has no label for, and a long one at that";
  assert.equal(shortReason("from_the_future", reason), "a newer pack's reason that this extensi…");
  assert.equal(shortReason(undefined, reason).length, 40);
  assert.equal(shortReason(null, "short reason"), "short reason");
  assert.equal(shortReason(undefined, undefined), "no reason given");
  // names on Object.prototype are not codes
  assert.equal(shortReason("constructor", "built in"), "built in");
  assert.equal(shortReason("toString", "built in"), "built in");

  const lines = formatReport({ ...REPORT, fallbacks: [{ backend: "sage2", code: "from_the_future", reason, count: 1 }] });
  const line = lines.find((l) => l.startsWith("fallback from sage2"));
  assert.equal(line, "fallback from sage2 ×1: a newer pack's reason that this extensi…");
  assert.ok(lines.includes(`why sage2 fell back: ${reason}`), show(lines));
});

test("a very long reason without a known code is short in the summary and whole in the details", () => {
  const reason = "x".repeat(500);
  const lines = formatReport({ ...REPORT, fallbacks: [{ backend: "sage2", reason, count: 1 }] });
  const line = lines.find((l) => l.startsWith("fallback from sage2"));
  assert.ok(line.length <= 80 && line.endsWith("…"), line);
  assert.ok(lines.includes(`why sage2 fell back: ${reason}`));
});

test("each fallback gets its own line; calls handed to ComfyUI's attention are named so", () => {
  const lines = formatReport({
    ...REPORT,
    fallbacks: [
      { backend: "sage2", code: "not_installed", reason: "sageattention not importable (ImportError: x)", count: 104 },
      { backend: "sage1", code: "head_dim", reason: "head_dim 80 not in [64, 96, 128]", count: 3 },
      { backend: "stock", code: "model_request", reason: "the model turned off low-precision attention for this call", count: 2 },
    ],
  });
  assert.ok(lines.includes("fallback from sage2 ×104: not installed"), show(lines));
  assert.ok(lines.includes("fallback from sage1 ×3: head_dim unsupported"), show(lines));
  assert.ok(lines.includes("to ComfyUI attention ×2: model asked for stock attention"), show(lines));
  assert.ok(lines.includes("why calls went to ComfyUI attention: the model turned off low-precision attention for this call"));
  assert.ok(!lines.includes("fallbacks: none"));
});

test("back-ends passed over without being asked for are skipped, apart from fallbacks, with their labels", () => {
  // sage1 asked for on a machine without it: sage1 fell back; sage2 and fa4 were never asked for
  const lines = formatReport({ ...REPORT, backend_requested: "sage1", backends_ran: { sdpa: 104 },
    fallbacks: [{ backend: "sage1", code: "not_installed", reason: "sageattention not importable", count: 104 }],
    skipped: [
      { backend: "sage2", code: "wrong_version", reason: "installed sageattention is 1.x (PyPI)", count: 104 },
      { backend: "fa4", code: "not_installed", reason: "flash-attn-4 not installed (pip install flash-attn-4)", count: 104 }] });
  assert.ok(lines.includes("fallback from sage1 ×104: not installed"), show(lines));
  assert.ok(lines.includes("skipped: sage2 (other version installed), fa4 (not installed)"), show(lines));
  assert.ok(!lines.some((l) => /fallback from (sage2|fa4)/.test(l)), show(lines));
  assert.ok(lines.includes("why fa4 was skipped: flash-attn-4 not installed (pip install flash-attn-4)"));
  assert.ok(lines.includes("why sage1 fell back: sageattention not importable"));
  const clean = formatReport({ ...REPORT, skipped: [{ backend: "fa4", code: "not_installed", reason: "x", count: 1 }] });
  assert.ok(clean.includes("fallbacks: none") && clean.includes("skipped: fa4 (not installed)"), show(clean));
});

test("int8 reasons are whole in the details, and comfy-kitchen's release says what it means for the route", () => {
  const reason = "comfy-kitchen 0.2.40 is not a release this route was written for (0.2.31)";
  for (const [route, label] of Object.entries(KITCHEN_ROUTE_LABELS)) {
    const lines = formatReport({ ...REPORT, int8_own_quantizer_calls: route === "stock" ? 0 : 800,
      int8_stock_quantizer: route === "stock" ? [{ reason, count: 800 }] : [],
      comfy_kitchen: { release: "0.2.40", route, reason: route === "stock" ? reason : null } });
    assert.ok(lines.includes(`comfy-kitchen 0.2.40: ${label}`), `${route}\n${show(lines)}`);
    assert.equal(formatKitchen({ release: "0.2.40", route, reason: null }), `comfy-kitchen 0.2.40: ${label}`);
    if (route === "stock") {
      assert.ok(lines.includes(`why int8 linears kept stock's quantiser: ${reason}`), show(lines));
      assert.ok(lines.includes(`why the int8 route is off: ${reason}`), show(lines));
    }
  }
  assert.equal(formatKitchen({ release: "0.2.40", route: "verified", reason: null }), "comfy-kitchen 0.2.40: verified for the int8 route");
  assert.equal(formatKitchen({ release: null, route: "a_new_route" }), "comfy-kitchen (release unknown): int8 route a_new_route");
  // no int8 linears ran: no comfy-kitchen line
  assert.equal(formatKitchen(null), "");
  assert.ok(!formatReport(REPORT).some((l) => l.startsWith("comfy-kitchen")));
});

test("on a CPU no int8 linear takes the route: the release line says the route did not run", () => {
  const reason = "not on a CUDA device";
  const cpu = { ...REPORT, int8_own_quantizer_calls: 0, int8_stock_quantizer: [{ reason, count: 8 },
    { layout: "TensorWiseINT8Layout", reason, count: 6 }, { layout: "AsymW4A8Int8Layout", reason, count: 4 }] };
  for (const [route, label] of Object.entries(KITCHEN_UNRUN_LABELS)) {
    const lines = formatReport({ ...cpu, comfy_kitchen: { release: "0.2.40", route, reason: null } });
    assert.ok(lines.includes(`comfy-kitchen 0.2.40: ${label}`), `${route}\n${show(lines)}`);
    assert.ok(!lines.some((l) => l.includes(KITCHEN_ROUTE_LABELS[route])), show(lines));
    // by layout: a report without one names them "int8"
    for (const [label, n] of [["int8", 8], ["int8 ConvRot", 6], ["W4A8", 4]]) {
      assert.ok(lines.includes(`${label} linears on stock's quantiser ×${n}`), show(lines));
      assert.ok(lines.includes(`why ${label} linears kept stock's quantiser: ${reason}`), show(lines));
    }
  }
  assert.equal(formatKitchen({ release: "0.2.40", route: "verified" }, false),
    "comfy-kitchen 0.2.40: int8 route not run (a release verified for it)");
  // a release that keeps the route off says so whether or not a call could have taken it
  assert.equal(formatKitchen({ release: "0.2.41", route: "stock" }, false), `comfy-kitchen 0.2.41: ${KITCHEN_ROUTE_LABELS.stock}`);
});

test("the int8 route's calls on the pack's quantiser are named by layout: int8 ConvRot and W4A8", () => {
  const lines = formatReport({ ...REPORT, int8_own_quantizer_calls: 900, int8_own_layouts: [
    { layout: "TensorWiseINT8Layout", count: 800 }, { layout: "AsymW4A8Int8Layout", count: 100 }] });
  assert.ok(lines.includes("int8 ConvRot linears on the pack's quantiser: 800 calls"), show(lines));
  assert.ok(lines.includes("W4A8 linears on the pack's quantiser: 100 calls"), show(lines));
  assert.deepEqual(INT8_LAYOUT_LABELS, { TensorWiseINT8Layout: "int8 ConvRot", AsymW4A8Int8Layout: "W4A8" });
  // a report without the layouts (an older pack): the total, as int8 linears
  const older = formatReport({ ...REPORT, int8_own_quantizer_calls: 800, int8_own_layouts: undefined });
  assert.ok(older.includes("int8 linears on the pack's quantiser: 800 calls"), show(older));
  assert.ok(!formatReport(REPORT).some((l) => l.includes("on the pack's quantiser")), show(formatReport(REPORT)));
});

test("the int8 route's GEMM: which kernel ran, and why comfy-kitchen's where it did", () => {
  const why = "measured faster than comfy-kitchen's GEMM only on sm90, not on this sm89 GPU";
  const pack = formatReport({ ...REPORT, int8_own_quantizer_calls: 800, int8_gemm: { kernel: "pack", reason: null } });
  assert.ok(pack.includes(`int8 GEMM: ${GEMM_KERNEL_LABELS.pack}`), show(pack));
  const kitchen = formatReport({ ...REPORT, int8_own_quantizer_calls: 800, int8_gemm: { kernel: "comfy_kitchen", reason: why } });
  assert.ok(kitchen.includes(`int8 GEMM: ${GEMM_KERNEL_LABELS.comfy_kitchen}`), show(kitchen));
  assert.ok(kitchen.includes(`why comfy-kitchen's int8 GEMM runs: ${why}`), show(kitchen));
  assert.ok(!formatReport(REPORT).some((l) => l.startsWith("int8 GEMM")));
  const sm90 = formatReport({ ...REPORT, int8_own_quantizer_calls: 800, int8_gemm: { kernel: "pack_sm90", reason: null } });
  assert.ok(sm90.includes(`int8 GEMM: ${GEMM_KERNEL_LABELS.pack_sm90}`), show(sm90));
  const gluon = "its Gluon kernel was measured with Triton 3.6, not 3.8.0";
  const portable = formatReport({ ...REPORT, int8_own_quantizer_calls: 800, int8_gemm: { kernel: "pack", reason: gluon } });
  assert.ok(portable.includes(`why not the warp-specialised int8 GEMM: ${gluon}`), show(portable));
  assert.ok(!portable.some((l) => l.startsWith("why comfy-kitchen")), show(portable));
});

test("memory: the largest model call's peak and stock's video embedding handed back", () => {
  const peak = { peak_bytes: 2.2 * 2 ** 30, released_bytes: null };
  const lines = formatReport({ ...REPORT, block_path: "exact", block_path_blocks: 50, memory: peak });
  assert.equal(lines.at(-1), "model call needed: 2.2 GiB", show(lines));
  assert.equal(lines.at(-2), "block fast path: 50 of 50 blocks", show(lines));
  assert.equal(formatMemory({ peak_bytes: null, released_bytes: null }), "");
  assert.equal(formatMemory({ ...peak, released_bytes: 1.5 * 2 ** 30 }),
    "model call needed: 2.2 GiB; 1.5 GiB of stock's video embedding handed back");
  assert.equal(formatMemory({ peak_bytes: null, released_bytes: 385 * 2 ** 20 }),
    "385 MiB of stock's video embedding handed back");
  assert.equal(formatMemory({ ...peak, released_bytes: 0 }), "model call needed: 2.2 GiB");
  for (const none of [null, undefined, [], "2 GiB"]) assert.equal(formatMemory(none), "");
  assert.ok(!formatReport(REPORT).some((l) => l.includes("model call")));
  assert.deepEqual([840 * 2 ** 20, 3.5 * 2 ** 20, 2 ** 30, 1944 * 2 ** 20].map(formatBytes),
    ["840 MiB", "3.5 MiB", "1.0 GiB", "1.9 GiB"]);
  // below a MiB in KiB, never "0.0 MiB"
  assert.deepEqual([96 * 2 ** 10, 2.5 * 2 ** 10, 1023 * 2 ** 10, 2 ** 20].map(formatBytes),
    ["96 KiB", "2.5 KiB", "1023 KiB", "1.0 MiB"]);
  assert.equal(formatMemory({ peak_bytes: null, released_bytes: 40 * 2 ** 10 }),
    "40 KiB of stock's video embedding handed back");
});

test("prepared and prepared_skipped lines", () => {
  assert.equal(formatPrepared([{ backend: "sage2", mode: "exact", calls: 100 }]), "sage2 exact ×100");
  assert.equal(formatPrepared([{ backend: "sage2", mode: "fused", calls: 90 }, { backend: "sage2", mode: "rotated", calls: 0 },
    { backend: "sage2", calls: 3 }]), "sage2 fused ×90, sage2 ×3");
  assert.equal(formatPrepared([]), "");
  assert.equal(formatPrepared(undefined), "");

  const lines = formatReport({ ...REPORT, prep_mode: "fused_rotated",
    prepared: [{ backend: "sage2", mode: "fused_rotated", calls: 96 }],
    prepared_skipped: [{ backend: "sage2", code: "gpu_arch", reason: "prepared path needs sm90 (H100/H200), got 8.9", count: 8 }] });
  assert.ok(lines.includes("layout: strided_nhd · asked: auto · prep: fused_rotated"), show(lines));
  assert.ok(lines.includes("prepared: sage2 fused_rotated ×96"), show(lines));
  assert.ok(lines.includes("no prepared path ×8: no kernel for this GPU"), show(lines));
  assert.ok(lines.includes("why no sage2 prepared path: prepared path needs sm90 (H100/H200), got 8.9"), show(lines));
  // summary before details
  assert.ok(lines.indexOf("no prepared path ×8: no kernel for this GPU") < lines.indexOf("MiniMaxH3: 50 blocks + 2 refiner"));
  assert.ok(lines.indexOf("why no sage2 prepared path: prepared path needs sm90 (H100/H200), got 8.9") > lines.indexOf("MiniMaxH3: 50 blocks + 2 refiner"));

  const none = formatReport({ ...REPORT, prepared: [], prepared_skipped: [] });
  assert.ok(!none.some((l) => l.startsWith("prepared") || l.startsWith("no prepared")), show(none));
});

test("interrupted and failed runs say so first; a failed run shows its error", () => {
  const interrupted = formatReport({ ...REPORT, status: "interrupted" });
  assert.equal(interrupted[0], "run interrupted: counts cover the steps that ran");
  assert.ok(!interrupted.some((l) => l.startsWith("error:")), show(interrupted));
  assert.equal(reportState({ ...REPORT, status: "interrupted" }), "interrupted");

  const failed = formatReport({ ...REPORT, status: "failed",
    error: { type: "RuntimeError", message: "CUDA error: an illegal memory access was encountered" } });
  assert.equal(failed[0], "run failed: counts cover the calls before the error");
  assert.ok(failed.includes("error: RuntimeError: CUDA error: an illegal memory access was encountered"), show(failed));
  assert.equal(reportState({ ...REPORT, status: "failed" }), "failed");
});

test("the error comes from the error field, never from the log messages", () => {
  const lines = formatReport({ ...REPORT, status: "failed", error: null,
    messages: ["the sampling run failed: RuntimeError: from the messages"] });
  assert.equal(lines[0], "run failed: counts cover the calls before the error");
  assert.ok(!show(lines).includes("from the messages"), show(lines));
  assert.equal(formatError({ type: "KeyError", message: "'x'" }), "KeyError: 'x'");
  assert.equal(formatError({ type: "RuntimeError", message: "" }), "RuntimeError");
  assert.equal(formatError({ message: "just a message" }), "just a message");
  assert.equal(formatError(null), "");
  assert.equal(formatError("RuntimeError: a string"), "");
});

test("notes are objects: their text is shown in the details, whatever the code", () => {
  const notes = [
    { code: "sparse_composed", text: "composed with Model Sparse Attention: its override runs first and hands this node the calls it keeps dense" },
    { code: "override_composed", text: "composed with another node's attention override (x.y): it runs first and hands this node the calls it declines" },
    { code: "override_missing", text: "this node's attention override is not on the model being sampled: nothing ran through it" },
    { code: "preference_honoured", text: "checkpoint attention preference (comfy_attention.config 'sage') on blocks 0-49: honoured: sage2 runs first (backend auto)" },
    { code: "preference_overridden", text: "checkpoint attention preference (comfy_attention.config 'sage') on blocks 0-49: overridden by the node's back-end sdpa" },
    { code: "preference_ignored", text: "checkpoint attention preference (comfy_attention.config 'flex') on blocks 0-49: ignored: the pack has no back-end for it" },
    { code: "block_replaces", text: "another node replaces 2 DiT block(s) (patches_replace 'dit'): calls they route to the block's attention run this node's forward and are counted; others are theirs" },
    { code: "a_new_note", text: "a note this extension has no code for" },
  ];
  const lines = formatReport({ ...REPORT, notes: [...notes, { code: "empty", text: "" }, "a bare string", null] });
  const model = lines.indexOf("MiniMaxH3: 50 blocks + 2 refiner");
  for (const n of notes) {
    const at = lines.indexOf(`note: ${n.text}`);
    assert.ok(at > model, `${n.code}\n${show(lines)}`);
  }
  assert.equal(lines.filter((l) => l.startsWith("note:")).length, notes.length, show(lines));
  assert.ok(!show(lines).includes("[object Object]"));
});

test("compile events are shown, with their keys in the details", () => {
  const lines = formatReport({ ...REPORT,
    compile_events: [{ backend: "fa4", key: "sm90 bf16 d128", seconds: 1.83 }, { backend: "sage2" }] });
  assert.ok(lines.includes("fa4 compiled in 1.8 s"), show(lines));
  assert.ok(lines.includes("fa4 compiled for sm90 bf16 d128"));
  assert.ok(lines.includes("sage2 compiled"));
});

test("no schema-1 or schema-2 leftovers are rendered", () => {
  const lines = formatReport({ ...REPORT, copies_avoided_per_call: { vs_stock: 2, vs_hnd: 4 },
    remaining_copies: ["x"], fast_path: "sage2 x104", fast_path_skipped: [{ reason: "r", count: 1 }] });
  assert.deepEqual(lines, formatReport(REPORT));
  assert.ok(!("remaining_copies" in KEYS_NOT_SHOWN));
});

test("the longest report keeps every piece of information and needs the box to scroll", () => {
  assert.equal(LONGEST.schema, 5);
  const lines = formatReport(LONGEST);
  const all = show(lines);
  assert.equal(lines[0], "run failed: counts cover the calls before the error");
  assert.equal(reportState(LONGEST), "failed");
  assert.ok(lines.includes(`error: ${LONGEST.error.type}: ${LONGEST.error.message}`));
  for (const f of LONGEST.fallbacks) {
    assert.ok(Object.hasOwn(REASON_LABELS, f.code), f.code);
    const what = f.backend === "stock" ? "to ComfyUI attention" : `fallback from ${f.backend}`;
    assert.ok(lines.includes(`${what} ×${f.count}: ${REASON_LABELS[f.code]}`), `${f.backend} ${f.code}\n${all}`);
    assert.ok(all.includes(f.reason), f.reason);
  }
  const skipLine = "skipped: " + LONGEST.skipped.map((s) => `${s.backend} (${REASON_LABELS[s.code]})`).join(", ");
  assert.ok(lines.includes(skipLine), `${skipLine}\n${all}`);
  for (const s of LONGEST.skipped) assert.ok(lines.includes(`why ${s.backend} was skipped: ${s.reason}`), s.reason);
  assert.ok(lines.includes(`prepared: ${formatPrepared(LONGEST.prepared)}`));
  for (const s of LONGEST.prepared_skipped) {
    assert.ok(lines.includes(`no prepared path ×${s.count}: ${REASON_LABELS[s.code]}`), s.code);
    assert.ok(lines.includes(`why no ${s.backend} prepared path: ${s.reason}`), s.reason);
  }
  for (const n of LONGEST.notes) assert.ok(lines.includes(`note: ${n.text}`), n.text);
  assert.ok(lines.includes(`why comfy-kitchen's int8 GEMM runs: ${LONGEST.int8_gemm.reason}`), all);
  assert.ok(lines.includes("model call needed: 4.6 GiB; 1.5 GiB of stock's video embedding handed back"), all);
  for (const e of LONGEST.compile_events) assert.ok(all.includes(e.key), e.key);
  assert.ok(lines.includes("split over heads: up to 3 chunks (int32 offsets)"));
  assert.ok(lines.includes("handed back to ComfyUI attention: ×7"));
  assert.ok(lines.includes("layout: strided_nhd · asked: auto · prep: fused_rotated"));
  assert.ok(lines.includes("replaced an earlier patch of this node on the same model"));
  assert.ok(lines.includes(formatKitchen(LONGEST.comfy_kitchen)) && all.includes(LONGEST.comfy_kitchen.reason));
  for (const s of LONGEST.int8_stock_quantizer) assert.ok(lines.includes(`why int8 linears kept stock's quantiser: ${s.reason}`));
  assert.ok(lines.length > STATUS_VISIBLE_LINES, "the fixture must need the box to scroll");
  // the fixture carries every payload key (nodes/report.py), so no part of the format goes untried
  for (const key of Object.keys(REPORT)) assert.ok(key in LONGEST, key);
});

test("markup from the server stays literal text", () => {
  const lines = formatReport({ ...REPORT, layout: "<img src=x onerror=alert(1)>" });
  assert.ok(lines.includes("layout: <img src=x onerror=alert(1)> · asked: auto"));
});

test("no attention calls is said plainly", () => {
  const lines = formatReport({ ...REPORT, status: "no_attention_calls", backends_ran: {}, attention_calls: 0, prepared: [] });
  assert.ok(lines.some((l) => l.startsWith("ran: nothing")), show(lines));
  assert.ok(!lines.some((l) => l.startsWith("copies made")), show(lines));
  assert.equal(reportState({ ...REPORT, status: "no_attention_calls" }), "no_calls");
});

test("a run where no sampling run used the patched model says the node ran and no model call was made", () => {
  const report = { ...REPORT, status: "no_model_calls", backends_ran: {}, attention_calls: 0, prepared: [],
    block_path_blocks: 0, notes: [{ code: "removed_value", text: "block_path 'fused' was removed" }] };
  const lines = formatReport(report);
  assert.equal(lines[0], `ran: ${NO_MODEL_CALLS}`, show(lines));
  assert.ok(NO_MODEL_CALLS.includes("denoise 0"), NO_MODEL_CALLS);
  assert.ok(lines.includes("layout: strided_nhd · asked: auto"), show(lines));
  assert.ok(lines.includes("note: block_path 'fused' was removed"), show(lines));
  // nothing ran: no counts, no fallback line, no "0 of 50 blocks"
  for (const start of ["fallbacks", "block fast path", "copies made", "skipped"]) {
    assert.ok(!lines.some((l) => l.startsWith(start)), `${start}: ${show(lines)}`);
  }
  assert.equal(reportState(report), "no_calls");
});

test("a loader that runs the model's forward itself: not active, who and how first, no counts", () => {
  const taken = { code: "forward_taken_away", text: "Raylight runs the model's forward (diffusion_model._forward set)" };
  const report = { ...REPORT, status: "not_active", backends_ran: {}, attention_calls: 0, prepared: [], fallbacks: [],
    blocks_patched: 0, refiner_blocks_patched: 0, notes: [taken, { code: "removed_value", text: "mapped" }] };
  const lines = formatReport(report);
  assert.equal(lines[0], `not active: ${taken.text}`, show(lines));
  assert.ok(lines.includes("note: mapped") && !lines.some((l) => l === `note: ${taken.text}`), show(lines));
  for (const start of ["ran:", "fallbacks", "block fast path", "copies made"]) {
    assert.ok(!lines.some((l) => l.startsWith(start)), `${start}: ${show(lines)}`);
  }
  assert.equal(reportState(report), "no_calls");
  // calls that still came (the text refiner) are counted under it
  const refiner = formatReport({ ...report, attention_calls: 4, backends_ran: { sdpa: 4 } });
  assert.equal(refiner[0], `not active: ${taken.text}`, show(refiner));
  assert.equal(refiner[1], "ran: sdpa ×4", show(refiner));
});

test("H3 forwards patched and no call reaching them name the likely cause", () => {
  const none = { ...REPORT, status: "no_attention_calls", backends_ran: {}, attention_calls: 0, prepared: [] };
  assert.ok(formatReport(none).includes(NO_CALLS_CAUSE), show(formatReport(none)));
  assert.ok(NO_CALLS_CAUSE.startsWith("likely cause: ") && NO_CALLS_CAUSE.includes("DIFFUSION_MODEL wrapper"));
  // nothing patched (a declined checkpoint, the override path): the notes say why, no guess
  assert.ok(!formatReport({ ...none, blocks_patched: 0, refiner_blocks_patched: 0 }).includes(NO_CALLS_CAUSE));
  assert.ok(!formatReport({ ...none, path: "attention_override" }).includes(NO_CALLS_CAUSE));
});

test("override path, stock hand-backs, head chunks and a replaced patch are all shown", () => {
  const lines = formatReport({
    ...REPORT,
    path: "attention_override",
    model_family: "SDXL",
    stock_calls: 7,
    head_chunks_max: 3,
    copies_per_call: 1.5,
    replaced_own_patch: true,
  });
  assert.ok(lines.includes("SDXL: attention override"), show(lines));
  assert.ok(lines.includes("handed back to ComfyUI attention: ×7"));
  assert.ok(lines.includes("split over heads: up to 3 chunks (int32 offsets)"));
  assert.ok(lines.includes("copies made per call: 1.5"));
  assert.ok(lines.includes("replaced an earlier patch of this node on the same model"));
});

test("missing or malformed fields give question marks instead of throwing", () => {
  const lines = formatReport({});
  assert.ok(lines.length >= 4);
  assert.ok(lines.every((l) => typeof l === "string"));
  assert.deepEqual(formatReport(null), formatReport({}));
  const odd = formatReport({ fallbacks: [null, "sage2", 3], skipped: "x", comfy_kitchen: ["0.2.40"], prepared: {}, prepared_skipped: [[]],
    notes: "n", compile_events: [null], error: 5 });
  assert.ok(odd.includes("fallbacks: none"), show(odd));
  assert.ok(odd.every((l) => typeof l === "string" && !l.includes("undefined") && !l.includes("[object")), show(odd));
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
  const served = { "comfyui-sage-strided-nhd": ["H3 12-step HND", "H3 2-step strided NHD",
    "H3 12-step strided NHD", "H3 2-step HND"], other: ["b", "a"] };
  assert.deepEqual(sortOurTemplates(served), {
    "comfyui-sage-strided-nhd": ["H3 2-step HND", "H3 2-step strided NHD",
      "H3 12-step HND", "H3 12-step strided NHD"],
    other: ["b", "a"],
  });
  assert.equal(sortOurTemplates(undefined), undefined);
});

test("the H3 path says on how many blocks the block fast path ran", () => {
  const lines = formatReport({ ...REPORT, block_path: "exact", block_path_blocks: 48 });
  assert.ok(lines.includes("block fast path: 48 of 50 blocks"), lines.join("\n"));
  assert.ok(!formatReport({ ...REPORT, path: "attention_override", block_path_blocks: 0 }).some((l) => l.startsWith("block fast path")));
});
