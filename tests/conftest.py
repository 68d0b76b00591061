import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; the variable must be set before
    # anything (fla's tests included) imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib
import importlib.util
import zlib

import numpy as np
import pytest

from deltarule import cases
from deltarule.backends import cpu_backend
from deltarule.tools.check import STORE_TOL

if cpu_backend.available():
    # Every cpu call runs on the threads it asks for: on a loaded CI machine a stall would send
    # small calls to the calling thread alone for a while (csrc/team.h) and the tests that split
    # a call over threads would not. tests/test_threads.py turns the adaptation on to test it.
    from deltarule.kernels.cpu import recurrent as _cpu_recurrent
    _cpu_recurrent.adapt_to_contention(False)

CPU = pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_backend.available(), reason="the cpu backend's native kernel was not built (no C compiler at install time)"))


def case_params(filter_=lambda case: True, dtypes=None):
    """pytest params (case, dtype) over test.json, with ids like `gdn-B2-T65-H4-K32-float32`."""
    return [
        pytest.param(case, dtype, id=f"{case['name']}-{dtype}")
        for case in cases.test_cases() if filter_(case)
        for dtype in case["dtypes"] if dtypes is None or dtype in dtypes
    ]


def case_id(case: dict) -> str:
    """Readable ids like `B2-T65-Hq4-Hv8-K36-V20-gk-erase_write-raw_gate`."""
    parts = [f"B{case['B']}", f"T{case['T']}"]
    if case["Hq"] == case["Hk"] == case["Hv"]:
        parts.append(f"H{case['Hv']}")
    else:
        parts += [f"Hq{case['Hq']}"] + ([f"Hk{case['Hk']}"] if case["Hk"] != case["Hq"] else []) \
            + [f"Hv{case['Hv']}"]
    parts.append(f"K{case['K']}" + (f"-V{case['V']}" if case["V"] != case["K"] else ""))
    if case.get("rule", "gated_delta") != "gated_delta":
        parts.append(case["rule"])
    for key in ("decay", "update"):
        if case.get(key) is not None:
            parts.append(case[key])
    if case.get("decay_range") is not None:
        parts.append("decay{:g}..{:g}".format(*case["decay_range"]))
    for key in ("cu_seqlens", "seq_lens", "state_indices"):
        if case.get(key) is not None:
            parts.append(key + "=" + ",".join(map(str, case[key])))
    parts += [flag for flag in ("qk_l2norm", "raw_gate", "beta_sigmoid") if case.get(flag)]
    if case.get("initial_state"):
        parts.append("state-" + case.get("state_layout", "kv"))
    elif case.get("state_layout") == "vk":
        parts.append("vk")
    return "-".join(parts)


def params(*case_list):
    """pytest params of test.json-style case dicts, with `case_id` ids."""
    return [pytest.param(c, id=case_id(c)) for c in case_list]


def assert_rows_rewritten(slab, before, written):
    """Exactly the slab rows in `written` changed; every other row is bit-identical."""
    for row in range(slab.shape[0]):
        assert torch.equal(slab[row], before[row]) != (row in written), f"slab row {row}"


def assert_slab_updated_in_place(state, slab, before, o, state_indices):
    """A slab call returned the slab itself, rewrote the rows `state_indices` names, left every
    other row bit-identical, and gave padding sequences (negative index) a zero output."""
    assert state is slab
    assert_rows_rewritten(slab, before, {i for i in state_indices if i >= 0})
    for n, i in enumerate(state_indices):
        if i < 0:
            assert torch.count_nonzero(o[n]) == 0, f"padding sequence {n} has an output"


def rng_for(request) -> np.random.Generator:
    """A generator seeded by the test id: reproducible, different per case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only copy of a NumPy array."""
    a = a.copy()
    a.flags.writeable = False
    return a


def assert_refused(call, args: dict, argument: str) -> None:
    """`call(args)` raises a ContractError naming `argument` ("argument: expected ..."), and the
    state it would update in place (`args["state"]`, torch or NumPy) keeps every bit."""
    from deltarule import ContractError

    state = args["state"]
    before = state.copy() if isinstance(state, np.ndarray) else state.clone()
    with pytest.raises(ContractError) as info:
        call(args)
    assert info.value.argument == argument
    assert str(info.value).startswith(f"{argument}: expected ")
    if isinstance(state, np.ndarray):
        np.testing.assert_array_equal(state, before)
    else:
        assert torch.equal(state, before), "the state changed although the call was refused"


