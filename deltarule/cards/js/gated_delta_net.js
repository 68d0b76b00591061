// Host program of com.microsoft.GatedDeltaNet: shapes, requests, and the recurrent dispatch.
// The loader has checked presence, dtypes and ranks against manifest.json; this checks the
// shapes (errors name the bind key) and plans the passes. Semantics: deltarule's ONNX Runtime
// adapter (deltarule/contracts/ort.py, gated_delta_net) on the "vk" state layout, with ONNX
// Runtime 1.32's per-key decay, bounded sigmoid ("kda") gate and compact transition capture.
import {
  checkSizes, chunkedPasses, chunkedRefusal, chunkedWins, ContractError, finite, narrowPass, numel, recurrentPasses,
  resultTarget, same, show,
} from "./common.js";

export { link } from "./common.js";     // takes the loader's ContractError and numel before each plan

export function plan({ inputs, attributes, variant, limits }) {
  const q = inputs.queryT, k = inputs.keyT, v = inputs.valueT;
  const a = attributes;
  const lead = q.shape.slice(0, -2);
  const [Hq, Dk] = q.shape.slice(-2);
  if (Hq < 1 || Dk < 1) throw new ContractError("queryT", "num_heads_q >= 1 and head_size_qk >= 1", show(q.shape));
  if (!same(k.shape, q.shape)) throw new ContractError("keyT", `queryT's shape ${show(q.shape)}`, show(k.shape));
  if (v.shape.length !== q.shape.length || !same(v.shape.slice(0, -2), lead) || v.shape.at(-1) < 1) {
    throw new ContractError("valueT", `(${lead.join(", ")}, num_heads_v, head_size_v)`, show(v.shape));
  }
  const [Hv, Dv] = v.shape.slice(-2);
  if (Hv < 1 || Hv % Hq) throw new ContractError("valueT", `num_heads_v a positive multiple of ${Hq}`, Hv);
  const total = numel(lead);
  if (total < 1) throw new ContractError("queryT", "at least one token", show(q.shape));
  if (!finite(a.scale)) throw new ContractError("scale", "a float finite in float32", a.scale);
  if (!finite(a.gate_lower_bound) || a.gate_lower_bound >= 0) {
    throw new ContractError("gate_lower_bound", "a negative float finite in float32", a.gate_lower_bound);
  }

  // requests: cu_seqlens (clamped), uniform packing from initial_state, or the rank-4 batch
  const s0 = inputs.initialStateT;
  let N, B, S, spans;
  if (inputs.cuSeqlensT) {
    const cu = inputs.cuSeqlensT.data;
    if (cu.length < 2) throw new ContractError("cuSeqlensT", "at least 2 entries", show(inputs.cuSeqlensT.shape));
    N = cu.length - 1; B = 1; S = total;
    const c = Array.from(cu, (x) => Math.min(Math.max(x, 0), total));
    spans = c.slice(0, -1).map((start, n) => ({ row: 0, start, end: Math.max(start, c[n + 1]), live: true }));
  } else {
    if (lead.length === 1) {
      if (!s0) throw new ContractError("initialStateT", "present when cuSeqlensT is absent from the rank-3 " +
        "form (it gives the batch size)", "absent");
      N = s0.shape[0];
      if (N < 1 || total % N) throw new ContractError("initialStateT", `a batch size dividing total_tokens = ${total}`, N);
      B = N; S = total / N;
    } else {
      [B, S] = lead; N = B;
    }
    spans = Array.from({ length: B }, (_, b) => ({ row: b, start: 0, end: S, live: true }));
  }
  const stateShape = [N, Hv, Dv, Dk];
  if (s0 && !same(s0.shape, stateShape)) {
    throw new ContractError("initialStateT", `(batch, num_heads_v, head_size_v, head_size_qk) = ${show(stateShape)}`,
      show(s0.shape));
  }
  const d = inputs.decayT;
  if (d && !same(d.shape, [...lead, Hv]) && !same(d.shape, [...lead, Hv, Dk])) {
    throw new ContractError("decayT", `${show([...lead, Hv])} or, per key, ${show([...lead, Hv, Dk])}`, show(d.shape));
  }
  const perKey = !!d && d.shape.length === lead.length + 2;
  if (inputs.betaT && !same(inputs.betaT.shape, [...lead, Hv])) {
    throw new ContractError("betaT", show([...lead, Hv]), show(inputs.betaT.shape));
  }
  const gateFn = GATE_FUNCTIONS[a.gate_activation];
  let gates = null;
  if (gateFn) gates = rawGates(inputs, a, Hv, Dk, perKey);
  const capture = captures(inputs, a, spans, N, { Hq, Hv, Dk, Dv, perKey });

  const dtype = q.dtype;
  const outShape = [...lead, Hv, Dv];
  const plan = {
    outputs: { outputT: { dtype, shape: outShape }, finalStateT: { dtype: "float32", shape: stateShape } },
    buffers: {}, passes: [], finish: [],
  };
  // entries past each request's captured prefix stay zero (ONNX Runtime leaves them unspecified)
  if (capture) plan.outputs.stateUpdateT = { dtype: "float32", shape: capture.shape, zero: true };
  const p = {
    B, T: S, K: Dk, V: Dv, G: 1, Hq, Hk: Hq, Hv, layout: "vk",
    dtypes: { qkv: dtype, g: d && !perKey ? "float32" : null, gk: perKey ? "float32" : null,
      b: inputs.betaT ? "float32" : null },
    retrieves: !!inputs.betaT, rawGate: gateFn ? (perKey ? "gk" : "g") : "", gateFn: gateFn || "softplus",
    sigmoid: a.beta_activation === "sigmoid" && !!inputs.betaT, l2norm: a.qk_l2_norm !== 0,
    scale: a.scale === 0 ? 1 / Math.sqrt(Dk) : a.scale, eps: gateFn === "sigmoid" ? KDA_L2NORM_EPS : L2NORM_EPS,
    chunkSize: Math.max(1, a.chunk_size),
    names: { K: "queryT", G: "queryT", Hv: "valueT", V: "valueT",
      sequences: inputs.cuSeqlensT ? "cuSeqlensT" : lead.length === 1 ? "initialStateT" : "queryT" },
  };
  checkSizes(p, spans.length, limits);
  const bindings = { 2: { output: "finalStateT" }, 4: { input: "queryT" }, 5: { input: "keyT" },
    6: { input: "valueT" } };
  if (d) bindings[perKey ? 8 : 7] = { input: "decayT" };
  if (inputs.betaT) bindings[9] = { input: "betaT" };
  const rows = spans.map((_, n) => n);
  const capturing = !!capture && capture.counts.some((c) => c > 0);
  // the storage buffers of the recurrence: table, state, output, q, k, v, the gates, the capture
  const used = 6 + (d ? 1 : 0) + (inputs.betaT ? 1 : 0) + (capturing ? 1 : 0);
  const maxBuffers = limits.maxStorageBuffersPerShaderStage;        // WebGPU guarantees 8: the call without a capture fits
  if (capturing) p.capacity = a.state_update_capacity;
  if (capturing && used <= maxBuffers) {
    bindings[12] = { output: "stateUpdateT" };
    bindings[3] = resultTarget("outputT", dtype, numel(outShape), plan, limits);
  } else if (capturing) {
    // no storage buffer to spare (WebGPU's default 8): the capture rows follow the outputs in one
    // float32 buffer, zeroed first, and are copied out after the recurrence
    bindings[3] = sharedTarget(dtype, numel(outShape), numel(capture.shape), plan, limits);
    Object.assign(p, { captureInOut: true, captureBase: numel(outShape) });
  } else {
    bindings[3] = resultTarget("outputT", dtype, numel(outShape), plan, limits);
  }
  // the chunked form for prefill (a request of CHUNKED_MIN_TOKENS or more), the recurrence else;
  // a capture needs the state after each token: the recurrence
  const refusal = capturing ? "compact capture runs token by token" : chunkedRefusal(p, spans, false, limits);
  if (variant === "chunked" && refusal) throw new ContractError("variant", "a call the chunked form runs", `chunked (${refusal})`);
  const chunked = variant === "chunked" || (variant === "auto" && !refusal && chunkedWins(p, spans));
  // Each request reads initialStateT's row and stores finalStateT's. The recurrence, with a
  // storage buffer to spare, reads initialStateT itself (no copy, as a decode loop wants); else
  // the requests run in place on a copy of it (or on zeros without one).
  const stateIn = !chunked && !!s0 && used + 1 <= maxBuffers;
  if (stateIn) {
    bindings[11] = { input: "initialStateT" };
    p.stateIn = true;
  } else {
    Object.assign(plan.outputs.finalStateT, s0 ? { copy: "initialStateT" } : { zero: true });
  }
  if (chunked) {
    const { 2: state, 3: output, ...operands } = bindings;
    plan.passes = chunkedPasses(p, spans, rows, gates, operands, state, output, plan, limits);
  } else {
    const entries = capturing ? capture.counts.map((count, n) => [n, count]) : null;
    plan.passes = [...plan.passes, ...recurrentPasses(p, spans, rows, null, gates, bindings, limits, entries)];
  }
  return plan;
}

