"""deltarule.contracts.ort against ONNX Runtime itself.

Every peer test builds a one-node model with `onnx.helper`, runs it on
onnxruntime's CPU execution provider and compares with the adapter on the
same (seeded, random) inputs: relative error ||x - ref|| / ||ref|| under 2e-5
for float32 and 1e-2 for float16, for outputs AND states.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

import deltarule
from deltarule import ContractError
from deltarule.contracts import ort as dort
from deltarule.tools.oracles import run_onnx_node

from conftest import rel, rng_for

F32_TOL, F16_TOL = 2e-5, 1e-2
RULES = ("linear", "gated", "delta", "gated_delta")
GATED = ("gated", "gated_delta")
DELTA = ("delta", "gated_delta")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def normal(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def l2n(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(x.dtype)


def decays(rng, *shape):
    return rng.uniform(-1.0, -0.01, shape).astype(np.float32)


def betas(rng, *shape):
    return rng.uniform(0.05, 0.95, shape).astype(np.float32)


def run_ort(op, inputs, outputs, **attrs):
    """Run a one-node com.microsoft model on ORT's CPU EP (see deltarule.tools.oracles.run_onnx_node)."""
    pytest.importorskip("onnxruntime", reason="the peer runtime onnxruntime is not installed")
    pytest.importorskip("onnx", reason="onnx (to build the peer model) is not installed")
    return run_onnx_node(op, inputs, outputs, domain="com.microsoft", **attrs)


def gdn_peer(q, k, v, cu=None, decay=None, beta=None, s0=None, a_log=None, dt_bias=None, **attrs):
    inputs = [("query", q), ("key", k), ("value", v), ("cu_seqlens", cu), ("decay", decay),
              ("beta", beta), ("initial_state", s0), ("a_log", a_log), ("dt_bias", dt_bias)]
    return run_ort("GatedDeltaNet", inputs, [("output", q.dtype), ("final_state", np.float32)], **attrs)


def la_peer(q, k, v, past=None, decay=None, beta=None, **attrs):
    state_dtype = past.dtype if past is not None else q.dtype
    inputs = [("query", q), ("key", k), ("value", v), ("past_state", past), ("decay", decay), ("beta", beta)]
    return run_ort("LinearAttention", inputs, [("output", q.dtype), ("present_state", state_dtype)], **attrs)


def assert_close(got, ref, tol):
    for name, x, r in zip(("output", "state"), got, ref):
        assert isinstance(x, np.ndarray), f"{name}: NumPy in must give NumPy out, got {type(x)}"
        assert x.dtype == r.dtype, f"{name}: dtype {x.dtype}, runtime {r.dtype}"
        err = rel(x, r)
        assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


# ---------------------------------------------------------------------------
# com.microsoft.GatedDeltaNet
# ---------------------------------------------------------------------------

GDN_CU = [0, 0, 5, 5, 12, 20]                      # two empty requests


def gdn_inputs(rng, *, form, rule, Hq, ratio, K=8, V=6, state=True, dtype=np.float32,
               l2norm_keys=None):
    """Random GatedDeltaNet inputs; form: 'varlen' (rank 3 + cu_seqlens), 'rank4', 'uniform'."""
    Hv = Hq * ratio
    if form == "varlen":
        lead, N, cu = (GDN_CU[-1],), len(GDN_CU) - 1, np.array(GDN_CU, np.int32)
    elif form == "rank4":
        lead, N, cu = (2, 9), 2, None
    else:                                          # rank 3, batch from initial_state
        lead, N, cu = (18,), 3, None
    q = normal(rng, *lead, Hq, K)
    k = normal(rng, *lead, Hq, K)
    if l2norm_keys is None:
        l2norm_keys = rule in DELTA
    if l2norm_keys:
        k = l2n(k)
    v = normal(rng, *lead, Hv, V)
    return dict(
        q=q.astype(dtype), k=k.astype(dtype), v=v.astype(dtype), cu=cu,
        decay=decays(rng, *lead, Hv) if rule in GATED else None,
        beta=betas(rng, *lead, Hv) if rule in DELTA else None,
        s0=normal(rng, N, Hv, V, K) * 0.5 if state else None,
    )


def gdn_adapter(x, **attrs):
    return dort.gated_delta_net(x["q"], x["k"], x["v"], x["cu"], x["decay"], x["beta"], x["s0"],
                                x.get("a_log"), x.get("dt_bias"), **attrs)


