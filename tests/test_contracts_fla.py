"""deltarule.contracts.fla against flash-linear-attention's own PyTorch references.

fla's Triton kernels need a GPU; its naive recurrent references
(`naive_recurrent_gated_delta_rule`, `naive_recurrent_kda`,
`naive_recurrent_gdn2`) and its torch gate references (`naive_gdn_gate`,
`naive_kda_gate`, `naive_kda_lowerbound_gate`) run on CPU, in float32, and are
the oracle here. Features the naive references lack (GVA for GDN / GDN-2,
varlen, in-kernel l2norm, beta sigmoid, V-first state) are composed around them
exactly as fla's kernels define them.

Error floor: both sides accumulate in float32, the adapters measure ~1e-7
relative error against the naive references; the bound is 1e-5 (docs/design.md
section 7), and `test_bound_discriminates` checks that the comparisons fail on
a wrong mapping.
"""

import inspect
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("triton", reason="fla-core imports triton at import time: pip install triton")
fla = pytest.importorskip(
    "fla", reason="the fla adapter is checked against flash-linear-attention: pip install fla-core einops packaging")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gdn
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused_gdn
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.gdn2 import chunk_gdn2 as fla_chunk_gdn2
    from fla.ops.gdn2 import fused_recurrent_gdn2 as fla_fused_gdn2
    from fla.ops.gdn2.naive import naive_recurrent_gdn2
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    from fla.ops.kda import fused_recurrent_kda as fla_fused_kda
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

import deltarule
from deltarule.contracts import fla as dfla

from conftest import rel
from test_properties import examples

TOL = 1e-5
F32 = torch.float32


def close(got, ref, tol=TOL):
    (o, s), (o_ref, s_ref) = got, ref
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert rel(o, o_ref) < tol, rel(o, o_ref)
    if s_ref is None:
        assert s is None
    else:
        assert s.dtype == F32 and s.shape == s_ref.shape
        assert rel(s, s_ref) < tol, rel(s, s_ref)


def inputs(seed, B=2, T=37, H=2, HV=None, K=16, V=32, normalize=True):
    gen = torch.Generator().manual_seed(seed)
    HV = HV or H
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    if normalize:
        k = F.normalize(k, dim=-1)
    return dict(
        q=q, k=k, v=v,
        g=F.logsigmoid(r(B, T, HV) + 2.0),          # scalar log decay
        gk=F.logsigmoid(r(B, T, HV, K) + 3.0),      # per-key log decay
        beta=u(B, T, HV),
        b=u(B, T, HV, K), w=u(B, T, HV, V),         # GDN-2 erase / write
        h0=r(B, HV, K, V),
        raw=r(B, T, HV), raw_k=r(B, T, HV, K),      # raw gate projections
        A_log=torch.log(u(HV) * 2 + 0.5), dt_bias=r(HV), dt_bias_k=r(HV * K),
        logits=r(B, T, HV) * 2,
        gen=gen,
    )


# --- references composed from fla's naive functions ---------------------------------------

def expand(x, HV):
    """fla's GVA: value head h reads q/k head h // (HV // H)."""
    return x.repeat_interleave(HV // x.shape[2], dim=2)


def fla_l2norm(x):
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def ref_gdn(q, k, v, g, beta, scale=None, h0=None, final=True):
    HV = v.shape[2]
    return naive_recurrent_gated_delta_rule(expand(q, HV), expand(k, HV), v, beta, g, scale=scale,
                                            initial_state=h0, output_final_state=final)


def ref_kda(q, k, v, g, beta, scale=None, h0=None, final=True):
    return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=final)


def ref_gdn2(q, k, v, g, b, w, scale=None, h0=None, final=True):
    HV = v.shape[2]
    return naive_recurrent_gdn2(expand(q, HV), expand(k, HV), v, g, b, w, scale=scale,
                                initial_state=h0, output_final_state=final)


def ref_varlen(ref, cu, q, k, v, *gates, h0=None, **kw):
    """Packed B=1 varlen through a fixed-length reference, one sequence at a time."""
    outs, states = [], []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = lambda x, s=s, e=e: x[:, s:e]  # noqa: E731
        o, st = ref(sl(q), sl(k), sl(v), *map(sl, gates), h0=None if h0 is None else h0[n:n + 1], **kw)
        outs.append(o)
        states.append(st)
    return torch.cat(outs, 1), torch.cat(states, 0)


# --- the contract: signatures --------------------------------------------------------------

@pytest.mark.parametrize("pair", [
    (fla_chunk_gdn, dfla.chunk_gated_delta_rule), (fla_fused_gdn, dfla.fused_recurrent_gated_delta_rule),
    (fla_chunk_kda, dfla.chunk_kda), (fla_fused_kda, dfla.fused_recurrent_kda),
    (fla_chunk_gdn2, dfla.chunk_gdn2), (fla_fused_gdn2, dfla.fused_recurrent_gdn2),
], ids=lambda p: p[1].__name__)
def test_signature_is_flas(pair):
    """Names, order, kinds and defaults of every parameter are fla's."""
    theirs, ours = (
        [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()] for f in pair)
    assert ours == theirs


