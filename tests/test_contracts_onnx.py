"""deltarule.contracts.onnx_linear_attention against ONNX's own reference implementation.

Each peer test builds a one-node `LinearAttention` model (domain "", opset 27)
with `onnx.helper` and runs it with `onnx.reference.ReferenceEvaluator`, then
compares with the adapter on the same seeded random inputs: relative error
||x - ref|| / ||ref|| under 2e-5 for float32 and 1e-2 for float16 / bfloat16,
for the output AND the present state.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

import deltarule
from deltarule import ContractError
from deltarule.contracts import onnx_linear_attention as donnx
from deltarule.tools.oracles import run_onnx_node

from conftest import rel, rng_for

F32_TOL, F16_TOL = 2e-5, 1e-2
RULES = ("linear", "gated", "delta", "gated_delta")
GATED = ("gated", "gated_delta")
DELTA = ("delta", "gated_delta")
HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (4, 1)}   # (q_num_heads, kv_num_heads)


def reference(q, k, v, past=None, decay=None, beta=None, **attrs):
    """Run ONNX's reference implementation of LinearAttention-27 on one node."""
    pytest.importorskip("onnx", reason="onnx (the reference implementation) is not installed")
    inputs = [("query", q), ("key", k), ("value", v), ("past_state", past), ("decay", decay), ("beta", beta)]
    state_dtype = (past if past is not None else q).dtype
    return run_onnx_node("LinearAttention", inputs, [("output", q.dtype), ("present_state", state_dtype)],
                         runtime="reference", **attrs)


def make_inputs(rng, *, rule, heads, decay_form="per-head", past=True, beta_form="per-head",
                B=2, T=9, K=8, V=6, dtype=np.float32, past_dtype=np.float32):
    Hq, Hkv = heads
    k = rng.standard_normal((B, T, Hkv, K))
    if rule in DELTA:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    cast = lambda a: None if a is None else np.asarray(a, np.float32).astype(dtype)
    decay = beta = None
    if rule in GATED:
        width = Hkv if decay_form == "per-head" else Hkv * K
        decay = rng.uniform(-1.0, -0.01, (B, T, width))
    if rule in DELTA:
        beta = rng.uniform(0.05, 0.95, (B, T, Hkv if beta_form == "per-head" else 1))
    return dict(
        q=cast(rng.standard_normal((B, T, Hq * K))), k=cast(k.reshape(B, T, Hkv * K)),
        v=cast(rng.standard_normal((B, T, Hkv * V))),
        past=(0.5 * rng.standard_normal((B, Hkv, K, V))).astype(np.float32).astype(past_dtype) if past else None,
        decay=cast(decay), beta=cast(beta), attrs=dict(q_num_heads=Hq, kv_num_heads=Hkv, update_rule=rule),
    )


def adapter_of(x, **extra):
    return donnx.linear_attention(x["q"], x["k"], x["v"], x["past"], x["decay"], x["beta"],
                                  **x["attrs"], **extra)


def reference_of(x, **extra):
    return reference(x["q"], x["k"], x["v"], x["past"], x["decay"], x["beta"], **x["attrs"], **extra)


def assert_close(got, ref, tol):
    for name, x, r in zip(("output", "present_state"), got, ref):
        assert isinstance(x, np.ndarray), f"{name}: NumPy in must give NumPy out, got {type(x)}"
        assert x.dtype == r.dtype, f"{name}: dtype {x.dtype}, reference {r.dtype}"
        err = rel(x, r)
        assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


CASES = [
    pytest.param(rule, decay, heads, past, id=f"{rule}-{decay}-{heads}-{'past' if past else 'no-past'}")
    for rule in RULES
    for decay in (("per-head", "per-key") if rule in GATED else ("no-decay",))
    for heads in HEADS
    for past in (False, True)
]


@pytest.mark.parametrize("rule, decay, heads, past", CASES)
def test_matches_onnx_reference(request, rule, decay, heads, past):
    x = make_inputs(rng_for(request), rule=rule, heads=HEADS[heads], decay_form=decay, past=past)
    got = adapter_of(x)
    assert got[0].shape == (2, 9, HEADS[heads][0] * 6) and got[1].shape == (2, HEADS[heads][1], 8, 6)
    assert_close(got, reference_of(x), F32_TOL)


@pytest.mark.parametrize("scale", [0.25, -2.0], ids=["scale-0.25", "scale-neg2"])
def test_explicit_scale_matches_onnx_reference(request, scale):
    x = make_inputs(rng_for(request), rule="gated_delta", heads=HEADS["gqa"])
    assert_close(adapter_of(x, scale=scale), reference_of(x, scale=scale), F32_TOL)