def gdn_peer_of(x, **attrs):
    return gdn_peer(x["q"], x["k"], x["v"], x["cu"], x["decay"], x["beta"], x["s0"],
                    x.get("a_log"), x.get("dt_bias"), **attrs)


@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("form", ["varlen", "rank4"])
@pytest.mark.parametrize("ratio", [1, 2, 4], ids=lambda r: f"gva{r}x")
@pytest.mark.parametrize("rule", RULES)
def test_gated_delta_net_matches_ort(request, rule, ratio, form, state):
    x = gdn_inputs(rng_for(request), form=form, rule=rule, Hq=2, ratio=ratio, state=state)
    got = gdn_adapter(x, update_rule=rule)
    assert_close(got, gdn_peer_of(x, update_rule=rule), F32_TOL)


@pytest.mark.parametrize("scale", [0.0, 0.3, -1.5], ids=["default-scale", "scale-0.3", "scale-neg1.5"])
def test_gated_delta_net_uniform_rank3_batch_from_initial_state(request, scale):
    x = gdn_inputs(rng_for(request), form="uniform", rule="gated_delta", Hq=2, ratio=2)
    assert_close(gdn_adapter(x, scale=scale), gdn_peer_of(x, scale=scale), F32_TOL)


def test_gated_delta_net_empty_requests_copy_state_through(request):
    x = gdn_inputs(rng_for(request), form="varlen", rule="gated_delta", Hq=1, ratio=2)
    _, state = gdn_adapter(x)
    for n in (0, 2):                               # GDN_CU's two empty requests
        np.testing.assert_array_equal(state[n], x["s0"][n])


@pytest.mark.parametrize("decay_form, dt_bias_shape", [
    ("per-head", "H"), ("per-key", "H"), ("per-key", "HK"), ("per-key", "H*K"),
], ids=["per-head-decay", "per-key-decay-H-bias", "per-key-decay-HK-bias", "per-key-decay-flat-bias"])
@pytest.mark.parametrize("gate", ["qwen", "softplus", "kda"])
def test_gated_delta_net_fused_gates_match_ort(request, gate, decay_form, dt_bias_shape):
    """gate_activation + beta_activation='sigmoid' + qk_l2_norm=1, on raw (unnormalised) inputs."""
    rng = rng_for(request)
    Hq, Hv, K, V = 2, 4, 8, 6
    x = gdn_inputs(rng, form="varlen", rule="gated_delta", Hq=Hq, ratio=2, K=K, V=V, l2norm_keys=False)
    lead = x["q"].shape[:-2]
    x["decay"] = normal(rng, *lead, Hv) if decay_form == "per-head" else normal(rng, *lead, Hv, K)
    x["beta"] = normal(rng, *lead, Hv) * 2.0
    x["a_log"] = normal(rng, Hv) * 0.5
    x["dt_bias"] = normal(rng, *{"H": (Hv,), "HK": (Hv, K), "H*K": (Hv * K,)}[dt_bias_shape])
    attrs = dict(gate_activation=gate, beta_activation="sigmoid", qk_l2_norm=1)
    if gate == "kda":
        attrs["gate_lower_bound"] = -3.0
    assert_close(gdn_adapter(x, **attrs), gdn_peer_of(x, **attrs), F32_TOL)


def test_gated_delta_net_l2norm_epsilon_matches_ort(request):
    """Near-zero query / key vectors: the epsilon's place (inside the sqrt, 1e-12) shows."""
    rng = rng_for(request)
    x = gdn_inputs(rng, form="rank4", rule="gated_delta", Hq=2, ratio=1, l2norm_keys=False)
    x["q"][0, 0, 0] = 1e-7 * l2n(normal(rng, 8))    # ||q|| = 1e-7 ~ sqrt(eps)
    x["k"][0, 1, 1] = 3e-7 * l2n(normal(rng, 8))
    x["k"][1, 2, 0] = 0.0
    got = gdn_adapter(x, qk_l2_norm=1)
    assert_close(got, gdn_peer_of(x, qk_l2_norm=1), F32_TOL)
    # and with a different epsilon the result is visibly different (the test can fail)
    ref = deltarule.linear_attention(
        *(torch.from_numpy(x[n]) for n in "qkv"), g=torch.from_numpy(x["decay"]),
        beta=torch.from_numpy(x["beta"]), initial_state=torch.from_numpy(x["s0"]),
        state_layout="vk", qk_l2norm=True, l2norm_eps=1e-6)
    assert rel(ref[0].numpy(), got[0]) > 1e-3