// One float32 buffer for the outputs (count floats) and then the capture rows (captured floats):
// zeroed by a first pass (a capture leaves the entries past each request's prefix zero), copied
// (or narrowed) into outputT and copied into stateUpdateT by the finishing passes.
function sharedTarget(dtype, count, captured, plan, limits) {
  const name = "outputT+stateUpdateT:float32";
  plan.buffers[name] = { bytes: 4 * (count + captured) };
  plan.passes.push(narrowPass("zero", count + captured, null, { buffer: name }, limits));
  plan.finish.push(narrowPass(dtype, count, { buffer: name }, { output: "outputT" }, limits),
    narrowPass("float32", captured, { buffer: name }, { output: "stateUpdateT" }, limits, count));
  return { buffer: name };
}

// qk_l2_norm's epsilon: ONNX Runtime 1.32's CPU kernel uses fla's KDA epsilon with the sigmoid
// ("kda") gate (deltarule/contracts/_ort_gdn.py, read off its output; the schema names none)
const L2NORM_EPS = 1e-12, KDA_L2NORM_EPS = 1e-6;

// gate_activation -> the shaders' raw-gate function (absent: decayT is the log decay itself)
const GATE_FUNCTIONS = { softplus: "softplus", qwen: "softplus", sigmoid: "sigmoid", kda: "sigmoid" };

