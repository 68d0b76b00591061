"""deltarule.contracts.ascend against a float64 oracle of Ascend's golden semantics.

No NPU runs here: the oracle (`golden`) is a token loop in NumPy float64
written from the operator's description (the parameter table and golden of
CANN ops-transformer's attention/recurrent_gated_delta_rule/), not
from deltarule. Bounds:

- a float32 slab's touched rows: relative error <= 1e-5 per row;
- `out` (bfloat16) against the unrounded oracle: one rounding, elementwise
  |x - ref| <= 2^-8 |ref| + 1e-4, and norm-wise relative error <= 2^-8;
- a bfloat16 slab's touched rows against the oracle's bfloat16 stores: at
  most one bfloat16 ulp apart, |x - ref| <= 2^-7 |ref| + 1e-4 (Ascend's own
  golden tolerance, rtol 0.0078125 / atol 1e-4, here on 100 % of the elements
  instead of 99.5 %), norm-wise <= 2^-8;
- slab rows no token names: bit-identical.

`test_bounds_discriminate` checks that a wrong mapping fails them.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import deltarule
from deltarule.contracts import ascend

from conftest import assert_refused, read_only, rel, rng_for

OUT_RTOL, STORE_RTOL, BF16_ATOL, BF16_NORM = 2.0 ** -8, 2.0 ** -7, 1e-4, 2.0 ** -8
F32_TOL = 1e-5
I32 = torch.int32


# ---------------------------------------------------------------------------
# the oracle: Ascend's golden, literally, in float64
# ---------------------------------------------------------------------------

def round_to(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """A float64 state stored into a `dtype` slab (nearest even) and read back as float64."""
    return torch.from_numpy(x).to(dtype).double().numpy()


def golden(q, k, v, beta, slab, lengths, indices, g=None, gk=None, accepted=None, scale=None, *, slab_dtype):
    """(out (T, Nv, Dv), slab after) in float64. Per sequence i: S = slab[indices[start + a_i - 1]]
    (a_i = 1 without `accepted`); per token and value head: S *= exp(g); S *= exp(gk) along Dk;
    S += ((v - S k) * beta) k^T (S is V-major, Dv x Dk); slab[indices[token]] = S rounded to the
    slab's dtype; out = S (q * scale). Value head h reads key head h // (Nv / Nk)."""
    T, Nk, Dk = q.shape
    Nv = v.shape[1]
    scale = 1.0 / math.sqrt(Dk) if scale is None else scale
    slab = slab.copy()
    out = np.zeros((T, Nv, v.shape[2]))
    start = 0
    for i, L in enumerate(lengths):
        a = 1 if accepted is None else accepted[i]
        S = slab[indices[start + a - 1]].copy()
        for j in range(start, start + L):
            for h in range(Nv):
                kh = h // (Nv // Nk)
                if g is not None:
                    S[h] *= np.exp(g[j, h])
                if gk is not None:
                    S[h] *= np.exp(gk[j, h])[None, :]
                S[h] += np.outer((v[j, h] - S[h] @ k[j, kh]) * beta[j, h], k[j, kh])
                out[j, h] = S[h] @ (q[j, kh] * scale)
            slab[indices[j]] = round_to(S, slab_dtype)
        start += L
    return out, slab


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------

def bf16(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)


