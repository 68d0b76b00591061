// Shared host code of deltarule's kernel cards: the recurrent shader's specialization,
// its sequence table and dispatch plan (the JavaScript twin of
// deltarule/kernels/wgsl/recurrent.py), float16 / bfloat16 narrowing, errors.
//
// A host program turns a validated call into a plan the loader executes:
//   { outputs: { bind: { dtype, shape, alias?, copy?, zero? } },  // alias: that input's buffer (in
//                                                              // place); copy: starts as a copy of
//                                                              // that input; zero: starts as zeros
//     buffers: { name: { bytes, copy?: bind } },             // float32 scratch, zero or copied
//     passes: [ { template, spec, grid, workgroup: { invocations, bytes }, bindings: { slot: ref } } ],
//     finish: [ passes run after those ] }
// with ref one of { input: bind }, { output: bind }, { buffer: name },
// { uniform: ArrayBuffer }, { storage: TypedArray } (read-only data made on the host).

// The loader's ContractError and numel (web/deltarule-kernels.js, their one definition): a card
// folder cannot import from wherever the loader lives, so the loader hands them over with `link`
// (every host.js re-exports it) before each `plan`; a host program's refusals are the loader's
// own ContractError(argument, expected, actual, limit?).
export let ContractError, numel;

export function link(loader) {
  ({ ContractError, numel } = loader);
}

export const SHADER_DTYPES = { float32: "f32", float16: "f16", bfloat16: "bf16" };
export const BYTES = { float32: 4, float16: 2, bfloat16: 2, int32: 4 };
export const NO_ROW = 0xffffffff;
// lavapipe ends any shader loop after 65535 iterations: longer sequences run in segments
export const SEGMENT = 32768;
const MAX_WORKGROUP = 256;
const KEYS_PER_INVOCATION = 16;
// The card's own bounds (docs/web.md, "Sizes a card serves"): both shaders unroll their key loops
// in the template (the recurrent shader keeps ceil(K / 8) keys per invocation in registers, the
// chunked pass 2 a vec4 per key) and the recurrent one its query group inside that, so WGSL size and
// compile time grow with K and with K x G: on SwiftShader K = 256 compiles in 0.6 s (recurrent) and
// 70 s (chunked), K = 512 chunked over 5 minutes, G = 128 at K = 128 in 90 s.
export const MAX_KEYS = 256;
export const MAX_GROUP = 16;

export const same = (a, b) => a.length === b.length && a.every((x, i) => x === b[i]);
export const show = (shape) => `[${shape.join(", ")}]`;

// (KS, BV): key slices per value column, value columns per workgroup (recurrent.py's tiling)
export function tiling(K, V, G, retrieves, l2norm, workgroupBytes) {
  const log2ceil = (x) => Math.ceil(Math.log2(x));
  const KS = Math.min(8, 1 << Math.max(0, log2ceil(Math.ceil(K / KEYS_PER_INVOCATION))));
  let BV = Math.min(32, 1 << log2ceil(V), MAX_WORKGROUP / KS);
  const [NR, NS] = sums(G, retrieves, l2norm);
  while (BV > 1 && 4 * 2 * (NR * KS * BV + NS * KS) > workgroupBytes) BV /= 2;
  return [KS, BV];
}

function sums(G, retrieves, l2norm) {
  return [G + (retrieves ? 1 : 0), G + (l2norm ? 1 + G : 0)];
}

// The recurrent shader's specialization (recurrent.py's `specialization`).
// p: { K, V, G, Hq, Hk, Hv, layout, dtypes: { qkv, g, gk, b, w }, retrieves, bPerKey, rawGate,
//      gateFn ("softplus" default, or "sigmoid": the bounded KDA gate), sigmoid, l2norm, owners,
//      speculative, stateIn, capacity (compact capture: transitions per row, 0 for none),
//      captureInOut (the capture rows in the output buffer from element captureBase) }
export function recurrentSpec(p, limits) {
  const [KS, BV] = tiling(p.K, p.V, p.G, p.retrieves, p.l2norm, limits.maxComputeWorkgroupStorageSize);
  const [NR, NS] = sums(p.G, p.retrieves, p.l2norm);
  const d = (x) => (x ? SHADER_DTYPES[x] : "");
  return {
    K: p.K, V: p.V, KS, KC: Math.ceil(p.K / KS), BV, G: p.G, HQ: p.Hq, HK: p.Hk, HV: p.Hv, NR, NS,
    layout: p.layout, dt_qkv: d(p.dtypes.qkv),
    has_g: !!p.dtypes.g, dt_g: d(p.dtypes.g), has_gk: !!p.dtypes.gk, dt_gk: d(p.dtypes.gk),
    has_b: !!p.dtypes.b, dt_b: d(p.dtypes.b), b_per_key: !!p.bPerKey,
    has_w: !!p.dtypes.w, dt_w: d(p.dtypes.w), w_per_value: !!p.dtypes.w,
    raw_gate: p.rawGate || "", gate_fn: p.gateFn || "softplus", sigmoid: !!p.sigmoid, l2norm: !!p.l2norm,
    has_owner: !!p.owners, speculative: !!p.speculative, state_in: !!p.stateIn, capture: p.capacity || 0,
    capture_in_out: !!p.captureInOut,
  };
}

