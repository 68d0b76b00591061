"""com.microsoft.GatedDeltaNet's compact state-update capture (deltarule.contracts.ort) against
ONNX Runtime 1.32's CPU kernel and the float64 reference, and a property test of the whole
adapter against that kernel.

What ORT's CPU kernel's `state_update` holds, found from its output (the parametrized tests
below pin each finding; docs/contracts.md records them):

- struct of arrays per request: the C decay entries, then the C keys, then the C deltas;
- decay: the factor exp(g) of the token (g after the gate activation), [H_v] or per key
  [H_v, d_k]; 1.0 for the rules without decay;
- key: the key as the recurrence uses it, after qk_l2_norm, at the H_q (= H_k) key heads;
- delta: u = beta * (v - exp(g) S^T k) for the delta rules (beta after its activation), v
  for "linear" / "gated";
- entries past min(capture_count, C, length) are zeros (the schema leaves them unspecified;
  the adapter zeroes them), and so is everything with state_update_active = 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

import deltarule
from deltarule import ContractError
from deltarule.tools.check import expected_with_capture
from deltarule.contracts import ort as dort

from conftest import rel, rng_for
from test_contracts_ort import F16_TOL, F32_TOL, l2n, normal, run_ort
from test_properties import examples

INPUTS = ("query", "key", "value", "cu_seqlens", "decay", "beta", "initial_state", "a_log", "dt_bias",
          "capture_count", "state_update_active")
GATED, DELTA = ("gated", "gated_delta"), ("delta", "gated_delta")


def peer(x: dict, attrs: dict, *, state_update: bool = True):
    """ORT's CPU kernel on the inputs `x` (names of INPUTS; missing = absent)."""
    dtype = x["query"].dtype
    outputs = [("output", dtype), ("final_state", np.float32)] + ([("state_update", np.float32)] if state_update
                                                                   else [])
    return run_ort("GatedDeltaNet", [(n, x.get(n)) for n in INPUTS], outputs, **attrs)


def adapter(x: dict, attrs: dict):
    return dort.gated_delta_net(*(x.get(n) for n in INPUTS), **attrs)


def parts(su: np.ndarray, C: int, widths: tuple) -> list[np.ndarray]:
    """The struct-of-arrays views of a state_update [N, C * sum(widths)]: [N, C, width] each."""
    out, at = [], 0
    for w in widths:
        out.append(su[:, at: at + C * w].reshape(su.shape[0], C, w))
        at += C * w
    return out


def assert_capture(got: np.ndarray, ref: np.ndarray, counts: list[int], C: int, widths: tuple, tol: float):
    """The captured prefix of each request (count entries) within `tol` of ORT's, part by part;
    every entry past it exactly zero (the adapter's promise)."""
    assert got.shape == ref.shape and got.dtype == np.float32
    for name, g, r in zip(("decay", "key", "delta"), parts(got, C, widths), parts(ref, C, widths)):
        kept_g = np.concatenate([g[n, :c].ravel() for n, c in enumerate(counts)])
        kept_r = np.concatenate([r[n, :c].ravel() for n, c in enumerate(counts)])
        if np.linalg.norm(kept_r) > 0:
            assert rel(kept_g, kept_r) < tol, f"{name}: relative error {rel(kept_g, kept_r):.3g}"
        else:
            np.testing.assert_array_equal(kept_g, kept_r)
        for n, c in enumerate(counts):
            assert not g[n, c:].any(), f"{name}: request {n} has entries past its count {c}"


