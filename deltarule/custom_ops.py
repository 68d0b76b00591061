"""deltarule as torch custom ops (`torch.library`): what `torch.compile` and `torch.export` see
of a call. Registered when deltarule is imported.

`linear_attention` (and the contract adapters, the fla drop-ins, so the transformers
integration) run eagerly as Python. Traced (`torch.compiler.is_compiling()`: Dynamo,
`torch.export`), a call becomes one of these ops instead, so a compiled function or model
runs without a graph break, `fullgraph=True` included, and an exported program holds them:

- ``deltarule::linear_attention``: every call without a slab; returns a fresh ``(o, state)``.
  Differentiable (`register_autograd`): its backward is ``deltarule::linear_attention_backward``,
  which recomputes the call under `torch.func.vjp` and so runs the backend's own reverse
  kernel, as eager code does (no private dispatcher API: the implementation of an op runs
  below autograd, where `torch.autograd.grad` would see no graph, but torch.func's
  transforms work there).
- ``deltarule::linear_attention_slab``: a slab call (``state_indices``, or a plan with slab
  rows); updates ``initial_state`` in place (declared mutated) and returns ``o``. Preceded by
  ``deltarule::check_slab`` (no outputs, kept by dead-code elimination): the aliasing rule on the
  caller's tensors, which a functionalized graph does not hand the slab op.
- A call with a compact ``capture`` buffer is no op: it is a graph break and runs as eager code
  (the buffer it writes in place is not an argument the ops declare).

The short convolution's op, ``deltarule::causal_conv1d_with_state``, is registered by
`deltarule.conv.custom_ops` (this module holds the namespace's "DEF" library; that one a fragment).

The ops' arguments are the record's (`deltarule.arguments.op_schema`, in its order), but a
plan travels as the host copies of the index tensors it was built from (``plan_cu_seqlens``,
``plan_seq_lens``, ``plan_state_indices``, ``plan_num_accepted_tokens``: `BatchPlan.indices`),
its ``plan_layout`` [B, T, num_slots (-1: none)] and ``plan_device``, by whose values the op
finds the plan or rebuilds it (`engine.plan_of_indices`): the traced code reads nothing on
the host, and an exported program keeps them as constants. The
implementation is the eager path itself (`eager.run_call`), validation included: an invalid call
raises `ContractError` when the compiled code runs it. The fake implementations give the
outputs' shapes and dtypes from the inputs' alone (``num_states``: the rows of a fresh state,
from the plan, ``cu_seqlens`` or B, fixed when the call is traced).

Example (a decode step on slab rows, compiled whole; any Dynamo backend, "eager" keeps it quick)::

    >>> import torch, deltarule
    >>> slab = torch.zeros(8, 2, 16, 16)
    >>> plan = deltarule.plan_batch(2, 1, state_indices=torch.tensor([5, 1]), num_slots=8)
    >>> def step(q, k, v, g, beta, slab, plan):
    ...     o, _ = deltarule.linear_attention(q, k, v, g=g, beta=beta, initial_state=slab, plan=plan)
    ...     return o
    >>> step = torch.compile(step, fullgraph=True, backend="eager")
    >>> q, k, v = (torch.randn(2, 1, 2, 16) for _ in range(3))
    >>> o = step(q, k, v, -torch.rand(2, 1, 2), torch.rand(2, 1, 2), slab, plan)
    >>> tuple(o.shape), bool(slab[5].ne(0).any()), bool(slab[0].eq(0).all())
    ((2, 1, 2, 16), True, True)
    >>> torch._dynamo.reset()                          # (drops the compiled code and its guards)
"""

from __future__ import annotations

import torch

from . import aliasing, arguments, eager, engine

_OP_NAMES = arguments.op_names()
_PLAN_INDICES = arguments.PLAN_INDICES
# the ops' inputs a gradient reaches, by position in their schema
_DIFFERENTIABLE = tuple(_OP_NAMES.index(n) for n in arguments.OPERANDS)
_SLAB_CHECKED = tuple(n for n in arguments.OPERANDS if n != "initial_state")

