// transformers.js in Node (onnxruntime-node, CPU) on each deltarule export folder (web/models, by
// web/models.py), loaded as it is through generate.js: the tokenizer shipped in the folder gives
// the prompt ids Python's `tokenizers` gave, and greedy generation gives transformers' tokens; a
// model type transformers.js does not register is refused by name; inspect() refuses what is
// not an export or too large before loading anything. The quantized files (q8, q4, q4f16: the
// index's `dtypes`) give the tokens onnxruntime (Python) generated from the same file; and
// @huggingface/transformers resolves onnxruntime-web to the version package.json overrides to.
import assert from "node:assert/strict";
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { test } from "node:test";
import { ExportError, WASM_MEMORY_BYTES, folderFromPath, generate, inspect, openExport, transformersJs } from "../generate.js";
import { modelIndex, modelsRoot, webRoot } from "../tools/generate-page.js";

const index = modelIndex();

for (const m of index.models) {
  test(`node/onnxruntime-node: ${m.name} (${m.architecture})`, { timeout: 300_000 }, async (t) => {
    const folder = await folderFromPath(path.join(modelsRoot, m.name));
    if (m.transformers_js) {
      await assert.rejects(openExport(folder, { device: "cpu" }), (e) => e instanceof ExportError &&
        e.message.includes(`transformers.js 4.3.2 cannot run model type "${m.model_type}"`));
      t.diagnostic(`refused: ${m.transformers_js}`);
      return;
    }
    const model = await openExport(folder, { device: "cpu" });
    const run = await generate(model, index.prompt, { maxNewTokens: index.max_new_tokens });
    assert.deepEqual(run.promptIds, m.prompt_ids);
    assert.deepEqual(run.tokens, m.tokens);
    assert.equal(run.text, m.text);
    await model.model.dispose();
  });
}

// each quantized dtype on onnxruntime-node's CPU kernels (those onnxruntime Python runs: the
// same MatMulNBits int8-activation path at accuracy_level 4)
for (const m of index.models.filter((m) => Object.keys(m.dtypes).length)) {
  test(`node/onnxruntime-node: ${m.name} at ${Object.keys(m.dtypes).join(", ")} gives onnxruntime's tokens`,
    { timeout: 300_000 }, async (t) => {
      const folder = await folderFromPath(path.join(modelsRoot, m.name));
      assert.deepEqual((await inspect(folder)).dtypes, ["fp32", ...Object.keys(m.dtypes)]);
      for (const [dtype, q] of Object.entries(m.dtypes)) {
        const model = await openExport(folder, { device: "cpu", dtype });
        assert.equal(model.dtype, dtype);
        const run = await generate(model, index.prompt, { maxNewTokens: index.max_new_tokens });
        assert.deepEqual(run.promptIds, m.prompt_ids);
        assert.deepEqual(run.tokens, q.tokens, `${m.name} ${dtype}`);
        assert.equal(run.text, q.text);
        await model.model.dispose();
        t.diagnostic(`${dtype} (${q.ops.join(", ")}): ${run.tokens.length} tokens equal onnxruntime's` +
          (q.tokens.join() === m.tokens.join() ? " (which equal transformers' fp32 tokens)" : ""));
      }
    });
}

// package.json's "overrides" give transformers.js's own onnxruntime-web dependency the version
// of ours: its web build (dist/transformers.web.js, which generate.html loads) imports that
// package; Node's build runs onnxruntime-node, whose version is transformers.js's pin
test("@huggingface/transformers resolves onnxruntime-web to package.json's version", async () => {
  const ours = JSON.parse(fs.readFileSync(path.join(webRoot, "package.json"), "utf8"));
  const wanted = ours.dependencies["onnxruntime-web"];
  assert.equal(ours.overrides["onnxruntime-web"], "$onnxruntime-web");
  const fromTransformers = createRequire(import.meta.resolve("@huggingface/transformers"));
  const ort = fromTransformers("onnxruntime-web");
  assert.deepEqual(ort.env.versions, { common: wanted, web: wanted });
  const t = await transformersJs();
  assert.equal(t.env.backends.onnx.versions.node, "1.30.0");
});

