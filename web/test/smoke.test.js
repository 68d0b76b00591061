// WebGPU environment smoke tests: the same compute kernel in Node (Dawn) and in headless Chromium.
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { nodeGPU, serve, withChromium } from "../tools/gpu.js";
import { N, runSmoke } from "./smoke-kernel.js";

const here = path.dirname(fileURLToPath(import.meta.url));
const webRoot = path.dirname(here);
const shots = path.join(webRoot, "test-results");

function checkAdapter(t, r) {
  t.diagnostic(JSON.stringify(r.adapter));
  assert.equal(r.adapter.architecture, "swiftshader");
  assert.ok(r.adapter.maxStorageBuffersPerShaderStage >= 8);
  assert.ok(r.adapter.maxComputeWorkgroupStorageSize >= 16384);
  assert.equal(r.mismatches, 0, `${r.mismatches}/${N} wrong: got ${r.sample}, want ${r.want}`);
  t.diagnostic(`kernel round trip ${r.ms} ms`);
}

test("node: Dawn runs a compute shader", { timeout: 60_000 }, async (t) => {
  const r = await runSmoke(await nodeGPU());
  checkAdapter(t, r);
});

test("static server: MIME types and root confinement", async () => {
  const server = await serve(webRoot);
  try {
    const get = (p) => fetch(new URL(p, server.url));
    const js = await get("test/smoke-kernel.js");
    assert.equal(js.status, 200);
    assert.match(js.headers.get("content-type"), /^text\/javascript/);
    assert.match(await js.text(), /workgroupBarrier/);
    assert.match((await get("test/smoke.html")).headers.get("content-type"), /^text\/html/);
    assert.match((await get("package.json")).headers.get("content-type"), /^application\/json/);
    assert.equal((await get("test/nope.wgsl")).status, 404);
    // web/../.gitignore exists, so anything but 403 here means the server left its root.
    for (const p of ["/..%2f.gitignore", "/test/..%2F..%2F.gitignore", "/%2e%2e%2f.gitignore"]) {
      const r = await fetch(server.url.slice(0, -1) + p);
      assert.equal(r.status, 403, `${p} -> ${r.status}`);
    }
  } finally {
    await server.close();
  }
});

test("chromium: WebGPU in a headless page", { timeout: 120_000 }, async (t) => {
  const server = await serve(webRoot);
  try {
    const r = await withChromium(new URL("test/smoke.html", server.url).href, async (page) => {
      const res = await page.evaluate(() => window.smoke);
      await page.waitForFunction(() => !document.getElementById("out").textContent.startsWith("running"));
      fs.mkdirSync(shots, { recursive: true });
      await page.screenshot({ path: path.join(shots, "smoke-chromium.png") });
      assert.deepEqual(page.errors, []);
      return res;
    });
    assert.ok(r.ok, r.error);
    checkAdapter(t, r);
  } finally {
    await server.close();
  }
});