// The sizes every variant needs, checked before any GPU work (ContractError naming the argument,
// the bound and where it comes from). p.names: the argument that sets K, G, Hv, V and the
// sequence count. Per-variant bounds (value tiles, speculative segments) are in the passes below;
// the loader checks buffer sizes and every pass's grid and workgroup against the device again.
export function checkSizes(p, live, limits) {
  const n = p.names;
  if (p.K > MAX_KEYS) {
    throw new ContractError(n.K, `a key head size K <= ${MAX_KEYS} (the card's bound: the shaders unroll the key ` +
      "loop)", `K = ${p.K}`, { name: "card MAX_KEYS", value: MAX_KEYS });
  }
  if (p.G > MAX_GROUP) {
    throw new ContractError(n.G, `at most ${MAX_GROUP} query heads per state head (the card's bound: the recurrent ` +
      "shader unrolls the query group)", `G = Hq / Hv = ${p.G}`, { name: "card MAX_GROUP", value: MAX_GROUP });
  }
  const wg = limits.maxComputeWorkgroupsPerDimension;
  if (p.Hv > wg) {
    throw new ContractError(n.Hv, `at most ${wg} value heads (the adapter's maxComputeWorkgroupsPerDimension: a ` +
      "workgroup row per head)", `Hv = ${p.Hv}`, { name: "maxComputeWorkgroupsPerDimension", value: wg });
  }
  if (live > wg) {
    throw new ContractError(n.sequences, `at most ${wg} live sequences (the adapter's ` +
      "maxComputeWorkgroupsPerDimension: a workgroup layer per sequence)", `${live} sequences`,
    { name: "maxComputeWorkgroupsPerDimension", value: wg });
  }
}

// Output owners: the live sequence that writes each token (later sequences win where clamped
// spans overlap), as positions among the live sequences; NO_ROW for none. Null when no two
// live spans overlap (the shader then writes every token it runs).
export function owners(spans, B, T) {
  const busy = spans.filter((s) => s.live && s.end > s.start)
    .map((s) => [s.row * T + s.start, s.row * T + s.end]).sort((a, b) => a[0] - b[0]);
  if (!busy.some((x, i) => i > 0 && x[0] < busy[i - 1][1])) return null;
  const owner = new Uint32Array(B * T).fill(NO_ROW);
  let position = 0;
  for (const s of spans) {
    if (!s.live) continue;
    owner.fill(position, s.row * T + s.start, s.row * T + s.end);
    position += 1;
  }
  return owner;
}

// Every token owned by a live sequence (else the zero-initialized output keeps zeros there).
export function covered(spans, B, T) {
  const seen = new Uint8Array(B * T);
  for (const s of spans) if (s.live) seen.fill(1, s.row * T + s.start, s.row * T + s.end);
  return seen.every((x) => x === 1);
}

// One uint32 table of both shaders from its named parts in order, then the owners, the raw
// gate's A_log (followed by the sigmoid gate's lower bound) / dt_bias bits and the capture
// entries where present; `at` holds each part's offset (0 when absent).
function packTable(parts, owner, gates, captures = null) {
  const all = { ...parts };
  if (owner !== null) all.owner = owner;
  if (gates) {
    all.aLog = new Uint32Array(Float32Array.from([...gates.aLog, gates.bound ?? 0]).buffer);
    all.dtBias = new Uint32Array(Float32Array.from(gates.dtBias).buffer);
  }
  if (captures) all.captures = captures;
  const at = { owner: 0, aLog: 0, dtBias: 0, captures: 0 };
  let size = 0;
  for (const [name, x] of Object.entries(all)) { at[name] = size; size += x.length; }
  const table = new Uint32Array(size);
  for (const [name, x] of Object.entries(all)) table.set(x, at[name]);
  return { table, at };
}

