// deltarule's kernel cards against onnxruntime-web's own WebGPU kernels, same inputs, same page,
// same GPUDevice (docs/web.md, "The cards against onnxruntime-web's own kernels"). Used by
// ort-kernels.html; reads what benchmarks/ort_web_kernels.py wrote into ort-kernels/:
//
//   .venv/bin/python benchmarks/ort_web_kernels.py --out web/ort-kernels
//
// Per case (prefill from a non-zero state, decode with the state fed back) and contract:
// - com.microsoft.GatedDeltaNet: the card cards/com.microsoft.GatedDeltaNet, and one-node ONNX
//   models run by onnxruntime-web 1.31.1 (ort.webgpu.bundle: the native WebGPU execution
//   provider's GatedDeltaNet kernel; (1, S, H, D) inputs, a V-major initial_state), one per
//   chunk_size attribute the generator wrote (16: the kernel's opt-in to a chunkwise prefill on
//   adapters it supports; 64, the default: its recurrent route);
// - com.microsoft.LinearAttention: the card cards/deltarule.LinearAttention fed the same numbers
//   (packed [B, T, H*D] is the same memory as [B, T, H, D]; past_state [B, H, K, V] is the card's
//   "kv" layout; scale 0 -> 1/sqrt(K) in both), and the one-node model in onnxruntime-web.
// Every output and final state is checked against deltarule's float64 reference with the cards'
// own measure (relativeError of deltarule-kernels.js) and the float32 tolerance of the cards.
// Which programs each onnxruntime-web session built (its route) is read from the WGSL its program
// manager logs when it builds one (verbose log), during that session's untimed warm-up calls.
//
// Timing: onnxruntime-web creates the GPUDevice (its own feature and limit choices) and the cards
// are loaded on that same device, so both read the same GPUBuffers: the cards as { buffer } inputs
// with { resident: true }, onnxruntime-web through ort.Tensor.fromGpuBuffer with
// preferredOutputLocation "gpu-buffer". Each call is timed to the end of its GPU work
// (queue.onSubmittedWorkDone, as web/bench.js). One untimed warm-up call each, then `repeat` rounds
// in which every implementation of the case makes one call (decode: one loop of `steps` T = 1
// calls, ms per step, state on the device), the order rotated from round to round (a shared, noisy
// machine: its slow spells fall on all of them). A row's time is the median of its rounds; a
// card's speed over an onnxruntime-web implementation is the median of the per-round ratios
// (onnxruntime-web's time over the card's in the same round), with their min and max.

import * as ort from "./node_modules/onnxruntime-web/dist/ort.webgpu.bundle.min.mjs";
import { loadKernel, numel, relativeError } from "./deltarule-kernels.js";

const GDN = "com.microsoft.GatedDeltaNet", LA = "com.microsoft.LinearAttention";
export const GENERATOR = ".venv/bin/python benchmarks/ort_web_kernels.py --out web/ort-kernels";

// ---- onnxruntime-web: sessions, their log lines (node placement) --------------------------------

// What onnxruntime's wasm logger writes to the console, collected while `sink` is set. Emscripten
// binds console.log / console.error when the wasm module starts, so the hooks go in before the
// first session and stay (outside a capture they pass everything through).
let sink = null;
function hookConsole() {
  if (console.__ortKernelsHooked) return;
  for (const name of ["log", "info", "warn", "error", "debug"]) {
    const original = console[name].bind(console);
    console[name] = (...args) => (sink ? sink.push(args.map(String).join(" ")) : original(...args));
  }
  console.__ortKernelsHooked = true;
}

async function capturingLogs(fn) {
  const lines = [];
  sink = lines;
  try {
    return { value: await fn(), lines };
  } catch (error) {
    return { error, lines };
  } finally {
    sink = null;
  }
}

