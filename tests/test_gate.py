"""`deltarule.gate.bounded_gate`: KDA's bounded per-key decay (fla's ``lower_bound`` gate), the one
form the fla drop-ins and the vLLM plugin's Kimi Linear layers pass as ``gk``."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deltarule.errors import ContractError
from deltarule.gate import bounded_gate, gate

from test_properties import examples


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 5, 3, 4, generator=g).to(dtype), torch.rand(3, generator=g),
            torch.randn(12, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_a_log", [True, False])
@pytest.mark.parametrize("with_dt_bias", [True, False])
def test_bounded_gate_matches_float64(dtype, with_a_log, with_dt_bias):
    raw, A_log, dt_bias = _inputs(dtype)
    A_log, dt_bias = (A_log if with_a_log else None), (dt_bias if with_dt_bias else None)
    gk = bounded_gate(raw, -5.0, A_log, dt_bias)
    x = raw.double() + (dt_bias.double().view(3, 4) if dt_bias is not None else 0)
    if A_log is not None:
        x = A_log.double().exp()[:, None] * x
    want = -5.0 * torch.sigmoid(x)
    assert gk.dtype == torch.float32 and gk.shape == raw.shape
    assert (gk.double() - want).abs().max() < 2e-6
    assert (gk < 0).all() and (gk > -5.0).all()


def test_bounded_gate_is_the_fla_drop_ins_gate():
    """fla's chunk_kda with lower_bound forms its gk with this function: the same bits."""
    import deltarule.contracts.fla as dfla
    raw, A_log, dt_bias = _inputs(torch.bfloat16, seed=1)
    got = dfla._vector_gate(raw, A_log, dt_bias, -3.0, use_gate_in_kernel=True, fn="chunk_kda")
    assert got.keys() == {"gk"} and torch.equal(got["gk"], bounded_gate(raw, -3.0, A_log, dt_bias.view(3, 4)))


@pytest.mark.parametrize("args, match", [
    (dict(g=torch.zeros(4)), r"^g: .*rank >= 2"),
    (dict(g=[[0.0]]), r"^g: .*torch.Tensor"),
    (dict(A_log=torch.zeros(4)), r"^A_log: .*3 elements"),
    (dict(dt_bias=torch.zeros(3, 3)), r"^dt_bias: .*12 elements"),
])
def test_bounded_gate_refuses(args, match):
    call = dict(g=torch.zeros(1, 2, 3, 4), lower_bound=-1.0, **{k: v for k, v in args.items() if k != "g"})
    call["g"] = args.get("g", call["g"])
    with pytest.raises(ContractError, match=match):
        bounded_gate(**call)


def _want(raw, lower_bound, A_log, dt_bias):
    """The bounded gate in float64."""
    x = raw.double() + dt_bias.double().view(3, 4)
    return lower_bound * torch.sigmoid(A_log.double().exp()[:, None] * x)


@examples(100)
@given(value=st.floats(allow_nan=True, allow_infinity=True),
       form=st.sampled_from(["float", "0-d tensor", "1-element tensor", "float64 tensor", "numpy scalar",
                             "0-d array"]))
def test_bounded_gate_takes_exactly_the_bounds_finite_in_float32(value, form):
    """A lower_bound finite in float32, in any of its forms, gives the float64 gate; any other
    (NaN, inf, a float64 beyond float32's range: a -inf or NaN decay, silently, before) is a
    ContractError naming lower_bound, as `linear_attention` refuses such a scale."""
    raw, A_log, dt_bias = _inputs(torch.float32, seed=3)
    bound = {"float": value, "0-d tensor": torch.tensor(value),                  # float32: 1e39 is inf there
             "1-element tensor": torch.tensor([value], dtype=torch.float64),
             "float64 tensor": torch.tensor(value, dtype=torch.float64), "numpy scalar": np.float64(value),
             "0-d array": np.array(value)}[form]
    with np.errstate(over="ignore"):
        finite = math.isfinite(np.float32(value))
    if not finite:
        with pytest.raises(ContractError, match="^lower_bound: expected .*finite in float32"):
            bounded_gate(raw, bound, A_log, dt_bias)
        return
    gk = bounded_gate(raw, bound, A_log, dt_bias)
    want = _want(raw, value, A_log, dt_bias)
    assert gk.dtype == torch.float32 and bool(torch.isfinite(gk).all())
    assert (gk.double() - want).abs().max() <= 2e-6 * abs(value) + 1e-44         # + float32's subnormal step