@pytest.mark.parametrize("rule", ["delta", "gated"])
def test_gated_delta_net_unused_activations_match_ort(request, rule):
    """delta + qwen (a_log / dt_bias required yet unused); gated + sigmoid beta (no beta)."""
    rng = rng_for(request)
    x = gdn_inputs(rng, form="varlen", rule=rule, Hq=2, ratio=2)
    x["a_log"], x["dt_bias"] = normal(rng, 4), normal(rng, 4)
    if rule == "gated":
        x["decay"] = normal(rng, *x["decay"].shape)
    attrs = dict(update_rule=rule, gate_activation="qwen", beta_activation="sigmoid")
    assert_close(gdn_adapter(x, **attrs), gdn_peer_of(x, **attrs), F32_TOL)


@pytest.mark.parametrize("packed_rank", [2, 3])
def test_gated_delta_net_packed_qkv_matches_ort(request, packed_rank):
    rng = rng_for(request)
    form = "varlen" if packed_rank == 2 else "rank4"
    x = gdn_inputs(rng, form=form, rule="gated_delta", Hq=2, ratio=2)
    lead = x["q"].shape[:-2]
    packed = np.concatenate([x[n].reshape(*lead, -1) for n in "qkv"], axis=-1)
    got = dort.gated_delta_net(packed, None, None, x["cu"], x["decay"], x["beta"], x["s0"])
    ref = gdn_peer(packed, None, None, x["cu"], x["decay"], x["beta"], x["s0"])
    assert_close(got, ref, F32_TOL)
    assert got[0].shape == lead + (4, 6)


@pytest.mark.parametrize("gate_dtype", ["float32-gates", "float16-gates"])
@pytest.mark.parametrize("form", ["varlen", "rank4"])
def test_gated_delta_net_float16_matches_ort(request, form, gate_dtype):
    x = gdn_inputs(rng_for(request), form=form, rule="gated_delta", Hq=2, ratio=2, dtype=np.float16)
    if gate_dtype == "float16-gates":
        x["decay"], x["beta"] = x["decay"].astype(np.float16), x["beta"].astype(np.float16)
    got = gdn_adapter(x)
    assert got[0].dtype == np.float16 and got[1].dtype == np.float32
    assert_close(got, gdn_peer_of(x), F16_TOL)


@pytest.mark.parametrize("cu,clamped", [([0, 5, 30], [0, 5, 20]), ([-1, 20], [0, 20]),
                                        ([-3, 7, 7, 99], [0, 7, 7, 20])],
                         ids=["past-the-end", "negative", "both-ends"])
def test_gated_delta_net_cu_seqlens_are_clamped(request, cu, clamped):
    """The card's clamping: equal to ORT on the clamped offsets, which its CPU kernel requires."""
    ort = pytest.importorskip("onnxruntime", reason="the peer runtime onnxruntime is not installed")
    x = gdn_inputs(rng_for(request), form="varlen", rule="gated_delta", Hq=1, ratio=2, state=False)
    x["cu"] = np.array(cu, np.int32)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="cu_seqlens"):
        gdn_peer_of(x)                            # ORT's CPU kernel rejects what the card clamps
    got = gdn_adapter(x)
    x["cu"] = np.array(clamped, np.int32)
    assert_close(got, gdn_peer_of(x), F32_TOL)


def test_gated_delta_net_decreasing_cu_seqlens_give_empty_requests(request):
    x = gdn_inputs(rng_for(request), form="varlen", rule="gated_delta", Hq=1, ratio=1, state=False)
    x["cu"] = np.array([0, 12, 8, 20], np.int32)
    _, state = gdn_adapter(x)
    assert np.array_equal(state[1], np.zeros_like(state[1]))    # [12, 8): empty, zero state through
    _, state_first = gdn_adapter(dict(x, cu=np.array([0, 12, 20], np.int32)))
    assert rel(state[0], state_first[0]) < F32_TOL                 # request 0 is unchanged


# ---------------------------------------------------------------------------
# com.microsoft.LinearAttention
# ---------------------------------------------------------------------------

