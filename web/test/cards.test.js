// Every test.json case of the three kernel cards (exported by `deltarule card export cards`, which
// `bash .ci/web test` runs first) in Node's Dawn and in headless Chromium; the loader's contract
// checks; the device-resident decode loop.
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { ContractError, decodeTensor, loadKernel, requestDevice, runCase, toFloat32 } from "../deltarule-kernels.js";
import { nodeGPU, serve, withChromium } from "../tools/gpu.js";

const webRoot = path.dirname(path.dirname(fileURLToPath(import.meta.url)));
const cardsRoot = path.join(webRoot, "cards");
const CARDS = ["com.microsoft.GatedDeltaNet", "com.microsoft.LinearAttentionGate", "deltarule.LinearAttention"];

for (const id of CARDS) {
  if (!fs.existsSync(path.join(cardsRoot, id, "metadata.json"))) {
    throw new Error(`${cardsRoot}/${id} is missing: run \`python -m deltarule card export ${cardsRoot}\` ` +
      "(bash .ci/web test does)");
  }
}

let gpu, device;                       // the Dawn instance must outlive its device (else a crash)
async function nodeDevice() {
  gpu ??= await nodeGPU();
  device ??= await requestDevice(gpu);
  return device;
}
const load = async (id) => loadKernel(path.join(cardsRoot, id), { device: await nodeDevice() });

for (const id of CARDS) {
  test(`node/dawn: ${id} test.json`, { timeout: 600_000 }, async (t) => {
    const kernel = await load(id);
    const cases = await kernel.tests();
    assert.ok(cases.length > 0);
    const failures = [];
    for (const c of cases) {
      const r = await runCase(kernel, c);
      if (!r.ok) failures.push(`${c.name}: ${JSON.stringify(r.errors)} > ${JSON.stringify(r.tolerance)}`);
    }
    t.diagnostic(`${cases.length} cases`);
    assert.deepEqual(failures, []);
  });
}

// "auto" takes the chunked form only for sequences of 128 tokens or more: here every case of
// deltarule's card runs it (the GatedDeltaNet card's long cases take it under "auto")
for (const id of ["deltarule.LinearAttention"]) {
  test(`node/dawn: ${id} test.json, variant chunked`, { timeout: 900_000 }, async (t) => {
    const kernel = await load(id);
    const failures = [], declined = [];
    let ran = 0;
    for (const c of await kernel.tests()) {
      try {
        const r = await runCase(kernel, c, { variant: "chunked" });
        ran += 1;
        if (!r.ok) failures.push(`${c.name}: ${JSON.stringify(r.errors)} > ${JSON.stringify(r.tolerance)}`);
      } catch (e) {
        if (e.name !== "ContractError" || e.argument !== "variant") throw e;
        declined.push(c.name);
      }
    }
    t.diagnostic(`${ran} cases chunked; declined (speculative rows, no tokens): ${declined.join(" ")}`);
    assert.deepEqual(failures, []);
    assert.ok(declined.every((n) => /^spec-|-T0-/.test(n)), declined.join(" "));
    assert.ok(ran >= 80);
  });
}

test("node/dawn: com.microsoft.GatedDeltaNet test.json with WebGPU's default limits (8 storage buffers: " +
  "the final states start as a copy of the initial ones)", { timeout: 600_000 }, async () => {
  const adapter = await (gpu ??= await nodeGPU()).requestAdapter();
  const small = await adapter.requestDevice();
  assert.equal(small.limits.maxStorageBuffersPerShaderStage, 8);
  const kernel = await loadKernel(path.join(cardsRoot, "com.microsoft.GatedDeltaNet"), { device: small });
  const failures = [];
  for (const c of await kernel.tests()) {
    const r = await runCase(kernel, c);
    if (!r.ok) failures.push(`${c.name}: ${JSON.stringify(r.errors)}`);
  }
  assert.deepEqual(failures, []);
});

test("chromium: every card's test.json in a page", { timeout: 900_000 }, async (t) => {
  const server = await serve(webRoot);
  try {
    const url = new URL(`test/cards.html?cards=${CARDS.join(",")}`, server.url).href;
    const results = await withChromium(url, async (page) => {
      const r = await page.evaluate(() => window.results);
      assert.deepEqual(page.errors, []);
      return r;
    });
    const expected = (await Promise.all(CARDS.map(async (id) => (await load(id)).tests()))).flat().length;
    t.diagnostic(`${results.length} cases`);
    assert.equal(results.length, expected);
    assert.deepEqual(results.filter((r) => !r.ok), []);
  } finally {
    await server.close();
  }
});

