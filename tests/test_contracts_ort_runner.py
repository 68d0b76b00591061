"""deltarule.onnx.run on graphs with onnxruntime 1.32's newest contrib inputs, attributes and
outputs: GatedDeltaNet's compact capture (capture_count, state_update_active, state_update),
LinearAttention's state_window, CausalConvWithState's windows, ndim > 1 and extended
attributes. Where ORT's CPU kernel runs the graph, `run` is compared with it; where it refuses,
with the adapter (tests/test_contracts_ort_*.py check the adapters themselves).
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="deltarule.onnx needs the 'onnx' package")
ort = pytest.importorskip("onnxruntime", reason="these checks run models in onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

from deltarule import ContractError  # noqa: E402
from deltarule import onnx as donnx  # noqa: E402
from deltarule.contracts import ort as dort  # noqa: E402

from conftest import rel, rng_for  # noqa: E402
from test_contracts_ort import F32_TOL, l2n, normal  # noqa: E402

MS = "com.microsoft"


def info(name, array):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape))


def model(nodes, feeds: dict, outputs: list[str]):
    """A graph of `nodes` over the graph inputs `feeds` (their arrays type them), outputs untyped."""
    graph = helper.make_graph(nodes, "g", [info(n, a) for n, a in feeds.items()],
                              [onnx.ValueInfoProto(name=n) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27), helper.make_opsetid(MS, 1)],
                             ir_version=10)


def ort_session_run(m, feeds):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_equal_outputs(got, ref, names):
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        if np.linalg.norm(r) > 0:
            assert rel(g, r) < F32_TOL, f"{name}: {rel(g, r):.3g}"
        else:
            np.testing.assert_array_equal(g, r)


def gdn_feeds(rng, *, with_active=True):
    T, Hq, Hv, K, V = 9, 2, 4, 4, 3
    feeds = dict(q=normal(rng, T, Hq, K), k=l2n(normal(rng, T, Hq, K)), v=normal(rng, T, Hv, V),
                 cu=np.array([0, 0, 4, 9], np.int32), decay=rng.uniform(-1, -0.01, (T, Hv)).astype(np.float32),
                 beta=rng.uniform(0.05, 0.95, (T, Hv)).astype(np.float32), s0=normal(rng, 3, Hv, V, K),
                 count=np.array([1, 2, 9], np.int32))
    if with_active:
        feeds["active"] = np.array([1], np.int32)
    return feeds


def gdn_graph(feeds, *, capacity=3, outputs=("o", "s", "su")):
    """q * 2 -> GatedDeltaNet (capture) -> o + 1; the state and state_update graph outputs."""
    ins = ["q2", "k", "v", "cu", "decay", "beta", "s0", "", "", "count" if capacity else "",
           "active" if "active" in feeds else ""]
    while not ins[-1]:
        ins.pop()
    nodes = [helper.make_node("Mul", ["q", "two"], ["q2"]),
             helper.make_node("GatedDeltaNet", ins, list(outputs), domain=MS, name="gdn",
                              state_update_capacity=capacity),
             helper.make_node("Add", [outputs[0], "one"], ["o1"])]
    m = model(nodes, feeds, ["o1", *outputs[1:]])
    m.graph.initializer.extend([helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
                                helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    return m


@pytest.mark.parametrize("active", [1, 0, None], ids=["active", "inactive", "active-absent"])
def test_run_gated_delta_net_with_capture_matches_ort(request, active):
    feeds = gdn_feeds(rng_for(request), with_active=active is not None)
    if active is not None:
        feeds["active"][0] = active
    m = gdn_graph(feeds)
    session = donnx.Session(m)
    assert ("deltarule", "gdn") in session.plan
    got = session.run(None, feeds)
    assert got[2].shape == (3, 3 * (4 + 8 + 12))
    assert_equal_outputs(got, ort_session_run(m, feeds), ("o1", "s", "su"))
    assert bool(got[2].any()) == (active != 0)


def test_run_gated_delta_net_state_update_without_capacity_is_empty_like_ort(request):
    feeds = gdn_feeds(rng_for(request), with_active=False)
    feeds.pop("count")
    m = gdn_graph(feeds, capacity=0)
    got, ref = donnx.run(m, feeds), ort_session_run(m, feeds)
    assert got[2].shape == ref[2].shape == (3, 0) and got[2].dtype == np.float32
    assert_equal_outputs(got[:2], ref[:2], ("o1", "s"))


def test_run_refuses_a_gated_delta_net_node_with_four_outputs(request):
    feeds = gdn_feeds(rng_for(request))
    m = gdn_graph(feeds, outputs=("o", "s", "su", "extra"))
    with pytest.raises(ContractError) as info_:
        donnx.Session(m)
    assert info_.value.argument == "node 'gdn' outputs"


def test_run_linear_attention_state_window(request):
    """ORT's CPU kernel refuses the model; run computes the node with the adapter."""
    rng = rng_for(request)
    B, T, H, K, V, W = 2, 5, 2, 4, 3, 3
    feeds = dict(q=normal(rng, B, T, H * K), k=l2n(normal(rng, B, T, H, K)).reshape(B, T, H * K),
                 v=normal(rng, B, T, H * V), past=normal(rng, W, B, H, K, V),
                 decay=rng.uniform(-1, -0.01, (B, T, H)).astype(np.float32),
                 beta=rng.uniform(0.05, 0.95, (B, T, H)).astype(np.float32))
    attrs = dict(q_num_heads=H, kv_num_heads=H, state_window=W)
    node = helper.make_node("LinearAttention", ["q", "k", "v", "past", "decay", "beta"], ["o", "present"],
                            domain=MS, name="la", **attrs)
    m = model([node], feeds, ["o", "present"])
    got = donnx.run(m, feeds)
    want = dort.linear_attention(*feeds.values(), **attrs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert got[1].shape == (W, B, H, K, V)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="state_window"):
        ort_session_run(m, feeds)