_LIB = torch.library.Library("deltarule", "DEF")
# num_states is a SymInt: an int would pin the batch size when the call is exported (torch.export
# specializes a symbolic batch it meets as an int argument)
_LIB.define(f"linear_attention({arguments.op_schema(slab=False)}, SymInt num_states) -> (Tensor, Tensor)")
_LIB.define(f"linear_attention_slab({arguments.op_schema(slab=True)}) -> Tensor")
_LIB.define(f"linear_attention_backward(Tensor do, Tensor dstate, {arguments.op_schema(slab=False)}) -> Tensor[]")
_LIB.define(f"check_slab(Tensor initial_state, {', '.join(f'Tensor? {n}' for n in _SLAB_CHECKED)}) -> ()")
_ops = torch.ops.deltarule


def _call(args: tuple) -> dict:
    """An op's arguments (schema order) as the engine's call; the plan found by its indices."""
    call = dict(zip(_OP_NAMES, args), capture=None)
    indices = tuple(call.pop(n) for n in _PLAN_INDICES)
    layout, device = call.pop("plan_layout"), call.pop("plan_device")
    call["plan"] = None if layout is None else engine.plan_of_indices(indices, layout, device)
    return call


def _linear_attention(*args):
    """`deltarule.linear_attention` without a slab: (o [B, T, Ho, V], state [num_states, Hv, ...])."""
    call = _call(args[:-1])
    o, state = eager.run_call(call)
    # a custom op's outputs never alias its inputs (a backend may return a view of one: T = 0)
    return _fresh(o, (call["q"], call["k"], call["v"])), _fresh(state, (call["initial_state"],))


def _linear_attention_fake(*args):
    call = dict(zip(_OP_NAMES, args))
    q, v, initial_state = call["q"], call["v"], call["initial_state"]
    B, T, Hq, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    tail = (Hv, K, V) if call["state_layout"] == "kv" else (Hv, V, K)
    dtype = torch.float32 if initial_state is None else initial_state.dtype
    return v.new_empty(B, T, max(Hq, Hv), V), q.new_empty(args[-1], *tail, dtype=dtype)


def _linear_attention_slab(*args):
    """`deltarule.linear_attention` on a slab: updates `initial_state` in place, returns o."""
    call = _call(args)
    o, _ = eager.run_call(call)
    return _fresh(o, (call["q"], call["k"], call["v"]))


def _linear_attention_slab_fake(*args):
    call = dict(zip(_OP_NAMES, args))
    q, v = call["q"], call["v"]
    return v.new_empty(q.shape[0], q.shape[1], max(q.shape[2], v.shape[2]), v.shape[3])


def _check_slab(initial_state, *inputs):
    """The aliasing rule of a slab call (`aliasing.check_written`, as `validate` applies it),
    on the tensors the compiled code holds before ``linear_attention_slab`` runs. That op sees
    the caller's slab only where the graph is not functionalized: under AOT autograd without
    reinplacing (``backend="aot_eager"``) it is handed a copy of the slab, which no input
    shares, so an input that is a view of the slab was accepted there."""
    aliasing.check_written("initial_state", initial_state, zip(_SLAB_CHECKED, inputs))


def _backward_op(do, dstate, *args):
    """The gradients of `linear_attention`'s o and state (do, dstate) with respect to its
    operands (`arguments.OPERANDS`, in that order; an empty tensor for an absent one): the
    call recomputed under `torch.func.vjp` (public, and it works below the autograd keys,
    where a custom op's implementation runs), so the backend's own backward runs as in eager
    code (each backend's `torch.autograd.Function` has torch.func's form)."""
    call = _call(args)
    names = [n for n in arguments.OPERANDS if call[n] is not None]

    def forward(*operands):
        return eager.run_call({**call, **dict(zip(names, operands))})

    _, vjp = torch.func.vjp(forward, *(call[n] for n in names))
    found = dict(zip(names, vjp((do, dstate))))
    q = call["q"]
    return [found[name].contiguous() if name in found else q.new_empty(0) for name in arguments.OPERANDS]


