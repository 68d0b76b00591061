"""The cpu kernels (forward and backward) on every test.json case, with one thread and with
three, and no oracle: .ci/sanitize runs this file against the kernels built with
AddressSanitizer and UBSan (docs/testing.md), where what is checked is the kernels' memory
accesses; the numbers are tests/test_conformance.py's and tests/test_gradients.py's business
(their float64 oracles cost seconds a case; this sweep costs ~20 s under the sanitizers).
Besides: uninitialised memory reads as NaN (nan_poison), so every output element, state and
gradient must be finite, and three threads give the same bits as one.

Not collected by a plain `pytest` (no test_ prefix); run it by path:
`pytest tests/sanitizer_sweep.py`.
"""

import pytest
import torch

import deltarule
from conftest import case_params, gradients
from deltarule import cases
from deltarule.backends import cpu_backend
from test_gradients import differentiable_case

pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason="the cpu backend's native kernel was not built")


def _run(monkeypatch, threads: int, call):
    """`call()` with the cpu backend on `threads` threads (every call big enough for them)."""
    with monkeypatch.context() as m:
        m.setattr(torch, "get_num_threads", lambda: threads)
        m.setattr(cpu_backend, "ELEMENT_STEPS_PER_THREAD", 1)
        return call()


def _assert_finite_and_equal(one, three, what):
    for name in one:
        assert torch.isfinite(one[name].float()).all(), f"{what} {name}: not finite (unwritten?)"
        assert torch.equal(one[name], three[name]), f"{what} {name}: three threads changed bits"


@pytest.mark.parametrize(("case", "dtype"), case_params())
def test_forward(monkeypatch, nan_poison, case, dtype):
    def call():
        args = cases.make_inputs(case, dtype)       # afresh: a slab is updated in place
        o, state = deltarule.linear_attention(**args, backend="cpu")
        return {"o": o, "state": state}

    _assert_finite_and_equal(_run(monkeypatch, 1, call), _run(monkeypatch, 3, call), "forward")


@pytest.mark.parametrize(("case", "dtype"), case_params(differentiable_case))
def test_backward(monkeypatch, nan_poison, case, dtype):
    args = cases.make_inputs(case, dtype)

    def call():
        o, state, grads = gradients(args, "cpu")
        return {"o": o.detach(), "state": state.detach(), **{"d" + n: g for n, g in grads.items()}}

    _assert_finite_and_equal(_run(monkeypatch, 1, call), _run(monkeypatch, 3, call), "backward")
