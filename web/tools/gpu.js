// WebGPU from Node on this machine class (no GPU): Dawn in Node and headless Chromium, both on
// SwiftShader's Vulkan ICD from Debian's `chromium` package, and the static server that serves
// web/ to a browser. Used by the tests (test/*.test.js) and the scripts (serve.js, bench.js,
// prefill-bench.js). See ../ENVIRONMENT.md.
import fs from "node:fs";
import http from "node:http";
import path from "node:path";

export const CHROMIUM = process.env.CHROMIUM_PATH || "/usr/bin/chromium";
export const SWIFTSHADER_ICD = "/usr/lib/chromium/vk_swiftshader_icd.json";

// Dawn (npm `webgpu`) rejects Mesa 22.3's lavapipe ("Vulkan shaderUniform*ArrayDynamicIndexing
// required"), so point the Vulkan loader at SwiftShader unless the caller chose a driver already.
// NODEVICE_SELECT=1 keeps Mesa's implicit device-select layer (and its XDG_RUNTIME_DIR noise) out.
function vulkanEnv() {
  if (!process.env.VK_ICD_FILENAMES && !process.env.VK_DRIVER_FILES && fs.existsSync(SWIFTSHADER_ICD)) {
    process.env.VK_ICD_FILENAMES = SWIFTSHADER_ICD;
  }
  process.env.NODEVICE_SELECT ??= "1";
}

// Returns a fresh `navigator.gpu` for Node (Dawn's Vulkan backend on SwiftShader); also
// installs the WebGPU globals (GPUBufferUsage, GPUMapMode, ...) on globalThis.
// `flags` are extra dawn.node options, e.g. "enable-dawn-features=allow_unsafe_apis".
// Do not keep the returned object in a global: Node will not exit while it is referenced.
export async function nodeGPU(flags = []) {
  vulkanEnv();
  let webgpu;
  try {
    webgpu = await import("webgpu");
  } catch (e) {
    throw new Error(`npm package "webgpu" is not installed (run \`npm ci\` in web/): ${e.message}`);
  }
  Object.assign(globalThis, webgpu.globals);
  const gpu = webgpu.create(["backend=vulkan", ...flags]);
  const adapter = await gpu.requestAdapter();
  if (!adapter) {
    const icd = process.env.VK_ICD_FILENAMES || process.env.VK_DRIVER_FILES;
    throw new Error(
      "Dawn found no WebGPU adapter. " +
        (icd
          ? `Vulkan driver in use: ${icd}` + (fs.existsSync(icd) ? "." : " (file does not exist).")
          : `No SwiftShader ICD at ${SWIFTSHADER_ICD}: install Debian's chromium (bash .ci/web install).`) +
        " Also needs the system Vulkan loader (apt libvulkan1). Dawn refuses Mesa lavapipe 22.3.",
    );
  }
  return gpu;
}

// Flags that give headless Chromium a WebGPU adapter (SwiftShader, bundled with Chromium)
// on a machine without a GPU, plus those that keep it off the (closed) network.
export const CHROMIUM_ARGS = [
  "--no-sandbox", // we run as root
  "--enable-unsafe-webgpu", // the one that matters: without it requestAdapter() returns null
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--no-first-run",
  "--disable-quic",
];

// Launches headless Chromium through playwright-core, opens a page (at pageUrl, if given),
// calls fn(page, browser) and closes everything. Page errors and console errors are
// collected on page.errors (an array of strings). Returns fn's result.
export async function withChromium(pageUrl, fn, { args = [], headless = true } = {}) {
  if (!fs.existsSync(CHROMIUM)) {
    throw new Error(`Chromium not found at ${CHROMIUM}: run \`bash .ci/web install\` (apt chromium) or set CHROMIUM_PATH`);
  }
  const { chromium } = await import("playwright-core");
  const browser = await chromium.launch({ executablePath: CHROMIUM, headless, args: [...CHROMIUM_ARGS, ...args] });
  try {
    const page = await browser.newPage();
    page.errors = [];
    page.on("pageerror", (e) => page.errors.push(`pageerror: ${e.message}`));
    page.on("console", (m) => {
      if (m.type() === "error" && !/favicon|status of 404/.test(m.text())) page.errors.push(`console: ${m.text()}`);
    });
    if (pageUrl) await page.goto(pageUrl);
    return await fn(page, browser);
  } finally {
    await browser.close();
  }
}

export const MIME = {
  ".html": "text/html; charset=utf-8",
  ".js": "text/javascript; charset=utf-8",
  ".mjs": "text/javascript; charset=utf-8",
  ".json": "application/json; charset=utf-8",
  ".wgsl": "text/plain; charset=utf-8",
  ".jinja": "text/plain; charset=utf-8",
  ".txt": "text/plain; charset=utf-8",
  ".css": "text/css; charset=utf-8",
  ".svg": "image/svg+xml",
  ".png": "image/png",
  ".wasm": "application/wasm",
};

// Static file server on 127.0.0.1 (`port`, default a random free one), serving files under rootDir only
// (no directory listings; "dir/" serves dir/index.html). Resolves to the listening
// http.Server once it is listening, with .url ("http://127.0.0.1:PORT/") and
// .close() returning a promise.
export function serve(rootDir, port = 0) {
  const root = fs.realpathSync(path.resolve(rootDir));
  const server = http.createServer(async (req, res) => {
    const fail = (code) => { res.writeHead(code, { "content-type": "text/plain" }); res.end(`${code}\n`); };
    try {
      if (req.method !== "GET" && req.method !== "HEAD") return fail(405);
      let rel = decodeURIComponent(new URL(req.url, "http://x").pathname);
      if (rel.includes("\0")) return fail(400);
      if (rel.endsWith("/")) rel += "index.html";
      const file = await fs.promises.realpath(path.join(root, rel)); // follows symlinks
      const inside = path.relative(root, file);
      if (inside.startsWith("..") || path.isAbsolute(inside)) return fail(403);
      const st = await fs.promises.stat(file);
      if (!st.isFile()) return fail(404);
      res.writeHead(200, {
        "content-type": MIME[path.extname(file).toLowerCase()] || "application/octet-stream",
        "content-length": st.size,
        "cache-control": "no-store",
      });
      if (req.method === "HEAD") return res.end();
      fs.createReadStream(file).on("error", () => res.destroy()).pipe(res);
    } catch (e) {
      fail(e?.code === "ENOENT" || e?.code === "ENOTDIR" ? 404 : e instanceof URIError ? 400 : 500);
    }
  });
  const close = server.close.bind(server);
  server.close = () => new Promise((resolve) => { server.closeAllConnections?.(); close(() => resolve()); });
  return new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, "127.0.0.1", () => {
      server.url = `http://127.0.0.1:${server.address().port}/`;
      resolve(server);
    });
  });
}
