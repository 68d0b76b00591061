"""What computing the exported linear-attention node in float32 costs a float16 export
(docs/export.md, "Targets"): one ``com.microsoft.LinearAttention`` node in float16 (what a float16
export emitted before issue 46) against the same node in float32 between Casts (what it emits
now: the eager call's arithmetic), ONNX Runtime's CPU kernel, B = 1, 16 heads of K = V = 128.

Rounds alternate the order; the first two are dropped (session warm-up). Prints per length the
median time ratio (float32 + Casts / float16) and its spread over the kept rounds.

    python benchmarks/export_node_dtype.py [--rounds 9] [--lengths 1 256 1024]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

H, K, V = 16, 128, 128
INPUTS = (("q", H * K), ("k", H * K), ("v", H * V), ("g", H), ("b", H))


def session(float32_node: bool) -> ort.InferenceSession:
    """The node with float16 inputs and output; `float32_node`: Cast up, float32 node, Cast down."""
    names = [n for n, _ in INPUTS]
    nodes = []
    if float32_node:
        nodes = [helper.make_node("Cast", [n], [n + "32"], to=TensorProto.FLOAT) for n in names]
        names = [n + "32" for n in names]
    out = "o32" if float32_node else "o"
    nodes.append(helper.make_node("LinearAttention", [*names[:3], "", *names[3:]], [out, "state"],
                                  domain="com.microsoft", q_num_heads=H, kv_num_heads=H,
                                  update_rule="gated_delta", scale=K ** -0.5))
    if float32_node:
        nodes.append(helper.make_node("Cast", ["o32"], ["o"], to=TensorProto.FLOAT16))
    state_type = TensorProto.FLOAT if float32_node else TensorProto.FLOAT16
    graph = helper.make_graph(
        nodes, "node", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, ["B", "T", w]) for n, w in INPUTS],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT16, None),
         helper.make_tensor_value_info("state", state_type, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 256, 1024])
    args = parser.parse_args()
    sessions = {"float16": session(False), "float32": session(True)}
    rng = np.random.default_rng(0)
    for T in args.lengths:
        feeds = {n: (rng.standard_normal((1, T, w)) * 0.1).astype(np.float16) for n, w in INPUTS[:3]}
        feeds["g"] = (-rng.random((1, T, H)) * 0.1).astype(np.float16)
        feeds["b"] = rng.random((1, T, H)).astype(np.float16)
        times = {n: [] for n in sessions}
        repeats = 50 if T == 1 else 1
        for r in range(args.rounds):
            for name in (list(sessions) if r % 2 == 0 else list(sessions)[::-1]):
                start = time.perf_counter()
                for _ in range(repeats):
                    sessions[name].run(None, feeds)
                times[name].append((time.perf_counter() - start) / repeats)
        ratios = [a / b for a, b in zip(times["float32"][2:], times["float16"][2:])]
        print(f"T = {T}: float32 node + Casts / float16 node: {np.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] (float16 node {1e3 * np.median(times['float16'][2:]):.2f} ms)")


if __name__ == "__main__":
    main()