def capture_case(rng, *, rule="gated_delta", per_key=False, gate="none", Hq=2, ratio=2, K=4, V=3,
                 cu=(0, 0, 4, 9), counts=(2, 1, 7), C=3, l2norm=True, active=None):
    """Rank-3 varlen inputs with a capture; decay in log space ("none") or raw (the gates)."""
    T, Hv, N = cu[-1], Hq * ratio, len(cu) - 1
    x = dict(query=normal(rng, T, Hq, K), key=normal(rng, T, Hq, K), value=normal(rng, T, Hv, V),
             cu_seqlens=np.array(cu, np.int32), initial_state=normal(rng, N, Hv, V, K) * 0.5,
             capture_count=np.array(counts, np.int32))
    if not l2norm:
        x["key"] = l2n(x["key"])
    if rule in GATED:
        shape = (T, Hv, K) if per_key else (T, Hv)
        x["decay"] = normal(rng, *shape) if gate != "none" else rng.uniform(-1, -0.01, shape).astype(np.float32)
    if rule in DELTA:
        x["beta"] = normal(rng, T, Hv)
    if gate != "none":
        x["a_log"], x["dt_bias"] = normal(rng, Hv) * 0.5, normal(rng, Hv)
    if active is not None:
        x["state_update_active"] = np.array([active], np.int32)
    attrs = dict(update_rule=rule, gate_activation=gate, beta_activation="sigmoid", qk_l2_norm=int(l2norm),
                 state_update_capacity=C)
    widths = (Hv * K if per_key else Hv, Hq * K, Hv * V)
    return x, attrs, widths


def clamped(counts, cu, C):
    return [max(0, min(c, C, cu[n + 1] - cu[n])) for n, c in enumerate(counts)]


# ---------------------------------------------------------------------------
# the capture against ORT's CPU kernel, feature by feature
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("gate", ["none", "softplus", "qwen", "sigmoid", "kda"])
@pytest.mark.parametrize("per_key", [False, True], ids=["scalar-decay", "per-key-decay"])
@pytest.mark.parametrize("rule", ["gated_delta", "gated"])
def test_capture_matches_ort_for_every_gate(request, rule, per_key, gate):
    """Counts below (1), at (2 of a 4-token request... clamped) and above C (7), an empty
    request first; GVA 2x; scalar and per-key decay; every gate activation."""
    x, attrs, widths = capture_case(rng_for(request), rule=rule, per_key=per_key, gate=gate)
    got, ref = adapter(x, attrs), peer(x, attrs)
    for name, g, r in zip(("output", "final_state"), got, ref):
        assert rel(g, r) < F32_TOL, name
    assert_capture(got[2], ref[2], clamped([2, 1, 7], [0, 0, 4, 9], 3), 3, widths, F32_TOL)


@pytest.mark.parametrize("rule", ["linear", "delta"])
def test_capture_matches_ort_for_rules_without_decay(request, rule):
    """No decay: every captured decay factor is exactly 1.0; "linear": the delta is v itself."""
    x, attrs, widths = capture_case(rng_for(request), rule=rule)
    got, ref = adapter(x, attrs), peer(x, attrs)
    counts = clamped([2, 1, 7], [0, 0, 4, 9], 3)
    assert_capture(got[2], ref[2], counts, 3, widths, F32_TOL)
    decay, _, delta = parts(got[2], 3, widths)
    for n, c in enumerate(counts):
        np.testing.assert_array_equal(decay[n, :c], 1.0)
    if rule == "linear":                           # request 2 spans tokens 4..8: u = v
        np.testing.assert_array_equal(delta[2, :3], x["value"][4:7].reshape(3, -1))


def test_capture_factors_are_exp_decay_normalised_key_and_delta(request):
    """What each factor is, from ORT's own output: exp(g) (not g), the key after qk_l2_norm (not
    the raw key), and u = beta * (v - exp(g) S^T k) with S the state before the token."""
    x, attrs, widths = capture_case(rng_for(request), rule="gated_delta", counts=(0, 3, 3), ratio=1, l2norm=True)
    attrs["beta_activation"] = "none"
    x["beta"] = np.abs(x["beta"]) % 1
    ref = peer(x, attrs)[2]
    decay, key, delta = parts(ref, 3, widths)
    t = 0                                          # request 1's first token (cu = 0, 0, 4, 9)
    k = x["key"][t].astype(np.float64)
    k /= np.sqrt((k * k).sum(-1, keepdims=True) + 1e-12)
    np.testing.assert_allclose(decay[1, 0], np.exp(x["decay"][t]), rtol=1e-6)
    np.testing.assert_allclose(key[1, 0].reshape(k.shape), k, rtol=1e-5, atol=1e-7)
    S = x["initial_state"][1].astype(np.float64)                       # [Hv, V, K], V-major
    g = np.exp(x["decay"][t].astype(np.float64))[:, None]
    u = x["beta"][t][:, None] * (x["value"][t] - g * np.einsum("hvk,hk->hv", S, k))
    np.testing.assert_allclose(delta[1, 0].reshape(u.shape), u, rtol=1e-5, atol=1e-6)
    assert np.abs(decay[1, 0] - x["decay"][t]).max() > 1e-2            # the log decay would be wrong


