"""The triton backend's chunked prefill (every gate form) against the float64 reference.

The kernels are called directly on the operands the backend prepares
(`_prepare.pack` / `operands` / `finish`), reading the initial state where it
lies as the backend does (any layout; a slab updated in place), so these tests
do not depend on how the backend routes a call. Without a CUDA device they run
on CPU tensors under the Triton interpreter (conftest.py sets TRITON_INTERPRET=1
before anything imports triton); if triton was imported without it, the module
is skipped with the reason. Shapes stay tiny: the interpreter runs one numpy op
per Triton op per program.
"""

import pytest

from conftest import assert_slab_updated_in_place, case_id, err, params, rel, require_triton, state_dtype, state_tol

require_triton()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import deltarule  # noqa: E402
from deltarule import cases  # noqa: E402
from deltarule.backends import _prepare, triton_backend  # noqa: E402
from deltarule.tools.check import expected  # noqa: E402
from deltarule.kernels.triton import chunked as triton_chunked
from deltarule.kernels.triton import common as triton_common  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.triton

TOL = {"float32": 5e-5, "float16": 1e-2, "bfloat16": 1e-2}


def run_chunked(args: dict, mode: str = "backend"):
    """The chunked kernels on `args`, through the backend's operand preparation.

    "backend": as the backend lays the call out (`token_layout`): varlen / ragged / padded
    batches unpacked (spans of the flat token axis) when disjoint, the initial state read where
    it lies (any layout; a slab updated in place at `state_indices`). "packed": sequences
    packed into [N, L] rows (the path for overlapping spans), each run for its own length,
    state where it lies. "gathered": packed, from a gathered K-major copy S0 that the kernels
    update in place (S = S0).
    """
    p = deltarule.validate(**args)
    lay = triton_backend.token_layout(p, packed=mode != "backend")
    pk = lay.packing
    x = _prepare.raw_operands(p, pk)
    fused = dict(A_log=p.A_log, dt_bias=p.dt_bias, beta_sigmoid=p.beta_sigmoid,
                 l2norm_eps=p.l2norm_eps if p.qk_l2norm else None,
                 spans=lay.spans)
    if mode == "gathered":
        S0 = _prepare.initial_states(p)
        owned = p.initial_state is None or \
            S0.untyped_storage().data_ptr() != p.initial_state.untyped_storage().data_ptr()
        o, S = triton_chunked.chunked(x.q, x.k, x.v, x.g, x.gk, x.b, x.w, S0, p.scale,
                                      S=S0 if owned else None, **fused)
        assert o.dtype == torch.float32 and S.dtype == torch.float32
        return _prepare.finish(p, pk, o, S)
    o, S = triton_chunked.chunked(x.q, x.k, x.v, x.g, x.gk, x.b, x.w, p.initial_state, p.scale,
                                  state_indices=lay.rows, state_layout=p.state_layout, **fused)
    assert o.dtype == torch.float32 and S.dtype == p.state_dtype
    if p.in_place:
        assert S is p.initial_state
        return _prepare.finish(p, pk, o, None)
    return _prepare.finish(p, pk, o, S if p.state_layout == "kv" else S.transpose(-1, -2))


def check(args: dict, tol: float, mode: str = "backend"):
    ref_o, ref_state = expected(args)         # before the call: a slab is updated in place
    o, state = run_chunked(args, mode)
    assert o.dtype == args["v"].dtype and state.dtype == state_dtype(args)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    e_o, e_s = err(o, ref_o), err(state, ref_state)
    assert e_o <= tol and e_s <= state_tol(args, tol), f"err(o)={e_o:.2e} err(S)={e_s:.2e} tol={tol:.0e}"
    return o, state


def small(**over) -> dict:
    """A test.json-style case dict: tiny sizes, overridable."""
    case = dict(name="small", seed=200, B=1, T=65, Hq=1, Hk=1, Hv=1, K=16, V=16, rule="gated_delta")
    case.update(over)
    return case


