// Host program of com.microsoft.GatedDeltaNet: shapes, requests, and the recurrent dispatch.
// The loader has checked presence, dtypes and ranks against manifest.json; this checks the
// shapes (errors name the bind key) and plans the passes. Semantics: deltarule's ONNX Runtime
// adapter (deltarule/contracts/ort.py, gated_delta_net) on the "vk" state layout.
import {
  checkSizes, chunkedPasses, chunkedRefusal, chunkedWins, ContractError, finite, numel, recurrentPasses, resultTarget,
  same, show,
} from "./common.js";

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
  for (const [bind, x] of [["decayT", inputs.decayT], ["betaT", inputs.betaT]]) {
    if (x && !same(x.shape, [...lead, Hv])) throw new ContractError(bind, show([...lead, Hv]), show(x.shape));
  }
  if (a.gate_activation === "qwen") {
    for (const bind of ["aLogT", "dtBiasT"]) {
      if (!same(inputs[bind].shape, [Hv])) throw new ContractError(bind, `(num_heads_v) = [${Hv}]`, show(inputs[bind].shape));
    }
  }

  const dtype = q.dtype;
  const outShape = [...lead, Hv, Dv];
  const plan = {
    outputs: { outputT: { dtype, shape: outShape }, finalStateT: { dtype: "float32", shape: stateShape } },
    buffers: {}, passes: [], finish: [],
  };
  const out = resultTarget("outputT", dtype, numel(outShape), plan, limits);
  const p = {
    B, T: S, K: Dk, V: Dv, G: 1, Hq, Hk: Hq, Hv, layout: "vk",
    dtypes: { qkv: dtype, g: inputs.decayT ? "float32" : null, b: inputs.betaT ? "float32" : null },
    retrieves: !!inputs.betaT, rawGate: a.gate_activation === "qwen" ? "g" : "",
    sigmoid: a.beta_activation === "sigmoid" && !!inputs.betaT, l2norm: a.qk_l2_norm !== 0,
    scale: a.scale === 0 ? 1 / Math.sqrt(Dk) : a.scale, eps: 1e-12, chunkSize: Math.max(1, a.chunk_size),
    names: { K: "queryT", G: "queryT", Hv: "valueT", V: "valueT",
      sequences: inputs.cuSeqlensT ? "cuSeqlensT" : lead.length === 1 ? "initialStateT" : "queryT" },
  };
  checkSizes(p, spans.length, limits);
  const bindings = { 2: { output: "finalStateT" }, 3: out, 4: { input: "queryT" }, 5: { input: "keyT" },
    6: { input: "valueT" } };
  if (inputs.decayT) bindings[7] = { input: "decayT" };
  if (inputs.betaT) bindings[9] = { input: "betaT" };
  const gates = p.rawGate ? { aLog: inputs.aLogT.data, dtBias: inputs.dtBiasT.data } : null;
  const rows = spans.map((_, n) => n);
  // the chunked form for prefill (a request of CHUNKED_MIN_TOKENS or more), the recurrence else
  const refusal = chunkedRefusal(p, spans, false, limits);
  if (variant === "chunked" && refusal) throw new ContractError("variant", "a call the chunked form runs", `chunked (${refusal})`);
  const chunked = variant === "chunked" || (variant === "auto" && !refusal && chunkedWins(p, spans));
  // Each request reads initialStateT's row and stores finalStateT's. The recurrence, with a
  // storage buffer to spare, reads initialStateT itself (no copy, as a decode loop wants); else
  // the requests run in place on a copy of it (or on zeros without one).
  const stateIn = !chunked && !!s0 && 7 + (inputs.decayT ? 1 : 0) + (inputs.betaT ? 1 : 0) <= limits.maxStorageBuffersPerShaderStage;
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
    plan.passes = recurrentPasses(p, spans, rows, null, gates, bindings, limits);
  }
  return plan;
}
