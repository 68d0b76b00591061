"""Property-based tests (hypothesis) of `deltarule.linear_attention` (issue 19).

Random VALID calls (tests/strategies.py: every rule and gate form, GQA / GVA, K != V,
sizes 0 and 1, packed / clamped / ragged batches, slabs with padding rows, speculative
plans, 16-bit states, both state layouts, non-contiguous and expanded inputs, plans) run
on every backend this machine has and are compared with the float64 `reference`:

- o and the returned state within the tolerance of the input dtype (a 16-bit state adds
  `check.STORE_TOL`), NaN failing;
- o in v's dtype and [B, T, max(Hq, Hv), V]; the state in initial_state's dtype and
  layout, or the slab itself;
- outputs no live sequence owns exactly zero (even where uninitialised memory is NaN);
- no read-only input changes (bytes of its whole storage); slab rows not addressed and
  every byte around the slab's elements stay bit-identical; a fresh state shares no
  memory with the inputs;
- a reused `plan_batch` plan gives bit-for-bit the results of the index arguments, and
  rewriting the index tensors after planning changes nothing;
- with inputs that require grad (cpu, torch): o, the state and every input's gradient
  against the oracle's float64 autograd.

The fast backends (cpu, torch, reference; "cpu:threads" is the cpu backend with its
thread and cache thresholds lowered so that small calls take the large calls' paths) draw
small calls and a few larger ones; triton (the interpreter) and wgsl (lavapipe) only tiny
ones: they take 0.1-1 s a call here.

Random INVALID calls (a valid call with one thing broken) must raise ContractError naming
the broken argument before any backend runs, leaving every input (the slab included)
bit-identical.

Profiles: "ci" (the default: derandomized, a bounded number of examples, ~45 s wall on
two cores, imports included) and "long" (DELTARULE_HYPOTHESIS=long: 50x the examples,
random, with hypothesis's example database in .hypothesis/, for hunting defects). A
failure prints the drawn `Call(...)`: `strategies.make_args(Call(...))` rebuilds its
arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, assume, given, note, reject, settings
from hypothesis import strategies as st

import deltarule
from deltarule import ContractError, Unsupported
from deltarule.backends import REGISTRY
from deltarule.tools.check import STORE_TOL, expected

from conftest import GRAD_TOL, err, gradients, uninitialised_memory_is_nan
from strategies import INDEX_ARGS, KINDS, Call, break_call, invalid_calls, make_args, valid_calls

# ---------------------------------------------------------------------------------------
# profiles: the examples a test draws are scaled by the profile, never the test's own count

settings.register_profile(
    "ci", deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "long", deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("DELTARULE_HYPOTHESIS", "ci")
SCALE = {"ci": 1, "long": 50}[PROFILE]


def examples(n: int):
    """The profile's settings with n examples (n * 50 in the long profile)."""
    return settings(settings.get_profile(PROFILE), max_examples=n * SCALE)


# Relative error against the float64 oracle: float32 inputs run through float32 arithmetic
# (chunked forms included); 16-bit inputs carry the rounding of o to their dtype.
TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}


def backend_param(name: str, mark=None):
    module = REGISTRY[name.split(":")[0]]
    why = None if module.available() else getattr(module, "unavailable", lambda: "not available here")()
    marks = [pytest.mark.skipif(why is not None, reason=f"backend {name}: {why}")]
    return pytest.param(name, marks=marks + ([mark] if mark else []), id=name)


# "cpu:threads" is the cpu backend with its thresholds lowered so that tiny calls take the
# paths of large ones: a helper thread per task, fresh states streamed past the caches.
# (the reference backend too: its slab stores, dtypes and layouts against its own solve)
FAST = [backend_param("cpu"), backend_param("cpu:threads"), backend_param("torch"), backend_param("reference")]
# slow here (the Triton interpreter, lavapipe): tiny calls, few of them
SLOW = [backend_param("triton", pytest.mark.triton), backend_param("wgsl", pytest.mark.wgsl)]


# ---------------------------------------------------------------------------------------
# helpers


def storage_bytes(x: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of x's storage (the bytes between strided elements too)."""
    return torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage()).clone()