def test_shared_beta_matches_onnx_reference(request):
    x = make_inputs(rng_for(request), rule="delta", heads=HEADS["mqa"], beta_form="shared")
    assert x["beta"].shape == (2, 9, 1)
    assert_close(adapter_of(x), reference_of(x), F32_TOL)


@pytest.mark.parametrize("past", ["no-past", "float16-past", "float32-past"])
@pytest.mark.parametrize("rule", RULES)
def test_float16_matches_onnx_reference(request, rule, past):
    past_dtype = np.float32 if past == "float32-past" else np.float16
    x = make_inputs(rng_for(request), rule=rule, heads=HEADS["gqa"], past=past != "no-past",
                    dtype=np.float16, past_dtype=past_dtype)
    got = adapter_of(x)
    # present_state is type S: past_state's dtype, or query's when past_state is absent
    assert got[0].dtype == np.float16 and got[1].dtype == past_dtype
    assert_close(got, reference_of(x), F16_TOL)


@pytest.mark.parametrize("decay", ["per-head", "per-key"])
def test_bfloat16_matches_onnx_reference(request, decay):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="NumPy bfloat16 needs ml_dtypes")
    x = make_inputs(rng_for(request), rule="gated_delta", heads=HEADS["gqa"], decay_form=decay,
                    dtype=ml_dtypes.bfloat16, past_dtype=np.float32)
    got = adapter_of(x)
    assert got[0].dtype == ml_dtypes.bfloat16 and got[1].dtype == np.float32
    assert_close(got, reference_of(x), F16_TOL)


def test_float32_state_with_float16_activations_matches_onnx_reference(request):
    """S != T: float16 activations, float32 state in and out."""
    x = make_inputs(rng_for(request), rule="gated_delta", heads=HEADS["mha"], dtype=np.float16,
                    past_dtype=np.float32)
    got = adapter_of(x)
    assert got[1].dtype == np.float32
    assert_close(got, reference_of(x), F16_TOL)


def test_no_tokens_passes_the_state_through(request):
    x = make_inputs(rng_for(request), rule="gated_delta", heads=HEADS["gqa"], T=0)
    got, ref = adapter_of(x), reference_of(x)
    assert got[0].shape == ref[0].shape == (2, 0, 4 * 6)
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_array_equal(got[1], x["past"])


@pytest.mark.parametrize("chunk_size", [0, 1, 3, 1000])
def test_chunk_size_is_only_a_hint(request, chunk_size):
    x = make_inputs(rng_for(request), rule="gated_delta", heads=HEADS["mha"], decay_form="per-key")
    assert_close(adapter_of(x, chunk_size=chunk_size), reference_of(x), F32_TOL)


# ---------------------------------------------------------------------------
# where the reference rejects a call, the adapter raises ContractError (a ValueError)
# ---------------------------------------------------------------------------

def _bad(rng, case):
    x = make_inputs(rng, rule="gated_delta", heads=HEADS["gqa"])
    B, T = 2, 9
    if case == "decay-for-delta":
        x["attrs"]["update_rule"] = "delta"
        return x, "decay"
    if case == "beta-for-gated":
        x["attrs"]["update_rule"] = "gated"
        return x, "beta"
    if case == "missing-decay":
        x["decay"] = None
        return x, "decay"
    if case == "missing-beta":
        x["beta"] = None
        return x, "beta"
    if case == "q-heads-not-multiple":
        x["attrs"].update(q_num_heads=3, kv_num_heads=2)
        return x, "q_num_heads"
    if case == "inverse-gqa":
        x["attrs"].update(q_num_heads=2, kv_num_heads=4)
        return x, "q_num_heads"
    if case == "decay-width":
        x["decay"] = x["decay"][..., :1].copy()
        return x, "decay"
    if case == "beta-width":
        x["beta"] = np.concatenate([x["beta"], x["beta"][..., :1]], axis=-1)
        return x, "beta"
    if case == "rank-4-query":
        x["q"] = x["q"].reshape(B, T, 4, 8)
        return x, "query"
    if case == "bad-update-rule":
        x["attrs"]["update_rule"] = "mamba"
        return x, "update_rule"
    if case == "past-shape":
        x["past"] = x["past"][:, :1].copy()
        return x, "past_state"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["decay-for-delta", "beta-for-gated", "missing-decay", "missing-beta",
                                  "q-heads-not-multiple", "inverse-gqa", "decay-width", "beta-width",
                                  "rank-4-query", "bad-update-rule", "past-shape"])
