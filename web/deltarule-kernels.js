// deltarule's WebGPU kernel cards from JavaScript: an ES module, no build step, for the browser
// and for Node (with the npm `webgpu` package). docs/web.md is the guide.
//
//   import { loadKernel } from "./deltarule-kernels.js";
//   const kernel = await loadKernel("cards/com.microsoft.GatedDeltaNet", { device });
//   const { outputT, finalStateT } = await kernel({ queryT: { data, shape }, ... });
//
// A card folder holds manifest.json (the contract: bind keys, dtypes, ranks, presence rules,
// attributes), metadata.json (variants, digests), host.js (the card's host program: shapes and
// the dispatch plan) and *.wgsl.jinja templates, rendered here with Nunjucks once per
// specialization and compiled into a cached pipeline. Inputs are checked against the manifest
// before any GPU work; errors are ContractErrors naming the bind key.
//
// Tensors: { data, shape, dtype? } on the host (Float32Array, Int32Array, Float16Array where the
// platform has it, or Uint16Array holding float16 / bfloat16 bits with an explicit dtype), or
// { buffer: GPUBuffer, shape, dtype } on the device. With { resident: true } outputs stay on the
// device as { buffer, shape, dtype }; otherwise they are read back as { data, shape, dtype }
// (16-bit outputs as Uint16Array bits: `toFloat32` widens them).

// The one ContractError class: the loader's checks and the cards' host programs (HOST_LINK) throw it.
export class ContractError extends Error {
  // argument (bind key, attribute or option), what was expected, what was given; `limit` for a
  // size beyond the adapter's or the card's bounds: { name, value } (named in `expected` too)
  constructor(argument, expected, actual, limit) {
    super(`${argument}: expected ${expected}, got ${actual}`);
    this.name = "ContractError";
    Object.assign(this, { argument, expected, actual });
    if (limit) this.limit = limit;
  }
}

// elements of a tensor of this shape (1 for a scalar's [])
export const numel = (shape) => shape.reduce((a, b) => a * b, 1);

// What a card's host program takes from the loader (its common.js `link`, called before every
// plan: the card's modules are shared by whatever imports the same URL), so that its refusals
// are this ContractError too. Cards exported before `link` existed throw a class of their own.
const HOST_LINK = Object.freeze({ ContractError, numel });

// What WebGPU itself refused (a validation, out-of-memory or internal error caught by the call's
// error scopes, a failed pipeline, a failed read-back): every message WebGPU gave, and the
// exception it raised first, if any, as `cause`.
export class WebGPUError extends Error {
  constructor(errors, cause, what) {
    const parts = errors.map((e) => `${e.constructor?.name ?? "GPUError"}: ${String(e.message).trim() || "(no message)"}`);
    if (cause) parts.push(`${cause.name}: ${cause.message || "(no message)"}`);
    super(`WebGPU: ${[what, parts.join("; ")].filter(Boolean).join(": ")}`, cause ? { cause } : undefined);
    this.name = "WebGPUError";
    this.errors = errors;
  }
}

const BYTES = { float32: 4, float16: 2, bfloat16: 2, int32: 4 };
const isNode = typeof process !== "undefined" && !!process.versions?.node;

// ---- reading a card: a URL (fetch) or, in Node, a folder path --------------------------------

async function cardReader(source) {
  const text = String(source);
  if (isNode && !/^(https?|blob|data):/.test(text)) {
    const [{ readFile }, path, url] = await Promise.all([import("node:fs/promises"), import("node:path"),
      import("node:url")]);
    const root = text.startsWith("file:") ? url.fileURLToPath(text) : path.resolve(text);
    return {
      read: (name) => readFile(path.join(root, name), "utf8"),
      moduleUrl: (name) => url.pathToFileURL(path.join(root, name)).href,
    };
  }
  const base = new URL(text.endsWith("/") ? text : text + "/", globalThis.location?.href);
  return {
    read: async (name) => {
      const response = await fetch(new URL(name, base));
      if (!response.ok) throw new Error(`${new URL(name, base)}: HTTP ${response.status}`);
      return response.text();
    },
    moduleUrl: (name) => new URL(name, base).href,
  };
}

