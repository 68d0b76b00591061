"""`deltarule.onnx.export.exporter.to_onnx` on single `linear_attention` calls: every argument of the call
record the translation accepts (gate forms, g with gk, the raw-gate arm, the sigmoid on every
gate, scales including 0, L2 norm, state layouts and dtypes, GQA / GVA, 16-bit operands beside
float32 gates) gives the eager call's result in ONNX Runtime and in `deltarule.onnx.run`, on
every target; the rest is refused at export time, naming the argument (on target ort-gpu also
GQA, which com.microsoft.GatedDeltaNet cannot express).

Target ort-gpu's node normalizes q and k with its own epsilon (1e-12, `GATED_DELTA_NET_L2NORM_EPS`)
where the call has `l2norm_eps`: its result is checked against the eager call with that epsilon
at the same tolerance as the other targets, and against the call as made within the effect of
the epsilon's change (`_eps_effect`)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

import deltarule  # noqa: E402
from deltarule.tools.check import STORE_TOL  # noqa: E402
from deltarule.onnx.export.exporter import to_onnx  # noqa: E402
from deltarule.onnx.export.translate import GATED_DELTA_NET_L2NORM_EPS  # noqa: E402
from deltarule.onnx import run  # noqa: E402

from strategies import Call, make_args, valid_calls  # noqa: E402

# ONNX's node and deltarule's kernel both compute in float32, then round to the output's
# dtype: they differ by float32 arithmetic order and at most one rounding of the stored value
ARITHMETIC_TOL = 1e-5
_ONNX_TYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
               torch.bfloat16: onnx.TensorProto.BFLOAT16}
CALLS = valid_calls(max_B=2, max_T=4, max_dim=6, min_B=1, min_T=1, layouts=("dense",), slabs=("none",),
                    views=False, plans=False)


class _Call(torch.nn.Module):
    """One `linear_attention` call: takes its tensors in float32 (what ONNX Runtime is fed) and
    casts each to the call's dtype inside, so 16-bit operands and states are part of the graph."""

    def __init__(self, args: dict):
        super().__init__()
        self.names = [n for n, x in args.items() if isinstance(x, torch.Tensor)]
        self.dtypes = [args[n].dtype for n in self.names]
        self.scalars = {n: x for n, x in args.items() if not isinstance(x, torch.Tensor)}

    def forward(self, *tensors):
        tensors = {n: x.to(dtype) for n, x, dtype in zip(self.names, tensors, self.dtypes)}
        return deltarule.linear_attention(**tensors, **self.scalars)


def _exported(args: dict, target: str):
    module = _Call(args)
    inputs = tuple(args[n].float() for n in module.names)
    program = torch.export.export(module, inputs, strict=False)
    model = to_onnx(program, target, inputs=module.names, outputs=["o", "state"], roles={})
    return module, inputs, model


def _assert_equal_to_eager(name: str, got: np.ndarray, want: torch.Tensor, slack: float = 0.0) -> None:
    """`got` has the eager result's dtype (bfloat16 read as float32), shape, non-finite elements, and values within float32
    arithmetic plus one rounding to the dtype (plus `slack`)."""
    want_np = want.float().numpy() if want.dtype == torch.bfloat16 else want.numpy()     # (exact)
    assert got.dtype == want_np.dtype and got.shape == want_np.shape, (name, got.dtype, got.shape)
    finite = np.isfinite(want_np)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg=f"{name}: non-finite elements differ")
    want64, got64 = want_np[finite].astype(np.float64), got[finite].astype(np.float64)
    scale = np.linalg.norm(want64)
    error = np.linalg.norm(got64 - want64) / scale if scale else np.abs(got64).max(initial=0.0)
    assert error <= ARITHMETIC_TOL + STORE_TOL[want.dtype] + slack, f"{name}: relative error {error:.3e}"


