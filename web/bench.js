// The cards' bench.json in WebGPU: prefill per variant (recurrent, chunked) and decode steps per
// second with the state on the device. Used by demo.html and, in Node, by
// `node bench.js CARD_FOLDER` (Dawn; prints the table as JSON lines).
//
// Inputs are drawn once, uploaded once and passed as GPUBuffers; each call runs resident (no
// read-back) and is timed to the end of its GPU work (queue.onSubmittedWorkDone). Decode on
// deltarule.LinearAttention updates its slab in place (stateIndicesT): no state copy per step.
// com.microsoft.GatedDeltaNet's contract keeps initialStateT and finalStateT apart, so its
// decode swaps the two buffers between steps (finalStateT is written from initialStateT's rows).

function draw(bind, shape, seed) {
  const n = shape.reduce((a, b) => a * b, 1);
  const x = new Float32Array(n);
  let s = seed * 2654435761 >>> 0;
  const next = () => ((s = (s * 1664525 + 1013904223) >>> 0) / 4294967296);
  const gate = /^(decay|g|gk)T$/.test(bind), rate = /^(beta|erase|write)T$/.test(bind);
  for (let i = 0; i < n; i++) {
    const u = next();
    x[i] = gate ? -0.01 - 0.09 * u : rate ? u : 2 * u - 1;
  }
  if (bind === "keyT" || bind === "kT") {             // unit keys per head: the delta rule's conditioning
    const K = shape.at(-1);
    for (let i = 0; i < n; i += K) {
      let norm = 0;
      for (let j = 0; j < K; j++) norm += x[i + j] ** 2;
      for (let j = 0; j < K; j++) x[i + j] /= Math.sqrt(norm);
    }
  }
  return x;
}

function upload(device, data) {
  const buffer = device.createBuffer({ size: Math.max(4, data.byteLength),
    usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST });
  device.queue.writeBuffer(buffer, 0, data);
  return buffer;
}

function release(outputs, keep) {
  for (const t of Object.values(outputs)) if (!keep.includes(t.buffer)) t.buffer.destroy();
}

async function timed(fn) {
  const t0 = performance.now();
  await fn();
  return performance.now() - t0;
}

/**
 * Time every bench.json case of a loaded card.
 * @returns rows { case, kind, variant, tokens, ms (median per call or step), tokensPerSecond }
 */
export async function benchCard(kernel, { repeat = 3, variants } = {}) {
  const device = kernel.device;
  const names = variants ?? kernel.metadata.variants.map((v) => v.name);
  const rows = [];
  for (const c of await kernel.bench()) {
    const inputs = {};
    let seed = 1;
    for (const [bind, shape] of Object.entries(c.shapes)) {
      const data = draw(bind, shape, seed++);
      const onHost = kernel.manifest.inputs.find((x) => x.bind === bind).host;   // per-head parameters
      inputs[bind] = onHost ? { data, shape } : { buffer: upload(device, data), shape, dtype: c.dtype };
    }
    const keep = Object.values(inputs).map((t) => t.buffer).filter(Boolean);
    if (c.kind === "decode") {
      const slab = kernel.manifest.inputs.some((x) => x.bind === "stateIndicesT");
      const extra = slab ? { stateIndicesT: { data: Int32Array.from([0]), shape: [1] } } : {};
      const step = async () => {
        const out = await kernel({ ...inputs, ...extra }, { resident: true });
        if (!slab) {                                  // the next step starts from this one's state
          release({ outputT: out.outputT }, keep);
          inputs.initialStateT.buffer.destroy();
          keep.splice(keep.indexOf(inputs.initialStateT.buffer), 1, out.finalStateT.buffer);
          inputs.initialStateT = out.finalStateT;
        } else {
          release({ oT: out.oT }, keep);
        }
      };
      await step();
      const ms = await timed(async () => { for (let i = 0; i < c.steps; i++) await step(); });
      rows.push({ case: c.name, kind: "decode", variant: "recurrent", tokens: c.steps, ms: ms / c.steps,
        tokensPerSecond: (1000 * c.steps) / ms });
    } else {
      const q = c.shapes.queryT ?? c.shapes.qT;
      const tokens = q ? q.slice(0, -2).reduce((a, b) => a * b, 1) : c.shapes.aT[0];
      for (const variant of names) {
        const call = async () => release(await kernel(inputs, { resident: true, variant }), keep);
        await call();                                 // compile and warm up
        const times = [];
        for (let i = 0; i < repeat; i++) times.push(await timed(call));
        times.sort((a, b) => a - b);
        const ms = times[Math.floor(times.length / 2)];
        rows.push({ case: c.name, kind: c.kind ?? "call", variant, tokens, ms, tokensPerSecond: (1000 * tokens) / ms });
      }
    }
    for (const b of keep) b.destroy();
  }
  return rows;
}

// `node bench.js CARD_FOLDER [repeat]`: the table from Dawn (SwiftShader here), one JSON line per row
if (typeof process !== "undefined" && process.argv[1] && import.meta.url === (await import("node:url")).pathToFileURL(process.argv[1]).href) {
  const { nodeGPU } = await import("./tools/gpu.js");
  const { loadKernel, requestDevice } = await import("./deltarule-kernels.js");
  const gpu = await nodeGPU();
  const device = await requestDevice(gpu);
  const kernel = await loadKernel(process.argv[2], { device });
  for (const row of await benchCard(kernel, { repeat: Number(process.argv[3] ?? 3) })) console.log(JSON.stringify(row));
  const info = gpu && (await gpu.requestAdapter()).info;
  console.log(JSON.stringify({ adapter: `${info.vendor} ${info.architecture} ${info.description}` }));
  process.exit(0);
}