def make(rng, lengths, *, Nk=2, Nv=4, Dk=100, Dv=36, gates="both", accepted=False, slab_dtype=torch.bfloat16,
         block_num=None):
    """Random Ascend inputs (torch): unit keys, decays in (-1, -0.01), each token its own slab row."""
    T = sum(lengths)
    block_num = block_num or T + 5
    k = rng.standard_normal((T, Nk, Dk))
    x = dict(
        query=bf16(rng.standard_normal((T, Nk, Dk))),
        key=bf16(k / np.linalg.norm(k, axis=-1, keepdims=True)),
        value=bf16(rng.standard_normal((T, Nv, Dv))),
        beta=bf16(rng.uniform(0.05, 0.95, (T, Nv))),
        state=torch.from_numpy(rng.standard_normal((block_num, Nv, Dv, Dk)).astype(np.float32) * 0.5).to(slab_dtype),
        actual_seq_lengths=torch.tensor(lengths, dtype=I32),
        ssm_state_indices=torch.from_numpy(rng.permutation(block_num)[:T].astype(np.int32)),
    )
    if gates in ("g", "both"):
        x["g"] = torch.from_numpy(rng.uniform(-1.0, -0.01, (T, Nv)).astype(np.float32))
    if gates in ("gk", "both"):
        x["gk"] = torch.from_numpy(rng.uniform(-1.0, -0.01, (T, Nv, Dk)).astype(np.float32))
    if accepted:
        x["num_accepted_tokens"] = torch.tensor([rng.integers(1, n + 1) for n in lengths], dtype=I32)
    return x


def golden_of(x, **kw):
    f64 = lambda name: None if x.get(name) is None else x[name].double().numpy()  # noqa: E731
    acc = x.get("num_accepted_tokens")
    return golden(f64("query"), f64("key"), f64("value"), f64("beta"), f64("state"),
                  x["actual_seq_lengths"].tolist(), x["ssm_state_indices"].tolist(), f64("g"), f64("gk"),
                  None if acc is None else acc.tolist(), x.get("scale_value"), slab_dtype=x["state"].dtype, **kw)


def assert_bf16_close(x, ref, what, rtol=OUT_RTOL):
    """`x` (bfloat16) within one rounding of `ref`: rtol 2^-8 against an unrounded reference,
    2^-7 (one ulp) against a rounded one."""
    x = x.double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    bad = np.abs(x - ref) > rtol * np.abs(ref) + BF16_ATOL
    assert not bad.any(), f"{what}: {bad.sum()} elements beyond one bfloat16 rounding"
    assert rel(x, ref) <= BF16_NORM, f"{what}: relative error {rel(x, ref):.3g}"


def assert_matches_golden(x, out, before):
    """out and the slab after the call (x['state']) against the oracle; unnamed rows bit-identical."""
    ref_out, ref_slab = golden_of(dict(x, state=before))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == ref_out.shape
    assert_bf16_close(out, ref_out, "out")
    slab = x["state"]
    touched = set(x["ssm_state_indices"].tolist())
    for r in range(slab.shape[0]):
        if r not in touched:
            assert torch.equal(slab[r], before[r]), f"slab row {r} is named by no token, yet changed"
        elif slab.dtype == torch.float32:
            assert rel(slab[r], ref_slab[r]) <= F32_TOL, f"slab row {r}: {rel(slab[r], ref_slab[r]):.3g}"
        else:
            assert_bf16_close(slab[r], ref_slab[r], f"slab row {r}", rtol=STORE_RTOL)


def call(x):
    return ascend.recurrent_gated_delta_rule(**x)


LENGTHS = {
    "one-token": [1],
    "eight-tokens": [8],
    "decode-batch": [1, 1, 1],
    "mixed": [3, 1, 8, 5],
    "all-lengths": [2, 7, 1, 4, 6, 3, 8, 5],
}


# ---------------------------------------------------------------------------
# against the golden
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("slab_dtype", [torch.bfloat16, torch.float32], ids=["bf16-slab", "fp32-slab"])
@pytest.mark.parametrize("accepted", [False, True], ids=["no-accepted", "num-accepted"])
@pytest.mark.parametrize("gates", ["none", "g", "gk", "both"], ids=lambda s: f"gates-{s}")
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_matches_golden(request, lengths, gates, accepted, slab_dtype):
    x = make(rng_for(request), LENGTHS[lengths], gates=gates, accepted=accepted, slab_dtype=slab_dtype)
    before = x["state"].clone()
    out = call(x)
    assert_matches_golden(x, out, before)


