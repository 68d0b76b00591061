// Host program of com.microsoft.LinearAttentionGate: decay = decay_scale * softplus(a + dt_bias),
// beta = sigmoid(b) when requested, in float32 (gate.wgsl.jinja), narrowed on store.
import { ContractError, numel, resultTarget, same, show, SHADER_DTYPES } from "./common.js";

export { link } from "./common.js";     // takes the loader's ContractError and numel before each plan

const WORKGROUP = 256;

export function plan({ inputs, requested, limits }) {
  const a = inputs.aT;
  if (a.shape.length < 1) throw new ContractError("aT", "rank >= 1 (..., H)", show(a.shape));
  const H = a.shape.at(-1);
  if (H < 1) throw new ContractError("aT", "H >= 1 heads on the last axis", show(a.shape));
  for (const bind of ["dtBiasT", "decayScaleT"]) {
    if (!same(inputs[bind].shape, [H])) throw new ContractError(bind, `(H) = [${H}]`, show(inputs[bind].shape));
  }
  const beta = requested.includes("betaT");
  if (inputs.bT && !same(inputs.bT.shape, a.shape)) throw new ContractError("bT", `aT's shape ${show(a.shape)}`, show(inputs.bT.shape));
  const count = numel(a.shape);
  const plan = { outputs: { decayT: { dtype: a.dtype, shape: a.shape } }, buffers: {}, passes: [], finish: [] };
  if (beta) plan.outputs.betaT = { dtype: a.dtype, shape: a.shape };
  if (!count) return plan;
  const groups = Math.ceil(count / WORKGROUP);
  const nx = Math.min(groups, limits.maxComputeWorkgroupsPerDimension);
  const params = new ArrayBuffer(16);
  new Uint32Array(params).set([count, H, nx * WORKGROUP]);
  const headParams = new Float32Array(2 * H);
  headParams.set(inputs.dtBiasT.data, 0);
  headParams.set(inputs.decayScaleT.data, H);
  const bindings = { 0: { uniform: params }, 1: { storage: headParams }, 3: { input: "aT" },
    2: resultTarget("decayT", a.dtype, count, plan, limits) };
  if (beta) {
    bindings[4] = { input: "bT" };
    bindings[5] = resultTarget("betaT", a.dtype, count, plan, limits);
  }
  plan.passes.push({ template: "gate.wgsl.jinja", spec: { dtype: SHADER_DTYPES[a.dtype], has_b: beta },
    grid: [nx, Math.ceil(groups / nx), 1], workgroup: { invocations: WORKGROUP, bytes: 0 }, bindings });
  return plan;
}
