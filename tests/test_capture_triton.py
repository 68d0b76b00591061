"""The triton backend's compact transition capture against the float64 reference.

A call with `capture` runs the fused recurrence (never the chunked form), which
writes each live sequence's first min(C, length) transitions (decay, key, delta)
into the capture buffer. Every buffer here starts as NaN: the entries a kernel
must leave alone (past a sequence's count, padding sequences' rows) stay NaN,
and an entry it should have written and did not shows up as NaN in the
comparison. Runs under the Triton interpreter without a CUDA device
(conftest.py sets TRITON_INTERPRET=1), so the cases stay tiny.
"""

import numpy as np
import pytest

from conftest import case_id, case_params, check_capture, err, poisoned_capture, require_triton

require_triton()

import torch  # noqa: E402

import deltarule  # noqa: E402
from deltarule import cases, reference  # noqa: E402
from deltarule.tools.check import compare  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5                                   # float32 inputs, as tests/test_triton.py

pytestmark = pytest.mark.triton


def small(**over) -> dict:
    """A test.json-style case dict: tiny sizes, overridable."""
    case = dict(seed=48, B=2, T=5, Hq=2, Hk=2, Hv=2, K=16, V=24, rule="gated_delta", initial_state=True)
    case.update(over)
    return case


def run_capture(args: dict, C: int):
    """Call the triton backend on `args` with a NaN-poisoned capture of capacity C (added to
    `args`) and check o, the returned state and the captured prefix of every sequence against
    the reference; every entry past a sequence's count (all of a padding sequence's row) must
    still be NaN. Returns (o, state, the reference's `Captured`)."""
    args["capture"] = poisoned_capture(args, C, DEVICE)
    p = deltarule.validate(**args)
    sol = reference.solve(p)
    ref_state = reference.expected_state(p, sol).numpy()     # before the call (a slab's rows)
    o, state = deltarule.linear_attention(**args, backend="triton")
    e_o, e_s = err(o, sol.o), err(state, ref_state)
    assert e_o <= TOL and e_s <= TOL, f"err(o)={e_o:.2e} err(S)={e_s:.2e}"

    cap = sol.capture
    check_capture(p, cap, TOL)
    return o, state, cap


CASES = [
    # scalar decay through the raw-gate arm, fused sigmoid and L2 norm; T above C
    (small(decay="g", raw_gate=True, beta_sigmoid=True, qk_l2norm=True), 3),
    # GDN-2: per-key decay (raw-gate arm), erase / write; GVA (2 state heads per key head),
    # K = 100 (a masked key block), V = 72 (two value tiles); T below C
    (small(B=1, T=3, Hq=2, Hk=2, Hv=4, K=100, V=72, decay="gk", update="erase_write", raw_gate=True), 4),
    # varlen with an empty sequence between two others; the delta rule (decay factors 1)
    (small(B=1, T=7, cu_seqlens=[0, 3, 3, 7], rule="delta", decay="none"), 2),
]


@pytest.mark.parametrize("case,C", [pytest.param(c, C, id=f"{case_id(c)}-C{C}") for c, C in CASES])
def test_capture_matches_reference(case, C):
    run_capture(cases.make_inputs(case, "float32", DEVICE), C)


@pytest.mark.parametrize("case", [
    # the padding sequence is not launched: the third sequence is the kernels' second one
    small(B=3, T=4, state_indices=[2, -1, 0], num_slots=4, decay="gk", state_layout="vk"),
    # clamped cu_seqlens whose spans overlap (0..8, 4..12) run packed: sequence n in row n
    small(B=1, T=12, cu_seqlens=[0, 8, 4, 12], state_indices=[1, -1, 0], num_slots=3),
], ids=case_id)
def test_verify_reads_the_slab_and_writes_no_row(case):
    """Slab + capture is a verify: the rows are read, none is written (a bit-identical slab);
    a padding sequence (index -1) leaves its capture row as it was."""
    args = cases.make_inputs(case, "float32", DEVICE)
    before = args["initial_state"].clone()
    _, state, cap = run_capture(args, 3)
    assert state is args["initial_state"] and torch.equal(state, before)
    pad = case["state_indices"].index(-1)
    assert cap.count[pad] == 0 and torch.isnan(args["capture"][pad]).all()


@pytest.mark.parametrize("case,dtype", case_params(lambda c: c.get("capture") is not None))
def test_test_json_capture_case(monkeypatch, case, dtype):
    """test.json's capture cases through `check.compare` (o, state, capture); a capture needs
    every token's delta, which the chunked form never forms: the 65-token case (past
    RECURRENT_MAX_LEN) still runs the fused recurrence."""
    from deltarule.kernels.triton import chunked as triton_chunked

    def refuse(*a, **kw):
        pytest.fail("a capture call ran the chunked kernels")
    monkeypatch.setattr(triton_chunked, "chunked", refuse)
    r = compare(case, dtype, "triton", DEVICE)
    assert r.passed, (f"err(o)={r.err_o:.2e} err(S)={r.err_state:.2e} err(capture)={r.err_capture:.2e} "
                      f"tol={r.tol:.0e}")


def test_kernel_skips_padding_rows():
    """The kernel's own contract, below the backend (which gives a padding sequence no tokens):
    a sequence whose slab row is negative runs its L tokens but writes no capture entry; the
    other sequence's row holds its C transitions."""
    from deltarule.kernels.triton.recurrent import recurrent

    args = cases.make_inputs(small(B=2, T=3, state_indices=[-1, 2], num_slots=3), "float32", DEVICE)
    C = 2
    args["capture"] = poisoned_capture(args, C, DEVICE)
    cap = reference.solve(deltarule.validate(**args)).capture
    q, k, v, g, beta = (args[n] for n in ("q", "k", "v", "g", "beta"))
    recurrent(q.unsqueeze(3), k, v, g, None, beta, beta, args["initial_state"], 1.0,
              state_indices=args["state_indices"], capture=args["capture"])
    assert torch.isnan(args["capture"][0]).all()
    want = np.concatenate([x[1].reshape(-1) for x in (cap.decay, cap.key, cap.delta)])
    assert err(args["capture"][1], want) <= TOL
