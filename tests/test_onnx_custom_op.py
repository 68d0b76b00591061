"""deltarule.onnx: the ai.deltarule::LinearAttention op, its function body, and deltarule.onnx.run.

The function body (a Scan of standard ops) is run by ONNX's ReferenceEvaluator
and by ONNX Runtime and compared with `deltarule.linear_attention` on seeded
random inputs: relative error ||x - ref|| / ||ref|| < 2e-5 in float32, for the
output AND the present state. `deltarule.onnx.run` is compared with plain ORT
on small graphs in which the attention nodes take computed inputs and feed
later nodes.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="deltarule.onnx needs the 'onnx' package")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import deltarule  # noqa: E402
from deltarule import ContractError  # noqa: E402
from deltarule import onnx as donnx  # noqa: E402
from deltarule.onnx import custom_op as ops  # noqa: E402
from deltarule.tools.bench import onnx_block as bench  # noqa: E402
from deltarule.onnx import runner as run_module  # noqa: E402

from conftest import rel

F32_TOL, F16_TOL = 2e-5, 1e-2
RULES = ("linear", "gated", "delta", "gated_delta")
GATED = ("gated", "gated_delta")
DELTA = ("delta", "gated_delta")
HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (3, 1)}       # (q_num_heads, kv_num_heads)


@pytest.fixture
def ort():
    return pytest.importorskip("onnxruntime", reason="these checks run models in onnxruntime, not installed")


def assert_close(got, ref, tol, names=("output", "present_state")):
    for name, x, r in zip(names, got, ref):
        err = rel(x, r)
        assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


def rng_for(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def make_feeds(rng, *, rule, heads, decay="per-head", gates="beta", past=True, B=2, T=9, K=8, V=6,
               dtype=np.float32):
    """Random inputs of ai.deltarule::LinearAttention, keyed by its input names."""
    Hq, Hkv = heads
    k = rng.standard_normal((B, T, Hkv, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    x = dict(query=rng.standard_normal((B, T, Hq * K)), key=k.reshape(B, T, Hkv * K),
             value=rng.standard_normal((B, T, Hkv * V)))
    if past:
        x["past_state"] = 0.5 * rng.standard_normal((B, Hkv, K, V))
    if rule in GATED:
        x["decay"] = rng.uniform(-1.0, -0.01, (B, T, Hkv if decay == "per-head" else Hkv * K))
    if rule in DELTA:
        if gates == "beta":
            x["beta"] = rng.uniform(0.05, 0.95, (B, T, Hkv))
        elif gates == "shared-beta":
            x["beta"] = rng.uniform(0.05, 0.95, (B, T, 1))
        else:
            x["erase_gate"] = rng.uniform(0.0, 1.0, (B, T, Hkv * K))
            x["write_gate"] = rng.uniform(0.0, 1.0, (B, T, Hkv * V))
    return {n: np.asarray(a, np.float32).astype(dtype) for n, a in x.items()}


def canonical(feeds, *, q_num_heads, kv_num_heads, update_rule, scale=0.0):
    """The expected result: deltarule.linear_attention (the canonical API) on the same inputs."""
    t = {n: torch.from_numpy(np.asarray(a, np.float32)) for n, a in feeds.items()}
    B, T, _ = t["query"].shape
    Hq, Hkv = q_num_heads, kv_num_heads
    K = t["query"].shape[2] // Hq
    V = t["value"].shape[2] // Hkv
    kw = {}
    if "decay" in t:
        d = t["decay"]
        kw["g" if d.shape[2] == Hkv else "gk"] = d if d.shape[2] == Hkv else d.reshape(B, T, Hkv, K)
    if "beta" in t:
        kw["beta"] = t["beta"].expand(B, T, Hkv).contiguous()
    if "erase_gate" in t:
        kw["erase"] = t["erase_gate"].reshape(B, T, Hkv, K)
        kw["write"] = t["write_gate"].reshape(B, T, Hkv, V)
    o, s = deltarule.linear_attention(
        t["query"].reshape(B, T, Hq, K), t["key"].reshape(B, T, Hkv, K), t["value"].reshape(B, T, Hkv, V),
        rule=update_rule, scale=None if scale == 0 else scale, initial_state=t.get("past_state"), **kw)
    return o.reshape(B, T, Hq * V).numpy(), s.numpy()


def ort_run(ort, model, feeds, output_names=None):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(output_names, feeds)


# ---------------------------------------------------------------------------
# the function body against deltarule.linear_attention
# ---------------------------------------------------------------------------

CASES = [
    pytest.param(rule, decay, gates, heads, past,
                 id=f"{rule}-{decay}-{gates}-{heads}-{'past' if past else 'no-past'}")
    for rule in RULES
    for decay in (("per-head", "per-key") if rule in GATED else ("no-decay",))
    for gates in (("beta", "erase_write") if rule in DELTA else ("none",))
    for heads in HEADS
    for past in (False, True)
]


@pytest.mark.parametrize("rule, decay, gates, heads, past", CASES)
def test_function_body_matches_deltarule(request, ort, rule, decay, gates, heads, past):
    Hq, Hkv = HEADS[heads]
    feeds = make_feeds(rng_for(request), rule=rule, heads=(Hq, Hkv), decay=decay, gates=gates, past=past)
    attrs = dict(q_num_heads=Hq, kv_num_heads=Hkv, update_rule=rule)
    model = donnx.make_model(feeds, **attrs)
    assert [f.overload for f in model.functions] == [donnx.Config.of_node(model.graph.node[0]).overload]
    expected = canonical(feeds, **attrs)
    assert expected[0].shape == (2, 9, Hq * 6) and expected[1].shape == (2, Hkv, 8, 6)
    assert_close(ReferenceEvaluator(model).run(None, feeds), expected, F32_TOL)
    assert_close(ort_run(ort, model, feeds), expected, F32_TOL)
    # and deltarule's own kernel for the op
    assert_close(donnx.linear_attention(**feeds, **attrs), expected, F32_TOL)


@pytest.mark.parametrize("scale", [0.3, -1.5])
@pytest.mark.parametrize("gates", ["shared-beta", "erase_write"])
def test_explicit_scale_and_shared_beta(request, ort, gates, scale):
    feeds = make_feeds(rng_for(request), rule="gated_delta", heads=HEADS["gqa"], decay="per-key", gates=gates)
    attrs = dict(q_num_heads=4, kv_num_heads=2, update_rule="gated_delta", scale=scale)
    model = donnx.make_model(feeds, **attrs)
    expected = canonical(feeds, **attrs)
    assert_close(ReferenceEvaluator(model).run(None, feeds), expected, F32_TOL)
    assert_close(ort_run(ort, model, feeds), expected, F32_TOL)


@pytest.mark.parametrize("rule", RULES)
def test_without_gates_it_is_onnx_linear_attention_27(request, rule):
    """No erase / write gate: the function body equals ONNX's own reference of LinearAttention-27."""
    feeds = make_feeds(rng_for(request), rule=rule, heads=HEADS["gqa"], decay="per-key",
                       gates="beta" if rule in DELTA else "none")
    attrs = dict(q_num_heads=4, kv_num_heads=2, update_rule=rule)
    ours = ReferenceEvaluator(donnx.make_model(feeds, **attrs)).run(None, feeds)
    names = ["query", "key", "value", "past_state", "decay", "beta"]
    node_inputs = [n if n in feeds else "" for n in names]
    while not node_inputs[-1]:
        node_inputs.pop()
    graph = helper.make_graph(
        [helper.make_node("LinearAttention", node_inputs, ["output", "present_state"], **attrs)], "la27",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(feeds[n].shape)) for n in names if n in feeds],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("output", "present_state")])
    theirs = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)])).run(
        None, feeds)
    assert_close(ours, theirs, F32_TOL)