# float32 only: the half-precision inputs are covered by the tests below (and by
# `deltarule check --backend triton`), and the interpreter's time is the budget here
JSON_CASES = [   # speculative plans and captures never run chunked: per-token states and deltas come
    pytest.param(case, id=case["name"]) for case in cases.test_cases()     # from the recurrence alone
    if case["T"] <= 2048 and not isinstance((case.get("state_indices") or [0])[0], list)
    and case.get("capture") is None
]


@pytest.mark.parametrize("case", JSON_CASES)
def test_test_json_case(case):
    """Every case of test.json up to 2048 tokens (every gate form, varlen, ragged, slab, raw gate,
    sigmoid, l2norm, vk layout, ...), in float32, through the chunked kernels even where short."""
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


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
    """S = S0 (a gathered, owned state) updates the states in place with the same result; the
    caller's own state (either layout) is read where it lies and never written."""
    case = small(B=2, T=70, initial_state=True, state_indices=[2, 0], num_slots=3, decay="gk")
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"], mode="gathered")
    for layout in ("kv", "vk"):
        args = cases.make_inputs(small(B=2, T=70, initial_state=True, state_layout=layout), "float32", DEVICE)
        before = args["initial_state"].clone()
        _, state = check(args, TOL["float32"])
        assert torch.equal(args["initial_state"], before) and state.data_ptr() != args["initial_state"].data_ptr()


@pytest.mark.parametrize("case", params(
    small(decay="gk", K=36, V=20, initial_state=True),                       # KDA
    small(decay="g+gk", K=36, V=20, initial_state=True),                     # scalar and per-key together
    small(rule="gated", decay="gk", K=36, V=20, initial_state=True),         # per key, no retrieval
    small(decay="gk", update="erase_write", K=36, V=20, initial_state=True),  # GDN-2
    small(decay="g", update="erase_write", K=36, V=20, initial_state=True),
    small(decay="g+gk", update="erase_write", T=129, K=36, V=20, initial_state=True),
    small(rule="delta", update="erase_write", K=36, V=20, initial_state=True),
    small(decay="gk", T=64, K=16, V=16),                                     # one exact chunk
    small(decay="gk", T=100, K=64, V=64, initial_state=True),
    small(decay="gk", update="erase_write", T=80, K=8, V=72, initial_state=True),  # K padded, V two tiles
))
def test_per_channel_gates(case):
    """Per-key decay (alone, with scalar g, without retrieval) and GDN-2 erase / write gates."""
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


@pytest.mark.parametrize("case,dtype", [
    pytest.param(c, d, id=f"{case_id(c)}-{d}") for c, d in [
        (small(T=130, K=36, V=20, raw_gate=True, beta_sigmoid=True, qk_l2norm=True, initial_state=True), "float32"),
        (small(T=70, K=36, V=20, decay="gk", update="erase_write", raw_gate=True, beta_sigmoid=True,
               qk_l2norm=True, initial_state=True), "float32"),                                  # GDN-2, raw
        (small(B=1, T=65, Hq=4, Hk=2, Hv=2, K=32, V=16, decay="gk", raw_gate=True, qk_l2norm=True), "bfloat16"),
        # overlapping clamped spans run packed: each row only for its own length (60 of 100 here)
        (small(T=150, cu_seqlens=[0, 100, 90, 150], K=20, V=20, decay="gk", raw_gate=True,
               beta_sigmoid=True, initial_state=True), "float32"),
    ]])
def test_fused_preprocessing(case, dtype):
    """The raw-gate arm (cumsum kernel or scalar loads), beta_sigmoid and qk_l2norm on every q / k
    load, inside the chunked kernels."""
    args = cases.make_inputs(case, dtype, DEVICE)
    p = deltarule.validate(**args)
    if case.get("cu_seqlens") is not None:
        assert triton_backend.flat_spans(p.plan) is None         # packed: the path this case is for
    check(args, TOL[dtype])


