"""The cpu backend's compact transition capture against the float64 reference.

A call with `capture` makes the native kernel (kernels/cpu/csrc/recurrent.c) write each
live sequence's first min(C, length) transitions (decay factors, key, delta u) into the
capture buffer, on both of its paths: value tiles (prefill) and whole rows (a single
token). Every buffer starts as NaN: an entry the kernel should have written and did not
shows up as NaN in the comparison, and the entries it must leave alone (past a
sequence's count, a padding sequence's row) must still be NaN after the call.
"""

import numpy as np
import pytest
import torch

import deltarule
from conftest import case_id, poisoned_capture, rel, run_capture, state_tol
from deltarule import cases, reference
from deltarule.backends import cpu_backend

pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason="the native cpu kernel is not built")

# o and the returned state, per input dtype (tests/test_cpu_backend.py's); a 16-bit
# state adds its rounding (conftest.state_tol)
TOL = {"float32": 5e-5, "bfloat16": 1e-2, "float16": 1e-2}
# The captured factors are float32 computed from the inputs' exact values whatever their
# dtype (nothing is rounded to 16 bits on the way), so every dtype meets float32's bound.
CAPTURE_TOL = 1e-5


def small(**over) -> dict:
    """A test.json-style case dict of tiny sizes, overridable."""
    case = dict(seed=48, B=2, T=5, Hq=2, Hk=2, Hv=2, K=16, V=24, rule="gated_delta", initial_state=True)
    case.update(over)
    return case


def ident(case: dict, C: int) -> str:
    """A readable test id: the case's (conftest.case_id), a 16-bit state's dtype, the capacity."""
    state = f"-state_{case['state_dtype']}" if case.get("state_dtype") else ""
    return f"{case_id(case)}{state}-C{C}"


# (case, C). On AVX2 a tile is 32 value columns, 64 on AVX-512: V = 24 is one partial tile,
# V = 72 several (the last partial), V = 32 / 64 whole ones; a single token runs on whole rows
# (V a multiple of the tile), longer sequences on tiles.
CASES = [
    # scalar decay, beta; T above C
    (small(T=7), 3),
    # the raw-gate arm (A_log, dt_bias) of a scalar decay, sigmoid of beta, fused L2 norm; T at C
    (small(V=64, raw_gate=True, beta_sigmoid=True, qk_l2norm=True), 5),
    # GDN-2: per-key decay through the raw-gate arm, erase / write; GVA (2 state heads per key
    # head: one writes the key), K = 100; T below C
    (small(B=1, T=3, Hq=2, Hk=2, Hv=4, K=100, V=72, decay="gk", update="erase_write", raw_gate=True), 4),
    # g + gk summed; GQA (2 query heads per state head); T at C
    (small(T=6, Hq=4, Hk=2, Hv=2, V=32, decay="g+gk"), 6),
    # the linear rule: decay factors 1, delta = v
    (small(T=4, rule="linear", decay="none", update="none"), 2),
    # the gated rule with per-key decay: delta = v
    (small(T=4, rule="gated", decay="gk", update="none"), 4),
    # varlen with an empty sequence (lengths 3, 0, 5: below and above C); the delta rule
    (small(B=1, T=8, cu_seqlens=[0, 3, 3, 8], rule="delta", decay="none"), 4),
    # varlen with a one-token sequence (whole rows) beside a tiled one
    (small(B=1, T=6, V=64, cu_seqlens=[0, 1, 1, 6], decay="gk", qk_l2norm=True), 3),
    # decode: one token per sequence on whole rows; GVA, per-key decay, C above T
    (small(B=3, T=1, Hq=2, Hk=2, Hv=4, K=32, V=64, decay="gk", update="erase_write", qk_l2norm=True), 2),
    # 40 tokens, C = 20: the capture crosses the kernel's 16-token key-side blocks; strong decays
    # make the lazy decay restart, so a factor carrying the lazy scale would show
    (small(B=1, T=40, Hq=1, Hk=1, Hv=1, V=32, decay="gk", decay_range=[-4.0, -1.0]), 20),
]


@pytest.mark.parametrize("case,C", [pytest.param(c, C, id=ident(c, C)) for c, C in CASES])
def test_capture_matches_reference(case, C):
    run_capture(cases.make_inputs(case, "float32"), C, "cpu", TOL["float32"], CAPTURE_TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case,C", [
    pytest.param(c, C, id=ident(c, C)) for c, C in (
        (small(T=7, raw_gate=True, qk_l2norm=True), 3),
        (small(B=2, T=1, Hq=2, Hk=2, Hv=4, K=32, V=64, decay="gk", state_dtype="bfloat16"), 1),
    )])
def test_16_bit_inputs_capture_in_float32(case, C, dtype):
    run_capture(cases.make_inputs(case, dtype), C, "cpu", TOL[dtype], CAPTURE_TOL)


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("T", [1, 5], ids=["T1-rows", "T5-tiles"])
def test_verify_reads_the_slab_and_writes_no_row(T, layout):
    """Slab + capture is a verify: the plan stores nothing (final and token rows -1), so every
    slab row is bit-identical after the call, on both kernel paths; the padding sequence
    (index -1) captures nothing and leaves its row NaN."""
    case = small(B=3, T=T, Hq=2, Hk=2, Hv=4, V=64, state_indices=[2, -1, 0], num_slots=4, decay="gk",
                 state_layout=layout, qk_l2norm=True)
    args = cases.make_inputs(case, "float32")
    before = args["initial_state"].clone()
    o, state, p, sol = run_capture(args, 3, "cpu", TOL["float32"], CAPTURE_TOL)
    assert all(s.final == -1 for s in p.spans) and (p.plan.token_rows is None or (p.plan.token_rows == -1).all())
    assert state is args["initial_state"] and torch.equal(state, before)
    assert sol.capture.count.tolist() == [min(3, T), 0, min(3, T)]
    assert torch.isnan(args["capture"][1]).all() and torch.count_nonzero(o[1]) == 0