// The passes of one recurrence over the live spans: spans [{ row, start, end, read, live }],
// rows: the state buffer row of each live span; tokenRows: speculative per-token rows
// (Uint32Array [live, L]) or null; gates: { aLog, dtBias, bound? } float32 arrays (and the
// sigmoid gate's lower bound) for the raw-gate arm; captures: with p.capacity, per live span
// [capture row, transitions to capture] (the shader's capture buffer is bindings[12]).
export function recurrentPasses(p, spans, rows, tokenRows, gates, bindings, limits, captures = null) {
  const live = spans.filter((s) => s.live);
  if (!live.length || !(p.B * p.T)) return [];
  const owner = owners(spans, p.B, p.T);
  const spec = recurrentSpec({ ...p, owners: owner !== null, speculative: tokenRows !== null }, limits);
  const grid = [Math.ceil(p.V / spec.BV), p.Hv, live.length];
  const wg = limits.maxComputeWorkgroupsPerDimension;
  if (grid[0] > wg) {
    throw new ContractError(p.names.V, `a value head size V <= ${wg * spec.BV} (the adapter's ` +
      `maxComputeWorkgroupsPerDimension ${wg} x ${spec.BV} value columns per workgroup)`, `V = ${p.V}`,
    { name: "maxComputeWorkgroupsPerDimension", value: wg });
  }
  const maxLen = Math.max(1, ...live.map((s) => s.end - s.start));
  // a speculative sequence stores a row per token and reads one at the start: one dispatch each
  if (tokenRows !== null && maxLen > SEGMENT) {
    throw new ContractError(p.names.speculative, `speculative (2-D) rows for sequences of at most ${SEGMENT} tokens ` +
      "(one dispatch per sequence: the shader's segment)", `a live sequence of ${maxLen} tokens`,
    { name: "card SEGMENT", value: SEGMENT });
  }
  const passes = [];
  for (let skip = 0; skip < maxLen; skip += SEGMENT) {
    const seqs = new Uint32Array(4 * live.length);
    live.forEach((s, i) => {
      seqs[4 * i] = s.row * p.T + s.start + skip;
      seqs[4 * i + 1] = Math.min(Math.max(s.end - s.start - skip, 0), SEGMENT);
      seqs[4 * i + 2] = rows[i];
    });
    const parts = { seqs };
    if (tokenRows !== null) {
      const L = tokenRows.length / live.length;
      live.forEach((_, i) => { seqs[4 * i + 3] = seqs.length + i * L; });
      parts.tokenRows = tokenRows;
    }
    const { table, at } = packTable(parts, owner, gates, captures && captureEntries(captures, skip));
    const params = new ArrayBuffer(32);
    new Uint32Array(params, 0, 4).set([p.B * p.T, at.owner, at.aLog, at.dtBias]);
    new Float32Array(params, 16, 2).set([p.scale, p.eps]);
    new Uint32Array(params, 24, 2).set([at.captures, p.captureBase || 0]);
    passes.push({ template: "recurrent.wgsl.jinja", spec, grid,
      workgroup: { invocations: spec.KS * spec.BV, bytes: 4 * 2 * (spec.NR * spec.KS * spec.BV + spec.NS * spec.KS) },
      bindings: { 0: { uniform: params }, 1: { storage: table }, ...bindings } });
  }
  return passes;
}

// The table's capture entries of the segment starting at token `skip` of each sequence
// (recurrent.py's `capture_entries`): capture row, transitions past skip (of the segment), skip.
function captureEntries(captures, skip) {
  const entries = new Uint32Array(4 * captures.length);
  captures.forEach(([row, count], i) => entries.set([row, Math.min(Math.max(count - skip, 0), SEGMENT), skip], 4 * i));
  return entries;
}

// `count` float32 elements of a buffer from element `first` into an output of `dtype` (narrowed
// to 16 bits, or copied for float32), two elements per invocation; dtype "zero": `count` zeros
// into `to` from element `first` (`from` unused).
export function narrowPass(dtype, count, from, to, limits, first = 0) {
  const groups = Math.ceil(Math.ceil(count / 2) / 256);
  const nx = Math.max(1, Math.min(groups, limits.maxComputeWorkgroupsPerDimension));
  const params = new ArrayBuffer(16);
  new Uint32Array(params).set([count, nx * 256, first]);
  const bindings = dtype === "zero" ? { 0: { uniform: params }, 2: to } : { 0: { uniform: params }, 1: from, 2: to };
  return { template: "narrow.wgsl.jinja", spec: { dtype: dtype === "zero" ? "zero" : SHADER_DTYPES[dtype] },
    grid: [nx, Math.max(1, Math.ceil(groups / nx)), 1], workgroup: { invocations: 256, bytes: 0 }, bindings };
}