async function sha256(text) {
  const digest = await globalThis.crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
  return "sha256:" + Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

async function nunjucksModule(given) {
  if (given) return given;
  if (globalThis.nunjucks) return globalThis.nunjucks;           // the browser build, by <script>
  return (await import("nunjucks")).default;                       // Node, or an import map
}

// ---- the device -------------------------------------------------------------------------------

export async function requestDevice(gpu = globalThis.navigator?.gpu) {
  if (!gpu) throw new Error("WebGPU is not available here (navigator.gpu is undefined)");
  const adapter = await gpu.requestAdapter();
  if (!adapter) throw new Error("WebGPU: no adapter (requestAdapter() returned null)");
  // the storage-buffer count and workgroup memory the shaders can use: as much as the adapter has
  const requiredLimits = {};
  for (const name of ["maxStorageBuffersPerShaderStage", "maxComputeWorkgroupStorageSize",
    "maxStorageBufferBindingSize", "maxBufferSize", "maxComputeWorkgroupsPerDimension"]) {
    requiredLimits[name] = adapter.limits[name];
  }
  return adapter.requestDevice({ requiredLimits });
}

// ---- loading ----------------------------------------------------------------------------------

/**
 * Load a kernel card.
 * @param source  card folder: URL (browser) or path / file URL (Node)
 * @param options { device?: GPUDevice (default: one from navigator.gpu), nunjucks?: the module,
 *                  verify?: check metadata.json's sha256 digests (default true) }
 * @returns async kernel(inputs, { attributes?, outputs?, resident?, poison?, variant? }) -> outputs
 *          (variant: "auto", the host's choice, or a name from metadata.variants, e.g. "recurrent");
 *          kernel.manifest, kernel.metadata, kernel.tests() (test.json), kernel.bench() (bench.json)
 */
export async function loadKernel(source, options = {}) {
  const reader = await cardReader(source);
  const metadata = JSON.parse(await reader.read("metadata.json"));
  const texts = {};
  for (const name of ["manifest.json", metadata.host, ...metadata.modules, ...metadata.templates]) {
    texts[name] = await reader.read(name);
  }
  if (options.verify !== false) {
    for (const [name, text] of Object.entries(texts)) {
      const want = metadata.digests[name];
      const got = await sha256(text);
      if (want !== got) throw new Error(`${metadata.id}: ${name} does not match metadata.json's digest (${want}, got ${got})`);
    }
  }
  const manifest = JSON.parse(texts["manifest.json"]);
  const host = await import(reader.moduleUrl(metadata.host));
  const device = options.device ?? await requestDevice();
  const nunjucks = await nunjucksModule(options.nunjucks);
  const env = new nunjucks.Environment({
    getSource: (name) => ({ src: texts[name], path: name, noCache: false }),
  }, { autoescape: false, throwOnUndefined: true });
  const pipelines = new Map();
  // a lost (or destroyed) device: calls are refused instead of returning invalid buffers
  let lost = null;
  device.lost?.then((info) => { lost = info; });
  const refuseLost = () => {
    if (lost) throw new WebGPUError([], null, `the device is lost (${lost.reason}: ${lost.message || "no message"}); load the card on a new device`);
  };

  // A compiled pipeline per (template, specialization), cached as a promise. Compiled
  // asynchronously, with the shader module's validation messages kept; a failure is not cached.
  function pipeline(template, spec) {
    const key = template + JSON.stringify(spec);
    let entry = pipelines.get(key);
    if (!entry) {
      const code = env.render(template, spec);
      const label = `${metadata.id} ${template}`;
      device.pushErrorScope("validation");
      const module = device.createShaderModule({ code, label });
      const made = device.createComputePipelineAsync({ label, layout: "auto", compute: { module, entryPoint: "main" } })
        .then((p) => [p, null], (e) => [null, e]);
      entry = Promise.all([device.popErrorScope(), made]).then(([error, [p, thrown]]) => {
        if (error || thrown) throw new WebGPUError(error ? [error] : [], thrown, `compiling ${template}`);
        return p;
      });
      pipelines.set(key, entry);
      entry.catch(() => { if (pipelines.get(key) === entry) pipelines.delete(key); });
    }
    return entry;
  }

  const variants = ["auto", ...metadata.variants.map((v) => v.name)];
  async function kernel(inputs, options = {}) {
    refuseLost();
    if (options === null || typeof options !== "object") throw new ContractError("options", "an object", String(options));
    const { attributes = {}, outputs, resident = false, poison = false, variant = "auto" } = options;
    for (const name of Object.keys(options)) {
      if (!["attributes", "outputs", "resident", "poison", "variant"].includes(name)) {
        throw new ContractError(name, "an option of kernel() (attributes, outputs, resident, poison, variant)", "unknown");
      }
    }
    if (!variants.includes(variant)) throw new ContractError("variant", `one of ${variants.join(", ")}`, variant);
    if (inputs === null || typeof inputs !== "object" || Array.isArray(inputs)) {
      throw new ContractError("inputs", "an object of bind keys", Array.isArray(inputs) ? "an array" : String(inputs));
    }
    if (attributes === null || typeof attributes !== "object" || Array.isArray(attributes)) {
      throw new ContractError("attributes", "an object of attribute values", String(attributes));
    }
    if (outputs !== undefined && (!Array.isArray(outputs) || !outputs.every((o) => typeof o === "string"))) {
      throw new ContractError("outputs", "an array of output bind keys", JSON.stringify(outputs));
    }
    const call = validate(manifest, inputs, attributes, outputs);
    host.link?.(HOST_LINK);
    const plan = host.plan({ ...call, variant, limits: device.limits });
    checkPlan(call, plan, device.limits, !!resident);
    const pipes = await Promise.all([...plan.passes, ...plan.finish].map((pass) => pipeline(pass.template, pass.spec)));
    refuseLost();
    const result = await execute(device, pipes, call, plan, { resident: !!resident, poison: !!poison });
    refuseLost();
    return result;
  }
  kernel.manifest = manifest;
  kernel.metadata = metadata;
  kernel.device = device;
  kernel.render = (template, spec) => env.render(template, spec);
  kernel.tests = async () => JSON.parse(await reader.read("test.json")).cases;
  kernel.bench = async () => JSON.parse(await reader.read("bench.json")).cases;
  return kernel;
}

// ---- validation against manifest.json ---------------------------------------------------------

function dtypeOf(bind, t) {
  const d = t.data;
  if (t.dtype) {
    const ok = { float32: [Float32Array], int32: [Int32Array], float16: [Uint16Array, globalThis.Float16Array],
      bfloat16: [Uint16Array] }[t.dtype];
    if (!ok) throw new ContractError(bind, "dtype float32, float16, bfloat16 or int32", t.dtype);
    if (d !== undefined && !ok.some((C) => C && d instanceof C)) {
      throw new ContractError(bind, `data for dtype ${t.dtype} (${ok.filter(Boolean).map((C) => C.name).join(" or ")})`,
        d?.constructor?.name);
    }
    return t.dtype;
  }
  if (d instanceof Float32Array) return "float32";
  if (d instanceof Int32Array) return "int32";
  if (globalThis.Float16Array && d instanceof globalThis.Float16Array) return "float16";
  if (d instanceof Uint16Array) throw new ContractError(bind, "a dtype (float16 or bfloat16) with Uint16Array data", "none");
  throw new ContractError(bind, "Float32Array, Int32Array, Float16Array or Uint16Array data (or a GPUBuffer with " +
    "shape and dtype)", d?.constructor?.name ?? typeof d);
}

// float values of a host tensor (16-bit patterns widened), for host programs that read values
function values(t) {
  if (t.dtype === "float16" && t.data instanceof Uint16Array) return halfBitsToFloat32(t.data);
  if (t.dtype === "bfloat16") return bf16BitsToFloat32(t.data);
  return t.data;
}

function validate(manifest, inputs, attributes, requestedOutputs) {
  const specs = new Map(manifest.inputs.map((x) => [x.bind, x]));
  for (const bind of Object.keys(inputs)) {
    if (!specs.has(bind)) throw new ContractError(bind, `a bind key of ${manifest.id} (${[...specs.keys()].join(", ")})`, "unknown");
  }
  // attributes: known, typed, in range; defaults filled
  const attrs = {};
  const attrSpecs = new Map(manifest.attributes.map((a) => [a.name, a]));
  for (const name of Object.keys(attributes)) {
    if (!attrSpecs.has(name)) throw new ContractError(name, `an attribute of ${manifest.id} (${[...attrSpecs.keys()].join(", ") || "none"})`, "unknown");
  }
  for (const a of manifest.attributes) {
    const value = attributes[a.name] ?? a.default;
    const typeOk = a.type === "string" ? typeof value === "string"
      : a.type === "int" ? Number.isInteger(value) : typeof value === "number";
    if (!typeOk) throw new ContractError(a.name, a.type === "int" ? "an int" : `a ${a.type}`, JSON.stringify(value));
    if (a.values && !a.values.includes(value)) throw new ContractError(a.name, `one of ${JSON.stringify(a.values)}`, JSON.stringify(value));
    attrs[a.name] = value;
  }
  // inputs: presence, dtype per type variable (shared within a variable), rank, data length
  const call = {};
  const typeVars = {};
  for (const spec of manifest.inputs) {
    const t = inputs[spec.bind];
    const present = t !== undefined && t !== null;
    const p = spec.presence;
    if (p === "required" && !present) throw new ContractError(spec.bind, "an input (required)", "absent");
    if (p.exactly_when) {
      const [attr, allowed] = Object.entries(p.exactly_when)[0];
      const want = allowed.includes(attrs[attr]);
      if (want && !present) throw new ContractError(spec.bind, `an input for ${attr} ${JSON.stringify(attrs[attr])}`, "absent");
      if (!want && present) throw new ContractError(spec.bind, `absent for ${attr} ${JSON.stringify(attrs[attr])}`, "an input");
    }
    if (!present) continue;
    if (p.with) {
      for (const other of p.with) {
        if (inputs[other] === undefined || inputs[other] === null) throw new ContractError(spec.bind, `given together with ${other}`, `${other} absent`);
      }
    }
    if (p.requires_rank) {
      const [other, rank] = Object.entries(p.requires_rank)[0];
      if (inputs[other]?.shape?.length !== rank) throw new ContractError(spec.bind, `absent unless ${other} has rank ${rank}`, `${other} of rank ${inputs[other]?.shape?.length}`);
    }
    if (typeof t !== "object" || !Array.isArray(t.shape) || !t.shape.every((n) => Number.isInteger(n) && n >= 0)) {
      throw new ContractError(spec.bind, "{ data, shape } or { buffer, shape, dtype } with a shape of integers >= 0", JSON.stringify(t?.shape));
    }
    const onDevice = t.buffer !== undefined;
    if (onDevice && t.data !== undefined) throw new ContractError(spec.bind, "either data (host) or buffer (device)", "both");
    if (onDevice && !(t.buffer && typeof t.buffer.size === "number" && typeof t.buffer.usage === "number" &&
      typeof t.buffer.destroy === "function")) {
      throw new ContractError(spec.bind, "buffer: a GPUBuffer", t.buffer?.constructor?.name ?? String(t.buffer));
    }
    if (onDevice && spec.host) throw new ContractError(spec.bind, "a typed array on the host (its values shape the dispatch)", "a GPUBuffer");
    if (onDevice && !t.dtype) throw new ContractError(spec.bind, "a dtype with a GPUBuffer", "none");
    const dtype = onDevice ? t.dtype : dtypeOf(spec.bind, t);
    const allowed = manifest.type_constraints[spec.type];
    if (!allowed.includes(dtype)) throw new ContractError(spec.bind, `dtype ${allowed.join(" or ")} (type ${spec.type})`, dtype);
    if (typeVars[spec.type] && typeVars[spec.type][1] !== dtype) {
      throw new ContractError(spec.bind, `${typeVars[spec.type][0]}'s dtype ${typeVars[spec.type][1]} (type ${spec.type})`, dtype);
    }
    typeVars[spec.type] ??= [spec.bind, dtype];
    if (Array.isArray(spec.rank) && !spec.rank.includes(t.shape.length)) {
      throw new ContractError(spec.bind, `rank ${spec.rank.join(" or ")}`, `shape [${t.shape.join(", ")}]`);
    }
    const n = numel(t.shape);
    if (onDevice) {
      // bound as padded(n * bytes) from offset 0: 16-bit tensors are read as whole u32 words
      const need = padded(n * BYTES[dtype]);
      if (t.buffer.size < need) throw new ContractError(spec.bind, `a GPUBuffer of at least ${need} bytes (shape [${t.shape.join(", ")}] ${dtype})`, `${t.buffer.size} bytes`);
      if (t.buffer.mapState !== undefined && t.buffer.mapState !== "unmapped") {
        throw new ContractError(spec.bind, "an unmapped GPUBuffer", `mapState ${t.buffer.mapState}`);
      }
    } else if (t.data.length !== n) {
      throw new ContractError(spec.bind, `${n} elements (shape [${t.shape.join(", ")}])`, `${t.data.length}`);
    }
    const tensor = { ...t, dtype, shape: [...t.shape] };
    if (!onDevice) tensor.values = () => values(tensor);
    call[spec.bind] = tensor;
  }
  // outputs: the required ones, plus optional ones whose companions are present (or as asked)
  const optionalOk = (o) => !o.presence.with || o.presence.with.every((b) => call[b]);
  let requested = manifest.outputs.filter((o) => o.presence === "required" || optionalOk(o)).map((o) => o.bind);
  if (requestedOutputs) {
    const known = new Map(manifest.outputs.map((o) => [o.bind, o]));
    for (const bind of requestedOutputs) {
      const o = known.get(bind);
      if (!o) throw new ContractError("outputs", `bind keys among ${[...known.keys()].join(", ")}`, bind);
      if (!optionalOk(o)) throw new ContractError(bind, `requested only with ${o.presence.with.join(", ")}`, "absent inputs");
    }
    for (const o of manifest.outputs) {
      if (o.presence === "required" && !requestedOutputs.includes(o.bind)) throw new ContractError("outputs", `${o.bind} (required)`, JSON.stringify(requestedOutputs));
    }
    requested = [...requestedOutputs];
  }
  return { inputs: call, attributes: attrs, requested };
}

// ---- executing a host program's plan ----------------------------------------------------------

const STORAGE = () => GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
const padded = (bytes) => Math.max(4, Math.ceil(bytes / 4) * 4);
const uniformBytes = (bytes) => Math.max(16, Math.ceil(bytes / 16) * 16);
const U32_ELEMENTS = 2 ** 32 - 1;              // the shaders index elements with u32

function upload(device, data, usage = STORAGE()) {
  const bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  const size = usage & GPUBufferUsage.UNIFORM ? uniformBytes(bytes.length) : padded(bytes.length);
  const buffer = device.createBuffer({ size, usage, mappedAtCreation: true });
  new Uint8Array(buffer.getMappedRange()).set(bytes);
  buffer.unmap();
  return buffer;
}

// The plan against the device's limits, before any GPU work: every buffer the call creates or
// binds (maxBufferSize, maxStorageBufferBindingSize, maxUniformBufferBindingSize, u32 element
// indices), every pass's grid (maxComputeWorkgroupsPerDimension) and workgroup
// (maxComputeInvocationsPerWorkgroup, maxComputeWorkgroupSizeX, maxComputeWorkgroupStorageSize),
// the usages of the caller's buffers, and that a buffer written in place is bound once. The host
// programs refuse the sizes they know the reason for first (naming the argument that sets them);
// this is the loader's own check of whatever a plan asks for.
function checkPlan(call, plan, limits, resident) {
  const all = [...plan.passes, ...plan.finish];
  const bound = new Set(), copied = new Set();
  for (const pass of all) for (const ref of Object.values(pass.bindings)) if (ref.input) bound.add(ref.input);
  for (const o of Object.values(plan.outputs)) {
    if (o.copy) copied.add(o.copy);
    if (o.alias) bound.add(o.alias);
    if (o.alias && !resident) copied.add(o.alias);
  }
  const limit = (name) => ({ name, value: limits[name] });
  const bytes = (argument, what, size, { storage = true, elements = 0 } = {}) => {
    if (elements > U32_ELEMENTS) {
      throw new ContractError(argument, `at most 2^32 - 1 elements (the shaders index with u32)`, `${what}: ${elements} elements`,
        { name: "u32 indices", value: U32_ELEMENTS });
    }
    const caps = [["maxBufferSize", limits.maxBufferSize]];
    if (storage) caps.push(["maxStorageBufferBindingSize", limits.maxStorageBufferBindingSize]);
    for (const [name, cap] of caps) {
      if (size > cap) throw new ContractError(argument, `at most ${cap} bytes (the adapter's ${name})`, `${what}: ${size} bytes`, limit(name));
    }
  };
  for (const [bind, t] of Object.entries(call.inputs)) {
    if (!bound.has(bind) && !copied.has(bind)) continue;
    const n = numel(t.shape);
    const what = `shape [${t.shape.join(", ")}] ${t.dtype}`;
    bytes(bind, what, t.buffer ? padded(n * BYTES[t.dtype]) : padded(t.data.byteLength), { storage: bound.has(bind), elements: n });
    if (t.buffer) {
      const need = (bound.has(bind) ? GPUBufferUsage.STORAGE : 0) | (copied.has(bind) ? GPUBufferUsage.COPY_SRC : 0);
      if ((t.buffer.usage & need) !== need) {
        const names = (u) => ["MAP_READ", "MAP_WRITE", "COPY_SRC", "COPY_DST", "INDEX", "VERTEX", "UNIFORM", "STORAGE", "INDIRECT", "QUERY_RESOLVE"].filter((x) => u & GPUBufferUsage[x]).join(" | ") || "none";
        throw new ContractError(bind, `a GPUBuffer with usage ${names(need)}`, `usage ${t.buffer.usage} (${names(t.buffer.usage)})`);
      }
    }
  }
  // a buffer written in place (an output aliasing an input) is no other input's buffer
  for (const [bind, o] of Object.entries(plan.outputs)) {
    const mine = o.alias && call.inputs[o.alias].buffer;
    if (!mine) continue;
    for (const [other, t] of Object.entries(call.inputs)) {
      if (other !== o.alias && t.buffer === mine) {
        throw new ContractError(o.alias, `a GPUBuffer apart from every other input's (${bind} is written into it in place)`,
          `the same GPUBuffer as ${other}`);
      }
    }
  }
  for (const [bind, o] of Object.entries(plan.outputs)) {
    if (o.alias) continue;
    const n = numel(o.shape);
    bytes(bind, `the output of shape [${o.shape.join(", ")}] ${o.dtype} these inputs give`, padded(n * BYTES[o.dtype]), { elements: n });
  }
  for (const [name, b] of Object.entries(plan.buffers)) bytes("inputs", `the scratch buffer ${name} these sizes need`, padded(b.bytes));
  const wg = limits.maxComputeWorkgroupsPerDimension;
  for (const pass of all) {
    for (const ref of Object.values(pass.bindings)) {
      if (ref.storage) bytes("inputs", `the table of ${pass.template} these sizes need`, padded(ref.storage.byteLength));
      if (ref.uniform && uniformBytes(ref.uniform.byteLength) > limits.maxUniformBufferBindingSize) {
        throw new ContractError("inputs", `uniforms of at most ${limits.maxUniformBufferBindingSize} bytes (the adapter's ` +
          "maxUniformBufferBindingSize)", `${ref.uniform.byteLength} bytes for ${pass.template}`, limit("maxUniformBufferBindingSize"));
      }
    }
    if (pass.grid.length !== 3 || !pass.grid.every((x) => Number.isInteger(x) && x >= 0)) {
      throw new Error(`${pass.template}: a plan with a grid that is not 3 integers >= 0: ${JSON.stringify(pass.grid)} (a card bug)`);
    }
    if (pass.grid.some((x) => x > wg)) {
      throw new ContractError("inputs", `at most ${wg} workgroups per grid dimension (the adapter's ` +
        "maxComputeWorkgroupsPerDimension)", `grid [${pass.grid.join(", ")}] for ${pass.template}`, limit("maxComputeWorkgroupsPerDimension"));
    }
    const w = pass.workgroup;
    if (!w) continue;
    for (const [name, value] of [["maxComputeInvocationsPerWorkgroup", w.invocations], ["maxComputeWorkgroupSizeX", w.invocations],
      ["maxComputeWorkgroupStorageSize", w.bytes]]) {
      if (limits[name] !== undefined && value > limits[name]) {
        throw new ContractError("inputs", `at most ${limits[name]} (the adapter's ${name})`, `${value} for ${pass.template}`, limit(name));
      }
    }
  }
}

// WebGPU reports validation and allocation failures asynchronously: the call creates and
// encodes everything inside error scopes with no await in between (so calls made concurrently
// never pop each other's scopes), and raises a WebGPUError with every message they caught. A
// failed call returns nothing and destroys what it created.
//
// Buffers: with resident: false every buffer the call creates is destroyed before it returns.
// With resident: true the output buffers belong to the caller (destroy them when done), all but
// one that IS the caller's own input buffer (a slab given as a GPUBuffer, updated in place);
// a slab given as host data comes back as a new buffer the caller owns, to pass to later calls.
async function execute(device, pipes, call, plan, { resident, poison }) {
  const made = [];                       // every buffer this call creates
  let job, thrown;
  device.pushErrorScope("internal");
  device.pushErrorScope("out-of-memory");
  device.pushErrorScope("validation");
  try {
    job = encode(device, pipes, call, plan, made, { resident, poison });
  } catch (e) {
    thrown = e;
  }
  const scopes = Promise.all([device.popErrorScope(), device.popErrorScope(), device.popErrorScope()]);
  const done = job && resident ? device.queue.onSubmittedWorkDone() : null;
  let errors;
  try {
    const [validation, memory, internal] = await scopes;
    errors = [memory, internal, validation].filter(Boolean);        // the root cause first
  } catch (e) {                          // a lost device may reject the pops
    errors = [];
    thrown ??= e;
  }
  if (thrown || errors.length) {
    for (const b of made) b.destroy();
    if (!errors.length && thrown) throw thrown;
    throw new WebGPUError(errors, thrown);
  }
  const result = {};
  try {
    if (resident) {
      await done;
      for (const [bind, o] of Object.entries(plan.outputs)) result[bind] = { buffer: job.outputs[bind], shape: o.shape, dtype: o.dtype };
    } else {
      for (const [bind, o, staging, bytes] of job.reads) {
        try {
          await staging.mapAsync(GPUMapMode.READ);
        } catch (e) {
          throw new WebGPUError([], e, `reading ${bind} back`);
        }
        const raw = staging.getMappedRange().slice(0, bytes);
        staging.unmap();
        const Type = o.dtype === "float32" ? Float32Array : o.dtype === "int32" ? Int32Array : Uint16Array;
        result[bind] = { data: new Type(raw), shape: o.shape, dtype: o.dtype };
      }
    }
  } catch (e) {
    for (const b of made) b.destroy();
    throw e;
  }
  const kept = new Set(resident ? Object.values(job.outputs) : []);
  for (const b of made) if (!kept.has(b)) b.destroy();
  return result;
}

// Creates the call's buffers, encodes its passes and submits them (no await: see execute).
function encode(device, pipes, call, plan, made, { resident, poison }) {
  const own = (b) => { made.push(b); return b; };
  // the inputs a pass binds or an output starts from go to the device (host-only ones stay)
  const used = new Set(Object.values(plan.outputs).flatMap((o) => [o.copy, o.alias]));
  for (const pass of plan.passes) for (const ref of Object.values(pass.bindings)) used.add(ref.input);
  const inputs = {};
  for (const [bind, t] of Object.entries(call.inputs)) {
    if (used.has(bind)) inputs[bind] = t.buffer ?? own(upload(device, t.data));
  }
  const size = (bind) => padded(numel(call.inputs[bind].shape) * BYTES[call.inputs[bind].dtype]);
  const poisonFill = (buffer) => device.queue.writeBuffer(buffer, 0, new Float32Array(buffer.size / 4).fill(NaN));
  const outputs = {}, sizes = {};
  for (const [bind, o] of Object.entries(plan.outputs)) {
    sizes[bind] = padded(numel(o.shape) * BYTES[o.dtype]);
    if (o.alias) { outputs[bind] = inputs[o.alias]; continue; }
    outputs[bind] = own(device.createBuffer({ size: sizes[bind], usage: STORAGE() }));
    if (poison && !o.zero && !o.copy) poisonFill(outputs[bind]);     // (a zero state is read)
  }
  const scratch = {};
  for (const [name, b] of Object.entries(plan.buffers)) {
    scratch[name] = own(device.createBuffer({ size: padded(b.bytes), usage: STORAGE() }));
    if (poison) poisonFill(scratch[name]);
  }
  // a binding covers the tensor, not the whole of a larger caller's buffer
  const resolve = (ref) => {
    if (ref.input) return { buffer: inputs[ref.input], size: size(ref.input) };
    if (ref.output) return { buffer: outputs[ref.output], size: sizes[ref.output] };
    if (ref.buffer) return { buffer: scratch[ref.buffer] };
    if (ref.uniform) return { buffer: own(upload(device, new Uint8Array(ref.uniform), GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST)) };
    if (ref.storage) return { buffer: own(upload(device, ref.storage)) };
    throw new Error(`a binding the loader does not know: ${JSON.stringify(ref)}`);
  };
  const encoder = device.createCommandEncoder();
  for (const [bind, o] of Object.entries(plan.outputs)) {
    if (o.copy) encoder.copyBufferToBuffer(inputs[o.copy], 0, outputs[bind], 0, numel(o.shape) * BYTES[o.dtype]);
  }
  [...plan.passes, ...plan.finish].forEach((pass, i) => {
    const pipe = pipes[i];
    const entries = Object.entries(pass.bindings).map(([slot, ref]) => ({ binding: Number(slot), resource: resolve(ref) }));
    const group = device.createBindGroup({ layout: pipe.getBindGroupLayout(0), entries });
    const compute = encoder.beginComputePass();
    compute.setPipeline(pipe);
    compute.setBindGroup(0, group);
    compute.dispatchWorkgroups(...pass.grid);
    compute.end();
  });
  const reads = [];
  if (!resident) {
    for (const [bind, o] of Object.entries(plan.outputs)) {
      const bytes = numel(o.shape) * BYTES[o.dtype];
      const staging = own(device.createBuffer({ size: padded(bytes), usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST }));
      encoder.copyBufferToBuffer(outputs[bind], 0, staging, 0, padded(bytes));
      reads.push([bind, o, staging, bytes]);
    }
  }
  device.queue.submit([encoder.finish()]);
  return { outputs, reads };
}

// ---- 16-bit helpers ---------------------------------------------------------------------------

export function halfBitsToFloat32(bits) {
  const out = new Float32Array(bits.length);
  for (let i = 0; i < bits.length; i++) {
    const h = bits[i], s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    out[i] = e === 0 ? s * m * 2 ** -24 : e === 31 ? (m ? NaN : s * Infinity) : s * (1 + m / 1024) * 2 ** (e - 15);
  }
  return out;
}

export function bf16BitsToFloat32(bits) {
  const words = new Uint32Array(bits.length);
  for (let i = 0; i < bits.length; i++) words[i] = bits[i] << 16;
  return new Float32Array(words.buffer);
}

export function float32ToHalfBits(values) {
  const f = new Float32Array(1), u = new Uint32Array(f.buffer);
  const out = new Uint16Array(values.length);
  for (let i = 0; i < values.length; i++) {
    f[0] = values[i];
    const x = u[0], sign = (x >>> 16) & 0x8000, exp = (x >>> 23) & 0xff, mant = x & 0x7fffff;
    if (exp === 255) { out[i] = sign | 0x7c00 | (mant ? 0x200 : 0); continue; }
    let e = exp - 127 + 15;
    if (e >= 31) { out[i] = sign | 0x7c00; continue; }
    if (e <= 0) {                                   // subnormal: round to nearest even
      if (e < -10) { out[i] = sign; continue; }
      const m = mant | 0x800000, shift = 14 - e;
      let h = m >>> shift;
      const rest = m & ((1 << shift) - 1), half = 1 << (shift - 1);
      if (rest > half || (rest === half && (h & 1))) h += 1;
      out[i] = sign | h;
      continue;
    }
    let h = (e << 10) | (mant >>> 13);
    const rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest === 0x1000 && (h & 1))) h += 1;
    out[i] = sign | h;
  }
  return out;
}