def _readable(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its bfloat16 outputs cast to float32 after the fact (NumPy has no bfloat16;
    the cast is exact)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for value in model.graph.output:
        if value.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16:
            stored = value.name + "_bfloat16"
            for node in model.graph.node:
                node.output[:] = [stored if x == value.name else x for x in node.output]
            model.graph.node.append(onnx.helper.make_node("Cast", [stored], [value.name], to=onnx.TensorProto.FLOAT))
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return model


def _eps_effect(args: dict, inputs: tuple, module: _Call) -> float:
    """The relative change of the L2-normalized q and k rows when the epsilon goes from the
    call's `l2norm_eps` to the node's: at most |eps - 1e-12| / (2 min |x|^2) over the rows."""
    if not args.get("qk_l2norm"):
        return 0.0
    eps = args.get("l2norm_eps", 1e-6)
    rows = [x.to(dtype).float() for n, x, dtype in zip(module.names, inputs, module.dtypes) if n in ("q", "k")]
    smallest = min(float(x.pow(2).sum(-1).min()) for x in rows)
    return abs(eps - GATED_DELTA_NET_L2NORM_EPS) / (2 * smallest) if smallest else float("inf")


def _is_gqa(call: Call) -> bool:
    return call.Hq != call.Hk and call.update != "erase_write"


def _check(call: Call, target: str) -> None:
    args = make_args(call)
    if target == "ort-gpu" and _is_gqa(call):
        with pytest.raises(deltarule.Unsupported, match=r"GQA \(query heads Hq = \d+ above"):
            _exported(args, target)
        return
    module, inputs, model = _exported(args, target)
    want = module(*inputs)
    checks = [(want, 0.0)]
    if target == "ort-gpu" and args.get("qk_l2norm"):
        # the node's epsilon: the same tolerance; the call's: within the epsilon's effect (a few
        # times the rows' relative change, which the recurrence carries over a few tokens)
        node_eps = _Call({**args, "l2norm_eps": GATED_DELTA_NET_L2NORM_EPS})
        checks = [(node_eps(*inputs), 0.0), (want, 8 * call.T * _eps_effect(args, inputs, module))]
    declared = [value.type.tensor_type.elem_type for value in model.graph.output]
    assert declared == [_ONNX_TYPES[w.dtype] for w in want], "the graph's outputs are not the eager dtypes"
    model = _readable(model)
    feeds = {n: x.numpy() for n, x in zip(module.names, inputs)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for runner, got in (("onnxruntime", session.run(None, feeds)), ("deltarule.onnx.run", run(model, feeds))):
        for wanted, slack in checks:
            for name, g, w in zip(("o", "state"), got, wanted):
                _assert_equal_to_eager(f"{runner} {name}", g, w, slack)


@pytest.mark.parametrize("target", ["ort", "onnx"])
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(call=CALLS)
def test_every_accepted_call_exports_to_the_eager_result(target, call):
    _check(call, target)


# ort-gpu: fewer examples (CI time); the GQA ones check the refusal
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(call=CALLS)
def test_every_accepted_call_exports_to_the_eager_result_on_ort_gpu(call):
    _check(call, "ort-gpu")


@pytest.mark.parametrize("target", ["ort", "ort-gpu"])
@pytest.mark.parametrize("scale", [0.0, -0.0, 1e-46, -2.5, None])
def test_scales_zero_and_below_float32_are_not_the_nodes_default(scale, target):
    """ONNX reads scale 0 as 1 / sqrt(d_k); deltarule's 0 (and a scale float32 rounds to 0) is 0."""
    _check(Call(seed=3, B=2, T=3, Hq=2, Hk=2, Hv=2, K=4, V=4, scale=scale), target)


@pytest.mark.parametrize("target", ["ORT", "tensorrt", None, ["ort"]])
def test_an_unknown_target_is_refused_before_converting(target, monkeypatch):
    args = make_args(Call(seed=2, B=1, T=2, K=4, V=4))
    module = _Call(args)
    program = torch.export.export(module, tuple(args[n].float() for n in module.names), strict=False)

    def convert(*args, **kwargs):
        raise AssertionError("converted before the target was checked")
    monkeypatch.setattr(torch.onnx, "export", convert)
    with pytest.raises(deltarule.ContractError, match="^target: expected 'ort' \\| 'onnx' \\| 'ort-gpu'"):
        to_onnx(program, target, inputs=module.names, outputs=["o", "state"], roles={})


@pytest.mark.parametrize("target", ["ort", "ort-gpu"])
@pytest.mark.parametrize("index", ["cu_seqlens", "seq_lens"])
def test_calls_without_a_node_are_refused_naming_the_argument(index, target):
    args = make_args(Call(seed=1, B=1, T=4, K=4, V=4))
    args[index] = torch.tensor([0, 4], dtype=torch.int32) if index == "cu_seqlens" else torch.tensor([3])
    with pytest.raises(deltarule.Unsupported, match=rf"\({index}\)"):
        _exported(args, target)


def test_ort_gpu_is_one_gated_delta_net_node_with_its_gates_fused():
    """The raw-gate arm, beta's sigmoid and the L2 norm go into the node's attributes (GVA
    heads as they are, float16 q / k / v as the node's T); GQA is refused; a Gated DeltaNet-2
    call keeps ai.deltarule::LinearAttention."""
    call = Call(seed=4, dtype="float16", B=2, T=3, Hq=1, Hk=1, Hv=2, K=4, V=5, raw_gate=True, beta_sigmoid=True,
                qk_l2norm=True, state="float32", state_layout="vk")
    _, _, model = _exported(make_args(call), "ort-gpu")
    nodes = [n for n in model.graph.node if n.op_type in ("GatedDeltaNet", "LinearAttention")]
    assert [(n.domain, n.op_type) for n in nodes] == [("com.microsoft", "GatedDeltaNet")]
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attributes == {"update_rule": b"gated_delta", "scale": 0.5, "qk_l2_norm": 1, "beta_activation": b"sigmoid",
                          "gate_activation": b"qwen", "chunk_size": 16}
    assert not [n for n in model.graph.node if n.op_type in ("Softplus", "Sigmoid", "ReduceSumSquare", "Expand")]
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.value_info)}
    assert types.get(nodes[0].input[0]) == onnx.TensorProto.FLOAT16
    _check(call, "ort-gpu")
    gdn2 = Call(seed=5, B=1, T=2, Hq=2, Hk=1, Hv=1, K=4, V=4, update="erase_write")
    _, _, model = _exported(make_args(gdn2), "ort-gpu")
    assert [(n.domain, n.op_type) for n in model.graph.node if "LinearAttention" in n.op_type
            or n.op_type == "GatedDeltaNet"] == [("ai.deltarule", "LinearAttention")]
    with pytest.raises(deltarule.Unsupported, match="GQA"):
        _exported(make_args(Call(seed=6, B=1, T=2, Hq=2, Hk=1, Hv=1, K=4, V=4)), "ort-gpu")


