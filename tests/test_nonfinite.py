"""Non-finite inputs (docs/design.md, "Non-finite inputs"): a NaN or ±inf in an input is
computed with, not refused, and every backend makes non-finite exactly the outputs and states the
float64 reference does — chunked forms may add the earlier tokens of the poisoned token's chunk —
without saying whether a position holds NaN or ±inf (inf - inf and 0 * inf are NaN in one order
of operations and not in another). Finite outputs still match the reference.

Issue 19 asked for this rule after the cpu kernel returned NaN where the reference returned ±inf.
"""

import pytest
import torch

import deltarule
from deltarule import backends as registry
from deltarule import cases
from deltarule.tools.check import expected

from conftest import CPU, rel, small_case

CHUNK = 64                 # the chunked forms' chunk (torch's default chunk_size, Triton's fixed one)
POISONED_TOKEN = 70        # in the second chunk, past its start: earlier tokens of it may be poisoned too
T_LONG = 80


def _available(name, slow=False):
    marks = [pytest.mark.skipif(not registry.REGISTRY[name].available(),
                                reason=f"the {name} backend is not available here")]
    if slow:
        marks.append(getattr(pytest.mark, name))
    return pytest.param(name, marks=marks)


# backend -> the token count past which it runs a chunked form (None: always token by token)
CHUNKED_PAST = {"cpu": None, "torch": 16, "triton": 64, "wgsl": None}
BACKENDS = [CPU, "torch", _available("triton", slow=True), _available("wgsl", slow=True)]

# poisoned input (an id) -> (its argument, the case options of a call that has it)
INPUTS = {
    "q": ("q", {}), "k": ("k", {}), "v": ("v", dict(decay="gk")), "beta": ("beta", {}),
    "erase": ("erase", dict(decay="gk", update="erase_write")), "write": ("write", dict(update="erase_write")),
    "g": ("g", {}), "gk": ("gk", dict(decay="gk", update="erase_write")),
    "raw-g": ("g", dict(raw_gate=True, beta_sigmoid=True)), "raw-gk": ("gk", dict(decay="gk", raw_gate=True)),
    "A_log": ("A_log", dict(raw_gate=True)), "dt_bias": ("dt_bias", dict(decay="gk", raw_gate=True)),
    "initial_state": ("initial_state", {}),
}
VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def poisoned(input_id: str, value: float, T: int) -> dict:
    name, options = INPUTS[input_id]
    args = cases.make_inputs(small_case(B=1, T=T, Hq=2, Hk=2, Hv=2, K=16, V=12, **options))
    x = args[name]
    if name in ("initial_state", "A_log", "dt_bias"):   # no token axis
        index = (0, 1, 0, 3)[-x.dim():] if name == "initial_state" else (1, 3)[:x.dim()]
    else:
        index = (0, min(POISONED_TOKEN, T - 1), 1, 3)[:x.dim()]
    x[index] = value
    return args


def assert_nonfinite_like_the_reference(o, state, ref_o, ref_state, chunked: bool, tol: float):
    """The non-finite positions of o and state are the reference's (a chunked form: plus tokens
    before a poisoned one in its chunk); finite positions agree within tol."""
    ref_o, ref_state = torch.from_numpy(ref_o), torch.from_numpy(ref_state)
    assert torch.equal(~state.double().isfinite(), ~ref_state.isfinite()), "non-finite state positions differ"
    bad, ref_bad = ~o.double().isfinite(), ~ref_o.isfinite()
    assert not (ref_bad & ~bad).any(), "an output the reference makes non-finite is finite"
    extra = (bad & ~ref_bad).any(-1)                      # [B, T, H]: tokens poisoned beyond the reference
    if chunked:
        poisoned_later = ref_bad.any(-1).clone()          # a later token of the same chunk is poisoned
        for t in range(o.shape[1] - 2, -1, -1):
            if (t + 1) % CHUNK:
                poisoned_later[:, t] |= poisoned_later[:, t + 1]
        extra &= ~poisoned_later
    assert not extra.any(), f"outputs poisoned beyond the reference at (b, t, h) {extra.nonzero().tolist()[:5]}"
    good = ~bad & ~ref_bad
    if good.any():
        assert rel(o.double()[good], ref_o[good]) <= tol
    finite = state.double().isfinite()
    if finite.any():
        assert rel(state.double()[finite], ref_state[finite]) <= tol


def combinations():
    """(backend, input, value, T) params; a log decay of -inf is a reset (test.json's decay_resets)
    and +inf is refused, so g and gk get NaN only; the Triton interpreter (~1 s a call) runs every
    value on decode and NaN on prefill."""
    for backend in BACKENDS:
        name = backend.values[0] if hasattr(backend, "values") else backend
        for input_id in INPUTS:
            for value in VALUES:
                for T in (1, T_LONG):
                    if (INPUTS[input_id][0] in ("g", "gk") and value != "nan") or \
                            (name == "triton" and T > 1 and value != "nan"):
                        continue
                    marks = backend.marks if hasattr(backend, "marks") else ()
                    yield pytest.param(name, input_id, value, T, marks=marks, id=f"{name}-{input_id}-{value}-T{T}")


@pytest.mark.parametrize("backend, name, value, T", list(combinations()))
def test_non_finite_inputs_poison_what_the_reference_poisons(backend, name, value, T):
    args = poisoned(name, VALUES[value], T)
    ref_o, ref_state = expected(args)
    o, state = deltarule.linear_attention(**args, backend=backend)
    past = CHUNKED_PAST[backend]
    assert_nonfinite_like_the_reference(o, state, ref_o, ref_state, past is not None and T > past, 1e-4)


def test_a_reset_is_not_a_poison():
    """-inf in g is a reset: everything stays finite (the recurrence's own zero decay factor)."""
    args = cases.make_inputs(small_case(B=1, T=T_LONG, decay_resets=[3, POISONED_TOKEN]))
    for backend in [b for b in ("cpu", "torch", "reference") if registry.REGISTRY[b].available()]:
        o, state = deltarule.linear_attention(**args, backend=backend)
        assert o.isfinite().all() and state.isfinite().all(), backend
