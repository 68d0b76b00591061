"""The cpu kernels' threading policy (csrc/team.h), checked by what it promises, not by timing:

- no call waits for a helper that has not arrived: a helper held out of calls
  (`cpu_recurrent.hold_helpers`, as a thread the scheduler does not run) does not keep the
  kernels' own threads from finishing a call (recurrence, conv, backward), and the bits are those
  of one thread;
- on torch's OpenMP pool, whose parallel region waits for all its threads, a call that waited
  for a held helper is seen as a stall; after two close together small calls run on the calling
  thread alone (a later call with the helper still held completes), while a call large enough to
  hide a stall keeps its helpers (the held helper arrives at it).

A call that waits for a held helper would never return: each runs under `_completes`, which
releases the helpers and fails the test after WATCHDOG_S.
"""

from __future__ import annotations

import threading

import pytest
import torch

import deltarule
from deltarule import cases
from deltarule.backends import cpu_backend
from deltarule.conv import causal_conv1d_slab, plan_conv
from deltarule.kernels.cpu import conv as cpu_conv
from deltarule.kernels.cpu import recurrent as cpu_recurrent

from conftest import gradients, small_case

pytestmark = pytest.mark.skipif(not cpu_backend.available(), reason="the cpu backend's native kernel was not built")

HELPER = 1 << 1          # hold_helpers' bit of the first helper (thread 1; 0 is the caller)
WATCHDOG_S = 10.0        # a call still running after this long waited for a held helper
RELEASE_S = 0.3          # the OpenMP test releases its held helper after this long


@pytest.fixture
def two_threads(monkeypatch):
    """Every cpu call asks for two threads (torch's count and the work's), the adaptation starts
    afresh, and no helper is held after the test."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    was = cpu_recurrent.threads_in_use()
    adapting = cpu_recurrent.adapt_to_contention(True)
    try:
        yield
    finally:
        cpu_recurrent.hold_helpers(0)
        cpu_recurrent.use_threads(was)
        cpu_recurrent.adapt_to_contention(adapting)


def _completes(call):
    """call()'s result; fails (after releasing every helper) if it has not returned in WATCHDOG_S."""
    box = {}

    def run():
        try:
            box["result"] = call()
        except BaseException as e:  # re-raised on the test's thread
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(WATCHDOG_S)
    if worker.is_alive():
        cpu_recurrent.hold_helpers(0)
        worker.join()
        pytest.fail(f"the call waited {WATCHDOG_S:.0f} s for a helper that never arrived")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _wait_for_arrival(before: int) -> None:
    """Waits until a held helper has arrived at a call (it is woken for the call, and the call
    may well have returned before it runs)."""
    done = threading.Event()
    for _ in range(int(WATCHDOG_S / 0.01)):
        if cpu_recurrent.contention().held_arrivals > before:
            return
        done.wait(0.01)
    pytest.fail(f"the held helper never arrived at the call: the call did not ask for it ({cpu_recurrent.contention()})")


def _decodes(n: int) -> list:
    """n calls of one B = 1, 16-head decode step on a slab (2^19 state-element steps: two
    threads), each on its own copy of the inputs, built now: the calls can run back to back (a
    call more than 2 ms after the last parallel one is not judged, csrc/team.c)."""
    case = dict(seed=3, B=1, T=1, Hq=16, Hk=16, Hv=16, K=128, V=128, rule="gated_delta", initial_state=True,
                state_indices=[3], num_slots=5)
    return [lambda args=cases.make_inputs(case, "float32"): deltarule.linear_attention(**args, backend="cpu")
            for _ in range(n)]


def _decode():
    return _decodes(1)[0]()


def _prefill(T: int):
    args = cases.make_inputs(dict(seed=4, B=1, T=T, Hq=16, Hk=16, Hv=16, K=128, V=128, rule="gated_delta",
                                  initial_state=True), "float32")
    return lambda: deltarule.linear_attention(**args, backend="cpu")


def _conv():
    """A 4-token, 3-block conv (the conv's blocks on two threads)."""
    g = torch.Generator().manual_seed(3)
    C = 3 * cpu_conv.CHANNEL_BLOCK
    x, weight, slab = torch.randn(4, C, generator=g), torch.randn(C, 4, generator=g), torch.randn(6, 3, C, generator=g)
    out = causal_conv1d_slab(x, weight, None, slab, plan_conv([2, 2], width=4, read_rows=[3, 4], write_rows=[3, 4]),
                             backend="cpu")
    return out, slab


