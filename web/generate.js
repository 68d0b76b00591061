// Greedy generation with transformers.js on a `deltarule export onnx` folder, in this browser
// (generate.html: WebGPU or WASM, onnxruntime-web) and in Node (the tests: onnxruntime-node).
// docs/export.md, "transformers.js", is the guide.
//
//   import { openExport, folderFromFiles, generate } from "./generate.js";
//   const model = await openExport(folderFromFiles(input.files), { device: "webgpu" });
//   const run = await generate(model, "The gated delta rule", { maxNewTokens: 32, onToken });
//
// The folder is read as it is: no hub, no network (env.allowRemoteModels = false); its files
// reach transformers.js through env.fetch. What cannot run is refused with an ExportError
// that says why, before anything is loaded where that can be known (not an export, no
// tokenizer, too large), and otherwise with transformers.js's or onnxruntime's own message.

const isNode = typeof process !== "undefined" && !!process.versions?.node;

// onnxruntime-web reads the whole graph and its weights through WebAssembly memory (wasm32,
// also on the WebGPU backend, which uploads the weights from there): at most 4 GiB in all.
export const WASM_MEMORY_BYTES = 4 * 1024 ** 3;

export class ExportError extends Error {
  constructor(message, { cause } = {}) {
    super(message, cause ? { cause } : undefined);
    this.name = "ExportError";
  }
}

let loaded;
let instances = 0;
// transformers.js: Node's build (onnxruntime-node) in Node. In a page its web build
// (dist/transformers.web.min.js), which imports onnxruntime-web by name ("onnxruntime-web/webgpu",
// "onnxruntime-common"): generate.html's import map points both at web/node_modules/onnxruntime-web
// (the version package.json's overrides give transformers.js, not the one its all-in-one
// transformers.min.js has inside); its WebAssembly files from there too (by default it fetches
// them from a CDN).
//
// In a page transformers.js 4.3.2 chains every session creation (and every run) onto the one
// before (backends/onnx.js: webInitChain = webInitChain.then(load)), so once one fails (a kernel
// onnxruntime-web lacks) every later one rejects with that same error. After a failure the page
// therefore takes a fresh instance of the module (`forget`); onnxruntime-web itself is shared.
export async function transformersJs() {
  loaded ??= (async () => {
    if (isNode) return import("@huggingface/transformers");
    let t;
    try {
      t = await import(`./node_modules/@huggingface/transformers/dist/transformers.web.min.js${
        instances ? `?instance=${instances}` : ""}`);
    } catch (e) {
      if (!/onnxruntime/.test(e.message)) throw e;
      throw new ExportError("transformers.js's web build imports onnxruntime-web by name: the page needs an " +
        `import map for "onnxruntime-web/webgpu" and "onnxruntime-common" (generate.html has one): ${e.message}`,
      { cause: e });
    }
    const dist = new URL("./node_modules/onnxruntime-web/dist/", import.meta.url).href;
    t.env.backends.onnx.wasm.wasmPaths = { mjs: `${dist}ort-wasm-simd-threaded.asyncify.mjs`,
      wasm: `${dist}ort-wasm-simd-threaded.asyncify.wasm` };
    t.env.useWasmCache = false;
    t.env.useBrowserCache = false;
    return t;
  })();
  return loaded;
}

function forget() {
  if (isNode) return;
  loaded = undefined;
  instances++;
}

// A folder as { name, files: Map(relative path -> Blob) } from an <input webkitdirectory>'s
// FileList (paths relative to the picked folder).
export function folderFromFiles(fileList) {
  const files = new Map();
  let name = "";
  for (const f of fileList) {
    const parts = (f.webkitRelativePath || f.name).split("/");
    name ||= parts.length > 1 ? parts[0] : "";
    files.set(parts.length > 1 ? parts.slice(1).join("/") : parts[0], f);
  }
  return { name: name || "folder", files };
}

// Node: a folder on disk as the same { name, files } (Blobs backed by the files).
export async function folderFromPath(dir) {
  const [fs, path] = await Promise.all([import("node:fs"), import("node:path")]);
  const files = new Map();
  for (const rel of fs.readdirSync(dir, { recursive: true })) {
    const file = path.join(dir, rel);
    if (fs.statSync(file).isFile()) files.set(rel.split(path.sep).join("/"), await fs.openAsBlob(file));
  }
  return { name: path.basename(dir), files };
}

const gib = (n) => `${(n / 1024 ** 3).toFixed(2)} GiB`;

// transformers.js 4.3.2's dtypes and the file-name suffix it loads for each (utils/dtypes.js
// DEFAULT_DTYPE_SUFFIX_MAPPING), in the order the page lists them; `deltarule export onnx
// --dtype` writes fp32, fp16, q8, q4 and q4f16 (docs/export.md, "dtypes").
export const DTYPE_SUFFIXES = Object.freeze({ fp32: "", fp16: "_fp16", q8: "_quantized", q4: "_q4",
  q4f16: "_q4f16", int8: "_int8", uint8: "_uint8", bnb4: "_bnb4", q2: "_q2", q2f16: "_q2f16", q1: "_q1",
  q1f16: "_q1f16" });

