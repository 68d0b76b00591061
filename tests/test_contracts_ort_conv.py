"""com.microsoft.CausalConvWithState (deltarule.contracts.ort.causal_conv_with_state) against
onnxruntime 1.32's CPU kernel, where it runs the call, and an independent float64 loop over the
kernel taps written here, for everything (the schema's text: what the CPU kernel refuses, ndim
2 / 3, state_window and the CUDA-only extended attributes, is checked against it alone, and the
refusal is asserted so that an onnxruntime that runs one of them fails by name).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

from deltarule import ContractError
from deltarule.contracts import ort as dort

from conftest import rng_for
from test_contracts_ort import run_ort
from test_properties import examples

INPUTS = ("input", "weight", "bias", "past_state")
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3}      # relative to 1 + max |reference|


def oracle(x, w, b, past, *, ndim=1, activation="none", dilation=1, channels_last=0, state_window=0,
           state_update_capacity=0, state_length=0, state_channels_last=-1, input_channel_offset=0,
           input_channels=0):
    """The schema's convolution in float64, tap by tap: (output, present_state[, state_update])."""
    x = x.astype(np.float64)
    if input_channels:
        x = x[..., input_channel_offset: input_channel_offset + input_channels]
    B, C, k = x.shape[0], w.shape[0], w.shape[-1]
    if channels_last:                              # [B, L, d...] -> [B, C, L]
        trailing, L = x.shape[2:], x.shape[1]
        cf = np.moveaxis(x.reshape(B, L, C), 1, 2)
    else:
        trailing, L = None, x.shape[-1]
        cf = x
    SL = state_length or (k - 1) * dilation
    scl = channels_last if state_channels_last == -1 else state_channels_last
    state_of = (lambda s: np.moveaxis(s.reshape(B, SL, C), 1, 2)) if scl else (lambda s: s)
    back = ((lambda s: np.moveaxis(s, -1, 1).reshape((B, SL) + (trailing if channels_last and not input_channels
                                                               else (C,))))
            if scl else (lambda s: s))
    if past is None:
        prior = np.zeros(cf.shape[:-1] + (SL,))
    else:
        prior = state_of((past[state_window - 1] if state_window else past).astype(np.float64))
    v = np.concatenate([prior, cf], axis=-1)
    taps = w.astype(np.float64).reshape(C, k)
    out = np.zeros(cf.shape)
    bshape = (C,) + (1,) * (cf.ndim - 3)                     # over [B, C, mid...]
    for t in range(L):
        acc = np.zeros(cf.shape[:-1]) + (0 if b is None else b.astype(np.float64).reshape(bshape))
        for j in range(k):
            acc += taps[:, j].reshape(bshape) * v[..., SL + t - (k - 1 - j) * dilation]
        out[..., t] = acc / (1 + np.exp(-acc)) if activation in ("silu", "swish") else acc
    if channels_last:
        out = np.moveaxis(out, 1, 2).reshape((B, L) + trailing)
    if state_window:
        present = np.zeros((state_window,) + back(v[..., :SL]).shape)
        for j in range(state_window):
            end = L - state_window + j + 1
            if end > 0:
                present[j] = back(v[..., end: end + SL])
    else:
        present = back(v[..., L:])
    if not state_update_capacity:
        return out, present
    su = np.zeros((B, state_update_capacity, C))
    n = min(L, state_update_capacity)
    su[:, :n] = np.moveaxis(cf, 1, 2)[:, :n]
    return out, present, su


def peer(x: dict, attrs: dict):
    dtype = x["input"].dtype
    return run_ort("CausalConvWithState", [(n, x.get(n)) for n in INPUTS],
                   [("output", dtype), ("present_state", dtype)], **attrs)


def adapter(x: dict, attrs: dict):
    return dort.causal_conv_with_state(*(x.get(n) for n in INPUTS), **attrs)