# (q_num_heads, key heads, kv_num_heads)
LA_HEADS = {
    "mha": (2, 2, 2),
    "gqa": (4, 2, 2),
    "gqa-shared-key": (8, 2, 4),
    "mha-shared-key": (4, 2, 4),
    "inverse-gqa": (2, 2, 4),
    "inverse-gqa-kv-key": (2, 4, 4),
    "inverse-gqa-key-above-q": (2, 4, 8),
    "inverse-gqa-key-below-q": (4, 2, 8),
    "inverse-gqa-single-q": (1, 2, 4),
}


def la_inputs(rng, *, rule, heads, decay_form="per-head", past=True, B=2, T=7, K=8, V=6,
              dtype=np.float32, past_dtype=np.float32, beta_form="per-head"):
    Hq, Hk, Hkv = heads
    k = normal(rng, B, T, Hk, K)
    if rule in DELTA:
        k = l2n(k)
    decay = None
    if rule in GATED:
        decay = decays(rng, B, T, Hkv) if decay_form == "per-head" else decays(rng, B, T, Hkv * K)
    beta = None
    if rule in DELTA:
        beta = betas(rng, B, T, Hkv) if beta_form == "per-head" else betas(rng, B, T, 1)
    cast = lambda a: None if a is None else a.astype(dtype)
    return dict(
        q=cast(normal(rng, B, T, Hq * K)), k=cast(k.reshape(B, T, Hk * K)), v=cast(normal(rng, B, T, Hkv * V)),
        past=(normal(rng, B, Hkv, K, V) * 0.5).astype(past_dtype) if past else None,
        decay=cast(decay), beta=cast(beta), attrs=dict(q_num_heads=Hq, kv_num_heads=Hkv, update_rule=rule),
    )


def la_run(x, adapter=dort.linear_attention):
    return adapter(x["q"], x["k"], x["v"], x["past"], x["decay"], x["beta"], **x["attrs"])


def la_peer_of(x):
    return la_peer(x["q"], x["k"], x["v"], x["past"], x["decay"], x["beta"], **x["attrs"])


@pytest.mark.parametrize("past", [False, True], ids=["no-past", "past-state"])
@pytest.mark.parametrize("heads", list(LA_HEADS))
@pytest.mark.parametrize("rule", RULES)
def test_ort_linear_attention_matches_ort(request, rule, heads, past):
    x = la_inputs(rng_for(request), rule=rule, heads=LA_HEADS[heads], past=past)
    got = la_run(x)
    assert got[0].shape == (2, 7, max(LA_HEADS[heads][0], LA_HEADS[heads][2]) * 6)
    assert_close(got, la_peer_of(x), F32_TOL)


@pytest.mark.parametrize("heads", ["mha", "gqa", "inverse-gqa"])
@pytest.mark.parametrize("rule", GATED)
def test_ort_linear_attention_per_key_decay_matches_ort(request, rule, heads):
    x = la_inputs(rng_for(request), rule=rule, heads=LA_HEADS[heads], decay_form="per-key")
    assert_close(la_run(x), la_peer_of(x), F32_TOL)


@pytest.mark.parametrize("scale", [0.0, 0.3], ids=["default-scale", "scale-0.3"])
def test_ort_linear_attention_shared_beta_matches_ort(request, scale):
    x = la_inputs(rng_for(request), rule="gated_delta", heads=LA_HEADS["gqa"], beta_form="shared")
    x["attrs"]["scale"] = scale
    assert x["beta"].shape == (2, 7, 1)
    assert_close(la_run(x), la_peer_of(x), F32_TOL)


@pytest.mark.parametrize("rule", ["linear", "gated", "delta"])
def test_ort_linear_attention_ignores_unused_gates_like_ort(request, rule):
    rng = rng_for(request)
    x = la_inputs(rng, rule=rule, heads=LA_HEADS["mha"])
    x["decay"] = decays(rng, 2, 7, 2) if x["decay"] is None else x["decay"]
    x["beta"] = betas(rng, 2, 7, 2) if x["beta"] is None else x["beta"]
    assert_close(la_run(x), la_peer_of(x), F32_TOL)


