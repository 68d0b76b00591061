"""deltarule under `torch.compile` (issue 20): a traced call becomes one of the custom ops of
`deltarule.custom_ops`, so `fullgraph=True` compiles (a graph break is an error there) and the
compiled function matches eager, gradients included. With a plan the traced code reads no index
tensor on the host (a `.tolist()` or `.item()` in traced code is a graph break, so an error
with `fullgraph=True`): the property a CUDA graph capture needs. Each test names the backend
the op runs on. The transformers models under `generate(compile_config=...)` are in
tests/test_transformers.py.
"""

import pytest
import torch

import deltarule
from deltarule import ContractError, cases
from deltarule.tools.check import expected

from conftest import CPU, rel, small_case

SLOTS = 6


class Graphs:
    """A Dynamo backend that keeps the graphs it is given and runs them eagerly: the test reads
    which deltarule ops a compiled function calls."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def ops(self) -> list[str]:
        return [str(node.target) for gm in self.graphs for node in gm.graph.nodes
                if node.op == "call_function" and "deltarule" in str(node.target)]


def compiled(fn):
    graphs = Graphs()
    torch._dynamo.reset()
    return torch.compile(fn, backend=graphs, fullgraph=True), graphs


def decode_inputs(B=2, T=1, **over):
    args = cases.make_inputs(small_case(B=B, T=T, initial_state=False, **over))
    args["initial_state"] = torch.randn(SLOTS, args["v"].shape[2], args["q"].shape[3], args["v"].shape[3])
    return args


def gated(q, k, v, g, beta, initial_state, plan, backend):
    o, state = deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=initial_state, plan=plan,
                                          backend=backend)
    return o * 2, state


@pytest.mark.parametrize("backend", [CPU, "torch"])
@pytest.mark.parametrize("T", [1, 3], ids=["decode", "verify"])
def test_fullgraph_with_a_plan_updates_the_slab_as_eager(T, backend):
    args = decode_inputs(T=T)
    rows = torch.tensor([4, 1])
    plan = deltarule.plan_batch(2, T, state_indices=rows, num_slots=SLOTS)
    want_o, want_slab = expected({**args, "state_indices": rows})
    fn, graphs = compiled(gated)
    for step in range(3):                                   # traced once, then the compiled code runs
        slab = args["initial_state"].clone()
        o, state = fn(args["q"], args["k"], args["v"], args["g"], args["beta"], slab, plan, backend)
        assert state is slab or torch.equal(state, slab)
        assert rel(o, 2 * torch.as_tensor(want_o)) < 1e-5 and rel(slab, want_slab) < 1e-5, step
    assert graphs.ops() == ["deltarule.check_slab.default", "deltarule.linear_attention_slab.default"]


def test_a_plan_reaches_the_op_as_the_host_copies_of_its_indices():
    """A plan's index tensors reach the op as its host copies (`BatchPlan.indices`: CPU int64,
    read by the op, not by traced code), never as the caller's tensors; their values are not
    guarded: a plan rebuilt with other rows reuses the same graph."""
    args = decode_inputs()
    fn, graphs = compiled(gated)
    for rows in ([4, 1], [0, 5], [2, 3]):
        indices = torch.tensor(rows, dtype=torch.int32)
        plan = deltarule.plan_batch(2, 1, state_indices=indices, num_slots=SLOTS)
        slab = args["initial_state"].clone()
        o, _ = fn(args["q"], args["k"], args["v"], args["g"], args["beta"], slab, plan, "cpu")
        want_o, want_slab = expected({**args, "state_indices": torch.tensor(rows)})
        assert rel(o, 2 * torch.as_tensor(want_o)) < 1e-5 and rel(slab, want_slab) < 1e-5, rows
        assert plan.indices[2] is not indices and plan.indices[2].tolist() == rows
    assert len(graphs.graphs) == 1
    (placeholders,) = [[n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
                       for gm in graphs.graphs]
    integers = [x for x in placeholders if not x.dtype.is_floating_point]
    assert [(x.dtype, x.device.type, tuple(x.shape)) for x in integers] == [(torch.int64, "cpu", (2,))]


def test_export_holds_the_ops_and_runs_as_eager_after_a_save_and_load(tmp_path):
    """torch.export of modules that call linear_attention, without a plan (dense and varlen),
    on a slab (state_indices as an input) and with a plan (a module attribute: its indices
    become the program's constants): the graphs hold deltarule's ops, and the programs, saved
    and loaded again (no object of this process survives that), give eager's outputs and
    slab."""
    class Fresh(torch.nn.Module):
        def forward(self, q, k, v, g, beta, cu_seqlens):
            return deltarule.linear_attention(q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens)

    class Slab(torch.nn.Module):
        def forward(self, q, k, v, g, beta, slab, rows):
            return deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=slab, state_indices=rows)[0]

    class Planned(torch.nn.Module):
        def __init__(self, plan):
            super().__init__()
            self.plan = plan

        def forward(self, q, k, v, g, beta, slab):
            return deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=slab, plan=self.plan)[0]

    varlen = cases.make_inputs(small_case(B=1, T=19, initial_state=False, cu_seqlens=[0, 7, 7, 19]))
    args = decode_inputs()
    rows = torch.tensor([4, 1])
    plan = deltarule.plan_batch(2, 1, state_indices=rows, num_slots=SLOTS)
    programs = [
        (Fresh(), tuple(varlen[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")), None),
        (Slab(), (*(args[n] for n in ("q", "k", "v", "g", "beta")), args["initial_state"], rows), 5),
        (Planned(plan), (*(args[n] for n in ("q", "k", "v", "g", "beta")), args["initial_state"]), 5),
    ]
    for i, (module, inputs, slab_at) in enumerate(programs):
        program = torch.export.export(module, tuple(x.clone() for x in inputs))
        ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function" and "deltarule" in str(n.target)]
        assert ops == (["deltarule.linear_attention.default"] if slab_at is None else
                       ["deltarule.check_slab.default", "deltarule.linear_attention_slab.default"]), ops
        torch.export.save(program, tmp_path / f"{i}.pt2")
        loaded = torch.export.load(tmp_path / f"{i}.pt2").module()
        want_inputs, got_inputs = [x.clone() for x in inputs], [x.clone() for x in inputs]
        want, got = module(*want_inputs), loaded(*got_inputs)
        for w, x in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            assert torch.equal(w, x), type(module).__name__
        if slab_at is not None:
            assert torch.equal(want_inputs[slab_at], got_inputs[slab_at]), "the slab differs"
            assert not torch.equal(got_inputs[slab_at], inputs[slab_at]), "the slab was not updated"


@pytest.mark.parametrize("backend", [CPU, "torch"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "cu_seqlens"])
def test_fullgraph_without_a_plan_matches_eager(varlen, backend):
    over = dict(B=1, T=19, cu_seqlens=[0, 7, 7, 19]) if varlen else dict(B=2, T=19)
    args = cases.make_inputs(small_case(decay="gk", update="erase_write", **over))

    def fn(args):
        o, state = deltarule.linear_attention(**args, backend=backend)
        return o.sum(-1), state

    eager = fn(args)
    fn_compiled, graphs = compiled(fn)
    for got, want in zip(fn_compiled(args), eager):
        assert got.shape == want.shape and rel(got, want) < 1e-6
    assert graphs.ops() == ["deltarule.linear_attention.default"]


TRITON = pytest.param("triton", marks=[pytest.mark.triton, pytest.mark.skipif(
    not deltarule.backends.triton_backend.available(), reason="triton: not installed, no GPU and no interpreter")])


@pytest.mark.parametrize("backend", [CPU, "torch", TRITON, "reference"])
def test_fullgraph_gradients_match_eager(backend):
    """The compiled backward (`deltarule::linear_attention_backward`: the call under
    torch.func.vjp) runs the backend's own reverse kernel, as eager code: the same gradients
    (bit for bit on torch and reference; the native and Triton kernels' runs differ in the
    last bits: 1e-7 seen)."""
    args = cases.make_inputs(small_case(B=2, T=21, decay="gk", raw_gate=True, beta_sigmoid=True))
    names = ["q", "k", "v", "g", "gk", "beta", "initial_state", "A_log", "dt_bias"]
    names = [n for n in names if args.get(n) is not None]

    def loss(args):
        o, state = deltarule.linear_attention(**args, backend=backend)
        return (o ** 2).sum() + state.sin().sum()

    def grads(fn):
        leaves = {n: args[n].clone().requires_grad_(True) for n in names}
        return torch.autograd.grad(fn({**args, **leaves}), list(leaves.values()))

    fn, graphs = compiled(loss)
    for name, got, want in zip(names, grads(fn), grads(loss)):
        assert rel(got, want) < 1e-6, name
    assert graphs.ops() == ["deltarule.linear_attention.default"]


def test_an_invalid_call_is_refused_when_the_compiled_code_runs_it():
    """Validation is the op's: the values a call is refused for are checked when it runs."""
    args = decode_inputs()
    plan = deltarule.plan_batch(2, 1, state_indices=torch.tensor([4, 1]), num_slots=SLOTS)
    fn, _ = compiled(gated)
    slab = args["initial_state"].clone()
    fn(args["q"], args["k"], args["v"], args["g"], args["beta"], slab, plan, "cpu")
    before = slab.clone()
    with pytest.raises(ContractError, match="g"):
        fn(args["q"], args["k"], args["v"], args["g"].abs() + 0.5, args["beta"], slab, plan, "cpu")
    assert torch.equal(slab, before), "a refused call modified the slab"
    with pytest.raises(ContractError, match="scale"):
        torch.compile(lambda a: deltarule.linear_attention(**a, scale=1e39), fullgraph=True)(
            {n: args[n] for n in ("q", "k", "v", "g", "beta")})


@pytest.mark.parametrize("dynamo_backend", ["eager", "aot_eager", "inductor"])
def test_a_slab_an_input_views_is_refused_under_every_dynamo_backend(dynamo_backend):
    """k a view of a slab row, made inside the compiled function: refused as in eager code, the
    slab bit-identical. Under aot_eager the slab op is handed a copy of the slab (the graph is
    functionalized, not reinplaced), so the check runs before it (`library.check_slab`)."""
    args = decode_inputs()
    plan = deltarule.plan_batch(2, 1, state_indices=torch.tensor([4, 1]), num_slots=SLOTS)

    def step(q, v, g, beta, slab, plan):
        k = slab[4].reshape(-1)[:q.numel()].view(q.shape)
        o, _ = deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=slab, plan=plan)
        return o

    torch._dynamo.reset()
    fn = torch.compile(step, fullgraph=True, backend=dynamo_backend)
    slab = args["initial_state"].clone()
    before = slab.clone()
    with pytest.raises(ContractError, match=r"^initial_state: .*no input shares.*k shares"):
        fn(args["q"], args["v"], args["g"], args["beta"], slab, plan)
    assert torch.equal(slab, before), "a refused call modified the slab"
    # the same compiled function with a k of its own runs (the check passes it)
    fn = torch.compile(lambda q, k, v, g, beta, slab, plan: gated(q, k, v, g, beta, slab, plan, "auto")[0],
                       fullgraph=True, backend=dynamo_backend)
    want_o, want_slab = expected({**args, "state_indices": torch.tensor([4, 1])})
    o = fn(args["q"], args["k"], args["v"], args["g"], args["beta"], slab, plan)
    assert rel(o, 2 * torch.as_tensor(want_o)) < 1e-5 and rel(slab, want_slab) < 1e-5
    torch._dynamo.reset()


def test_export_keeps_the_batch_dynamic():
    """The op's ``num_states`` is a SymInt: an exported call with a dynamic batch runs at
    other batch sizes (an int there pinned the batch to the traced one)."""
    class Fresh(torch.nn.Module):
        def forward(self, q, k, v, g, beta, state):
            return deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=state)

    def inputs(B):
        g = torch.Generator().manual_seed(B)
        q, k, v = (torch.randn(B, 3, 2, 16, generator=g) for _ in range(3))
        return (q, torch.nn.functional.normalize(k, dim=-1), v, -torch.rand(B, 3, 2, generator=g),
                torch.rand(B, 3, 2, generator=g), torch.randn(B, 2, 16, 16, generator=g))

    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(Fresh(), inputs(2), dynamic_shapes=tuple({0: batch} for _ in range(6)))
    for B in (1, 5):
        x = inputs(B)
        for want, got in zip(Fresh()(*x), program.module()(*x)):
            assert want.shape[0] == B and torch.equal(want, got)