// The WGSL onnxruntime's program manager logs (verbose) when it builds a program, by cache key;
// returns the keys found in `lines`.
const ortShaders = new Map();
function keepShaders(lines) {
  let key = null, code = [];
  const keys = [];
  for (const line of lines.join("\n").split("\n")) {
    const start = line.match(/=== WebGPU Shader code \[(.*)\] Start ===/);
    if (start) { key = start[1]; code = []; continue; }
    if (key && /=== WebGPU Shader code .*End ===/.test(line)) {
      ortShaders.set(key, code.join("\n").trim());
      keys.push(key);
      key = null;
      continue;
    }
    if (key) code.push(line);
  }
  return keys;
}

// The program name of a cache key ("GatedDeltaNetChunkScan[...]..." -> "GatedDeltaNetChunkScan").
export const programName = (key) => key.match(/^[A-Za-z0-9_]+/)?.[0] ?? key;

// onnxruntime-web 1.31.1's GatedDeltaNet routes, by the programs they build (its
// contrib_ops/webgpu/bert/gated_delta_net.cc): the token-serial GatedDeltaNet program (with
// GatedDeltaNetParams / Copy / UnpackQkv helpers), or a chunked prefill (GatedDeltaNetChunkPrepare
// and GatedDeltaNetChunkScan, the chunkwise route chunk_size 16 opts into; GatedDeltaNetPrefill*,
// the linear rule's parallel prefill).
export function routeOf(programs) {
  const names = new Set(programs.map(programName));
  if ([...names].some((n) => /^GatedDeltaNet(Chunk|Prefill)/.test(n))) return "chunked";
  if (names.has("GatedDeltaNet")) return "recurrent";
  return null;
}

// An untimed onnxruntime-web call (the warm-up, where it builds its programs): its log kept apart;
// the cache keys of the programs it built are pushed onto `built`.
async function untimed(fn, built) {
  const { value, error, lines } = await capturingLogs(fn);
  built.push(...keepShaders(lines));
  if (error) throw error;
  return value;
}

// The session-creation lines that say where each node went (verbose session log).
function placementLines(lines) {
  return lines.filter((l) => /Node placements|placed on|kernel not found in registries|Could not find an implementation|Provider type for/.test(l))
    .map((l) => l.replace(/^.*?\] /, "").trim());
}

function placementOf(lines) {
  const all = lines.find((l) => /All nodes placed on/.test(l));
  if (all) return all.match(/\[(\w+)\]/)?.[1] ?? all;
  const some = lines.filter((l) => /placed on/.test(l));
  return some.length ? some.join("; ") : null;
}

// One session with verbose session logs, kept open while the timed session runs (closing the last
// session of a device lets onnxruntime destroy the device).
async function probe(url, executionProviders) {
  const { value, error, lines } = await capturingLogs(() => ort.InferenceSession.create(url,
    { executionProviders, logSeverityLevel: 0, logVerbosityLevel: 0 }));
  const kept = placementLines(lines);
  return { session: value ?? null, error: error ? String(error.message ?? error).trim() : null, lines: kept,
    placement: value ? placementOf(kept) : null };
}

// ---- data ---------------------------------------------------------------------------------------

async function fetchOk(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response;
}

async function readIndex(base) {
  const url = new URL("index.json", base);
  const response = await fetch(url);
  if (!response.ok) {
    throw new Error(`ort-kernels/ is missing (${url}: HTTP ${response.status}): run \`${GENERATOR}\` from the repository root`);
  }
  return response.json();
}

async function readTensor(base, t) {
  const data = new Float32Array(await (await fetchOk(new URL(t.file, base))).arrayBuffer());
  const n = t.shape.reduce((a, b) => a * b, 1);
  if (data.length !== n) throw new Error(`${t.file}: ${data.length} float32s, shape [${t.shape}] needs ${n}`);
  return { data, shape: t.shape, dtype: "float32" };
}

const USAGE = () => GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;

function upload(device, data, made) {
  const buffer = device.createBuffer({ size: Math.max(16, Math.ceil(data.byteLength / 16) * 16), usage: USAGE() });
  device.queue.writeBuffer(buffer, 0, data);
  made.push(buffer);
  return buffer;
}