const blob = (size) => ({ size, text: async () => "{}" });
const fake = (entries) => ({ name: "fake", files: new Map(Object.entries(entries)) });

test("inspect refuses a folder that is not an export, lacks a graph or tokenizer, or is too large", async () => {
  const config = { text: async () => JSON.stringify({ model_type: "qwen3_5_text", architectures: ["Qwen3_5ForCausalLM"] }) };
  const vl = { text: async () => JSON.stringify({ model_type: "qwen3_5", architectures: ["Qwen3_5ForConditionalGeneration"] }) };
  const cases = [
    [await folderFromPath(path.join(webRoot, "cards", "deltarule.LinearAttention")), /not a model export: it has no config\.json/],
    [fake({ "config.json": { text: async () => "{" } }), /config\.json" is not JSON/],
    [fake({ "config.json": config }), /no onnx\/\*\.onnx: not an ONNX export/],
    [fake({ "config.json": config, "onnx/model.onnx": blob(10) }), /no tokenizer\.json/],
    [fake({ "config.json": vl, "onnx/model.onnx": blob(10), "tokenizer.json": blob(10) }),
      /lacks onnx\/embed_tokens\.onnx/],
    [fake({ "config.json": config, "onnx/model.onnx": blob(2 ** 20), "onnx/model.onnx_data": blob(WASM_MEMORY_BYTES),
      "tokenizer.json": blob(10) }), /too large for this page: its graphs and weights are 4\.00 GiB/],
  ];
  for (const [folder, message] of cases) await assert.rejects(inspect(folder), (e) => e instanceof ExportError && message.test(e.message));
  const ok = await inspect(fake({ "config.json": config, "onnx/model.onnx": blob(100), "onnx/model.onnx_data": blob(900),
    "tokenizer.json": blob(10), "onnx/other.onnx": blob(5) }));
  assert.deepEqual([ok.graphs, ok.bytes, ok.dtype, ok.dtypes], [["onnx/model.onnx"], 1000, "fp32", ["fp32"]]);
  // the dtypes a folder holds (transformers.js's file names), the one asked, or fp32 / the first held
  const quantized = fake({ "config.json": config, "onnx/model.onnx": blob(100), "onnx/model_q4.onnx": blob(30),
    "onnx/model_quantized.onnx": blob(40), "onnx/model_q4f16.onnx": blob(20), "tokenizer.json": blob(10) });
  assert.deepEqual((await inspect(quantized)).dtypes, ["fp32", "q8", "q4", "q4f16"]);
  const q4 = await inspect(quantized, { dtype: "q4" });
  assert.deepEqual([q4.graphs, q4.bytes, q4.dtype], [["onnx/model_q4.onnx"], 30, "q4"]);
  await assert.rejects(inspect(quantized, { dtype: "fp16" }),
    /lacks onnx\/model_fp16\.onnx, which transformers\.js loads .* at dtype "fp16" \(the folder holds fp32, q8, q4, q4f16\)/);
  await assert.rejects(inspect(quantized, { dtype: "int4" }), /dtype "int4" is none of transformers\.js's: fp32, fp16, q8/);
  const onlyQ4 = await inspect(fake({ "config.json": vl, "onnx/embed_tokens_q4.onnx": blob(5),
    "onnx/decoder_model_merged_q4.onnx": blob(7), "tokenizer.json": blob(10) }));
  assert.deepEqual([onlyQ4.graphs, onlyQ4.bytes, onlyQ4.dtype, onlyQ4.dtypes],
    [["onnx/embed_tokens_q4.onnx", "onnx/decoder_model_merged_q4.onnx"], 12, "q4", ["q4"]]);
});
