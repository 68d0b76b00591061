"""deltarule.contracts.slab (gatedDeltaUpdate) against a float64 oracle of the runtime's card.

The oracle (`reference`) is a token loop in NumPy float64 written from the
binding card (the `gatedDeltaUpdate` operator reference), not from
deltarule: per batch row b, S = state[slot_ids[b]] (or state[b]); per token
< seq_lens[b] and value head, S = exp(decay) S (per key: along K), with
decay = gate, or gate_scale * softplus(gate + gate_bias) in the raw form;
S += (beta k) (v - S^T k)^T; o = (scale q)^T S; the final S is stored back.
Bounds: relative error <= 1e-5 for float32 outputs and for every touched
state row (the state is float32 whatever the activations); bfloat16 outputs
within one rounding of the unrounded oracle (|x - ref| <= 2^-8 |ref| + 1e-4,
norm-wise <= 2^-8); rows not addressed bit-identical.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

import deltarule
from deltarule.contracts import slab as dslab

from conftest import assert_refused, read_only, rel, rng_for

F32_TOL = 1e-5
OUT_RTOL, BF16_ATOL, BF16_NORM = 2.0 ** -8, 1e-4, 2.0 ** -8
I32 = torch.int32


# ---------------------------------------------------------------------------
# the oracle: the card's semantics, literally, in float64
# ---------------------------------------------------------------------------

def reference(q, k, v, beta, gate, state, seq_lens=None, slot_ids=None, scale=None, gate_bias=None,
              gate_scale=None):
    """(o [B, T, HV, V], state after) in float64; `state` [num_slots, HV, K, V] is not modified."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K ** -0.5 if scale is None else scale
    per_key = gate.ndim == 4
    state = state.copy()
    o = np.zeros(v.shape)
    for b in range(B):
        slot = b if slot_ids is None else slot_ids[b]
        S = state[slot].copy()
        for t in range(T if seq_lens is None else seq_lens[b]):
            for h in range(HV):
                kh = h // (HV // H)
                decay = gate[b, t, h]
                if gate_scale is not None:
                    decay = gate_scale[h] * np.logaddexp(0.0, decay + gate_bias[h])   # softplus
                S[h] = (np.exp(decay)[:, None] if per_key else np.exp(decay)) * S[h]
                S[h] += np.outer(beta[b, t, h] * k[b, t, kh], v[b, t, h] - S[h].T @ k[b, t, kh])
                o[b, t, h] = (scale * q[b, t, kh]) @ S[h]
        state[slot] = S
    return o, state


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------

def tensor(a, dtype=torch.float32):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(dtype)


def make(rng, *, B=3, T=5, H=2, HV=4, K=36, V=20, gate="scalar", raw=False, dtype=torch.float32,
         gate_dtype=None, seq_lens=None, slots=None):
    """Random gatedDeltaUpdate inputs (torch): unit keys, log decays in (-1, -0.01), raw gates
    around 0 with gate_scale = -exp(A_log); `slots` = num_slots to address rows through slot_ids."""
    k = rng.standard_normal((B, T, H, K))
    gate_shape = (B, T, HV) if gate == "scalar" else (B, T, HV, K)
    x = dict(
        query=tensor(rng.standard_normal((B, T, H, K)), dtype),
        key=tensor(k / np.linalg.norm(k, axis=-1, keepdims=True), dtype),
        value=tensor(rng.standard_normal((B, T, HV, V)), dtype),
        beta=tensor(rng.uniform(0.05, 0.95, (B, T, HV)), dtype),
        gate=tensor(rng.standard_normal(gate_shape) if raw else rng.uniform(-1.0, -0.01, gate_shape),
                    gate_dtype or dtype),
        state=tensor(rng.standard_normal((slots or B, HV, K, V)) * 0.5),
    )
    if raw:
        x["gate_bias"] = tensor(rng.standard_normal((HV,) if gate == "scalar" else (HV, K)))
        x["gate_scale"] = -torch.exp(tensor(rng.uniform(-1.0, 0.5, HV)))
    if seq_lens is not None:
        x["seq_lens"] = torch.tensor(seq_lens, dtype=I32)
    if slots is not None:
        x["slot_ids"] = torch.from_numpy(rng.permutation(slots)[:B].astype(np.int32))
    return x


