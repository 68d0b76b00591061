// Shared by test/limits.test.js (Node, Dawn) and test/limits.html (Chromium): the sizes the
// loader must refuse before any GPU work, a GPU-work counter, and the resident chains.

import { numel } from "../deltarule-kernels.js";

const fill = (n, x) => new Float32Array(n).fill(x);
const wave = (n, seed) => Float32Array.from({ length: n }, (_, i) => Math.sin(seed * 7.1 + i * 1.3));

// unit rows of length K (the delta rule's keys)
function unit(n, K, seed) {
  const x = wave(n, seed);
  for (let i = 0; i < n; i += K) {
    const norm = Math.hypot(...x.subarray(i, i + K));
    for (let j = i; j < i + K; j++) x[j] /= norm;
  }
  return x;
}

function gdnCall({ T, Hq = 1, Hv, K, V, N = null }) {
  const cu = N === null ? Int32Array.of(0, T) : Int32Array.from({ length: N + 1 }, (_, i) => Math.min(i, T));
  return { queryT: { data: fill(T * Hq * K, 0.1), shape: [T, Hq, K] }, keyT: { data: fill(T * Hq * K, 0.1), shape: [T, Hq, K] },
    valueT: { data: fill(T * Hv * V, 0.1), shape: [T, Hv, V] }, decayT: { data: fill(T * Hv, -0.1), shape: [T, Hv] },
    betaT: { data: fill(T * Hv, 0.5), shape: [T, Hv] }, cuSeqlensT: { data: cu, shape: [cu.length] } };
}

function laCall({ B = 1, T = 1, Hq = 1, Hv = 1, K, V }) {
  return { qT: { data: fill(B * T * Hq * K, 0.1), shape: [B, T, Hq, K] }, kT: { data: fill(B * T * Hv * K, 0.1), shape: [B, T, Hv, K] },
    vT: { data: fill(B * T * Hv * V, 0.1), shape: [B, T, Hv, V] }, gT: { data: fill(B * T * Hv, -0.1), shape: [B, T, Hv] },
    betaT: { data: fill(B * T * Hv, 0.5), shape: [B, T, Hv] } };
}

