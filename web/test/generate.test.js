// generate.html in headless Chromium: transformers.js (onnxruntime-web) generates transformers'
// greedy tokens from each deltarule export folder (web/models, by web/models.py), on WebGPU
// (SwiftShader here) and on WASM, the folder picked as a person picks it; what it cannot run gets
// a message in the page and the page keeps working; the quantized files (the index's `dtypes`)
// chosen in the page's dtype list give onnxruntime's tokens or onnxruntime-web's exact refusal;
// "Time prefill" times the fused export and its Scan twin (measured, not asserted: docs/export.md
// has the numbers).
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { choose, modelIndex, modelsRoot, pick, press, timePrefill, webRoot } from "../tools/generate-page.js";
import { serve, withChromium } from "../tools/gpu.js";

const index = modelIndex();
const shots = path.join(webRoot, "test-results");

async function onPage(fn) {
  const server = await serve(webRoot);
  try {
    return await withChromium(new URL("generate.html", server.url).href, async (page) => {
      await page.waitForFunction(() => document.getElementById("adapter").textContent !== "…");
      return fn(page);
    });
  } finally {
    await server.close();
  }
}

for (const device of ["webgpu", "wasm"]) {
  test(`chromium/${device}: transformers.js generates transformers' tokens from every export`, { timeout: 900_000 },
    async (t) => {
      await onPage(async (page) => {
        if (device === "webgpu") assert.match(await page.textContent("#adapter"), /\w/);
        await page.fill("#prompt", index.prompt);
        await page.fill("#max-new-tokens", String(index.max_new_tokens));
        for (const m of index.models) {
          const loaded = await pick(page, path.join(modelsRoot, m.name), device);
          if (m.transformers_js) {        // a model type transformers.js does not register: said in the page
            assert.equal(loaded.state, "error", `${m.name} loaded`);
            assert.match(loaded.error, new RegExp(`cannot run model type "${m.model_type}"`));
            assert.equal(await page.textContent("#error"), loaded.error);
            t.diagnostic(`${m.name}: refused (${m.transformers_js})`);
            continue;
          }
          assert.equal(loaded.state, "ready", `${m.name}: ${loaded.error}`);
          const after = await press(page, "#generate");
          assert.equal(after.state, "ready", `${m.name}: ${after.error}`);
          const run = after.runs.at(-1);
          assert.deepEqual(run.promptIds, m.prompt_ids, `${m.name}: prompt token ids`);
          assert.deepEqual(run.tokens, m.tokens, `${m.name}: greedy tokens`);
          assert.ok(run.prefillTokensPerSecond > 0 && run.decodeTokensPerSecond > 0);
          // what was streamed into the page is the text of the tokens
          assert.equal(await page.textContent("#output"), index.prompt + run.text);
          assert.match(await page.textContent("#stats"), /prefill [\d.]+ tokens\/s .* decode [\d.]+ tokens\/s/);
          fs.mkdirSync(shots, { recursive: true });
          await page.screenshot({ path: path.join(shots, `generate-${device}.png`), fullPage: true });
          t.diagnostic(`${m.name}: ${run.tokens.length} tokens equal; prefill ${run.prefillTokensPerSecond.toFixed(0)}` +
            ` tokens/s, decode ${run.decodeTokensPerSecond.toFixed(1)} tokens/s`);
        }
        assert.deepEqual(page.errors.filter((e) => !/Unsupported model type/.test(e)), []);
      });
    });
}