def _backward_op_fake(do, dstate, *args):
    call = dict(zip(_OP_NAMES, args))
    return [call["q"].new_empty(0) if call[n] is None else torch.empty_like(call[n]) for n in arguments.OPERANDS]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*(x if isinstance(x, torch.Tensor) else None for x in inputs))
    ctx.tensors = tuple(isinstance(x, torch.Tensor) for x in inputs)
    ctx.scalars = tuple(None if isinstance(x, torch.Tensor) else x for x in inputs)
    ctx.shapes = tuple(x.shape for x in output), tuple(x.dtype for x in output)


def _backward(ctx, do, dstate):
    saved = ctx.saved_tensors
    inputs = [t if is_tensor else s for t, s, is_tensor in zip(saved, ctx.scalars, ctx.tensors)]
    (o_shape, state_shape), (o_dtype, state_dtype) = ctx.shapes
    q = inputs[0]
    do = q.new_zeros(o_shape, dtype=o_dtype) if do is None else do.contiguous()
    dstate = q.new_zeros(state_shape, dtype=state_dtype) if dstate is None else dstate.contiguous()
    grads = _ops.linear_attention_backward.default(do, dstate, *inputs[:-1])     # (not num_states)
    result = [None] * len(inputs)
    for i, grad in zip(_DIFFERENTIABLE, grads):
        if inputs[i] is not None:
            result[i] = grad
    return tuple(result)


for _name, _impl, _fake in (("linear_attention", _linear_attention, _linear_attention_fake),
                            ("linear_attention_slab", _linear_attention_slab, _linear_attention_slab_fake),
                            ("linear_attention_backward", _backward_op, _backward_op_fake),
                            ("check_slab", _check_slab, lambda *args: None)):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"deltarule::{_name}", _fake, lib=_LIB)
torch.library.register_autograd("deltarule::linear_attention", _backward, setup_context=_setup_context, lib=_LIB)
# returns nothing: without this, dead-code elimination drops it from the functionalized graph
torch.fx.node.has_side_effect(_ops.check_slab.default)


def call(call: dict):
    """A call of `linear_attention` (a dict of the record's arguments) as one of the ops,
    by keyword."""
    plan = call["plan"]
    if call["capture"] is not None:          # a graph break: the ops do not declare the buffer they'd write
        return _eager(call)
    op_args = {n: x for n, x in call.items() if n not in ("plan", "capture")}
    if plan is None:
        op_args.update(dict.fromkeys(_PLAN_INDICES), plan_layout=None, plan_device=None)
    else:
        op_args.update(zip(_PLAN_INDICES, plan.indices), plan_device=plan.device,
                       plan_layout=[plan.B, plan.T, -1 if plan.num_slots is None else plan.num_slots])
    initial_state = call["initial_state"]
    if call["state_indices"] is not None or (plan is not None and plan.in_place):
        if isinstance(initial_state, torch.Tensor):      # refused before the slab op runs (its check sees a copy)
            _ops.check_slab.default(initial_state, *(call[n] for n in _SLAB_CHECKED))
        return _ops.linear_attention_slab.default(**op_args), initial_state
    if plan is not None:
        num_states = plan.N
    elif call["cu_seqlens"] is not None:
        num_states = call["cu_seqlens"].shape[0] - 1
    else:
        num_states = call["q"].shape[0]
    return _ops.linear_attention.default(**op_args, num_states=num_states)


# a call with a compact `capture` runs as eager code under torch.compile (a graph break;
# `fullgraph=True` refuses it, torch.export cannot hold it)
_eager = torch.compiler.disable(eager.run_call)


def _fresh(x: torch.Tensor, inputs) -> torch.Tensor:
    """x, or a copy where it shares memory with one of `inputs` (a custom op may not alias)."""
    for y in inputs:
        if y is not None and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() and x.numel():
            return x.clone()
    return x