// ---- the loader's contract checks: errors name the bind key, before any work ------------------

function gdnInputs(overrides = {}) {
  const T = 4, Hq = 1, Hv = 2, K = 8, V = 8;
  const rand = (n) => Float32Array.from({ length: n }, (_, i) => Math.sin(i + 1));
  return { queryT: { data: rand(T * Hq * K), shape: [T, Hq, K] }, keyT: { data: rand(T * Hq * K), shape: [T, Hq, K] },
    valueT: { data: rand(T * Hv * V), shape: [T, Hv, V] }, decayT: { data: new Float32Array(T * Hv).fill(-0.1), shape: [T, Hv] },
    betaT: { data: new Float32Array(T * Hv).fill(0.5), shape: [T, Hv] }, cuSeqlensT: { data: Int32Array.from([0, 4]), shape: [2] },
    ...overrides };
}

// every refusal, the loader's or a card's host program's, is the loader's one ContractError class
const refuses = async (promise, argument) => {
  await assert.rejects(promise, (e) => e instanceof ContractError && e instanceof Error && e.name === "ContractError" &&
    e.argument === argument, `a ContractError naming ${argument}`);
};

test("loader: contract errors name the bind key or attribute", async () => {
  const gdn = await load("com.microsoft.GatedDeltaNet");
  assert.ok((await gdn(gdnInputs())).outputT.data.every(Number.isFinite));
  await refuses(gdn(gdnInputs({ queryX: { data: new Float32Array(1), shape: [1] } })), "queryX");
  await refuses(gdn(gdnInputs({ keyT: undefined })), "keyT");
  await refuses(gdn(gdnInputs({ betaT: undefined })), "betaT");                       // gated_delta needs it
  await refuses(gdn(gdnInputs(), { attributes: { update_rule: "gated" } }), "betaT");  // and gated refuses it
  await refuses(gdn(gdnInputs(), { attributes: { update_rule: "fast" } }), "update_rule");
  await refuses(gdn(gdnInputs(), { attributes: { state_update_capacity: 9 } }), "state_update_capacity");  // [0, 8]
  await refuses(gdn(gdnInputs(), { attributes: { state_update_capacity: 4 } }), "captureCountT");
  await refuses(gdn(gdnInputs(), { attributes: { gate_activation: "qwen" } }), "aLogT");
  await refuses(gdn(gdnInputs({ valueT: { data: new Float32Array(3 * 2 * 8), shape: [3, 2, 8] } })), "valueT");
  await refuses(gdn(gdnInputs({ decayT: { data: new Uint16Array(8), shape: [4, 2], dtype: "float16" } })), "decayT");
  await refuses(gdn(gdnInputs({ keyT: { data: new Uint16Array(32), shape: [4, 1, 8], dtype: "float16" } })), "keyT");
  await refuses(gdn(gdnInputs({ cuSeqlensT: { data: Float32Array.from([0, 4]), shape: [2] } })), "cuSeqlensT");
  await refuses(gdn(gdnInputs({ queryT: { data: new Float32Array(31), shape: [4, 1, 8] } })), "queryT");
  // ONNX Runtime 1.32's additions: per-key decay, the sigmoid gate's bound, compact capture
  const count = (n) => ({ data: Int32Array.from(Array(n).fill(2)), shape: [n] });
  const capture = { attributes: { state_update_capacity: 2 } };
  await refuses(gdn(gdnInputs({ captureCountT: count(1) })), "captureCountT");          // capacity 0 forbids it
  await refuses(gdn(gdnInputs({ captureCountT: count(2) }), capture), "captureCountT");  // one per request
  await refuses(gdn(gdnInputs({ captureCountT: count(1), stateUpdateActiveT: count(2) }), capture), "stateUpdateActiveT");
  await refuses(gdn(gdnInputs({ captureCountT: count(1) }), { ...capture, variant: "chunked" }), "variant");
  await refuses(gdn(gdnInputs({ decayT: { data: new Float32Array(4 * 2 * 7), shape: [4, 2, 7] } })), "decayT");
  await refuses(gdn(gdnInputs(), { attributes: { gate_lower_bound: 0 } }), "gate_lower_bound");
  const kda = { attributes: { gate_activation: "kda" } };
  const gateParams = (bias) => ({ aLogT: { data: new Float32Array(2), shape: [2] }, dtBiasT: bias });
  await refuses(gdn(gdnInputs(gateParams({ data: new Float32Array(16), shape: [2, 8] })), kda), "dtBiasT");  // per-head decay
  const perKey = { decayT: { data: new Float32Array(4 * 2 * 8).fill(0.3), shape: [4, 2, 8] } };
  await refuses(gdn(gdnInputs({ ...perKey, ...gateParams({ data: new Float32Array(14), shape: [14] }) }), kda), "dtBiasT");
  // two transitions of a per-key kda call: decays exp(-5 sigmoid(0.3)) [2, Hv * K], then the keys as given
  const inputs = gdnInputs({ ...perKey, ...gateParams({ data: new Float32Array(16), shape: [2, 8] }), captureCountT: count(1) });
  const { stateUpdateT } = await gdn(inputs, { attributes: { state_update_capacity: 2, gate_activation: "kda" } });
  assert.deepEqual(stateUpdateT.shape, [1, 2 * (2 * 8 + 1 * 8 + 2 * 8)]);
  const close = (x, y) => Math.abs(x - y) <= 1e-6 * Math.abs(y);
  assert.ok(stateUpdateT.data.subarray(0, 32).every((x) => close(x, Math.exp(-5 / (1 + Math.exp(-0.3))))));
  assert.ok(stateUpdateT.data.subarray(32, 48).every((x, i) => close(x, inputs.keyT.data[i])));
  const rank4 = { queryT: { data: new Float32Array(32), shape: [1, 4, 1, 8] } };
  await refuses(gdn(gdnInputs(rank4)), "cuSeqlensT");                                 // rank 3 only
  const la = await load("deltarule.LinearAttention");
  const base = { qT: { data: new Float32Array(16), shape: [1, 2, 1, 8] }, kT: { data: new Float32Array(16), shape: [1, 2, 1, 8] },
    vT: { data: new Float32Array(16), shape: [1, 2, 1, 8] }, gT: { data: new Float32Array(2), shape: [1, 2, 1] },
    betaT: { data: new Float32Array(2), shape: [1, 2, 1] } };
  await refuses(la({ ...base, gT: { data: Float32Array.from([-1, 0.5]), shape: [1, 2, 1] } }), "gT");
  const slab = { data: new Float32Array(3 * 64), shape: [3, 1, 8, 8] };
  await refuses(la({ ...base, initialStateT: slab, stateIndicesT: { data: Int32Array.from([3]), shape: [1] } }), "stateIndicesT[0]");
  await refuses(la({ ...base, stateIndicesT: { data: Int32Array.from([0]), shape: [1] } }), "stateIndicesT");
  const gate = await load("com.microsoft.LinearAttentionGate");
  const g = { aT: { data: new Float32Array(6), shape: [2, 3] }, dtBiasT: { data: new Float32Array(3), shape: [3] },
    decayScaleT: { data: new Float32Array(3), shape: [3] } };
  await refuses(gate(g, { outputs: ["decayT", "betaT"] }), "betaT");                  // beta requires b
  assert.deepEqual(Object.keys(await gate(g)), ["decayT"]);
  await refuses(gate({ ...g, dtBiasT: { data: new Float32Array(2), shape: [2] } }), "dtBiasT");  // its host program's
  // a resident buffer the shader cannot bind is refused before any GPU work, naming its usage
  // (what only the GPU can refuse, a WebGPUError, is tested in limits.test.js)
  const dev = await nodeDevice();
  const mapped = dev.createBuffer({ size: 32 * 4, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  await assert.rejects(gdn(gdnInputs({ queryT: { buffer: mapped, shape: [4, 1, 8], dtype: "float32" } })),
    (e) => e.name === "ContractError" && e.argument === "queryT" && /usage STORAGE, got usage 9 \(MAP_READ \| COPY_DST\)/.test(e.message));
});

// ---- decode with the state on the device: the slab is updated in place, no state copy ---------

test("loader: device-resident decode keeps the slab in place and matches host calls", async () => {
  const la = await load("deltarule.LinearAttention");
  const dev = await nodeDevice();
  const [S, H, K, V, steps] = [4, 2, 16, 16, 5];
  const rand = (n, seed) => Float32Array.from({ length: n }, (_, i) => Math.sin(seed * 7.1 + i * 1.3));
  const slabData = rand(S * H * K * V, 1);
  const buffer = dev.createBuffer({ size: slabData.byteLength, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST });
  dev.queue.writeBuffer(buffer, 0, slabData);
  let hostSlab = { data: slabData, shape: [S, H, K, V] };
  const rows = { data: Int32Array.from([2, 0]), shape: [2] };
  for (let step = 0; step < steps; step++) {
    const unit = (n, seed) => { const x = rand(n, seed); const norm = Math.hypot(...x.subarray(0, K)); return x.map((v) => v / norm); };
    const inputs = { qT: { data: rand(2 * H * K, 10 + step), shape: [2, 1, H, K] }, kT: { data: unit(2 * H * K, 20 + step), shape: [2, 1, H, K] },
      vT: { data: rand(2 * H * V, 30 + step), shape: [2, 1, H, V] }, gT: { data: new Float32Array(2 * H).fill(-0.05), shape: [2, 1, H] },
      betaT: { data: new Float32Array(2 * H).fill(0.6), shape: [2, 1, H] }, stateIndicesT: rows };
    const resident = await la({ ...inputs, initialStateT: { buffer, shape: [S, H, K, V], dtype: "float32" } }, { resident: true });
    assert.equal(resident.stateT.buffer, buffer, "the slab itself comes back (in place)");
    const host = await la({ ...inputs, initialStateT: hostSlab });
    hostSlab = { data: host.stateT.data, shape: [S, H, K, V] };
    const o = new Float32Array(2 * H * V);
    const read = dev.createBuffer({ size: o.byteLength, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    const enc = dev.createCommandEncoder();
    enc.copyBufferToBuffer(resident.oT.buffer, 0, read, 0, o.byteLength);
    dev.queue.submit([enc.finish()]);
    await read.mapAsync(GPUMapMode.READ);
    o.set(new Float32Array(read.getMappedRange()));
    read.unmap();
    assert.deepEqual(Array.from(o), Array.from(host.oT.data));
  }
  // rows 1 and 3 were never addressed: bit-identical
  const slabNow = new Float32Array(slabData.length);
  const read = dev.createBuffer({ size: slabNow.byteLength, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  const enc = dev.createCommandEncoder();
  enc.copyBufferToBuffer(buffer, 0, read, 0, slabNow.byteLength);
  dev.queue.submit([enc.finish()]);
  await read.mapAsync(GPUMapMode.READ);
  slabNow.set(new Float32Array(read.getMappedRange()));
  const row = (x, r) => Array.from(x.subarray(r * H * K * V, (r + 1) * H * K * V));
  for (const r of [1, 3]) assert.deepEqual(row(slabNow, r), row(slabData, r));
  assert.deepEqual(Array.from(slabNow), Array.from(hostSlab.data));
  assert.notDeepEqual(row(slabNow, 2), row(slabData, 2));
  assert.ok(toFloat32(decodeTensor({ dtype: "float32", shape: [1], data: "AACAPw==" }))[0] === 1);
});

// ---- the checks above can fail: a perturbed expectation, a tampered card ------------------------

test("runCase fails a wrong expectation; loadKernel refuses a file that is not the card's", async (t) => {
  const gate = await load("com.microsoft.LinearAttentionGate");
  const c = structuredClone((await gate.tests())[1]);
  assert.ok((await runCase(gate, c)).ok);
  const expected = decodeTensor(c.expected.decayT);
  expected.data[0] += 0.5;
  c.expected.decayT.data = Buffer.from(expected.data.buffer).toString("base64");
  assert.equal((await runCase(gate, c)).ok, false);
  const copy = fs.mkdtempSync(path.join(webRoot, "test-results-card-"));
  t.after(() => fs.rmSync(copy, { recursive: true, force: true }));
  fs.cpSync(path.join(cardsRoot, "com.microsoft.LinearAttentionGate"), copy, { recursive: true });
  fs.appendFileSync(path.join(copy, "gate.wgsl.jinja"), "\n// edited\n");
  await assert.rejects(loadKernel(copy, { device: await nodeDevice() }), /gate\.wgsl\.jinja does not match/);
});