def test_bf16_stores_round_the_float32_state_to_nearest_even(request):
    """A BF16 slab's rows are the FP32 slab's rows (same start values) rounded to nearest even, and
    the outputs are the same: the state is FP32 between tokens, only the stores round."""
    x = make(rng_for(request), LENGTHS["mixed"], accepted=True)
    x32 = dict(x, state=x["state"].float())
    out, out32 = call(x), call(x32)
    assert torch.equal(out, out32)
    assert torch.equal(x["state"], x32["state"].to(torch.bfloat16))


@pytest.mark.parametrize("heads", [(1, 1), (2, 2), (2, 4), (1, 8), (3, 6)], ids=lambda h: f"Nk{h[0]}-Nv{h[1]}")
@pytest.mark.parametrize("dims", [(100, 36), (16, 16), (7, 129), (256, 8)], ids=lambda d: f"Dk{d[0]}-Dv{d[1]}")
def test_heads_and_sizes_match_golden(request, heads, dims):
    """GVA (value head h reads key head h // (Nv / Nk)) and odd head sizes up to the limit."""
    x = make(rng_for(request), [3, 1, 5], Nk=heads[0], Nv=heads[1], Dk=dims[0], Dv=dims[1], accepted=True)
    before = x["state"].clone()
    assert_matches_golden(x, call(x), before)


@pytest.mark.parametrize("scale", [0.3, -1.5, 0.0], ids=["scale-0.3", "scale-neg1.5", "scale-0"])
def test_scale_value_matches_golden(request, scale):
    x = make(rng_for(request), [4, 2], slab_dtype=torch.float32)
    x["scale_value"] = scale
    before = x["state"].clone()
    out = call(x)
    if scale == 0.0:                               # a zero scale is a scale, not "the default"
        assert torch.count_nonzero(out) == 0
        again = dict(x, state=before.clone(), scale_value=None)
        call(again)
        assert torch.equal(x["state"], again["state"])     # the scale only scales the output
    else:
        assert_matches_golden(x, out, before)


def test_default_scale_is_inverse_sqrt_dk(request):
    x = make(rng_for(request), [3, 2], Dk=100)
    s0 = x["state"].clone()
    out = call(x)
    x.update(state=s0, scale_value=0.1)            # 1 / sqrt(100)
    assert torch.equal(call(x), out)


def test_maps_onto_linear_attention(request):
    """The documented mapping: (1, T, ...) views, cu_seqlens from actual_seq_lengths, 2-D state_indices
    padded with -1, num_accepted_tokens passed through, state_layout 'vk'; bit-identical."""
    x = make(rng_for(request), [3, 1, 2], accepted=True)
    slab = x["state"].clone()
    out = call(x)
    rows = torch.tensor([[int(r) for r in x["ssm_state_indices"][s:s + n]] + [-1] * (3 - n)
                         for s, n in ((0, 3), (3, 1), (4, 2))], dtype=I32)
    o, state = deltarule.linear_attention(
        x["query"][None], x["key"][None], x["value"][None], g=x["g"][None], gk=x["gk"][None],
        beta=x["beta"][None], initial_state=slab, state_layout="vk",
        cu_seqlens=torch.tensor([0, 3, 4, 6], dtype=I32), state_indices=rows,
        num_accepted_tokens=x["num_accepted_tokens"])
    assert torch.equal(o[0], out) and torch.equal(state, x["state"])


