// Host program of deltarule.LinearAttention: deltarule's validation (deltarule/api.py) and batch
// plan (deltarule/batch.py) in JavaScript, then the recurrent dispatch. The loader has checked
// presence, dtypes and ranks; errors here name the bind key.
import {
  checkSizes, chunkedPasses, chunkedRefusal, chunkedWins, ContractError, finite, NO_ROW, numel, recurrentPasses,
  resultTarget, same, show,
} from "./common.js";

export { link } from "./common.js";     // takes the loader's ContractError and numel before each plan

const GATED = ["gated", "gated_delta"];
const DELTA = ["delta", "gated_delta"];

export function plan({ inputs, attributes, variant, limits }) {
  const a = attributes;
  const { qT: q, kT: k, vT: v } = inputs;
  const [B, T, Hq, K] = q.shape;
  const [Hk, Hv, V] = [k.shape[2], v.shape[2], v.shape[3]];
  if (Hq < 1 || K < 1) throw new ContractError("qT", "[B, T, Hq, K] with Hq, K >= 1", show(q.shape));
  if (!same(k.shape, [B, T, Hk, K]) || Hk < 1) throw new ContractError("kT", `[B, T, Hk, K] = [${B}, ${T}, Hk >= 1, ${K}]`, show(k.shape));
  if (!same(v.shape.slice(0, 2), [B, T]) || Hv < 1 || V < 1) throw new ContractError("vT", `[B, T, Hv, V] = [${B}, ${T}, Hv >= 1, V >= 1]`, show(v.shape));
  if (Hv % Hk) throw new ContractError("vT", `Hv a multiple of Hk = ${Hk}`, `Hv = ${Hv}`);
  if (Hq !== Hk && !(Hv === Hk && Hq % Hv === 0)) {
    throw new ContractError("qT", `Hq == Hk = ${Hk} (GVA) or Hq a multiple of Hv == Hk (GQA)`, `Hq = ${Hq}, Hk = ${Hk}, Hv = ${Hv}`);
  }
  checkGates(inputs, a.rule);
  const shapes = { gT: [B, T, Hv], gkT: [B, T, Hv, K], betaT: [B, T, Hv], eraseT: [B, T, Hv, K], writeT: [B, T, Hv, V] };
  for (const [bind, shape] of Object.entries(shapes)) {
    if (inputs[bind] && !same(inputs[bind].shape, shape)) throw new ContractError(bind, show(shape), show(inputs[bind].shape));
  }
  if (inputs.aLogT) {
    if (inputs.gT && inputs.gkT) throw new ContractError("aLogT", "absent when both gT and gkT are given (ambiguous raw gate)", "present");
    if (!inputs.gT && !inputs.gkT) throw new ContractError("aLogT", "absent without a decay gate gT or gkT", "present");
    if (!same(inputs.aLogT.shape, [Hv])) throw new ContractError("aLogT", show([Hv]), show(inputs.aLogT.shape));
    const bias = inputs.gT ? [Hv] : [Hv, K];
    if (!same(inputs.dtBiasT.shape, bias)) throw new ContractError("dtBiasT", show(bias), show(inputs.dtBiasT.shape));
  }
  if (!finite(a.scale)) throw new ContractError("scale", "a number finite in float32", a.scale);
  if (!finite(a.l2norm_eps) || a.l2norm_eps < 0) throw new ContractError("l2norm_eps", "a number >= 0 finite in float32", a.l2norm_eps);
  if (a.beta_sigmoid && !DELTA.includes(a.rule)) throw new ContractError("beta_sigmoid", `0 for rule "${a.rule}" (no beta)`, 1);
  if (!Number.isInteger(a.chunk_size) || a.chunk_size < 1) throw new ContractError("chunk_size", "an int >= 1", a.chunk_size);
  if (!inputs.aLogT) refusePositiveDecay(inputs);

  const slab = !!inputs.stateIndicesT;
  const s0 = inputs.initialStateT;
  const { spans, tokenRows } = batchPlan(inputs, B, T, slab ? s0.shape[0] : null);
  const N = spans.length;
  const tail = a.state_layout === "kv" ? [Hv, K, V] : [Hv, V, K];
  if (s0 && (!same(s0.shape.slice(1), tail) || (!slab && s0.shape[0] !== N))) {
    const rows = slab ? "S" : String(N);
    throw new ContractError("initialStateT", `[${rows}, ${a.state_layout === "kv" ? "Hv, K, V" : "Hv, V, K"}] = ` +
      `[${rows}, ${tail.join(", ")}]`, show(s0.shape));
  }

  const G = Hq > Hv ? Hq / Hv : 1;
  const Ho = Math.max(Hq, Hv);
  const dtype = q.dtype;
  const oShape = [B, T, Ho, V];
  const plan = { outputs: { oT: { dtype, shape: oShape } }, buffers: {}, passes: [], finish: [] };
  // a slab is updated in place (host mode: the uploaded copy comes back as stateT)
  plan.outputs.stateT = slab ? { dtype: "float32", shape: s0.shape, alias: "initialStateT" }
    : { dtype: "float32", shape: [N, ...tail], ...(s0 ? { copy: "initialStateT" } : { zero: true }) };
  const live = spans.filter((s) => s.live);
  let rows, perToken = null;
  if (!slab) {
    rows = spans.map((_, n) => n).filter((n) => spans[n].live);
  } else if (!tokenRows) {
    rows = live.map((s) => s.read);
  } else {
    // a sequence without tokens reads no row (in the same dispatch another may store into it)
    rows = live.map((s) => (s.end > s.start ? s.read : NO_ROW));
    const L = tokenRows[0]?.length ?? 0;
    perToken = new Uint32Array(live.length * L).fill(NO_ROW);
    spans.forEach((s, n) => {
      if (!s.live) return;
      const i = live.indexOf(s);
      for (let t = 0; t < s.end - s.start; t++) if (tokenRows[n][t] >= 0) perToken[i * L + t] = tokenRows[n][t];
    });
  }
  const bindings = { 2: { output: "stateT" }, 3: resultTarget("oT", dtype, numel(oShape), plan, limits),
    4: { input: "qT" }, 5: { input: "kT" }, 6: { input: "vT" } };
  const b = inputs.betaT ? "betaT" : inputs.eraseT ? "eraseT" : null;
  if (inputs.gT) bindings[7] = { input: "gT" };
  if (inputs.gkT) bindings[8] = { input: "gkT" };
  if (b) bindings[9] = { input: b };
  if (inputs.writeT) bindings[10] = { input: "writeT" };
  const gd = (bind) => (inputs[bind] ? inputs[bind].dtype : null);
  const p = {
    B, T, K, V, G, Hq, Hk, Hv, layout: a.state_layout,
    dtypes: { qkv: dtype, g: gd("gT"), gk: gd("gkT"), b: b && inputs[b].dtype, w: gd("writeT") },
    retrieves: DELTA.includes(a.rule), bPerKey: b === "eraseT",
    rawGate: inputs.aLogT ? (inputs.gT ? "g" : "gk") : "", sigmoid: !!a.beta_sigmoid, l2norm: !!a.qk_l2norm,
    scale: a.scale === 0 ? 1 / Math.sqrt(K) : a.scale, eps: a.l2norm_eps, chunkSize: a.chunk_size,
    names: { K: "qT", G: "qT", Hv: "vT", V: "vT", speculative: "stateIndicesT",
      sequences: inputs.cuSeqlensT ? "cuSeqlensT" : inputs.seqLensT ? "seqLensT" : slab ? "stateIndicesT" : "qT" },
  };
  checkSizes(p, live.length, limits);
  const need = 6 + [inputs.gT, inputs.gkT, b, inputs.writeT].filter(Boolean).length;
  if (need > limits.maxStorageBuffersPerShaderStage) {
    throw new ContractError("inputs", `at most ${limits.maxStorageBuffersPerShaderStage} storage buffers per shader ` +
      "stage (the device's limit)", `${need} for these gates`);
  }
  const gates = p.rawGate ? { aLog: inputs.aLogT.data, dtBias: inputs.dtBiasT.data } : null;
  // the chunked form for prefill (a sequence of CHUNKED_MIN_TOKENS or more), the recurrence else
  const refusal = chunkedRefusal(p, spans, perToken !== null, limits);
  if (variant === "chunked" && refusal) throw new ContractError("variant", "a call the chunked form runs", `chunked (${refusal})`);
  if (variant === "chunked" || (variant === "auto" && !refusal && chunkedWins(p, spans))) {
    const { 2: state, 3: out, ...operands } = bindings;
    plan.passes = chunkedPasses(p, spans, rows, gates, operands, state, out, plan, limits);
  } else {
    plan.passes = recurrentPasses(p, spans, rows, perToken, gates, bindings, limits);
  }
  return plan;
}

