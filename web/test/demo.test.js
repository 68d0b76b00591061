// demo.html in headless Chromium: the card's test cases pass, the bench table holds numbers, and a
// screenshot of the page is kept (test-results/demo-*.png).
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { serve, withChromium } from "../tools/gpu.js";

const webRoot = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const shots = path.join(webRoot, "test-results");

// one card (every card's cases already ran in a page in cards.test.js): its cases, bench and plot
for (const card of ["deltarule.LinearAttention"]) {
  test(`chromium: demo.html runs ${card}'s cases and bench`, { timeout: 600_000 }, async (t) => {
    const server = await serve(webRoot);
    try {
      await withChromium(new URL(`demo.html?card=${card}&repeat=1`, server.url).href, async (page) => {
        const demo = await page.evaluate(() => window.demo);
        await page.waitForFunction(() => document.getElementById("status").textContent.startsWith("done"));
        fs.mkdirSync(shots, { recursive: true });
        await page.screenshot({ path: path.join(shots, `demo-${card}.png`), fullPage: true });
        assert.deepEqual(page.errors, []);
        assert.equal(await page.textContent("#status"), "done");
        const cells = await page.$$eval("#tests tbody tr", (trs) => trs.map((tr) => tr.children[1].textContent));
        assert.ok(cells.length > 0 && cells.every((c) => c === "pass"), cells.join(" "));
        const bench = await page.$$eval("#bench tbody tr", (trs) => trs.map((tr) => [...tr.children].map((td) => td.textContent)));
        assert.ok(bench.length >= 3);
        for (const [, , , tokens, ms, rate] of bench) {
          for (const x of [tokens, ms, rate]) assert.ok(Number(x) > 0 && Number.isFinite(Number(x)), `${x} in ${bench}`);
        }
        assert.ok(await page.$$eval("#plot rect", (r) => r.length) === bench.length);
        t.diagnostic(JSON.stringify(demo.bench.map((r) => [r.case, r.variant, Math.round(r.tokensPerSecond)])));
      });
    } finally {
      await server.close();
    }
  });
}
