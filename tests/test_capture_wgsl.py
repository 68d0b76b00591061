"""The wgsl backend's compact transition capture against the float64 reference.

A call with `capture` runs the recurrent shader (kernels/wgsl/recurrent.wgsl.jinja) with its
capture writes: each live sequence's first min(C, length) transitions (decay factors, the key
as the recurrence uses it, the delta u) land in a device copy of the caller's buffer, copied
back after the call. Every buffer starts as NaN: an entry the shader should have written and
did not shows up as NaN, and the entries it must leave alone (past a sequence's count, a
padding sequence's row) must still be NaN afterwards. Shapes stay small (lavapipe).
"""

import dataclasses

import pytest

from conftest import case_id, check_capture, poisoned_capture, rel, run_capture

from deltarule.kernels.wgsl import _device

_REASON = _device.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"no WebGPU device for the wgsl backend: {_REASON}", allow_module_level=True)

import torch  # noqa: E402

import deltarule  # noqa: E402
from deltarule import WgslStateSlab, cases, reference  # noqa: E402
from deltarule.tools import check  # noqa: E402
from deltarule.backends import wgsl_backend  # noqa: E402
from deltarule.kernels.wgsl import recurrent  # noqa: E402

pytestmark = pytest.mark.wgsl

# o and the returned state per input dtype (tests/test_wgsl.py's); the captured factors are
# float32 computed from the inputs' values whatever their dtype: float32's bound for every dtype
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
CAPTURE_TOL = 2e-5


def small(**over) -> dict:
    """A test.json-style case dict of tiny sizes, overridable."""
    case = dict(seed=480, B=2, T=5, Hq=2, Hk=2, Hv=2, K=16, V=24, rule="gated_delta", initial_state=True)
    case.update(over)
    return case


@pytest.mark.parametrize("case,dtype", [
    pytest.param(c, d, id=f"{c['name']}-{d}") for c in cases.test_cases() if c.get("capture") for d in c["dtypes"]
])
def test_test_json_capture_case(case, dtype):
    """test.json's capture-* cases through `check.compare` (o, state and the capture buffer)."""
    r = check.compare(case, dtype, "wgsl")
    assert r.passed, r


# (case, C): the shader writes the decays from the first value tile's key column, the key from
# the first state head of each key head, the delta from each value column's first key slice
CASES = [
    # scalar decay, beta; T above C
    (small(T=7), 3),
    # the raw-gate arm of a scalar decay, sigmoid of beta, fused L2 norm (normalized keys); T at C
    (small(V=40, raw_gate=True, beta_sigmoid=True, qk_l2norm=True), 5),
    # GDN-2: per-key decay through the raw-gate arm, erase / write; GVA 2x, K = 100 (4 key slices
    # with a partial last one), V = 36 (two value tiles, one partial); T below C
    (small(B=1, T=3, Hq=2, Hk=2, Hv=4, K=100, V=36, decay="gk", update="erase_write", raw_gate=True), 4),
    # g + gk summed; GQA 2x (query heads share a state head); T at C
    (small(T=6, Hq=4, Hk=2, Hv=2, V=32, decay="g+gk"), 6),
    # rules without decay or retrieval: decay factors 1, delta = v (linear), delta = v (gated)
    (small(T=4, rule="linear", decay="none", update="none"), 2),
    (small(T=4, rule="gated", decay="gk", update="none", state_layout="vk"), 4),
    # varlen with an empty sequence (lengths 3, 0, 5: below and above C); the delta rule
    (small(B=1, T=8, cu_seqlens=[0, 3, 3, 8], rule="delta", decay="none"), 4),
    # decode: one token per sequence; GVA 4x, per-key decay, C above T
    (small(B=3, T=1, Hq=1, Hk=1, Hv=4, K=32, V=20, decay="gk", update="erase_write", qk_l2norm=True), 2),
    # strong decays with a -inf reset inside the captured prefix: a decay factor of exactly 0
    (small(B=1, T=6, decay="gk", decay_range=[-6.0, -2.0], decay_resets=[2]), 6),
]