def test_speculative_rollback_reads_the_accepted_tokens_row(request):
    """Step 1 verifies 4 draft tokens, each storing its state (rows 0..3, reading row 0); 2 are
    accepted, so step 2 names row 1 in its column 1 with num_accepted_tokens = 2. It equals
    replaying the 2 accepted tokens and step 2's tokens as one sequence from step 1's start."""
    rng = rng_for(request)
    x = make(rng, [4], slab_dtype=torch.float32, block_num=12)
    x["ssm_state_indices"] = torch.tensor([0, 1, 2, 3], dtype=I32)
    original = x["state"].clone()
    call(x)
    after_step1 = x["state"].clone()
    per_token = ("query", "key", "value", "beta", "g", "gk")
    new = make(rng, [4], slab_dtype=torch.float32, block_num=12)
    step2 = dict({n: new[n] for n in per_token}, state=x["state"], actual_seq_lengths=torch.tensor([4], dtype=I32),
                 ssm_state_indices=torch.tensor([4, 1, 5, 6], dtype=I32),
                 num_accepted_tokens=torch.tensor([2], dtype=I32))
    out = call(step2)
    replay = dict({n: torch.cat([x[n][:2], new[n]]) for n in per_token}, state=original.clone(),
                  actual_seq_lengths=torch.tensor([6], dtype=I32),
                  ssm_state_indices=torch.tensor([0, 7, 8, 9, 10, 11], dtype=I32))
    out_replay = call(replay)
    assert_bf16_close(out, out_replay[2:].double().numpy(), "out", rtol=STORE_RTOL)   # both rounded
    assert rel(step2["state"][6], replay["state"][11]) <= F32_TOL
    for r in (0, 2, 3):                            # the rejected drafts' rows stay as step 1 left them
        assert step2["state"][r].equal(after_step1[r])


@pytest.mark.parametrize("wrong", ["first-row-read", "gk-ignored", "no-gva-map"])
def test_bounds_discriminate(request, wrong):
    """The comparisons fail on a plausible wrong mapping (they can fail at all)."""
    x = make(rng_for(request), [3, 5], accepted=True, slab_dtype=torch.float32)
    x["num_accepted_tokens"] = torch.tensor([3, 4], dtype=I32)
    before = x["state"].clone()
    out = call(x)
    if wrong == "first-row-read":
        bad = dict(x, num_accepted_tokens=None)
    elif wrong == "gk-ignored":
        bad = dict(x, gk=None)
    else:                                          # value head h reading key head h % Nk
        bad = dict(x, query=x["query"][:, [0, 1, 0, 1]], key=x["key"][:, [0, 1, 0, 1]])
    ref_out, _ = golden_of(dict(bad, state=before))
    assert rel(out, ref_out) > 100 * BF16_NORM


def test_limits_are_accepted(request):
    """The largest shapes the operator allows: L_i = 8, Nk = Nv = 256; Dk = Dv = 256."""
    rng = rng_for(request)
    for shape in (dict(Nk=256, Nv=256, Dk=4, Dv=4), dict(Nk=1, Nv=1, Dk=256, Dv=256)):
        x = make(rng, [8, 1], accepted=True, **shape)
        before = x["state"].clone()
        assert_matches_golden(x, call(x), before)


def test_every_output_is_written(request, nan_poison):
    x = make(rng_for(request), LENGTHS["all-lengths"], accepted=True)
    assert not call(x).isnan().any()


# ---------------------------------------------------------------------------
# NumPy in: NumPy out, and the caller's state array updated in place
# ---------------------------------------------------------------------------

def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


@pytest.mark.parametrize("state_form", ["float32", "bfloat16", "float32-strided"])
def test_numpy_state_is_updated_in_the_callers_array(request, state_form):
    """float32 arrays share memory with the tensor deltarule updates; bfloat16 (ml_dtypes) and
    strided arrays are copies, whose touched rows the adapter writes back."""
    slab_dtype = torch.bfloat16 if state_form == "bfloat16" else torch.float32
    x = make(rng_for(request), [3, 1, 4], accepted=True, slab_dtype=slab_dtype)
    xn = {n: to_numpy(t) for n, t in x.items()}
    if state_form == "float32-strided":
        big = np.zeros((2 * xn["state"].shape[0],) + xn["state"].shape[1:], np.float32)
        big[::2] = xn["state"]
        xn["state"] = big[::2]
        assert not xn["state"].flags.c_contiguous
    state = xn["state"]
    out_np = call(xn)
    out_t = call(x)
    assert isinstance(out_np, np.ndarray) and out_np.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out_np.view(np.int16), out_t.view(torch.int16).numpy())
    assert xn["state"] is state
    np.testing.assert_array_equal(to_numpy(x["state"]).view(np.uint8), state.view(np.uint8))
    if state_form == "float32-strided":
        assert not big[1::2].any()                 # the rows between the view's are untouched