class _Step(torch.nn.Module):
    """A decoder-like step: the recurrent state in and out under the decoder's names."""

    def forward(self, q, k, v, g, beta, state):
        return deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=state, qk_l2norm=True,
                                          l2norm_eps=GATED_DELTA_NET_L2NORM_EPS)


def test_ort_gpu_takes_the_decoders_recurrent_state_v_major():
    """On target ort-gpu a graph whose state input and output are the decoder's
    (``past_recurrent.{i}`` / ``present_recurrent.{i}``) takes and gives them V-major [B, H, V, K],
    the node's layout, with no Transpose; any other graph keeps the traced function's layout."""
    B, T, H, K, V = 2, 3, 2, 4, 6
    x = (torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V), -torch.rand(B, T, H),
         torch.rand(B, T, H), torch.randn(B, H, K, V))
    program = torch.export.export(_Step(), x, strict=False)
    want = _Step()(*x)
    feeds = {n: t.numpy() for n, t in zip("qkvgb", x[:5])}
    for past, present, v_major in (("past_recurrent.0", "present_recurrent.0", True),
                                   ("s", "present_recurrent.0", False)):
        model = to_onnx(program, "ort-gpu", inputs=[*"qkvgb", past], outputs=["o", present], roles={})
        dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in (*model.graph.input, *model.graph.output)}
        assert dims[past] == dims[present] == ([B, H, V, K] if v_major else [B, H, K, V])
        assert bool([n for n in model.graph.node if n.op_type == "Transpose"]) != v_major
        state = x[5].transpose(-1, -2) if v_major else x[5]
        got = ort.InferenceSession(model.SerializeToString()).run(None, {**feeds, past: state.contiguous().numpy()})
        _assert_equal_to_eager("o", got[0], want[0])
        _assert_equal_to_eager("state", got[1], want[1].transpose(-1, -2).contiguous() if v_major else want[1])