// The graphs transformers.js loads at `dtype` for a checkpoint of `config`: model<suffix>.onnx, or
// the text-only pair of a ...ForConditionalGeneration checkpoint.
export function graphsOf(config, dtype) {
  const suffix = DTYPE_SUFFIXES[dtype];
  const pair = config.architectures?.[0]?.endsWith("ForConditionalGeneration");
  return pair ? [`onnx/embed_tokens${suffix}.onnx`, `onnx/decoder_model_merged${suffix}.onnx`]
    : [`onnx/model${suffix}.onnx`];
}

// What transformers.js will load from `folder` at `dtype` (default: fp32 where the folder has
// it, else the first of `DTYPE_SUFFIXES` it has), checked: a config, a tokenizer, the ONNX
// decoder (model<suffix>.onnx, or the text-only pair of a ...ForConditionalGeneration
// checkpoint) and their weights within what onnxruntime-web can hold. Returns { config,
// graphs, bytes, dtype, dtypes } (dtypes: every dtype whose graphs the folder holds).
export async function inspect(folder, { dtype } = {}) {
  const { files } = folder;
  const text = async (rel) => JSON.parse(await files.get(rel).text());
  if (!files.has("config.json")) {
    throw new ExportError(`"${folder.name}" is not a model export: it has no config.json ` +
      "(pick the folder `deltarule export onnx MODEL_DIR OUT_DIR` wrote: OUT_DIR)");
  }
  let config;
  try {
    config = await text("config.json");
  } catch (e) {
    throw new ExportError(`"${folder.name}/config.json" is not JSON: ${e.message}`, { cause: e });
  }
  const onnx = [...files.keys()].filter((p) => /^onnx\/.*\.onnx$/.test(p));
  if (onnx.length === 0) {
    throw new ExportError(`"${folder.name}" has a config.json but no onnx/*.onnx: not an ONNX export ` +
      "(`deltarule export onnx` writes onnx/model.onnx)");
  }
  if (!files.has("tokenizer.json")) {
    throw new ExportError(`"${folder.name}" has no tokenizer.json: the page tokenizes with the tokenizer ` +
      "shipped in the folder (the export copies the checkpoint's)");
  }
  if (dtype !== undefined && !Object.hasOwn(DTYPE_SUFFIXES, dtype)) {
    throw new ExportError(`dtype "${dtype}" is none of transformers.js's: ${Object.keys(DTYPE_SUFFIXES).join(", ")}`);
  }
  const dtypes = Object.keys(DTYPE_SUFFIXES).filter((d) => graphsOf(config, d).every((g) => files.has(g)));
  dtype ??= dtypes.includes("fp32") ? "fp32" : dtypes[0] ?? "fp32";
  const graphs = graphsOf(config, dtype);
  for (const g of graphs) {
    if (!files.has(g)) {
      throw new ExportError(`"${folder.name}" lacks ${g}, which transformers.js loads for a ` +
        `${config.architectures?.[0] ?? config.model_type} checkpoint at dtype "${dtype}" ` +
        (dtypes.length ? `(the folder holds ${dtypes.join(", ")})` : "(re-export it with this deltarule)"));
    }
  }
  const weights = [...files.keys()].filter((p) => graphs.some((g) => p === g || p.startsWith(`${g}_data`)));
  const bytes = weights.reduce((n, p) => n + files.get(p).size, 0);
  if (bytes > WASM_MEMORY_BYTES) {
    throw new ExportError(`"${folder.name}" is too large for this page: its graphs and weights are ` +
      `${gib(bytes)}, and onnxruntime-web reads them through WebAssembly memory, at most ${gib(WASM_MEMORY_BYTES)}`);
  }
  return { config, graphs, bytes, dtype, dtypes };
}

// transformers.js reads a local model's files with env.fetch (in Node too, with env.useFS off)
// at env.localModelPath + model id + file: a path (not a URL: its file checks skip URLs) that
// env.fetch answers from the folder. A fresh id per load: transformers.js memoizes file lookups by id.
const PREFIX = "/deltarule-export/";
let loads = 0;
let cacheDir;
async function processCacheDir() {
  if (!cacheDir) {
    const [fs, os, path] = await Promise.all([import("node:fs"), import("node:os"), import("node:path")]);
    cacheDir = fs.mkdtempSync(path.join(os.tmpdir(), "deltarule-transformers-js-"));
    process.on("exit", () => fs.rmSync(cacheDir, { recursive: true, force: true }));
  }
  return cacheDir;
}

// Load the export in `folder` ({ name, files }) on `device` ("webgpu" | "wasm" | "cpu" in
// Node) at `dtype` (`inspect`'s default: fp32 where the folder has it). Returns { tokenizer,
// model, config, device, dtype, dtypes, bytes, name }. `onProgress(text)` gets
// loading news. Calls run one at a time (each sets transformers.js's env while it loads).
let queue = Promise.resolve();
export function openExport(folder, options = {}) {
  const opened = queue.then(() => open(folder, options));
  queue = opened.catch(() => {});
  return opened;
}

