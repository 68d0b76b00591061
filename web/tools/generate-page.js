// Driving generate.html in headless Chromium as a person does (pick a folder, choose the
// backend, press a button), for test/generate.test.js and prefill-bench.js; the folders of
// web/models (web/models.py) it picks from.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

export const webRoot = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
export const modelsRoot = path.join(webRoot, "models");

// web/models/index.json (web/models.py): the export folders and transformers' tokens
export function modelIndex() {
  const index = path.join(modelsRoot, "index.json");
  if (!fs.existsSync(index)) {
    throw new Error(`${index} is missing: run \`.venv/bin/python web/models.py web/models\` (bash .ci/web test does)`);
  }
  return JSON.parse(fs.readFileSync(index, "utf8"));
}

// Pick `folder` (a path) on `device`; resolves to window.page once it is ready or has failed.
export async function pick(page, folder, device) {
  await page.selectOption("#device", device);
  await page.setInputFiles("#folder", folder);
  const name = path.basename(folder);
  await page.waitForFunction((name) => window.page.state === "error" ||
    (window.page.state === "ready" && window.page.model?.name === name), name, { timeout: 600_000 });
  return page.evaluate(() => window.page);
}

// Choose `value` in the page's list `what` ("dtype": the picked folder's dtypes; "device": the
// backend) for the folder already picked; resolves to window.page once it is loaded so or has failed.
export async function choose(page, what, value) {
  await page.selectOption(`#${what}`, value);
  await page.waitForFunction(([what, value]) => window.page.state === "error" ||
    (window.page.state === "ready" && window.page.model?.[what] === value), [what, value], { timeout: 600_000 });
  return page.evaluate(() => window.page);
}

// Press `button` ("#generate" or "#time-prefill"); resolves to window.page after its run.
export async function press(page, button) {
  const runs = await page.evaluate(() => window.page.runs.length);
  await page.click(button);
  await page.waitForFunction((n) => window.page.state === "error" || window.page.runs.length > n, runs,
    { timeout: 600_000 });
  return page.evaluate(() => window.page);
}

// Prefill tokens/s of each export in `folders` on `device` for a prompt of `tokens` tokens, one
// export after the other: loaded, one warm-up run (shader and kernel compilation), then `repeat`
// timed runs. Returns { folder name: { median, runs } } (runs: tokens/s, sorted).
export async function timePrefill(page, folders, device, tokens, repeat = 1) {
  const rates = {};
  for (const folder of folders) {
    const state = await pick(page, folder, device);
    if (state.state === "error") throw new Error(`${folder} on ${device}: ${state.error}`);
    await page.fill("#prefill-length", String(tokens));
    const runs = [];
    for (let i = 0; i <= repeat; i++) {
      const after = await press(page, "#time-prefill");
      if (after.state === "error") throw new Error(`prefill of ${folder} on ${device}: ${after.error}`);
      if (i > 0) runs.push(after.runs.at(-1).prefillTokensPerSecond);
    }
    runs.sort((a, b) => a - b);
    rates[path.basename(folder)] = { median: runs[Math.floor(runs.length / 2)], runs };
  }
  return rates;
}