@pytest.mark.parametrize("lower_bound, match", [
    (None, "got None"), (torch.tensor([-1.0, -2.0]), "shape \\[2\\]"), (-1e39, "-1e\\+39"),
    (-(10 ** 400), "finite in float32"), (float("nan"), "nan"), (float("-inf"), "-inf"), ("-5", "'-5'"),
    (True, "True"), (-1 + 0j, "real number"), (np.array([-1.0]), "array"),
    (torch.tensor(True), "torch.bool"), (torch.tensor(-1 + 0j), "complex64"),
    (torch.tensor(-1.0, requires_grad=True), "requires_grad"),
], ids=["None", "2-elements", "float32-overflow", "int-overflow", "nan", "-inf", "str", "bool", "complex",
        "1-d-array", "bool-tensor", "complex-tensor", "requires-grad"])
def test_bounded_gate_refuses_a_bad_lower_bound(lower_bound, match):
    """TypeError / ValueError from float(), or a -inf / NaN decay, before: a ContractError naming
    lower_bound (a bound read as a number carries no gradient: one requiring grad is refused)."""
    with pytest.raises(ContractError, match="^lower_bound: expected .*" + match):
        bounded_gate(torch.zeros(1, 2, 3, 4), lower_bound)


@pytest.mark.parametrize("name, bad", [
    ("g", torch.complex64), ("g", torch.int32), ("g", torch.bool), ("A_log", torch.complex64),
    ("A_log", torch.int64), ("dt_bias", torch.complex64), ("A_log", "meta"), ("dt_bias", "meta")],
    ids=lambda x: str(x))
def test_bounded_gate_refuses_what_float32_would_silently_change(name, bad):
    """A complex input lost its imaginary part in .to(float32), an int or bool one passed as a
    gate, one on another device failed mid-call: each a ContractError naming it, before any work."""
    args = dict(zip(("g", "A_log", "dt_bias"), _inputs(torch.float32)))
    args[name] = args[name].to(bad) if bad != "meta" else args[name].to("meta")
    with pytest.raises(ContractError, match=f"^{name}: expected " + ("device" if bad == "meta" else "a floating")):
        bounded_gate(args["g"], -5.0, args["A_log"], args["dt_bias"])


@pytest.mark.parametrize("lower_bound", [-5, np.float32(-5.0), np.array(-5.0), torch.tensor(-5.0),
                                         torch.tensor([-5.0]), torch.tensor(-5), 0.0, 2.0],
                         ids=["int", "np.float32", "0-d-array", "0-d-tensor", "1-element", "int-tensor", "0", "2"])
def test_bounded_gate_still_takes_every_real_bound(lower_bound):
    """What was accepted stays accepted, with the same result: ints, NumPy scalars and 0-d arrays,
    one-element real tensors; zero and positive bounds (fla's gate takes any, a growing state)."""
    raw, A_log, dt_bias = _inputs(torch.float32, seed=4)
    value = float(np.asarray(lower_bound.item() if isinstance(lower_bound, torch.Tensor) else lower_bound))
    assert torch.equal(bounded_gate(raw, lower_bound, A_log, dt_bias), value * bounded_gate(raw, 1.0, A_log, dt_bias))


@pytest.mark.parametrize("args, name", [
    (dict(a=torch.zeros(2, 3, dtype=torch.complex64)), "a"), (dict(a=torch.zeros(2, 3, dtype=torch.int32)), "a"),
    (dict(b=torch.zeros(2, 3, dtype=torch.complex64)), "b"),
    (dict(dt_bias=torch.zeros(3, dtype=torch.complex64)), "dt_bias"),
    (dict(decay_scale=torch.zeros(3, dtype=torch.int32)), "decay_scale"),
    (dict(dt_bias=torch.zeros(3, device="meta")), "dt_bias"), (dict(a=torch.zeros(2, 0)), "a")],
    ids=["a-complex", "a-int", "b-complex", "dt_bias-complex", "decay_scale-int", "dt_bias-device", "a-no-heads"])
def test_gate_refuses_what_float32_would_silently_change(args, name):
    """`gate`, the same class of input: refused by its dtype / device / shape checks."""
    call = dict(a=torch.zeros(2, 3), dt_bias=torch.zeros(3), decay_scale=-torch.ones(3), b=None)
    call.update(args)
    with pytest.raises(ContractError, match=f"^{name}: expected "):
        gate(**call)