def test_erase_write_equal_to_beta_reproduce_the_beta_form(request, ort):
    rng = rng_for(request)
    feeds = make_feeds(rng, rule="gated_delta", heads=HEADS["gqa"], decay="per-key", gates="beta")
    B, T, Hkv, K, V = 2, 9, 2, 8, 6
    beta = feeds["beta"][..., None]
    gdn2 = {n: a for n, a in feeds.items() if n != "beta"}
    gdn2["erase_gate"] = np.broadcast_to(beta, (B, T, Hkv, K)).reshape(B, T, Hkv * K).copy()
    gdn2["write_gate"] = np.broadcast_to(beta, (B, T, Hkv, V)).reshape(B, T, Hkv * V).copy()
    attrs = dict(q_num_heads=4, kv_num_heads=2, update_rule="gated_delta")
    assert_close(ort_run(ort, donnx.make_model(gdn2, **attrs), gdn2),
                 ort_run(ort, donnx.make_model(feeds, **attrs), feeds), 1e-6)


def test_the_comparisons_can_fail(request, ort):
    """The checks above see a wrong gate: key-side erase is not a scalar beta, nor the value side."""
    rng = rng_for(request)
    feeds = make_feeds(rng, rule="gated_delta", heads=HEADS["mha"], decay="per-key", gates="erase_write", K=6)
    attrs = dict(q_num_heads=2, kv_num_heads=2, update_rule="gated_delta")
    got = ort_run(ort, donnx.make_model(feeds, **attrs), feeds)
    # the erase gate averaged per head (what LinearAttention-27 could do) is far off
    B, T = 2, 9
    beta_like = dict(feeds)
    beta_like["erase_gate"] = np.repeat(feeds["erase_gate"].reshape(B, T, 2, 6).mean(-1, keepdims=True), 6, -1
                                        ).reshape(B, T, 12)
    assert rel(got[0], canonical(beta_like, **attrs)[0]) > 100 * F32_TOL
    # erase and write swapped (both 6 wide here) is far off too
    swapped = dict(feeds, erase_gate=feeds["write_gate"], write_gate=feeds["erase_gate"])
    assert rel(got[0], canonical(swapped, **attrs)[0]) > 100 * F32_TOL
    assert_close(got, canonical(feeds, **attrs), F32_TOL)