function checkGates(inputs, rule) {
  const { gT: g, gkT: gk, betaT: beta, eraseT: erase, writeT: write } = inputs;
  if (GATED.includes(rule) && !g && !gk) throw new ContractError("gT", `gT and/or gkT for rule "${rule}"`, "neither");
  if (!GATED.includes(rule)) {
    for (const [bind, x] of [["gT", g], ["gkT", gk]]) if (x) throw new ContractError(bind, `absent for rule "${rule}" (no decay)`, "present");
  }
  if (DELTA.includes(rule)) {
    if (beta && (erase || write)) throw new ContractError("betaT", "absent when eraseT / writeT are given", "present");
    if (!beta && !erase) throw new ContractError("betaT", `betaT, or eraseT and writeT, for rule "${rule}"`, "none");
  } else {
    for (const [bind, x] of [["betaT", beta], ["eraseT", erase], ["writeT", write]]) {
      if (x) throw new ContractError(bind, `absent for rule "${rule}" (no retrieval)`, "present");
    }
  }
}

// deltarule refuses a positive log decay; host data is read, device buffers cannot be
function refusePositiveDecay(inputs) {
  for (const bind of ["gT", "gkT"]) {
    const x = inputs[bind];
    if (!x || !x.values) continue;
    const values = x.values();
    for (let i = 0; i < values.length; i++) {
      if (values[i] > 0) throw new ContractError(bind, "log decays <= 0 (natural log, -inf resets)", `${values[i]} at ${i}`);
    }
  }
}

