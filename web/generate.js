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
// transformers.js: Node's build (onnxruntime-node) in Node; in a page its full bundle (with
// onnxruntime-web) from web/node_modules, its WebAssembly files from there too (by default
// it fetches them from a CDN).
export async function transformersJs() {
  loaded ??= (async () => {
    if (isNode) return import("@huggingface/transformers");
    const t = await import("./node_modules/@huggingface/transformers/dist/transformers.min.js");
    const dist = new URL("./node_modules/onnxruntime-web/dist/", import.meta.url).href;
    t.env.backends.onnx.wasm.wasmPaths = { mjs: `${dist}ort-wasm-simd-threaded.asyncify.mjs`,
      wasm: `${dist}ort-wasm-simd-threaded.asyncify.wasm` };
    t.env.useWasmCache = false;
    t.env.useBrowserCache = false;
    return t;
  })();
  return loaded;
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

// What transformers.js will load from `folder`, checked: a config, a tokenizer, the ONNX
// decoder (model.onnx, or the text-only pair of a ...ForConditionalGeneration checkpoint) and
// their weights within what onnxruntime-web can hold. Returns { config, graphs, bytes }.
export async function inspect(folder) {
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
  const pair = config.architectures?.[0]?.endsWith("ForConditionalGeneration");
  const graphs = pair ? ["onnx/embed_tokens.onnx", "onnx/decoder_model_merged.onnx"] : ["onnx/model.onnx"];
  for (const g of graphs) {
    if (!files.has(g)) {
      throw new ExportError(`"${folder.name}" lacks ${g}, which transformers.js loads for a ` +
        `${config.architectures?.[0] ?? config.model_type} checkpoint (re-export it with this deltarule)`);
    }
  }
  const weights = [...files.keys()].filter((p) => graphs.some((g) => p === g || p.startsWith(`${g}_data`)));
  const bytes = weights.reduce((n, p) => n + files.get(p).size, 0);
  if (bytes > WASM_MEMORY_BYTES) {
    throw new ExportError(`"${folder.name}" is too large for this page: its graphs and weights are ` +
      `${gib(bytes)}, and onnxruntime-web reads them through WebAssembly memory, at most ${gib(WASM_MEMORY_BYTES)}`);
  }
  return { config, graphs, bytes };
}

// transformers.js reads a local model's files with env.fetch (in Node too, with env.useFS off)
// at env.localModelPath + model id + file: a path (not a URL: its file checks skip URLs) that
// env.fetch answers from the folder. A fresh id per load: transformers.js memoizes file lookups by id.
const PREFIX = "/deltarule-export/";
let loads = 0;

// Load the export in `folder` ({ name, files }) on `device` ("webgpu" | "wasm" | "cpu" in
// Node). Returns { tokenizer, model, config, device, bytes, name }. `onProgress(text)` gets
// loading news. Calls run one at a time (each sets transformers.js's env while it loads).
let queue = Promise.resolve();
export function openExport(folder, options = {}) {
  const opened = queue.then(() => open(folder, options));
  queue = opened.catch(() => {});
  return opened;
}

async function open(folder, { device = "wasm", onProgress } = {}) {
  const { config, bytes } = await inspect(folder);
  const t = await transformersJs();
  if (device === "webgpu") {
    const adapter = await globalThis.navigator?.gpu?.requestAdapter();
    if (!adapter) {
      throw new ExportError("WebGPU: this browser gave no adapter (navigator.gpu.requestAdapter() returned " +
        "nothing); choose WASM");
    }
  }
  const id = `folder-${++loads}`;
  const saved = { fetch: t.env.fetch, useFS: t.env.useFS, localModelPath: t.env.localModelPath };
  Object.assign(t.env, { allowRemoteModels: false, allowLocalModels: true, useFS: false, localModelPath: PREFIX });
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
    const model = await t.AutoModelForCausalLM.from_pretrained(id, { ...options, dtype: "fp32", device,
      progress_callback: progress });
    return { tokenizer, model, config, device, bytes, name: folder.name };
  } catch (e) {
    const what = /Unsupported model type/.test(e.message)
      ? `transformers.js ${t.env.version} cannot run model type "${config.model_type}"`
      : `loading "${folder.name}" on ${device} failed`;
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
  await model.generate({ input_ids, attention_mask, max_new_tokens: maxNewTokens, do_sample: false, streamer });
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