// [{ name, card: "gdn" | "la", inputs: () => inputs, argument, message: RegExp, limit }]
export function sizeCases(limits) {
  const wg = limits.maxComputeWorkgroupsPerDimension;
  const cases = [
    { name: "K = 65536 (a 256 KB input) over the card's key bound", card: "gdn", inputs: () => gdnCall({ T: 1, Hv: 1, K: 65536, V: 4 }),
      argument: "queryT", message: /K <= 256 \(the card's bound.*got K = 65536/, limit: "card MAX_KEYS" },
    { name: "K = 257", card: "la", inputs: () => laCall({ K: 257, V: 4 }), argument: "qT", message: /K <= 256.*got K = 257/, limit: "card MAX_KEYS" },
    { name: "Hv over maxComputeWorkgroupsPerDimension", card: "gdn", inputs: () => gdnCall({ T: 1, Hv: wg + 1, K: 4, V: 4 }),
      argument: "valueT", message: new RegExp(`at most ${wg} value heads \\(the adapter's maxComputeWorkgroupsPerDimension.*got Hv = ${wg + 1}`),
      limit: "maxComputeWorkgroupsPerDimension" },
    { name: "Hv over maxComputeWorkgroupsPerDimension (LinearAttention)", card: "la", inputs: () => laCall({ Hq: wg + 1, Hv: wg + 1, K: 4, V: 4 }),
      argument: "vT", message: new RegExp(`at most ${wg} value heads.*got Hv = ${wg + 1}`), limit: "maxComputeWorkgroupsPerDimension" },
    { name: "a query group over the card's bound", card: "la", inputs: () => laCall({ Hq: 32, K: 8, V: 8 }), argument: "qT",
      message: /at most 16 query heads per state head.*got G = Hq \/ Hv = 32/, limit: "card MAX_GROUP" },
    { name: "V beyond the grid's value tiles", card: "la", inputs: () => laCall({ K: 1, V: 32 * wg + 1 }), argument: "vT",
      message: new RegExp(`V <= ${32 * wg} \\(the adapter's maxComputeWorkgroupsPerDimension ${wg} x 32.*got V = ${32 * wg + 1}`),
      limit: "maxComputeWorkgroupsPerDimension" },
    { name: "sequences over maxComputeWorkgroupsPerDimension (cu_seqlens)", card: "gdn", inputs: () => gdnCall({ T: 1, Hv: 1, K: 4, V: 4, N: wg + 1 }),
      argument: "cuSeqlensT", message: new RegExp(`at most ${wg} live sequences.*got ${wg + 1} sequences`), limit: "maxComputeWorkgroupsPerDimension" },
    { name: "sequences over maxComputeWorkgroupsPerDimension (seq_lens)", card: "la",
      inputs: () => ({ ...laCall({ B: wg + 1, K: 4, V: 4 }), seqLensT: { data: new Int32Array(wg + 1).fill(1), shape: [wg + 1] } }),
      argument: "seqLensT", message: new RegExp(`at most ${wg} live sequences.*got ${wg + 1} sequences`), limit: "maxComputeWorkgroupsPerDimension" },
    { name: "a speculative sequence longer than one segment", card: "la", inputs: () => {
      const T = 32769;
      return { ...laCall({ T, K: 1, V: 1 }), initialStateT: { data: new Float32Array(T + 1), shape: [T + 1, 1, 1, 1] },
        stateIndicesT: { data: Int32Array.from({ length: T }, (_, i) => i + 1), shape: [1, T] } };
    }, argument: "stateIndicesT", message: /sequences of at most 32768 tokens.*got a live sequence of 32769 tokens/, limit: "card SEGMENT" },
  ];
  // a final state over maxBufferSize with small inputs (no initial state: zeros on the device)
  const [N, K, V] = [16, 128, 128];
  const Hv = Math.floor(limits.maxBufferSize / (4 * N * K * V)) + 1;
  if (Hv <= wg && N * Hv * V <= 2 ** 24) {
    const bytes = 4 * N * Hv * K * V;
    cases.push({ name: "a final state over maxBufferSize", card: "gdn", inputs: () => gdnCall({ T: N, Hv, K, V, N }),
      argument: "finalStateT", message: new RegExp(`at most ${limits.maxBufferSize} bytes \\(the adapter's maxBufferSize\\), got the ` +
        `output of shape \\[${N}, ${Hv}, ${V}, ${K}\\] float32 these inputs give: ${bytes} bytes`), limit: "maxBufferSize" });
  }
  return cases;
}

// Counts the GPU work started on a device: buffers, shaders, pipelines, bind groups, encoders,
// error scopes, submits, writes.
export function watch(device) {
  const counts = {};
  const undo = [];
  const wrap = (object, name) => {
    const original = object[name];
    counts[name] = 0;
    object[name] = function (...args) { counts[name] += 1; return original.apply(this, args); };
    undo.push(() => { object[name] = original; });
  };
  for (const name of ["createBuffer", "createShaderModule", "createComputePipeline", "createComputePipelineAsync",
    "createBindGroup", "createCommandEncoder", "pushErrorScope"]) wrap(device, name);
  for (const name of ["submit", "writeBuffer"]) wrap(device.queue, name);
  return { counts, total: () => Object.values(counts).reduce((a, b) => a + b, 0), restore: () => undo.forEach((f) => f()) };
}

// Runs one refusal case: { name, error, problems: [what is wrong], ms, gpuWork }
export async function refusal(kernel, c) {
  const w = watch(kernel.device);
  const t0 = performance.now();
  let error = null;
  try {
    await kernel(c.inputs(), c.options ?? {});
  } catch (e) {
    error = e;
  } finally {
    w.restore();
  }
  const ms = performance.now() - t0;
  const problems = [];
  if (!error) {
    problems.push("not refused");
  } else {
    if (error.name !== "ContractError") problems.push(`${error.name}: ${error.message}`);
    if (error.argument !== c.argument) problems.push(`argument ${error.argument}, not ${c.argument}`);
    if (!c.message.test(error.message)) problems.push(`message ${JSON.stringify(error.message)} does not match ${c.message}`);
    if (c.limit && error.limit?.name !== c.limit) problems.push(`limit ${JSON.stringify(error.limit)}, not ${c.limit}`);
    if (c.limit && error.limit && !error.message.includes(String(error.limit.value))) problems.push("the limit's value is not in the message");
  }
  if (w.total()) problems.push(`GPU work before the refusal: ${JSON.stringify(w.counts)}`);
  if (ms > 5000) problems.push(`refused after ${Math.round(ms)} ms`);
  return { name: c.name, error, problems, ms, gpuWork: w.total() };
}

// deltarule.LinearAttention steps on a slab [4, 2, 16, 16]: rows 2 and 0, two tokens each
export function laSteps(n) {
  const [S, H, K, V, B, T] = [4, 2, 16, 16, 2, 2];
  const steps = Array.from({ length: n }, (_, i) => ({ inputs: {
    qT: { data: wave(B * T * H * K, 10 + i), shape: [B, T, H, K] }, kT: { data: unit(B * T * H * K, K, 20 + i), shape: [B, T, H, K] },
    vT: { data: wave(B * T * H * V, 30 + i), shape: [B, T, H, V] }, gT: { data: fill(B * T * H, -0.05 * (i + 1)), shape: [B, T, H] },
    betaT: { data: fill(B * T * H, 0.6), shape: [B, T, H] }, stateIndicesT: { data: Int32Array.of(2, 0), shape: [B] } } }));
  steps.slab = wave(S * H * K * V, 1);
  steps.shape = [S, H, K, V];
  return steps;
}

// com.microsoft.GatedDeltaNet steps: 4 tokens in 2 requests (1 + 3), Hv = 2, K = V = 16
export function gdnSteps(n) {
  const [T, Hq, Hv, K, V] = [4, 1, 2, 16, 16];
  const steps = Array.from({ length: n }, (_, i) => ({ inputs: {
    queryT: { data: wave(T * Hq * K, 40 + i), shape: [T, Hq, K] }, keyT: { data: unit(T * Hq * K, K, 50 + i), shape: [T, Hq, K] },
    valueT: { data: wave(T * Hv * V, 60 + i), shape: [T, Hv, V] }, decayT: { data: fill(T * Hv, -0.1), shape: [T, Hv] },
    betaT: { data: fill(T * Hv, 0.5), shape: [T, Hv] }, cuSeqlensT: { data: Int32Array.of(0, 1, 4), shape: [3] } } }));
  steps.state = wave(2 * Hv * V * K, 2);
  steps.shape = [2, Hv, V, K];
  return steps;
}

// a float32 GPUBuffer's first numel(shape) values
export async function readBuffer(device, buffer, shape) {
  const bytes = 4 * numel(shape);
  const staging = device.createBuffer({ size: bytes, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  const encoder = device.createCommandEncoder();
  encoder.copyBufferToBuffer(buffer, 0, staging, 0, bytes);
  device.queue.submit([encoder.finish()]);
  await staging.mapAsync(GPUMapMode.READ);
  const out = new Float32Array(staging.getMappedRange().slice(0));
  staging.unmap();
  staging.destroy();
  return out;
}

const differ = (a, b) => a.length !== b.length || a.some((x, i) => !Object.is(x, b[i]));

// The same steps on the host, each call's final state (bind key `final`) the next one's initial
// state, starting from a copy of `start`: every call's result.
async function hostChain(kernel, steps, start, final) {
  const results = [];
  let state = { data: start.slice(), shape: steps.shape };
  for (const { inputs } of steps) {
    const r = await kernel({ ...inputs, initialStateT: state });
    results.push(r);
    state = { data: r[final].data, shape: steps.shape };
  }
  return results;
}

// Resident chains of 3 calls against the same calls on the host: deltarule.LinearAttention from a
// host-data slab (then the returned buffer, in place), com.microsoft.GatedDeltaNet from a host
// initial state (then each finalStateT as the next initialStateT). Returns { problems, owned }:
// owned, the LinearAttention slab buffer the caller now owns (still live).
export async function residentChains(device, la, gdn) {
  const problems = [];
  const steps = laSteps(3);
  const host = await hostChain(la, steps, steps.slab, "stateT");
  const given = steps.slab.slice();
  let slab = { data: given, shape: steps.shape };
  let owned = null;
  for (let i = 0; i < 3; i++) {
    const r = await la({ ...steps[i].inputs, initialStateT: slab }, { resident: true });
    if (!r.stateT.buffer) problems.push(`call ${i + 1}: stateT is not a buffer`);
    if (i === 0) owned = r.stateT.buffer;
    else if (r.stateT.buffer !== owned) problems.push(`call ${i + 1}: stateT is not the slab given (in place)`);
    if (differ(await readBuffer(device, r.oT.buffer, r.oT.shape), host[i].oT.data)) problems.push(`call ${i + 1}: oT differs from the host call's`);
    if (differ(await readBuffer(device, r.stateT.buffer, r.stateT.shape), host[i].stateT.data)) problems.push(`call ${i + 1}: stateT differs`);
    r.oT.buffer.destroy();
    slab = r.stateT;
  }
  if (differ(given, steps.slab)) problems.push("the caller's host slab was changed");
  const g = gdnSteps(3);
  const ghost = await hostChain(gdn, g, g.state, "finalStateT");
  let s = { data: g.state.slice(), shape: g.shape };
  for (let i = 0; i < 3; i++) {
    const r = await gdn({ ...g[i].inputs, initialStateT: s }, { resident: true });
    if (differ(await readBuffer(device, r.outputT.buffer, r.outputT.shape), ghost[i].outputT.data)) problems.push(`GatedDeltaNet call ${i + 1}: outputT differs`);
    if (differ(await readBuffer(device, r.finalStateT.buffer, r.finalStateT.shape), ghost[i].finalStateT.data)) problems.push(`GatedDeltaNet call ${i + 1}: finalStateT differs`);
    s.buffer?.destroy();                  // the caller's: the previous call's final state
    r.outputT.buffer.destroy();
    s = r.finalStateT;
  }
  s.buffer.destroy();
  return { problems, owned };
}
