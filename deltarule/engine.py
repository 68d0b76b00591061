"""The eager path of a `linear_attention` call: plan, kept launch or validation, dispatch.

Below both `deltarule.api` (which calls `run` outside a trace) and `deltarule.library`
(whose ops run `run_call`): neither imports the other's caller.

`run` takes the record's arguments (`deltarule.arguments.NAMES`) positionally, in the
record's order: it is generated from the record (`_source`), and its callers' argument lists
are checked against the record by tests/test_arguments.py. Positional because a decode step
calls it per layer: binding 25 keywords, or building a dict of them, costs about 1 us a
call, a tenth of the whole call's Python at B = 1. `run_call` takes a dict of them.

A call whose batch layout is a plan (given, or found by its index values in `_PLANS`) and
whose signature the plan saw before runs the launch the plan keeps for it: the backend's
optional `launch(problem)` (`deltarule.backends.launch`), made when the signature is first
validated. The signature (`launch_key`) is generated from the record: everything
`validate` checks that does not depend on the tensors' values or addresses (each tensor's
presence, shape, contiguity or strides, dtype and device, whether a gradient is wanted, and
every scalar, with its type where validation tells types apart); the launch checks what
does (the sign of the log decays, a slab's overlap with the inputs) on every call. A call
with a `capture` buffer always takes the full path (no kept launch writes one).
"""

from __future__ import annotations

import collections
import operator

import torch

from . import arguments
from . import backends as _backends
from . import batch as _batch
from .batch import BatchPlan
from .errors import ContractError
from .validation import validate

_is_grad_enabled = torch.is_grad_enabled
_INDEX = arguments.INDEX
_NAMES = arguments.NAMES


def run_call(call: dict):
    """`run` on a dict of every argument of the record."""
    return run(*map(call.__getitem__, _NAMES))


def _full(call: dict):
    """The full path: validate, dispatch."""
    problem = validate(**{n: x for n, x in call.items() if n != "backend"})
    return _backends.dispatch(problem, call["backend"])


def _launch(call: dict):
    """The launch a call signature keeps, or None (the call takes the full path every time:
    its backend keeps none, or an input needs grad). Validates the call."""
    problem = validate(**{n: x for n, x in call.items() if n != "backend"})
    return _backends.launch(problem, call["backend"])


def _key_parts() -> tuple[list[str], str]:
    """The launch key's parts as expressions of the arguments' names (see the module
    docstring), and the expression of whether a gradient is wanted."""
    parts, grads = [], []
    for a in arguments.ARGUMENTS:
        x = a.name
        if a.kind in ("tensor", "tensor?", "state?"):
            layout = f"{x}.stride()" if a.kind == "state?" else f"{x}.is_contiguous()"
            part = f"({x}.shape, {layout}, {x}.dtype, {x}.device)"
            parts.append(part if a.kind == "tensor" else f"(None if {x} is None else {part})")
            if a.differentiable:            # (a device slab has no requires_grad: AttributeError, no launch)
                grads.append(f"{x}.requires_grad" if a.kind == "tensor" else f"({x} is not None and {x}.requires_grad)")
        elif a.kind == "capture?":         # a capture call never takes a kept launch (see `run`)
            continue
        elif a.kind == "str":               # validation compares strings by value alone
            parts.append(x)
        elif a.kind not in ("index?", "plan?"):     # other scalars: value and type (True == 1, 0 == False)
            parts.append(f"{x}, type({x})")
    return parts, f"_is_grad_enabled() and ({' or '.join(grads)})"


