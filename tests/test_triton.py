"""The triton backend's fused recurrence against the float64 reference.

Without a CUDA device the kernels run on CPU tensors under the Triton
interpreter: conftest.py sets TRITON_INTERPRET=1 before anything imports
triton (its standard library, `tl.sum` included, is set up at import). If
triton was imported without it, the module is skipped with the reason. Shapes
stay tiny: the interpreter runs one numpy op per Triton op per program per token.
"""

import pytest

from conftest import assert_rows_rewritten, assert_slab_updated_in_place, case_id, err, require_triton, state_dtype, state_tol

require_triton()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import deltarule  # noqa: E402
from deltarule import cases  # noqa: E402
from deltarule.backends import triton_backend  # noqa: E402
from deltarule.tools.check import expected  # noqa: E402
from deltarule.kernels.triton import common as triton_common  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.triton

TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}



def check(args: dict, tol: float):
    """Run the triton backend on `args` and compare o and the state with the reference."""
    ref_o, ref_state = expected(args)         # before the call: a slab is updated in place
    p = deltarule.validate(**args)
    assert triton_backend.supports(p) is None
    o, state = triton_backend.run(p)
    assert o.dtype == args["v"].dtype and state.dtype == state_dtype(args)
    e_o, e_s = err(o, ref_o), err(state, ref_state)
    assert e_o <= tol and e_s <= state_tol(args, tol), f"err(o)={e_o:.2e} err(S)={e_s:.2e} tol={tol:.0e}"
    return o, state


def small(**over) -> dict:
    """A test.json-style case dict: tiny sizes, overridable."""
    case = dict(name="small", seed=100, B=2, T=5, Hq=2, Hk=2, Hv=2, K=16, V=24, rule="gated_delta")
    case.update(over)
    return case


def _fits(case: dict) -> bool:
    return deltarule.validate(**cases.make_inputs(case)).max_len <= triton_backend.RECURRENT_MAX_LEN


def _speculative(case: dict) -> bool:
    return isinstance((case.get("state_indices") or [0])[0], list)


FUSED_CASES = [   # speculative plans run the fused recurrence at any length
    pytest.param(case, dtype, id=f"{case['name']}-{dtype}")
    for case in cases.test_cases()
    if case["T"] <= 64 or _speculative(case) or (case.get("cu_seqlens") is not None and _fits(case))
    for dtype in case["dtypes"]
]


@pytest.mark.parametrize("case,dtype", FUSED_CASES)
def test_test_json_case(case, dtype):
    check(cases.make_inputs(case, dtype, DEVICE), TOL[dtype])


@pytest.mark.parametrize("T", [1, 63])
@pytest.mark.parametrize("K,V", [(100, 60), (20, 72)])
def test_odd_sizes(T, K, V):
    """K, V not powers of two; V = 72 spans two value tiles, the second masked."""
    case = small(B=1, T=T, K=K, V=V, decay="gk", update="erase_write", initial_state=True)
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


@pytest.mark.parametrize("rule,decay,update", [
    ("linear", "none", "none"),
    ("gated", "g", "none"),
    ("gated", "gk", "none"),
    ("delta", "none", "beta"),
    ("delta", "none", "erase_write"),
    ("gated_delta", "gk", "beta"),
    ("gated_delta", "g+gk", "erase_write"),
])
def test_gates(rule, decay, update):
    case = small(rule=rule, decay=decay, update=update, initial_state=True)
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


@pytest.mark.parametrize("case,dtype", [
    pytest.param(c, d, id=f"{case_id(c)}-{d}") for c, d in [
        (small(raw_gate=True, beta_sigmoid=True, qk_l2norm=True, initial_state=True), "float32"),
        (small(decay="gk", update="erase_write", raw_gate=True, beta_sigmoid=True, K=20), "float32"),
        (small(Hq=4, Hk=2, Hv=2, raw_gate=True, qk_l2norm=True), "bfloat16"),                # GQA
        (small(B=3, T=1, Hq=2, Hk=2, Hv=4, raw_gate=True, beta_sigmoid=True, qk_l2norm=True,   # Qwen3-Next decode
               initial_state=True, state_indices=[1, -1, 0], num_slots=3), "bfloat16"),
    ]])