@pytest.mark.parametrize("case,dtype", [
    pytest.param(c, d, id=f"{case_id(c)}-{d}") for c, d in [
        (small(B=2, T=65, Hq=4, Hk=4, Hv=8, K=36, V=20, decay="gk"), "float32"),                 # GVA
        (small(B=2, T=65, Hq=2, Hk=2, Hv=8, K=36, V=20, decay="gk", update="erase_write",
               initial_state=True), "bfloat16"),
        (small(B=1, T=129, Hq=8, Hk=2, Hv=2, K=36, V=20, decay="gk", initial_state=True), "float32"),  # GQA
        (small(B=1, T=65, Hq=4, Hk=1, Hv=1, K=32, V=16, decay="g+gk", update="erase_write"), "float16"),
    ]])
def test_head_grouping_per_key(case, dtype):
    check(cases.make_inputs(case, dtype, DEVICE), TOL[dtype])


@pytest.mark.parametrize("case", params(
    small(T=130, K=36, V=20, decay="gk", decay_range=[-6.0, -4.0], initial_state=True),
    small(T=130, K=36, V=20, decay="gk", update="erase_write", decay_range=[-8.0, -2.0], initial_state=True),
    small(T=129, K=20, V=20, decay="g+gk", decay_range=[-4.0, -3.0], initial_state=True),
))
def test_strong_per_key_decay_stays_finite(case):
    """Log decays of -2..-8 per token and key: -130..-510 accumulated per chunk, so a factored
    exp(-G) overflows float32 and exp(G_r - G_n) with a reference past r would too; the
    sub-chunk reference points keep every exponent <= 0."""
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


@pytest.mark.parametrize("case", params(
    small(T=145, cu_seqlens=[0, 70, 70, 145], initial_state=True, Hq=2, Hk=2, Hv=2, decay="gk",
          update="erase_write", K=36, V=20),
    small(T=150, cu_seqlens=[0, 0, 80, 80, 150], initial_state=True, Hq=2, Hk=2, Hv=4, decay="g+gk",
          state_layout="vk", K=20, V=36),
))
@pytest.mark.parametrize("mode", ["backend", "packed"])
def test_varlen_per_key_with_empty_requests(case, mode):
    """Varlen with empty requests (first and middle), unpacked (spans of the token axis, chunk
    indices) and packed: the empty ones pass their state through."""
    args = cases.make_inputs(case, "float32", DEVICE)
    _, state = check(args, TOL["float32"], mode)
    lengths = [b - a for a, b in zip(case["cu_seqlens"], case["cu_seqlens"][1:])]
    for n, length in enumerate(lengths):
        if length == 0:
            assert torch.equal(state[n], args["initial_state"][n])


@pytest.mark.parametrize("case", params(
    small(T=141, cu_seqlens=[0, 3, 140, 141], Hq=2, Hk=2, Hv=2, K=36, V=20, decay="gk",
          update="erase_write", initial_state=True),
    small(B=3, T=130, seq_lens=[130, 0, 5], K=20, V=36, decay="g+gk", initial_state=True,
          state_indices=[1, -1, 3], num_slots=4, state_layout="vk"),
    small(T=150, cu_seqlens=[4, 70, 75, 140], K=16, V=16, decay="g"),                 # uncovered tokens
))
def test_unpacked_spans_write_only_their_tokens(nan_poison, case):
    """Unequal spans run unpacked (chunk indices over the flat token axis); tokens outside every
    span, padding sequences and empty rows read as zeros, the rest as the reference."""
    p = deltarule.validate(**cases.make_inputs(case, "float32", DEVICE))
    assert triton_backend.flat_spans(p.plan) is not None
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


def test_spans_tensors():
    """Chunk indices computed once: (sequence, chunk) per chunk, and each sequence's first chunk."""
    seq, chunks, total = triton_chunked.spans_tensors([(0, 3), (3, 0), (3, 130), (133, 64)], 64, "cpu")
    assert total == 5
    assert seq.tolist() == [[0, 3, 0], [3, 0, 1], [3, 130, 1], [133, 64, 4]]
    assert chunks.tolist() == [[0, 0], [2, 0], [2, 1], [2, 2], [3, 0]]


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_slab_in_place_with_padding(layout):
    """The slab is read and written where it lies (rows state_indices[n], either layout); the
    padding row's output is zero and no other row is touched."""
    case = small(B=3, T=70, K=36, V=20, initial_state=True, state_indices=[3, -1, 0], num_slots=5,
                 decay="gk", update="erase_write", state_layout=layout)
    args = cases.make_inputs(case, "float32", DEVICE)
    slab = args["initial_state"]
    before = slab.clone()
    o, state = check(args, TOL["float32"])
    assert_slab_updated_in_place(state, slab, before, o, case["state_indices"])


