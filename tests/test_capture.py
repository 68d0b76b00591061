"""Compact capture (`linear_attention(capture=)`) and `deltarule.replay`: the contract's edges.

Every backend's captured factors are compared with the float64 reference on test.json's
`capture-*` cases by `deltarule.tools.check.compare` (tests/test_conformance.py and each backend's
own suite); here: the comparison itself, verify + replay against per-token rows, refusals.
"""

import numpy as np
import pytest
import torch

import deltarule
from deltarule import ContractError, cases
from deltarule.tools.check import capture_err

from conftest import CPU, params, rel

BACKENDS = [CPU, "torch", "reference"]


def _width(H, Hk, K, V, per_key=False):
    return (H * K if per_key else H) + Hk * K + H * V


def _spec_case(**over):
    case = dict(seed=31, B=3, T=4, Hq=2, Hk=2, Hv=4, K=16, V=12, rule="gated_delta", initial_state=True,
                state_indices=[4, -1, 1], num_slots=6)
    case.update(over)
    return case


def test_capture_err_sees_unwritten_overwritten_and_wrong_entries():
    ref = np.array([[1.0, 2.0, np.nan], [3.0, np.nan, np.nan]])
    good = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("nan"), float("nan")]])
    assert capture_err(good, ref) == 0.0
    overwritten, unwritten, wrong = good.clone(), good.clone(), good.clone()
    overwritten[1, 1] = 0.0                  # written past the sequence's count
    unwritten[0, 1] = float("nan")           # a captured entry left unwritten
    wrong[1, 0] = 3.5
    assert capture_err(overwritten, ref) == float("inf")
    assert capture_err(unwritten, ref) == float("inf")
    assert capture_err(wrong, ref) > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", params(
    _spec_case(),
    _spec_case(decay="gk", raw_gate=True, qk_l2norm=True, seed=32),
    _spec_case(update="erase_write", decay="g+gk", state_layout="vk", seed=33),
    _spec_case(state_dtype="bfloat16", seed=34),
))
def test_verify_then_replay_gives_the_accepted_tokens_state(backend, case):
    """A verify call (slab + capture) writes no row and gives the outputs of the draft tokens;
    replaying the accepted count gives the state after that token (the float64 reference run
    on the accepted tokens alone), within float32 rounding (plus one bfloat16 store)."""
    args = cases.make_inputs(case)
    per_key, layout = "gk" in args, case.get("state_layout", "kv")
    N, L = len(case["state_indices"]), case["T"]
    capture = torch.full((N, L * _width(case["Hv"], case["Hk"], case["K"], case["V"], per_key)), float("nan"))
    slab = args["initial_state"]
    before = slab.clone()
    rows = torch.tensor(case["state_indices"])
    o, state = deltarule.linear_attention(**args, capture=capture, backend=backend)
    assert state is slab and torch.equal(slab, before), "a verify call wrote a slab row"
    o_ref, _ = deltarule.linear_attention(**dict(args, initial_state=before.clone()), backend="reference")
    assert rel(o, o_ref) <= 5e-5

    accepted = torch.tensor([3, 2, 1])
    deltarule.replay(slab, capture, accepted, key_heads=case["Hk"], per_key_decay=per_key, state_indices=rows,
                     state_layout=layout)
    store = 2 ** -8 if slab.dtype == torch.bfloat16 else 0.0
    for n, (r, a) in enumerate(zip(rows.tolist(), accepted.tolist())):
        if r < 0:
            continue
        one = {name: (x[n: n + 1, :a] if name in ("q", "k", "v", "g", "gk", "beta", "erase", "write") else x)
               for name, x in args.items() if name not in ("state_indices", "initial_state")}
        _, want = deltarule.linear_attention(**one, initial_state=before[r: r + 1].float(), backend="reference")
        assert rel(slab[r], want[0]) <= 5e-5 + store, (n, a)
    untouched = [i for i in range(slab.shape[0]) if i not in rows.tolist()]
    assert torch.equal(slab[untouched], before[untouched])


