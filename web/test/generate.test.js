// generate.html in headless Chromium: transformers.js (onnxruntime-web) generates transformers'
// greedy tokens from each deltarule export folder (web/models, by web/models.py), on WebGPU
// (SwiftShader here) and on WASM, the folder picked as a person picks it; what it cannot run gets
// a message in the page and the page keeps working; "Time prefill" times the fused export and
// its Scan twin (measured, not asserted: docs/export.md has the numbers).
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { modelIndex, modelsRoot, pick, press, timePrefill, webRoot } from "./page.js";
import { serve, withChromium } from "./gpu.js";

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