def test_float16_through_the_function(request, ort):
    feeds = make_feeds(rng_for(request), rule="gated_delta", heads=HEADS["gqa"], decay="per-key",
                       gates="erase_write", dtype=np.float16)
    attrs = dict(q_num_heads=4, kv_num_heads=2, update_rule="gated_delta")
    got = ort_run(ort, donnx.make_model(feeds, **attrs), feeds)
    assert got[0].dtype == np.float16 and got[1].dtype == np.float16    # past_state's dtype
    ours = donnx.linear_attention(**feeds, **attrs)
    assert ours[0].dtype == np.float16 and ours[1].dtype == np.float16
    assert_close(got, canonical(feeds, **attrs), F16_TOL)
    assert_close(ours, canonical(feeds, **attrs), F16_TOL)


@pytest.mark.parametrize("opset", [18, 21, 27])
def test_function_follows_the_model_opset(request, ort, opset):
    feeds = make_feeds(rng_for(request), rule="delta", heads=HEADS["mha"], gates="erase_write")
    attrs = dict(q_num_heads=2, kv_num_heads=2, update_rule="delta")
    model = donnx.make_model(feeds, opset=opset, **attrs)
    assert [o.version for o in model.functions[0].opset_import if o.domain == ""] == [opset]
    onnx.checker.check_model(model)
    assert_close(ort_run(ort, model, feeds), canonical(feeds, **attrs), F32_TOL)


def test_two_configurations_in_one_model_use_overloads(request, ort):
    """A GDN-2 layer (per-key decay, gates, no past) feeding a delta layer with past_state (beta)."""
    rng = rng_for(request)
    a = make_feeds(rng, rule="gated_delta", heads=HEADS["mha"], decay="per-key", gates="erase_write", past=False)
    b = make_feeds(rng, rule="delta", heads=HEADS["mha"], gates="beta", past=True, V=6)
    nodes = [
        donnx.make_node("query", "key", "value", None, "decay", None, "erase_gate", "write_gate",
                        q_num_heads=2, kv_num_heads=2, update_rule="gated_delta", outputs=("o1", "s1")),
        # layer 2 reads layer 1's output as its values
        donnx.make_node("query", "key", "o1", "past2", None, "beta2", q_num_heads=2, kv_num_heads=2,
                        update_rule="delta", outputs=("o2", "s2")),
    ]
    feeds = dict(a, past2=b["past_state"], beta2=b["beta"])
    graph = helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(x.shape)) for n, x in feeds.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("o2", "s1", "s2")])
    model = donnx.attach_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert sorted(f.overload for f in model.functions) == ["delta.past.beta", "gated_delta.nopast.erase_write"]
    got = ort_run(ort, model, feeds)
    la = donnx.linear_attention
    o1, s1 = la(a["query"], a["key"], a["value"], None, a["decay"], None, a["erase_gate"], a["write_gate"],
                q_num_heads=2, kv_num_heads=2, update_rule="gated_delta")
    o2, s2 = la(a["query"], a["key"], o1, b["past_state"], None, b["beta"], q_num_heads=2, kv_num_heads=2,
                update_rule="delta")
    assert_close(got, (o2, s1, s2), F32_TOL, names=("o2", "s1", "s2"))
    assert_close(donnx.run(model, feeds), (o2, s1, s2), F32_TOL, names=("o2", "s1", "s2"))
    # ONNX's ReferenceEvaluator ignores overloads; the expanded model (standard ops only) runs there
    expanded = donnx.expand(model)
    assert not expanded.functions and all(n.domain == "" for n in expanded.graph.node)
    assert_close(ReferenceEvaluator(expanded).run(None, feeds), (o2, s1, s2), F32_TOL, names=("o2", "s1", "s2"))


