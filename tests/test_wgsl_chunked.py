"""The wgsl backend's chunked prefill (`deltarule/kernels/wgsl/chunked.py`) against the float64
reference, forced on (MIN_TOKENS = 1) for every feature the recurrent shader has.

Every test asserts that the chunked passes ran (`used_chunked`), so none can pass on the
recurrent shader by accident. Output buffers start NaN: an element the shader skips shows up.
"""

import pytest

from conftest import assert_slab_updated_in_place, case_id, err, state_dtype, state_tol

from deltarule.kernels.wgsl import _device

_REASON = _device.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"no WebGPU device for the wgsl backend: {_REASON}", allow_module_level=True)

import torch  # noqa: E402

import deltarule  # noqa: E402
from deltarule import cases  # noqa: E402
from deltarule.tools.check import expected  # noqa: E402
from deltarule import WgslStateSlab  # noqa: E402
from deltarule.kernels.wgsl import chunked  # noqa: E402

pytestmark = pytest.mark.wgsl

TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def small(**over) -> dict:
    case = dict(name="small", seed=300, B=2, T=65, Hq=2, Hk=2, Hv=2, K=16, V=24, rule="gated_delta")
    case.update(over)
    return case


@pytest.fixture
def used_chunked(monkeypatch):
    """Force the chunked path (MIN_TOKENS = 1) and count its calls (`calls[0]`, checked by `check`)."""
    calls = [0]
    real = chunked.chunked

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked, "MIN_TOKENS", 1)
    monkeypatch.setattr(chunked, "chunked", counting)
    return calls


def check(args: dict, tol: float, calls: list, chunk_size: int = 64):
    ref_o, ref_state = expected(args)          # before the call: a slab is updated in place
    before = calls[0]
    o, state = deltarule.linear_attention(**args, backend="wgsl", chunk_size=chunk_size)
    assert calls[0] == before + 1, "the chunked path did not run"
    assert o.dtype == args["v"].dtype and state.dtype == state_dtype(args)
    e_o, e_s = err(o, ref_o), err(state, ref_state)
    assert e_o <= tol and e_s <= state_tol(args, tol), f"err(o)={e_o:.2e} err(S)={e_s:.2e} tol={tol:.0e}"
    return o, state


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 63, 65, 130])
def test_lengths_and_chunk_sizes(used_chunked, nan_output, T, chunk_size):
    """T = 1, 63, 65, 130 across chunk boundaries at C = 16, 32, 64 (odd V, GDN-2 gates, g + gk)."""
    case = small(B=2, T=T, K=36, V=33, decay="g+gk", update="erase_write", initial_state=True)
    check(cases.make_inputs(case), TOL["float32"], used_chunked, chunk_size)


@pytest.mark.parametrize("case,chunk_size", [
    pytest.param(small(B=1, T=130, Hq=2, Hk=2, Hv=4, K=100, V=33, decay="gk", initial_state=True), 64,
                 id="B1-T130-Hq2-Hv4-K100-V33-gk-state-kv-C64"),
    pytest.param(small(B=2, T=65, K=100, V=21, decay="g", initial_state=True), 16,
                 id="B2-T65-H2-K100-V21-g-state-kv-C16"),
])
def test_k100(used_chunked, nan_output, case, chunk_size):
    """K = 100 (padded to the vec4 words), odd V, GVA."""
    check(cases.make_inputs(case), TOL["float32"], used_chunked, chunk_size)