// an output (or input) tensor's values as float32, whatever its dtype
export function toFloat32(t) {
  if (t.dtype === "float16" && t.data instanceof Uint16Array) return halfBitsToFloat32(t.data);
  if (t.dtype === "bfloat16") return bf16BitsToFloat32(t.data);
  return Float32Array.from(t.data);
}

// ---- test.json ----------------------------------------------------------------------------------

function base64Bytes(text) {
  if (typeof atob === "function") return Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
  return new Uint8Array(Buffer.from(text, "base64"));
}

// a test.json tensor as a host tensor
export function decodeTensor(t) {
  const raw = base64Bytes(t.data);
  const Type = t.dtype === "float32" ? Float32Array : t.dtype === "int32" ? Int32Array : Uint16Array;
  const data = new Type(raw.buffer, raw.byteOffset, raw.byteLength / BYTES[t.dtype]);
  return { data: new Type(data), shape: t.shape, dtype: t.dtype };
}

// ||out - expected|| / ||expected|| in float64 (NaN or a missing value fails)
export function relativeError(out, expected) {
  const a = toFloat32(out), b = toFloat32(expected);
  if (a.length !== b.length) return Infinity;
  let num = 0, den = 0;
  for (let i = 0; i < a.length; i++) {
    if (!Number.isFinite(a[i]) && !(a[i] === b[i])) return Infinity;
    num += (a[i] - b[i]) ** 2;
    den += b[i] ** 2;
  }
  return den > 0 ? Math.sqrt(num / den) : num === 0 ? 0 : Infinity;
}

// Run one test.json case: { name, ok, errors: { bind: relative error }, tolerance }
export async function runCase(kernel, testCase, { poison = true, variant = "auto" } = {}) {
  const inputs = Object.fromEntries(Object.entries(testCase.inputs).map(([b, t]) => [b, decodeTensor(t)]));
  const out = await kernel(inputs, { attributes: testCase.attributes, outputs: testCase.outputs,
    poison: poison && testCase.poison, variant });
  const errors = {};
  let ok = true;
  for (const [bind, t] of Object.entries(testCase.expected)) {
    const expected = decodeTensor(t);
    const got = out[bind];
    const shapeOk = got && got.shape.length === expected.shape.length && got.shape.every((n, i) => n === expected.shape[i]);
    errors[bind] = shapeOk && got.dtype === expected.dtype ? relativeError(got, expected) : Infinity;
    ok = ok && errors[bind] <= testCase.tolerance[bind];
  }
  return { name: testCase.name, ok, errors, tolerance: testCase.tolerance };
}