def conv_graph(feeds, outputs=("y", "state"), **attrs):
    """x * 2 -> CausalConvWithState -> y + 1."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["x2"]),
             helper.make_node("CausalConvWithState", ["x2", "w", "b", "past"], list(outputs), domain=MS,
                              name="conv", **attrs),
             helper.make_node("Add", [outputs[0], "one"], ["y1"])]
    m = model(nodes, feeds, ["y1", *outputs[1:]])
    m.graph.initializer.extend([helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
                                helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    return m


def conv_feeds(rng, *, x_shape=(2, 3, 5), past_shape=(2, 3, 3), C=3, kernel=(4,)):
    return dict(x=normal(rng, *x_shape), w=normal(rng, C, 1, *kernel), b=normal(rng, C), past=normal(rng, *past_shape))


def test_run_leaves_a_conv_ort_cpu_runs_to_ort(request):
    """A CausalConvWithState node ORT's CPU kernel runs (here dilation 2, channels last) stays in
    ORT's session: no cut, no deltarule call."""
    feeds = conv_feeds(rng_for(request), x_shape=(2, 5, 3), past_shape=(2, 6, 3))
    m = conv_graph(feeds, dilation=2, channels_last=1)
    session = donnx.Session(m)
    assert [kind for kind, _ in session.plan] == ["ort"]
    assert_equal_outputs(session.run(None, feeds), ort_session_run(m, feeds), ("y1", "state"))


CONV_CASES = {
    # attributes, input shapes, the node's outputs
    "state_window": (dict(state_window=2), dict(past_shape=(2, 2, 3, 3)), ("y", "state")),
    "ndim-2": (dict(ndim=2), dict(x_shape=(2, 3, 2, 5), past_shape=(2, 3, 2, 3), kernel=(1, 4)), ("y", "state")),
    "capture": (dict(channels_last=1, state_update_capacity=3, input_channels=3, input_channel_offset=1),
                dict(x_shape=(2, 5, 6), past_shape=(2, 3, 3)), ("y", "state", "su")),
    "state_length": (dict(state_length=6, state_channels_last=1), dict(past_shape=(2, 6, 3)), ("y", "state")),
}


@pytest.mark.parametrize("attrs, shapes, outputs", CONV_CASES.values(), ids=CONV_CASES.keys())
def test_run_computes_a_conv_ort_cpu_refuses(request, attrs, shapes, outputs):
    feeds = conv_feeds(rng_for(request), **shapes)
    m = conv_graph(feeds, outputs, **attrs)
    session = donnx.Session(m)
    assert ("deltarule", "conv") in session.plan
    got = session.run(None, feeds)
    want = dort.causal_conv_with_state(feeds["x"] * 2, feeds["w"], feeds["b"], feeds["past"], **attrs)
    np.testing.assert_array_equal(got[0], want[0] + 1)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail):
        ort_session_run(m, feeds)


@pytest.mark.parametrize("outputs, attrs, argument", [
    (("y", "state", "su"), dict(), "state_update_capacity"),
    (("y", "state", "su", "extra"), dict(state_update_capacity=2, channels_last=1), "node 'conv' outputs"),
    (("y", "state"), dict(state_window=2, foo=1), "foo"),
], ids=["state_update-without-capacity", "four-outputs", "unknown-attribute"])
def test_run_refuses_a_conv_node_the_op_does_not_define(request, outputs, attrs, argument):
    feeds = conv_feeds(rng_for(request), x_shape=(2, 5, 3))
    with pytest.raises(ContractError) as info_:
        donnx.Session(conv_graph(feeds, outputs, **attrs))
    assert info_.value.argument == argument, info_.value