def state_dtype(args: dict) -> torch.dtype:
    """The storage dtype of a call's state: initial_state's, float32 without one."""
    init = args.get("initial_state")
    return torch.float32 if init is None else init.dtype


def state_tol(args: dict, tol: float) -> float:
    """The tolerance of a call's returned state: `tol` plus one rounding to a 16-bit state dtype."""
    return tol + STORE_TOL[state_dtype(args)]


def rel(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64, NumPy or torch; same shapes; a zero ref is a test bug."""
    x = x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    ref = ref.detach().double().cpu().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref, dtype=np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    den = np.linalg.norm(ref)
    assert den > 0, "degenerate reference: the comparison could not fail"
    return float(np.linalg.norm(x - ref) / den)


@contextlib.contextmanager
def uninitialised_memory_is_nan():
    """torch.empty memory reads as NaN inside: an output element a backend skips shows up
    (a context manager for hypothesis tests, whose examples share one fixture call)."""
    previous = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.fixture
def nan_output(monkeypatch):
    """The wgsl shaders' output buffer starts as NaN: an element a shader skips shows up (dense
    calls only: tokens no sequence owns stay as the buffer was, zero in production)."""
    from deltarule.kernels.wgsl import _device, recurrent

    def nan_buffer(nbytes):
        return _device.upload(np.full(max(nbytes // 4, 1), np.nan, dtype=np.float32))
    monkeypatch.setattr(recurrent, "_output_buffer", nan_buffer)


@pytest.fixture
def nan_poison():
    """Uninitialised torch memory reads as NaN: an unwritten output element shows up."""
    with uninitialised_memory_is_nan():
        yield


@pytest.fixture(params=["openmp", "own"])
def cpu_threads(request):
    """The cpu kernels' threads for this test (cpu_recurrent.use_threads): torch's OpenMP pool or
    the kernel's own; restored after. The value is the kind; "openmp" fails where torch has no
    OpenMP runtime (every torch build this project tests has one)."""
    from deltarule.kernels.cpu import recurrent as cpu_recurrent
    if not cpu_recurrent.available():
        pytest.skip("the native kernel is not built")
    was = cpu_recurrent.threads_in_use()
    assert cpu_recurrent.use_threads(request.param) == request.param, "torch has no OpenMP runtime here"
    try:
        yield request.param
    finally:
        cpu_recurrent.use_threads(was)


def require_triton():
    """Skip the calling test module unless Triton kernels can run here: a CUDA device, or the
    interpreter (TRITON_INTERPRET=1 in effect when triton was first imported, as set above)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton backend needs triton: pip install triton", allow_module_level=True)
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not torch.cuda.is_available() and not isinstance(tl.sum, InterpretedFunction):
        pytest.skip("no CUDA device, and Triton is not in interpreter mode: TRITON_INTERPRET=1 must be "
                    "set before anything imports triton (tests/conftest.py does)", allow_module_level=True)


def err(x: torch.Tensor, ref: np.ndarray) -> float:
    """Relative error; against an all-zero reference, the largest |x| (NaN stays NaN)."""
    if np.linalg.norm(ref) > 0:
        return rel(x, ref)
    return float(np.abs(x.detach().double().cpu().numpy()).max(initial=0.0))


# The arguments of linear_attention that gradients reach, and the tolerance of a gradient
# against the float64 oracle's (relative, over the whole tensor): issue 12 asks float32 to do
# far better than fla's own test tolerances (0.008 to 0.02 relative RMS); 16-bit gradients
# carry one rounding to their dtype besides the float32 arithmetic.
DIFFERENTIABLE = ("q", "k", "v", "g", "gk", "beta", "erase", "write", "A_log", "dt_bias", "initial_state")
GRAD_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}


def gradients(args: dict, backend: str, seed: int = 0, fn=None):
    """(o, state, {name: gradient}) of loss = (o * do).sum() + (state * dS).sum(), with do and
    dS drawn from `seed`, through `fn(**args, backend=backend)` (linear_attention by default).
    The differentiable inputs become fresh leaves that require grad; args is not modified."""
    import deltarule

    fn = fn or deltarule.linear_attention
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in args.items()
              if n in DIFFERENTIABLE and isinstance(x, torch.Tensor)}
    o, state = fn(**{**args, **leaves}, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
    dS = torch.randn(state.shape, generator=gen).to(state.device, state.dtype)
    loss = (o.float() * do.float()).sum() + (state.float() * dS.float()).sum()
    # an input no output depends on (T = 0) gets zeros; a missing dependence elsewhere shows
    # up as a mismatch against the oracle
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True, materialize_grads=True)
    return o, state, dict(zip(leaves, grads))


