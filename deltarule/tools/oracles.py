"""The other runtimes as oracles: run a one-node ONNX model in ONNX Runtime or
ONNX's reference evaluator, and `deltarule check --peers`, which compares each
contract adapter with its runtime on a few representative random inputs.

The test-suite (tests/test_contracts_*.py) runs the same comparisons on many
more configurations; this module is what a user runs on an installed package.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class PeerMissing(RuntimeError):
    """The peer runtime is not installed; the message says which and how to get it."""


def one_node_model(op: str, inputs: list, outputs: list, *, domain: str = "", opset: int = 27,
                   ir_version: int = 11, **attrs):
    """A model of one `op` node (an ``onnx.ModelProto``).

    Args:
        op, domain: the operator (e.g. "GatedDeltaNet", "com.microsoft").
        inputs: [(name, numpy dtype, shape)] in the operator's input order (a shape may hold
            dimension names); ``None`` in place of a triple omits an optional input.
        outputs: [(name, numpy dtype, shape or None)].
        opset, ir_version: the default domain's opset and the model's IR version (onnxruntime-web
            1.31 takes IR 10 at most).
        attrs: the node's attributes.
    """
    try:
        from onnx import helper
    except ImportError as e:
        raise PeerMissing("onnx is not installed (pip install 'deltarule[peers]')") from e
    names = [x[0] if x is not None else "" for x in inputs]
    while names and not names[-1]:
        names.pop()
    info = lambda name, dt, shape: helper.make_tensor_value_info(  # noqa: E731
        name, helper.np_dtype_to_tensor_dtype(np.dtype(dt)), shape)
    node = helper.make_node(op, names, [x[0] for x in outputs], domain=domain, **attrs)
    graph = helper.make_graph([node], op, [info(*x) for x in inputs if x is not None], [info(*x) for x in outputs])
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)


def run_onnx_node(op: str, inputs: list, outputs: list, *, domain: str = "", runtime: str = "onnxruntime",
                  **attrs) -> list[np.ndarray]:
    """Build a one-node model (`one_node_model`, static shapes) and run it.

    Args:
        op, domain: the operator (e.g. "GatedDeltaNet", "com.microsoft").
        inputs: [(name, ndarray or None)] in the operator's input order; None
            omits an optional input.
        outputs: [(name, numpy dtype)].
        runtime: "onnxruntime" (CPU execution provider) or "reference"
            (`onnx.reference.ReferenceEvaluator`).
        attrs: the node's attributes.
    """
    model = one_node_model(op, [(name, x.dtype, list(x.shape)) if x is not None else None for name, x in inputs],
                           [(name, dt, None) for name, dt in outputs], domain=domain, **attrs)
    feeds = {name: x for name, x in inputs if x is not None}
    if runtime == "reference":
        from onnx.reference import ReferenceEvaluator
        return ReferenceEvaluator(model).run(None, feeds)
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise PeerMissing("onnxruntime is not installed (pip install 'deltarule[peers]')") from e
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@dataclass
class PeerResult:
    name: str
    errors: dict              # output name -> relative error; empty when skipped
    tol: float
    skipped: str = ""

    @property
    def passed(self) -> bool:
        return not self.skipped and all(e <= self.tol for e in self.errors.values())


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / den) if den > 0 else float(np.linalg.norm(x))


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)        # noqa: E731
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)  # noqa: E731
    uniform = lambda lo, hi, *s: rng.uniform(lo, hi, s).astype(np.float32)  # noqa: E731
    return normal, unit, uniform


def _ort_gated_delta_net():
    from ..contracts import ort
    normal, unit, uniform = _inputs(1)
    T, Hq, Hv, K, V = 20, 2, 4, 8, 6
    cu = np.array([0, 0, 5, 5, 12, 20], np.int32)
    args = dict(query=normal(T, Hq, K), key=normal(T, Hq, K), value=normal(T, Hv, V), cu_seqlens=cu,
                decay=normal(T, Hv), beta=normal(T, Hv), initial_state=normal(5, Hv, V, K),
                a_log=uniform(-1, 1, Hv), dt_bias=uniform(-1, 1, Hv))
    attrs = dict(gate_activation="qwen", beta_activation="sigmoid", qk_l2_norm=1)
    got = ort.gated_delta_net(*args.values(), **attrs)
    ref = run_onnx_node("GatedDeltaNet", list(args.items()), [("output", np.float32), ("final_state", np.float32)],
                        domain="com.microsoft", **attrs)
    return got, ref


def _ort_linear_attention():
    from ..contracts import ort
    normal, unit, uniform = _inputs(2)
    B, T, Hq, Hkv, K, V = 2, 17, 4, 2, 8, 6
    args = dict(query=normal(B, T, Hq * K), key=unit(normal(B, T, Hkv, K)).reshape(B, T, Hkv * K),
                value=normal(B, T, Hkv * V), past_state=normal(B, Hkv, K, V),
                decay=uniform(-1, -0.01, B, T, Hkv * K), beta=uniform(0.05, 0.95, B, T, Hkv))
    attrs = dict(q_num_heads=Hq, kv_num_heads=Hkv, update_rule="gated_delta")
    got = ort.linear_attention(*args.values(), **attrs)
    ref = run_onnx_node("LinearAttention", list(args.items()), [("output", np.float32), ("present_state", np.float32)],
                        domain="com.microsoft", **attrs)
    return got, ref


def _ort_linear_attention_gate():
    from ..contracts import ort
    normal, unit, uniform = _inputs(3)
    H = 4
    args = dict(a=normal(3, 5, H), dt_bias=uniform(-1, 1, H), decay_scale=-np.exp(uniform(-1, 1, H)), b=normal(3, 5, H))
    got = ort.linear_attention_gate(*args.values())
    ref = run_onnx_node("LinearAttentionGate", list(args.items()), [("decay", np.float32), ("beta", np.float32)],
                        domain="com.microsoft")
    return got, ref


def _onnx_linear_attention(rule: str):
    def check():
        from ..contracts import onnx_linear_attention
        normal, unit, uniform = _inputs(4)
        B, T, Hq, Hkv, K, V = 2, 13, 4, 2, 8, 6
        args = dict(query=normal(B, T, Hq * K), key=unit(normal(B, T, Hkv, K)).reshape(B, T, Hkv * K),
                    value=normal(B, T, Hkv * V), past_state=normal(B, Hkv, K, V),
                    decay=uniform(-1, -0.01, B, T, Hkv) if rule in ("gated", "gated_delta") else None,
                    beta=uniform(0.05, 0.95, B, T, Hkv) if rule in ("delta", "gated_delta") else None)
        attrs = dict(q_num_heads=Hq, kv_num_heads=Hkv, update_rule=rule)
        got = onnx_linear_attention.linear_attention(*args.values(), **attrs)
        ref = run_onnx_node("LinearAttention", list(args.items()),
                            [("output", np.float32), ("present_state", np.float32)], runtime="reference", **attrs)
        return got, ref
    return check


def _fla(kind: str):
    def check():
        import torch
        try:
            if kind == "gdn":
                from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule as naive
            elif kind == "kda":
                from fla.ops.kda.naive import naive_recurrent_kda as naive
            else:
                from fla.ops.gdn2.naive import naive_recurrent_gdn2 as naive
        except ImportError as e:
            raise PeerMissing("fla-core (with triton) is not installed (pip install 'deltarule[peers]')") from e
        from ..contracts import fla
        torch.manual_seed(5)
        B, T, H, K, V = 1, 37, 2, 16, 16
        q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        k = torch.nn.functional.normalize(k, dim=-1)
        h0 = torch.randn(B, H, K, V)
        if kind == "gdn":
            g, beta = -torch.rand(B, T, H), torch.rand(B, T, H)
            got = fla.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                                       output_final_state=True)
            ref = naive(q, k, v, beta, g, initial_state=h0, output_final_state=True)
        elif kind == "kda":
            g, beta = -torch.rand(B, T, H, K), torch.rand(B, T, H)
            got = fla.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
            ref = naive(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        else:
            g, b, w = -torch.rand(B, T, H, K), torch.rand(B, T, H, K), torch.rand(B, T, H, V)
            got = fla.fused_recurrent_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True)
            ref = naive(q, k, v, g, b, w, initial_state=h0, output_final_state=True)
        return [x.detach().numpy() for x in got], [x.detach().numpy() for x in ref]
    return check


CHECKS = [
    ("ort.GatedDeltaNet varlen GVA qwen-gate sigmoid l2norm", _ort_gated_delta_net, 2e-5),
    ("ort.LinearAttention per-key GQA past", _ort_linear_attention, 2e-5),
    ("ort.LinearAttentionGate rank-3", _ort_linear_attention_gate, 2e-5),
    *((f"onnx.LinearAttention-27 {rule} GQA past (reference evaluator)", _onnx_linear_attention(rule), 2e-5)
      for rule in ("linear", "gated", "delta", "gated_delta")),
    ("fla fused_recurrent_gated_delta_rule (naive ref)", _fla("gdn"), 1e-5),
    ("fla fused_recurrent_kda (naive ref)", _fla("kda"), 1e-5),
    ("fla fused_recurrent_gdn2 (naive ref)", _fla("gdn2"), 1e-5),
]


def run_checks() -> list[PeerResult]:
    """Every peer comparison; a missing runtime gives a skipped result with the reason."""
    results = []
    for name, check, tol in CHECKS:
        try:
            got, ref = check()
        except PeerMissing as e:
            results.append(PeerResult(name, {}, tol, skipped=str(e)))
            continue
        errors = {f"out{i}": _rel(np.asarray(g), r) for i, (g, r) in enumerate(zip(got, ref))}
        results.append(PeerResult(name, errors, tol))
    return results
