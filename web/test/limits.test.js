// The loader's size limits and its resident buffers (issue 32, items 6 and 7), in Node's Dawn and
// in headless Chromium: every size beyond the adapter's limits or the card's own bounds is a
// ContractError naming the argument, the bound and the limit, raised before any GPU work (no
// buffer, shader, encoder or submit, and quickly); GPU errors keep WebGPU's message; a resident
// call's state is a live buffer the caller owns, and a chain of resident calls equals the host
// calls; malformed inputs, concurrent calls and a destroyed device.
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { ContractError, loadKernel, requestDevice, WebGPUError } from "../deltarule-kernels.js";
import { nodeGPU, serve, withChromium } from "../tools/gpu.js";
import { gdnSteps, laSteps, readBuffer, refusal, residentChains, sizeCases } from "./limits-cases.js";

const webRoot = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const cardsRoot = path.join(webRoot, "cards");
for (const id of ["com.microsoft.GatedDeltaNet", "deltarule.LinearAttention"]) {
  if (!fs.existsSync(path.join(cardsRoot, id, "metadata.json"))) {
    throw new Error(`${cardsRoot}/${id} is missing: run \`python -m deltarule card export ${cardsRoot}\` (bash .ci/web test does)`);
  }
}

let gpu, device;                       // the Dawn instance must outlive its devices (else a crash)
async function nodeDevice() {
  gpu ??= await nodeGPU();
  device ??= await requestDevice(gpu);
  return device;
}
async function defaultDevice() {       // WebGPU's default limits (128 MiB bindings, 256 MiB buffers)
  gpu ??= await nodeGPU();
  return (await gpu.requestAdapter()).requestDevice();
}
const load = async (id, dev) => loadKernel(path.join(cardsRoot, id), { device: dev ?? await nodeDevice() });

async function refusedBeforeGpuWork(kernel, c) {
  const r = await refusal(kernel, c);
  assert.deepEqual(r.problems, [], `${c.name}: ${r.error?.message}`);
  return r.error;
}

test("node/dawn: sizes beyond the adapter's limits or the card's bounds are refused before any GPU work", async (t) => {
  const dev = await nodeDevice();
  const kernels = { gdn: await load("com.microsoft.GatedDeltaNet"), la: await load("deltarule.LinearAttention") };
  const cases = sizeCases(dev.limits);
  for (const c of cases) await refusedBeforeGpuWork(kernels[c.card], c);
  t.diagnostic(`${cases.length} refusals: ${cases.map((c) => c.name).join("; ")}`);
  // the bounds are not stricter than stated: K = 256 and G = 16 still run
  const f = (n) => Float32Array.from({ length: n }, (_, i) => 0.1 * Math.sin(i + 1));
  const K = 256;
  const r = await kernels.gdn({ queryT: { data: f(K), shape: [1, 1, K] }, keyT: { data: f(K), shape: [1, 1, K] },
    valueT: { data: f(4), shape: [1, 1, 4] }, decayT: { data: Float32Array.of(-0.1), shape: [1, 1] },
    betaT: { data: Float32Array.of(0.5), shape: [1, 1] }, cuSeqlensT: { data: Int32Array.of(0, 1), shape: [2] } });
  assert.ok(r.outputT.data.every(Number.isFinite));
  const G = 16;
  const q = await kernels.la({ qT: { data: f(G * 8), shape: [1, 1, G, 8] }, kT: { data: f(8), shape: [1, 1, 1, 8] },
    vT: { data: f(8), shape: [1, 1, 1, 8] }, gT: { data: Float32Array.of(-0.1), shape: [1, 1, 1] },
    betaT: { data: Float32Array.of(0.5), shape: [1, 1, 1] } });
  assert.equal(q.oT.data.length, G * 8);
});