def reference_of(x):
    f64 = lambda name: None if x.get(name) is None else x[name].double().numpy()  # noqa: E731
    ints = lambda name: None if x.get(name) is None else x[name].tolist()  # noqa: E731
    return reference(f64("query"), f64("key"), f64("value"), f64("beta"), f64("gate"), f64("state"),
                     ints("seq_lens"), ints("slot_ids"), x.get("scale"), f64("gate_bias"), f64("gate_scale"))


def assert_matches_reference(x, o, before):
    """o and the state after the call (x['state']) against the oracle; rows not addressed bit-identical."""
    ref_o, ref_state = reference_of(dict(x, state=before))
    assert o.dtype == x["value"].dtype and tuple(o.shape) == ref_o.shape
    if o.dtype == torch.float32:
        assert rel(o, ref_o) <= F32_TOL, f"o: relative error {rel(o, ref_o):.3g}"
    else:
        err = np.abs(o.double().numpy() - ref_o)
        assert not (err > OUT_RTOL * np.abs(ref_o) + BF16_ATOL).any(), "o: beyond one rounding"
        assert rel(o, ref_o) <= BF16_NORM
    slots = x["slot_ids"].tolist() if x.get("slot_ids") is not None else list(range(x["query"].shape[0]))
    state = x["state"]
    for r in range(state.shape[0]):
        if r not in slots:
            assert torch.equal(state[r], before[r]), f"state row {r} is not addressed, yet changed"
        else:
            assert rel(state[r], ref_state[r]) <= F32_TOL, f"state row {r}: {rel(state[r], ref_state[r]):.3g}"


def call(x):
    return dslab.gated_delta_update(**x)


ROWS = {
    "dense": dict(),
    "seq_lens": dict(seq_lens=[5, 0, 2]),
    "slot_ids": dict(slots=7),
    "seq_lens-slot_ids": dict(seq_lens=[1, 5, 0], slots=7),
}


# ---------------------------------------------------------------------------
# against the oracle
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("raw", [False, True], ids=["log-gate", "raw-gate"])
@pytest.mark.parametrize("gate", ["scalar", "per-key"])
def test_matches_reference(request, gate, raw, rows, dtype):
    """Both gate ranks, both gate forms; bfloat16 activations carry a bfloat16 gate (float32 bias/scale)."""
    x = make(rng_for(request), gate=gate, raw=raw, dtype=dtype, **ROWS[rows])
    before = x["state"].clone()
    assert_matches_reference(x, call(x), before)


@pytest.mark.parametrize("heads", [(1, 1), (2, 2), (2, 4), (1, 6)], ids=lambda h: f"H{h[0]}-HV{h[1]}")
@pytest.mark.parametrize("dims", [(100, 17), (16, 16), (7, 130)], ids=lambda d: f"K{d[0]}-V{d[1]}")
@pytest.mark.parametrize("gate", ["scalar", "per-key"])
def test_heads_and_sizes_match_reference(request, gate, heads, dims):
    """Grouped heads (value head h reads query / key head h // (HV / H)) and odd head sizes."""
    x = make(rng_for(request), H=heads[0], HV=heads[1], K=dims[0], V=dims[1], gate=gate, raw=True,
             seq_lens=[5, 3, 1], slots=5)
    before = x["state"].clone()
    assert_matches_reference(x, call(x), before)


@pytest.mark.parametrize("gate_form", ["log-gate", "raw-gate"])
@pytest.mark.parametrize("gate", ["scalar", "per-key"])
def test_zero_gate_scale_means_no_decay(request, gate, gate_form):
    """gate_scale 0 (and -0.0) is a zero decay rate: A_log = log(0) = -inf, -exp(-inf) = 0, decay
    factor exp(0) = 1, the delta rule without decay on those heads."""
    x = make(rng_for(request), gate=gate, raw=True, seq_lens=[5, 2, 4], slots=4)
    x["gate_scale"] = torch.tensor([0.0, -0.0, -0.5, -2.0])
    before = x["state"].clone()
    o = call(x)
    assert_matches_reference(x, o, before)
    plain = dict(x, state=before.clone(), gate_scale=torch.zeros(4))
    o_plain = call(plain)
    o_delta, _ = deltarule.linear_attention(
        x["query"], x["key"], x["value"], rule="delta", beta=x["beta"], initial_state=before.clone(),
        seq_lens=x["seq_lens"], state_indices=x["slot_ids"])
    torch.testing.assert_close(o_plain, o_delta, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o[:, :, :2], o_plain[:, :, :2], rtol=0, atol=0)