@pytest.mark.parametrize("active", [0, 1, 7, None], ids=["active-0", "active-1", "active-7", "active-absent"])
def test_state_update_active_matches_ort(request, active):
    """0 disables the capture (all zeros, counts ignored, outputs unchanged); other values and
    absence capture."""
    x, attrs, widths = capture_case(rng_for(request), active=active)
    got, ref = adapter(x, attrs), peer(x, attrs)
    for name, g, r in zip(("output", "final_state"), got, ref):
        assert rel(g, r) < F32_TOL, name
    counts = [0, 0, 0] if active == 0 else clamped([2, 1, 7], [0, 0, 4, 9], 3)
    assert_capture(got[2], ref[2], counts, 3, widths, F32_TOL)
    if active == 0:
        assert not got[2].any() and not ref[2].any()


@pytest.mark.parametrize("counts", [(-5, 0, 0), (0, 9, 9), (3, 3, 3), (0, 4, 5)],
                         ids=["negative", "above-C-and-length", "at-C", "at-length"])
@pytest.mark.parametrize("C", [1, 3, 8])
def test_capture_counts_are_clamped_like_ort(request, counts, C):
    x, attrs, widths = capture_case(rng_for(request), counts=counts, C=C)
    got, ref = adapter(x, attrs), peer(x, attrs)
    assert got[2].shape == (3, C * sum(widths))
    assert_capture(got[2], ref[2], clamped(counts, [0, 0, 4, 9], C), C, widths, F32_TOL)


def test_capture_against_the_float64_reference_and_replay(request):
    """The adapter's mapping with a capture, through deltarule's float64 oracle: the captured
    prefix within float32 of it, and replaying it onto the initial state gives the state after
    `count` tokens (the speculative-decoding use: roll back to an accepted prefix)."""
    x, attrs, widths = capture_case(rng_for(request), rule="gated_delta", per_key=True, gate="qwen",
                                     counts=(1, 2, 2))
    kind, args, _ = dort.gated_delta_net_arguments(*(x.get(n) for n in INPUTS), **attrs, scale=0.0, chunk_size=64,
                                                   gate_lower_bound=-5.0)
    args.pop("accept_growth")
    _, _, ref = expected_with_capture(args)
    got = adapter(x, attrs)[2]
    assert_capture(got, ref, [0, 2, 2], 3, widths, F32_TOL)         # the oracle writes min(C, length)
    state = torch.from_numpy(x["initial_state"]).clone()
    # the clamped counts: zero-filled entries are not identity transitions (their decay is 0)
    deltarule.replay(state, torch.from_numpy(got), torch.tensor([0, 2, 2]), key_heads=2, per_key_decay=True,
                     state_layout="vk")
    prefix = dict(x, cu_seqlens=np.array([0, 0, 2, 6], np.int32))                # tokens 0, 1 and 4, 5
    keep = np.r_[0:2, 4:6]
    for n in ("query", "key", "value", "decay", "beta"):
        prefix[n] = x[n][keep]
    prefix.pop("capture_count")
    after = adapter(prefix, dict(attrs, state_update_capacity=0))[1]
    assert rel(state.numpy()[1:], after[1:]) < F32_TOL
    np.testing.assert_array_equal(state.numpy()[0], x["initial_state"][0])     # empty request


def test_capture_torch_in_torch_out_and_initial_state_untouched(request):
    x, attrs, _ = capture_case(rng_for(request))
    xt = {n: torch.from_numpy(a.copy()) for n, a in x.items()}
    before = xt["initial_state"].clone()
    o, s, su = adapter(xt, attrs)
    assert all(isinstance(t, torch.Tensor) for t in (o, s, su)) and su.dtype == torch.float32
    assert torch.equal(xt["initial_state"], before)                        # ORT lets it alias final_state:
    assert s.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()   # the result is new
    np.testing.assert_array_equal(su.numpy(), adapter(x, attrs)[2])