test("node/dawn: buffer limits of a device with WebGPU's default limits", async () => {
  const small = await defaultDevice();
  const gdn = await load("com.microsoft.GatedDeltaNet", small);
  const binding = small.limits.maxStorageBufferBindingSize;
  // a final state over the binding limit (no initial state: nothing large on the host)
  const [N, K, V] = [16, 128, 128];
  const Hv = Math.floor(binding / (4 * N * K * V)) + 1;
  const f = (n, x) => new Float32Array(n).fill(x);
  const inputs = () => ({ queryT: { data: f(N * K, 0.1), shape: [N, 1, K] }, keyT: { data: f(N * K, 0.1), shape: [N, 1, K] },
    valueT: { data: f(N * Hv * V, 0.1), shape: [N, Hv, V] }, decayT: { data: f(N * Hv, -0.1), shape: [N, Hv] },
    betaT: { data: f(N * Hv, 0.5), shape: [N, Hv] }, cuSeqlensT: { data: Int32Array.from({ length: N + 1 }, (_, i) => i), shape: [N + 1] } });
  await refusedBeforeGpuWork(gdn, { name: "final state over maxStorageBufferBindingSize", inputs, argument: "finalStateT",
    message: new RegExp(`at most ${binding} bytes \\(the adapter's maxStorageBufferBindingSize\\), got the output of shape ` +
      `\\[${N}, ${Hv}, ${V}, ${K}\\] float32 these inputs give: ${4 * N * Hv * K * V} bytes`), limit: "maxStorageBufferBindingSize" });
  small.destroy();
});

// ---- GPU errors keep their message -------------------------------------------------------------

test("node/dawn: a GPU error keeps WebGPU's message (and the exception raised with it)", async () => {
  const dev = await nodeDevice();
  const gdn = await load("com.microsoft.GatedDeltaNet");
  const [{ inputs }] = gdnSteps(1);
  // a destroyed input buffer: only the GPU can tell
  const dead = dev.createBuffer({ size: 4 * 4 * 16, usage: GPUBufferUsage.STORAGE });
  dead.destroy();
  await assert.rejects(gdn({ ...inputs, queryT: { buffer: dead, shape: inputs.queryT.shape, dtype: "float32" } }),
    (e) => e instanceof WebGPUError && /WebGPU: GPUValidationError: .*destroyed/s.test(e.message) && e.errors.length >= 1);
  // a buffer WebGPU refuses, and an exception raised after it (issue 32: a state over
  // maxBufferSize raised OperationError with an empty message, the error scope's message was
  // dropped): the upload made too large behind the loader's back, its mapping throwing as such
  // a mapping can; the message keeps both, the exception is the cause
  const original = dev.createBuffer;
  dev.createBuffer = function (descriptor) {
    if (!(descriptor.mappedAtCreation && descriptor.size >= 256)) return original.call(this, descriptor);
    const buffer = original.call(this, { ...descriptor, size: dev.limits.maxBufferSize + 4 });
    buffer.getMappedRange = () => { throw new DOMException("", "OperationError"); };
    return buffer;
  };
  try {
    await assert.rejects(gdn(inputs), (e) => {
      assert.ok(e instanceof WebGPUError, `${e.name}: ${e.message}`);
      assert.match(e.message, new RegExp(`^WebGPU: GPUValidationError: Buffer size \\(${dev.limits.maxBufferSize + 4}\\) exceeds the max buffer size`));
      assert.match(e.message, /; OperationError: \(no message\)$/);
      assert.equal(e.cause?.name, "OperationError");
      assert.equal(e.errors.length, 1);
      return true;
    });
  } finally {
    dev.createBuffer = original;
  }
  // a failed call leaves nothing behind: the next calls run
  assert.ok((await gdn(inputs)).outputT.data.every(Number.isFinite));
});

// ---- resident calls: the returned buffers are live and the caller's ----------------------------

test("node/dawn: resident calls with a host-data slab return a live buffer; a chain of 3 equals host calls", async () => {
  const dev = await nodeDevice();
  const la = await load("deltarule.LinearAttention");
  const { problems, owned } = await residentChains(dev, la, await load("com.microsoft.GatedDeltaNet"));
  assert.deepEqual(problems, []);
  // the slab buffer is live and the caller's: usable in a 4th call, then destroyed by the caller;
  // a destroyed buffer is refused by the GPU, with its message
  const [step] = laSteps(1);
  const slab = { buffer: owned, shape: laSteps(0).shape, dtype: "float32" };
  const fourth = await la({ ...step.inputs, initialStateT: slab });
  assert.ok(fourth.stateT.data.every(Number.isFinite));
  owned.destroy();
  await assert.rejects(la({ ...step.inputs, initialStateT: slab }), (e) => e instanceof WebGPUError && /destroyed/.test(e.message));
});

// ---- malformed inputs: ContractErrors before any GPU work ---------------------------------------