def assert_close(got, want, dtype, what=("output", "present_state", "state_update")):
    assert len(got) == len(want)
    tol = TOL[np.dtype(dtype)]
    for name, g, r in zip(what, got, want):
        assert g.shape == r.shape, f"{name}: shape {g.shape}, expected {r.shape}"
        assert g.dtype == dtype, f"{name}: dtype {g.dtype}"
        if g.size:
            err = np.abs(g.astype(np.float64) - r).max() / (1 + np.abs(r).max())
            assert err <= tol, f"{name}: error {err:.3g}"


def inputs(rng, *, B=2, C=3, L=5, k=4, ndim=1, mid=(), dilation=1, channels_last=0, trailing=None, bias=True,
           past=True, dtype=np.float32, state_window=0, state_length=0, state_channels_last=-1, width=None):
    """Random inputs in the layout the attributes name (trailing: the channel axes of a
    channels-last input; width: a channel-selecting input's last extent)."""
    SL = state_length or (k - 1) * dilation
    normal = lambda *s: rng.standard_normal(s).astype(dtype)                    # noqa: E731
    if channels_last:
        trailing = trailing or (C,)
        C = math.prod(trailing)
        x = normal(B, L, *trailing) if width is None else normal(B, L, width)
    else:
        x = normal(B, C, *mid, L)
    scl = channels_last if state_channels_last == -1 else state_channels_last
    if scl:
        slot = (B, SL) + (trailing if channels_last and width is None else (C,))
    else:
        slot = (B, C) + tuple(mid) + (SL,)
    window = (state_window,) if state_window else ()
    return dict(input=x, weight=normal(C, 1, *(1,) * (ndim - 1), k), bias=normal(C) if bias else None,
                past_state=normal(*window, *slot) if past else None)


# ---------------------------------------------------------------------------
# what ORT's CPU kernel runs: against it and the float64 loop
# ---------------------------------------------------------------------------

@st.composite
def cpu_calls(draw):
    channels_last = draw(st.sampled_from([0, 1]))
    trailing = draw(st.sampled_from([None, (2, 2), (3, 1)])) if channels_last else None
    attrs = dict(activation=draw(st.sampled_from(["none", "silu", "swish"])), dilation=draw(st.integers(1, 3)),
                 channels_last=channels_last)
    x = inputs(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), B=draw(st.integers(0, 2)),
               C=draw(st.integers(0, 4)), L=draw(st.integers(0, 6)), k=draw(st.integers(1, 5)),
               dilation=attrs["dilation"], channels_last=channels_last, trailing=trailing,
               bias=draw(st.booleans()), past=draw(st.booleans()),
               dtype=draw(st.sampled_from([np.float32, np.float32, np.float16])))
    return x, attrs


@examples(60)
@given(call=cpu_calls())
def test_conv_matches_ort_cpu_and_float64(call):
    x, attrs = call
    note(f"attrs={attrs} shapes={ {n: None if a is None else a.shape for n, a in x.items()} }")
    event(f"channels_last {attrs['channels_last']}")
    event(f"dilation {attrs['dilation']}")
    got = adapter(x, attrs)
    dtype = x["input"].dtype
    assert_close(got, peer(x, attrs), dtype)
    assert_close(got, oracle(*(x[n] for n in INPUTS), **attrs), dtype)


def test_conv_present_state_is_exactly_the_inputs(request):
    """The state holds inputs, not results: the last (k - 1) * d positions bit for bit."""
    x = inputs(rng_for(request), L=9, k=3, dilation=2)
    _, present = adapter(x, dict(dilation=2))
    np.testing.assert_array_equal(present, x["input"][..., -4:])


def test_conv_torch_in_torch_out(request):
    x = inputs(rng_for(request), channels_last=1, trailing=(2, 3))
    got = adapter(x, dict(channels_last=1, activation="silu"))
    o, s = adapter({n: torch.from_numpy(a) for n, a in x.items()}, dict(channels_last=1, activation="silu"))
    assert isinstance(o, torch.Tensor) and isinstance(s, torch.Tensor)
    np.testing.assert_array_equal(o.numpy(), got[0])
    np.testing.assert_array_equal(s.numpy(), got[1])


