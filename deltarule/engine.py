"""The parts of a `linear_attention` call's eager path: the plan cache, the full path and the
kept launches. The path itself, `run`, is `deltarule.eager` (generated from the record).

Below both `deltarule.api` (which calls `eager.run` outside a trace) and
`deltarule.custom_ops` (whose ops run `eager.run_call` and find their plans with
`plan_of_indices`): neither imports the other's caller.

A call whose batch layout is a plan (given, or found by its index values in `_PLANS`) and
whose signature the plan saw before runs the launch the plan keeps for it: the backend's
optional `launch(problem)` (`deltarule.backends.launch`), made by `kept_launch` when the
signature is first validated. The signature (the key `eager.run` computes) is everything `validate`
checks that does not depend on the tensors' values or addresses (each tensor's presence,
shape, contiguity or strides, dtype and device, whether a gradient is wanted, and every
scalar, with its type where validation tells types apart); the launch checks what does (the
sign of the log decays, a slab's overlap with the inputs) on every call. A call with a
`capture` buffer always takes the full path (no kept launch writes one).
"""

from __future__ import annotations

import collections

import torch

from . import backends as _backends
from . import batch as _batch
from .batch import BatchPlan
from .errors import ContractError
from .validation import validate


def full_call(call: dict):
    """The full path: validate, dispatch."""
    problem = validate(**{n: x for n, x in call.items() if n != "backend"})
    return _backends.dispatch(problem, call["backend"])


def kept_launch(call: dict):
    """The launch a call signature keeps, or None (the call takes the full path every time:
    its backend keeps none, or an input needs grad). Validates the call."""
    problem = validate(**{n: x for n, x in call.items() if n != "backend"})
    return _backends.launch(problem, call["backend"])


# Plans by their layout and index values, least recently used first: a decode step's layers
# pass the same indices, so all but the first find the plan here (reading the indices to the
# host is the only per-call cost of the layout). Calls without `plan=` (`known_plan`) and the
# traced ops (`plan_of_indices`) share it.
_PLANS: collections.OrderedDict = collections.OrderedDict()
_PLANS_KEPT = 64


def _kept_plan(key: tuple, build) -> BatchPlan:
    """The plan kept under `key`, or `build()`'s, kept (the least recently used one leaves)."""
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = build()
        if len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def known_plan(q, initial_state, cu_seqlens, seq_lens, state_indices, accepted) -> BatchPlan | None:
    """The plan of a call without `plan=`, kept or built; None where the call is not one a plan
    can take (the full validation then says why)."""
    try:
        B, T, _, _ = q.shape
        device = q.device
        if cu_seqlens is None and seq_lens is None and state_indices is None and accepted is None:
            return _batch.dense(B, T, device)
        slots = None if state_indices is None else initial_state.shape[0]
        key = (B, T, device, slots, _values(cu_seqlens, device), _values(seq_lens, device),
               _values(state_indices, device), _values(accepted, device))
    except (AttributeError, TypeError, ValueError):
        return None
    try:
        return _kept_plan(key, lambda: _batch.build(B, T, device, cu_seqlens=cu_seqlens, seq_lens=seq_lens,
                                                    state_indices=state_indices, num_accepted_tokens=accepted,
                                                    num_slots=slots))
    except ContractError:
        return None                              # the full validation raises it, in its order


def plan_of_indices(indices: tuple, layout: list, device: torch.device) -> BatchPlan:
    """The plan a traced call passed to an op as the host copies of the index tensors it was
    built from (`BatchPlan.indices`), its [B, T, num_slots (-1: none)] and its device: kept
    under those values (no device read), or rebuilt from them and validated like any plan
    (the call is then checked against it as against the original)."""
    B, T, slots = layout
    slots = None if slots < 0 else slots
    if all(x is None for x in indices):
        return _batch.dense(B, T, device)
    key = (B, T, device, slots, *(None if x is None else _values(x, x.device) for x in indices))

    def build():
        cu_seqlens, seq_lens, state_indices, accepted = (None if x is None else x.to(device) for x in indices)
        return _batch.build(B, T, device, cu_seqlens=cu_seqlens, seq_lens=seq_lens, state_indices=state_indices,
                            num_accepted_tokens=accepted, num_slots=slots)
    return _kept_plan(key, build)


def _values(x, device):
    """An index tensor's part of a plan key: its dtype and values (read to the host); one on
    another device than q's is not read (ValueError: the full validation refuses it)."""
    if x is None:
        return None
    if x.device != device or x.dim() not in (1, 2):
        raise ValueError(x.device)
    values = x.tolist()
    return x.dtype, tuple(map(tuple, values)) if x.dim() == 2 else tuple(values)