def test_attach_functions_fills_defaults_and_overloads(request, ort):
    feeds = make_feeds(rng_for(request), rule="gated_delta", heads=HEADS["mha"], decay="per-head",
                       gates="erase_write", past=False)
    node = helper.make_node("LinearAttention", ["query", "key", "value", "", "decay", "", "erase_gate", "write_gate"],
                            ["output", "present_state"], domain="ai.deltarule", q_num_heads=2, kv_num_heads=2)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in feeds],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("output", "present_state")])
    model = donnx.attach_functions(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    node = model.graph.node[0]
    assert node.overload == "gated_delta.nopast.erase_write"
    assert ops.attribute_values(node) == dict(q_num_heads=2, kv_num_heads=2, update_rule="gated_delta",
                                              scale=0.0, chunk_size=64)
    assert model.ir_version >= 10 and ("ai.deltarule", 1) in [(o.domain, o.version) for o in model.opset_import]
    expected = canonical(feeds, q_num_heads=2, kv_num_heads=2, update_rule="gated_delta")
    assert_close(ReferenceEvaluator(model).run(None, feeds), expected, F32_TOL)
    assert_close(ort_run(ort, model, feeds), expected, F32_TOL)


@pytest.mark.parametrize("inputs, attrs, name", [
    (["q", "k", "v", "", "d", "b", "e", "w"], {}, "beta"),
    (["q", "k", "v", "", "d", "", "e"], {}, "write_gate"),
    (["q", "k", "v", "", "", "b"], {}, "decay"),
    (["q", "k", "v", "", "", "", "e", "w"], {"update_rule": "linear"}, "erase_gate"),
    (["q", "k", "v", "", "d", ""], {"update_rule": "gated_delta"}, "beta"),
    (["q", "", "v"], {}, "key"),
    (["q", "k", "v"], {"update_rule": "mamba"}, "update_rule"),
])
def test_node_configuration_errors(inputs, attrs, name):
    node = helper.make_node("LinearAttention", inputs, ["o", "s"], domain="ai.deltarule",
                            q_num_heads=2, kv_num_heads=2, **attrs)
    with pytest.raises(ContractError) as info:
        donnx.Config.of_node(node)
    assert info.value.argument == name


@pytest.mark.parametrize("change, name", [
    (dict(beta=np.zeros((1, 3, 2), np.float32)), "beta"),
    (dict(write_gate=None), "write_gate"),
    (dict(erase_gate=np.zeros((1, 3, 6), np.float32)), "erase_gate"),
    (dict(write_gate=np.zeros((1, 3, 2), np.float32)), "write_gate"),
    (dict(erase_gate=np.zeros((1, 3, 8), np.float16)), "erase_gate"),
    (dict(update_rule="gated"), "erase_gate"),
    (dict(decay=None), "decay"),
    (dict(decay=np.zeros((1, 3, 3), np.float32)), "decay"),
    (dict(past_state=np.zeros((1, 2, 4, 5), np.float32)), "past_state"),
    (dict(q_num_heads=3), "q_num_heads"),
])
def test_deltarule_kernel_contract_errors(change, name):
    args = dict(query=np.zeros((1, 3, 8), np.float32), key=np.zeros((1, 3, 8), np.float32),
                value=np.zeros((1, 3, 8), np.float32), decay=np.zeros((1, 3, 2), np.float32),
                erase_gate=np.zeros((1, 3, 8), np.float32), write_gate=np.zeros((1, 3, 8), np.float32),
                q_num_heads=2, kv_num_heads=2, update_rule="gated_delta")
    args.update(change)
    with pytest.raises(ContractError) as info:
        donnx.linear_attention(**args)
    assert info.value.argument == name


def test_deltarule_kernel_torch_in_torch_out(request):
    feeds = make_feeds(rng_for(request), rule="gated_delta", heads=HEADS["gqa"], decay="per-key",
                       gates="erase_write")
    attrs = dict(q_num_heads=4, kv_num_heads=2, update_rule="gated_delta")
    o_np, s_np = donnx.linear_attention(**feeds, **attrs)
    o_t, s_t = donnx.linear_attention(**{n: torch.from_numpy(a) for n, a in feeds.items()}, **attrs)
    assert isinstance(o_t, torch.Tensor) and isinstance(s_t, torch.Tensor)
    np.testing.assert_array_equal(o_t.numpy(), o_np)
    np.testing.assert_array_equal(s_t.numpy(), s_np)


# ---------------------------------------------------------------------------
# deltarule.onnx.run: linear-attention nodes by deltarule, the rest by ORT
# ---------------------------------------------------------------------------

class Spy:
    """Counts the calls of every LINEAR_ATTENTION_OPS kernel."""

    def __init__(self, monkeypatch):
        self.calls = {}
        table = dict(run_module.LINEAR_ATTENTION_OPS)
        for key, (fn, n) in table.items():
            table[key] = (self._wrap(key, fn), n)
        monkeypatch.setattr(run_module, "LINEAR_ATTENTION_OPS", table)

    def _wrap(self, key, fn):
        def wrapped(*args, **kwargs):
            self.calls[key] = self.calls.get(key, 0) + 1
            return fn(*args, **kwargs)
        return wrapped


@pytest.mark.parametrize("past", [False, True], ids=["no-past", "past"])
@pytest.mark.parametrize("contrib_gate", [True, False], ids=["LinearAttentionGate", "plain-gate-ops"])
def test_run_gdn2_block_matches_plain_ort(ort, monkeypatch, contrib_gate, past):
    model, feeds = bench.gdn2_block(T=24, B=2, d_model=32, heads=2, d_k=8, d_v=6, past_state=past,
                                    contrib_gate=contrib_gate, seed=5)
    spy = Spy(monkeypatch)
    session = donnx.Session(model)
    assert [kind for kind, _ in session.plan] == ["ort", "deltarule", "ort"]
    assert session.plan[2] == ("ort", ["out_proj"])
    got = session.run(None, feeds)
    assert spy.calls == {("ai.deltarule", "LinearAttention"): 1}
    expected = ort_run(ort, model, feeds)                      # the function body, inlined by ORT
    assert_close(got, expected, F32_TOL, names=("y", "state"))
    # again, another length: the cached sub-model sessions have dynamic dimensions
    short = dict(feeds, x=feeds["x"][:, :7].copy())
    assert_close(session.run(["state", "y"], short), ort_run(ort, model, short, ["state", "y"]), F32_TOL,
                 names=("state", "y"))
    assert spy.calls == {("ai.deltarule", "LinearAttention"): 2}


def test_run_needs_no_function_body(ort):
    """Without the function ORT cannot run the node; deltarule.onnx.run can, with the same result."""
    model, feeds = bench.gdn2_block(T=16, B=1, d_model=16, heads=2, d_k=4, d_v=4, seed=2)
    bare = onnx.ModelProto.FromString(model.SerializeToString())
    del bare.functions[:]
    with pytest.raises(Exception):
        ort_run(ort, bare, feeds)
    assert_close(donnx.run(bare, feeds), ort_run(ort, model, feeds), F32_TOL, names=("y", "state"))


def _mixed_model(rng, *, B=2, T=10, H=2, K=8, V=8, D=16, shuffle=False):
    """x -> 4 stacked attention layers of the 4 kinds, with ops between them; several outputs."""
    f = lambda *s, scale=1.0: numpy_helper.from_array(np.asarray(scale * rng.standard_normal(s), np.float32))
    inits = []

    def init(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    init("shape_heads", np.array([0, 0, H, K], np.int64))
    init("shape_flat", np.array([0, 0, H * V], np.int64))
    nodes = []
    h = "x"
    for i, kind in enumerate(["la27", "gdn", "ms_la", "deltarule"]):
        w = f"w{i}"
        inits.append(f(D, 3 * H * K + 2 * H, scale=D ** -0.5))
        inits[-1].name = w
        p = f"p{i}_"
        nodes += [
            helper.make_node("MatMul", [h, w], [p + "proj"]),
            helper.make_node("Split", [p + "proj", init(p + "splits", np.array([H * K] * 3 + [H, H], np.int64))],
                             [p + "q", p + "kr", p + "v", p + "a", p + "b"], axis=-1),
            helper.make_node("Reshape", [p + "kr", "shape_heads"], [p + "kh"]),
            helper.make_node("LpNormalization", [p + "kh"], [p + "kn"], axis=-1, p=2),
            helper.make_node("Reshape", [p + "kn", init(p + "flatk", np.array([0, 0, H * K], np.int64))], [p + "k"]),
            helper.make_node("Sigmoid", [p + "b"], [p + "beta"]),
            helper.make_node("Softplus", [p + "a"], [p + "sp"]),
            helper.make_node("Neg", [p + "sp"], [p + "decay"]),
        ]
        out = p + "o"
        if kind == "la27":
            nodes.append(helper.make_node("LinearAttention", [p + "q", p + "k", p + "v", "", p + "decay", p + "beta"],
                                          [out, "state0"], q_num_heads=H, kv_num_heads=H))
        elif kind == "ms_la":
            nodes.append(helper.make_node("LinearAttention", [p + "q", p + "k", p + "v", "past2", p + "decay",
                                                              p + "beta"], [out, "state2"], domain="com.microsoft",
                                          q_num_heads=H, kv_num_heads=H, update_rule="gated_delta"))
        elif kind == "deltarule":
            nodes.append(donnx.make_node(p + "q", p + "k", p + "v", None, p + "decay", p + "beta",
                                         q_num_heads=H, kv_num_heads=H, outputs=(out, "state3")))
        else:                                     # com.microsoft.GatedDeltaNet on (B, S, H, D)
            for t in ("q", "k", "v"):
                nodes.append(helper.make_node("Reshape", [p + t, "shape_heads"], [p + t + "4"]))
            nodes += [
                helper.make_node("GatedDeltaNet", [p + "q4", p + "k4", p + "v4", "", p + "decay", p + "beta"],
                                 [p + "o4", "state1"], domain="com.microsoft", update_rule="gated_delta"),
                helper.make_node("Reshape", [p + "o4", "shape_flat"], [out]),
            ]
        nodes += [helper.make_node("Tanh", [out], [p + "t"]),
                  helper.make_node("MatMul", [p + "t", init(f"wo{i}", np.asarray(
                      rng.standard_normal((H * V, D)) * (H * V) ** -0.5, np.float32))], [p + "r"]),
                  helper.make_node("Add", [h, p + "r"], [p + "h"])]
        h = p + "h"
    nodes.append(helper.make_node("ReduceMean", ["x"], ["x_mean"], keepdims=1))   # independent of attention
    if shuffle:
        order = rng.permutation(len(nodes))
        nodes = [nodes[i] for i in order]
    feeds = {"x": rng.standard_normal((B, T, D)).astype(np.float32),
             "past2": (0.5 * rng.standard_normal((B, H, K, V))).astype(np.float32)}
    graph = helper.make_graph(
        nodes, "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, "T", D]),
         helper.make_tensor_value_info("past2", TensorProto.FLOAT, [B, H, K, V])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
         for n in (h, "state0", "state1", "state2", "state3", "p1_o", "x_mean", "past2")],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27), helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid("ai.deltarule", 1)], ir_version=11)
    return donnx.attach_functions(model), feeds