// deltarule/batch.py's `build`: spans { row, start, end, read, live } and speculative token rows
function batchPlan(inputs, B, T, numSlots) {
  const cu = inputs.cuSeqlensT, lens = inputs.seqLensT, idx = inputs.stateIndicesT;
  const accepted = inputs.numAcceptedTokensT;
  if (cu && lens) throw new ContractError("seqLensT", "absent when cuSeqlensT is given", "both given");
  let ranges;
  if (cu) {
    if (cu.data.length < 1) throw new ContractError("cuSeqlensT", "[N + 1] offsets, N + 1 >= 1", "shape [0]");
    if (B !== 1) throw new ContractError("cuSeqlensT", "B == 1 (qT [1, T, Hq, K]) with cuSeqlensT", `B = ${B}`);
    const c = Array.from(cu.data, (x) => Math.min(Math.max(x, 0), T));
    ranges = c.slice(0, -1).map((s, n) => [0, s, Math.max(s, c[n + 1])]);
  } else if (lens) {
    if (lens.data.length !== B) throw new ContractError("seqLensT", `shape [${B}]`, show(lens.shape));
    ranges = Array.from(lens.data, (n, b) => {
      if (n < 0 || n > T) throw new ContractError(`seqLensT[${b}]`, `a length in [0, ${T}]`, n);
      return [b, 0, n];
    });
  } else {
    ranges = Array.from({ length: B }, (_, b) => [b, 0, T]);
  }
  const N = ranges.length;
  if (!idx) return { spans: ranges.map(([row, start, end], n) => ({ row, start, end, read: n, live: true })), tokenRows: null };
  if (idx.shape[0] !== N) {
    throw new ContractError("stateIndicesT", `shape [${N}]` + " or " + `[${N}, L]`, show(idx.shape));
  }
  const checkRow = (r, where) => {
    if (r >= numSlots) throw new ContractError(where, `a slab row < ${numSlots} (or < 0 for padding)`, r);
  };
  if (idx.shape.length === 1) {
    const seen = new Set();
    const spans = ranges.map(([row, start, end], n) => {
      const r = idx.data[n];
      checkRow(r, `stateIndicesT[${n}]`);
      if (r >= 0) {
        if (seen.has(r)) throw new ContractError(`stateIndicesT[${n}]`, "distinct slab rows", `${r} repeated`);
        seen.add(r);
      }
      return { row, start, end: r >= 0 ? end : start, read: r, live: r >= 0 };
    });
    if (accepted) throw new ContractError("numAcceptedTokensT", "absent without 2-D stateIndicesT [N, L]", "1-D stateIndicesT");
    return { spans, tokenRows: null };
  }
  const L = idx.shape[1];
  if (L < 1) throw new ContractError("stateIndicesT", "[N, L] with L >= 1", show(idx.shape));
  const rows = ranges.map((_, n) => Array.from(idx.data.subarray(n * L, (n + 1) * L)));
  rows.forEach((r, n) => r.forEach((x, t) => checkRow(x, `stateIndicesT[${n}, ${t}]`)));
  let counts = new Array(N).fill(1);
  if (accepted) {
    if (accepted.data.length !== N) throw new ContractError("numAcceptedTokensT", `shape [${N}]`, show(accepted.shape));
    counts = Array.from(accepted.data);
    counts.forEach((c, n) => {
      if (c < 1 || c > L) throw new ContractError(`numAcceptedTokensT[${n}]`, `a count in [1, L = ${L}]`, c);
    });
  }
  const written = new Map();
  const spans = ranges.map(([row, start, end], n) => {
    const read = rows[n][counts[n] - 1];
    if (read < 0) return { row, start, end: start, read: -1, live: false };
    if (end - start > L) throw new ContractError("stateIndicesT", "[N, L] with L >= every live sequence's length", `L = ${L}, sequence ${n} has ${end - start} tokens`);
    for (let t = 0; t < end - start; t++) {
      const r = rows[n][t];
      if (r < 0) continue;
      if (written.has(r)) {
        throw new ContractError(`stateIndicesT[${n}, ${t}]`, "distinct slab rows among the rows live sequences write",
          `${r} repeated (also ${written.get(r)[1]})`);
      }
      written.set(r, [n, `stateIndicesT[${n}, ${t}]`]);
    }
    return { row, start, end, read, live: true };
  });
  spans.forEach((s, n) => {
    const other = written.get(s.read);
    if (s.live && other && other[0] !== n) {
      throw new ContractError(`stateIndicesT[${n}, ${counts[n] - 1}]`, "a read row no other live sequence writes", `${s.read}, written as ${other[1]}`);
    }
  });
  return { spans, tokenRows: rows };
}
