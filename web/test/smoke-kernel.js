// A tiny WGSL compute kernel shared by the Node (Dawn) and Chromium smoke tests:
// out[i] = scale * (a[j] + b[j]) where j is i's mirror inside its 64-wide workgroup,
// so the result is only right if the storage buffers, the uniform, workgroup memory
// and workgroupBarrier() all work. Uses only WebGPU globals (GPUBufferUsage, GPUMapMode).
export const N = 1000;
export const WG = 64;

export const WGSL = /* wgsl */ `
struct Params { n: u32, scale: f32 }
@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;
var<workgroup> tile: array<f32, ${WG}>;

@compute @workgroup_size(${WG})
fn main(@builtin(global_invocation_id) gid: vec3u, @builtin(local_invocation_index) li: u32) {
  let i = gid.x;
  var v = 0.0;
  if (i < params.n) { v = a[i] + b[i]; }
  tile[li] = v;
  workgroupBarrier();
  if (i < params.n) { out[i] = params.scale * tile[${WG - 1}u - li]; }
}`;

export function expected(a, b, scale) {
  const n = a.length, want = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    const j = i - (i % WG) + (WG - 1 - (i % WG));
    want[i] = j < n ? Math.fround(scale * Math.fround(a[j] + b[j])) : 0;
  }
  return want;
}

export function describeAdapter(adapter) {
  const { vendor, architecture, device, description, isFallbackAdapter } = adapter.info;
  const l = adapter.limits;
  return {
    vendor, architecture, device, description, isFallbackAdapter,
    maxStorageBuffersPerShaderStage: l.maxStorageBuffersPerShaderStage,
    maxComputeWorkgroupStorageSize: l.maxComputeWorkgroupStorageSize,
    maxComputeInvocationsPerWorkgroup: l.maxComputeInvocationsPerWorkgroup,
    maxStorageBufferBindingSize: l.maxStorageBufferBindingSize,
  };
}

// Runs the kernel on `gpu` (a navigator.gpu) and returns
// { adapter: describeAdapter(...), mismatches, sample, ms }.
export async function runSmoke(gpu, scale = 2) {
  const t0 = performance.now();
  const adapter = await gpu.requestAdapter();
  if (!adapter) throw new Error("requestAdapter() returned null");
  const device = await adapter.requestDevice();
  try {
    const errors = [];
    device.pushErrorScope("validation");
    const a = new Float32Array(N), b = new Float32Array(N);
    for (let i = 0; i < N; i++) { a[i] = i * 0.5; b[i] = 1000 - i * 0.25; }
    const upload = (bytes, usage) => {
      const buf = device.createBuffer({ size: bytes.byteLength, usage, mappedAtCreation: true });
      new Uint8Array(buf.getMappedRange()).set(new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength));
      buf.unmap();
      return buf;
    };
    const params = new ArrayBuffer(16);
    new Uint32Array(params, 0, 1)[0] = N;
    new Float32Array(params, 4, 1)[0] = scale;
    const bufA = upload(a, GPUBufferUsage.STORAGE);
    const bufB = upload(b, GPUBufferUsage.STORAGE);
    const bufP = upload(new Uint8Array(params), GPUBufferUsage.UNIFORM);
    const bufOut = device.createBuffer({ size: N * 4, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC });
    const bufRead = device.createBuffer({ size: N * 4, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });

    const module = device.createShaderModule({ code: WGSL });
    for (const m of (await module.getCompilationInfo()).messages) {
      if (m.type === "error") errors.push(`WGSL ${m.lineNum}:${m.linePos} ${m.message}`);
    }
    const pipeline = await device.createComputePipelineAsync({ layout: "auto", compute: { module, entryPoint: "main" } });
    const bindGroup = device.createBindGroup({
      layout: pipeline.getBindGroupLayout(0),
      entries: [bufA, bufB, bufOut, bufP].map((buffer, binding) => ({ binding, resource: { buffer } })),
    });
    const enc = device.createCommandEncoder();
    const pass = enc.beginComputePass();
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, bindGroup);
    pass.dispatchWorkgroups(Math.ceil(N / WG));
    pass.end();
    enc.copyBufferToBuffer(bufOut, 0, bufRead, 0, N * 4);
    device.queue.submit([enc.finish()]);
    const err = await device.popErrorScope();
    if (err) errors.push(err.message);
    if (errors.length) throw new Error(errors.join("\n"));

    await bufRead.mapAsync(GPUMapMode.READ);
    const got = new Float32Array(bufRead.getMappedRange().slice(0));
    bufRead.unmap();
    const want = expected(a, b, scale);
    let mismatches = 0;
    for (let i = 0; i < N; i++) if (got[i] !== want[i]) mismatches++;
    return {
      adapter: describeAdapter(adapter),
      mismatches,
      sample: Array.from(got.subarray(0, 4)),
      want: Array.from(want.subarray(0, 4)),
      ms: Math.round(performance.now() - t0),
    };
  } finally {
    device.destroy();
  }
}