def _call(**over):
    args = cases.make_inputs(dict(seed=3, B=2, T=3, Hq=2, Hk=2, Hv=2, K=8, V=8, rule="gated_delta",
                                  initial_state=True))
    args["capture"] = torch.zeros(2, 3 * _width(2, 2, 8, 8))
    args.update(over)
    return args


@pytest.mark.parametrize("change,expected", [
    (lambda a: a.update(capture=a["capture"].double()), "dtype float32"),
    (lambda a: a.update(capture=a["capture"][:1]), "[2, C * 34] with C >= 1"),
    (lambda a: a.update(capture=torch.zeros(2, 145)), "[2, C * 34] with C >= 1"),
    (lambda a: a.update(capture=torch.zeros(2, 3)), "[2, C * 34] with C >= 1"),
    (lambda a: a.update(capture=torch.zeros(4 * 34, 2).t()), "a contiguous tensor"),
    (lambda a: a.update(capture=torch.zeros(2, 2, 34)), "a rank-2 tensor"),
], ids=["float64", "rows", "width", "zero-capacity", "strided", "rank3"])
def test_bad_capture_is_refused_before_any_work(change, expected):
    args = _call()
    change(args)
    before = args["capture"].clone()
    state = args["initial_state"].clone()
    with pytest.raises(ContractError) as info:
        deltarule.linear_attention(**args)
    assert info.value.argument == "capture" and expected in str(info.value)
    assert torch.equal(args["capture"], before) and torch.equal(args["initial_state"], state)


def test_capture_sharing_an_input_is_refused():
    args = _call()
    flat = torch.zeros(2 * 3 * _width(2, 2, 8, 8) + 64)
    args["capture"] = flat[64:].view(2, -1)
    args["q"] = flat[100:148].view(1, 3, 2, 8).expand(2, 3, 2, 8)
    with pytest.raises(ContractError, match="q shares its memory") as info:
        deltarule.linear_attention(**args)
    assert info.value.argument == "capture"


def test_capture_with_gradients_or_per_token_rows_is_refused():
    args = _call()
    with pytest.raises(ContractError, match="requires grad") as info:
        deltarule.linear_attention(**dict(args, q=args["q"].requires_grad_(True)))
    assert info.value.argument == "capture"
    args = _call()
    slab = torch.zeros(8, 2, 8, 8)
    with pytest.raises(ContractError, match="2-D state_indices") as info:
        deltarule.linear_attention(**dict(args, initial_state=slab,
                                          state_indices=torch.tensor([[0, 1, 2], [3, 4, 5]])))
    assert info.value.argument == "capture" and not slab.any()



def test_a_compiled_capture_call_runs_eagerly():
    """torch.compile breaks the graph at a capture call and runs it as eager code (the capture
    buffer is written in place, which the custom ops do not declare)."""
    args = _call(capture=torch.full((2, 3 * 34), float("nan")))

    @torch.compile(backend="eager")
    def step(a):
        o, _ = deltarule.linear_attention(**a)
        return o * 2

    want = args["capture"].clone()
    o_want, _ = deltarule.linear_attention(**dict(args, capture=want), backend="torch")
    o = step(args)
    torch._dynamo.reset()
    assert torch.allclose(o, 2 * o_want, atol=1e-6) and torch.allclose(args["capture"], want, atol=1e-6)