@pytest.mark.parametrize("case", params(
    small(T=70, K=100, V=60, initial_state=True),
    small(T=66, K=20, V=72, rule="linear"),
    small(T=145, cu_seqlens=[0, 70, 70, 145], initial_state=True),
    small(B=2, T=70, Hq=4, Hk=2, Hv=2, seq_lens=[70, 3]),
    small(B=2, T=70, initial_state=True, state_indices=[-1, 2], num_slots=3),
    small(B=2, T=65, Hq=2, Hk=2, Hv=4, K=36, V=20, decay="gk", update="erase_write", initial_state=True),
    small(T=129, Hq=4, Hk=2, Hv=2, K=36, V=72, decay="g+gk", cu_seqlens=[0, 65, 65, 129],
          initial_state=True, state_layout="vk"),
))
def test_writes_every_output_element(nan_poison, case):
    """With uninitialised memory poisoned to NaN, outputs and states stay finite and correct."""
    check(cases.make_inputs(case, "float32", DEVICE), TOL["float32"])


@pytest.mark.parametrize("over", [dict(rule="linear"), dict(rule="gated"), dict(rule="delta"),
                                  dict(rule="gated_delta"), dict(raw_gate=True, beta_sigmoid=True),
                                  dict(decay="gk"), dict(decay="g+gk"), dict(update="erase_write"),
                                  dict(rule="delta", update="erase_write"), dict(rule="gated", decay="gk"),
                                  dict(raw_gate=True, decay="gk", update="erase_write")])
def test_every_gate_form_accepted(over):
    p = deltarule.validate(**cases.make_inputs(small(**over), "float32", DEVICE))
    assert p.max_len > triton_backend.RECURRENT_MAX_LEN and triton_backend.supports(p) is None


def test_kernel_refuses_mismatched_gates():
    """A scalar erase gate with a per-value write gate, or a raw gate beside both decays, is not
    an operand form the backend makes."""
    args = cases.make_inputs(small(update="erase_write", decay="g+gk"), "float32", DEVICE)
    p = deltarule.validate(**args)
    x = _prepare.raw_operands(p, _prepare.pack(p))
    with pytest.raises(ValueError, match="erase"):
        triton_chunked.chunked(x.q, x.k, x.v, x.g, x.gk, x.b[..., 0], x.w, None, p.scale)
    A_log = torch.zeros(p.Hv)
    with pytest.raises(ValueError, match="A_log"):
        triton_chunked.chunked(x.q, x.k, x.v, x.g, x.gk, x.b, x.w, None, p.scale, A_log=A_log, dt_bias=A_log)


@triton.jit
def _inverse_kernel(a, t, BT: tl.constexpr, BC: tl.constexpr, LEVELS: tl.constexpr):
    o = tl.arange(0, BT)
    p = o[:, None] * BT + o[None, :]
    tl.store(t + p, triton_chunked._unit_lower_inverse(tl.load(a + p), BT=BT, BC=BC, LEVELS=LEVELS))


@pytest.mark.parametrize("scale", [0.3, 1.0])
def test_unit_lower_inverse(scale):
    """(I + A)^-1 from 16 x 16 diagonal blocks and two merges equals the float64 inverse, for a
    dense strictly lower A whose blocks all matter (every entry of T below the diagonal)."""
    gen = torch.Generator().manual_seed(7)
    A = (torch.rand(64, 64, generator=gen) * 2 - 1).tril(-1) * scale / 8
    T = torch.full((64, 64), float("nan"))
    _inverse_kernel[(1,)](A, T, BT=64, BC=16, LEVELS=2)
    ref = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A.double())
    assert ref.abs()[48:, :16].min() > 0            # the merged corner blocks are non-trivial
    assert torch.isfinite(T).all()
    assert (T.double() - ref).norm() / ref.norm() < 1e-6