# --- Gated DeltaNet --------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["chunk", "fused"])
@pytest.mark.parametrize("HV", [2, 4], ids=["MHA", "GVA"])
def test_gdn_matches_naive(fn, HV):
    x = inputs(1, H=2, HV=HV)
    q, k, v, g, beta, h0 = x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"]
    ref = ref_gdn(q, k, v, g, beta, h0=h0)
    if fn == "chunk":
        got = dfla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    else:
        got = dfla.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                                    output_final_state=True)
    close(got, ref)
    # no initial state, no final state, explicit scale
    got = dfla.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3)
    close(got, ref_gdn(q, k, v, g, beta, scale=0.3, final=False))


def test_gdn_fused_optional_gates():
    """fused_recurrent_gated_delta_rule: beta defaults to ones, g optional, gk per-key, g + gk together."""
    x = inputs(2)
    q, k, v, g, gk, beta = x["q"], x["k"], x["v"], x["g"], x["gk"], x["beta"]
    ones = torch.ones_like(beta)
    close(dfla.fused_recurrent_gated_delta_rule(q, k, v, g=g, output_final_state=True),
          ref_gdn(q, k, v, g, ones))
    close(dfla.fused_recurrent_gated_delta_rule(q, k, v, beta=beta, output_final_state=True),
          ref_gdn(q, k, v, torch.zeros_like(g), beta))
    close(dfla.fused_recurrent_gated_delta_rule(q, k, v, gk=gk, beta=beta, output_final_state=True),
          ref_kda(q, k, v, gk, beta))
    close(dfla.fused_recurrent_gated_delta_rule(q, k, v, g=g, gk=gk, beta=beta, output_final_state=True),
          ref_kda(q, k, v, gk + g[..., None], beta))


@pytest.mark.parametrize("fn", ["chunk", "fused"])
def test_gdn_gate_l2norm_sigmoid_in_kernel(fn):
    x = inputs(3, H=2, HV=4, normalize=False)
    q, k, v, h0 = x["q"], x["k"], x["v"], x["h0"]
    raw, A_log, dt_bias, logits = x["raw"], x["A_log"], x["dt_bias"], x["logits"]
    f = dfla.chunk_gated_delta_rule if fn == "chunk" else dfla.fused_recurrent_gated_delta_rule
    kw = dict(g=raw, beta=logits, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, A_log=A_log, use_beta_sigmoid_in_kernel=True)
    qn, kn = fla_l2norm(q), fla_l2norm(k)
    for bias in (dt_bias, None):
        got = f(q, k, v, dt_bias=bias, **kw)
        close(got, ref_gdn(qn, kn, v, naive_gdn_gate(raw, A_log, bias), torch.sigmoid(logits), h0=h0))
    got = f(q, k, v, dt_bias=dt_bias, allow_neg_eigval=True, **kw)
    close(got, ref_gdn(qn, kn, v, naive_gdn_gate(raw, A_log, dt_bias), 2 * torch.sigmoid(logits), h0=h0))