// Where a shader writes a float32 result for output `bind` of `dtype`: the output itself
// (float32), or a scratch buffer narrowed into it afterwards.
export function resultTarget(bind, dtype, count, plan, limits) {
  if (dtype === "float32") return { output: bind };
  const name = `${bind}:float32`;
  plan.buffers[name] = { bytes: 4 * count };
  plan.finish.push(narrowPass(dtype, count, { buffer: name }, { output: bind }, limits));
  return { buffer: name };
}

export function finite(x) {
  return Number.isFinite(x) && Math.abs(x) <= 3.4028234663852886e38;
}

// ---- the chunked prefill (deltarule/kernels/wgsl/chunked.py's twin) -----------------------------
// Two passes per segment: chunked_intra (per chunk slot and head: the state-free WY / UT part
// into a float32 scratch) and chunked_state (per value tile, head and sequence: the chunks in
// order, the state in place). "auto" takes it where a sequence has at least CHUNKED_MIN_TOKENS
// tokens (the Python backend's threshold, measured on lavapipe: docs/wgsl.md).
const MIN_CHUNK = 16, MAX_CHUNK = 64, INTRA_WORKGROUP = 256, UNROLL = 4, LOOP_BUDGET = 60000;
const SCRATCH_BYTES = 64 << 20;
export const CHUNKED_MIN_TOKENS = 128;

const padTo = (x, m) => Math.ceil(x / m) * m;

// both passes' workgroup memory: pass 1's A by columns, per-row norms and gates; pass 2's U and
// Q^ S columns of BV values
function intraFloats(C, G) {
  const CQ = C / 4;
  return C * C - 8 * CQ * (CQ - 1) + C * (G + 4);
}

function fits(C, G, BV, workgroupBytes) {
  return 4 * Math.max(intraFloats(C, G), BV * C * (1 + G)) <= workgroupBytes;
}

function chunkLength(chunkSize, G, workgroupBytes) {
  let C = Math.min(MAX_CHUNK, Math.max(MIN_CHUNK, 1 << Math.max(0, Math.ceil(Math.log2(Math.max(chunkSize, 1))))));
  while (C > MIN_CHUNK && !fits(C, G, 4, workgroupBytes)) C /= 2;
  return C;
}

function chunkedTiling(p, workgroupBytes) {
  const C = chunkLength(p.chunkSize, p.G, workgroupBytes);
  let BV = Math.max(4, Math.min(32, 1 << Math.ceil(Math.log2(p.V))));
  while (BV > 4 && 4 * BV * C * (1 + p.G) > workgroupBytes) BV /= 2;
  return { C, KP: padTo(p.K, UNROLL), VP: padTo(p.V, BV), BV };
}

function blockFloats(C, KP, VP, G, perKey) {
  return C * VP + 3 * C * KP + G * C * KP + G * C * C + KP + (perKey ? 2 * C * KP : 0);
}

// chunks per sequence per segment; 0: the call does not fit (use the recurrence)
function segmentChunks(p, live, limits) {
  const t = chunkedTiling(p, limits.maxComputeWorkgroupStorageSize);
  const perSeq = Math.floor(LOOP_BUDGET / (3 * t.C + 1));
  const block = 4 * p.Hv * blockFloats(t.C, t.KP, t.VP, p.G, !!p.dtypes.gk);
  const slots = Math.min(Math.floor(Math.min(SCRATCH_BYTES, limits.maxStorageBufferBindingSize) / block),
    limits.maxComputeWorkgroupsPerDimension);
  return Math.min(perSeq, Math.floor(slots / Math.max(live, 1)));
}

// Why the chunked form cannot run this call (null: it can). p.bindings: pass 1's storage buffers.
export function chunkedRefusal(p, spans, speculative, limits) {
  if (speculative) return "speculative plans run token by token";
  const live = spans.filter((s) => s.live).length;
  if (5 + ["g", "gk", "b", "w"].filter((x) => p.dtypes[x]).length > limits.maxStorageBuffersPerShaderStage) {
    return "more storage buffers than the device allows";
  }
  if (!(p.B * p.T)) return "no tokens";
  const t = chunkedTiling(p, limits.maxComputeWorkgroupStorageSize);
  if (!fits(t.C, p.G, t.BV, limits.maxComputeWorkgroupStorageSize)) return "a query group too large for workgroup memory";
  if (t.VP / t.BV > limits.maxComputeWorkgroupsPerDimension) return "more value tiles than workgroups per dimension";
  if (segmentChunks(p, live, limits) < 1) return "the scratch of one chunk per sequence does not fit";
  return null;
}