def small_case(**over) -> dict:
    """A test.json-style case dict of tiny sizes (`deltarule.cases.make_inputs` takes it), overridable."""
    case = dict(seed=7, B=2, T=20, Hq=2, Hk=2, Hv=2, K=16, V=12, rule="gated_delta", initial_state=True)
    case.update(over)
    return case


def assert_gradients_match(args: dict, backend: str, tol: float, reference=None) -> None:
    """o, the state and every input's gradient (`gradients`) through `backend` within `tol`
    (relative) of the float64 oracle's (`reference`: its `gradients` result, computed here
    when not given). Each gradient has its input's shape and dtype."""
    o, state, grads = gradients(args, backend)
    ref_o, ref_state, ref_grads = reference or gradients(args, "reference")
    assert o.requires_grad and state.requires_grad
    assert set(grads) == set(ref_grads) and grads
    errors = {"o": err(o, ref_o.detach().double().cpu().numpy()),
              "state": err(state, ref_state.detach().double().cpu().numpy())}
    for name, grad in grads.items():
        assert grad.shape == args[name].shape and grad.dtype == args[name].dtype, name
        errors["d" + name] = err(grad, ref_grads[name].double().cpu().numpy())
    bad = {n: f"{e:.2e}" for n, e in errors.items() if not e <= tol}
    assert not bad, f"{backend}: relative errors over {tol:.0e}: {bad}"


def poisoned_capture(args: dict, C: int, device="cpu") -> torch.Tensor:
    """A NaN-filled float32 capture buffer [N, C * (Dw + Hk*K + Hv*V)] for the call `args`
    (`linear_attention(capture=)`): an entry a backend should have written, or should have
    left, shows."""
    import deltarule

    p = deltarule.validate(**args)
    return torch.full((p.N, C * (p.decay_width + p.Hk * p.K + p.Hv * p.V)), float("nan"), device=device)


def check_capture(p, captured, tol: float) -> None:
    """`p.capture` holds the reference's captured prefix (`reference.solve(p).capture`) of every
    sequence, relative error per part (decay / key / delta) within `tol` (NaN fails), and NaN
    past each sequence's count (all of a padding sequence's row)."""
    count = captured.count.tolist()
    assert count == [min(p.capacity, s.length) if s.live else 0 for s in p.spans]
    for name, part, ref in zip(("decay", "key", "delta"), p.capture_parts(),
                               (captured.decay, captured.key, captured.delta)):
        got = torch.cat([part[n, :c] for n, c in enumerate(count)])
        want = np.concatenate([ref[n, :c] for n, c in enumerate(count)])
        e = err(got, want)
        assert e <= tol, f"err({name})={e:.2e}"
        for n, c in enumerate(count):
            assert torch.isnan(part[n, c:]).all(), f"{name}: sequence {n} wrote past its count {c}"


def run_capture(args: dict, C: int, backend: str, tol: float, capture_tol: float):
    """`backend` on `args` with a NaN-poisoned capture of capacity C (added to `args`): o, the
    returned state (`tol`, plus a 16-bit state's rounding) and the capture (`capture_tol`)
    against the float64 reference, and o and the state bit for bit those of the same call
    without a capture. Returns (o, state, the validated Problem, the reference's Solution)."""
    import deltarule
    from deltarule import reference

    plain = {n: (x.clone() if n == "initial_state" else x) for n, x in args.items()}
    o_plain, state_plain = deltarule.linear_attention(**plain, backend=backend)
    args["capture"] = poisoned_capture(args, C)
    p = deltarule.validate(**args)
    sol = reference.solve(p)
    ref_state = reference.expected_state(p, sol).numpy()      # before the call: a slab's rows as they were
    o, state = deltarule.linear_attention(**args, backend=backend)
    e_o, e_s = rel(o, sol.o), rel(state, ref_state)
    assert e_o <= tol and e_s <= state_tol(args, tol), f"err(o)={e_o:.2e} err(S)={e_s:.2e}"
    check_capture(p, sol.capture, capture_tol)
    assert torch.equal(o, o_plain), "the capture changed o"
    if "state_indices" not in args:                  # (a verify stores nothing; the plain call did)
        assert torch.equal(state, state_plain), "the capture changed the state"
    return o, state, p, sol
