"""The three `deltarule.onnx.export.export_model` targets side by side in onnxruntime (CPU), one run (docs/export.md,
"Target ort-gpu"):

- ``ort``: com.microsoft.LinearAttention (L2 norm, head repeat, packing and the gates as standard
  ops around it) and CausalConvWithState;
- ``ort-gpu``: com.microsoft.GatedDeltaNet (rank-4 q / k / v, the L2 norm, beta's sigmoid and the
  gate fused into it; the decoder's state V-major, no Transpose) and CausalConvWithState;
- ``onnx``: the opset-27 standard LinearAttention and CausalConvWithState;
- ``ort-gpu unfused``: ort-gpu without its graph passes (transformers' gate / beta ops left as
  they are, a Transpose each side of the node for the K-major state inputs and outputs).

On a random-weight Qwen3.5 checkpoint of shape ``tiny_0_8b_heads`` (`deltarule.tools.bench.checkpoints`:
hidden 128, one Gated DeltaNet layer with Qwen3.5-0.8B's 16 key / value heads of 128, one
attention layer), batch 1: prefill of a prompt of each length from zero state, and decode (one
token after a past of that length), through `deltarule.onnx.export.generate.DecoderSession`. Timed
with `deltarule.tools.bench.timing.interleaved` (each export warmed up 0.1 s, then rounds of one >= 10
ms batch each, order rotated round to round, 20 ms pause before each batch); onnxruntime's
default intra-op threads (one per core). Ratios: the other export's time / ort-gpu's per round,
median [min-max] over the rounds (> 1: ort-gpu is faster). Copy bandwidth measured in the same run.
Then the same for each target's linear-attention node alone (one-node models at the shape's
heads, q / k normalized, gates given), which says how much of the difference is the node's
CPU kernel.

    .venv/bin/python benchmarks/export_targets.py --prompt 1024
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys

import numpy as np
import onnx

from deltarule.tools.bench import checkpoints, copy_bandwidth
from deltarule.tools.bench.timing import interleaved
from deltarule.onnx.export import fuse
from deltarule.onnx.export import export_model as export_onnx
from deltarule.onnx.export.generate import DecoderSession

TARGETS = ("ort", "ort-gpu", "onnx")
REFERENCE = "ort-gpu"
# the ort-gpu export without its graph passes (`deltarule.onnx.export.fuse`: gates fused, state V-major)
UNFUSED = "ort-gpu unfused"


@contextlib.contextmanager
def _passes_off():
    saved = fuse.gates, fuse.v_major_state
    fuse.gates, fuse.v_major_state = (lambda model: {}), (lambda model: [])
    try:
        yield
    finally:
        fuse.gates, fuse.v_major_state = saved


def _prefill(session: DecoderSession, T: int, vocab: int):
    ids = np.random.default_rng(0).integers(3, vocab, (1, T), dtype=np.int64)
    mask, past = np.ones((1, T), np.int64), session.zero_state(1)
    return lambda: session.step(ids, mask, past)


def _decode(session: DecoderSession, T: int, vocab: int):
    ids = np.random.default_rng(0).integers(3, vocab, (1, T), dtype=np.int64)
    _, past = session.step(ids, np.ones((1, T), np.int64), session.zero_state(1))
    token, mask = ids[:, -1:], np.ones((1, T + 1), np.int64)
    return lambda: session.step(token, mask, past)


def node_sessions(H: int, K: int, V: int) -> dict:
    """One-node models of the linear-attention node each target emits for a Gated DeltaNet layer
    of H heads (q / k rows L2-normalized upstream, gates given): ``ort``
    com.microsoft.LinearAttention (packed [B, T, H * D], K-major state), ``ort-gpu``
    com.microsoft.GatedDeltaNet (rank 4, V-major state, chunk_size 16), ``onnx`` the opset-27
    LinearAttention. name -> (session, feeds(T))."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def tensor(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    packed = [tensor("q", [1, "T", H * K]), tensor("k", [1, "T", H * K]), tensor("v", [1, "T", H * V]),
              tensor("s", [1, H, K, V]), tensor("g", [1, "T", H]), tensor("b", [1, "T", H])]
    nodes = {
        "ort": (helper.make_node("LinearAttention", ["q", "k", "v", "s", "g", "b"], ["o", "so"], domain="com.microsoft",
                                 q_num_heads=H, kv_num_heads=H, update_rule="gated_delta", scale=K ** -0.5), packed,
                [("com.microsoft", 1)]),
        "ort-gpu": (helper.make_node("GatedDeltaNet", ["q", "k", "v", "", "g", "b", "s"], ["o", "so"],
                                     domain="com.microsoft", update_rule="gated_delta", chunk_size=16),
                    [tensor("q", [1, "T", H, K]), tensor("k", [1, "T", H, K]), tensor("v", [1, "T", H, V]),
                     tensor("g", [1, "T", H]), tensor("b", [1, "T", H]), tensor("s", [1, H, V, K])],
                    [("com.microsoft", 1)]),
        "onnx": (helper.make_node("LinearAttention", ["q", "k", "v", "s", "g", "b"], ["o", "so"], q_num_heads=H,
                                  kv_num_heads=H, update_rule="gated_delta", scale=K ** -0.5), packed, [("", 27)]),
    }
    rng = np.random.default_rng(0)

    def feeds_for(target):
        def feeds(T):
            q, k = (rng.standard_normal((1, T, H, K)).astype(np.float32) for _ in range(2))
            q, k = q / np.linalg.norm(q, axis=-1, keepdims=True), k / np.linalg.norm(k, axis=-1, keepdims=True)
            v = rng.standard_normal((1, T, H, V)).astype(np.float32)
            g = -rng.uniform(0.01, 0.1, (1, T, H)).astype(np.float32)
            b = rng.uniform(0, 1, (1, T, H)).astype(np.float32)
            if target == "ort-gpu":
                return dict(q=q, k=k, v=v, g=g, b=b, s=np.zeros((1, H, V, K), np.float32))
            return dict(q=q.reshape(1, T, -1), k=k.reshape(1, T, -1), v=v.reshape(1, T, -1), g=g, b=b,
                        s=np.zeros((1, H, K, V), np.float32))
        return feeds

    options = ort.SessionOptions()
    options.add_session_config_entry("session.allow_released_opsets_only", "0")
    out = {}
    for target, (node, inputs, imports) in nodes.items():
        graph = helper.make_graph([node], target, inputs, [tensor("o", None), tensor("so", None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23 if target != "onnx" else 27)]
                                  + [helper.make_opsetid(d, v) for d, v in imports if d])
        out[target] = (ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]),
                       feeds_for(target))
    return out


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny_0_8b_heads", choices=sorted(checkpoints.SHAPES))
    parser.add_argument("--prompt", action="append", type=int, help="prompt / past lengths (default 1024)")
    parser.add_argument("--workdir", default=".onnx-models/export-targets")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=15.0, help="seconds per export and case")
    parser.add_argument("--no-nodes", dest="nodes", action="store_false",
                        help="skip the table of the linear-attention nodes alone (one-node models)")
    args = parser.parse_args(argv)
    prompts = args.prompt or [1024]
    bandwidth = copy_bandwidth()
    print(f"# onnxruntime CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}; "
          f"copy bandwidth {bandwidth:.1f} GB/s; qwen3_5 {args.shape}, batch 1")
    root = os.path.join(args.workdir, args.shape)
    ck = checkpoints.save("qwen3_5", os.path.join(root, "checkpoint"), shape=args.shape)
    vocab = checkpoints.config("qwen3_5", args.shape).vocab_size
    sessions, nodes = {}, {}
    exports = (*TARGETS, UNFUSED)
    for target in exports:
        out = os.path.join(root, target.replace(" ", "-"))
        path = os.path.join(out, "onnx", "model.onnx")
        if not os.path.isfile(path):
            with _passes_off() if target == UNFUSED else contextlib.nullcontext():
                export_onnx(ck, out, target=target.split()[0], overwrite=True)
        model = onnx.load(path, load_external_data=False)
        nodes[target] = len(model.graph.node)
        sessions[target] = DecoderSession(path)
    ids = np.random.default_rng(1).integers(3, vocab, (1, 16), dtype=np.int64)
    logits = {t: s.step(ids, np.ones((1, 16), np.int64), s.zero_state(1))[0] for t, s in sessions.items()}
    ref = logits["ort"]
    print("nodes: " + ", ".join(f"{t} {n}" for t, n in nodes.items()) + "; prefill logits vs ort's, relative max "
          "error: " + ", ".join(f"{t} {np.abs(x - ref).max() / np.abs(ref).max():.1e}" for t, x in logits.items()
                                if t != "ort") + " (ort-gpu: its L2-norm epsilon, docs/export.md)")
    others = [t for t in exports if t != REFERENCE]
    print("| tokens | phase | " + " | ".join(f"{t} ms" for t in exports) + " | "
          + " | ".join(f"{t} / {REFERENCE}" for t in others) + " |")
    print("|---" * (2 + len(exports) + len(others)) + "|")
    for T in prompts:
        for phase, make in (("prefill", _prefill), ("decode", _decode)):
            timings = interleaved({t: make(s, T, vocab) for t, s in sessions.items()}, args.rounds, args.budget)
            ms = [f"{timings[t].median * 1e3:.2f}" for t in exports]
            ratios = [_spread(timings[t].ratios(timings[REFERENCE])) for t in others]
            print(f"| {T} | {phase} | " + " | ".join(ms + ratios) + " |", flush=True)
    others = [t for t in TARGETS if t != REFERENCE]
    if args.nodes:
        config = checkpoints.config("qwen3_5", args.shape)
        H, K, V = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
        print(f"\nThe linear-attention node alone ({H} heads, K = {K}, V = {V}, B = 1, float32; decode: one "
              f"token from a zero state)")
        print("| tokens | " + " | ".join(f"{t} ms" for t in TARGETS) + " | "
              + " | ".join(f"{t} / {REFERENCE}" for t in others) + " |")
        print("|---" * (1 + len(TARGETS) + len(others)) + "|")
        nodes_of = node_sessions(H, K, V)
        for T in [*prompts, 1]:
            fns = {}
            for target, (session, feeds) in nodes_of.items():
                fns[target] = (lambda s, f: lambda: s.run(None, f))(session, feeds(T))
            timings = interleaved(fns, args.rounds, args.budget)
            ms = [f"{timings[t].median * 1e3:.2f}" for t in TARGETS]
            ratios = [_spread(timings[t].ratios(timings[REFERENCE])) for t in others]
            print(f"| {T} | " + " | ".join(ms + ratios) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