def test_run_routes_every_linear_attention_kind_to_deltarule(request, ort, monkeypatch):
    """LinearAttention-27, com.microsoft GatedDeltaNet / LinearAttention and ai.deltarule, chained."""
    model, feeds = _mixed_model(rng_for(request))
    spy = Spy(monkeypatch)
    session = donnx.Session(model)
    assert [kind for kind, _ in session.plan] == ["ort", "deltarule"] * 4 + ["ort"]
    assert "ReduceMean" in session.plan[0][1]                     # scheduled as early as possible
    got = session.run(None, feeds)
    assert spy.calls == {("", "LinearAttention"): 1, ("com.microsoft", "GatedDeltaNet"): 1,
                         ("com.microsoft", "LinearAttention"): 1, ("ai.deltarule", "LinearAttention"): 1}
    expected = ort_run(ort, model, feeds)          # ORT's own kernels (and the function body)
    names = [o.name for o in model.graph.output]
    assert_close(got, expected, F32_TOL, names=names)
    np.testing.assert_array_equal(got[-1], feeds["past2"])


def test_run_does_not_need_topological_node_order(ort):
    model, feeds = _mixed_model(np.random.default_rng(1))
    shuffled, _ = _mixed_model(np.random.default_rng(1), shuffle=True)
    assert [n.op_type for n in shuffled.graph.node] != [n.op_type for n in model.graph.node]
    names = [o.name for o in model.graph.output]
    assert_close(donnx.run(shuffled, feeds), ort_run(ort, model, feeds), F32_TOL, names=names)


