"""The triton backend's chunked prefill (scalar gates) against the float64 reference.

The kernels are called directly on the operands the backend prepares
(`_prepare.pack` / `operands` / `finish`), so these tests do not depend on how
the backend routes a call. Without a CUDA device they run on CPU tensors under
the Triton interpreter (conftest.py sets TRITON_INTERPRET=1 before anything
imports triton); if triton was imported without it, the module is skipped with
the reason. Shapes stay tiny: the interpreter runs one numpy op per Triton op
per program.
"""

import pytest

from conftest import err, require_triton

require_triton()

import torch  # noqa: E402

import deltarule  # noqa: E402
from deltarule import cases  # noqa: E402
from deltarule.backends import _prepare  # noqa: E402
from deltarule.backends.triton_chunked_support import PREFIX, chunked_supported  # noqa: E402
from deltarule.check import expected  # noqa: E402
from deltarule.kernels import triton_chunked  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.triton

TOL = {"float32": 5e-5, "float16": 1e-2, "bfloat16": 1e-2}



def run_chunked(args: dict, in_place: bool = False):
    """The chunked kernels on `args`, through the backend's operand preparation."""
    p = deltarule.validate(**args)
    assert chunked_supported(p) is None
    pk = _prepare.pack(p)
    x = _prepare.operands(p, pk)
    owned = p.initial_state is None or \
        x.S0.untyped_storage().data_ptr() != p.initial_state.untyped_storage().data_ptr()
    S = x.S0 if (in_place and owned) else None
    o, S = triton_chunked.chunked(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale, S=S)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    return _prepare.finish(p, pk, o, S)


def check(args: dict, tol: float, in_place: bool = False):
    ref_o, ref_state = expected(args)         # before the call: a slab is updated in place
    o, state = run_chunked(args, in_place)
    assert o.dtype == args["v"].dtype and state.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    e_o, e_s = err(o, ref_o), err(state, ref_state)
    assert e_o <= tol and e_s <= tol, f"err(o)={e_o:.2e} err(S)={e_s:.2e} tol={tol:.0e}"
    return o, state


def small(**over) -> dict:
    """A test.json-style case dict: tiny sizes, overridable."""
    case = dict(name="small", seed=200, B=1, T=65, Hq=1, Hk=1, Hv=1, K=16, V=16, rule="gated_delta")
    case.update(over)
    return case


def _scalar(case: dict) -> bool:
    return chunked_supported(deltarule.validate(**cases.make_inputs(case))) is None


JSON_CASES = [
    pytest.param(case, dtype, id=f"{case['name']}-{dtype}")
    for case in cases.test_cases() if case["T"] <= 2048 and _scalar(case)
    for dtype in case["dtypes"]
]


@pytest.mark.parametrize("case,dtype", JSON_CASES)
def test_test_json_case(case, dtype):
    """Every scalar-gate case of test.json (varlen, ragged, slab, raw gate, sigmoid, l2norm, ...)."""
    check(cases.make_inputs(case, dtype, DEVICE), TOL[dtype])


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("rule", ["linear", "gated", "delta", "gated_delta"])
def test_rules_and_lengths(rule, T):
    """Partial, exact and multiple chunks, with an initial state."""
    check(cases.make_inputs(small(rule=rule, T=T, initial_state=True), "float32", DEVICE), TOL["float32"])


@pytest.mark.parametrize("rule", ["linear", "gated_delta"])
@pytest.mark.parametrize("K,V", [(100, 60), (20, 72), (8, 8)])
def test_odd_sizes(rule, K, V):
    """K, V not powers of two; V = 72 spans two value tiles (the second masked);
    K = V = 8 are padded up to the 16-wide tiles `tl.dot` needs."""
    case = small(rule=rule, T=70, K=K, V=V, initial_state=True)
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


