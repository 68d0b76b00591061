// ort-kernels.html in headless Chromium: deltarule's kernel cards and onnxruntime-web's own WebGPU
// kernels on the same inputs and GPUDevice (docs/web.md, "The cards against onnxruntime-web's own
// kernels"). Every output and final state must agree with deltarule's float64 reference (the cards'
// relative error and float32 tolerance); times and the cards' per-round ratios must be finite and
// positive (they are measured and printed, not tested); onnxruntime-web's GatedDeltaNet sessions
// (one per chunk_size) must be placed on its WebGPU EP and say which route they built. The load
// average is printed before and after (the machine is shared). Needs web/ort-kernels/, written by
//   .venv/bin/python benchmarks/ort_web_kernels.py --out web/ort-kernels
// A screenshot goes to test-results/ort-kernels.png.
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { serve, withChromium } from "../tools/gpu.js";

const webRoot = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
// the generator's folder, relative to web/ (ORT_KERNELS_DATA: another --out below web/, e.g. a small case)
const DATA = process.env.ORT_KERNELS_DATA ?? "ort-kernels";
const dataRoot = path.join(webRoot, DATA);
// the exported cards, relative to web/ (ORT_KERNELS_CARDS: another `deltarule card export` folder
// below web/, e.g. one exported from a fixed commit while the shaders are being edited)
const CARDS = process.env.ORT_KERNELS_CARDS ?? "cards";
const shots = path.join(webRoot, "test-results");
const GDN = "com.microsoft.GatedDeltaNet", LA = "com.microsoft.LinearAttention";

if (!fs.existsSync(path.join(dataRoot, "index.json"))) {
  throw new Error(`${dataRoot}/index.json is missing: run \`.venv/bin/python benchmarks/ort_web_kernels.py ` +
    "--out web/ort-kernels` from the repository root (it writes the inputs, the one-node ONNX models and " +
    "the float64 references the page reads)");
}
for (const id of [GDN, "deltarule.LinearAttention"]) {
  if (!fs.existsSync(path.join(webRoot, CARDS, id, "metadata.json"))) {
    throw new Error(`${webRoot}/${CARDS}/${id} is missing: run \`python -m deltarule card export web/${CARDS}\``);
  }
}

const positive = (x) => typeof x === "number" && Number.isFinite(x) && x > 0;
const exp = (x) => x.toExponential(2);
const load = () => os.loadavg().map((x) => x.toFixed(2)).join(" / ");
const ratioText = (q) => `${q.median.toFixed(2)}x [${q.min.toFixed(2)}-${q.max.toFixed(2)}] vs ${q.against}`;

function table(result) {
  const lines = [`adapter ${result.adapter}; onnxruntime-web ${result.ort.versions.web}; B=1 H=${result.shape.H} ` +
    `K=${result.shape.K} V=${result.shape.V} ${result.shape.dtype}; tolerance ${result.tolerance}; median of ${result.repeat} rounds`];
  for (const r of result.rows) {
    lines.push([r.case, r.contract.replace("com.microsoft.", ""), r.implementation + (r.variant ? ` [${r.variant}]` : ""),
      r.ep + (r.programs?.length ? ` (built ${r.programs.join(", ")})` : ""), `err ${exp(r.errors.output)}/${exp(r.errors.state)}`,
      r.ok ? "pass" : "FAIL", `${r.ms.toFixed(1)} ms [${r.times.map((t) => t.toFixed(1)).join(", ")}]`,
      `${r.tokensPerSecond.toFixed(0)} tok/s`, ...(r.ratios ?? []).map((q) => `card/ORT ${ratioText(q)}`)].join(" | "));
  }
  for (const r of result.routes) lines.push(`route ${r.file}: ${r.route ?? "-"} (built ${r.programs.join(", ") || "nothing"})`);
  for (const [model, p] of Object.entries(result.placement)) lines.push(`placement ${model}: ${p.ep}`);
  return lines;
}

// One timed round (?repeat=1; ORT_KERNELS_REPEAT=N gives N rounds, docs/web.md's tables used 5):
// onnxruntime-web 1.31.1's GatedDeltaNet kernel takes 3.5x to 7x its LinearAttention's time here
// (50 to 80 s a call at 4096 tokens on a loaded 2-core machine), each round makes one call per
// session, and there are two GatedDeltaNet sessions (chunk_size 16 and 64): one round took 527 s.
const REPEAT = Number(process.env.ORT_KERNELS_REPEAT ?? 1);