def test_run_accepts_a_path_and_bytes(ort, tmp_path):
    model, feeds = bench.gdn2_block(T=6, B=1, d_model=8, heads=2, d_k=4, d_v=4, seed=3)
    onnx.save(model, tmp_path / "block.onnx")
    ref = donnx.run(model, feeds)
    for source in (str(tmp_path / "block.onnx"), tmp_path / "block.onnx", model.SerializeToString()):
        for x, r in zip(donnx.run(source, feeds), ref):
            np.testing.assert_array_equal(x, r)


def test_docs_quick_start_runs(ort):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "onnx.md").read_text()
    block = re.search(r"## Quick start\n\n```python\n(.*?)```", text, re.S).group(1)
    scope = {}
    exec(compile(block, "docs/onnx.md quick start", "exec"), scope)
    assert_close((scope["o_ort"], scope["s_ort"]), (scope["o_dr"], scope["s_dr"]), F32_TOL)
    assert_close((scope["o_ref"], scope["s_ref"]), (scope["o_dr"], scope["s_dr"]), F32_TOL)


def test_run_feed_errors(ort):
    model, feeds = bench.gdn2_block(T=4, B=1, d_model=8, heads=1, d_k=4, d_v=4)
    session = donnx.Session(model)
    with pytest.raises(ContractError) as info:
        session.run(None, {})
    assert info.value.argument == "x"
    with pytest.raises(ContractError) as info:
        session.run(None, dict(feeds, y=feeds["x"]))
    assert info.value.argument == "feeds"
    with pytest.raises(ContractError) as info:
        donnx.Session(b"not a model")
    assert info.value.argument == "model"