def test_replay_refuses_bad_arguments_before_touching_the_state():
    H, K, V = 2, 8, 8
    state = torch.randn(4, H, K, V)
    capture = torch.randn(2, 3 * _width(H, H, K, V))
    before = state.clone()
    good = dict(capture=capture, count=torch.tensor([1, 2]), key_heads=H, state_indices=torch.tensor([0, 3]))
    for over, argument in [
        (dict(count=torch.tensor([1, 4])), "count[1]"),
        (dict(count=torch.tensor([-1, 0])), "count[0]"),
        (dict(count=torch.tensor([1.0, 2.0])), "count"),
        (dict(state_indices=torch.tensor([3, 3])), "state_indices[1]"),
        (dict(state_indices=torch.tensor([0, 4])), "state_indices[1]"),
        (dict(key_heads=3), "key_heads"),
        (dict(capture=capture[:, :-1].contiguous()), "capture"),
        (dict(capture=capture.double()), "capture"),
        (dict(per_key_decay=1), "per_key_decay"),
        (dict(state_indices=None), "state"),
    ]:
        with pytest.raises(ContractError) as info:
            deltarule.replay(state, **{**good, **over})
        assert info.value.argument == argument, (over, info.value)
        assert torch.equal(state, before)
    with pytest.raises(ContractError) as info:
        deltarule.replay(state, **good, state_layout="kvv")
    assert info.value.argument == "state_layout"
    # padding rows and zero counts are no-ops; a repeated padding row is fine
    deltarule.replay(state, **{**good, "count": torch.tensor([0, 0])})
    deltarule.replay(state, **{**good, "state_indices": torch.tensor([-1, -1])})
    assert torch.equal(state, before)


def test_replay_is_one_rank1_update_per_transition():
    """Against the formula written out: S <- diag(d) S + k u^T, per-key decay, GVA keys."""
    gen = torch.Generator().manual_seed(5)
    Hv, Hk, K, V, C = 4, 2, 6, 5, 2
    state = torch.randn(1, Hv, K, V, generator=gen)
    capture = torch.rand(1, C * _width(Hv, Hk, K, V, per_key=True), generator=gen)
    want = state[0].double()
    d = capture[0, : C * Hv * K].view(C, Hv, K).double()
    k = capture[0, C * Hv * K: C * (Hv * K + Hk * K)].view(C, Hk, K).double()
    u = capture[0, C * (Hv * K + Hk * K):].view(C, Hv, V).double()
    for i in range(C):
        want = d[i][:, :, None] * want + k[i].repeat_interleave(2, 0)[:, :, None] * u[i][:, None, :]
    deltarule.replay(state, capture, torch.tensor([C]), key_heads=Hk, per_key_decay=True)
    assert rel(state[0], want) < 1e-6


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_key", [False, True], ids=["g", "gk"])
def test_native_replay_matches_its_torch_twin(layout, dtype, per_key):
    """csrc/replay.c (a contiguous CPU state) against the closed form in torch ops (a strided
    state takes it): the same rows, within float32 rounding and one 16-bit store."""
    from deltarule.kernels.cpu import replay as native

    if not native.available():
        pytest.skip("the cpu backend's native kernel was not built")
    gen = torch.Generator().manual_seed(11)
    Hv, Hk, K, V, C = 4, 2, 12, 20, 3
    shape = (6, Hv, K, V) if layout == "kv" else (6, Hv, V, K)
    contiguous = torch.randn(shape, generator=gen).to(dtype)
    strided = torch.empty(shape[:2] + shape[:1:-1], dtype=dtype).transpose(-1, -2)
    strided.copy_(contiguous)
    assert not strided.is_contiguous()
    capture = torch.rand(3, C * _width(Hv, Hk, K, V, per_key), generator=gen)
    kw = dict(key_heads=Hk, per_key_decay=per_key, state_indices=torch.tensor([4, -1, 0]), state_layout=layout)
    count = torch.tensor([3, 2, 1])
    before = contiguous.clone()
    deltarule.replay(contiguous, capture, count, **kw)
    deltarule.replay(strided, capture, count, **kw)
    assert rel(contiguous[[0, 4]], strided[[0, 4]]) < (1e-6 if dtype == torch.float32 else 2 ** -8)
    assert not torch.equal(contiguous[[0, 4]], before[[0, 4]])
    assert torch.equal(contiguous[[1, 2, 3, 5]], before[[1, 2, 3, 5]])
