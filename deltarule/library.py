"""deltarule as torch custom ops (`torch.library`): what `torch.compile` sees of a call.

`linear_attention` (and the contract adapters, the fla drop-ins, so the transformers
integration) run eagerly as Python. Traced by Dynamo (`torch.compiler.is_compiling()`), a
call becomes one of these ops instead, so a compiled function or model runs without a graph
break, `fullgraph=True` included:

- ``deltarule::linear_attention``: every call without a slab; returns a fresh ``(o, state)``.
  Differentiable (`register_autograd`): its backward is ``deltarule::linear_attention_backward``,
  which recomputes the call with its inputs requiring grad and runs the backend's own
  reverse kernel (`torch.autograd.grad` through the eager path).
- ``deltarule::linear_attention_slab``: a slab call (``state_indices``, or a plan with slab
  rows); updates ``initial_state`` in place (declared mutated) and returns ``o``. Preceded by
  ``deltarule::check_slab`` (no outputs, kept by dead-code elimination): the aliasing rule on the
  caller's tensors, which a functionalized graph does not hand the slab op.

The ops' arguments are `linear_attention`'s, but a plan travels as its ``handle`` (a
one-element tensor the plan owns; the op finds the plan by its address,
`batch.plan_of_handle`): the traced code
reads nothing on the host, the plan's tables stay with it. The implementation is the eager
path itself (`api.call`), validation included: an invalid call raises `ContractError` when
the compiled code runs it. The fake implementations give the outputs' shapes and dtypes from
the inputs' alone (``num_states``: the rows of a fresh state, from the plan, ``cu_seqlens`` or
B, fixed when the call is traced).

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

from . import aliasing
from .batch import plan_of_handle


def _run(q, k, v, g, gk, beta, erase, write, initial_state, cu_seqlens, seq_lens, state_indices,
         num_accepted_tokens, plan_handle, A_log, dt_bias, rule, scale, state_layout, qk_l2norm, l2norm_eps,
         beta_sigmoid, chunk_size, backend, accept_growth):
    from . import api

    return api.call(q, k, v, rule=rule, g=g, gk=gk, beta=beta, erase=erase, write=write, scale=scale,
                    initial_state=initial_state, state_layout=state_layout, cu_seqlens=cu_seqlens,
                    seq_lens=seq_lens, state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
                    plan=None if plan_handle is None else plan_of_handle(plan_handle), qk_l2norm=qk_l2norm,
                    l2norm_eps=l2norm_eps, A_log=A_log, dt_bias=dt_bias, beta_sigmoid=beta_sigmoid, chunk_size=chunk_size, backend=backend,
                    accept_growth=accept_growth)


@torch.library.custom_op("deltarule::linear_attention", mutates_args=())
def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, gk: torch.Tensor | None,
    beta: torch.Tensor | None, erase: torch.Tensor | None, write: torch.Tensor | None,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, seq_lens: torch.Tensor | None,
    plan_handle: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, rule: str,
    scale: float | None, state_layout: str, qk_l2norm: bool, l2norm_eps: float, beta_sigmoid: bool,
    chunk_size: int, backend: str, accept_growth: bool, num_states: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`deltarule.linear_attention` without a slab: (o [B, T, Ho, V], state [num_states, Hv, ...])."""
    o, state = _run(q, k, v, g, gk, beta, erase, write, initial_state, cu_seqlens, seq_lens, None, None,
                    plan_handle, A_log, dt_bias, rule, scale, state_layout, qk_l2norm, l2norm_eps, beta_sigmoid,
                    chunk_size, backend, accept_growth)
    # a custom op's outputs never alias its inputs (a backend may return a view of one: T = 0)
    return _fresh(o, (q, k, v)), _fresh(state, (initial_state,))


@linear_attention.register_fake
def _(q, k, v, g, gk, beta, erase, write, initial_state, cu_seqlens, seq_lens, plan_handle, A_log, dt_bias,
      rule, scale, state_layout, qk_l2norm, l2norm_eps, beta_sigmoid, chunk_size, backend, accept_growth,
      num_states):
    B, T, Hq, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    o = v.new_empty(B, T, max(Hq, Hv), V)
    tail = (Hv, K, V) if state_layout == "kv" else (Hv, V, K)
    dtype = torch.float32 if initial_state is None else initial_state.dtype
    return o, q.new_empty(num_states, *tail, dtype=dtype)


