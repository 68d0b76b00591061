"""A Gated DeltaNet-2 block in ONNX: plain ORT (Scan function body) vs `deltarule.onnx.run`.

    python -m deltarule.tools.bench.onnx_block                      # T = 4096, 4 heads, d_k = d_v = 64
    python -m deltarule.tools.bench.onnx_block --T 1024 --heads 2 --repeats 3

The block (`gdn2_block`): x (B, T, d_model) -> MatMul -> Split into q, k, v,
decay logits a, erase logits, write logits; k L2-normalised per head
(Reshape + LpNormalization); `com.microsoft.LinearAttentionGate` gives the
per-key decay -exp(A_log) * softplus(a + dt_bias) and the erase gate
sigmoid(erase logits) (or plain Softplus / Mul / Sigmoid ops with
contrib_gate=False); Sigmoid gives the write gate;
`ai.deltarule::LinearAttention` (gated_delta, per-key decay, erase / write
gates, optional past_state); a final MatMul. Outputs y (B, T, d_model) and
the state.

Both paths get the same model: one ORT InferenceSession, which inlines the
op's function body (a Scan over T), and one `deltarule.onnx.Session`, which
runs the projections and gates in ORT and the attention node in deltarule.
Sessions are built (and warmed up once) before timing; the time is the
median of `repeats` runs, measured with time.perf_counter.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...onnx import custom_op as _ops

__all__ = ["gdn2_block", "measure", "main"]


def gdn2_block(*, T: int, B: int = 1, d_model: int = 256, heads: int = 4, d_k: int = 64, d_v: int = 64,
               past_state: bool = False, contrib_gate: bool = True, seed: int = 0, opset: int = 21):
    """(model, feeds) for the block above, with seeded random weights and inputs."""
    rng = np.random.default_rng(seed)
    H = heads
    widths = [H * d_k, H * d_k, H * d_v, H * d_k, H * d_k, H * d_v]       # q k v a erase write
    f32 = lambda a: np.asarray(a, np.float32)
    inits = [
        numpy_helper.from_array(f32(rng.standard_normal((d_model, sum(widths))) / np.sqrt(d_model)), "w_in"),
        numpy_helper.from_array(f32(rng.standard_normal((H * d_v, d_model)) / np.sqrt(H * d_v)), "w_out"),
        numpy_helper.from_array(np.array(widths, np.int64), "splits"),
        numpy_helper.from_array(np.array([0, 0, H, d_k], np.int64), "heads_shape"),
        numpy_helper.from_array(np.array([0, 0, H * d_k], np.int64), "flat_shape"),
        numpy_helper.from_array(f32(rng.uniform(-1.0, 1.0, H * d_k)), "dt_bias"),
        numpy_helper.from_array(f32(-np.exp(rng.uniform(np.log(0.02), np.log(0.5), H * d_k))), "decay_scale"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w_in"], ["proj"], name="in_proj"),
        helper.make_node("Split", ["proj", "splits"], ["q", "k_raw", "v", "a", "erase_logit", "write_logit"],
                         axis=-1, name="split"),
        helper.make_node("Reshape", ["k_raw", "heads_shape"], ["k_heads"], name="k_heads"),
        helper.make_node("LpNormalization", ["k_heads"], ["k_unit"], axis=-1, p=2, name="k_l2norm"),
        helper.make_node("Reshape", ["k_unit", "flat_shape"], ["k"], name="k_flat"),
        helper.make_node("Sigmoid", ["write_logit"], ["write"], name="write_gate"),
    ]
    if contrib_gate:
        nodes.append(helper.make_node("LinearAttentionGate", ["a", "dt_bias", "decay_scale", "erase_logit"],
                                      ["decay", "erase"], domain="com.microsoft", name="gate"))
    else:
        nodes += [
            helper.make_node("Add", ["a", "dt_bias"], ["a_biased"], name="gate_bias"),
            helper.make_node("Softplus", ["a_biased"], ["a_soft"], name="gate_softplus"),
            helper.make_node("Mul", ["a_soft", "decay_scale"], ["decay"], name="gate_scale"),
            helper.make_node("Sigmoid", ["erase_logit"], ["erase"], name="erase_gate"),
        ]
    nodes += [
        _ops.make_node("q", "k", "v", "past" if past_state else None, "decay", None, "erase", "write",
                       q_num_heads=H, kv_num_heads=H, update_rule="gated_delta",
                       outputs=("attn", "state"), name="attention"),
        helper.make_node("MatMul", ["attn", "w_out"], ["y"], name="out_proj"),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, "T", d_model])]
    feeds = {"x": f32(rng.standard_normal((B, T, d_model)))}
    if past_state:
        inputs.append(helper.make_tensor_value_info("past", TensorProto.FLOAT, [B, H, d_k, d_v]))
        feeds["past"] = f32(0.5 * rng.standard_normal((B, H, d_k, d_v)))
    graph = helper.make_graph(
        nodes, "gdn2_block", inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, "T", d_model]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [B, H, d_k, d_v])],
        initializer=inits,
    )
    imports = [helper.make_opsetid("", opset), helper.make_opsetid(_ops.DOMAIN, _ops.VERSION)]
    if contrib_gate:
        imports.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=imports, ir_version=10)
    return _ops.attach_functions(model), feeds


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def measure(*, T: int = 4096, B: int = 1, heads: int = 4, d_k: int = 64, d_v: int = 64, d_model: int = 256,
            repeats: int = 5, contrib_gate: bool = True, threads: int | None = None) -> dict:
    """Time both paths on `gdn2_block`; returns a dict of seconds, the ratio and the agreement."""
    import onnxruntime as ort
    import torch

    from ...onnx.runner import Session

    model, feeds = gdn2_block(T=T, B=B, heads=heads, d_k=d_k, d_v=d_v, d_model=d_model,
                              contrib_gate=contrib_gate)
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        torch.set_num_threads(threads)
    plain = ort.InferenceSession(model.SerializeToString(), sess_options=options,
                                 providers=["CPUExecutionProvider"])
    ours = Session(model, sess_options=options)
    ref = plain.run(None, feeds)                   # warm-up runs, and the outputs compared
    got = ours.run(None, feeds)
    rel = [float(np.linalg.norm(g.astype(np.float64) - r) / np.linalg.norm(r)) for g, r in zip(got, ref)]
    t_plain, all_plain = _median_time(lambda: plain.run(None, feeds), repeats)
    t_ours, all_ours = _median_time(lambda: ours.run(None, feeds), repeats)

    # the attention node alone: its inputs as the block computes them, one-node model vs deltarule's kernel
    names = ["q", "k", "v", "decay", "erase", "write"]
    inner = dict(zip(names, ours.run(names, feeds)))   # values at a cut can be read back
    node_feeds = dict(query=inner["q"], key=inner["k"], value=inner["v"], decay=inner["decay"],
                      erase_gate=inner["erase"], write_gate=inner["write"])
    attrs = dict(q_num_heads=heads, kv_num_heads=heads, update_rule="gated_delta")
    node_model = _ops.make_model(node_feeds, opset=21, **attrs)
    node_plain = ort.InferenceSession(node_model.SerializeToString(), sess_options=options,
                                      providers=["CPUExecutionProvider"])
    node_plain.run(None, node_feeds)
    _ops.linear_attention(**node_feeds, **attrs)
    t_node_plain, _ = _median_time(lambda: node_plain.run(None, node_feeds), repeats)
    t_node_ours, _ = _median_time(lambda: _ops.linear_attention(**node_feeds, **attrs), repeats)
    return dict(T=T, B=B, heads=heads, d_k=d_k, d_v=d_v, d_model=d_model, repeats=repeats,
                ort_scan_s=t_plain, deltarule_s=t_ours, speedup=t_plain / t_ours,
                node_ort_scan_s=t_node_plain, node_deltarule_s=t_node_ours,
                node_speedup=t_node_plain / t_node_ours,
                ort_scan_runs_s=all_plain, deltarule_runs_s=all_ours,
                rel_err_y=rel[0], rel_err_state=rel[1], plan=ours.plan,
                onnxruntime=ort.__version__, onnx=onnx.__version__, torch_threads=torch.get_num_threads())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m deltarule.tools.bench.onnx_block", description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-k", type=int, default=64)
    p.add_argument("--d-v", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op and torch threads")
    p.add_argument("--plain-gate", action="store_true", help="Softplus/Sigmoid ops instead of LinearAttentionGate")
    a = p.parse_args(argv)
    r = measure(T=a.T, B=a.B, heads=a.heads, d_k=a.d_k, d_v=a.d_v, d_model=a.d_model, repeats=a.repeats,
                contrib_gate=not a.plain_gate, threads=a.threads)
    print(f"GDN-2 block B={r['B']} T={r['T']} heads={r['heads']} d_k={r['d_k']} d_v={r['d_v']} "
          f"d_model={r['d_model']} (onnxruntime {r['onnxruntime']}, onnx {r['onnx']}, "
          f"torch threads {r['torch_threads']})")
    print(f"  plain ORT, Scan function body : {r['ort_scan_s'] * 1e3:9.1f} ms  (median of {r['repeats']})")
    print(f"  deltarule.onnx.Session        : {r['deltarule_s'] * 1e3:9.1f} ms")
    print(f"  speed ratio                   : {r['speedup']:9.2f} x")
    print("  the attention node alone (one-node model vs deltarule.onnx.linear_attention):")
    print(f"  plain ORT, Scan function body : {r['node_ort_scan_s'] * 1e3:9.1f} ms")
    print(f"  deltarule                     : {r['node_deltarule_s'] * 1e3:9.1f} ms")
    print(f"  speed ratio                   : {r['node_speedup']:9.2f} x")
    print(f"  agreement ||ours - ort|| / ||ort||: y {r['rel_err_y']:.2e}, state {r['rel_err_state']:.2e}")
    return r


if __name__ == "__main__":
    main()