def test_gdn_fused_gate_in_kernel_with_gk():
    """use_gate_in_kernel acts on g only; gk stays a log decay (fla's fused kernel)."""
    x = inputs(4)
    q, k, v, gk, beta = x["q"], x["k"], x["v"], x["gk"], x["beta"]
    raw, A_log, dt_bias = x["raw"], x["A_log"], x["dt_bias"]
    got = dfla.fused_recurrent_gated_delta_rule(q, k, v, g=raw, gk=gk, beta=beta, output_final_state=True,
                                                use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    close(got, ref_kda(q, k, v, gk + naive_gdn_gate(raw, A_log, dt_bias)[..., None], beta))


# --- KDA -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["chunk", "fused"])
@pytest.mark.parametrize("HV", [2, 4], ids=["MHA", "GVA"])
def test_kda_matches_naive(fn, HV):
    x = inputs(5, H=2, HV=HV)
    q, k, v, gk, beta, h0 = x["q"], x["k"], x["v"], x["gk"], x["beta"], x["h0"]
    f = dfla.chunk_kda if fn == "chunk" else dfla.fused_recurrent_kda
    close(f(q, k, v, gk, beta, initial_state=h0, output_final_state=True), ref_kda(q, k, v, gk, beta, h0=h0))
    close(f(q, k, v, gk, beta), ref_kda(q, k, v, gk, beta, final=False))


@pytest.mark.parametrize("fn", ["chunk", "fused"])
def test_kda_gate_l2norm_sigmoid_in_kernel(fn):
    x = inputs(6, H=2, HV=4, normalize=False)
    q, k, v, h0 = x["q"], x["k"], x["v"], x["h0"]
    raw, A_log, dt_bias, logits = x["raw_k"], x["A_log"], x["dt_bias_k"], x["logits"]
    f = dfla.chunk_kda if fn == "chunk" else dfla.fused_recurrent_kda
    qn, kn = fla_l2norm(q), fla_l2norm(k)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    for bias in (dt_bias, None, dt_bias.view(4, -1)):
        got = f(q, k, v, raw, logits, A_log=A_log, dt_bias=bias, **kw)
        gate = naive_kda_gate(raw, A_log, None if bias is None else bias.reshape(-1))
        close(got, ref_kda(qn, kn, v, gate, torch.sigmoid(logits), h0=h0))
    # fla's bounded gate: lower_bound * sigmoid(exp(A_log) * (g + dt_bias)); A_log may be None
    for a in (A_log, None):
        got = f(q, k, v, raw, logits, A_log=a, dt_bias=dt_bias, lower_bound=-3.0, allow_neg_eigval=True, **kw)
        gate = naive_kda_lowerbound_gate(raw, a, dt_bias, lower_bound=-3.0)
        close(got, ref_kda(qn, kn, v, gate, 2 * torch.sigmoid(logits), h0=h0))


def test_kda_gate_options_ignored_without_gate_in_kernel():
    """As in fla, A_log / dt_bias / lower_bound do nothing unless use_gate_in_kernel=True."""
    x = inputs(7)
    q, k, v, gk, beta = x["q"], x["k"], x["v"], x["gk"], x["beta"]
    got = dfla.chunk_kda(q, k, v, gk, beta, A_log=x["A_log"], dt_bias=x["dt_bias_k"], lower_bound=-2.0,
                         output_final_state=True)
    close(got, ref_kda(q, k, v, gk, beta))


# --- GDN-2 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", ["chunk", "fused"])
@pytest.mark.parametrize("HV", [2, 4], ids=["MHA", "GVA"])
def test_gdn2_matches_naive(fn, HV):
    x = inputs(8, H=2, HV=HV)
    q, k, v, gk, b, w, h0 = x["q"], x["k"], x["v"], x["gk"], x["b"] * 2, x["w"], x["h0"]
    f = dfla.chunk_gdn2 if fn == "chunk" else dfla.fused_recurrent_gdn2
    close(f(q, k, v, gk, b, w, initial_state=h0, output_final_state=True),
          ref_gdn2(q, k, v, gk, b, w, h0=h0))
    close(f(q, k, v, gk, b, w, scale=0.5), ref_gdn2(q, k, v, gk, b, w, scale=0.5, final=False))


@pytest.mark.parametrize("fn", ["chunk", "fused"])
def test_gdn2_gate_l2norm_in_kernel(fn):
    x = inputs(9, normalize=False)
    q, k, v, b, w = x["q"], x["k"], x["v"], x["b"], x["w"]
    raw, A_log, dt_bias = x["raw_k"], x["A_log"], x["dt_bias_k"]
    f = dfla.chunk_gdn2 if fn == "chunk" else dfla.fused_recurrent_gdn2
    qn, kn = fla_l2norm(q), fla_l2norm(k)
    got = f(q, k, v, raw, b, w, A_log=A_log, dt_bias=dt_bias, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    close(got, ref_gdn2(qn, kn, v, naive_kda_gate(raw, A_log, dt_bias), b, w))
    got = f(q, k, v, raw, b, w, A_log=A_log, dt_bias=dt_bias, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-4.0)
    close(got, ref_gdn2(qn, kn, v, naive_kda_lowerbound_gate(raw, A_log, dt_bias, lower_bound=-4.0), b, w))


def test_gdn2_reduces_to_kda():
    x = inputs(10, H=2, HV=4)
    q, k, v, gk, beta = x["q"], x["k"], x["v"], x["gk"], x["beta"]
    bb, ww = (beta[..., None].expand(*beta.shape, n).contiguous() for n in (16, 32))
    close(dfla.fused_recurrent_gdn2(q, k, v, gk, bb, ww, output_final_state=True),
          dfla.fused_recurrent_kda(q, k, v, gk, beta, output_final_state=True))


# --- varlen, state layout ---------------------------------------------------------------------

CU = torch.tensor([0, 9, 9, 40, 70])       # 4 sequences, one empty


@pytest.mark.parametrize("fn", ["chunk", "fused"])
@pytest.mark.parametrize("family", ["gdn", "kda", "gdn2"])
def test_varlen(family, fn):
    x = inputs(11, B=1, T=70, H=2, HV=4, K=16, V=8)
    q, k, v, h0 = x["q"], x["k"], x["v"], torch.randn(4, 4, 16, 8, generator=x["gen"])
    if family == "gdn":
        gates = (x["g"], x["beta"])
        ref = ref_varlen(ref_gdn, CU, q, k, v, *gates, h0=h0)
        f = dfla.chunk_gated_delta_rule if fn == "chunk" else (
            lambda *a, **kw: dfla.fused_recurrent_gated_delta_rule(*a[:3], g=a[3], beta=a[4], **kw))
    elif family == "kda":
        gates = (x["gk"], x["beta"])
        ref = ref_varlen(ref_kda, CU, q, k, v, *gates, h0=h0)
        f = dfla.chunk_kda if fn == "chunk" else dfla.fused_recurrent_kda
    else:
        gates = (x["gk"], x["b"], x["w"])
        ref = ref_varlen(ref_gdn2, CU, q, k, v, *gates, h0=h0)
        f = dfla.chunk_gdn2 if fn == "chunk" else dfla.fused_recurrent_gdn2
    got = f(q, k, v, *gates, initial_state=h0, output_final_state=True, cu_seqlens=CU)
    close(got, ref)
    assert torch.equal(got[1][1], h0[1])            # the empty sequence passes its state through


@pytest.mark.parametrize("fn", ["chunk_kda", "fused_recurrent_kda", "chunk_gated_delta_rule",
                                "fused_recurrent_gdn2"])
def test_state_v_first(fn):
    x = inputs(12, H=2, HV=4)
    q, k, v, h0 = x["q"], x["k"], x["v"], x["h0"]
    gates = {"chunk_kda": (x["gk"], x["beta"]), "fused_recurrent_kda": (x["gk"], x["beta"]),
             "chunk_gated_delta_rule": (x["g"], x["beta"]), "fused_recurrent_gdn2": (x["gk"], x["b"], x["w"])}[fn]
    f = getattr(dfla, fn)
    o_kv, s_kv = f(q, k, v, *gates, initial_state=h0, output_final_state=True)
    o_vk, s_vk = f(q, k, v, *gates, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                   state_v_first=True)
    assert s_vk.shape == (2, 4, 32, 16)
    assert rel(o_vk, o_kv) < TOL and rel(s_vk.transpose(-1, -2), s_kv) < TOL
    with pytest.warns(DeprecationWarning):
        _, s_dep = f(q, k, v, *gates, initial_state=h0.transpose(-1, -2).contiguous(),
                         output_final_state=True, transpose_state_layout=True)
    assert torch.equal(s_dep, s_vk)


# --- chunk vs fused_recurrent, dtypes, the bound ---------------------------------------------

def test_chunk_and_fused_agree():
    x = inputs(13, B=2, T=70, H=2, HV=4, normalize=False)
    q, k, v, h0 = x["q"], x["k"], x["v"], x["h0"]
    common = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    pairs = [
        (dfla.chunk_gated_delta_rule(q, k, v, x["g"], x["beta"], **common),
         dfla.fused_recurrent_gated_delta_rule(q, k, v, g=x["g"], beta=x["beta"], **common)),
        (dfla.chunk_gated_delta_rule(q, k, v, x["raw"], x["logits"], use_gate_in_kernel=True, A_log=x["A_log"],
                                     dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True, chunk_size=16,
                                     **common),
         dfla.fused_recurrent_gated_delta_rule(q, k, v, g=x["raw"], beta=x["logits"], use_gate_in_kernel=True,
                                               A_log=x["A_log"], dt_bias=x["dt_bias"],
                                               use_beta_sigmoid_in_kernel=True, **common)),
        (dfla.chunk_kda(q, k, v, x["raw_k"], x["beta"], use_gate_in_kernel=True, A_log=x["A_log"],
                        dt_bias=x["dt_bias_k"], chunk_size=32, **common),
         dfla.fused_recurrent_kda(q, k, v, x["raw_k"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias_k"],
                                  use_gate_in_kernel=True, **common)),
        (dfla.chunk_kda(q, k, v, x["raw_k"], x["logits"], use_gate_in_kernel=True, A_log=x["A_log"],
                        safe_gate=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, **common),
         dfla.fused_recurrent_kda(q, k, v, x["raw_k"], x["logits"], A_log=x["A_log"], lower_bound=-5.0,
                                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, **common)),
        (dfla.chunk_gdn2(q, k, v, x["gk"], x["b"], x["w"], **common),
         dfla.fused_recurrent_gdn2(q, k, v, x["gk"], x["b"], x["w"], **common)),
    ]
    for (o1, s1), (o2, s2) in pairs:
        assert rel(o1, o2) < TOL and rel(s1, s2) < TOL


def test_dtypes():
    """o: q's dtype for chunk_*, v's for fused_recurrent_*; the final state is float32."""
    x = inputs(14)
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    o, s = dfla.chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(),
                                       initial_state=x["h0"].bfloat16(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == F32
    o_ref, s_ref = ref_gdn(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(),
                           h0=x["h0"].bfloat16().float())
    assert rel(o.float(), o_ref) < 1e-2 and rel(s, s_ref) < 1e-2
    # mixed input dtypes: read in float32, like fla's kernels
    o, _ = dfla.chunk_gated_delta_rule(q.half(), k.half(), v, g, beta)
    assert o.dtype == torch.float16
    o, _ = dfla.fused_recurrent_gated_delta_rule(q.half(), k.half(), v, g=g, beta=beta)
    assert o.dtype == F32
    assert rel(o, ref_gdn(q.half().float(), k.half().float(), v, g, beta, final=False)[0]) < TOL


def test_initial_state_untouched_and_not_returned():
    x = inputs(15)
    h0 = x["h0"]
    keep = h0.clone()
    _, s = dfla.fused_recurrent_kda(x["q"][:, :0], x["k"][:, :0], x["v"][:, :0], x["gk"][:, :0],
                                    x["beta"][:, :0], initial_state=h0, output_final_state=True)
    assert torch.equal(s, keep) and s.untyped_storage().data_ptr() != h0.untyped_storage().data_ptr()
    dfla.chunk_kda(x["q"], x["k"], x["v"], x["gk"], x["beta"], initial_state=h0, output_final_state=True)
    assert torch.equal(h0, keep)


def test_bound_discriminates():
    """The 1e-5 comparisons fail on a wrong mapping: a missed sigmoid, l2norm, gate or head mapping."""
    x = inputs(16, H=2, HV=4, normalize=False)
    q, k, v = x["q"], x["k"], x["v"]
    o, _ = dfla.chunk_gated_delta_rule(q, k, v, x["g"], x["logits"], use_beta_sigmoid_in_kernel=True,
                                       use_qk_l2norm_in_kernel=True)
    good = ref_gdn(fla_l2norm(q), fla_l2norm(k), v, x["g"], torch.sigmoid(x["logits"]), final=False)[0]
    assert rel(o, good) < TOL
    for wrong in (
        ref_gdn(fla_l2norm(q), fla_l2norm(k), v, x["g"], 2 * torch.sigmoid(x["logits"]), final=False)[0],
        ref_gdn(q, k, v, x["g"], torch.sigmoid(x["logits"]), final=False)[0],
        ref_gdn(fla_l2norm(q), fla_l2norm(k), v, 0.9 * x["g"], torch.sigmoid(x["logits"]), final=False)[0],
        ref_gdn(fla_l2norm(q), fla_l2norm(k).flip(2), v, x["g"], torch.sigmoid(x["logits"]), final=False)[0],
    ):
        assert rel(o, wrong) > 100 * TOL


# --- what deltarule cannot honour --------------------------------------------------------------

def test_contract_errors():
    x = inputs(17, H=2, HV=4)
    q, k, v, g, gk, beta = x["q"], x["k"], x["v"], x["g"], x["gk"], x["beta"]
    per_value_beta = torch.rand(*v.shape)

    def raises(argument, f, *a, **kw):
        with pytest.raises(deltarule.ContractError) as e:
            f(*a, **kw)
        assert argument in e.value.argument, e.value
        assert isinstance(e.value, ValueError)

    raises("gv", dfla.fused_recurrent_gated_delta_rule, q, k, v, g=g, gv=torch.zeros_like(v), beta=beta)
    raises("beta", dfla.fused_recurrent_gated_delta_rule, q, k, v, g=g, beta=per_value_beta)
    raises("beta", dfla.fused_recurrent_kda, q, k, v, gk, per_value_beta)
    raises("cp_context", dfla.chunk_kda, q, k, v, gk, beta, cp_context=object())
    raises("return_intermediate_states", dfla.chunk_gdn2, q, k, v, gk, x["b"], x["w"],
           return_intermediate_states=True)
    raises("not_an_fla_arg", dfla.chunk_kda, q, k, v, gk, beta, not_an_fla_arg=1)
    raises("ssm_state_indices", dfla.fused_recurrent_kda, q, k, v, gk, beta, ssm_state_indices=torch.arange(2))
    raises("head_first", dfla.chunk_gated_delta_rule, q, k, v, g, beta, head_first=False)
    raises("chunk_size", dfla.chunk_kda, q, k, v, gk, beta, chunk_size=16)
    raises("chunk_size", dfla.chunk_gdn2, q, k, v, gk, x["b"], x["w"], chunk_size=32)
    raises("allow_neg_eigval", dfla.chunk_gated_delta_rule, q, k, v, g, beta, allow_neg_eigval=True)
    raises("A_log", dfla.chunk_gated_delta_rule, q, k, v, g, beta, use_gate_in_kernel=True)
    # fla's fused KDA kernel would silently use A_log = 1 here (-e * softplus); chunk_kda raises
    raises("A_log", dfla.fused_recurrent_kda, q, k, v, gk, beta, use_gate_in_kernel=True)
    raises("dt_bias", dfla.chunk_kda, q, k, v, gk, beta, use_gate_in_kernel=True, A_log=x["A_log"],
           dt_bias=torch.zeros(4))
    raises("lower_bound", dfla.chunk_kda, q, k, v, gk, beta, use_gate_in_kernel=True, safe_gate=True,
           lower_bound=-6.0)
    raises("k", dfla.chunk_kda, q, k[:, :, :1], v, gk, beta)                 # fla: q and k share heads
    raises("transpose_state_layout", dfla.chunk_kda, q, k, v, gk, beta, state_v_first=True,
           transpose_state_layout=True)
    raises("cu_seqlens", dfla.chunk_kda, q, k, v, gk, beta, cu_seqlens=torch.tensor([0, 5, 37]))  # B == 2
    raises("initial_state", dfla.fused_recurrent_gdn2, q[:1], k[:1], v[:1], gk[:1], x["b"][:1], x["w"][:1],
           cu_seqlens=torch.tensor([0, 5, 37]), initial_state=torch.zeros(1, 4, 16, 32))
    raises("cu_seqlens_cpu", dfla.chunk_gated_delta_rule, q[:1], k[:1], v[:1], g[:1], beta[:1],
           cu_seqlens=torch.tensor([0, 5, 37]), cu_seqlens_cpu=torch.tensor([0, 6, 37]))


def _prefix_states(fn, x, gates, cu, h0, state_v_first):
    """The state after the first j * 64 tokens of every sequence, j = 0, 1, ... < ceil(len / 64):
    the drop-in's own final state of each prefix (h0's row for j = 0)."""
    states = []
    bounds = cu.tolist() if cu is not None else None
    for n in range(len(bounds) - 1 if bounds else x["q"].shape[0]):
        start, end = (bounds[n], bounds[n + 1]) if bounds else (0, x["q"].shape[1])
        row = slice(0, 1) if bounds else slice(n, n + 1)
        for j in range(-(-(end - start) // 64)):
            if j == 0:
                states.append(h0[n])
                continue
            cut = lambda t: t[row, start:start + 64 * j]  # noqa: E731
            _, state = fn(cut(x["q"]), cut(x["k"]), cut(x["v"]), *(cut(t) for t in gates),
                          initial_state=h0[n:n + 1], output_final_state=True, state_v_first=state_v_first)
            states.append(state[0])
    return torch.stack(states)


@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("name", ["chunk_kda", "chunk_gdn2"])
def test_intermediate_states_are_the_chunk_starts(name, varlen, state_v_first):
    """``return_intermediate_states=True`` (fla's prefix-caching output): h [B, NT, HV, K, V] in k's
    dtype, the state at the start of every 64-token chunk of every sequence (varlen: B = 1, the
    chunks of all sequences in order; an empty sequence has none, a 1-token one its initial
    state); o and the final state as without it."""
    x = inputs(31, B=1 if varlen else 2, T=200 if varlen else 150, H=2, K=16, V=32)
    cu = torch.tensor([0, 70, 70, 71, 200]) if varlen else None
    N = 4 if varlen else 2
    h0 = torch.randn(N, 2, 16, 32, generator=x["gen"])
    if state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()
    gates = (x["gk"], x["beta"]) if name == "chunk_kda" else (x["gk"], x["b"], x["w"])
    fn = getattr(dfla, name)
    common = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, state_v_first=state_v_first)
    with torch.inference_mode():
        o, final, h = fn(x["q"], x["k"], x["v"], *gates, return_intermediate_states=True, **common)
        o_ref, final_ref = fn(x["q"], x["k"], x["v"], *gates, **common)
        want = _prefix_states(fn, x, gates, cu, h0, state_v_first)
    NT = 2 + 0 + 1 + 3 if varlen else 3
    tail = (2, 32, 16) if state_v_first else (2, 16, 32)
    assert h.shape == ((1, NT) if varlen else (2, NT)) + tail and h.dtype == x["k"].dtype
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    assert rel(h.reshape(-1, *tail), want) < TOL


def test_intermediate_states_follow_flas_rules_and_dtypes():
    x = inputs(32, B=2, T=130, H=2, K=16, V=16)
    q, k, v, gk, beta = (x[n].to(torch.bfloat16) for n in ("q", "k", "v", "gk", "beta"))
    with pytest.raises(deltarule.ContractError, match="inference_mode"):
        dfla.chunk_kda(q, k, v, gk, beta, return_intermediate_states=True)      # fla asserts the same
    with torch.inference_mode():
        with pytest.raises(deltarule.ContractError, match="disable_recompute"):
            dfla.chunk_kda(q, k, v, gk, beta, return_intermediate_states=True, disable_recompute=True)
        with pytest.raises(deltarule.ContractError, match="initial_state"):     # copied in first: checked
            dfla.chunk_kda(q, k, v, gk, beta, return_intermediate_states=True,
                           initial_state=torch.zeros(2, 2, 16, 16, dtype=torch.int32))
        o, final, h = dfla.chunk_kda(q, k, v, gk, beta, return_intermediate_states=True)
        o_ref, _ = dfla.chunk_kda(q, k, v, gk, beta)
    assert final is None and o.dtype == torch.bfloat16 and torch.equal(o, o_ref)
    assert h.shape == (2, 3, 2, 16, 16) and h.dtype == torch.bfloat16
    assert not h[:, 0].any() and h[:, 1:].abs().amax() > 0                         # no h0: zeros first


@pytest.mark.parametrize("name, chunk_size, match", [
    # the regexes of fla's own tests (tests/ops/test_kda.py, test_gdn2.py: test_chunk_invalid_chunk_size),
    # which run against these drop-ins; fla's test_gdn.py has none, its message is fla's raise
    ("chunk_kda", 16, r"`chunk_size` must be either 32 or 64"),
    ("chunk_gdn2", 16, r"`chunk_size` must be 64 for GDN-2"),
    ("chunk_gdn2", 32, r"`chunk_size` must be 64 for GDN-2"),
    ("chunk_gated_delta_rule", 8, r"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule"),
])
def test_invalid_chunk_size_is_worded_as_fla_words_it(name, chunk_size, match):
    """A ContractError (a ValueError, as fla raises) whose message is fla's own, word for word."""
    x = inputs(23, B=1, T=64, H=2)
    args = {"chunk_kda": (x["q"], x["k"], x["v"], x["gk"], x["beta"]),
            "chunk_gdn2": (x["q"], x["k"], x["v"], x["gk"], x["b"], x["w"]),
            "chunk_gated_delta_rule": (x["q"], x["k"], x["v"], x["g"], x["beta"])}[name]
    with pytest.raises(ValueError, match=match) as ours:
        getattr(dfla, name)(*args, chunk_size=chunk_size)
    assert isinstance(ours.value, deltarule.ContractError) and ours.value.argument == "chunk_size"
    # fla checks chunk_size before any kernel runs, so its own function raises here on CPU too
    fla_fn = {"chunk_kda": fla_chunk_kda, "chunk_gdn2": fla_chunk_gdn2, "chunk_gated_delta_rule": fla_chunk_gdn}[name]
    with pytest.raises(ValueError) as theirs:
        fla_fn(*args, chunk_size=chunk_size)
    assert str(ours.value) == str(theirs.value)


# --- gradients: the drop-ins train ----------------------------------------------------------

GRAD_FAMILIES = {
    "chunk_gated_delta_rule": ("g", "beta"), "fused_recurrent_gated_delta_rule": ("g", "beta"),
    "chunk_kda": ("gk", "beta"), "fused_recurrent_kda": ("gk", "beta"),
    "chunk_gdn2": ("gk", "b", "w"), "fused_recurrent_gdn2": ("gk", "b", "w"),
}


def drop_in_gradients(fn, tensors: dict, cu=None):
    """(o, state, gradients of every tensor) of loss = (o * do).sum() + (state * dS).sum()."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in tensors.items()}
    o, state = fn(**leaves, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(5)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
    return o, state, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("name", GRAD_FAMILIES)
def test_drop_in_gradients(name, varlen, monkeypatch):
    """Each drop-in's gradients (deltarule's backward on the default backend) match fla's naive
    reference under autograd (float32) and deltarule's float64 oracle within 1e-4, across two
    checkpoint chunks, with an initial state, packed sequences included."""
    x = inputs(12, B=1 if varlen else 2, T=70, H=2, HV=2)
    gates = GRAD_FAMILIES[name]
    names = {"gk": "g"}                                   # fla calls the per-key gate g as well
    tensors = {"q": x["q"], "k": x["k"], "v": x["v"], **{names.get(g, g): x[g] for g in gates}}
    tensors["initial_state"] = torch.randn(2, 2, 16, 32, generator=x["gen"])   # [N, HV, K, V]
    cu = torch.tensor([0, 30, 70]) if varlen else None
    f = getattr(dfla, name)

    def drop_in(cu_seqlens, **t):
        return f(**t, output_final_state=True, cu_seqlens=cu_seqlens)

    ref = {"gated_delta": ref_gdn, "kda": ref_kda, "gdn2": ref_gdn2}[
        "gdn2" if "gdn2" in name else "kda" if "kda" in name else "gated_delta"]

    def naive(cu_seqlens, q, k, v, initial_state, **g):
        order = [g[n] for n in ("g", "beta") if n in g] if "b" not in g else [g["g"], g["b"], g["w"]]
        if cu_seqlens is None:
            return ref(q, k, v, *order, h0=initial_state)
        return ref_varlen(ref, cu_seqlens, q, k, v, *order, h0=initial_state)

    o, state, grads = drop_in_gradients(drop_in, tensors, cu)
    _, _, naive_grads = drop_in_gradients(naive, tensors, cu)
    call = dfla._call
    monkeypatch.setattr(dfla, "_call", lambda *args, **kwargs: call(*args, **{**kwargs, "backend": "reference"}))
    _, _, oracle = drop_in_gradients(drop_in, tensors, cu)
    for n in tensors:
        assert rel(grads[n], oracle[n]) < 1e-4, (n, rel(grads[n], oracle[n]))
        assert rel(grads[n], naive_grads[n]) < 1e-4, (n, rel(grads[n], naive_grads[n]))


# --- adversarial calls: a ContractError naming the argument, before any work (issue 46) ----------

# each drop-in's tensor arguments, by fla's name, and the inputs() entry a valid call passes
DROP_INS = {
    "chunk_gated_delta_rule": dict(q="q", k="k", v="v", g="g", beta="beta"),
    "fused_recurrent_gated_delta_rule": dict(q="q", k="k", v="v", g="g", beta="beta"),
    "chunk_kda": dict(q="q", k="k", v="v", g="gk", beta="beta"),
    "fused_recurrent_kda": dict(q="q", k="k", v="v", g="gk", beta="beta"),
    "chunk_gdn2": dict(q="q", k="k", v="v", g="gk", b="b", w="w"),
    "fused_recurrent_gdn2": dict(q="q", k="k", v="v", g="gk", b="b", w="w"),
}
# the error may name the argument as linear_attention knows it (fla's KDA g is its gk, b / w erase / write)
KNOWN_AS = {"g": ("g", "gk"), "b": ("b", "erase"), "w": ("w", "write")}
BAD_TENSORS = {
    "rank-1": lambda x: x.flatten()[:3], "rank+1": lambda x: x[..., None], "rank-3": lambda x: x[..., 0],
    "int32": lambda x: x.to(torch.int32), "complex64": lambda x: x.to(torch.complex64),
    "bool": lambda x: x.bool(), "float64": lambda x: x.double(), "list": lambda x: x.tolist(), "str": lambda x: "x",
}
BAD_SCALARS = [float("nan"), float("inf"), -1e39, "-1", True, 1j, None, torch.tensor([1.0, 2.0]), [1.0]]


def _drop_in_call(name, intermediate=False, **over):
    """A valid call of drop-in `name` (B = 2, T = 37: one partial chunk), with `over` replacing
    arguments; with `intermediate`, return_intermediate_states=True (in inference mode)."""
    x = inputs(46, T=37, K=8, V=8)
    args = {n: x[e] for n, e in DROP_INS[name].items()}
    args.update(initial_state=x["h0"][:, :, :8, :8].contiguous(), output_final_state=True)
    if intermediate:
        args["return_intermediate_states"] = True
    args.update(over)
    return args


def _refused(name, argument, args, intermediate=False):
    """The drop-in raises a ContractError naming `argument` and leaves initial_state as it was."""
    h0 = args["initial_state"]
    before = h0.clone() if isinstance(h0, torch.Tensor) else None
    with torch.inference_mode(intermediate), pytest.raises(deltarule.ContractError) as info:
        getattr(dfla, name)(**args)
    assert info.value.argument in KNOWN_AS.get(argument, (argument,)), info.value
    if before is not None:
        assert torch.equal(h0, before), "refused, but initial_state was modified"


@examples(60)
@given(name=st.sampled_from(sorted(DROP_INS)), bad=st.sampled_from(sorted(BAD_TENSORS)), data=st.data())
def test_a_bad_tensor_is_named(name, bad, data):
    """Any tensor argument of the wrong rank, dtype or type (an int, complex, bool or float64 q
    among float32 k / v was upcast silently; return_intermediate_states read shapes first, an
    IndexError) is a ContractError naming it, on every drop-in and both output paths."""
    argument = data.draw(st.sampled_from(sorted(DROP_INS[name])), label="argument")
    intermediate = name in ("chunk_kda", "chunk_gdn2") and data.draw(st.booleans(), label="intermediate")
    args = _drop_in_call(name, intermediate)
    args[argument] = BAD_TENSORS[bad](args[argument])
    _refused(name, argument, args, intermediate)


@examples(40)
@given(name=st.sampled_from(sorted(DROP_INS)), value=st.sampled_from(BAD_SCALARS[:-3] + BAD_SCALARS[-2:]))
def test_a_bad_scale_is_named(name, value):
    """scale NaN, inf, overflowing float32, a string, a bool, complex, a tensor of two: refused."""
    _refused(name, "scale", _drop_in_call(name, scale=value))


@examples(40)
@given(name=st.sampled_from(["chunk_kda", "fused_recurrent_kda", "chunk_gdn2", "fused_recurrent_gdn2"]),
       value=st.sampled_from(BAD_SCALARS[:-3] + [BAD_SCALARS[-2], BAD_SCALARS[-1], np.array([-1.0])]),
       safe_gate=st.booleans())
def test_a_bad_lower_bound_is_named(name, value, safe_gate):
    """fla's bounded gate: a lower_bound that is no real number finite in float32 (a string with
    safe_gate=True raised TypeError, -1e39 gave a -inf decay) is refused, with or without safe_gate."""
    over = dict(use_gate_in_kernel=True, lower_bound=value, A_log=torch.zeros(2))
    if name.startswith("chunk"):
        over["safe_gate"] = safe_gate
    _refused(name, "lower_bound", _drop_in_call(name, **over))


@pytest.mark.parametrize("value", ["2", True, 1.5, [1], -1], ids=repr)
def test_a_bad_max_num_seqs_is_named(value):
    """With use_graph, max_num_seqs an int >= 0 (a string raised TypeError, True passed as 1)."""
    args = _drop_in_call("chunk_kda", use_graph=True, max_num_seqs=value, cu_seqlens=torch.tensor([0, 20, 37]))
    args.update({n: args[n][:1] for n in ("q", "k", "v", "g", "beta")})
    _refused("chunk_kda", "max_num_seqs", args)


@pytest.mark.parametrize("over, argument", [
    (dict(cu_seqlens=5, use_graph=True, max_num_seqs=1), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor(5), use_graph=True, max_num_seqs=1), "cu_seqlens"),
    (dict(cu_seqlens="x", cu_seqlens_cpu=torch.tensor([0, 37])), "cu_seqlens"),
    (dict(chunk_size=np.array([64, 32])), "chunk_size"), (dict(chunk_size=torch.tensor([64, 32])), "chunk_size"),
    (dict(beta=torch.complex64, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), "beta"),
    (dict(beta=torch.int32, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), "beta"),
], ids=["cu-int-graph", "cu-0d-graph", "cu-str-cpu", "chunk-array", "chunk-tensor", "neg-eig-complex", "neg-eig-int"])
def test_a_bad_option_is_named(over, argument):
    """Options fla's helpers read before linear_attention does: len() of an int, torch.as_tensor of
    a string, an ambiguous array comparison, sigmoid of a complex beta (its imaginary part dropped)."""
    args = _drop_in_call("chunk_kda")
    if isinstance(over.get("beta"), torch.dtype):                  # the valid beta in that dtype
        over = {**over, "beta": args["beta"].to(over["beta"])}
    args.update(over)
    _refused("chunk_kda", argument, args)


@pytest.mark.parametrize("argument, bad", [
    ("g", torch.complex64), ("g", torch.int32), ("A_log", torch.complex64), ("dt_bias", torch.complex64),
    ("A_log", "meta")], ids=str)
def test_gdn_gate_in_kernel_with_gk_is_checked(argument, bad):
    """fused_recurrent_gated_delta_rule forms g itself when gk comes too: a complex or int raw
    gate lost its imaginary part or passed, an A_log on another device failed mid-call."""
    x = inputs(47, K=8, V=8)
    args = _drop_in_call("fused_recurrent_gated_delta_rule", gk=x["gk"][..., :8], use_gate_in_kernel=True,
                         A_log=x["A_log"], dt_bias=x["dt_bias"])
    args[argument] = args[argument].to(bad)
    _refused("fused_recurrent_gated_delta_rule", argument, args)


def test_mixed_float_dtypes_still_upcast():
    """The upcast the drop-ins keep (fla reads every input in float32): float16 q beside float32
    k / v is the float32 call, o in q's dtype."""
    args = _drop_in_call("chunk_kda")
    o, state = dfla.chunk_kda(**{**args, "q": args["q"].half()})
    o_ref, state_ref = dfla.chunk_kda(**{**args, "q": args["q"].half().float()})
    assert o.dtype == torch.float16 and torch.equal(o, o_ref.half()) and torch.equal(state, state_ref)


@pytest.mark.parametrize("B, T", [(0, 37), (0, 0), (2, 0)])
@pytest.mark.parametrize("name", ["chunk_kda", "chunk_gdn2"])
def test_intermediate_states_of_an_empty_batch(name, B, T):
    """B = 0 (a RuntimeError reshaping h before) or T = 0: h [B, ceil(T / 64), HV, K, V], the same
    o and final state as without return_intermediate_states."""
    args = _drop_in_call(name, intermediate=True)
    args = {n: x[:B, :T] if n in DROP_INS[name] else x for n, x in args.items()}
    args["initial_state"] = args["initial_state"][:B]
    with torch.inference_mode():
        o, final, h = getattr(dfla, name)(**args)
        o_ref, final_ref = getattr(dfla, name)(**{**args, "return_intermediate_states": False})
    assert h.shape == (B, -(-T // 64), 2, 8, 8) and torch.equal(o, o_ref) and torch.equal(final, final_ref)
    if B and not T:
        assert torch.equal(final, args["initial_state"])