// The quantized files, chosen in the page's dtype list, against onnxruntime (Python) on the same
// file. WASM: onnxruntime-web's WASM build computes MatMulNBits in float32 whatever its
// accuracy_level (native onnxruntime's CPU kernels quantize the activations to int8 at level 4),
// so its tokens are the index's `float_tokens` (onnxruntime with accuracy_level 0); it has no
// kernel for GatherBlockQuantized, so a q4 file with quantized embeddings is refused by name.
// WebGPU: q4 gives onnxruntime's tokens; q4f16 needs shader-f16 (SwiftShader has none: every f16
// kernel refuses to build its shader, said by name when the first one runs).
const refusals = {
  gatherBlockQuantized: /Can't create a session\. ERROR_CODE: 9, ERROR_MESSAGE: Could not find an implementation for GatherBlockQuantized\(1\) node with name 'node_embedding_Q4'/,
  f16: /failed to call OrtRun\(\)\. ERROR_CODE: 1, ERROR_MESSAGE: Non-zero status code returned while running \w+ node\. Name:'[^']+' Status Message: shader_helper\.cc:\d+ GenerateSourceCode Program \w+ requires f16 but the device does not support it\./,
};
test("chromium: q8 / q4 on WASM and q4 / q4f16 on WebGPU against onnxruntime on the same file", { timeout: 600_000 },
  async (t) => {
    await onPage(async (page) => {
      const versions = await page.evaluate(async () =>
        (await (await import("./generate.js")).transformersJs()).env.backends.onnx.versions);
      const wanted = JSON.parse(fs.readFileSync(path.join(webRoot, "package.json"), "utf8")).dependencies["onnxruntime-web"];
      assert.deepEqual(versions, { common: wanted, web: wanted });
      const f16 = await page.evaluate(async () => !!(await navigator.gpu?.requestAdapter())?.features.has("shader-f16"));
      await page.fill("#prompt", index.prompt);
      await page.fill("#max-new-tokens", String(index.max_new_tokens));
      const generates = async (m, dtype, expected) => {
        const after = await press(page, "#generate");
        assert.equal(after.state, "ready", `${m.name} ${dtype}: ${after.error}`);
        const run = after.runs.at(-1);
        assert.equal(run.dtype, dtype);
        assert.deepEqual(run.promptIds, m.prompt_ids);
        assert.deepEqual(run.tokens, expected, `${m.name} ${dtype} on ${run.device}: greedy tokens`);
        t.diagnostic(`${m.name} ${dtype} on ${run.device}: ${run.tokens.length} tokens equal`);
      };
      for (const m of index.models.filter((m) => Object.keys(m.dtypes).length)) {
        const embeddings = m.dtypes.q4.ops.includes("com.microsoft.GatherBlockQuantized");
        assert.equal((await pick(page, path.join(modelsRoot, m.name), "wasm")).state, "ready");
        assert.deepEqual(await page.$$eval("#dtype option", (os) => os.map((o) => o.value)), ["fp32", ...Object.keys(m.dtypes)]);
        assert.equal((await choose(page, "dtype", "q8")).state, "ready");
        await generates(m, "q8", m.dtypes.q8.float_tokens);
        const q4 = await choose(page, "dtype", "q4");
        if (embeddings) {
          assert.equal(q4.state, "error", `${m.name} q4 loaded on WASM`);
          assert.match(q4.error, refusals.gatherBlockQuantized);
          assert.equal(await page.textContent("#error"), q4.error);
          t.diagnostic(`${m.name} q4 on wasm: refused (${q4.error})`);
        } else {
          assert.equal(q4.state, "ready", q4.error);
          await generates(m, "q4", m.dtypes.q4.float_tokens);
        }
        // the backend changed, the dtype kept
        const gpu = await choose(page, "device", "webgpu");
        assert.equal(gpu.state, "ready", gpu.error);
        assert.equal(gpu.model.dtype, "q4");
        await generates(m, "q4", m.dtypes.q4.tokens);
        assert.equal((await choose(page, "dtype", "q4f16")).state, "ready");
        if (f16) {
          await generates(m, "q4f16", m.dtypes.q4f16.tokens);
        } else {
          const after = await press(page, "#generate");
          assert.equal(after.state, "error", `${m.name} q4f16 generated on WebGPU without shader-f16`);
          assert.match(after.error, refusals.f16);
          assert.equal(await page.textContent("#error"), after.error);
          t.diagnostic(`${m.name} q4f16 on webgpu: refused (no shader-f16: ${after.error})`);
        }
      }
      // after the refusals the page still loads and generates
      const good = index.models.find((m) => !m.transformers_js);
      assert.equal((await pick(page, path.join(modelsRoot, good.name), "wasm")).state, "ready");
      assert.deepEqual((await press(page, "#generate")).runs.at(-1).tokens, good.tokens);
      fs.mkdirSync(shots, { recursive: true });
      await page.screenshot({ path: path.join(shots, "generate-dtypes.png"), fullPage: true });
    });
  });