def test_capacity_zero_returns_two_outputs_and_ort_an_empty_state_update(request):
    x, attrs, _ = capture_case(rng_for(request))
    x.pop("capture_count")
    attrs["state_update_capacity"] = 0
    got, ref = adapter(x, attrs), peer(x, attrs)
    assert len(got) == 2 and ref[2].shape == (3, 0)


@pytest.mark.parametrize("case, change, name", [
    ("count-without-capacity", dict(state_update_capacity=0), "capture_count"),
    ("capacity-9", dict(state_update_capacity=9), "state_update_capacity"),
    ("capacity-a-float", dict(state_update_capacity=2.0), "state_update_capacity"),
])
def test_capture_attribute_errors(request, case, change, name):
    x, attrs, _ = capture_case(rng_for(request))
    with pytest.raises(ContractError) as info:
        adapter(x, dict(attrs, **change))
    assert info.value.argument == name


def test_capture_count_required_even_when_inactive(request):
    """ORT requires capture_count whenever C > 0, state_update_active = 0 included."""
    x, attrs, _ = capture_case(rng_for(request), active=0)
    x.pop("capture_count")
    with pytest.raises(ContractError) as info:
        adapter(x, attrs)
    assert info.value.argument == "capture_count"
    ort = pytest.importorskip("onnxruntime")
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="capture_count"):
        peer(x, attrs)


# ---------------------------------------------------------------------------
# property test: random valid calls against ORT's CPU kernel
# ---------------------------------------------------------------------------

@st.composite
def gdn_calls(draw):
    """(inputs, attributes, decay width) of a random valid GatedDeltaNet call ORT's CPU kernel
    runs: every form (varlen with empty requests, uniform rank 3, rank 4, packed QKV), rule,
    decay form, gate and beta activation, GVA ratio, capacity and count, active flag, dtype."""
    rule = draw(st.sampled_from(["gated_delta", "gated", "delta", "linear"]))
    form = draw(st.sampled_from(["varlen", "rank4", "uniform"]))
    packed = draw(st.booleans())
    Hq, ratio = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    K, V = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    Hv = Hq * ratio
    if form == "varlen":
        lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
        lengths[-1] += sum(lengths) == 0                                   # at least one token
        N, lead = len(lengths), (sum(lengths),)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    else:
        N, S = draw(st.integers(1, 3)), draw(st.integers(1, 5))
        lengths, cu = [S] * N, None
        lead = (N * S,) if form == "uniform" else (N, S)
    per_key = rule in GATED and draw(st.booleans())
    gate = draw(st.sampled_from(["none", "softplus", "qwen", "sigmoid", "kda"]))
    l2norm = draw(st.booleans())
    dtype = draw(st.sampled_from([np.float32, np.float32, np.float16]))
    C = draw(st.sampled_from([0, 0, 1, 2, 3, 8]))
    active = draw(st.sampled_from([None, 0, 1, 3]))
    state = packed or form == "uniform" or draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    k = normal(rng, *lead, Hq, K)
    x = dict(query=normal(rng, *lead, Hq, K), key=k if l2norm else l2n(k), value=normal(rng, *lead, Hv, V))
    if cu is not None:
        x["cu_seqlens"] = cu
    if rule in GATED:
        shape = lead + ((Hv, K) if per_key else (Hv,))
        x["decay"] = normal(rng, *shape) if gate != "none" else rng.uniform(-1, -0.01, shape).astype(np.float32)
    if rule in DELTA:
        x["beta"] = normal(rng, *lead, Hv)
    if state:
        x["initial_state"] = normal(rng, N, Hv, V, K) * 0.5
    if gate != "none":
        bias_shape = draw(st.sampled_from([(Hv,), (Hv, K), (Hv * K,)])) if per_key else (Hv,)
        x["a_log"], x["dt_bias"] = normal(rng, Hv) * 0.5, normal(rng, *bias_shape)
    if C:
        x["capture_count"] = np.array(draw(st.lists(st.integers(-1, 10), min_size=N, max_size=N)), np.int32)
    if active is not None:
        x["state_update_active"] = np.array([active], np.int32)
    for n in ("query", "key", "value"):
        x[n] = x[n].astype(dtype)
    gates_dtype = draw(st.sampled_from([np.float32, dtype]))
    for n in ("decay", "beta"):
        if n in x:
            x[n] = x[n].astype(gates_dtype)
    if packed:
        width = lambda a: a.reshape(*lead, -1)                            # noqa: E731
        x["query"] = np.concatenate([width(x["query"]), width(x["key"]), width(x["value"])], axis=-1)
        x["key"] = x["value"] = None
    attrs = dict(update_rule=rule, gate_activation=gate, beta_activation=draw(st.sampled_from(["none", "sigmoid"])),
                 qk_l2_norm=int(l2norm), state_update_capacity=C,
                 scale=draw(st.sampled_from([0.0, 0.5])), gate_lower_bound=-3.0)
    if attrs["beta_activation"] == "none" and "beta" in x:
        x["beta"] = (np.abs(x["beta"].astype(np.float32)) % 1).astype(x["beta"].dtype)
    counts = [0] * N
    if C and active != 0:
        counts = [max(0, min(c, C, L)) for c, L in zip(x["capture_count"].tolist(), lengths)]
    widths = (Hv * K if per_key else Hv, Hq * K, Hv * V)
    return x, attrs, counts, widths