async function readBuffer(device, buffer, count) {
  const staging = device.createBuffer({ size: count * 4, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  const encoder = device.createCommandEncoder();
  encoder.copyBufferToBuffer(buffer, 0, staging, 0, count * 4);
  device.queue.submit([encoder.finish()]);
  await staging.mapAsync(GPUMapMode.READ);
  const data = new Float32Array(staging.getMappedRange().slice(0));
  staging.unmap();
  staging.destroy();
  return data;
}

function copyInto(device, from, to, bytes) {
  const encoder = device.createCommandEncoder();
  encoder.copyBufferToBuffer(from, 0, to, 0, bytes);
  device.queue.submit([encoder.finish()]);
}

export function median(xs) {
  const s = [...xs].sort((a, b) => a - b), m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}
const f32 = (data) => ({ data, dtype: "float32" });

// ---- one case -----------------------------------------------------------------------------------

// Device-resident inputs of a case: the whole sequence (prefill) or one buffer set per step
// (decode: a binding starts at offset 0, so each step gets its own buffers). Shared by the cards
// and onnxruntime-web.
function deviceInputs(device, host, steps, made) {
  const [, T, H, K] = host.q.shape, V = host.v.shape[3];
  const slice = (t, n, width) => t.data.subarray(n * width, (n + 1) * width);
  const sets = [];
  for (let n = 0; n < steps; n++) {
    const len = steps === 1 ? T : 1;
    const pick = (t, width) => (steps === 1 ? t.data : slice(t, n, width));
    sets.push({
      T: len,
      q: upload(device, pick(host.q, H * K), made), k: upload(device, pick(host.k, H * K), made),
      v: upload(device, pick(host.v, H * V), made), g: upload(device, pick(host.g, H), made),
      beta: upload(device, pick(host.beta, H), made),
    });
  }
  return { sets, H, K, V, s0kv: upload(device, host.s0_kv.data, made), s0vk: upload(device, host.s0_vk.data, made) };
}

function cardInputs(contract, set, H, K, V, state) {
  const t = (buffer, shape) => ({ buffer, shape, dtype: "float32" });
  if (contract === GDN) {
    return { queryT: t(set.q, [1, set.T, H, K]), keyT: t(set.k, [1, set.T, H, K]), valueT: t(set.v, [1, set.T, H, V]),
      decayT: t(set.g, [1, set.T, H]), betaT: t(set.beta, [1, set.T, H]), initialStateT: t(state, [1, H, V, K]) };
  }
  return { qT: t(set.q, [1, set.T, H, K]), kT: t(set.k, [1, set.T, H, K]), vT: t(set.v, [1, set.T, H, V]),
    gT: t(set.g, [1, set.T, H]), betaT: t(set.beta, [1, set.T, H]), initialStateT: t(state, [1, H, K, V]) };
}

// The one-node models' state names and layouts: LinearAttention packed [B, T, H*D] inputs and a
// K-major past_state [B, H, K, V]; GatedDeltaNet [B, T, H, D] inputs and a V-major initial_state
// [B, H, V, K]
const ORT_IO = {
  [LA]: { past: "past_state", present: "present_state", s0: "s0kv", state: (H, K, V) => [1, H, K, V],
    x: (T, H, D) => [1, T, H * D] },
  [GDN]: { past: "initial_state", present: "final_state", s0: "s0vk", state: (H, K, V) => [1, H, V, K],
    x: (T, H, D) => [1, T, H, D] },
};

function ortFeeds(contract, set, H, K, V, state) {
  const io = ORT_IO[contract];
  const t = (buffer, dims) => ort.Tensor.fromGpuBuffer(buffer, { dataType: "float32", dims });
  const feeds = { query: t(set.q, io.x(set.T, H, K)), key: t(set.k, io.x(set.T, H, K)), value: t(set.v, io.x(set.T, H, V)),
    decay: t(set.g, [1, set.T, H]), beta: t(set.beta, [1, set.T, H]) };
  if (state) feeds[io.past] = t(state, io.state(H, K, V));
  return feeds;
}

// Each implementation is a runner: warm() makes its first, untimed call (pipelines, programs);
// timed() makes one timed call (prefill) or one decode loop and returns ms per call (per step);
// result() reads back the outputs of its last timed call (or loop) and frees what it holds.

// A prefill runner around `call` (resolves once its GPU work is done); `free(out)` releases an
// output set, `read(out)` reads { o, s } back; `warmCall` wraps the untimed first call.
function prefillRunner(call, free, read, warmCall = (f) => f()) {
  let last = null;
  return {
    warm: async () => free(await warmCall(call)),
    async timed() {
      if (last) free(last);
      last = null;
      const t0 = performance.now();
      last = await call();
      return performance.now() - t0;
    },
    async result() {
      const r = await read(last);
      free(last);
      return r;
    },
  };
}

function prefillCard(kernel, contract, dev, variant) {
  const { H, K, V } = dev;
  const inputs = cardInputs(contract, dev.sets[0], H, K, V, contract === GDN ? dev.s0vk : dev.s0kv);
  const [oKey, sKey] = contract === GDN ? ["outputT", "finalStateT"] : ["oT", "stateT"];
  return prefillRunner(() => kernel(inputs, { resident: true, variant }),
    (out) => { for (const x of Object.values(out)) x.buffer.destroy(); },
    async (out) => ({ o: await readBuffer(kernel.device, out[oKey].buffer, numel(out[oKey].shape)),
      s: await readBuffer(kernel.device, out[sKey].buffer, numel(out[sKey].shape)) }));
}

// (`built`: where the warm-up call pushes the cache keys of the programs it built)
function prefillOrt(contract, session, device, dev, built) {
  const { H, K, V } = dev, io = ORT_IO[contract];
  const feeds = ortFeeds(contract, dev.sets[0], H, K, V, dev[io.s0]);
  const call = async () => {
    const out = await session.run(feeds);
    await device.queue.onSubmittedWorkDone();     // run() returns once the work is submitted
    return out;
  };
  return prefillRunner(call, (out) => { for (const x of Object.values(out)) x.dispose(); },
    async (out) => ({ o: new Float32Array(await out.output.getData()), s: new Float32Array(await out[io.present].getData()) }),
    (f) => untimed(f, built));
}

// A decode runner: `reset()` makes a fresh copy of the initial state (before the clock starts),
// `step(set)` one token with the state fed back, `read()` the outputs of the last loop and the
// final state; `warmCall` wraps the untimed warm-up step.
function decodeRunner(sets, stateUpdate, reset, step, read, warmCall = (f) => f()) {
  return {
    stateUpdate,
    async warm() {
      await reset();
      await warmCall(() => step(sets[0]));
    },
    async timed() {
      await reset();
      const t0 = performance.now();
      for (const set of sets) await step(set);
      return (performance.now() - t0) / sets.length;
    },
    result: read,
  };
}

// decode: a loop of `steps` one-token calls, the state fed back on the device, each loop from a
// fresh copy of the initial state (made before the clock starts); warm() is one step on a copy.
function decodeCard(kernel, contract, dev) {
  const { H, K, V, sets } = dev, device = kernel.device, bytes = H * K * V * 4;
  const s0 = contract === GDN ? dev.s0vk : dev.s0kv;
  const [oKey, sKey] = contract === GDN ? ["outputT", "finalStateT"] : ["oT", "stateT"];
  // deltarule.LinearAttention: the state slab updated in place (stateIndicesT); GatedDeltaNet keeps
  // initial and final states apart: the final state buffer is the next step's initial state
  const slab = contract !== GDN ? { stateIndicesT: { data: Int32Array.from([0]), shape: [1] } } : {};
  let state = null, outs = [];
  const reset = async () => {
    for (const b of outs) b.destroy();
    outs = [];
    state?.destroy();
    state = device.createBuffer({ size: bytes, usage: USAGE() });
    copyInto(device, s0, state, bytes);
    await device.queue.onSubmittedWorkDone();
  };
  const step = async (set) => {
    const out = await kernel({ ...cardInputs(contract, set, H, K, V, state), ...slab }, { resident: true });
    outs.push(out[oKey].buffer);
    if (contract === GDN) {
      state.destroy();
      state = out[sKey].buffer;
    }
  };
  return decodeRunner(sets, contract === GDN ? "final state buffer fed back" : "slab updated in place", reset, step,
    async () => {
      const o = new Float32Array(sets.length * H * V);
      for (let n = 0; n < outs.length; n++) o.set(await readBuffer(device, outs[n], H * V), n * H * V);
      const s = await readBuffer(device, state, H * K * V);
      for (const b of [...outs, state]) b.destroy();
      return { o, s };
    });
}

function decodeOrt(contract, session, device, dev, built) {
  const { H, K, V, sets } = dev, bytes = H * K * V * 4, io = ORT_IO[contract];
  const feeds = sets.map((set) => ortFeeds(contract, set, H, K, V, null));
  // the state chained as onnxruntime returns it: present_state / final_state (a GPU tensor it
  // allocated) is the next step's past_state / initial_state
  let first = null, state = null, outs = [];
  const free = () => {
    for (const x of outs) x.dispose();
    outs = [];
    if (state && state.gpuBuffer !== first) state.dispose();
    first?.destroy();
    first = state = null;
  };
  const reset = async () => {
    free();
    first = device.createBuffer({ size: bytes, usage: USAGE() });
    copyInto(device, dev[io.s0], first, bytes);
    state = ort.Tensor.fromGpuBuffer(first, { dataType: "float32", dims: io.state(H, K, V) });
    await device.queue.onSubmittedWorkDone();
  };
  const step = async (set) => {
    const out = await session.run({ ...feeds[sets.indexOf(set)], [io.past]: state });
    await device.queue.onSubmittedWorkDone();
    outs.push(out.output);
    if (state.gpuBuffer !== first) state.dispose();
    state = out[io.present];
  };
  return decodeRunner(sets, `${io.present} tensor fed back as ${io.past}`, reset, step,
    async () => {
      const o = new Float32Array(sets.length * H * V);
      for (let n = 0; n < outs.length; n++) o.set(new Float32Array(await outs[n].getData()), n * H * V);
      const s = new Float32Array(await state.getData());
      free();
      return { o, s };
    }, (f) => untimed(f, built));
}

// ---- the whole comparison -----------------------------------------------------------------------

// The onnxruntime-web sessions, one per model of index.ort_models: first a probe session with the
// verbose session log (where its node was placed), kept open while the timed session (warnings
// only) runs, since closing the last session of a device lets onnxruntime destroy the device.
async function ortSessions(models, base) {
  const out = [];
  for (const m of models) {
    const url = new URL(m.file, base).href;
    const p = await probe(url, ["webgpu"]);
    if (!p.session) throw new Error(`onnxruntime-web could not create the ${m.contract} session (${m.file}): ${p.error}`);
    // (the runtime's default logger still writes verbose lines while a session is created: kept apart)
    const { value, error } = await capturingLogs(() => ort.InferenceSession.create(url,
      { executionProviders: ["webgpu"], preferredOutputLocation: "gpu-buffer", logSeverityLevel: 2 }));
    if (error) throw error;
    out.push({ ...m, probe: p.session, session: value, placement: { ep: p.placement, lines: p.lines }, built: [] });
  }
  return out;
}

// The runners of one case: each card (per variant on prefill), then each onnxruntime-web session
// in index order (the order of the warm-ups: the first session to run a program builds it).
function caseRunners(c, kernels, sessions, device, dev, variants) {
  const runners = [];
  for (const contract of [GDN, LA]) {
    const common = { contract, stateKey: contract === GDN ? "state_vk" : "state_kv", ep: "deltarule WebGPU card",
      implementation: contract === GDN ? "card com.microsoft.GatedDeltaNet" : "card deltarule.LinearAttention" };
    if (c.kind === "decode") {
      runners.push({ ...common, variant: "recurrent", run: decodeCard(kernels[contract], contract, dev) });
    } else {
      for (const variant of variants) {
        runners.push({ ...common, variant: variant === "auto" ? `auto (${c.tokens >= 128 ? "chunked" : "recurrent"})` : variant,
          run: prefillCard(kernels[contract], contract, dev, variant) });
      }
    }
  }
  for (const s of sessions) {
    const built = [];
    runners.push({ contract: s.contract, stateKey: s.contract === GDN ? "state_vk" : "state_kv", session: s,
      implementation: `onnxruntime-web ${s.contract}`, variant: s.variant, ep: s.placement.ep, built,
      run: c.kind === "decode" ? decodeOrt(s.contract, s.session, device, dev, built)
        : prefillOrt(s.contract, s.session, device, dev, built) });
  }
  return runners;
}

// Warm-ups, then `repeat` rounds of one timed call (or decode loop) each, the order rotated from
// round to round so that a slow spell of this shared machine falls on all of them.
async function timeRounds(runners, repeat) {
  for (const r of runners) {
    r.times = [];
    await r.run.warm();
  }
  for (let round = 0; round < repeat; round++) {
    for (let i = 0; i < runners.length; i++) {
      const r = runners[(i + round) % runners.length];
      r.times.push(await r.run.timed());
    }
  }
}

// A card's speed over each onnxruntime-web implementation of its contract in the same case: per
// round, onnxruntime-web's time over the card's; their median, min and max.
export function cardRatios(card, rows) {
  return rows.filter((x) => x.case === card.case && x.contract === card.contract && x.implementation.startsWith("onnxruntime"))
    .map((o) => {
      const perRound = o.times.map((t, i) => t / card.times[i]);
      return { against: o.implementation + (o.variant ? ` [${o.variant}]` : ""), median: median(perRound),
        min: Math.min(...perRound), max: Math.max(...perRound), perRound };
    });
}

/**
 * Run every case of ort-kernels/index.json.
 * @param options { base: URL of the folder holding index.json (default ./ort-kernels/ beside this
 *   module), cards: URL of the cards folder (default ./cards/), repeat: timed rounds (default 3),
 *   variants: card variants timed on prefill (default ["auto", "recurrent"]), onRow(row): called as
 *   rows come }
 * @returns { adapter, device, ort, cards, shape, tolerance, repeat, generator, placement, routes, rows,
 *   ratios, ortShaders }
 */
export async function runOrtKernels(options = {}) {
  const here = import.meta.url;
  const base = new URL(options.base ?? "./ort-kernels/", here);
  const cardsUrl = new URL(options.cards ?? "./cards/", here);
  const repeat = options.repeat ?? 3;
  const variants = options.variants ?? ["auto", "recurrent"];
  const onRow = options.onRow ?? (() => {});
  const index = await readIndex(base);
  if (!Array.isArray(index.ort_models)) {
    throw new Error(`${new URL("index.json", base)} has no ort_models (an older generator wrote it): run \`${GENERATOR}\``);
  }
  ort.env.wasm.wasmPaths = new URL("./node_modules/onnxruntime-web/dist/", here).href;
  ort.env.wasm.numThreads = 1;        // no cross-origin isolation here: one wasm thread either way
  // the runtime's logger passes verbose lines (set before the first session initializes it); the
  // probe sessions ask for them, the timed sessions do not (logSeverityLevel 2, warnings)
  ort.env.logLevel = "verbose";
  hookConsole();
  const sessions = await ortSessions(index.ort_models, base);
  const device = await ort.env.webgpu.device;
  if (!device) throw new Error("onnxruntime-web did not expose its GPUDevice (ort.env.webgpu.device)");
  const adapterInfo = device.adapterInfo ?? {};
  const kernels = {
    [GDN]: await loadKernel(new URL(`${GDN}/`, cardsUrl).href, { device }),
    [LA]: await loadKernel(new URL("deltarule.LinearAttention/", cardsUrl).href, { device }),
  };
  const tol = index.tolerance;
  const rows = [];
  try {
    for (const c of index.cases) {
      const host = {};
      for (const [name, t] of Object.entries(c.inputs)) host[name] = await readTensor(base, t);
      const expected = {};
      for (const [name, t] of Object.entries(c.expected)) expected[name] = await readTensor(base, t);
      const made = [];
      const dev = deviceInputs(device, host, c.kind === "decode" ? c.steps : 1, made);
      await device.queue.onSubmittedWorkDone();
      const tokens = c.kind === "decode" ? 1 : c.tokens;
      const runners = caseRunners(c, kernels, sessions, device, dev, variants);
      await timeRounds(runners, repeat);
      for (const r of runners) {
        if (r.session) r.session.built.push(...r.built);
        const { o, s } = await r.run.result();
        const errors = { output: relativeError(f32(o), f32(expected.o.data)),
          state: relativeError(f32(s), f32(expected[r.stateKey].data)) };
        const ms = median(r.times);
        const row = { case: c.name, kind: c.kind, tokens: c.tokens, contract: r.contract, implementation: r.implementation,
          variant: r.variant, ep: r.ep, tolerance: tol, errors, ok: errors.output <= tol && errors.state <= tol, ms,
          times: r.times, tokensPerSecond: (1000 * tokens) / ms, ...(r.run.stateUpdate ? { stateUpdate: r.run.stateUpdate } : {}),
          ...(r.session ? { programs: r.built.map(programName) } : {}) };
        rows.push(row);
        onRow(row);
      }
      for (const b of made) b.destroy();
    }
  } finally {
    // (releasing the last session destroys onnxruntime's device, which it logs: kept apart)
    await capturingLogs(async () => {
      for (const s of sessions) {
        await s.session.release();
        await s.probe.release();
      }
    });
  }
  const ratios = [];
  for (const r of rows.filter((x) => x.implementation.startsWith("card"))) {
    r.ratios = cardRatios(r, rows);
    for (const x of r.ratios) ratios.push({ case: r.case, contract: r.contract, card: r.implementation, variant: r.variant, ...x });
  }
  // each session's route: the programs it built over its warm-ups (a session that built none ran
  // programs an earlier session had built: null)
  const routes = sessions.map((s) => ({ contract: s.contract, variant: s.variant, file: s.file,
    programs: [...new Set(s.built.map(programName))], route: s.contract === GDN ? routeOf(s.built) : null }));
  const placement = Object.fromEntries(sessions.map((s) => [`${s.contract}${s.variant ? ` [${s.variant}]` : ""}`, s.placement]));
  return {
    adapter: [adapterInfo.vendor, adapterInfo.architecture, adapterInfo.description].filter(Boolean).join(" "),
    device: { features: [...device.features], limits: Object.fromEntries(["maxStorageBuffersPerShaderStage",
      "maxComputeWorkgroupStorageSize", "maxComputeInvocationsPerWorkgroup", "maxStorageBufferBindingSize"].map((k) => [k, device.limits[k]])) },
    ort: { versions: ort.env.versions, bundle: "ort.webgpu.bundle.min.mjs", numThreads: ort.env.wasm.numThreads },
    cards: Object.fromEntries(Object.values(kernels).map((k) => [k.metadata.id, { url: new URL(`${k.metadata.id}/`, cardsUrl).href,
      digests: k.metadata.digests }])),
    shape: { B: 1, H: index.H, K: index.K, V: index.V, dtype: index.dtype }, tolerance: tol, repeat, generator: index.generator,
    placement, routes, rows, ratios, ortShaders: Object.fromEntries(ortShaders),
  };
}

// ---- the page's table -----------------------------------------------------------------------------

const x2 = (v) => `${v.toFixed(2)}x`;
export const ratioText = (q) => `${x2(q.median)} [${q.min.toFixed(2)}-${q.max.toFixed(2)}] vs ${q.against.replace(/^onnxruntime-web (com\.microsoft\.)?/, "")}`;

export function tableRow(r) {
  const e = (x) => (x == null ? "" : x.toExponential(2));
  return [r.case, r.contract.replace("com.microsoft.", ""), r.implementation + (r.variant ? ` [${r.variant}]` : ""),
    (r.ep ?? "") + (r.programs?.length ? ` (built ${[...new Set(r.programs)].join(", ")})` : ""),
    `${e(r.errors.output)} / ${e(r.errors.state)}`, r.ok ? "pass" : "FAIL", r.ms.toFixed(1), r.tokensPerSecond.toFixed(0),
    (r.ratios ?? []).map(ratioText).join("; ")];
}