def test_fused_preprocessing(case, dtype):
    """The raw-gate arm, beta_sigmoid and qk_l2norm applied inside the kernel, as loaded."""
    check(cases.make_inputs(case, dtype, DEVICE), TOL[dtype])


def test_packed_raw_gate_keeps_empty_request_state():
    """Clamped cu_seqlens whose spans overlap run packed rows, each for its own length: the empty
    request keeps its state (a zero raw gate is no identity step: -exp(A_log) softplus(dt_bias) < 0)."""
    args = cases.make_inputs(small(B=1, T=12, cu_seqlens=[0, 8, 4, 12], decay="gk", raw_gate=True,
                                   initial_state=True), "float32", DEVICE)
    assert triton_backend.flat_spans(deltarule.validate(**args).plan) is None
    before = args["initial_state"].clone()
    _, state = check(args, TOL["float32"])
    assert torch.equal(state[1], before[1])


@triton.jit
def _softplus_kernel(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, triton_common.softplus(tl.load(x + o)))


def test_softplus_accuracy():
    """log(1 + exp(x)) in float32 to a few ulp from -80 (exp(x) ~ 1e-35) to 60 (x itself)."""
    x = torch.linspace(-80, 60, 512, dtype=torch.float32, device=DEVICE)
    y = torch.full_like(x, float("nan"))
    _softplus_kernel[(1,)](x, y, N=512)
    ref = torch.nn.functional.softplus(x.double())
    assert ((y.double() - ref).abs() / ref).max().item() < 1e-6