@torch.library.custom_op("deltarule::linear_attention_slab", mutates_args=("initial_state",))
def linear_attention_slab(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, gk: torch.Tensor | None,
    beta: torch.Tensor | None, erase: torch.Tensor | None, write: torch.Tensor | None,
    initial_state: torch.Tensor, cu_seqlens: torch.Tensor | None, seq_lens: torch.Tensor | None,
    state_indices: torch.Tensor | None, num_accepted_tokens: torch.Tensor | None,
    plan_handle: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, rule: str,
    scale: float | None, state_layout: str, qk_l2norm: bool, l2norm_eps: float, beta_sigmoid: bool,
    chunk_size: int, backend: str, accept_growth: bool,
) -> torch.Tensor:
    """`deltarule.linear_attention` on a slab: updates `initial_state` in place, returns o."""
    o, _ = _run(q, k, v, g, gk, beta, erase, write, initial_state, cu_seqlens, seq_lens, state_indices,
                num_accepted_tokens, plan_handle, A_log, dt_bias, rule, scale, state_layout, qk_l2norm,
                l2norm_eps, beta_sigmoid, chunk_size, backend, accept_growth)
    return _fresh(o, (q, k, v))


@linear_attention_slab.register_fake
def _(q, k, v, g, gk, beta, erase, write, initial_state, cu_seqlens, seq_lens, state_indices,
      num_accepted_tokens, plan_handle, A_log, dt_bias, rule, scale, state_layout, qk_l2norm, l2norm_eps,
      beta_sigmoid, chunk_size, backend, accept_growth):
    B, T, Hq, _ = q.shape
    return v.new_empty(B, T, max(Hq, v.shape[2]), v.shape[3])


@torch.library.custom_op("deltarule::check_slab", mutates_args=())
def check_slab(
    initial_state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
    gk: torch.Tensor | None, beta: torch.Tensor | None, erase: torch.Tensor | None, write: torch.Tensor | None,
    A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
) -> None:
    """The aliasing rule of a slab call (`aliasing.check_written`, as `api.validate` applies it),
    on the tensors the compiled code holds before ``linear_attention_slab`` runs. That op sees
    the caller's slab only where the graph is not functionalized: under AOT autograd without
    reinplacing (``backend="aot_eager"``) it is handed a copy of the slab, which no input
    shares, so an input that is a view of the slab was accepted there."""
    aliasing.check_written("initial_state", initial_state, (
        ("q", q), ("k", k), ("v", v), ("g", g), ("gk", gk), ("beta", beta), ("erase", erase), ("write", write),
        ("A_log", A_log), ("dt_bias", dt_bias)))


@check_slab.register_fake
def _(initial_state, q, k, v, g, gk, beta, erase, write, A_log, dt_bias):
    return None


# returns nothing: without this, dead-code elimination drops it from the functionalized graph
torch.fx.node.has_side_effect(torch.ops.deltarule.check_slab.default)


# The inputs a gradient reaches, by their position among linear_attention's arguments.
_DIFFERENTIABLE = {"q": 0, "k": 1, "v": 2, "g": 3, "gk": 4, "beta": 5, "erase": 6, "write": 7,
                   "initial_state": 8, "A_log": 12, "dt_bias": 13}


@torch.library.custom_op("deltarule::linear_attention_backward", mutates_args=())
def linear_attention_backward(
    do: torch.Tensor, dstate: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, gk: torch.Tensor | None,
    beta: torch.Tensor | None, erase: torch.Tensor | None, write: torch.Tensor | None,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, seq_lens: torch.Tensor | None,
    plan_handle: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, rule: str,
    scale: float | None, state_layout: str, qk_l2norm: bool, l2norm_eps: float, beta_sigmoid: bool,
    chunk_size: int, backend: str, accept_growth: bool,
) -> list[torch.Tensor]:
    """The gradients of `linear_attention`'s o and state (do, dstate) with respect to q, k, v,
    g, gk, beta, erase, write, initial_state, A_log, dt_bias, in that order (an empty tensor
    for an absent input): the call recomputed with those inputs requiring grad, differentiated
    by the backend's own backward."""
    args = [q, k, v, g, gk, beta, erase, write, initial_state, cu_seqlens, seq_lens, plan_handle, A_log, dt_bias]
    leaves = {}
    for name, i in _DIFFERENTIABLE.items():
        if args[i] is not None:
            args[i] = leaves[name] = args[i].detach().requires_grad_(True)
    with _autograd(), torch.enable_grad():
        o, state = _run(*args[:11], None, None, *args[11:], rule, scale, state_layout, qk_l2norm, l2norm_eps,
                        beta_sigmoid, chunk_size, backend, accept_growth)
        grads = torch.autograd.grad((o, state), list(leaves.values()), (do, dstate), allow_unused=True,
                                    materialize_grads=True)
    found = dict(zip(leaves, grads))
    return [found[name].contiguous() if name in found else q.new_empty(0) for name in _DIFFERENTIABLE]


