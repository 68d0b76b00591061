"""The one record of a `linear_attention` call: every argument's name, kind, default and
whether gradients reach it, in the public order.

Everything that lists the arguments is derived from `ARGUMENTS` or checked against it:

- the signatures of `linear_attention`, `api.call` (the contract adapters' entry, which adds
  `accept_growth`), `validate` and `distributed.linear_attention`: `check_signature`, run when
  each module loads, so a function that drifts from the record does not import (they are
  written out for their docstrings and for readers);
- the custom ops' schemas (`op_schema`; a plan travels as the index tensors it was built from,
  its layout and device: `PLAN_ARGUMENTS`), their
  fakes and autograd slices (`deltarule.custom_ops`);
- the eager path `deltarule.eager` (`run`, positional in the record's order, and the key
  under which a plan keeps a call's launch: what `validate` checks of the call that its
  tensors' values and addresses do not decide), written from the record by
  `deltarule.tools.eager_source` and checked in; the order in which a kept launch takes its
  tensors (`LAUNCH_OPERANDS`).

Adding an argument is one row here, its parameter in the public functions (which refuse to
import until it is there), `python -m deltarule.tools.eager_source` (tests/test_arguments.py
fails until it ran), its check in `validation.validate`, and the backends that use it.

>>> [a.name for a in ARGUMENTS if a.differentiable][:4]
['q', 'k', 'v', 'g']
>>> op_schema(slab=True).split(", ")[10]
'Tensor(a!) initial_state'
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

REQUIRED = inspect.Parameter.empty

# kind -> the op schema's type (the plan is expanded into PLAN_ARGUMENTS)
_SCHEMA_TYPES = {"tensor": "Tensor", "tensor?": "Tensor?", "index?": "Tensor?", "state?": "Tensor?",
                 "str": "str", "float?": "float?", "float": "float", "bool": "bool", "int": "int"}


@dataclass(frozen=True)
class Argument:
    """One argument: `kind` is "tensor" (required), "tensor?" (an optional operand),
    "state?" (initial_state: a tensor, a device slab or None), "index?" (an optional index
    tensor of the batch layout), "plan?", "capture?" (an output buffer the call writes in
    place; such a call runs eagerly, so it is not in the ops' schemas), or a scalar type
    ("str", "float?", "float", "bool", "int"); `public`: in `linear_attention`'s signature (else the adapters' only)."""

    name: str
    kind: str
    default: object = REQUIRED
    differentiable: bool = False
    public: bool = True

    @property
    def tensor(self) -> bool:
        return self.kind in ("tensor", "tensor?", "state?", "index?", "capture?")


ARGUMENTS: tuple[Argument, ...] = (
    Argument("q", "tensor", differentiable=True),
    Argument("k", "tensor", differentiable=True),
    Argument("v", "tensor", differentiable=True),
    Argument("rule", "str", "gated_delta"),
    Argument("g", "tensor?", None, differentiable=True),
    Argument("gk", "tensor?", None, differentiable=True),
    Argument("beta", "tensor?", None, differentiable=True),
    Argument("erase", "tensor?", None, differentiable=True),
    Argument("write", "tensor?", None, differentiable=True),
    Argument("scale", "float?", None),
    Argument("initial_state", "state?", None, differentiable=True),
    Argument("state_layout", "str", "kv"),
    Argument("cu_seqlens", "index?", None),
    Argument("seq_lens", "index?", None),
    Argument("state_indices", "index?", None),
    Argument("num_accepted_tokens", "index?", None),
    Argument("plan", "plan?", None),
    Argument("qk_l2norm", "bool", False),
    Argument("l2norm_eps", "float", 1e-6),
    Argument("A_log", "tensor?", None, differentiable=True),
    Argument("dt_bias", "tensor?", None, differentiable=True),
    Argument("beta_sigmoid", "bool", False),
    Argument("chunk_size", "int", 64),
    # written in place, never differentiated; eager even when traced (`deltarule.custom_ops`)
    Argument("capture", "capture?", None),
    Argument("backend", "str", "auto"),
    # the adapters of runtimes that take positive log decays pass True (`api.call`)
    Argument("accept_growth", "bool", False, public=False),
)

NAMES = tuple(a.name for a in ARGUMENTS)
BY_NAME = {a.name: a for a in ARGUMENTS}
INDEX = tuple(a.name for a in ARGUMENTS if a.kind == "index?")
# the tensors a gradient reaches (and that a slab may not share memory with), in the record's order
OPERANDS = tuple(a.name for a in ARGUMENTS if a.differentiable)
# the arguments the custom ops take (a capture buffer is eager-only: `deltarule.custom_ops`)
TRACED = tuple(a for a in ARGUMENTS if a.kind != "capture?")
# a kept launch's tensors (`backends.cpu_backend.Launch`): the operands, the state last
LAUNCH_OPERANDS = tuple(n for n in OPERANDS if n != "initial_state") + ("initial_state",)
# a plan in an op's arguments: the host copies of the index tensors it was built from
# (`BatchPlan.indices`), its [B, T, num_slots (-1: none)] and its device, by which the op
# finds or rebuilds it (`engine.plan_of_indices`)
PLAN_INDICES = tuple(f"plan_{n}" for n in INDEX)
PLAN_ARGUMENTS = (*((n, "Tensor?") for n in PLAN_INDICES), ("plan_layout", "int[]?"), ("plan_device", "Device?"))


def op_names() -> tuple[str, ...]:
    """The ops' argument names, in schema order (the plan replaced by `PLAN_ARGUMENTS`)."""
    names = []
    for a in TRACED:
        names.extend(n for n, _ in PLAN_ARGUMENTS) if a.kind == "plan?" else names.append(a.name)
    return tuple(names)


def op_schema(*, slab: bool) -> str:
    """The argument list of the ops' schemas: ``slab`` marks initial_state as mutated (the slab
    op updates it in place; there it is required)."""
    parts = []
    for a in TRACED:
        if a.kind == "plan?":
            parts.extend(f"{t} {n}" for n, t in PLAN_ARGUMENTS)
        elif a.name == "initial_state" and slab:
            parts.append("Tensor(a!) initial_state")
        else:
            parts.append(f"{_SCHEMA_TYPES[a.kind]} {a.name}")
    return ", ".join(parts)


def check_signature(fn, *, without: tuple[str, ...] = (), internal: bool = False, extra: tuple[str, ...] = ()) -> None:
    """Raise TypeError unless `fn` takes the record's arguments, in its order, with its defaults
    (q, k, v positional, the rest keyword-only): the public ones (and with `internal` the
    others), `without` those named, plus `extra` ones of fn's own (anywhere)."""
    want = [a for a in ARGUMENTS if a.name not in without and (a.public or internal)]
    got = [p for p in inspect.signature(fn).parameters.values() if p.name not in extra]
    problems = []
    if [p.name for p in got] != [a.name for a in want]:
        problems.append(f"arguments {[p.name for p in got]}, the record's {[a.name for a in want]}")
    else:
        for p, a in zip(got, want):
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if a.kind == "tensor" else inspect.Parameter.KEYWORD_ONLY
            if p.default != a.default or type(p.default) is not type(a.default) or p.kind != kind:
                problems.append(f"{a.name}: {p.default!r} ({p.kind.description}), the record's {a.default!r}")
    if problems:
        raise TypeError(f"{fn.__module__}.{fn.__qualname__} differs from deltarule.arguments.ARGUMENTS: "
                        + "; ".join(problems))
