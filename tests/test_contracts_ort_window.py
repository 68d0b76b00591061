"""com.microsoft.LinearAttention's `state_window` (deltarule.contracts.ort.linear_attention).

ONNX Runtime 1.32's CPU kernel refuses state_window > 0 (CUDA only), so the windows are
checked against the schema's text through an independent float64 token loop written here:
past_state [W, B, H_kv, d_k, d_v] of which slot W - 1 is read; present_state slot j the state
after token T - W + j (0-based), zeros where T - W + j < 0. What ORT's CPU kernel does run,
the W = 0 call, must give the window call's output and its slot W - 1; and the refusal itself
is asserted, so that an onnxruntime that runs windows on the CPU fails
`test_ort_cpu_refuses_state_window` by name (then compare against it instead).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltarule import ContractError

from conftest import rel, rng_for
from test_contracts_ort import F16_TOL, F32_TOL, LA_HEADS, la_inputs, la_peer, la_run


def token_loop(x: dict, W: int) -> tuple[np.ndarray, np.ndarray]:
    """The schema's recurrence in float64, one token at a time: (output [B, T, max(H_q, H_kv) * d_v],
    the window [W, B, H_kv, d_k, d_v] as the state_window text defines it)."""
    a = x["attrs"]
    Hq, Hkv, rule = a["q_num_heads"], a["kv_num_heads"], a["update_rule"]
    q, k, v = (x[n].astype(np.float64) for n in "qkv")
    B, T, _ = q.shape
    d_k = q.shape[2] // Hq
    d_v = v.shape[2] // Hkv
    Hk = k.shape[2] // d_k
    q, k, v = q.reshape(B, T, Hq, d_k), k.reshape(B, T, Hk, d_k), v.reshape(B, T, Hkv, d_v)
    scale = a.get("scale", 0.0) or 1.0 / np.sqrt(d_k)
    S = np.zeros((B, Hkv, d_k, d_v)) if x["past"] is None else x["past"][W - 1].astype(np.float64)
    Ho = max(Hq, Hkv)
    out = np.zeros((B, T, Ho, d_v))
    window = np.zeros((W, B, Hkv, d_k, d_v))
    for t in range(T):
        for h in range(Hkv):
            kt = k[:, t, h // (Hkv // Hk)]                                     # [B, d_k]
            if rule in ("gated", "gated_delta"):
                g = x["decay"][:, t].astype(np.float64).reshape(B, Hkv, -1)[:, h]   # [B, 1] or [B, d_k]
                S[:, h] *= np.exp(g)[:, :, None]
            u = v[:, t, h]
            if rule in ("delta", "gated_delta"):
                beta = x["beta"][:, t].astype(np.float64)
                b = beta[:, h if beta.shape[1] > 1 else 0][:, None]
                u = b * (u - np.einsum("bkv,bk->bv", S[:, h], kt))
            S[:, h] += kt[:, :, None] * u[:, None, :]
        for j in range(Ho):
            h = j // (Hq // Hkv) if Hq >= Hkv else j                           # the state head output j reads
            qj = q[:, t, j if Hq >= Hkv else j // (Hkv // Hq)]
            out[:, t, j] = scale * np.einsum("bkv,bk->bv", S[:, h], qj)
        slot = t - (T - W)
        if slot >= 0:
            window[slot] = S
    return out.reshape(B, T, Ho * d_v), window


def windowed(rng, *, rule="gated_delta", heads="gqa", W=3, T=7, past=True, dtype=np.float32,
             past_dtype=np.float32, decay_form="per-head", beta_form="per-head"):
    x = la_inputs(rng, rule=rule, heads=LA_HEADS[heads], T=T, past=False, dtype=dtype, decay_form=decay_form,
                  beta_form=beta_form)
    B, Hkv = 2, LA_HEADS[heads][2]
    if past:
        x["past"] = (rng.standard_normal((W, B, Hkv, 8, 6)) * 0.5).astype(past_dtype)
    x["attrs"]["state_window"] = W
    return x


def assert_window(got, x, W, tol):
    want_o, want_s = token_loop(x, W)
    o, s = got
    assert o.shape == want_o.shape and s.shape == want_s.shape
    state_dtype = x["past"].dtype if x["past"] is not None else x["q"].dtype
    assert o.dtype == x["q"].dtype and s.dtype == state_dtype
    assert rel(o, want_o) < tol, f"output: {rel(o, want_o):.3g}"
    T = x["q"].shape[1]
    for j in range(W):
        if T - W + j < 0:
            assert not s[j].any(), f"slot {j} holds no token of this call: zeros"
        else:
            assert rel(s[j], want_s[j]) < tol, f"slot {j}: {rel(s[j], want_s[j]):.3g}"


@pytest.mark.parametrize("T", [1, 2, 3, 5, 12], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("W", [1, 3, 8], ids=lambda w: f"W{w}")
def test_state_window_matches_the_token_loop(request, W, T):
    """Right-aligned slots; T < W leaves the first W - T slots zero."""
    x = windowed(rng_for(request), W=W, T=T)
    assert_window(la_run(x), x, W, F32_TOL)


@pytest.mark.parametrize("heads", ["mha", "gqa", "inverse-gqa", "inverse-gqa-key-below-q", "gqa-shared-key"])
@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_state_window_every_rule_and_head_form(request, rule, heads):
    x = windowed(rng_for(request), rule=rule, heads=heads, W=4, T=6)
    assert_window(la_run(x), x, 4, F32_TOL)


@pytest.mark.parametrize("form", ["per-key-decay", "shared-beta", "no-past", "float16", "float16-past"])
def test_state_window_input_forms(request, form):
    kw = {"per-key-decay": dict(decay_form="per-key"), "shared-beta": dict(beta_form="shared"),
          "no-past": dict(past=False), "float16": dict(dtype=np.float16, past=False),
          "float16-past": dict(dtype=np.float16, past_dtype=np.float16)}[form]
    x = windowed(rng_for(request), W=3, T=5, **kw)
    tol = F16_TOL if x["q"].dtype == np.float16 else F32_TOL
    assert_window(la_run(x), x, 3, tol)


def test_state_window_reads_only_slot_w_minus_1(request):
    x = windowed(rng_for(request), W=4, T=5)
    o, s = la_run(x)
    x["past"][:3] = np.nan                                  # slots 0 .. W - 2 are never read
    o2, s2 = la_run(x)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(s, s2)


def test_state_window_with_no_tokens_is_all_zeros(request):
    """T = 0: every slot holds no token of this call (the schema's max(0, W - T) rule), slot
    W - 1 included; the output is empty."""
    x = windowed(rng_for(request), W=2, T=1)
    for n in ("q", "k", "v", "decay", "beta"):
        x[n] = x[n][:, :0]
    o, s = la_run(x)
    assert o.shape == (2, 0, 24) and s.shape == (2, 2, 2, 8, 6) and not s.any()


def test_state_window_agrees_with_what_ort_cpu_runs(request):
    """ORT's CPU kernel runs the W = 0 call: its output is the window call's output and its
    present_state the window's slot W - 1 (past_state its slot W - 1)."""
    x = windowed(rng_for(request), W=3, T=6, heads="inverse-gqa-key-below-q")
    o, s = la_run(x)
    attrs = dict(x["attrs"], state_window=0)
    ref_o, ref_s = la_peer(x["q"], x["k"], x["v"], x["past"][2], x["decay"], x["beta"], **attrs)
    assert rel(o, ref_o) < F32_TOL and rel(s[2], ref_s) < F32_TOL


def test_ort_cpu_refuses_state_window(request):
    """onnxruntime 1.32's CPU kernel refuses W > 0 (CUDA only). When a release runs it, this test
    fails by name: then compare `la_run` with it here instead of asserting the refusal."""
    ort = pytest.importorskip("onnxruntime")
    x = windowed(rng_for(request), W=2, T=3)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="state_window"):
        la_peer(x["q"], x["k"], x["v"], x["past"], x["decay"], x["beta"], **x["attrs"])