@pytest.mark.parametrize("case,C", [pytest.param(c, C, id=f"{case_id(c)}-C{C}") for c, C in CASES])
def test_capture_matches_reference(case, C):
    run_capture(cases.make_inputs(case, "float32"), C, "wgsl", TOL["float32"], CAPTURE_TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_inputs_capture_in_float32(dtype):
    case = small(B=2, T=4, Hq=2, Hk=2, Hv=4, K=24, V=20, decay="gk", qk_l2norm=True, raw_gate=True)
    run_capture(cases.make_inputs(case, dtype), 3, "wgsl", TOL[dtype], CAPTURE_TOL)


def test_capture_across_dispatch_segments(monkeypatch):
    """Sequences longer than a dispatch's segment run as several dispatches: each captures the
    transitions of its tokens at their index in the sequence (segments of 3 tokens here)."""
    monkeypatch.setattr(recurrent, "SEGMENT", 3)
    args = cases.make_inputs(small(B=1, T=11, cu_seqlens=[0, 8, 8, 11], decay="gk"), "float32")
    _, _, p, sol = run_capture(args, 7, "wgsl", TOL["float32"], CAPTURE_TOL)
    assert sol.capture.count.tolist() == [7, 0, 3]


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_device_slab_verify_reads_the_rows_and_stores_nothing(layout):
    """WgslStateSlab + capture is a verify: the slab rows the call reads keep every bit, o and the
    capture are the reference's (the draft tokens on the rows' states), the padding sequence
    (index -1) captures nothing and has a zero output."""
    case = small(B=3, T=4, Hq=2, Hk=2, Hv=4, K=16, V=20, initial_state=True, state_indices=[2, -1, 0],
                 num_slots=4, decay="gk", state_layout=layout, qk_l2norm=True)
    args = cases.make_inputs(case, "float32")
    rows = args["initial_state"].clone()
    args["capture"] = poisoned_capture(args, 3)
    p = deltarule.validate(**args)
    sol = reference.solve(p)
    args["initial_state"] = WgslStateSlab.from_tensor(rows, layout=layout)
    o, state = deltarule.linear_attention(**args, backend="wgsl")
    assert state is args["initial_state"] and torch.equal(state.download(), rows)
    assert rel(o, sol.o) <= TOL["float32"]
    check_capture(p, sol.capture, CAPTURE_TOL)
    assert sol.capture.count.tolist() == [3, 0, 3]
    assert torch.isnan(args["capture"][1]).all() and torch.count_nonzero(o[1]) == 0


def test_torch_slab_verify_stores_nothing():
    """The same verify on a torch slab (a device copy of the read rows): every slab row keeps its bits."""
    case = small(B=3, T=5, state_indices=[3, -1, 1], num_slots=5, decay="g+gk", update="erase_write")
    args = cases.make_inputs(case, "float32")
    before = args["initial_state"].clone()
    _, state, p, sol = run_capture(args, 4, "wgsl", TOL["float32"], CAPTURE_TOL)
    assert state is args["initial_state"] and torch.equal(state, before)
    assert sol.capture.count.tolist() == [4, 0, 4]


def test_verify_then_replay_commits_the_accepted_tokens():
    """Verify on the device slab, then `deltarule.replay` of each sequence's accepted count onto a
    host copy of its row: the reference's state after that many tokens."""
    case = small(B=2, T=4, Hq=2, Hk=2, Hv=4, K=16, V=20, state_indices=[1, 0], num_slots=3, decay="gk",
                 update="erase_write", qk_l2norm=True)
    args = cases.make_inputs(case, "float32")
    rows = args["initial_state"].clone()
    args["capture"] = poisoned_capture(args, 4)
    args["initial_state"] = WgslStateSlab.from_tensor(rows)
    deltarule.linear_attention(**args, backend="wgsl")
    accepted = [3, 1]
    committed = rows.clone()
    deltarule.replay(committed, args["capture"], torch.tensor(accepted), key_heads=2, per_key_decay=True,
                     state_indices=args["state_indices"])
    dense = {n: x for n, x in args.items() if n not in ("state_indices", "capture", "initial_state")}
    for n, row in enumerate([1, 0]):
        one = {name: x[n:n + 1, :accepted[n]] if isinstance(x, torch.Tensor) and x.dim() >= 3 else x
               for name, x in dense.items()}
        _, want = deltarule.linear_attention(**one, initial_state=rows[row:row + 1].clone(), backend="reference")
        e = rel(committed[row], want[0].numpy())
        assert e <= TOL["float32"], f"sequence {n}: err={e:.2e}"


def test_capture_needs_one_more_storage_buffer(monkeypatch):
    """The capture is one more storage binding: an adapter without it declines the call (with the
    reason), one with exactly enough runs it."""
    args = cases.make_inputs(small(T=2, decay="gk", update="erase_write"), "float32")
    args["capture"] = poisoned_capture(args, 2)
    p = deltarule.validate(**args)
    need = recurrent.bindings_needed(p)
    assert need == 10                                  # table, state, out, q, k, v, gk, erase, write, capture
    real = _device.gpu()
    monkeypatch.setattr(_device, "gpu", lambda: dataclasses.replace(real, max_storage_buffers=need - 1))
    assert f"needs {need} storage buffers" in wgsl_backend.supports(p)
    monkeypatch.setattr(_device, "gpu", lambda: dataclasses.replace(real, max_storage_buffers=need))
    assert wgsl_backend.supports(p) is None