@pytest.mark.parametrize("past", ["no-past", "float32-past", "float16-past"])
def test_ort_linear_attention_float16_matches_ort(request, past):
    past_dtype = {"no-past": np.float32, "float32-past": np.float32, "float16-past": np.float16}[past]
    x = la_inputs(rng_for(request), rule="gated_delta", heads=LA_HEADS["gqa"], past=past != "no-past",
                  dtype=np.float16, past_dtype=past_dtype)
    got = la_run(x)
    # present_state has past_state's dtype, or query's (float16) without one
    assert got[1].dtype == (np.float16 if past != "float32-past" else np.float32)
    assert_close(got, la_peer_of(x), F16_TOL)


@pytest.mark.parametrize("window", [-1, 9, True, 2.0], ids=["negative", "above-8", "bool", "float"])
def test_ort_linear_attention_state_window_outside_0_to_8_is_refused(window):
    """state_window is an int in [0, 8] (the schema's range; ORT's shape inference refuses the others).
    Windows themselves: tests/test_contracts_ort_window.py."""
    q = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(ContractError) as info:
        dort.linear_attention(q, q, q, q_num_heads=1, kv_num_heads=1, update_rule="linear", state_window=window)
    assert info.value.argument == "state_window"


# ---------------------------------------------------------------------------
# com.microsoft.LinearAttentionGate
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("with_b", [False, True], ids=["decay-only", "with-b"])
@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5), (2, 1, 3, 5)], ids=lambda s: f"rank{len(s)}")
def test_linear_attention_gate_matches_ort(request, shape, with_b, dtype):
    rng = rng_for(request)
    H = shape[-1]
    a = (normal(rng, *shape) * 3.0).astype(dtype)
    b = (normal(rng, *shape) * 3.0).astype(dtype) if with_b else None
    dt_bias, decay_scale = normal(rng, H), -np.exp(normal(rng, H))
    inputs = [("a", a), ("dt_bias", dt_bias), ("decay_scale", decay_scale), ("b", b)]
    outputs = [("decay", dtype)] + ([("beta", dtype)] if with_b else [])
    ref = run_ort("LinearAttentionGate", inputs, outputs)
    decay, beta = dort.linear_attention_gate(a, dt_bias, decay_scale, b)
    tol = F32_TOL if dtype == np.float32 else F16_TOL
    for got, r in zip((decay, beta), ref):
        assert isinstance(got, np.ndarray) and got.dtype == r.dtype and got.shape == r.shape
        assert rel(got, r) < tol
    assert (beta is None) == (not with_b)


def test_gate_is_accurate_in_the_tails():
    """deltarule.gate is float32-accurate where ORT's kernel is not (see docs/contracts.md).

    onnxruntime 1.32's LinearAttentionGate computes softplus as log(1 + exp(x)),
    which flushes to 0 below x ~ -17 and loses relative precision below ~ -9; its
    sigmoid has ~1e-7 absolute error. The norm-wise comparisons above cannot see
    this; deltarule keeps float32 accuracy against float64.
    """
    x = torch.tensor([-30.0, -17.0, -12.0, -10.0, -2.0, 0.0, 3.0, 25.0])
    H = x.numel()
    decay, beta = deltarule.gate(x, torch.zeros(H), torch.ones(H), x)
    x64 = x.double().numpy()
    np.testing.assert_allclose(decay.numpy(), np.logaddexp(0.0, x64), rtol=1e-6)
    np.testing.assert_allclose(beta.numpy(), 1.0 / (1.0 + np.exp(-x64)), rtol=1e-6)


def test_linear_attention_gate_torch_in_torch_out():
    a = torch.randn(2, 3, 4, dtype=torch.float16)
    b = torch.randn(2, 3, 4, dtype=torch.float16)
    dt_bias, scale = torch.randn(4), -torch.rand(4) - 0.5
    decay, beta = dort.linear_attention_gate(a, dt_bias, scale, b)
    assert isinstance(decay, torch.Tensor) and decay.dtype == torch.float16 and beta.dtype == torch.float16
    ref = (scale * torch.nn.functional.softplus(a.float() + dt_bias)).half()
    torch.testing.assert_close(decay, ref, rtol=0, atol=0)
    d2, b2 = deltarule.gate(a, dt_bias, scale, b)
    assert torch.equal(d2, decay) and torch.equal(b2, beta)
    assert dort.linear_attention_gate(a, dt_bias, scale)[1] is None


@pytest.mark.parametrize("case", ["rank0", "no-heads", "dt_bias-length", "dt_bias-float16",
                                  "b-shape", "b-dtype", "a-float64"])
