// transformers.js in Node (onnxruntime-node, CPU) on each deltarule export folder (web/models, by
// web/models.py), loaded as it is through generate.js: the tokenizer shipped in the folder gives
// the prompt ids Python's `tokenizers` gave, and greedy generation gives transformers' tokens; a
// model type transformers.js does not register is refused by name; inspect() refuses what is
// not an export or too large before loading anything.
import assert from "node:assert/strict";
import path from "node:path";
import { test } from "node:test";
import { ExportError, WASM_MEMORY_BYTES, folderFromPath, generate, inspect, openExport } from "../generate.js";
import { modelIndex, modelsRoot, webRoot } from "./page.js";

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
  assert.deepEqual([ok.graphs, ok.bytes], [["onnx/model.onnx"], 1000]);
});
