// ort-kernels.html in headless Chromium: deltarule's kernel cards and onnxruntime-web's own WebGPU
// kernels on the same inputs and GPUDevice (docs/web.md, "The cards against onnxruntime-web's own
// kernels"). Every output and final state must agree with deltarule's float64 reference (the cards'
// relative error and float32 tolerance); times must be finite and positive (they are measured and
// printed, not tested). Needs web/ort-kernels/, written by
//   .venv/bin/python benchmarks/ort_web_kernels.py --out web/ort-kernels
// A screenshot goes to test-results/ort-kernels.png.
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { serve, withChromium } from "./gpu.js";

const webRoot = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const dataRoot = path.join(webRoot, "ort-kernels");
const shots = path.join(webRoot, "test-results");
const GDN = "com.microsoft.GatedDeltaNet", LA = "com.microsoft.LinearAttention";

if (!fs.existsSync(path.join(dataRoot, "index.json"))) {
  throw new Error(`${dataRoot}/index.json is missing: run \`.venv/bin/python benchmarks/ort_web_kernels.py ` +
    "--out web/ort-kernels` from the repository root (it writes the inputs, the one-node ONNX models and " +
    "the float64 references the page reads)");
}
for (const id of [GDN, "deltarule.LinearAttention"]) {
  if (!fs.existsSync(path.join(webRoot, "cards", id, "metadata.json"))) {
    throw new Error(`${webRoot}/cards/${id} is missing: run \`python -m deltarule card export web/cards\``);
  }
}

const positive = (x) => typeof x === "number" && Number.isFinite(x) && x > 0;
const exp = (x) => (x == null ? "-" : x.toExponential(2));

function table(result) {
  const lines = [`adapter ${result.adapter}; onnxruntime-web ${result.ort.versions.web}; B=1 H=${result.shape.H} ` +
    `K=${result.shape.K} V=${result.shape.V} ${result.shape.dtype}; tolerance ${result.tolerance}; median of ${result.repeat}`];
  for (const r of result.rows) {
    lines.push([r.case, r.contract.replace("com.microsoft.", ""), r.implementation + (r.variant ? ` [${r.variant}]` : ""),
      r.ep ?? "-", r.errors ? `err ${exp(r.errors.output)}/${exp(r.errors.state)}` : "-",
      r.unavailable ? "n/a" : r.ok ? "pass" : "FAIL", r.ms == null ? "-" : `${r.ms.toFixed(1)} ms`,
      r.tokensPerSecond == null ? "-" : `${r.tokensPerSecond.toFixed(0)} tok/s`,
      r.ratio == null ? "" : `card/ORT ${r.ratio.toFixed(2)}x` + (r.ratioAgainst.endsWith(r.contract) ? "" : " (vs ORT LinearAttention)"),
    ].join(" | "));
  }
  for (const [contract, p] of Object.entries(result.placement)) {
    lines.push(`placement ${contract}: ${p.ep ?? `none: ${p.error}` + (p.wasmError ? `; wasm EP alone: ${p.wasmError}` : "")}`);
  }
  return lines;
}

// One timed round (?repeat=1; ORT_KERNELS_REPEAT=3 gives the page's default, docs/web.md's table):
// onnxruntime-web 1.31.1's GatedDeltaNet kernel takes about 4x its LinearAttention's time here (80 s
// a call at 4096 tokens on a loaded 2-core machine), and each round makes one such call per case.
const REPEAT = Number(process.env.ORT_KERNELS_REPEAT ?? 1);

test("chromium: ort-kernels.html, the cards against onnxruntime-web's WebGPU kernels", { timeout: 1_200_000 }, async (t) => {
  const started = performance.now();
  const server = await serve(webRoot);
  try {
    await withChromium(new URL(`ort-kernels.html?repeat=${REPEAT}`, server.url).href, async (page) => {
      const outcome = await page.evaluate(() => window.ortKernels.then((r) => ({ r }), (e) => ({ error: String(e?.message ?? e) })));
      await page.waitForFunction(() => !document.getElementById("status").textContent.startsWith("running"));
      fs.mkdirSync(shots, { recursive: true });
      await page.screenshot({ path: path.join(shots, "ort-kernels.png"), fullPage: true });
      assert.equal(outcome.error, undefined, `the page failed: ${outcome.error}`);
      const result = outcome.r;
      for (const line of table(result)) t.diagnostic(line);
      t.diagnostic(`wall ${((performance.now() - started) / 1000).toFixed(1)} s`);
      assert.deepEqual(page.errors, []);

      const index = JSON.parse(fs.readFileSync(path.join(dataRoot, "index.json"), "utf8"));
      assert.ok(index.cases.length > 0);
      for (const c of index.cases) {
        for (const contract of [GDN, LA]) {
          const rows = result.rows.filter((r) => r.case === c.name && r.contract === contract);
          const cards = rows.filter((r) => r.implementation.startsWith("card"));
          const ort = rows.filter((r) => r.implementation.startsWith("onnxruntime-web"));
          assert.ok(cards.length >= 1, `${c.name} ${contract}: no card row`);
          assert.equal(ort.length, 1, `${c.name} ${contract}: one onnxruntime-web row`);
          for (const r of rows) {
            const what = `${c.name} ${contract} ${r.implementation} ${r.variant}`;
            if (r.unavailable) {
              // onnxruntime-web 1.31.0-dev had GatedDeltaNet's schema but no kernel in any EP: the session
              // was refused. Only that refusal is accepted: any other error, or a session that runs and
              // disagrees, fails. (1.31.1, package.json's version, has a WebGPU kernel: its rows run
              // and are held to the reference like the others.)
              assert.equal(contract, GDN, `${what}: unavailable: ${r.unavailable}`);
              const p = result.placement[GDN];
              assert.match(p.error, /Provider type for GatedDeltaNet node with name '.*' is not set|Could not find an implementation for GatedDeltaNet/);
              assert.ok(p.lines.some((l) => /webgpu kernel not found in registries for Op type: GatedDeltaNet/.test(l)), p.lines.join("\n"));
              assert.match(p.wasmError, /Could not find an implementation for GatedDeltaNet/);
              continue;
            }
            assert.ok(r.errors && Number.isFinite(r.errors.output) && Number.isFinite(r.errors.state), `${what}: errors ${JSON.stringify(r.errors)}`);
            assert.ok(r.errors.output <= r.tolerance && r.errors.state <= r.tolerance,
              `${what}: relative error output ${r.errors.output}, state ${r.errors.state} > ${r.tolerance} against the float64 reference`);
            assert.equal(r.ok, true, what);
            assert.ok(r.times.length === result.repeat && r.times.every(positive), `${what}: times ${r.times}`);
            assert.ok(positive(r.ms) && positive(r.tokensPerSecond), `${what}: ${r.ms} ms, ${r.tokensPerSecond} tokens/s`);
          }
          for (const r of cards) assert.ok(positive(r.ratio), `${c.name} ${contract} ${r.variant}: ratio ${r.ratio}`);
        }
      }
      assert.equal(typeof result.placement[LA].ep, "string", "onnxruntime-web logged no placement for LinearAttention");
      assert.ok(Object.keys(result.ortShaders).length > 0, "onnxruntime-web logged no WGSL");
      assert.equal(await page.textContent("#status"), "done");
      assert.equal(await page.$$eval("#results tbody tr", (trs) => trs.length), result.rows.length);
    });
  } finally {
    await server.close();
  }
});