def test_gate_contract_errors(case):
    a, H = torch.randn(3, 4), 4
    args = dict(a=a, dt_bias=torch.zeros(H), decay_scale=-torch.ones(H), b=None)
    bad, name = {
        "rank0": (dict(a=torch.tensor(1.0)), "a"),
        "no-heads": (dict(a=torch.zeros(3, 0)), "a"),
        "dt_bias-length": (dict(dt_bias=torch.zeros(H + 1)), "dt_bias"),
        "dt_bias-float16": (dict(dt_bias=torch.zeros(H, dtype=torch.float16)), "dt_bias"),
        "b-shape": (dict(b=torch.zeros(3, 5)), "b"),
        "b-dtype": (dict(b=torch.zeros(3, 4, dtype=torch.float16)), "b"),
        "a-float64": (dict(a=torch.zeros(3, 4, dtype=torch.float64)), "a"),
    }[case]
    args.update(bad)
    with pytest.raises(ContractError) as info:
        deltarule.gate(**args)
    assert info.value.argument == name


# ---------------------------------------------------------------------------
# NumPy / torch in and out, contract errors (no runtime needed)
# ---------------------------------------------------------------------------

def test_gated_delta_net_torch_in_torch_out_equals_numpy_path():
    rng = np.random.default_rng(7)
    x = gdn_inputs(rng, form="varlen", rule="gated_delta", Hq=2, ratio=2)
    o_np, s_np = gdn_adapter(x)
    xt = {n: (torch.from_numpy(a) if isinstance(a, np.ndarray) else a) for n, a in x.items()}
    o_t, s_t = gdn_adapter(xt)
    assert isinstance(o_t, torch.Tensor) and isinstance(s_t, torch.Tensor)
    assert isinstance(o_np, np.ndarray) and isinstance(s_np, np.ndarray)
    assert s_t.dtype == torch.float32 and tuple(s_t.shape) == (5, 4, 6, 8)
    np.testing.assert_array_equal(o_t.numpy(), o_np)
    np.testing.assert_array_equal(s_t.numpy(), s_np)


def test_gated_delta_net_maps_onto_linear_attention():
    """The adapter is linear_attention with state_layout='vk' (GVA), l2norm eps 1e-12."""
    g = torch.Generator().manual_seed(3)
    T, Hq, Hv, K, V = 9, 2, 4, 8, 6
    q, k = torch.randn(T, Hq, K, generator=g), torch.randn(T, Hq, K, generator=g)
    v = torch.randn(T, Hv, V, generator=g)
    raw, braw = torch.randn(T, Hv, generator=g), torch.randn(T, Hv, generator=g)
    a_log, dt_bias = torch.randn(Hv, generator=g), torch.randn(Hv, generator=g)
    s0 = torch.randn(2, Hv, V, K, generator=g)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    o, s = dort.gated_delta_net(q, k, v, cu, raw, braw, s0, a_log, dt_bias, gate_activation="qwen",
                                beta_activation="sigmoid", qk_l2_norm=1, scale=0.3)
    ro, rs = deltarule.linear_attention(
        q[None], k[None], v[None], g=raw[None], beta=braw[None], A_log=a_log, dt_bias=dt_bias,
        beta_sigmoid=True, qk_l2norm=True, l2norm_eps=1e-12, scale=0.3, initial_state=s0,
        state_layout="vk", cu_seqlens=cu)
    torch.testing.assert_close(o, ro[0], rtol=0, atol=0)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)


def _gdn_ok():
    T, H, K = 6, 2, 4
    return dict(query=np.zeros((T, H, K), np.float32), key=np.zeros((T, H, K), np.float32),
                value=np.zeros((T, H, K), np.float32), cu_seqlens=np.array([0, T], np.int32),
                decay=np.zeros((T, H), np.float32), beta=np.zeros((T, H), np.float32))