test("node/dawn: malformed inputs and options are ContractErrors naming the argument, before any GPU work", async () => {
  const dev = await nodeDevice();
  const gdn = await load("com.microsoft.GatedDeltaNet");
  const la = await load("deltarule.LinearAttention");
  const [{ inputs: base }] = gdnSteps(1);
  const shape = base.queryT.shape;
  const n = shape.reduce((a, b) => a * b, 1);
  const mk = (usage, size = 4 * n, mapped = false) => dev.createBuffer({ size, usage, mappedAtCreation: mapped });
  const storage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
  const buffers = { mapRead: mk(GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST), mapped: mk(GPUBufferUsage.STORAGE, 4 * n, true),
    small: mk(storage, 4 * n - 4), ok: mk(storage), slab: mk(storage, 4 * 4 * 2 * 16 * 16) };
  const q = (t) => () => ({ ...base, queryT: t });
  const cases = [
    ["negative size", q({ data: new Float32Array(n), shape: [shape[0], shape[1], -shape[2]] }), "queryT", /integers >= 0/],
    ["non-integer size", q({ data: new Float32Array(n), shape: [shape[0], shape[1], shape[2] + 0.5] }), "queryT", /integers >= 0/],
    ["shape not an array", q({ data: new Float32Array(n), shape: "4,1,16" }), "queryT", /shape of integers/],
    ["typed array too short", q({ data: new Float32Array(n - 1), shape }), "queryT", new RegExp(`expected ${n} elements.*got ${n - 1}`)],
    ["typed array too long", q({ data: new Float32Array(n + 1), shape }), "queryT", new RegExp(`expected ${n} elements.*got ${n + 1}`)],
    ["Float64Array", q({ data: new Float64Array(n), shape }), "queryT", /got Float64Array/],
    ["plain Array", q({ data: Array.from({ length: n }, () => 0), shape }), "queryT", /got Array/],
    ["int32 where T is float", q({ data: new Int32Array(n), shape }), "queryT", /dtype float32 or float16.*got int32/],
    ["Uint16Array without dtype", q({ data: new Uint16Array(n), shape }), "queryT", /a dtype/],
    ["dtype and data disagree", q({ data: new Float32Array(n), shape, dtype: "float16" }), "queryT", /data for dtype float16/],
    ["unknown dtype", q({ data: new Float32Array(n), shape, dtype: "float64" }), "queryT", /got float64/],
    ["data and buffer", q({ data: new Float32Array(n), buffer: buffers.ok, shape, dtype: "float32" }), "queryT", /either data .* or buffer/],
    ["buffer not a GPUBuffer", q({ buffer: new ArrayBuffer(4 * n), shape, dtype: "float32" }), "queryT", /a GPUBuffer, got ArrayBuffer/],
    ["buffer without dtype", q({ buffer: buffers.ok, shape }), "queryT", /a dtype with a GPUBuffer/],
    ["buffer too small", q({ buffer: buffers.small, shape, dtype: "float32" }), "queryT", new RegExp(`at least ${4 * n} bytes.*got ${4 * n - 4} bytes`)],
    ["buffer without STORAGE", q({ buffer: buffers.mapRead, shape, dtype: "float32" }), "queryT", /usage STORAGE, got usage \d+ \(MAP_READ \| COPY_DST\)/],
    ["buffer mapped", q({ buffer: buffers.mapped, shape, dtype: "float32" }), "queryT", /unmapped GPUBuffer, got mapState mapped/],
    ["cu_seqlens as float", () => ({ ...base, cuSeqlensT: { data: Float32Array.of(0, 4), shape: [2] } }), "cuSeqlensT", /int32/],
    ["unknown bind key", () => ({ ...base, queryX: { data: new Float32Array(1), shape: [1] } }), "queryX", /unknown/],
  ];
  const calls = cases.map(([name, inputs, argument, message]) => ({ name, inputs, argument, message }));
  calls.push(
    { name: "inputs null", inputs: () => null, argument: "inputs", message: /an object of bind keys, got null/ },
    { name: "options not an object", inputs: () => base, options: 7, argument: "options", message: /an object/ },
    { name: "unknown option", inputs: () => base, options: { resdent: true }, argument: "resdent", message: /an option of kernel/ },
    { name: "outputs not an array", inputs: () => base, options: { outputs: "outputT" }, argument: "outputs", message: /an array/ },
    { name: "unknown output", inputs: () => base, options: { outputs: ["outputT", "finalStateT", "stateT"] }, argument: "outputs", message: /stateT/ },
    { name: "non-integer int attribute", inputs: () => base, options: { attributes: { chunk_size: 1.5 } }, argument: "chunk_size", message: /an int, got 1.5/ },
    { name: "NaN scale", inputs: () => base, options: { attributes: { scale: NaN } }, argument: "scale", message: /finite/ },
    { name: "variant unknown", inputs: () => base, options: { variant: "fast" }, argument: "variant", message: /one of auto/ },
  );
  for (const c of calls) await refusedBeforeGpuWork(gdn, c);
  // a slab written in place may not also be another input's buffer (a WebGPU usage conflict)
  const la1 = laSteps(1);
  await refusedBeforeGpuWork(la, { name: "slab aliasing an input", argument: "initialStateT", message: /apart from every other input's.*same GPUBuffer as qT/,
    inputs: () => ({ ...la1[0].inputs, qT: { buffer: buffers.slab, shape: la1[0].inputs.qT.shape, dtype: "float32" },
      initialStateT: { buffer: buffers.slab, shape: la1.shape, dtype: "float32" } }) });
  // the host program's ContractError is the loader's class too
  const e = await refusedBeforeGpuWork(gdn, { name: "a host program's refusal", argument: "keyT", message: /queryT's shape/,
    inputs: () => ({ ...base, keyT: { data: new Float32Array(4 * 8), shape: [4, 1, 8] } }) });
  assert.ok(e instanceof ContractError && e instanceof Error);
  for (const b of Object.values(buffers)) b.destroy();
});

