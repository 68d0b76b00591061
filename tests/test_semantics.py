"""Semantics the test.json comparison alone does not pin down: varlen against
per-sequence calls, slab rows, chunk-size invariance, gate equivalences, and
random shapes (hypothesis). Each test names the backend it checks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deltarule
from deltarule import cases
from deltarule.tools.check import expected
from deltarule.kernels.torch import chunked as chunked_module

from conftest import CPU, rel

CASE = {"name": "semantics", "seed": 11, "B": 2, "T": 70, "Hq": 2, "Hk": 2, "Hv": 4, "K": 20, "V": 12}


def make(**overrides):
    return cases.make_inputs({**CASE, **overrides})


def slice_args(args, row, start, end, state):
    """The dense single-sequence call equivalent to one varlen sequence."""
    out = dict(args)
    for name in ("q", "k", "v", "g", "gk", "beta", "erase", "write"):
        if name in out:
            out[name] = out[name][row:row + 1, start:end]
    for name in ("cu_seqlens", "seq_lens", "state_indices"):
        out.pop(name, None)
    out["initial_state"] = state
    return out


@pytest.mark.parametrize("backend", [CPU, "torch", "reference"])
@pytest.mark.parametrize("decay,update", [("g", "beta"), ("gk", "erase_write")], ids=["gdn", "gdn2"])
def test_cu_seqlens_equals_per_sequence_calls(backend, decay, update):
    cu = [0, 0, 17, 17, 50, 45, 70]                    # empty, decreasing and normal sequences
    args = make(B=1, decay=decay, update=update, initial_state=True, cu_seqlens=cu)
    args["initial_state"] = torch.randn(len(cu) - 1, 4, 20, 12)
    o, state = deltarule.linear_attention(**args, backend=backend)
    want_o = torch.zeros_like(o)                        # spans overlap at 45..50: the later one writes
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        e = max(s, e)
        o_n, s_n = deltarule.linear_attention(
            **slice_args(args, 0, s, e, args["initial_state"][n:n + 1]), backend="reference")
        want_o[:, s:e] = o_n
        assert rel(state[n:n + 1], s_n) < 5e-5, n
        if e == s:
            assert torch.equal(state[n], args["initial_state"][n])   # copied through
    assert rel(o, want_o) < 5e-5


@pytest.mark.parametrize("backend", [CPU, "torch", "reference"])
def test_seq_lens_ignores_padding_tokens(backend):
    lens = [70, 0]
    args = make(seq_lens=lens, initial_state=True)
    for name in ("q", "k", "v", "g", "beta"):
        args[name] = args[name].clone()
        args[name][1] = float("nan")                    # row 1 is all padding
    o, state = deltarule.linear_attention(**args, backend=backend)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert torch.equal(state[1], args["initial_state"][1])
    o0, s0 = deltarule.linear_attention(**slice_args(args, 0, 0, 70, args["initial_state"][:1]),
                                        backend="reference")
    assert rel(o[:1], o0) < 5e-5 and rel(state[:1], s0) < 5e-5


@pytest.mark.parametrize("backend", [CPU, "torch", "reference"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_slab_rows_match_dense_call_and_others_untouched(backend, layout):
    idx = [5, -1, 2]
    args = make(B=3, T=9, initial_state=True, state_indices=idx, num_slots=7, state_layout=layout)
    slab = args["initial_state"]
    before = slab.clone()
    dense = dict(args, initial_state=before[[5, 0, 2]].clone(), state_indices=None)
    o_dense, s_dense = deltarule.linear_attention(**dense, backend=backend)
    o, out = deltarule.linear_attention(**args, backend=backend)
    assert out is slab
    for n, row in enumerate(idx):
        if row >= 0:
            assert rel(slab[row], s_dense[n]) < 1e-6
            assert rel(o[n], o_dense[n]) < 1e-6
    for row in (0, 1, 3, 4, 6):
        assert torch.equal(slab[row], before[row])       # bit-identical
    assert torch.equal(o[1], torch.zeros_like(o[1]))    # padding sequence


@pytest.mark.parametrize("backend", [CPU, "torch", "reference"])
def test_slab_all_padding_touches_nothing(backend):
    args = make(B=2, T=4, initial_state=True, state_indices=[-1, -1], num_slots=3)
    before = args["initial_state"].clone()
    o, slab = deltarule.linear_attention(**args, backend=backend)
    assert torch.equal(slab, before)
    assert torch.equal(o, torch.zeros_like(o))


@pytest.mark.parametrize("decay", ["g", "gk", "g+gk"])
def test_torch_chunk_size_is_only_a_hint(decay):
    args = make(T=130, decay=decay, initial_state=True)
    ref_o, ref_s = deltarule.linear_attention(**args, chunk_size=64, backend="torch")
    for chunk in (1, 5, 16, 33, 128, 1000):
        o, s = deltarule.linear_attention(**dict(args, chunk_size=chunk), backend="torch")
        assert rel(o, ref_o) < 1e-5 and rel(s, ref_s) < 1e-5, chunk


def test_torch_chunk_groups_do_not_change_the_result(monkeypatch):
    """One chunk per group (tiny memory budget) equals the default grouping."""
    args = make(T=200, decay="gk", update="erase_write", initial_state=True)
    ref_o, ref_s = deltarule.linear_attention(**args, chunk_size=16, backend="torch")
    monkeypatch.setattr(chunked_module, "GROUP_ELEMENTS", 1)
    o, s = deltarule.linear_attention(**args, chunk_size=16, backend="torch")
    assert rel(o, ref_o) < 1e-6 and rel(s, ref_s) < 1e-6


@pytest.mark.parametrize("backend", [CPU, "torch", "reference"])
@pytest.mark.parametrize("T", [3, 70])
def test_erase_write_equal_to_beta_reproduce_scalar_path(backend, T):
    args = make(T=T, decay="gk", initial_state=True)
    beta = args["beta"]
    channel = dict(args, beta=None, erase=beta[..., None].expand(-1, -1, -1, 20).contiguous(),
                   write=beta[..., None].expand(-1, -1, -1, 12).contiguous())
    o1, s1 = deltarule.linear_attention(**args, backend=backend)
    o2, s2 = deltarule.linear_attention(**channel, backend=backend)
    assert rel(o2, o1) < 1e-6 and rel(s2, s1) < 1e-6


def test_torch_long_strong_per_key_decay_stays_finite():
    """T = 8192 at about -5 per token and key: no inf / NaN, within tolerance."""
    args = cases.make_inputs({"name": "strong", "seed": 3, "B": 1, "T": 8192, "Hq": 1, "Hk": 1, "Hv": 1,
                              "K": 16, "V": 16, "decay": "g+gk", "decay_range": [-3.0, -2.0]})
    o, s = deltarule.linear_attention(**args, backend="torch")
    ref_o, ref_s = expected(args)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel(o, ref_o) < 5e-5 and rel(s, ref_s) < 5e-5


@st.composite
def random_case(draw):
    rule = draw(st.sampled_from(["linear", "gated", "delta", "gated_delta"]))
    gqa = draw(st.booleans())
    Hk = draw(st.integers(1, 3))
    if gqa:
        Hv, Hq = Hk, Hk * draw(st.integers(1, 3))
    else:
        Hq, Hv = Hk, Hk * draw(st.integers(1, 3))
    case = {
        "name": "hypothesis", "seed": draw(st.integers(0, 2**16)), "rule": rule,
        "B": draw(st.integers(1, 2)), "T": draw(st.integers(0, 90)),
        "Hq": Hq, "Hk": Hk, "Hv": Hv, "K": draw(st.integers(1, 40)), "V": draw(st.integers(1, 40)),
        "initial_state": draw(st.booleans()), "state_layout": draw(st.sampled_from(["kv", "vk"])),
        "chunk_size": draw(st.sampled_from([1, 8, 16, 64, 100])),
    }
    if rule in ("gated", "gated_delta"):
        case["decay"] = draw(st.sampled_from(["g", "gk", "g+gk"]))
        case["decay_range"] = draw(st.sampled_from([[-1.0, -0.01], [-6.0, -2.0]]))
    if rule in ("delta", "gated_delta"):
        case["update"] = draw(st.sampled_from(["beta", "erase_write"]))
    if draw(st.booleans()) and case["B"] == 1:
        T = case["T"]
        cuts = sorted(draw(st.lists(st.integers(0, T), min_size=0, max_size=3)))
        case["cu_seqlens"] = [0, *cuts, T]
    return case


@settings(max_examples=40, deadline=None)
@given(random_case())
def test_torch_random_shapes_match_reference(case):
    args = cases.make_inputs(case)
    o, s = deltarule.linear_attention(**args, backend="torch")
    ref_o, ref_s = expected(args)
    for got, ref in ((o, ref_o), (s, ref_s)):
        if not ref.any():                   # no tokens, no initial state: exactly zero
            assert not got.any()
        else:
            assert rel(got, ref) < 5e-5


@pytest.mark.parametrize("backend", [CPU, "torch", "reference"])
@pytest.mark.parametrize("T", [0, 1, 70])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_initial_state_is_read_only_without_a_slab(backend, T, layout):
    args = make(T=T, initial_state=True, state_layout=layout)
    before = args["initial_state"].clone()
    _, state = deltarule.linear_attention(**args, backend=backend)
    assert torch.equal(args["initial_state"], before)
    assert state.data_ptr() != args["initial_state"].data_ptr()
    if T == 0:
        assert torch.equal(state, before)