@examples(80)
@given(call=gdn_calls())
def test_gated_delta_net_matches_ort_on_random_calls(call):
    x, attrs, counts, widths = call
    note(f"attrs={attrs} shapes={ {n: None if a is None else a.shape for n, a in x.items()} }")
    for what in (f"rule {attrs['update_rule']}", f"gate {attrs['gate_activation']}",
                 "packed" if x["key"] is None else "q/k/v",
                 "varlen" if "cu_seqlens" in x else f"{x['query'].ndim - (1 if x['key'] is None else 2)} token axes",
                 f"capacity {attrs['state_update_capacity']}", f"active {x.get('state_update_active')}",
                 "counts " + ("none" if not counts or not any(counts) else "some"), f"dtype {x['query'].dtype}"):
        event(what)
    got, ref = adapter(x, attrs), peer(x, attrs)
    tol = F32_TOL if x["query"].dtype == np.float32 else F16_TOL
    assert len(got) == (3 if attrs["state_update_capacity"] else 2)
    for name, g, r in zip(("output", "final_state"), got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        if np.linalg.norm(r) > 0:
            assert rel(g, r) < tol, f"{name}: relative error {rel(g, r):.3g}"
        else:
            np.testing.assert_array_equal(g, r)
    if attrs["state_update_capacity"]:
        assert_capture(got[2], ref[2], counts, attrs["state_update_capacity"], widths, tol)
    else:
        assert ref[2].shape == (got[1].shape[0], 0)


@pytest.mark.parametrize("gate", ["none", "softplus", "sigmoid", "kda"])
def test_l2norm_epsilon_follows_the_gate_like_ort(request, gate):
    """ORT 1.32's CPU kernel normalises q and k with eps 1e-12, but with 1e-6 beside the bounded
    KDA gate ("sigmoid" / "kda"), found from its output: head vectors of norm ~1e-3 show it
    (a 1e-6 eps moves them by ~30 %), and the adapter matches ORT with each gate's epsilon."""
    rng = rng_for(request)
    x, attrs, _ = capture_case(rng, gate=gate, counts=(0, 0, 0), C=1)
    x["query"] *= 1e-3
    x["key"] *= 2e-3
    got, ref = adapter(x, attrs), peer(x, attrs)
    for name, g, r in zip(("output", "final_state"), got, ref):
        assert rel(g, r) < F32_TOL, name
    # the other epsilon is visibly wrong: the test can fail
    kind, args, shape = dort.gated_delta_net_arguments(*(x.get(n) for n in INPUTS), **attrs, scale=0.0,
                                                       chunk_size=64, gate_lower_bound=-5.0)
    expected = 1e-6 if gate in ("sigmoid", "kda") else 1e-12
    assert args["l2norm_eps"] == expected
    args.pop("capture")
    o, _ = deltarule.api.call(**dict(args, l2norm_eps=1e-12 if expected == 1e-6 else 1e-6))
    assert rel(o.reshape(shape).numpy(), ref[0]) > 1e-2
