// Prefill tokens/s in generate.html (headless Chromium), each fused export of web/models/index.json's
// `scan` pairs against its Scan twin, on WebGPU and WASM: the numbers docs/export.md quotes.
//
//   node prefill-bench.js [TOKENS ...] [--shape tiny|tiny_0_8b_heads] [--device webgpu|wasm] [--repeat N]
//
// One JSON line per (shape, device, tokens): fused and Scan tokens/s (median of N runs after a
// warm-up run; the fused export's runs first, then the Scan's, each in its own session), their
// ratio and its spread over the runs; then the adapter. onnxruntime-web's WASM runs one thread
// (the page is not cross-origin isolated).
import path from "node:path";
import { serve, withChromium } from "./tools/gpu.js";
import { modelIndex, modelsRoot, timePrefill, webRoot } from "./tools/generate-page.js";

const args = process.argv.slice(2);
const option = (name) => args.flatMap((a, i) => (a === name ? [args[i + 1]] : []));
const plain = args.filter((a, i) => !a.startsWith("--") && !args[i - 1]?.startsWith("--"));
const lengths = (plain.length ? plain : ["512"]).map(Number);
const repeat = Number(option("--repeat")[0] ?? 1);
const index = modelIndex();
const shapes = option("--shape").length ? option("--shape") : [...new Set(index.scan.map((m) => m.shape))];
const devices = option("--device").length ? option("--device") : ["webgpu", "wasm"];

const server = await serve(webRoot);
try {
  await withChromium(new URL("generate.html", server.url).href, async (page) => {
    await page.waitForFunction(() => document.getElementById("adapter").textContent !== "…");
    for (const shape of shapes) {
      const pair = ["fused", "scan"].map((kind) => index.scan.find((m) => m.shape === shape && m.kind === kind));
      for (const device of devices) {
        for (const tokens of lengths) {
          const rates = await timePrefill(page, pair.map((m) => path.join(modelsRoot, m.name)), device, tokens, repeat);
          const [fused, scan] = pair.map((m) => rates[m.name]);
          const round = (runs) => runs.map((x) => Math.round(x));
          console.log(JSON.stringify({ shape, device, tokens, fused: Math.round(fused.median), scan: Math.round(scan.median),
            ratio: Number((fused.median / scan.median).toFixed(2)),
            // the ratio's spread: slowest fused over fastest Scan .. fastest fused over slowest Scan
            spread: [fused.runs[0] / scan.runs.at(-1), fused.runs.at(-1) / scan.runs[0]].map((x) => Number(x.toFixed(2))),
            fusedRuns: round(fused.runs), scanRuns: round(scan.runs) }));
        }
      }
    }
    console.log(JSON.stringify({ adapter: await page.textContent("#adapter"), userAgent: await page.evaluate(() => navigator.userAgent) }));
  });
} finally {
  await server.close();
}