def test_conv_bfloat16_matches_float64(request):
    """bfloat16 (the schema's type T allows it; ORT 1.32's CPU kernel has no bfloat16 kernel):
    against the float64 loop on the same bfloat16 values, one rounding of the result."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    ort = pytest.importorskip("onnxruntime")
    x = {n: a.astype(ml_dtypes.bfloat16) for n, a in inputs(rng_for(request), dilation=2).items()}
    got = adapter(x, dict(dilation=2, activation="silu"))
    want = oracle(*(x[n].astype(np.float32) for n in INPUTS), dilation=2, activation="silu")
    for g, r in zip(got, want):
        assert g.dtype == x["input"].dtype and g.shape == r.shape
        assert np.abs(g.astype(np.float64) - r).max() <= 1e-2 * (1 + np.abs(r).max())
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.NotImplemented):
        peer(x, dict(dilation=2))


# ---------------------------------------------------------------------------
# what ORT's CPU kernel refuses: the schema's text, against the float64 loop
# ---------------------------------------------------------------------------

@st.composite
def schema_calls(draw, feature: str):
    """Calls with ndim 2 / 3 ("ndim"), state_window ("window") or the extended attributes
    ("extended"), each with what the schema lets it combine with."""
    kw = dict(B=draw(st.integers(0, 2)), C=draw(st.integers(1, 4)), L=draw(st.integers(0, 6)),
              k=draw(st.integers(1, 4)), bias=draw(st.booleans()), past=draw(st.booleans()))
    attrs = dict(activation=draw(st.sampled_from(["none", "silu"])), dilation=draw(st.integers(1, 3)))
    if feature == "ndim":
        attrs["ndim"] = draw(st.sampled_from([2, 3]))
        kw["mid"] = tuple(draw(st.lists(st.integers(1, 3), min_size=attrs["ndim"] - 1, max_size=attrs["ndim"] - 1)))
        attrs["state_window"] = draw(st.sampled_from([0, 0, 2]))
    elif feature == "window":
        attrs["state_window"] = draw(st.integers(1, 8))
        attrs["channels_last"] = draw(st.sampled_from([0, 1]))
        if attrs["channels_last"]:
            kw["trailing"] = draw(st.sampled_from([(2,), (2, 2)]))
    else:
        attrs["channels_last"] = draw(st.sampled_from([0, 1]))
        attrs["state_channels_last"] = draw(st.sampled_from([-1, 0, 1]))
        attrs["state_length"] = draw(st.sampled_from([(kw["k"] - 1) * attrs["dilation"] + draw(st.integers(0, 3)), 0]))
        if attrs["channels_last"]:
            attrs["state_update_capacity"] = draw(st.integers(0, 8))
            if draw(st.booleans()):
                attrs["input_channels"] = kw["C"]
                attrs["input_channel_offset"] = draw(st.integers(0, 3))
                kw["width"] = attrs["input_channel_offset"] + kw["C"] + draw(st.integers(0, 2))
    for name in ("dilation", "channels_last", "state_window", "state_length", "state_channels_last"):
        if name in attrs:
            kw[name] = attrs[name]
    kw["ndim"] = attrs.get("ndim", 1)
    x = inputs(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), **kw)
    return x, attrs


@pytest.mark.parametrize("feature", ["ndim", "window", "extended"])
@examples(25)
@given(data=st.data())
def test_conv_schema_features_match_float64(feature, data):
    x, attrs = data.draw(schema_calls(feature))
    note(f"attrs={attrs} shapes={ {n: None if a is None else a.shape for n, a in x.items()} }")
    for name, value in attrs.items():
        event(f"{name} {value}")
    got = adapter(x, attrs)
    assert len(got) == (3 if attrs.get("state_update_capacity") else 2)
    assert_close(got, oracle(*(x[n] for n in INPUTS), **attrs), np.float32)


@pytest.mark.parametrize("ndim", [2, 3])
def test_conv_ndim_with_unit_non_causal_kernel_is_the_1d_conv_per_row(request, ndim):
    """ndim 2 / 3 with kernel extent 1 off the causal axis: every row along the causal axis is the
    ndim 1 convolution of that row (and its state row)."""
    mid = (2, 3)[: ndim - 1]
    x = inputs(rng_for(request), ndim=ndim, mid=mid, k=3, dilation=2)
    o, s = adapter(x, dict(ndim=ndim, dilation=2, activation="silu"))
    B, C = 2, 3
    rows = lambda a: np.moveaxis(a, 1, -2).reshape(-1, C, a.shape[-1])          # noqa: E731
    flat = dict(input=rows(x["input"]), weight=x["weight"].reshape(C, 1, 3), bias=x["bias"],
                past_state=rows(x["past_state"]))
    o1, s1 = adapter(flat, dict(dilation=2, activation="silu"))
    np.testing.assert_array_equal(rows(o), o1)
    np.testing.assert_array_equal(rows(s), s1)
    assert o.shape == x["input"].shape and s.shape == (B, C) + mid + (4,)


def test_conv_state_window_slots_and_zeros(request):
    """Slot j: the last SL inputs of the prefix ending at position L - W + j; slots j < W - L zero;
    slot W - 1 is the W = 0 state, and only slot W - 1 of past_state is read."""
    x = inputs(rng_for(request), L=3, k=3, state_window=5)
    _, s = adapter(x, dict(state_window=5))
    assert not s[:2].any()                                         # W - L = 2 slots before the call
    virtual = np.concatenate([x["past_state"][4], x["input"]], axis=-1)
    for j in range(2, 5):
        end = 3 - 5 + j + 1
        np.testing.assert_array_equal(s[j], virtual[..., end: end + 2])
    flat = dict(x, past_state=x["past_state"][4])
    o0, s0 = adapter(flat, {})
    x["past_state"][:4] = np.nan
    o, s = adapter(x, dict(state_window=5))
    np.testing.assert_array_equal(o, o0)
    np.testing.assert_array_equal(s[4], s0)


def test_conv_channel_selection_and_state_update(request):
    """input_channels of a [B, L, input_width] input from input_channel_offset; state_update the
    first min(L, capacity) selected input rows, zero rows after."""
    rng = rng_for(request)
    x = inputs(rng, L=3, C=4, channels_last=1, width=9, k=2)
    attrs = dict(channels_last=1, input_channel_offset=2, input_channels=4, state_update_capacity=5)
    o, s, su = adapter(x, attrs)
    assert o.shape == (2, 3, 4) and s.shape == (2, 1, 4) and su.shape == (2, 5, 4)
    np.testing.assert_array_equal(su[:, :3], x["input"][:, :, 2:6])
    assert not su[:, 3:].any()
    np.testing.assert_array_equal(s[:, 0], x["input"][:, -1, 2:6])


def test_conv_explicit_state_length_reads_the_trailing_history(request):
    """state_length > (k - 1) * d: the state keeps the last SL inputs; the convolution reads only
    its last (k - 1) * d, so the older positions do not change the output."""
    x = inputs(rng_for(request), k=3, state_length=6, channels_last=1)
    o, s = adapter(x, dict(channels_last=1, state_length=6))
    x["past_state"][:, :4] = 1e6
    o2, s2 = adapter(x, dict(channels_last=1, state_length=6))
    np.testing.assert_array_equal(o, o2)
    assert s.shape == (2, 6, 3)


REFUSED_ON_CPU = {                   # what ORT 1.32's CPU kernel refuses (CUDA only): attributes, input shape
    "ndim-2": (dict(ndim=2), dict(ndim=2, mid=(2,))),
    "ndim-3": (dict(ndim=3), dict(ndim=3, mid=(2, 2))),
    "state_window": (dict(state_window=2), dict(state_window=2)),
    "state_length": (dict(state_length=5), dict(state_length=5)),
    "state_channels_last": (dict(state_channels_last=1), dict(state_channels_last=1)),
    "input_channels": (dict(channels_last=1, input_channels=3), dict(channels_last=1, width=3)),
    "state_update_capacity": (dict(channels_last=1, state_update_capacity=2), dict(channels_last=1)),
}


@pytest.mark.parametrize("attrs, shape", REFUSED_ON_CPU.values(), ids=REFUSED_ON_CPU.keys())
def test_ort_cpu_refuses_what_is_checked_against_the_schema(request, attrs, shape):
    """The features above are checked against the schema's text because onnxruntime 1.32's CPU
    kernel refuses them. A release that runs one fails here by name: compare with it then."""
    ort = pytest.importorskip("onnxruntime")
    x = inputs(rng_for(request), **shape)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail):
        peer(x, attrs)
    assert len(adapter(x, attrs)) == (3 if attrs.get("state_update_capacity") else 2)


# ---------------------------------------------------------------------------
# contract errors
# ---------------------------------------------------------------------------

CONV_ERRORS = {
    # (the input layout, attributes, argument named)
    "ndim-4": (dict(), dict(ndim=4), "ndim"),
    "activation-relu": (dict(), dict(activation="relu"), "activation"),
    "dilation-0": (dict(), dict(dilation=0), "dilation"),
    "channels_last-2": (dict(), dict(channels_last=2), "channels_last"),
    "channels_last-with-ndim-2": (dict(ndim=2, mid=(2,)), dict(ndim=2, channels_last=1), "channels_last"),
    "window-9": (dict(), dict(state_window=9), "state_window"),
    "capacity-9": (dict(channels_last=1), dict(channels_last=1, state_update_capacity=9), "state_update_capacity"),
    "state_channels_last-2": (dict(), dict(state_channels_last=2), "state_channels_last"),
    "ndim-2-kernel-3x3": (dict(ndim=2, mid=(4,)), dict(ndim=2), "ndim"),
    "extended-with-rank-4": (dict(ndim=2, mid=(2,)), dict(ndim=2, state_length=5), "state_length"),
    "extended-with-window": (dict(state_window=2), dict(state_window=2, state_channels_last=0),
                             "state_channels_last"),
    "offset-without-channels": (dict(channels_last=1), dict(channels_last=1, input_channel_offset=1),
                                "input_channel_offset"),
    "selection-channels-first": (dict(), dict(input_channels=3), "input_channels"),
    "selection-past-the-end": (dict(channels_last=1, width=4), dict(channels_last=1, input_channels=3,
                                                                     input_channel_offset=2), "input_channels"),
    "capacity-channels-first": (dict(), dict(state_update_capacity=2), "state_update_capacity"),
    "state_length-too-short": (dict(), dict(state_length=2), "state_length"),
}


@pytest.mark.parametrize("shape, attrs, name", CONV_ERRORS.values(), ids=CONV_ERRORS.keys())
def test_conv_attribute_errors(request, shape, attrs, name):
    x = inputs(rng_for(request), **shape)
    if name == "ndim" and attrs.get("ndim") == 2:
        x["weight"] = np.zeros((3, 1, 3, 4), np.float32)          # a 3-wide kernel on the non-causal axis
    with pytest.raises(ContractError) as info:
        adapter(x, attrs)
    assert info.value.argument == name, info.value


@pytest.mark.parametrize("case, change, name", [
    ("weight-rank-2", dict(weight=np.zeros((3, 4), np.float32)), "weight"),
    ("weight-channels", dict(weight=np.zeros((4, 1, 4), np.float32)), "weight"),
    ("weight-grouped", dict(weight=np.zeros((3, 2, 4), np.float32)), "weight"),
    ("weight-float16", dict(weight=np.zeros((3, 1, 4), np.float16)), "weight"),
    ("bias-length", dict(bias=np.zeros(1, np.float32)), "bias"),
    ("past-length", dict(past_state=np.zeros((2, 3, 2), np.float32)), "past_state"),
    ("past-batch", dict(past_state=np.zeros((1, 3, 3), np.float32)), "past_state"),
    ("past-float16", dict(past_state=np.zeros((2, 3, 3), np.float16)), "past_state"),
    ("input-rank-2", dict(input=np.zeros((2, 5), np.float32)), "input"),
    ("input-float64", dict(input=np.zeros((2, 3, 5))), "input"),
])
def test_conv_input_errors(request, case, change, name):
    x = inputs(rng_for(request))
    x.update(change)
    with pytest.raises(ContractError) as info:
        adapter(x, {})
    assert info.value.argument == name, info.value