def reference_states_after(args: dict, n: int, c: int) -> np.ndarray:
    """The reference's state of dense batch row n after its first c tokens, [Hv, K, V] float64
    ("kv"): the reference run on the first c tokens of that row alone."""
    sliced = {name: (x[n:n + 1, :c] if name in ("q", "k", "v", "g", "gk", "beta", "erase", "write") else x)
              for name, x in args.items() if name != "capture"}
    if "initial_state" in args:
        sliced["initial_state"] = args["initial_state"][n:n + 1]
    _, state = deltarule.linear_attention(**sliced, backend="reference")
    return state[0].numpy()


@pytest.mark.parametrize("case,C", [pytest.param(c, C, id=ident(c, C)) for c, C in (
    (small(B=2, T=5, Hq=2, Hk=2, Hv=4, V=32, decay="gk", update="erase_write", qk_l2norm=True), 4),
    (small(B=2, T=3, Hq=4, Hk=2, Hv=2, V=64, raw_gate=True, beta_sigmoid=True), 3),
)])
def test_replay_reproduces_the_reference_states(case, C):
    """Replaying the first c captured transitions of a row onto its initial state gives the
    reference's state after token c, for every c up to the count."""
    args = cases.make_inputs(case, "float32")
    _, _, p, sol = run_capture(args, C, "cpu", TOL["float32"], CAPTURE_TOL)
    for n, count in enumerate(sol.capture.count.tolist()):
        for c in range(1, count + 1):
            state = args["initial_state"][n:n + 1].clone()
            deltarule.replay(state, args["capture"][n:n + 1], torch.tensor([c]), key_heads=p.Hk,
                             per_key_decay=p.per_key_decay)
            e = rel(state[0], reference_states_after(args, n, c))
            assert e <= TOL["float32"], f"sequence {n}, {c} transitions: err={e:.2e}"


def test_replay_after_a_verify_commits_the_accepted_tokens():
    """Verify then replay: the slab rows the replay commits equal the reference's state after
    each sequence's accepted tokens; the padding sequence's and the unaddressed rows keep
    every bit."""
    case = small(B=3, T=4, Hv=2, V=32, state_indices=[3, -1, 1], num_slots=5, decay="g+gk")
    args = cases.make_inputs(case, "float32")
    slab = args["initial_state"]
    reads = {n: slab[row].clone() for n, row in enumerate([3, -1, 1]) if row >= 0}
    before = slab.clone()
    _, _, p, _ = run_capture(args, 4, "cpu", TOL["float32"], CAPTURE_TOL)
    accepted = [2, 0, 4]
    deltarule.replay(slab, args["capture"], torch.tensor(accepted), key_heads=p.Hk, per_key_decay=True,
                     state_indices=args["state_indices"])
    for row in (0, 2, 4):
        assert torch.equal(slab[row], before[row]), f"slab row {row}"
    dense = {n: x for n, x in args.items() if n not in ("state_indices", "capture")}
    for n, row in ((0, 3), (2, 1)):
        dense["initial_state"] = torch.stack([reads[n]] * 3)
        e = rel(slab[row], reference_states_after(dense, n, accepted[n]))
        assert e <= TOL["float32"], f"sequence {n}: err={e:.2e}"


def test_threads_split_the_capture_without_changing_a_bit(monkeypatch, cpu_threads):
    """Each (sequence, head) task writes its own entries: the capture of a call on two threads
    (torch's pool or the kernel's own) equals the one-thread capture bit for bit."""
    case = small(B=2, T=20, Hq=2, Hk=2, Hv=4, V=64, decay="gk", qk_l2norm=True)
    captures = []
    for per_thread in (1 << 60, 1):                  # one thread, then one per task (capped by torch's 2)
        monkeypatch.setattr(cpu_backend, "ELEMENT_STEPS_PER_THREAD", per_thread)
        args = cases.make_inputs(case, "float32")
        args["capture"] = poisoned_capture(args, 17)
        deltarule.linear_attention(**args, backend="cpu")
        captures.append(args["capture"])
    assert torch.get_num_threads() >= 2, "one thread: the test could not split the tasks"
    assert torch.equal(captures[0].nan_to_num(7.0), captures[1].nan_to_num(7.0))


def test_a_kept_launch_never_writes_a_capture():
    """A capture call with a reused plan takes the full path; the next call of that plan
    without a capture (a kept launch) leaves the earlier buffer alone."""
    case = small(B=2, T=1, Hv=2, V=32)
    args = cases.make_inputs(case, "float32")
    plan = deltarule.plan_batch(2, 1)
    buffer = poisoned_capture(args, 1)
    deltarule.linear_attention(**args, plan=plan, capture=buffer, backend="cpu")
    assert not torch.isnan(buffer).any()
    buffer.fill_(float("nan"))
    for _ in range(2):                               # the second call runs the kept launch
        deltarule.linear_attention(**args, plan=plan, backend="cpu")
    assert torch.isnan(buffer).all()