FEATURES = [
    small(Hq=8, Hk=2, Hv=2, K=32, V=33, decay="g+gk"),                         # GQA 4x
    small(Hq=4, Hk=4, Hv=8, K=20, V=40, decay="gk", initial_state=True),      # GVA 2x, KDA
    small(Hq=2, Hk=2, Hv=8, K=20, V=12, decay="g", initial_state=True),       # GVA 4x, GDN
    small(K=24, V=40, decay="gk", update="erase_write", beta_sigmoid=True, initial_state=True),  # GDN-2
    small(K=40, V=24, raw_gate=True, beta_sigmoid=True, qk_l2norm=True, initial_state=True),   # raw g arm
    small(K=24, V=20, decay="gk", raw_gate=True, update="erase_write", initial_state=True),    # raw gk arm
    small(Hq=6, Hk=3, Hv=3, K=20, V=9, qk_l2norm=True, decay="g+gk", initial_state=True),
    small(rule="delta", decay="none", update="beta", initial_state=True),      # no decay
    small(rule="delta", decay="none", update="erase_write", initial_state=True),
    small(rule="gated", decay="g", update="none", initial_state=True),         # no beta (linear update)
    small(rule="gated", decay="gk", update="none", initial_state=True),
    small(rule="linear", decay="none", update="none", initial_state=True),
    small(K=24, V=40, decay="gk", initial_state=True, state_layout="vk"),
    small(K=24, V=40, initial_state=True, state_layout="vk", qk_l2norm=True),
]


@pytest.mark.parametrize("case", FEATURES, ids=case_id)
def test_features(used_chunked, nan_output, case):
    check(cases.make_inputs(case), TOL["float32"], used_chunked, chunk_size=16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [
    small(B=2, T=70, Hq=2, Hk=2, Hv=4, K=36, V=24, decay="gk", qk_l2norm=True, initial_state=True),
    small(B=1, T=40, Hq=6, Hk=3, Hv=3, K=20, V=9, update="erase_write", raw_gate=True, beta_sigmoid=True),
], ids=case_id)
def test_half_inputs(used_chunked, nan_output, case, dtype):
    """16-bit inputs are packed pairs on the device (odd element counts included)."""
    check(cases.make_inputs(case, dtype), TOL[dtype], used_chunked, chunk_size=32)


@pytest.mark.parametrize("case", [
    small(B=1, T=130, cu_seqlens=[0, 0, 37, 37, 130], initial_state=True, decay="gk"),   # empty requests
    small(B=1, T=90, cu_seqlens=[-3, 50, 20, 140], initial_state=True, state_layout="vk"),  # clamped, overlap
    small(B=3, T=40, seq_lens=[40, 0, 17], initial_state=True, Hq=4, Hk=2, Hv=2, decay="g+gk"),
    small(B=1, T=80, cu_seqlens=[0, 33, 33, 80], initial_state=True, state_indices=[2, 0, -1], num_slots=4),
], ids=case_id)
def test_varlen(used_chunked, case):
    check(cases.make_inputs(case), TOL["float32"], used_chunked, chunk_size=16)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_torch_slab_rows_in_place(used_chunked, layout):
    case = small(B=3, T=40, K=20, decay="gk", initial_state=True, state_indices=[3, -1, 0], num_slots=5,
                 state_layout=layout)
    args = cases.make_inputs(case)
    slab = args["initial_state"]
    before = slab.clone()
    o, state = check(args, TOL["float32"], used_chunked, chunk_size=16)
    assert_slab_updated_in_place(state, slab, before, o, case["state_indices"])


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_device_slab_prefill_then_decode(used_chunked, layout):
    """A chunked prefill on a WgslStateSlab, then a decode step (recurrent shader) from the rows
    it left: both equal the reference of the whole sequence; other rows untouched."""
    case = small(B=2, T=41, K=36, V=20, decay="gk", update="erase_write", initial_state=True,
                 state_indices=[3, 1], num_slots=5, state_layout=layout)
    args = cases.make_inputs(case)
    host_slab = args["initial_state"]
    ref_o, ref_slab = expected(args)
    slab = WgslStateSlab.from_tensor(host_slab, layout=layout)
    head = {n: (x[:, :40] if n in ("q", "k", "v", "gk", "erase", "write") else x) for n, x in args.items()}
    tail = {n: (x[:, 40:] if n in ("q", "k", "v", "gk", "erase", "write") else x) for n, x in args.items()}
    o1, state = deltarule.linear_attention(**dict(head, initial_state=slab), backend="wgsl", chunk_size=16)
    assert state is slab and used_chunked[0] == 1
    chunked_calls = used_chunked[0]
    o2, _ = deltarule.linear_attention(**dict(tail, initial_state=slab), backend="wgsl", chunk_size=16)
    assert used_chunked[0] == chunked_calls + 1        # T = 1 is still forced chunked here
    rows = slab.download()
    assert err(torch.cat([o1, o2], dim=1), ref_o) <= TOL["float32"] and err(rows, ref_slab) <= TOL["float32"]
    for row in (0, 2, 4):
        assert torch.equal(rows[row], host_slab[row])