@triton.jit
def _dot_kernel(a, b, c, DT: tl.constexpr, N: tl.constexpr):
    o = tl.arange(0, N)
    p = o[:, None] * N + o[None, :]
    tl.store(c + p, triton_common.dot(tl.load(a + p), tl.load(b + p), DT))


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_dot_precision(dt):
    """16-bit inputs: products of operands rounded to bfloat16 (nearest even), float32 sums;
    float32 inputs: exact float32 products."""
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(32, 32, generator=gen) * 3).to(DEVICE), torch.randn(32, 32, generator=gen).to(DEVICE)
    c = torch.full_like(a, float("nan"))
    _dot_kernel[(1,)](a, b, c, DT=getattr(tl, dt), N=32)
    cast = (lambda x: x.bfloat16().double()) if dt == "bfloat16" else (lambda x: x.double())
    ref = cast(a) @ cast(b)
    assert (c.double() - ref).norm() / ref.norm() < 1e-6
    if dt == "bfloat16":                              # and not the float32 product
        assert (c.double() - a.double() @ b.double()).norm() / ref.norm() > 1e-4


# ---- Each stage alone against its torch twin (deltarule/kernels/triton/chunked_ref.py) --------
# A stage gets its twin's outputs of the stages before it, so a failure names one stage. Rows
# outside every span are left out of the comparison (the stages do not write them). Float32
# inputs; the twins compute in float64.

from deltarule.kernels.triton import chunked_ref  # noqa: E402

STAGE_TOL = 2e-5
# packed: 2 rows of 65 tokens (a chunk and one token); spans: 150 flat tokens holding an empty
# sequence, 63, 0, 1 and 80 tokens (80 spans two chunks)
STAGE_LAYOUTS = {"packed": (2, 65, None), "spans": (1, 150, [(0, 0), (0, 63), (63, 0), (63, 1), (64, 80)])}


def stage_inputs(layout: str, decay: str, update: str, seed: int = 0) -> dict:
    """Operands of the stages in the backend's token-major layout: H = 4 state heads, 2 key heads,
    2 query heads of G = 2 rows each, K = 20 (a masked key tile), V = 72 (two value tiles, the
    second partial); decay "none" | "g" | "gk" | "g+gk" | "raw-g" | "raw-gk"; update "beta" |
    "erase_write" | "none"."""
    gen = torch.Generator().manual_seed(seed)
    N, L, spans = STAGE_LAYOUTS[layout]
    H, Hk, Hq, G, K, V = 4, 2, 2, 2, 20, 72
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    uni = lambda *s: torch.rand(*s, generator=gen).to(DEVICE)  # noqa: E731
    x = dict(q=rnd(N, L, Hq, G, K), k=torch.nn.functional.normalize(rnd(N, L, Hk, K), dim=-1), v=rnd(N, L, H, V),
             g=None, gk=None, A_log=None, dt_bias=None, b=None, w=None)
    raw = decay.startswith("raw-")
    if "gk" in decay:
        x["gk"] = rnd(N, L, H, K) if raw else -uni(N, L, H, K) * 0.3
    if decay in ("g", "g+gk", "raw-g"):
        x["g"] = rnd(N, L, H) if raw else -uni(N, L, H)
    if raw:
        x["A_log"], x["dt_bias"] = rnd(H) * 0.5, rnd(*((H, K) if "gk" in decay else (H,)))
    if update == "beta":
        x["b"] = x["w"] = uni(N, L, H)
    elif update == "erase_write":
        x["b"], x["w"] = uni(N, L, H, K), uni(N, L, H, V)
    lay = triton_chunked.chunk_layout(N, L, H, spans, DEVICE)
    return x, lay