test("chromium: ort-kernels.html, the cards against onnxruntime-web's WebGPU kernels", { timeout: (3 + REPEAT) * 400_000 }, async (t) => {
  const started = performance.now();
  t.diagnostic(`load average (1 / 5 / 15 min) at start ${load()}`);
  const server = await serve(webRoot);
  try {
    await withChromium(new URL(`ort-kernels.html?repeat=${REPEAT}&data=${DATA}/&cards=${CARDS}/`, server.url).href, async (page) => {
      const outcome = await page.evaluate(() => window.ortKernels.then((r) => ({ r }), (e) => ({ error: String(e?.message ?? e) })));
      await page.waitForFunction(() => !document.getElementById("status").textContent.startsWith("running"));
      fs.mkdirSync(shots, { recursive: true });
      await page.screenshot({ path: path.join(shots, "ort-kernels.png"), fullPage: true });
      assert.equal(outcome.error, undefined, `the page failed: ${outcome.error}`);
      const result = outcome.r;
      for (const line of table(result)) t.diagnostic(line);
      t.diagnostic(`wall ${((performance.now() - started) / 1000).toFixed(1)} s; load average at end ${load()}`);
      assert.deepEqual(page.errors, []);

      const index = JSON.parse(fs.readFileSync(path.join(dataRoot, "index.json"), "utf8"));
      assert.ok(index.cases.length > 0);
      for (const c of index.cases) {
        for (const contract of [GDN, LA]) {
          const rows = result.rows.filter((r) => r.case === c.name && r.contract === contract);
          const cards = rows.filter((r) => r.implementation.startsWith("card"));
          const ort = rows.filter((r) => r.implementation.startsWith("onnxruntime-web"));
          const models = index.ort_models.filter((m) => m.contract === contract);
          assert.ok(cards.length >= 1, `${c.name} ${contract}: no card row`);
          assert.deepEqual(ort.map((r) => r.variant), models.map((m) => m.variant), `${c.name} ${contract}: one onnxruntime-web row per model`);
          for (const r of rows) {
            const what = `${c.name} ${contract} ${r.implementation} ${r.variant}`;
            assert.ok(Number.isFinite(r.errors.output) && Number.isFinite(r.errors.state), `${what}: errors ${JSON.stringify(r.errors)}`);
            assert.ok(r.errors.output <= r.tolerance && r.errors.state <= r.tolerance,
              `${what}: relative error output ${r.errors.output}, state ${r.errors.state} > ${r.tolerance} against the float64 reference`);
            assert.equal(r.ok, true, what);
            assert.ok(r.times.length === result.repeat && r.times.every(positive), `${what}: times ${r.times}`);
            assert.ok(positive(r.ms) && positive(r.tokensPerSecond), `${what}: ${r.ms} ms, ${r.tokensPerSecond} tokens/s`);
          }
          for (const r of ort) assert.equal(r.ep, "WebGpuExecutionProvider", `${c.name} ${contract} ${r.variant}: placed on ${r.ep}`);
          for (const r of cards) {
            // a ratio per onnxruntime-web row of the contract, from the same rounds
            assert.equal(r.ratios.length, ort.length, `${c.name} ${contract} ${r.variant}: ratios ${JSON.stringify(r.ratios)}`);
            for (const q of r.ratios) {
              assert.ok(positive(q.min) && q.min <= q.median && q.median <= q.max && q.perRound.length === result.repeat,
                `${c.name} ${contract} ${r.variant} vs ${q.against}: ${JSON.stringify(q)}`);
            }
          }
        }
      }
      // onnxruntime-web's GatedDeltaNet routes: the first session (index order) builds its programs;
      // a later one either builds others (another route) or none (it runs the programs already built)
      const gdnRoutes = result.routes.filter((r) => r.contract === GDN);
      assert.equal(gdnRoutes.length, index.ort_models.filter((m) => m.contract === GDN).length);
      assert.ok(["recurrent", "chunked"].includes(gdnRoutes[0].route), `${gdnRoutes[0].file}: route ${JSON.stringify(gdnRoutes[0])}`);
      for (const r of gdnRoutes.slice(1)) assert.ok(r.route !== null || r.programs.length === 0, JSON.stringify(r));
      if (/swiftshader/.test(result.adapter)) {
        // 1.31.1 documents chunk_size 16 as the opt-in to its chunkwise prefill on supported Apple
        // silicon only: here every GatedDeltaNet session runs the token-serial program
        for (const r of gdnRoutes) assert.ok(r.route === "recurrent" || r.route === null, `${r.file}: ${JSON.stringify(r)}`);
      }
      assert.ok(Object.keys(result.ortShaders).length > 0, "onnxruntime-web logged no WGSL");
      assert.equal(await page.textContent("#status"), "done");
      assert.equal(await page.$$eval("#results tbody tr", (trs) => trs.length), result.rows.length);
    });
  } finally {
    await server.close();
  }
});