def test_state_window_torch_in_torch_out(request):
    x = windowed(rng_for(request), W=2, T=4)
    got = la_run(x)
    xt = dict(x, **{n: torch.from_numpy(x[n]) for n in ("q", "k", "v", "past", "decay", "beta")})
    o, s = la_run(xt)
    assert isinstance(o, torch.Tensor) and isinstance(s, torch.Tensor)
    np.testing.assert_array_equal(o.numpy(), got[0])
    np.testing.assert_array_equal(s.numpy(), got[1])


@pytest.mark.parametrize("case, change, name", [
    ("4-d-past", dict(past=np.zeros((2, 2, 8, 6), np.float32)), "past_state"),
    ("window-of-2", dict(past=np.zeros((2, 2, 2, 8, 6), np.float32)), "past_state"),
    ("past-float64", dict(past=np.zeros((3, 2, 2, 8, 6))), "past_state"),
    ("key-length", dict(k=np.zeros((2, 6, 16), np.float32)), "key"),
    ("value-heads", dict(v=np.zeros((2, 7, 5), np.float32)), "value"),
    ("decay-length", dict(decay=np.zeros((2, 6, 2), np.float32)), "decay"),
    ("query-heads", dict(q=np.zeros((2, 7, 30), np.float32)), "query"),
])
def test_state_window_contract_errors(request, case, change, name):
    """The window call refuses what the W = 0 call refuses, naming the same input (checked on
    the whole inputs, before the token axis is cut), and a past_state without the window axis."""
    x = windowed(rng_for(request), W=3, T=7)
    x.update(change)
    with pytest.raises(ContractError) as info:
        la_run(x)
    assert info.value.argument == name, info.value


def test_state_window_bad_update_rule_is_named_first(request):
    x = windowed(rng_for(request), W=3, T=7)
    x["past"] = np.zeros((1, 1), np.float32)                 # wrong too: the rule is checked first, as for W = 0
    x["attrs"]["update_rule"] = "rwkv"
    with pytest.raises(ContractError) as info:
        la_run(x)
    assert info.value.argument == "update_rule"