def _backward():
    o, state, grads = gradients(cases.make_inputs(small_case(B=2, Hv=4, Hq=4, Hk=4), "float32"), "cpu")
    return (o.detach(), state.detach(), *grads.values())


KERNELS = {"recurrence": _decode, "conv": _conv, "backward": _backward}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_own_threads_finish_a_call_without_a_helper_that_never_arrives(monkeypatch, two_threads, kernel):
    """The kernels' own helpers: with helper 1 held, the call completes on the calling thread
    (the helper is asked, arrives later, and stays out), with the bits of one thread, and the
    caller did not wait for it (no stall seen)."""
    monkeypatch.setattr(cpu_backend, "ELEMENT_STEPS_PER_THREAD", 1)
    monkeypatch.setattr(cpu_conv, "ELEMENTS_PER_THREAD", 1)
    call = KERNELS[kernel]
    cpu_recurrent.use_threads("own")
    cpu_recurrent.adapt_to_contention(False)         # every call on its two threads
    want = call()                                    # (also starts the helper)
    before = cpu_recurrent.contention().held_arrivals
    cpu_recurrent.hold_helpers(HELPER)
    got = _completes(call)
    _wait_for_arrival(before)
    cpu_recurrent.hold_helpers(0)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{kernel}: the bits changed"
    assert cpu_recurrent.contention().stalls == 0


def _hold_for(seconds: float) -> None:
    """Holds helper 1 until `seconds` from now (a Timer releases it)."""
    cpu_recurrent.hold_helpers(HELPER)
    threading.Timer(seconds, cpu_recurrent.hold_helpers, (0,)).start()


def _stalls(first, *stalled):
    """first() and then, back to back on one thread, each of `stalled` with helper 1 held until
    its release (RELEASE_S apart, from now): as many stalls in a row (a call more than 2 ms after
    the last parallel one is not judged, and a Python thread takes up to 5 ms to start, so none
    is started between them). Returns the first call's result and `contention()` after each
    stalled call."""
    for i in range(len(stalled)):
        threading.Timer(RELEASE_S * (i + 1), cpu_recurrent.hold_helpers, (0,)).start()

    def run():
        result, seen = first(), []
        for call in stalled:
            cpu_recurrent.hold_helpers(HELPER)
            call()
            seen.append(cpu_recurrent.contention())
        return result, seen
    return _completes(run)


def test_openmp_stall_sends_small_calls_to_the_caller_alone(two_threads):
    """torch's pool: a region waits for its held helper (released after RELEASE_S): a stall.
    After a second close to it a small call (B = 1 decode) with the helper held again completes
    alone, with the same bits; with the adaptation off, the same call asks for the helper again
    (and waits for it). (That one stall alone changes nothing is not asserted: on a loaded
    machine the calls around it may stall too.)"""
    assert cpu_recurrent.use_threads("openmp") == "openmp", "torch has no OpenMP runtime here"
    first, stalled, stalled_again, alone, again = _decodes(5)
    want, (_, seen) = _stalls(first, stalled, stalled_again)
    assert seen.stalls >= 2 and seen.solo_calls > 0, seen
    cpu_recurrent.hold_helpers(HELPER)               # now never released while the call runs
    before = seen.held_arrivals
    got = _completes(alone)
    cpu_recurrent.hold_helpers(0)
    assert cpu_recurrent.contention().held_arrivals == before, "the small call still asked for its helper"
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    cpu_recurrent.adapt_to_contention(False)
    _hold_for(RELEASE_S)
    _completes(again)
    assert cpu_recurrent.contention().held_arrivals > before, "without the adaptation the call asks its helper"


def test_openmp_stall_keeps_large_calls_on_their_threads(two_threads):
    """After a stall, a prefill of 2^27 state-element steps (a stall is small beside it) still
    takes its helper: the held helper arrives at it (released after RELEASE_S)."""
    assert cpu_recurrent.use_threads("openmp") == "openmp", "torch has no OpenMP runtime here"
    first, *stalled = _decodes(3)
    prefill = _prefill(512)
    _, seen = _stalls(first, *stalled)
    assert seen[-1].solo_calls > 0, seen
    before = cpu_recurrent.contention().held_arrivals
    _hold_for(RELEASE_S)
    _completes(prefill)
    assert cpu_recurrent.contention().held_arrivals > before