# ---------------------------------------------------------------------------
# node contracts (issue 32): refused with ContractError when the session is built, before any run
# ---------------------------------------------------------------------------

def _one_node_model(node, *, opset=27):
    """A model of `node` alone, its inputs graph inputs (float32, any shape)."""
    graph = helper.make_graph(
        [node], "one", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.input if n],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.output if n])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


HEAD_ATTRS = dict(q_num_heads=2, kv_num_heads=2)
NODE_ERRORS = {                      # (domain, inputs, attributes, opset) -> the argument named
    "onnx-no-q_num_heads": ("", 6, dict(kv_num_heads=2), 27, "q_num_heads"),
    "onnx-no-kv_num_heads": ("", 6, dict(q_num_heads=2), 27, "kv_num_heads"),
    "onnx-unknown-attribute": ("", 6, dict(HEAD_ATTRS, gate_activation="none"), 27, "gate_activation"),
    "onnx-7-inputs": ("", 7, HEAD_ATTRS, 27, "node 'la' inputs"),
    "onnx-opset-18": ("", 6, HEAD_ATTRS, 18, "opset_import"),
    "onnx-opset-26": ("", 6, HEAD_ATTRS, 26, "opset_import"),
    "ms-no-q_num_heads": ("com.microsoft", 6, dict(kv_num_heads=2), 27, "q_num_heads"),
    "ms-unknown-attribute": ("com.microsoft", 6, dict(HEAD_ATTRS, foo=1), 27, "foo"),
    "ms-7-inputs": ("com.microsoft", 7, HEAD_ATTRS, 27, "node 'la' inputs"),
    "deltarule-no-kv_num_heads": ("ai.deltarule", 6, dict(q_num_heads=2), 21, "kv_num_heads"),
    "deltarule-unknown-attribute": ("ai.deltarule", 6, dict(HEAD_ATTRS, foo=1), 21, "foo"),
    "deltarule-9-inputs": ("ai.deltarule", 9, HEAD_ATTRS, 21, "node 'la' inputs"),
    "gdn-unknown-attribute": (("com.microsoft", "GatedDeltaNet"), 6, dict(q_num_heads=2), 27, "q_num_heads"),
}