def test_float32_gate_and_beta_beside_bfloat16_activations(request):
    """A log-space gate (and beta) may be float32 beside 16-bit activations."""
    x = make(rng_for(request), dtype=torch.bfloat16, gate_dtype=torch.float32, slots=4)
    x["beta"] = x["beta"].float()
    before = x["state"].clone()
    assert_matches_reference(x, call(x), before)


def test_zero_length_row_keeps_its_state_and_gets_zero_output(request, nan_poison):
    x = make(rng_for(request), raw=True, seq_lens=[2, 0, 5], slots=6)
    before = x["state"].clone()
    o = call(x)
    assert not o.isnan().any()
    assert torch.count_nonzero(o[0, 2:]) == 0 and torch.count_nonzero(o[1]) == 0
    assert torch.equal(x["state"][x["slot_ids"][1]], before[x["slot_ids"][1]])


@pytest.mark.parametrize("scale", [0.3, -1.5], ids=["scale-0.3", "scale-neg1.5"])
def test_scale_matches_reference(request, scale):
    x = make(rng_for(request), gate="per-key", slots=5)
    x["scale"] = scale
    before = x["state"].clone()
    assert_matches_reference(x, call(x), before)


def test_maps_onto_linear_attention(request):
    """The documented mapping: g / gk by the gate's rank, A_log = log(-gate_scale), dt_bias =
    gate_bias, state_indices = slot_ids, seq_lens passed through; bit-identical."""
    x = make(rng_for(request), gate="per-key", raw=True, seq_lens=[3, 5, 1], slots=5)
    slab = x["state"].clone()
    o = call(x)
    ref, state = deltarule.linear_attention(
        x["query"], x["key"], x["value"], gk=x["gate"], beta=x["beta"], initial_state=slab,
        seq_lens=x["seq_lens"], state_indices=x["slot_ids"],
        A_log=torch.log(-x["gate_scale"].double()).float(), dt_bias=x["gate_bias"])
    assert torch.equal(o, ref) and torch.equal(state, x["state"])


@pytest.mark.parametrize("state_form", ["shared", "strided"])
def test_numpy_state_is_updated_in_the_callers_array(request, state_form):
    """A C-contiguous float32 array shares memory with the tensor deltarule updates; a strided one is
    a copy, whose addressed rows the adapter writes back."""
    x = make(rng_for(request), raw=True, seq_lens=[5, 1, 3], slots=5)
    xn = {n: t.numpy().copy() for n, t in x.items()}
    if state_form == "strided":
        big = np.zeros((10,) + xn["state"].shape[1:], np.float32)
        big[::2] = xn["state"]
        xn["state"] = big[::2]
    state = xn["state"]
    o_np = call(xn)
    o_t = call(x)
    assert isinstance(o_np, np.ndarray) and o_np.dtype == np.float32
    np.testing.assert_array_equal(o_np, o_t.numpy())
    np.testing.assert_array_equal(state, x["state"].numpy())
    if state_form == "strided":
        assert not big[1::2].any()


def test_docstring_example_runs():
    result = doctest.testmod(dslab)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------
# contract errors: each names the operator's argument; the state is untouched
# ---------------------------------------------------------------------------

def _bf16_activations(x):
    return {n: x[n].bfloat16() for n in ("query", "key", "value", "beta")}