def snapshot(args: dict) -> dict:
    """name -> (storage bytes, version) of every tensor argument with memory."""
    return {n: (storage_bytes(x), x._version) for n, x in args.items()
            if isinstance(x, torch.Tensor) and x.device.type != "meta"}


def changed(args: dict, before: dict, skip=()) -> list[str]:
    """The tensor arguments whose storage bytes (or version) differ from `before`."""
    return [n for n, (data, version) in before.items()
            if n not in skip and (args[n]._version != version or not torch.equal(storage_bytes(args[n]), data))]


def slab_bytes_after(slab: torch.Tensor, before: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The slab's storage as it must be after the call: `before` with only `rows` replaced by
    what the slab now holds there."""
    expect = before.clone()
    view = torch.empty(0, dtype=slab.dtype).set_(expect.untyped_storage(), slab.storage_offset(), slab.shape,
                                                 slab.stride())
    if rows:
        index = torch.tensor(rows)
        view[index] = slab[index]
    return expect




def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@contextlib.contextmanager
def large_call_paths(backend: str):
    """For "cpu:threads": every call big enough for threads and state streaming."""
    if backend != "cpu:threads":
        yield
        return
    cpu = REGISTRY["cpu"]
    with mock.patch.object(cpu, "ELEMENT_STEPS_PER_THREAD", 1), mock.patch.object(cpu, "LAST_LEVEL_CACHE_BYTES", 0):
        yield


def run(args: dict, backend: str):
    """linear_attention on `backend`; a slow backend declining the call rejects the example
    (cpu and torch take every call on CPU tensors)."""
    try:
        with uninitialised_memory_is_nan(), large_call_paths(backend):
            return deltarule.linear_attention(**args, backend=backend.split(":")[0])
    except Unsupported as e:
        if backend in ("cpu", "cpu:threads", "torch", "reference"):
            raise
        note(f"{backend} declined: {e}")
        reject()


def check_against_reference(call: Call, backend: str) -> None:
    """Run `call` on `backend`; check it against the float64 oracle and the contract."""
    args = make_args(call)
    problem = deltarule.validate(**args)
    ref_o, ref_state = expected(args)           # before the call: a slab is updated in place
    slab = args["initial_state"] if problem.in_place else None
    before = snapshot(args)

    o, state = run(args, backend)

    B, T, V, N = call.B, call.T, call.V, problem.N
    assert o.dtype == args["v"].dtype and tuple(o.shape) == (B, T, max(call.Hq, call.Hv), V)
    state_dtype = torch.float32 if call.state is None else args["initial_state"].dtype
    if slab is not None:
        assert state is slab, "a slab call returns the slab itself"
    else:
        tail = (call.Hv, call.K, V) if call.state_layout == "kv" else (call.Hv, V, call.K)
        assert state.dtype == state_dtype and tuple(state.shape) == (N, *tail)
        inputs = [x for x in args.values() if isinstance(x, torch.Tensor)]
        assert not any(shares_memory(state, x) for x in inputs), "the returned state aliases an input"
    assert not any(shares_memory(o, x) for x in args.values() if isinstance(x, torch.Tensor))

    # read-only inputs keep every byte; the slab changes in its written rows only
    assert not changed(args, before, skip={"initial_state"} if slab is not None else ()), "an input changed"
    if slab is not None:
        written = sorted({*problem.plan.final_writes()[1].tolist(), *problem.plan.token_writes()[2].tolist()})
        assert torch.equal(storage_bytes(slab), slab_bytes_after(slab, before["initial_state"][0], written)), \
            "slab bytes outside the written rows changed"

    # tokens no live sequence owns (padding, past a length, outside every span) are zero
    owner = torch.from_numpy(problem.plan.owner()).view(B, T) if B * T else torch.zeros(B, T, dtype=torch.int32)
    assert bool((o[owner < 0] == 0).all()), "an output no sequence owns is not zero"

    tol = TOL[call.dtype]
    e_o, e_s = err(o, ref_o), err(state, ref_state)
    note(f"{backend}: err(o) = {e_o:.2e}, err(state) = {e_s:.2e}")
    assert e_o <= tol, f"{backend}: err(o) = {e_o:.3e} > {tol:.0e}"
    assert e_s <= tol + STORE_TOL[state_dtype], f"{backend}: err(state) = {e_s:.3e} > {tol:.0e} + store"


# ---------------------------------------------------------------------------------------
# valid calls against the float64 reference


@pytest.mark.parametrize("backend", FAST)
@examples(300)
@given(call=valid_calls())
def test_valid_call_matches_reference(backend, call):
    """A small valid call of any form against the oracle and the contract."""
    check_against_reference(call, backend)


# Past the cpu kernel's 8- and 32-column vector tiles and the 64-token chunks of the
# chunked forms: fewer, larger calls.
@pytest.mark.parametrize("backend", FAST)
@examples(25)
@given(call=valid_calls(max_B=4, max_T=150, max_dim=80, max_heads=3, max_N=6, chunk_sizes=(None, 16, 32, 64)))
def test_larger_call_matches_reference(backend, call):
    check_against_reference(call, backend)


# Triton's interpreter takes 0.1-1 s a call, wgsl compiles a shader per shape (~0.5 s):
# tiny sizes, few examples, no huge chunk sizes to compile.
TINY = valid_calls(max_B=2, max_T=6, max_dim=8, max_N=3, chunk_sizes=(None, 1, 4))


@pytest.mark.parametrize("backend", SLOW)
@examples(15)
@given(call=TINY)
def test_valid_call_matches_reference_slow_backends(backend, call):
    check_against_reference(call, backend)


@pytest.mark.parametrize("backend", FAST)
@examples(60)
@given(call=valid_calls(max_T=20, views=False, plans=False), layers=st.integers(2, 3))
def test_reused_plan_matches_index_arguments(backend, call, layers):
    """Every layer of a step reuses one plan: each layer's call equals, bit for bit, the same
    call with the index arguments, and the reference; rewriting the index tensors after
    planning changes nothing (the plan holds host copies)."""
    base = make_args(call, plan=False)
    index = {n: base[n] for n in INDEX_ARGS if n in base}
    plan = deltarule.plan_batch(call.B, call.T, **index, num_slots=call.num_slots if call.slab else None)
    index = {n: x.clone() for n, x in index.items()}       # kept for the direct calls
    for n in INDEX_ARGS:
        if n in base:
            base[n].fill_(-7)                                # scribbled over after planning
    slab = base.get("initial_state") if call.slab else None
    for layer in range(layers):
        args = make_args(dataclasses.replace(call, seed=(call.seed + layer) % 2**32), plan=False)
        for n in INDEX_ARGS:
            args.pop(n, None)
        if slab is not None:
            args["initial_state"] = slab                     # the layers update one slab in turn
        direct = {**args, **index}
        if slab is not None:
            direct["initial_state"] = slab.clone()
        ref_o, ref_state = expected({**args, "plan": plan})
        o_direct, state_direct = run(direct, backend)
        o, state = run({**args, "plan": plan}, backend)
        assert torch.equal(o, o_direct) and torch.equal(state, state_direct), f"layer {layer}: plan != indices"
        if slab is not None:
            assert state is slab
        tol = TOL[call.dtype]
        state_tol = tol + STORE_TOL[state.dtype]
        assert err(o, ref_o) <= tol and err(state, ref_state) <= state_tol, f"layer {layer}"


def overlapping(call: Call) -> bool:
    """Two non-empty clamped cu_seqlens spans share tokens (autograd cannot follow them)."""
    if call.cu_seqlens is None:
        return False
    c = [min(max(x, 0), call.T) for x in call.cu_seqlens]
    spans = sorted((s, e) for s, e in itertools.pairwise(c) if e > s)
    return any(b0 < a1 for (_, a1), (b0, _) in itertools.pairwise(spans))


@pytest.mark.parametrize("backend", [backend_param("cpu"), backend_param("torch")])
@examples(60)
@given(call=valid_calls(max_T=24, max_dim=16, slabs=("none",)))
def test_gradients_match_reference(backend, call):
    """Inputs that require grad take each backend's differentiable path: o, the state and the
    gradient of every input within tolerance of the float64 oracle's autograd (16 tokens or
    fewer: the token-serial reverse walks; more: torch's chunked backward)."""
    assume(not overlapping(call))
    # K = 1 with qk_l2norm: x / sqrt(x^2 + eps) is +-1 whatever x, its gradient eps / |x|^3
    # is all float32 cancellation (no backend can match the float64 one there)
    assume(not (call.qk_l2norm and call.K == 1))
    # no shared inputs (gradients() makes every input its own leaf anyway): equal values make
    # degenerate gradients, ~0 and all float32 rounding: v = k under the delta rules (the
    # state learns v exactly: u = v - S^T k rounds to 0), q = k with qk_l2norm (d(q.k)/dq = 0)
    args = make_args(dataclasses.replace(call, shared=()))
    state_dtype = torch.float32 if call.state is None else args["initial_state"].dtype
    tol = GRAD_TOL[call.dtype] + STORE_TOL[state_dtype]
    with uninitialised_memory_is_nan():
        o, state, grads = gradients(args, backend)
    ref_o, ref_state, ref_grads = gradients(args, "reference")
    errors = {"o": err(o, ref_o.detach().double().numpy()), "state": err(state, ref_state.detach().double().numpy())}
    for name, grad in grads.items():
        assert grad.shape == args[name].shape and grad.dtype == args[name].dtype, name
        errors["d" + name] = err(grad, ref_grads[name].double().numpy())
    if call.raw_gate:
        # dA_log sums d(decay) * decay over every token: its terms can cancel to a small sum,
        # which float32 only gets within tol of the terms' magnitude, not of the sum
        errors["dA_log"] = min(errors["dA_log"], float(
            (grads["A_log"].double() - ref_grads["A_log"]).norm() / A_log_terms(args, ref_grads).norm()))
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= tol}
    assert not bad, f"{backend}: relative errors over {tol:.0e}: {bad}"