# ---------------------------------------------------------------------------
# contract errors: each names the Ascend argument; the slab is untouched
# ---------------------------------------------------------------------------

BF = torch.bfloat16
ERRORS = {
    # id: (change of the valid call (T = 5, Nk = 2, Nv = 4, Dk = 8, Dv = 6, BlockNum = 8), argument)
    "query-not-a-tensor": (lambda x: dict(query=[[0.0]]), "query"),
    "query-rank-2": (lambda x: dict(query=x["query"].reshape(5, 16)), "query"),
    "query-float32": (lambda x: dict(query=x["query"].float()), "query"),
    "query-no-heads": (lambda x: dict(query=torch.zeros(5, 0, 8, dtype=BF)), "query"),
    "query-257-heads": (lambda x: dict(query=torch.zeros(5, 257, 8, dtype=BF)), "query"),
    "query-Dk-257": (lambda x: dict(query=torch.zeros(5, 2, 257, dtype=BF)), "query"),
    "key-shape": (lambda x: dict(key=x["key"][..., :7]), "key"),
    "key-float16": (lambda x: dict(key=x["key"].half()), "key"),
    "key-other-device": (lambda x: dict(key=x["key"].to("meta")), "key"),
    "value-heads-not-multiple": (lambda x: dict(value=torch.zeros(5, 3, 6, dtype=BF)), "value"),
    "value-258-heads": (lambda x: dict(value=torch.zeros(5, 258, 6, dtype=BF)), "value"),
    "value-Dv-257": (lambda x: dict(value=torch.zeros(5, 4, 257, dtype=BF)), "value"),
    "value-tokens": (lambda x: dict(value=x["value"][:4]), "value"),
    "value-float32": (lambda x: dict(value=x["value"].float()), "value"),
    "beta-missing": (lambda x: dict(beta=None), "beta"),
    "beta-shape": (lambda x: dict(beta=x["beta"][:, :2]), "beta"),
    "beta-float32": (lambda x: dict(beta=x["beta"].float()), "beta"),
    "state-rank-3": (lambda x: dict(state=x["state"][0]), "state"),
    "state-k-major": (lambda x: dict(state=x["state"].transpose(-1, -2).contiguous()), "state"),
    "state-heads": (lambda x: dict(state=x["state"][:, :2]), "state"),
    "state-float16": (lambda x: dict(state=x["state"].half()), "state"),
    "state-read-only-array": (lambda x: dict(state=read_only(x["state"].float().numpy())), "state"),
    "lengths-zero": (lambda x: dict(actual_seq_lengths=torch.tensor([5, 0], dtype=I32)), "actual_seq_lengths"),
    "lengths-negative": (lambda x: dict(actual_seq_lengths=torch.tensor([6, -1], dtype=I32)), "actual_seq_lengths"),
    "lengths-nine": (lambda x: dict(actual_seq_lengths=torch.tensor([9, -4], dtype=I32)), "actual_seq_lengths"),
    "lengths-sum-below-T": (lambda x: dict(actual_seq_lengths=torch.tensor([3, 1], dtype=I32)), "actual_seq_lengths"),
    "lengths-sum-above-T": (lambda x: dict(actual_seq_lengths=torch.tensor([3, 3], dtype=I32)), "actual_seq_lengths"),
    "lengths-int64": (lambda x: dict(actual_seq_lengths=torch.tensor([3, 2])), "actual_seq_lengths"),
    "lengths-rank-2": (lambda x: dict(actual_seq_lengths=torch.tensor([[3, 2]], dtype=I32)), "actual_seq_lengths"),
    "lengths-empty": (lambda x: dict(actual_seq_lengths=torch.zeros(0, dtype=I32)), "actual_seq_lengths"),
    "indices-block-num": (lambda x: dict(ssm_state_indices=torch.tensor([0, 1, 2, 3, 8], dtype=I32)),
                          "ssm_state_indices"),
    "indices-negative": (lambda x: dict(ssm_state_indices=torch.tensor([0, 1, -1, 3, 4], dtype=I32)),
                         "ssm_state_indices"),
    "indices-repeated-in-a-sequence": (lambda x: dict(ssm_state_indices=torch.tensor([6, 6, 6, 3, 4], dtype=I32)),
                                       "ssm_state_indices"),
    "indices-repeated-across-sequences": (
        lambda x: dict(ssm_state_indices=torch.tensor([0, 1, 2, 3, 0], dtype=I32)), "ssm_state_indices"),
    "indices-int64": (lambda x: dict(ssm_state_indices=torch.arange(5)), "ssm_state_indices"),
    "indices-per-sequence": (lambda x: dict(ssm_state_indices=torch.tensor([0, 1], dtype=I32)),
                             "ssm_state_indices"),
    "g-shape": (lambda x: dict(g=x["g"][:, :2]), "g"),
    "g-bfloat16": (lambda x: dict(g=x["g"].bfloat16()), "g"),
    "g-other-device": (lambda x: dict(g=x["g"].to("meta")), "g"),
    "gk-per-value-shape": (lambda x: dict(gk=torch.zeros(5, 4, 6)), "gk"),
    "gk-bfloat16": (lambda x: dict(gk=x["gk"].bfloat16()), "gk"),
    "accepted-zero": (lambda x: dict(num_accepted_tokens=torch.tensor([0, 1], dtype=I32)), "num_accepted_tokens"),
    "accepted-above-length": (lambda x: dict(num_accepted_tokens=torch.tensor([3, 3], dtype=I32)),
                              "num_accepted_tokens"),
    "accepted-int64": (lambda x: dict(num_accepted_tokens=torch.tensor([1, 1])), "num_accepted_tokens"),
    "accepted-length": (lambda x: dict(num_accepted_tokens=torch.tensor([1], dtype=I32)), "num_accepted_tokens"),
    "scale-nan": (lambda x: dict(scale_value=float("nan")), "scale_value"),
    "scale-inf": (lambda x: dict(scale_value=float("inf")), "scale_value"),
    "scale-string": (lambda x: dict(scale_value="0.5"), "scale_value"),
    "scale-bool": (lambda x: dict(scale_value=True), "scale_value"),
    "scale-inf-in-float32": (lambda x: dict(scale_value=-1e39), "scale_value"),
    # the slab is written after the inputs are read: it may not overlap itself or any of them
    "state-expanded-rows": (lambda x: dict(state=x["state"][:1].expand(8, 4, 6, 8)), "state"),
    "key-view-of-a-state-row": (lambda x: dict(key=x["state"][7, :2, :5].transpose(0, 1)), "state"),
    "gk-view-of-the-state": (lambda x: _gk_in_a_float32_slab(x), "state"),
}


def _gk_in_a_float32_slab(x):
    """A float32 slab (BlockNum = 8, Nv = 4, Dv = 6, Dk = 8) whose row 0 also serves as gk (5, 4, 8)."""
    slab = x["state"].float()
    return dict(state=slab, gk=slab[0, :, :5].transpose(0, 1))


@pytest.mark.parametrize("case", list(ERRORS))
def test_contract_errors(request, case):
    x = make(rng_for(request), [3, 2], Dk=8, Dv=6, accepted=True, block_num=8)
    change, name = ERRORS[case]
    x.update(change(x))
    assert_refused(call, x, name)