def in_spans(x: torch.Tensor, lay) -> torch.Tensor:
    """The rows of a [N, L, ...] tensor that lie in a span, [tokens, ...]."""
    flat = x.reshape(lay.N * lay.L, *x.shape[2:])
    rows = [r for _, _, _, span in chunked_ref.chunks(lay) for r in range(span.start, span.stop)]
    return flat[torch.tensor(rows, dtype=torch.int64, device=flat.device)]


def stage_id(layout, decay, update):
    return f"{layout}-{decay}-{update}"


def twin_gc(x, lay):
    """(gc of the twin or None, the scalar g the later stages take)."""
    if x["gk"] is None:
        return None, x["g"]
    return chunked_ref.chunk_cumsum_ref(x["g"], x["gk"], x["A_log"], x["dt_bias"], lay), None


@pytest.mark.parametrize("layout", STAGE_LAYOUTS)
@pytest.mark.parametrize("decay", ["gk", "g+gk", "raw-gk"])
def test_stage_cumsum_matches_its_twin(decay, layout):
    x, lay = stage_inputs(layout, decay, "none")
    got = triton_chunked.chunk_cumsum(x["g"], x["gk"], x["A_log"], x["dt_bias"], lay)
    want = chunked_ref.chunk_cumsum_ref(x["g"], x["gk"], x["A_log"], x["dt_bias"], lay)
    assert got.dtype == torch.float64
    assert rel(in_spans(got, lay), in_spans(want, lay)) < STAGE_TOL


INTRA_FORMS = [("packed", "none", "beta"), ("packed", "g", "beta"), ("packed", "gk", "erase_write"),
               ("packed", "raw-g", "erase_write"), ("spans", "g+gk", "beta"), ("spans", "g", "erase_write")]


@pytest.mark.parametrize("layout,decay,update", INTRA_FORMS, ids=[stage_id(*f) for f in INTRA_FORMS])
def test_stage_intra_matches_its_twin(layout, decay, update):
    """A, T = (I + A)^-1, Ũ and Y; the raw-gate form also with beta_sigmoid and qk_l2norm."""
    x, lay = stage_inputs(layout, decay, update)
    gc, g = twin_gc(x, lay)
    extra = dict(beta_sigmoid=True, l2norm_eps=1e-6) if decay.startswith("raw") else {}
    got = triton_chunked.chunk_intra(x["k"], x["v"], g, x["A_log"], x["dt_bias"], gc, x["b"], x["w"], lay, **extra)
    want = chunked_ref.chunk_intra_ref(x["k"], x["v"], g, x["A_log"], x["dt_bias"], gc, x["b"], x["w"], lay, **extra)
    for name, a, b in zip(("u", "y"), got, want):
        assert rel(in_spans(a, lay), in_spans(b, lay)) < STAGE_TOL, name


STATE_FORMS = [("packed", "none", "none"), ("packed", "g", "beta"), ("packed", "gk", "erase_write"),
               ("spans", "raw-g", "beta"), ("spans", "g+gk", "erase_write"), ("spans", "none", "none")]