@pytest.mark.parametrize("heads", [
    dict(Hq=2, Hk=2, Hv=4),     # GVA: state head h reads key / query head h // 2
    dict(Hq=1, Hk=1, Hv=3),
    dict(Hq=4, Hk=2, Hv=2),     # GQA: 2 query rows per state head
    dict(Hq=3, Hk=1, Hv=1),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_head_grouping(heads, dtype):
    case = small(T=66, initial_state=True, **heads)
    check(cases.make_inputs(case, dtype, DEVICE), TOL[dtype])


@pytest.mark.parametrize("rule", ["gated", "gated_delta"])
def test_strong_decay_stays_finite(rule):
    """Log decay in [-6, -4]: ~ -320 accumulated per chunk; exp(-G) would overflow float32."""
    case = small(rule=rule, T=200, decay_range=[-6.0, -4.0], initial_state=True)
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


def test_varlen_with_empty_sequence():
    """Three sequences of 70, 0 and 75 tokens packed into B = 1; the empty one passes its state through."""
    case = small(T=145, cu_seqlens=[0, 70, 70, 145], initial_state=True, Hq=2, Hk=2, Hv=2)
    args = cases.make_inputs(case, "float32", DEVICE)
    _, state = check(args, TOL["float32"])
    assert torch.equal(state[1], args["initial_state"][1])


def test_in_place_state_buffer():
    """S = S0 (a gathered, owned state) updates the states in place with the same result."""
    case = small(B=2, T=70, initial_state=True, state_indices=[2, 0], num_slots=3)
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"], in_place=True)
    args = cases.make_inputs(small(B=2, T=70, initial_state=True), "float32", DEVICE)
    before = args["initial_state"].clone()
    _, state = check(args, TOL["float32"], in_place=True)       # the caller's state is never written
    assert torch.equal(args["initial_state"], before) and state.data_ptr() != args["initial_state"].data_ptr()


@pytest.mark.parametrize("case", [
    small(T=70, K=100, V=60, initial_state=True),
    small(T=66, K=20, V=72, rule="linear"),
    small(T=145, cu_seqlens=[0, 70, 70, 145], initial_state=True),
    small(B=2, T=70, Hq=4, Hk=2, Hv=2, seq_lens=[70, 3]),
    small(B=2, T=70, initial_state=True, state_indices=[-1, 2], num_slots=3),
], ids=["odd-sizes", "linear-two-value-tiles", "varlen-empty", "gqa-seq_lens", "slab-padding"])
def test_writes_every_output_element(nan_poison, case):
    """With uninitialised memory poisoned to NaN, outputs and states stay finite and correct."""
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


@pytest.mark.parametrize("over,what", [
    (dict(decay="gk"), "per-key decay gk"),
    (dict(decay="g+gk"), "per-key decay gk (with g)"),
    (dict(update="erase_write"), "channel-wise erase / write"),
    (dict(rule="delta", update="erase_write"), "channel-wise erase / write"),
    (dict(rule="gated", decay="gk"), "per-key decay gk"),
    (dict(raw_gate=True, decay="gk"), "per-key decay gk"),
])
def test_per_channel_gates_declined(over, what):
    p = deltarule.validate(**cases.make_inputs(small(**over), "float32", DEVICE))
    reason = chunked_supported(p)
    assert reason is not None and reason.startswith(PREFIX) and what in reason


@pytest.mark.parametrize("over", [dict(rule="linear"), dict(rule="gated"), dict(rule="delta"),
                                  dict(rule="gated_delta"), dict(raw_gate=True, beta_sigmoid=True)])
def test_scalar_gates_accepted(over):
    assert chunked_supported(deltarule.validate(**cases.make_inputs(small(**over), "float32", DEVICE))) is None


def test_kernel_refuses_per_channel_operands():
    args = cases.make_inputs(small(decay="gk"), "float32", DEVICE)
    p = deltarule.validate(**args)
    x = _prepare.operands(p, _prepare.pack(p))
    with pytest.raises(ValueError, match="scalar"):
        triton_chunked.chunked(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale)