@pytest.mark.parametrize("domain, n_inputs, attrs, opset, argument", NODE_ERRORS.values(), ids=NODE_ERRORS.keys())
def test_run_refuses_a_node_the_op_does_not_define(domain, n_inputs, attrs, opset, argument, monkeypatch):
    """A linear-attention node the op does not define (a required attribute absent, an unknown
    one, too many inputs, LinearAttention before opset 27): ContractError when the Session is
    built (these reached the kernel as Python TypeErrors, or ran), no kernel called."""
    domain, op_type = domain if isinstance(domain, tuple) else (domain, "LinearAttention")
    inputs = ["q", "k", "v", "past", "decay", "beta", "x7", "x8", "x9"][:n_inputs]
    node = helper.make_node(op_type, inputs, ["o", "s"], name="la", domain=domain, **attrs)
    spy = Spy(monkeypatch)
    with pytest.raises(ContractError) as info:
        donnx.Session(_one_node_model(node, opset=opset))
    assert info.value.argument == argument, info.value
    assert spy.calls == {}


@pytest.mark.parametrize("opset", [27, 28])
def test_run_takes_linear_attention_from_opset_27(opset):
    node = helper.make_node("LinearAttention", ["q", "k", "v"], ["o", "s"], update_rule="linear", **HEAD_ATTRS)
    q = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)
    o, s = donnx.run(_one_node_model(node, opset=opset), dict(q=q, k=q, v=q))
    want = donnx.linear_attention(q, q, q, update_rule="linear", **HEAD_ATTRS)
    assert_close((o, s), want, F32_TOL)


@pytest.mark.parametrize("attrs, argument", [
    (dict(q_num_heads="x", kv_num_heads=2), "q_num_heads"),
    (dict(q_num_heads=2, kv_num_heads=0), "kv_num_heads"),
    (dict(q_num_heads=3, kv_num_heads=2), "q_num_heads"),
    (dict(q_num_heads=True, kv_num_heads=1), "q_num_heads"),
    (dict(HEAD_ATTRS, scale="x"), "scale"),
    (dict(HEAD_ATTRS, scale=float("inf")), "scale"),
    (dict(HEAD_ATTRS, chunk_size=2.5), "chunk_size"),
    (dict(HEAD_ATTRS, update_rule=3), "update_rule"),
], ids=["heads-a-string", "kv-heads-0", "heads-not-a-multiple", "heads-a-bool", "scale-a-string", "scale-inf",
        "chunk_size-a-float", "update_rule-an-int"])
def test_make_node_refuses_attributes(attrs, argument):
    with pytest.raises(ContractError) as info:
        donnx.make_node("q", "k", "v", None, "decay", "beta", **attrs)
    assert info.value.argument == argument, info.value


@pytest.mark.parametrize("attrs, argument", [
    (dict(kv_num_heads=2), "q_num_heads"),
    (dict(q_num_heads=2), "kv_num_heads"),
    (dict(HEAD_ATTRS, foo=1), "foo"),
    (dict(q_num_heads=2.0, kv_num_heads=2), "q_num_heads"),
    (dict(HEAD_ATTRS, scale=1), "scale"),
    (dict(HEAD_ATTRS, chunk_size=0.5), "chunk_size"),
    (dict(q_num_heads=3, kv_num_heads=2), "q_num_heads"),
], ids=["no-q_num_heads", "no-kv_num_heads", "unknown", "heads-a-float", "scale-an-int", "chunk_size-a-float",
        "heads-not-a-multiple"])
def test_attach_functions_refuses_a_node_without_its_attributes(attrs, argument):
    """The body references q_num_heads / kv_num_heads (and each attribute by its type): a node
    without them, or with others, is refused, and the model given is not modified."""
    node = helper.make_node("LinearAttention", ["q", "k", "v", "", "decay", "beta"], ["o", "s"], domain="ai.deltarule",
                            **attrs)
    model = _one_node_model(node, opset=21)
    before = model.SerializeToString()
    with pytest.raises(ContractError) as info:
        donnx.attach_functions(model)
    assert info.value.argument == argument, info.value
    assert model.SerializeToString() == before