@pytest.mark.parametrize("layout,decay,update", STATE_FORMS, ids=[stage_id(*f) for f in STATE_FORMS])
def test_stage_state_matches_its_twin(layout, decay, update):
    """The states entering every chunk, U = Ũ - Y S, the final states (from a given S0)."""
    x, lay = stage_inputs(layout, decay, update)
    gc, g = twin_gc(x, lay)
    u, y = x["v"], None
    if update != "none":
        u, y = (t.float() for t in chunked_ref.chunk_intra_ref(x["k"], x["v"], g, x["A_log"], x["dt_bias"], gc,
                                                              x["b"], x["w"], lay))
    H, K, V = x["v"].shape[2], x["k"].shape[3], x["v"].shape[3]
    S0 = torch.randn(lay.n_seq, H, K, V, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want_h, want_u, want_S = chunked_ref.chunk_state_ref(x["k"], u, y, g, x["A_log"], x["dt_bias"], gc, S0, lay)
    u_stage = u.clone()                                       # rewritten in place (with y)
    S = torch.empty_like(S0)
    h = triton_chunked.chunk_state(x["k"], u_stage, y, g, x["A_log"], x["dt_bias"], gc, S0, S, lay)
    assert rel(h[:lay.n_chunks], want_h[:lay.n_chunks]) < STAGE_TOL
    assert rel(S, want_S) < STAGE_TOL
    assert rel(in_spans(u_stage, lay), in_spans(want_u, lay)) < STAGE_TOL


def test_stage_state_reads_and_writes_slab_rows_in_place():
    """The state stage's addressing: a V-major ("vk") slab read at state_indices and updated in
    place (S = S0), a padding sequence (index -1: starts from zeros, no row touched), slab rows
    no sequence names (untouched)."""
    x, lay = stage_inputs("spans", "gk", "beta")
    gc, g = twin_gc(x, lay)
    u, y = (t.float() for t in chunked_ref.chunk_intra_ref(x["k"], x["v"], g, x["A_log"], x["dt_bias"], gc,
                                                          x["b"], x["w"], lay))
    H, K, V = x["v"].shape[2], x["k"].shape[3], x["v"].shape[3]
    slab = torch.randn(lay.n_seq + 2, H, V, K, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    idx = torch.tensor([3, -1, 0, 5, 1], device=DEVICE)        # rows 2, 4 and 6 are no sequence's
    S0 = torch.where((idx >= 0)[:, None, None, None], slab[idx.clamp_min(0)].transpose(-1, -2), 0.0)
    want_h, want_u, want_S = chunked_ref.chunk_state_ref(x["k"], u, y, g, x["A_log"], x["dt_bias"], gc, S0, lay)
    before = slab.clone()
    h = triton_chunked.chunk_state(x["k"], u, y, g, x["A_log"], x["dt_bias"], gc, slab, slab, lay,
                                   state_indices=idx, state_layout="vk")
    assert rel(h[:lay.n_chunks], want_h[:lay.n_chunks]) < STAGE_TOL
    assert rel(in_spans(u, lay), in_spans(want_u, lay)) < STAGE_TOL           # u rewritten in place as U
    live = idx >= 0
    assert rel(slab[idx[live]].transpose(-1, -2), want_S[live]) < STAGE_TOL
    untouched = torch.tensor([2, 4, 6], device=DEVICE)
    assert torch.equal(slab[untouched], before[untouched])


OUTPUT_FORMS = [("packed", "none", "none"), ("packed", "g", "beta"), ("packed", "gk", "beta"),
                ("spans", "raw-gk", "erase_write"), ("spans", "g", "none")]


@pytest.mark.parametrize("layout,decay,update", OUTPUT_FORMS, ids=[stage_id(*f) for f in OUTPUT_FORMS])
def test_stage_output_matches_its_twin(layout, decay, update):
    """O = scale [(Q ⊙ exp(G)) h + M U], zero outside every span; with qk_l2norm."""
    x, lay = stage_inputs(layout, decay, update)
    gc, g = twin_gc(x, lay)
    u, y = x["v"], None
    if update != "none":
        u, y = chunked_ref.chunk_intra_ref(x["k"], x["v"], g, x["A_log"], x["dt_bias"], gc, x["b"], x["w"], lay)
    H, K, V = x["v"].shape[2], x["k"].shape[3], x["v"].shape[3]
    S0 = torch.randn(lay.n_seq, H, K, V, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    h, U, _ = chunked_ref.chunk_state_ref(x["k"], u, y, g, x["A_log"], x["dt_bias"], gc, S0, lay)
    h, U = h.float(), U.float()
    got = triton_chunked.chunk_output(x["q"], x["k"], U, g, x["A_log"], x["dt_bias"], gc, h, lay, scale=0.3,
                                      l2norm_eps=1e-6)
    want = chunked_ref.chunk_output_ref(x["q"], x["k"], U, g, x["A_log"], x["dt_bias"], gc, h, lay, scale=0.3,
                                        l2norm_eps=1e-6)
    assert rel(got, want) < STAGE_TOL                         # (zeros outside the spans included)
