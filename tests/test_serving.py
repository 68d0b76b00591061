"""Serving beyond the test.json comparison: speculative decoding against chained decode
steps, the verify / accept / rollback flow, reusable batch plans, and 16-bit state
storage rounded like torch. Each test names the backend it checks."""

import pytest
import torch

import deltarule
from deltarule import cases

from conftest import CPU, assert_rows_rewritten, rel

BACKENDS = [CPU, "torch", "reference"]
CASE = {"name": "serving", "seed": 21, "B": 3, "T": 4, "Hq": 2, "Hk": 2, "Hv": 4, "K": 20, "V": 12,
        "decay": "gk", "update": "erase_write", "initial_state": True, "num_slots": 16}
ROWS = [[3, 4, 5, 6], [10, -1, 11, 12], [0, 1, 2, -1]]   # a padding entry: token 1 of sequence 1 keeps no state


def speculative(accepted=(2, 1, 3), seq_lens=(4, 4, 3), **over):
    return cases.make_inputs({**CASE, "state_indices": ROWS, "num_accepted_tokens": list(accepted),
                              "seq_lens": list(seq_lens), **over})


def one_token(args, n, t, state, backend):
    """Token t of sequence n as a dense one-token call from `state` [1, Hv, ...]."""
    step = {name: x for name, x in args.items()
            if name not in ("state_indices", "num_accepted_tokens", "seq_lens", "initial_state")}
    for name in ("q", "k", "v", "g", "gk", "beta", "erase", "write"):
        if name in step:
            step[name] = step[name][n:n + 1, t:t + 1]
    return deltarule.linear_attention(**step, initial_state=state, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_speculative_step_equals_chained_decode_steps(backend, layout):
    """Each token's stored state and output equal one-token calls chained from the accepted row."""
    args = speculative(state_layout=layout)
    slab = args["initial_state"]
    before = slab.clone()
    o, out = deltarule.linear_attention(**args, backend=backend)
    assert out is slab
    written = set()
    for n, (a, length) in enumerate(zip((2, 1, 3), (4, 4, 3))):
        state = before[ROWS[n][a - 1]][None].clone()
        for t in range(length):
            o_t, state = one_token(args, n, t, state, backend)
            assert rel(o[n, t], o_t[0, 0]) < 1e-5, (n, t)
            if ROWS[n][t] >= 0:
                written.add(ROWS[n][t])
                assert rel(slab[ROWS[n][t]], state[0]) < 1e-5, (n, t)
    assert_rows_rewritten(slab, before, written)
    assert torch.count_nonzero(o[2, 3]) == 0                  # past sequence 2's length


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_sequence_touches_nothing(backend):
    """A negative read row: zero output, and none of its rows written (even non-negative ones)."""
    args = speculative(accepted=(2, 1, 4), seq_lens=(4, 4, 4))   # sequence 2 reads ROWS[2][3] = -1
    slab = args["initial_state"]
    before = slab.clone()
    o, _ = deltarule.linear_attention(**args, backend=backend)
    assert torch.count_nonzero(o[2]) == 0
    assert_rows_rewritten(slab, before, {3, 4, 5, 6, 10, 11, 12})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T, accepted", [(6, 2), (4, 3)], ids=["accept-2-then-4-tokens", "accept-3-then-1-token"])
def test_verify_accept_and_continue(backend, T, accepted):
    """The serving flow: verify 4 draft tokens into their own rows, accept some, continue from
    the accepted token's row with the next step's num_accepted_tokens (storing from column 0
    again). The result equals running the accepted tokens and the next ones as one plain
    sequence. The second case is vLLM's ragged verify: a request with no drafts this step
    (1 token, fewer than it accepted)."""
    args = cases.make_inputs({**CASE, "B": 1, "T": T, "state_indices": [0], "num_slots": 16})
    slab, rows = args.pop("initial_state"), [7, 8, 9, 10]
    del args["state_indices"]
    start = slab[7].clone()

    def part(lo, hi, **call):
        step = {n: (x[:, lo:hi] if n in ("q", "k", "v", "g", "gk", "erase", "write") else x)
                for n, x in args.items()}
        return deltarule.linear_attention(**step, **call, backend=backend)

    part(0, 4, initial_state=slab, state_indices=torch.tensor([rows]))          # verify 4 drafts
    before = slab.clone()
    o_next, _ = part(accepted, T, initial_state=slab, state_indices=torch.tensor([rows]),
                     num_accepted_tokens=torch.tensor([accepted]))                # reads rows[accepted - 1]
    o_plain, s_plain = part(0, T, initial_state=start[None].clone())
    stored = T - accepted
    assert rel(o_next, o_plain[:, accepted:]) < 1e-5
    assert rel(slab[rows[stored - 1]], s_plain[0]) < 1e-5
    assert_rows_rewritten(slab, before, set(rows[:stored]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_plan_reused_for_every_layer(backend):
    """One plan, three layers: the same results as calls that validate their own indices, and
    the plan's tables are built once."""
    layers = [speculative(seed=30 + i) for i in range(3)]
    plan = deltarule.plan_batch(3, 4, state_indices=torch.tensor(ROWS), num_accepted_tokens=torch.tensor([2, 1, 3]),
                                seq_lens=torch.tensor([4, 4, 3]), num_slots=16)
    planned = [dict(a, initial_state=a["initial_state"].clone()) for a in layers]
    for a, b in zip(layers, planned):
        o1, s1 = deltarule.linear_attention(**a, backend=backend)
        for name in ("state_indices", "num_accepted_tokens", "seq_lens"):
            b.pop(name)
        o2, s2 = deltarule.linear_attention(**b, plan=plan, backend=backend)
        assert torch.equal(o1, o2) and torch.equal(s1, s2)
        tables = dict(plan._cache)
        assert tables, "the backend keeps no table with the plan"
    assert all(plan._cache[key] is value for key, value in tables.items())


def test_plan_holds_the_indices_it_was_built_from():
    """The plan reads its index tensors once: changing them afterwards changes nothing."""
    rows = torch.tensor([[1, 2], [3, 4]])
    plan = deltarule.plan_batch(2, 2, state_indices=rows, num_slots=5)
    rows.fill_(0)
    assert [s.read for s in plan.spans] == [1, 3]
    assert plan.token_rows.tolist() == [[1, 2], [3, 4]]
    with pytest.raises(ValueError):
        plan.token_rows[0, 0] = 7                             # read-only


@pytest.mark.parametrize("over, match", [
    pytest.param(dict(B=-1), r"^B: .*int >= 0.*-1", id="B-negative"),
    pytest.param(dict(T=2.0), r"^T: .*int >= 0.*2\.0", id="T-float"),
    pytest.param(dict(state_indices=torch.tensor([0, 1])), r"^num_slots: .*with state_indices.*None",
                 id="state_indices-without-num_slots"),
    pytest.param(dict(num_slots=4), r"^num_slots: .*None without state_indices.*4", id="num_slots-alone"),
    pytest.param(dict(state_indices=torch.tensor([0, 9]), num_slots=4), r"^state_indices\[1\]: .*< 4.*9",
                 id="row-out-of-range"),
])
def test_plan_batch_refuses_bad_arguments(over, match):
    with pytest.raises(deltarule.ContractError, match=match):
        deltarule.plan_batch(**{"B": 2, "T": 3, **over})


def state_dtype_cases():
    base = dict(CASE)
    return [
        pytest.param(dict(base, T=1), id="decode"),
        pytest.param(dict(base, T=40, decay="g", update="beta"), id="prefill-T40"),
        pytest.param(dict(base, T=1, state_indices=[5, -1, 2], num_slots=7, state_layout="vk"), id="slab-vk"),
    ]


@pytest.mark.parametrize("backend", [CPU, "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", state_dtype_cases())
def test_16_bit_state_stores_round_like_torch(backend, dtype, case):
    """A 16-bit state is storage only: the call equals the float32 call on the widened state,
    with the stored state rounded by torch (nearest even), bit for bit."""
    args = cases.make_inputs(case)
    wide = args["initial_state"].to(dtype).float()
    narrow_args = dict(args, initial_state=wide.to(dtype))
    wide_args = dict(args, initial_state=wide.clone())
    o16, s16 = deltarule.linear_attention(**narrow_args, backend=backend)
    o32, s32 = deltarule.linear_attention(**wide_args, backend=backend)
    assert s16.dtype == dtype
    assert torch.equal(o16, o32)
    assert torch.equal(s16, s32.to(dtype))


@pytest.mark.parametrize("backend", [CPU, "torch"])
def test_16_bit_speculative_rows_round_like_torch(backend):
    args = speculative()
    wide = args["initial_state"].to(torch.bfloat16).float()
    o16, s16 = deltarule.linear_attention(**dict(args, initial_state=wide.to(torch.bfloat16)), backend=backend)
    o32, s32 = deltarule.linear_attention(**dict(args, initial_state=wide.clone()), backend=backend)
    assert torch.equal(o16, o32) and torch.equal(s16, s32.to(torch.bfloat16))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_few_token_rows_in_a_long_sequence(backend, layout):
    """Per-token rows stored by a few tokens of long sequences (fla's chunk-start states; the cpu
    kernel keeps its tiles there, where most tokens storing take whole rows): each stored state
    (the read row, stored again by token 0, included) and every output equal the reference's
    (`check.expected`), other rows untouched."""
    from deltarule.tools.check import expected

    T, L = 70, 70
    rows = torch.full((2, L), -1, dtype=torch.int64)
    rows[0, 0], rows[0, 31], rows[0, 63], rows[0, 69] = 5, 1, 2, 6     # token 0 rewrites its read row
    rows[1, 0], rows[1, 47], rows[1, 59] = 7, 9, 8
    args = cases.make_inputs({**CASE, "B": 2, "T": T, "initial_state": False})
    K, V = CASE["K"], CASE["V"]
    args.update(initial_state=torch.randn(12, CASE["Hv"], *((V, K) if layout == "vk" else (K, V))),
                state_layout=layout, state_indices=rows, num_accepted_tokens=torch.tensor([1, 1]),
                seq_lens=torch.tensor([70, 60]))
    want_o, want_slab = expected(args)
    slab = args["initial_state"]
    before = slab.clone()
    o, _ = deltarule.linear_attention(**args, backend=backend)
    assert rel(o, torch.as_tensor(want_o)) < 1e-5 and rel(slab, torch.as_tensor(want_slab)) < 1e-5
    assert_rows_rewritten(slab, before, {5, 1, 2, 6, 7, 9, 8})