// a folder that is not an export, a model too large for the page, a family transformers.js
// lacks: each gets its message, and the next good folder still generates; a lost WebGPU device
// gets its message too
test("chromium: bad folders get a message in the page, then a good one runs", { timeout: 600_000 }, async () => {
  const bad = fs.mkdtempSync(path.join(os.tmpdir(), "deltarule-web-"));
  try {
    const good = index.models.find((m) => !m.transformers_js);
    // too large: a real config and tokenizer, and a 4.5 GiB model.onnx (sparse: nothing written)
    const large = path.join(bad, "too-large");
    fs.mkdirSync(path.join(large, "onnx"), { recursive: true });
    for (const f of ["config.json", "tokenizer.json", "tokenizer_config.json"]) {
      fs.copyFileSync(path.join(modelsRoot, good.name, f), path.join(large, f));
    }
    fs.writeFileSync(path.join(large, "onnx", "model.onnx"), "");
    fs.truncateSync(path.join(large, "onnx", "model.onnx"), 4.5 * 1024 ** 3);
    const unsupported = index.models.find((m) => m.transformers_js);
    const cases = [
      [path.join(webRoot, "cards", "deltarule.LinearAttention"), /is not a model export: it has no config\.json/],
      [path.join(webRoot, "test"), /is not a model export/],
      [large, /too large for this page: its graphs and weights are 4\.50 GiB.*at most 4\.00 GiB/],
      [path.join(modelsRoot, unsupported.name), /cannot run model type/],
    ];
    await onPage(async (page) => {
      for (const device of ["wasm", "webgpu"]) {
        for (const [folder, message] of cases) {
          const state = await pick(page, folder, device);
          assert.equal(state.state, "error", `${folder} on ${device}`);
          assert.match(state.error, message);
          assert.equal(await page.textContent("#error"), state.error);
          assert.equal(await page.isDisabled("#generate"), true);
        }
        const state = await pick(page, path.join(modelsRoot, good.name), device);
        assert.equal(state.state, "ready", state.error);
        assert.equal(await page.textContent("#error"), "");
        assert.deepEqual((await press(page, "#generate")).runs.at(-1).tokens.length > 0, true);
      }
      await page.screenshot({ path: path.join(shots, "generate-error.png") });
      // a lost WebGPU device (here destroyed by hand) is said in the page, not waited on
      await page.evaluate(async () => {
        const { transformersJs } = await import("./generate.js");
        (await (await transformersJs()).env.backends.onnx.webgpu.device).destroy();
      });
      await page.waitForFunction(() => window.page.state === "error");
      assert.match(await page.textContent("#error"), /WebGPU device lost \(destroyed\)/);
      assert.equal(await page.isDisabled("#generate"), true);
    });
  } finally {
    fs.rmSync(bad, { recursive: true, force: true });
  }
});

// the page's prefill timing, fused export vs its Scan twin on both backends (tiny shape, short
// prompt here: `node web/prefill-bench.js` measures the shapes and lengths docs/export.md quotes)
test("chromium: Time prefill runs on the fused export and its Scan twin", { timeout: 600_000 }, async (t) => {
  const pair = index.scan.filter((m) => m.shape === "tiny");
  assert.deepEqual(pair.map((m) => m.kind), ["fused", "scan"]);
  await onPage(async (page) => {
    for (const device of ["wasm", "webgpu"]) {
      const rates = await timePrefill(page, pair.map((m) => path.join(modelsRoot, m.name)), device, 128);
      const [fused, scan] = pair.map((m) => rates[m.name].median);
      assert.ok(fused > 0 && scan > 0, JSON.stringify(rates));
      t.diagnostic(`${device}: prefill 128 tokens, fused ${fused.toFixed(0)} tokens/s, Scan ${scan.toFixed(0)} tokens/s, ` +
        `${(fused / scan).toFixed(2)}x`);
    }
  });
});