@pytest.mark.parametrize("case", [
    small(B=1, T=300, K=32, V=20, decay="gk", decay_range=[-8.0, -4.0], initial_state=True),
    small(B=1, T=300, K=32, V=20, decay="g", decay_range=[-30.0, -10.0], initial_state=True),
    small(B=1, T=130, K=32, V=32, decay="g", decay_range=[-0.05, -0.01], initial_state=True,
          decay_resets=list(range(0, 64, 2)) + [100, 129]),
    small(B=1, T=130, K=32, V=32, decay="gk", decay_range=[-0.05, -0.01], initial_state=True,
          decay_resets=list(range(0, 64, 2)) + [100, 129]),
    small(B=2, T=80, Hv=4, K=32, V=32, decay="g+gk", update="erase_write", initial_state=True,
          decay_resets=[0, 64, 79]),
], ids=lambda c: case_id(c) + ("-resets" if c.get("decay_resets") else ""))
def test_strong_decay_and_resets_stay_finite(used_chunked, nan_output, case):
    """Strong decay over a long sequence and -inf log decays (resets): finite, as the reference
    (exponents are differences within a chunk; resets clamp at -110; G is a compensated sum)."""
    o, state = check(cases.make_inputs(case), 2e-5, used_chunked, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()


def test_segments_continue_the_state_in_place(used_chunked, monkeypatch):
    """A loop budget of 2 chunks per segment: the passes run per segment, the state continues."""
    monkeypatch.setattr(chunked, "LOOP_BUDGET", 2 * chunked.loops_per_chunk(0, 16))
    case = small(B=1, T=130, cu_seqlens=[0, 3, 3, 130], initial_state=True, decay="gk", update="erase_write")
    args = cases.make_inputs(case)
    assert chunked.segment_chunks(deltarule.validate(**args, chunk_size=16)) == 2
    check(args, TOL["float32"], used_chunked, chunk_size=16)


def test_chunk_length_rule():
    assert [chunked.chunk_length(c) for c in (1, 8, 16, 17, 32, 48, 64, 65, 1024)] == [16, 16, 16, 32, 32, 64, 64,
                                                                                        64, 64]
    # a large query group shrinks C until both passes' workgroup memory fits 16 KiB
    assert chunked.chunk_length(64, G=16) == 32 and chunked.fits(32, 16, 4, 16384)
    assert not chunked.fits(16, 64, 4, 16384)


def test_dispatcher_uses_the_chunked_path_only_for_long_sequences(monkeypatch):
    """Default threshold: sequences of MIN_TOKENS or more go chunked; shorter calls and
    speculative plans take the recurrent shader."""
    calls = [0]
    real = chunked.chunked

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked, "chunked", counting)
    T = chunked.MIN_TOKENS
    short = cases.make_inputs(small(B=1, T=T - 1, K=16, V=8, initial_state=True))
    deltarule.linear_attention(**short, backend="wgsl")
    assert calls[0] == 0
    check(cases.make_inputs(small(B=2, T=T, K=16, V=8, initial_state=True, decay="gk")), TOL["float32"], calls)
    spec = cases.make_inputs(small(B=2, T=3, K=16, V=8, decay="gk", initial_state=True,
                                   state_indices=[[0, 1, 2], [3, 4, 5]], num_slots=6))
    deltarule.linear_attention(**spec, backend="wgsl")
    assert calls[0] == 1