@linear_attention_backward.register_fake
def _(do, dstate, q, k, v, g, gk, beta, erase, write, initial_state, cu_seqlens, seq_lens, plan_handle, A_log,
      dt_bias, rule, scale, state_layout, qk_l2norm, l2norm_eps, beta_sigmoid, chunk_size, backend,
      accept_growth):
    args = (q, k, v, g, gk, beta, erase, write, initial_state, None, None, None, A_log, dt_bias)
    return [q.new_empty(0) if args[i] is None else torch.empty_like(args[i]) for i in _DIFFERENTIABLE.values()]


def _autograd():
    """Autograd back on inside a custom op's implementation, which runs below it (the dispatcher
    excludes the autograd keys there; torch 2.13 names them as below)."""
    K = torch._C.DispatchKey
    autograd = (torch._C.DispatchKeySet(K.AutogradFunctionality) | torch._C.DispatchKeySet(K.AutogradOther)
                | torch._C.DispatchKeySet(K.AutogradNestedTensor))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - autograd)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*(x if isinstance(x, torch.Tensor) else None for x in inputs[:14]))
    ctx.scalars = inputs[14:23]
    ctx.shapes = tuple(x.shape for x in output), tuple(x.dtype for x in output)


def _backward(ctx, do, dstate):
    tensors = ctx.saved_tensors
    (o_shape, state_shape), (o_dtype, state_dtype) = ctx.shapes
    do = tensors[0].new_zeros(o_shape, dtype=o_dtype) if do is None else do.contiguous()
    dstate = tensors[0].new_zeros(state_shape, dtype=state_dtype) if dstate is None else dstate.contiguous()
    grads = linear_attention_backward(do, dstate, *tensors, *ctx.scalars)
    result = [None] * 24
    for (name, i), grad in zip(_DIFFERENTIABLE.items(), grads):
        if tensors[i] is not None:
            result[i] = grad
    return tuple(result)


linear_attention.register_autograd(_backward, setup_context=_setup_context)


def call(q, k, v, rule, g, gk, beta, erase, write, scale, initial_state, state_layout, cu_seqlens, seq_lens,
         state_indices, num_accepted_tokens, plan, qk_l2norm, l2norm_eps, A_log, dt_bias, beta_sigmoid,
         chunk_size, backend, accept_growth):
    """A call of `linear_attention` (its arguments, in `api._call`'s order) as one of the ops."""
    handle = None if plan is None else plan.handle
    slab = state_indices is not None or (plan is not None and plan.in_place)
    if slab:
        if isinstance(initial_state, torch.Tensor):      # refused before the slab op runs (its check sees a copy)
            check_slab(initial_state, q, k, v, g, gk, beta, erase, write, A_log, dt_bias)
        o = linear_attention_slab(q, k, v, g, gk, beta, erase, write, initial_state, cu_seqlens, seq_lens,
                                  state_indices, num_accepted_tokens, handle, A_log, dt_bias, rule, scale,
                                  state_layout, qk_l2norm, l2norm_eps, beta_sigmoid, chunk_size, backend,
                                  accept_growth)
        return o, initial_state
    if plan is not None:
        num_states = plan.N
    elif cu_seqlens is not None:
        num_states = cu_seqlens.shape[0] - 1
    else:
        num_states = q.shape[0]
    return linear_attention(q, k, v, g, gk, beta, erase, write, initial_state, cu_seqlens, seq_lens, handle,
                            A_log, dt_bias, rule, scale, state_layout, qk_l2norm, l2norm_eps, beta_sigmoid,
                            chunk_size, backend, accept_growth, num_states)


def _fresh(x: torch.Tensor, inputs) -> torch.Tensor:
    """x, or a copy where it shares memory with one of `inputs` (a custom op may not alias)."""
    for y in inputs:
        if y is not None and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() and x.numel():
            return x.clone()
    return x