def _source() -> str:
    """`run` and `launch_key` (the same key, of a dict: for tests), generated from the record."""
    parts, grad = _key_parts()
    key = "(" + ", ".join(parts) + f", {grad})"
    names = ", ".join(_NAMES)
    call = "{" + ", ".join(f"{n!r}: {n}" for n in _NAMES) + "}"
    index = ", ".join(_INDEX)
    keyed = [n for n in _NAMES if arguments.BY_NAME[n].kind not in ("index?", "plan?", "capture?")]
    return f"""\
def run({names}):
    "(o, state) of a call: the record's arguments, positionally in its order."
    if plan is None:
        plan = _known_plan(q, initial_state, {index})
        if plan is not None:
            {" = ".join(_INDEX)} = None
    if plan is not None and capture is None and {" and ".join(f"{n} is None" for n in _INDEX)}:
        try:
            key = {key}
            launch = plan._cache[key]
        except KeyError:
            launch = plan.cached(key, lambda: _launch({call}))
        except (AttributeError, TypeError):      # not tensors, unhashable scalars: the full path says what
            launch = None
        if launch is not None:
            return launch({", ".join(arguments.LAUNCH_OPERANDS)})
    return _full({call})


def launch_key(c):
    {", ".join(keyed)} = _keyed(c)
    return {key}
"""


# Plans of calls that brought their index tensors (or none), by the indices' values: a decode
# step's layers pass the same ones, so all but the first find the plan here (reading the
# indices to the host is the only per-call cost of the layout). Least recently used first.
_PLANS: collections.OrderedDict = collections.OrderedDict()
_PLANS_KEPT = 64


def _known_plan(q, initial_state, cu_seqlens, seq_lens, state_indices, accepted) -> BatchPlan | None:
    """The plan of a call without `plan=`, from `_PLANS` or built (and kept); None where the call
    is not one a plan can take (the full validation then says why)."""
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
    plan = _PLANS.get(key)
    if plan is None:
        try:
            plan = _batch.build(B, T, device, cu_seqlens=cu_seqlens, seq_lens=seq_lens, state_indices=state_indices,
                                num_accepted_tokens=accepted, num_slots=slots)
        except ContractError:
            return None                              # the full validation raises it, in its order
        _PLANS[key] = plan
        if len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def plan_of_indices(indices: tuple, layout: list, device: torch.device) -> BatchPlan:
    """The plan a traced call passed to an op as the host copies of the index tensors it was
    built from (`BatchPlan.indices`), its [B, T, num_slots (-1: none)] and its device: found in
    `_PLANS` by those values (no device read), or rebuilt from them and validated like any
    plan (the call is then checked against it as against the original)."""
    B, T, slots = layout
    slots = None if slots < 0 else slots
    if all(x is None for x in indices):
        return _batch.dense(B, T, device)
    key = (B, T, device, slots, *(None if x is None else _values(x, x.device) for x in indices))
    plan = _PLANS.get(key)
    if plan is None:
        cu_seqlens, seq_lens, state_indices, accepted = (None if x is None else x.to(device) for x in indices)
        plan = _PLANS[key] = _batch.build(B, T, device, cu_seqlens=cu_seqlens, seq_lens=seq_lens,
                                          state_indices=state_indices, num_accepted_tokens=accepted,
                                          num_slots=slots)
        if len(_PLANS) > _PLANS_KEPT:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def _values(x, device):
    """An index tensor's part of a plan key: its dtype and values (read to the host); one on
    another device than q's is not read (ValueError: the full validation refuses it)."""
    if x is None:
        return None
    if x.device != device or x.dim() not in (1, 2):
        raise ValueError(x.device)
    values = x.tolist()
    return x.dtype, tuple(map(tuple, values)) if x.dim() == 2 else tuple(values)


_namespace = {"_is_grad_enabled": _is_grad_enabled, "_launch": _launch, "_full": _full, "_known_plan": _known_plan,
              "_keyed": operator.itemgetter(*(n for n in _NAMES
                                              if arguments.BY_NAME[n].kind not in ("index?", "plan?", "capture?")))}
exec(_source(), _namespace)                # generated once, at import: see _source
run = _namespace["run"]
launch_key = _namespace["launch_key"]