@pytest.mark.parametrize("case, change, name", [
    ("state-update-capacity-9", dict(state_update_capacity=9), "state_update_capacity"),
    ("state-update-capacity-negative", dict(state_update_capacity=-1), "state_update_capacity"),
    ("capacity-without-capture_count", dict(state_update_capacity=2), "capture_count"),
    ("capture_count-without-capacity", dict(capture_count=np.zeros(1, np.int32)), "capture_count"),
    ("capture_count-int64", dict(state_update_capacity=2, capture_count=np.zeros(1, np.int64)), "capture_count"),
    ("capture_count-per-token", dict(state_update_capacity=2, capture_count=np.zeros(6, np.int32)),
     "capture_count"),
    ("state_update_active-rank-0", dict(state_update_capacity=2, capture_count=np.zeros(1, np.int32),
                                        state_update_active=np.array(1, np.int32)), "state_update_active"),
    ("state_update_active-two", dict(state_update_active=np.ones(2, np.int32)), "state_update_active"),
    ("state_update_active-int64", dict(state_update_active=np.ones(1, np.int64)), "state_update_active"),
    ("query-rank-2", dict(query=np.zeros((6, 8), np.float32)), "query"),
    ("key-heads", dict(key=np.zeros((6, 1, 4), np.float32)), "key"),
    ("value-heads-not-multiple", dict(value=np.zeros((6, 3, 4), np.float32)), "value"),
    ("missing-decay", dict(decay=None), "decay"),
    ("missing-beta", dict(beta=None), "beta"),
    ("decay-for-delta", dict(update_rule="delta"), "decay"),
    ("a_log-without-gate", dict(a_log=np.zeros(2, np.float32), dt_bias=np.zeros(2, np.float32)), "a_log"),
    ("qwen-without-a_log", dict(gate_activation="qwen"), "a_log"),
    ("cu_seqlens-int64", dict(cu_seqlens=np.array([0, 6], np.int64)), "cu_seqlens"),
    ("rank3-no-cu-no-state", dict(cu_seqlens=None), "initial_state"),
    ("state-k-major", dict(initial_state=np.zeros((1, 2, 4, 5), np.float32)), "initial_state"),
    ("state-float16", dict(initial_state=np.zeros((1, 2, 4, 4), np.float16)), "initial_state"),
    ("bad-update-rule", dict(update_rule="rwkv"), "update_rule"),
    ("bad-gate-activation", dict(gate_activation="silu"), "gate_activation"),
    ("lower-bound-positive", dict(gate_lower_bound=1.0), "gate_lower_bound"),
    ("lower-bound-inf-in-float32", dict(gate_lower_bound=-1e39), "gate_lower_bound"),
    ("scale-inf-in-float32", dict(scale=1e39), "scale"),
    ("chunk-size-0", dict(chunk_size=0), "chunk_size"),
    ("float64-query", dict(query=np.zeros((6, 2, 4)), key=np.zeros((6, 2, 4))), "query"),
    ("no-tokens", dict(query=np.zeros((0, 2, 4), np.float32), key=np.zeros((0, 2, 4), np.float32),
                       value=np.zeros((0, 2, 4), np.float32), decay=np.zeros((0, 2), np.float32),
                       beta=np.zeros((0, 2), np.float32), cu_seqlens=np.array([0, 0], np.int32)), "query"),
])
def test_gated_delta_net_contract_errors(case, change, name):
    args = _gdn_ok()
    args.update(change)
    with pytest.raises(ContractError) as info:
        dort.gated_delta_net(**args)
    assert info.value.argument == name


@pytest.mark.parametrize("case, change, name", [
    ("q-heads-not-multiple", dict(q_num_heads=3, kv_num_heads=2), "kv_num_heads"),
    ("key-heads-not-dividing", dict(key=np.zeros((1, 3, 12), np.float32)), "key"),
    ("missing-decay", dict(decay=None), "decay"),
    ("decay-width", dict(decay=np.zeros((1, 3, 3), np.float32)), "decay"),
    ("beta-width", dict(beta=np.zeros((1, 3, 3), np.float32)), "beta"),
    ("decay-float16", dict(decay=np.zeros((1, 3, 2), np.float16)), "decay"),
    ("rank-4-query", dict(query=np.zeros((1, 3, 2, 4), np.float32)), "query"),
    ("past-shape", dict(past_state=np.zeros((1, 2, 4, 5), np.float32)), "past_state"),
])
def test_ort_linear_attention_contract_errors(case, change, name):
    args = dict(query=np.zeros((1, 3, 8), np.float32), key=np.zeros((1, 3, 8), np.float32),
                value=np.zeros((1, 3, 8), np.float32), decay=np.zeros((1, 3, 2), np.float32),
                beta=np.zeros((1, 3, 2), np.float32), q_num_heads=2, kv_num_heads=2)
    args.update(change)
    with pytest.raises(ContractError) as info:
        dort.linear_attention(**args)
    assert info.value.argument == name