// The raw-gate parameters as the shaders read them: A_log [Hv], dt_bias [Hv] (scalar decay) or
// [Hv * K] (per-key decay; a per-head bias is repeated over the keys), the sigmoid gate's bound.
function rawGates(inputs, a, Hv, Dk, perKey) {
  const aLog = inputs.aLogT, bias = inputs.dtBiasT;
  if (!same(aLog.shape, [Hv])) throw new ContractError("aLogT", `(num_heads_v) = [${Hv}]`, show(aLog.shape));
  const shapes = perKey ? [[Hv], [Hv, Dk], [Hv * Dk]] : [[Hv]];
  if (!shapes.some((x) => same(bias.shape, x))) {
    throw new ContractError("dtBiasT", shapes.map(show).join(" or ") + (perKey ? " (per-key decay)" : " (per-head decay)"),
      show(bias.shape));
  }
  let dtBias = bias.data;
  if (perKey && bias.shape.length === 1 && bias.shape[0] === Hv && Dk > 1) {
    dtBias = new Float32Array(Hv * Dk);
    for (let h = 0; h < Hv; h++) dtBias.fill(bias.data[h], h * Dk, (h + 1) * Dk);
  }
  return { aLog: aLog.data, dtBias, bound: a.gate_lower_bound };
}

// Compact transition capture (state_update_capacity C > 0): per request the transitions to
// capture, capture_count clamped to [0, min(C, its length)] (none while stateUpdateActiveT is 0),
// and state_update's shape [N, C * (decay width + Hq * Dk + Hv * Dv)]. Null without a capture.
function captures(inputs, a, spans, N, { Hq, Hv, Dk, Dv, perKey }) {
  const active = inputs.stateUpdateActiveT;
  if (active && !same(active.shape, [1])) throw new ContractError("stateUpdateActiveT", "shape [1]", show(active.shape));
  const C = a.state_update_capacity;
  if (C === 0) return null;
  const count = inputs.captureCountT;
  if (!same(count.shape, [N])) throw new ContractError("captureCountT", `(batch_size) = [${N}]`, show(count.shape));
  const on = !active || active.data[0] !== 0;
  const counts = spans.map((s, n) => (on ? Math.min(Math.max(count.data[n], 0), C, s.end - s.start) : 0));
  return { counts, shape: [N, C * ((perKey ? Hv * Dk : Hv) + Hq * Dk + Hv * Dv)] };
}