async function open(folder, { device = "wasm", dtype, onProgress } = {}) {
  const { config, bytes, dtype: chosen, dtypes } = await inspect(folder, { dtype });
  const t = await transformersJs();
  if (device === "webgpu") {
    const adapter = await globalThis.navigator?.gpu?.requestAdapter();
    if (!adapter) {
      throw new ExportError("WebGPU: this browser gave no adapter (navigator.gpu.requestAdapter() returned " +
        "nothing); choose WASM");
    }
  }
  const id = `folder-${++loads}`;
  // ids repeat from one process to the next, so no cache outlives the process: none in a page;
  // in Node transformers.js hands onnxruntime-node a model as the path of its file cache's copy,
  // so the cache is a directory of this process's own, removed when it exits
  const saved = { fetch: t.env.fetch, useFS: t.env.useFS, localModelPath: t.env.localModelPath,
    useFSCache: t.env.useFSCache, useBrowserCache: t.env.useBrowserCache, cacheDir: t.env.cacheDir };
  Object.assign(t.env, { allowRemoteModels: false, allowLocalModels: true, useFS: false, localModelPath: PREFIX,
    useBrowserCache: false }, isNode ? { useFSCache: true, cacheDir: await processCacheDir() } : {});
  t.env.fetch = async (url, init) => {
    const where = String(url?.url ?? url);
    if (!where.startsWith(`${PREFIX}${id}/`)) return saved.fetch(url, init);
    const rel = decodeURIComponent(where.slice(`${PREFIX}${id}/`.length));
    const blob = folder.files.get(rel);
    if (!blob) return new Response(`${rel} is not in the folder`, { status: 404, statusText: "Not Found" });
    return new Response(blob, { status: 200, headers: { "content-length": String(blob.size) } });
  };
  const options = { local_files_only: true };
  const progress = (p) => {
    if (p.status === "progress" && p.total) onProgress?.(`${p.file}: ${Math.round(p.progress)}%`);
    else if (p.status) onProgress?.(`${p.file ?? ""} ${p.status}`.trim());
  };
  try {
    const tokenizer = await t.AutoTokenizer.from_pretrained(id, options);
    onProgress?.(`creating the ${device} session`);
    const model = await t.AutoModelForCausalLM.from_pretrained(id, { ...options, dtype: chosen, device,
      progress_callback: progress });
    return { tokenizer, model, config, device, dtype: chosen, dtypes, bytes, name: folder.name };
  } catch (e) {
    const what = /Unsupported model type/.test(e.message)
      ? `transformers.js ${t.env.version} cannot run model type "${config.model_type}"`
      : `loading "${folder.name}" (${chosen}) on ${device} failed`;
    forget();
    throw new ExportError(`${what}: ${e.message}`, { cause: e });
  } finally {
    Object.assign(t.env, saved);
  }
}

// Greedy generation of up to `maxNewTokens` after `prompt` (text, or token ids). onToken(ids,
// text) after each new token. Returns { promptIds, tokens, text, prefillMs, decodeMs,
// prefillTokensPerSecond, decodeTokensPerSecond } (prefill: the prompt's forward and the first
// token; decode: each later token).
export async function generate({ tokenizer, model }, prompt, { maxNewTokens = 32, onToken } = {}) {
  const t = await transformersJs();
  const promptIds = typeof prompt === "string" ? [...tokenizer.encode(prompt)] : [...prompt];
  const input_ids = new t.Tensor("int64", BigInt64Array.from(promptIds.map(BigInt)), [1, promptIds.length]);
  const attention_mask = new t.Tensor("int64", new BigInt64Array(promptIds.length).fill(1n), [1, promptIds.length]);
  const tokens = [];
  const stamps = [];
  const streamer = new t.TextStreamer(tokenizer, {
    skip_prompt: true,
    callback_function: () => {},
    token_callback_function: (ids) => {
      stamps.push(performance.now());
      tokens.push(...ids.map(Number));
      onToken?.(tokens, tokenizer.decode(tokens, { skip_special_tokens: false }));
    },
  });
  const t0 = performance.now();
  try {
    await model.generate({ input_ids, attention_mask, max_new_tokens: maxNewTokens, do_sample: false, streamer });
  } catch (e) {
    forget();        // (this model's runs are chained after the failed one: load it again)
    throw e;
  }
  const prefillMs = stamps[0] - t0;
  const decodeMs = stamps.at(-1) - stamps[0];
  return {
    promptIds, tokens, text: tokenizer.decode(tokens, { skip_special_tokens: false }),
    prefillMs, decodeMs,
    prefillTokensPerSecond: (1000 * promptIds.length) / prefillMs,
    decodeTokensPerSecond: tokens.length > 1 ? (1000 * (tokens.length - 1)) / decodeMs : NaN,
  };
}

// `n` prompt token ids for a prefill measurement: `text`'s ids repeated.
export function promptOfLength({ tokenizer }, text, n) {
  const ids = [...tokenizer.encode(text)];
  return Array.from({ length: n }, (_, i) => ids[i % ids.length]);
}