@pytest.mark.parametrize("heads", [
    dict(Hq=2, Hk=2, Hv=4),     # GVA: state head h reads key / query head h // 2
    dict(Hq=1, Hk=1, Hv=3),
    dict(Hq=8, Hk=2, Hv=2),     # GQA: 4 query rows per state head
    dict(Hq=6, Hk=1, Hv=1),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_grouping(heads, dtype):
    case = small(decay="gk", initial_state=True, **heads)
    check(cases.make_inputs(case, dtype, DEVICE), TOL[dtype])


def test_slab_with_padding_index():
    case = small(B=3, T=4, initial_state=True, state_indices=[3, -1, 0], num_slots=5, decay="gk")
    args = cases.make_inputs(case, "float32", DEVICE)
    slab = args["initial_state"]
    before = slab.clone()
    o, state = check(args, TOL["float32"])
    assert_slab_updated_in_place(state, slab, before, o, case["state_indices"])


def test_slab_vk_layout_decode():
    case = small(B=2, T=1, initial_state=True, state_indices=[1, 2], num_slots=4, state_layout="vk")
    args = cases.make_inputs(case, "float32", DEVICE)
    before = args["initial_state"].clone()
    check(args, TOL["float32"])
    assert torch.equal(args["initial_state"][0], before[0]) and torch.equal(args["initial_state"][3], before[3])


def refuse_scatter_into(monkeypatch, slab):
    """Fail the test if anything scatters rows into `slab` (the gather / scatter path)."""
    scatter = torch.Tensor.index_copy_

    def guarded(self, *a, **kw):
        if self is slab:
            pytest.fail("slab scattered")
        return scatter(self, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "index_copy_", guarded)


def test_slab_updated_where_it_lies(monkeypatch):
    """The fused kernel reads and writes the slab rows itself: no gathered copy, no scatter
    (index_select / index_copy_ on the slab would be the gather / scatter path)."""
    from deltarule.kernels.triton import recurrent as triton_recurrent

    case = small(B=3, T=2, initial_state=True, state_indices=[2, -1, 0], num_slots=4, decay="gk",
                 update="erase_write", state_layout="vk")
    args = cases.make_inputs(case, "float32", DEVICE)
    slab = args["initial_state"]
    seen = []
    kernel = triton_recurrent.recurrent

    def spy(*a, **kw):
        seen.append((a[7], kw.get("state_indices"), kw.get("spans")))
        return kernel(*a, **kw)

    monkeypatch.setattr(triton_recurrent, "recurrent", spy)
    refuse_scatter_into(monkeypatch, slab)
    o, _ = check(args, TOL["float32"])
    (S0, idx, spans), = seen
    # the padding sequence is not launched at all; the others are spans of the flat token axis
    assert S0 is slab and idx.tolist() == [2, 0] and spans == [(0, 2), (4, 2)]
    assert torch.count_nonzero(o[1]) == 0


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_speculative_rows_stored_where_the_slab_lies(monkeypatch, state_dtype):
    """Per-token states go straight into the (strided, 16-bit) slab rows from the kernel: no
    gather, no scatter; the accepted row is read before the same program rewrites it, rows not
    addressed and the padding sequence's rows stay bit-identical."""
    case = small(B=3, T=3, K=20, V=24, decay="gk", update="erase_write", initial_state=True,
                 state_indices=[[4, 0, 1], [-1, 5, 6], [2, 3, -1]], num_accepted_tokens=[2, 1, 1],
                 num_slots=8, state_dtype=state_dtype)
    args = cases.make_inputs(case, "float32", DEVICE)
    wide = torch.zeros(8, 2, 20 + 3, 24, dtype=args["initial_state"].dtype)
    wide[:, :, :20] = args["initial_state"]
    slab = wide[:, :, :20]                                            # rows not contiguous
    args["initial_state"] = slab
    before = wide.clone()
    refuse_scatter_into(monkeypatch, slab)
    o, state = check(args, TOL["float32"])
    assert state is slab
    assert_rows_rewritten(wide, before, {4, 0, 1, 2, 3})              # sequence 1 reads row -1: padding
    assert torch.count_nonzero(o[1]) == 0


def test_initial_state_untouched():
    args = cases.make_inputs(small(initial_state=True), "float32", DEVICE)
    before = args["initial_state"].clone()
    _, state = check(args, TOL["float32"])
    assert torch.equal(args["initial_state"], before)
    assert state.data_ptr() != args["initial_state"].data_ptr()


@pytest.mark.parametrize("case", [
    small(B=1, T=3, K=100, V=60, decay="gk", update="erase_write"),
    small(B=1, T=12, cu_seqlens=[2, 5, 5, 9], initial_state=True),
    small(B=2, T=4, Hq=4, Hk=2, Hv=2, seq_lens=[4, 1]),
    small(B=2, T=2, initial_state=True, state_indices=[-1, 2], num_slots=3),
], ids=["odd-sizes", "varlen-uncovered", "gqa-seq_lens", "slab-padding"])
def test_writes_every_output_element(nan_poison, case):
    """With uninitialised memory poisoned to NaN, outputs and states stay finite and correct."""
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


@pytest.mark.parametrize("over", [dict(decay="gk"), dict(decay="g+gk", update="erase_write", state_layout="vk")])
def test_longer_prefill_runs_chunked(monkeypatch, over):
    """Past RECURRENT_MAX_LEN tokens every gate form is accepted and runs the chunked kernels."""
    from deltarule.kernels.triton import chunked as triton_chunked

    calls = []
    kernel = triton_chunked.chunked
    monkeypatch.setattr(triton_chunked, "chunked", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    check(cases.make_inputs(small(B=1, T=65, initial_state=True, **over), "float32", DEVICE), 5e-5)
    assert calls == [1]


@pytest.mark.parametrize("cu,spans", [
    ([0, 3, 140, 141], [(0, 3), (3, 137), (140, 1)]),       # unequal: unpacked, no padding to 137
    # a decreasing entry: overlapping spans, packed into rows of L = 100, each run for its length
    ([0, 100, 90, 141], [(0, 100), (100, 0), (200, 51)]),
])
def test_varlen_unpacked_unless_spans_overlap(monkeypatch, cu, spans):
    from deltarule.kernels.triton import chunked as triton_chunked

    seen = []
    kernel = triton_chunked.chunked
    monkeypatch.setattr(triton_chunked, "chunked", lambda *a, **kw: seen.append(kw["spans"]) or kernel(*a, **kw))
    check(cases.make_inputs(small(B=1, T=141, cu_seqlens=cu, decay="gk", initial_state=True), "float32", DEVICE),
          5e-5)
    assert seen == [spans]


def test_varlen_with_short_spans_accepted():
    """T = 70 packed tokens in spans of at most 40: the fused recurrence takes it."""
    check(cases.make_inputs(small(B=1, T=70, cu_seqlens=[0, 40, 70]), "float32", DEVICE), TOL["float32"])


def test_available_and_described():
    assert triton_backend.available()
    assert triton_backend.NAME == "triton"
    assert "CUDA" in triton_backend.SUPPORTS["devices"]