ERRORS = {
    # id: (change of the valid call (B = 3, T = 5, H = 2, HV = 4, K = 36, V = 20, raw scalar gate,
    #      seq_lens, slot_ids into 7 rows), argument)
    "query-not-a-tensor": (lambda x: dict(query=1.0), "query"),
    "query-rank-3": (lambda x: dict(query=x["query"][0]), "query"),
    "query-no-rows": (lambda x: dict(query=x["query"][:0]), "query"),
    "query-float64": (lambda x: dict(query=x["query"].double().numpy()), "query"),
    "key-shape": (lambda x: dict(key=x["key"][..., :35]), "key"),
    "key-dtype": (lambda x: dict(key=x["key"].bfloat16()), "key"),
    "key-other-device": (lambda x: dict(key=x["key"].to("meta")), "key"),
    "value-heads-not-multiple": (lambda x: dict(value=x["value"][:, :, :3]), "value"),
    "value-no-channels": (lambda x: dict(value=x["value"][..., :0]), "value"),
    "value-tokens": (lambda x: dict(value=x["value"][:, :4]), "value"),
    "value-dtype": (lambda x: dict(value=x["value"].half()), "value"),
    "beta-missing": (lambda x: dict(beta=None), "beta"),
    "beta-shape": (lambda x: dict(beta=x["beta"][..., None]), "beta"),
    "beta-float16-beside-float32": (lambda x: dict(beta=x["beta"].half()), "beta"),
    "gate-rank-2": (lambda x: dict(gate=x["gate"][0]), "gate"),
    "gate-per-value": (lambda x: dict(gate=torch.zeros(3, 5, 4, 20)), "gate"),
    "gate-float16-beside-float32": (lambda x: dict(gate=x["gate"].half()), "gate"),
    "raw-gate-float32-beside-bfloat16": (_bf16_activations, "gate"),
    "state-rank-3": (lambda x: dict(state=x["state"][0]), "state"),
    "state-v-major": (lambda x: dict(state=x["state"].transpose(-1, -2).contiguous()), "state"),
    "state-bfloat16": (lambda x: dict(state=x["state"].bfloat16()), "state"),
    "state-rows-without-slot_ids": (lambda x: dict(slot_ids=None), "state"),
    "state-read-only-array": (lambda x: dict(state=read_only(x["state"].numpy())), "state"),
    "gate_bias-without-gate_scale": (lambda x: dict(gate_scale=None), "gate_scale"),
    "gate_scale-without-gate_bias": (lambda x: dict(gate_bias=None), "gate_bias"),
    "gate_bias-per-key-beside-scalar-gate": (lambda x: dict(gate_bias=torch.zeros(4, 36)), "gate_bias"),
    "gate_bias-scalar-beside-per-key-gate": (lambda x: dict(gate=torch.zeros(3, 5, 4, 36)), "gate_bias"),
    "gate_bias-float16": (lambda x: dict(gate_bias=x["gate_bias"].half()), "gate_bias"),
    "gate_scale-shape": (lambda x: dict(gate_scale=x["gate_scale"][:2]), "gate_scale"),
    "gate_scale-bfloat16": (lambda x: dict(gate_scale=x["gate_scale"].bfloat16()), "gate_scale"),
    "gate_scale-positive": (lambda x: dict(gate_scale=torch.tensor([-1.0, 0.5, -1.0, -1.0])), "gate_scale"),
    "seq_lens-above-T": (lambda x: dict(seq_lens=torch.tensor([5, 6, 0], dtype=I32)), "seq_lens"),
    "seq_lens-negative": (lambda x: dict(seq_lens=torch.tensor([5, -1, 0], dtype=I32)), "seq_lens"),
    "seq_lens-int64": (lambda x: dict(seq_lens=torch.tensor([5, 1, 0])), "seq_lens"),
    "seq_lens-length": (lambda x: dict(seq_lens=torch.tensor([5, 1], dtype=I32)), "seq_lens"),
    "slot_ids-out-of-range": (lambda x: dict(slot_ids=torch.tensor([0, 7, 1], dtype=I32)), "slot_ids"),
    "slot_ids-negative": (lambda x: dict(slot_ids=torch.tensor([0, -1, 1], dtype=I32)), "slot_ids"),
    "slot_ids-repeated": (lambda x: dict(slot_ids=torch.tensor([4, 2, 4], dtype=I32)), "slot_ids"),
    "slot_ids-int64": (lambda x: dict(slot_ids=torch.tensor([0, 1, 2])), "slot_ids"),
    "slot_ids-length": (lambda x: dict(slot_ids=torch.tensor([0, 1], dtype=I32)), "slot_ids"),
    "slot_ids-other-device": (lambda x: dict(slot_ids=x["slot_ids"].to("meta")), "slot_ids"),
    "scale-nan": (lambda x: dict(scale=float("nan")), "scale"),
    "scale-string": (lambda x: dict(scale="0.5"), "scale"),
    "scale-inf-in-float32": (lambda x: dict(scale=1e39), "scale"),
    # the state is written after the inputs are read: it may not overlap itself or any of them
    "state-expanded-rows": (lambda x: dict(state=x["state"][:1].expand(7, 4, 36, 20)), "state"),
    "query-view-of-a-state-row": (lambda x: dict(query=x["state"][6, :2, :, :5].permute(2, 0, 1)[None, :, :, :]
                                                 .expand(3, 5, 2, 36)), "state"),
    "beta-view-of-the-state": (lambda x: dict(beta=x["state"][0, 0, :5, :4].expand(3, 5, 4)), "state"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_contract_errors(request, case):
    x = make(rng_for(request), raw=True, seq_lens=[5, 1, 0], slots=7)
    change, name = ERRORS[case]
    x.update(change(x))
    assert_refused(call, x, name)