// ---- concurrent calls and a destroyed device ----------------------------------------------------

test("node/dawn: concurrent calls each get their own result or their own GPU error", async () => {
  const dev = await nodeDevice();
  const gdn = await load("com.microsoft.GatedDeltaNet");
  const steps = gdnSteps(4);
  const expected = [];
  for (const { inputs } of steps) expected.push(await gdn(inputs));
  const dead = dev.createBuffer({ size: 4 * 4 * 16, usage: GPUBufferUsage.STORAGE });
  dead.destroy();
  const bad = { ...steps[0].inputs, queryT: { buffer: dead, shape: steps[0].inputs.queryT.shape, dtype: "float32" } };
  const settled = await Promise.allSettled([gdn(steps[0].inputs), gdn(bad), gdn(steps[1].inputs), gdn(steps[2].inputs),
    gdn(steps[3].inputs, { resident: true }), gdn(bad)]);
  assert.deepEqual(settled.map((s) => s.status), ["fulfilled", "rejected", "fulfilled", "fulfilled", "fulfilled", "rejected"]);
  for (const i of [1, 5]) assert.match(settled[i].reason.message, /destroyed/);
  [0, 1, 2].forEach((step, k) => {
    const got = settled[[0, 2, 3][k]].value;
    assert.deepEqual(Array.from(got.outputT.data), Array.from(expected[step].outputT.data));
    assert.deepEqual(Array.from(got.finalStateT.data), Array.from(expected[step].finalStateT.data));
  });
  const r = settled[4].value;
  assert.deepEqual(Array.from(await readBuffer(dev, r.outputT.buffer, r.outputT.shape)), Array.from(expected[3].outputT.data));
  r.outputT.buffer.destroy();
  r.finalStateT.buffer.destroy();
});

test("node/dawn: a kernel on a destroyed device refuses calls", async () => {
  const dev = await defaultDevice();
  const gdn = await load("com.microsoft.GatedDeltaNet", dev);
  const [{ inputs }] = gdnSteps(1);
  assert.ok((await gdn(inputs)).outputT.data.every(Number.isFinite));
  dev.destroy();
  await assert.rejects(gdn(inputs), (e) => e instanceof WebGPUError && /device is lost \(destroyed/.test(e.message));
  await new Promise((resolve) => setTimeout(resolve, 50));
  await assert.rejects(gdn(inputs), (e) => e instanceof WebGPUError && /device is lost/.test(e.message));
});

// ---- the same in a Chromium page ----------------------------------------------------------------

test("chromium: size refusals before GPU work and the resident chain in a page", { timeout: 300_000 }, async () => {
  const server = await serve(webRoot);
  try {
    const results = await withChromium(new URL("test/limits.html", server.url).href, async (page) => {
      const r = await page.evaluate(() => window.results);
      assert.deepEqual(page.errors, []);
      return r;
    });
    assert.equal(results.error, undefined, results.error);
    assert.ok(results.refusals.length >= 8, JSON.stringify(results));
    for (const r of results.refusals) {
      assert.deepEqual(r.problems, [], JSON.stringify(r));
      assert.equal(r.name, "ContractError", JSON.stringify(r));
      assert.equal(r.argument, r.want.argument, JSON.stringify(r));
      assert.match(r.message, new RegExp(r.want.message), JSON.stringify(r));
      assert.equal(r.gpuWork, 0, JSON.stringify(r));
    }
    assert.equal(results.chain, "equal");
  } finally {
    await server.close();
  }
});