def A_log_terms(args: dict, ref_grads: dict) -> torch.Tensor:
    """[Hv] sum over tokens of |d(decay) * decay|, the terms dA_log adds up (float64): with
    decay = -exp(A_log) softplus(x), x = g + dt_bias, d(raw g) = d(decay) (-exp(A_log))
    sigmoid(x), so each term is |d(raw g)| softplus(x) / sigmoid(x) (1 / 1 at x = -inf)."""
    name = "g" if "g" in args else "gk"
    x = args[name].double() + args["dt_bias"].double()
    ratio = torch.nn.functional.softplus(x) / torch.sigmoid(x)
    ratio = torch.where(torch.isneginf(x), 1.0, ratio)
    terms = (ref_grads[name].double() * ratio).abs()
    return terms.sum(dim=tuple(d for d in range(terms.dim()) if d != 2))


# ---------------------------------------------------------------------------------------
# invalid calls


@contextlib.contextmanager
def no_backend_runs():
    def refuse(problem):
        raise AssertionError("a backend ran on an invalid call")

    with contextlib.ExitStack() as stack:
        for module in REGISTRY.values():
            stack.enter_context(mock.patch.object(module, "run", refuse))
        yield


def names(argument: str, expected_names) -> bool:
    """`argument` is one of the expected names, or an entry of one ("state_indices[1, 2]")."""
    return any(argument == e or argument.startswith(e + "[") for e in expected_names)


@pytest.mark.parametrize("kind", list(KINDS))
@examples(25)
@given(data=st.data())
def test_invalid_call_raises_contract_error(kind, data):
    """One thing broken (strategies.KINDS) in a small valid call: ContractError naming it,
    "argument: expected ...", before any backend runs; no input changed, not a byte."""
    call, broken = data.draw(invalid_calls(kind), label="case")
    args, expected_names = break_call(call, broken)
    before = snapshot(args)
    with no_backend_runs(), pytest.raises(ContractError) as info:
        deltarule.linear_attention(**args)
    error = info.value
    assert names(error.argument, expected_names), f"named {error.argument!r}, expected {expected_names}: {error}"
    assert str(error).startswith(f"{error.argument}: expected ")
    assert not changed(args, before), "a refused call changed an input"