export function chunkedWins(p, spans) {
  return Math.max(0, ...spans.filter((s) => s.live).map((s) => s.end - s.start)) >= CHUNKED_MIN_TOKENS;
}

// The passes of the chunked form; inputs: { 4: q, 5: k, 6: v, 7: g, 8: gk, 9: b, 10: w } refs,
// state and out refs, the scratch added to plan.buffers.
export function chunkedPasses(p, spans, rows, gates, inputs, state, out, plan, limits) {
  const live = spans.filter((s) => s.live);
  if (!live.length) return [];
  const t = chunkedTiling(p, limits.maxComputeWorkgroupStorageSize);
  const d = (x) => (x ? SHADER_DTYPES[x] : "");
  const common = { K: p.K, V: p.V, KP: t.KP, VP: t.VP, C: t.C, G: p.G, HV: p.Hv, retrieves: !!p.retrieves,
    per_key: !!p.dtypes.gk, decays: !!(p.dtypes.g || p.dtypes.gk) };
  const intra = { ...common, HQ: p.Hq, HK: p.Hk, WG: INTRA_WORKGROUP, dt_qkv: d(p.dtypes.qkv),
    has_g: !!p.dtypes.g, dt_g: d(p.dtypes.g), has_gk: !!p.dtypes.gk, dt_gk: d(p.dtypes.gk),
    has_b: !!p.dtypes.b, dt_b: d(p.dtypes.b), b_per_key: !!p.bPerKey, has_w: !!p.dtypes.w, dt_w: d(p.dtypes.w),
    raw_gate: p.rawGate || "", gate_fn: p.gateFn || "softplus", sigmoid: !!p.sigmoid, l2norm: !!p.l2norm };
  const owner = owners(spans, p.B, p.T);
  const stateSpec = { ...common, BV: t.BV, layout: p.layout, has_owner: owner !== null };
  const perSeq = segmentChunks(p, live.length, limits);
  const segTokens = perSeq * t.C;
  const block = blockFloats(t.C, t.KP, t.VP, p.G, !!p.dtypes.gk);
  const maxLen = Math.max(1, ...live.map((s) => s.end - s.start));
  const passes = [];
  let slotsMax = 1;
  for (let skip = 0; skip < maxLen; skip += segTokens) {
    const seqs = new Uint32Array(4 * live.length);
    const chunks = [];
    live.forEach((s, i) => {
      const length = Math.min(Math.max(s.end - s.start - skip, 0), segTokens);
      const first = s.row * p.T + s.start + skip;
      const count = Math.ceil(length / t.C);
      seqs.set([chunks.length / 2, count, rows[i], 0], 4 * i);
      for (let c = 0; c < count; c++) chunks.push(first + c * t.C, Math.min(t.C, length - c * t.C));
    });
    const { table, at } = packTable({ seqs, chunks: Uint32Array.from(chunks) }, owner, gates);
    const params = new ArrayBuffer(32);
    new Uint32Array(params, 0, 5).set([p.B * p.T, at.chunks, at.owner, at.aLog, at.dtBias]);
    new Float32Array(params, 20, 3).set([1.0, p.scale, p.eps]);
    const slots = chunks.length / 2;
    slotsMax = Math.max(slotsMax, slots);
    const head = { 0: { uniform: params }, 1: { storage: table }, 2: { buffer: "chunked:scratch" } };
    if (slots) {
      passes.push({ template: "chunked_intra.wgsl.jinja", spec: intra, grid: [slots, p.Hv, 1],
        workgroup: { invocations: INTRA_WORKGROUP, bytes: 4 * intraFloats(t.C, p.G) }, bindings: { ...head, ...inputs } });
    }
    passes.push({ template: "chunked_state.wgsl.jinja", spec: stateSpec, grid: [t.VP / t.BV, p.Hv, live.length],
      workgroup: { invocations: t.BV / 4, bytes: 4 * t.BV * t.C * (1 + p.G) }, bindings: { ...head, 3: state, 4: out } });
  }
  plan.buffers["chunked:scratch"] = { bytes: padTo(4 * block * p.Hv * slotsMax, 16) };
  return passes;
}