def test_rejected_like_onnx_reference(request, case):
    x, name = _bad(rng_for(request), case)
    with pytest.raises(Exception):
        reference_of(x)
    with pytest.raises(ContractError) as info:
        adapter_of(x)
    assert info.value.argument == name
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("case, change, name", [
    ("key-heads", dict(key=np.zeros((1, 3, 4), np.float32)), "key"),
    ("value-width", dict(value=np.zeros((1, 3, 7), np.float32)), "value"),
    ("decay-float16", dict(decay=np.zeros((1, 3, 2), np.float16)), "decay"),
    ("float64-query", dict(query=np.zeros((1, 3, 8))), "query"),
    ("q_num_heads-zero", dict(q_num_heads=0), "q_num_heads"),
    ("q_num_heads-float", dict(q_num_heads=2.0), "q_num_heads"),
    ("scale-nan", dict(scale=float("nan")), "scale"),
    ("scale-inf-in-float32", dict(scale=-1e39), "scale"),
    ("query-list", dict(query=[[[0.0] * 8] * 3]), "query"),
])
def test_contract_errors(case, change, name):
    args = dict(query=np.zeros((1, 3, 8), np.float32), key=np.zeros((1, 3, 8), np.float32),
                value=np.zeros((1, 3, 8), np.float32), decay=np.zeros((1, 3, 2), np.float32),
                beta=np.zeros((1, 3, 2), np.float32), q_num_heads=2, kv_num_heads=2)
    args.update(change)
    with pytest.raises(ContractError) as info:
        donnx.linear_attention(**args)
    assert info.value.argument == name


# ---------------------------------------------------------------------------
# NumPy / torch in and out (no runtime needed)
# ---------------------------------------------------------------------------

def test_torch_in_torch_out_equals_numpy_path():
    x = make_inputs(np.random.default_rng(11), rule="gated_delta", heads=HEADS["gqa"], decay_form="per-key")
    o_np, s_np = adapter_of(x)
    xt = dict(x, **{n: torch.from_numpy(x[n]) for n in ("q", "k", "v", "past", "decay", "beta")})
    o_t, s_t = adapter_of(xt)
    assert isinstance(o_t, torch.Tensor) and isinstance(s_t, torch.Tensor)
    np.testing.assert_array_equal(o_t.numpy(), o_np)
    np.testing.assert_array_equal(s_t.numpy(), s_np)


def test_torch_bfloat16_in_bfloat16_out():
    x = make_inputs(np.random.default_rng(12), rule="gated_delta", heads=HEADS["mha"], past=False)
    t = {n: torch.from_numpy(x[n]).to(torch.bfloat16) for n in ("q", "k", "v", "decay", "beta")}
    o, s = donnx.linear_attention(t["q"], t["k"], t["v"], None, t["decay"], t["beta"], q_num_heads=2,
                                  kv_num_heads=2)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.bfloat16   # S = T without past_state
    o32, s32 = donnx.linear_attention(*(t[n].float() for n in ("q", "k", "v")), None,
                                      t["decay"].float(), t["beta"].float(), q_num_heads=2, kv_num_heads=2)
    assert rel(o.float().numpy(), o32.numpy()) < F16_TOL and rel(s.float().numpy(), s32.numpy()) < F16_TOL


def test_maps_onto_linear_attention_in_gqa_form():
    """The adapter is linear_attention on [B, T, H, D] views (GQA: Hq multiple of Hk == Hv)."""
    x = make_inputs(np.random.default_rng(13), rule="gated_delta", heads=HEADS["gqa"], beta_form="shared")
    o, s = adapter_of(x)
    t = {n: torch.from_numpy(x[n]) for n in ("q", "k", "v", "past", "decay", "beta")}
    ro, rs = deltarule.linear_attention(
        t["q"].view(2, 9, 4, 8), t["k"].view(2, 9, 2, 8), t["v"].view(2, 9, 2, 6),
        g=t["decay"], beta=t["beta"].expand(2, 9, 2).contiguous(), initial_state=t["past"])
    np.testing.assert_array_equal(o, ro.reshape(2, 9, 24).numpy())
    np.testing.assert_array_equal(s, rs.numpy())


def test_numpy_inputs_are_not_modified_or_aliased():
    x = make_inputs(np.random.default_rng(14), rule="gated_delta", heads=HEADS["mha"], T=0)
    before = {n: x[n].copy() for n in ("q", "k", "v", "past", "decay", "beta")}
    _, state = adapter_of(x)
    state[...] = 123.0
    for n, a in before.items():
        np.testing.assert_array_equal(x[n], a)
