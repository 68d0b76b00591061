"""A forward step's layout, read once from vLLM's ``GDNAttentionMetadata``: the `Step` and its
`Part`s (deltarule's `BatchPlan` and the convolution's `ConvPlan` per call), shared by every
linear-attention layer of the step, whichever family's."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ...batch import BatchPlan, plan_batch
from ...conv import ConvPlan, plan_conv


@dataclass(frozen=True)
class Part:
    """One deltarule call of a step: the non-speculative sequences, or the speculative ones."""

    tokens: torch.Tensor | None    # [T] indices into the step's tokens; None: the first T in order
    count: int                     # T
    conv: ConvPlan
    plan: BatchPlan
    zero_rows: torch.Tensor | None  # state slab rows of sequences without a prior state (zeroed first)
    rows: torch.Tensor             # the state slab rows the call writes
    layout: dict                   # plan_conv's arguments (for the shadow check)
    state_indices: torch.Tensor    # the plan's rows, [N] or [N, L] (for the shadow check)
    kept: dict = field(default_factory=dict, compare=False)    # id(layer) -> its kept launches (core._Kept)


@dataclass(frozen=True)
class Step:
    metadata: object               # the GDNAttentionMetadata it was built from (identity)
    key: tuple                     # (conv width, conv columns, slots)
    parts: tuple[Part, ...]


_STEPS: OrderedDict[int, Step] = OrderedDict()


def step_of(m, *, width: int, columns: int, slots: int) -> Step:
    """The `Step` of vLLM metadata `m` (built once per step, kept for its other layers)."""
    key = (width, columns, slots)
    step = _STEPS.get(id(m))
    if step is not None and step.metadata is m and step.key == key:
        return step
    parts = []
    n_ns = m.num_decodes + m.num_prefills
    spec = m.spec_sequence_masks is not None
    if n_ns:
        qsl = m.non_spec_query_start_loc[:n_ns + 1].tolist()
        rows = m.non_spec_state_indices_tensor[:n_ns].tolist()
        has = m.has_initial_state.tolist() if m.has_initial_state is not None else [True] * n_ns
        lengths = [e - s for s, e in zip(qsl, qsl[1:])]
        tokens = m.non_spec_token_indx[:qsl[-1]].tolist() if spec else None
        parts.append(_part(lengths, rows, [not h for h in has], None, tokens, width=width, columns=columns,
                           slots=slots))
    if spec:
        n_s = m.num_spec_decodes
        qsl = m.spec_query_start_loc[:n_s + 1].tolist()
        rows = m.spec_state_indices_tensor[:n_s].tolist()
        # vLLM's kernels read column max(a - 1, 0): an a of 0 means 1 there
        accepted = [max(1, a) for a in m.num_accepted_tokens[:n_s].tolist()]
        lengths = [e - s for s, e in zip(qsl, qsl[1:])]
        tokens = m.spec_token_indx[:qsl[-1]].tolist() if n_ns else None
        parts.append(_part(lengths, rows, None, accepted, tokens, width=width, columns=columns, slots=slots))
    step = Step(m, key, tuple(parts))
    _STEPS[id(m)] = step
    while len(_STEPS) > 8:
        _STEPS.popitem(last=False)
    return step


_PARTS: OrderedDict[tuple, Part] = OrderedDict()


def _part(lengths, rows, fresh, accepted, tokens, *, width, columns, slots) -> Part:
    """The Part of a layout (host lists), kept by value: a decode step repeats the last one's."""
    key = (tuple(lengths), tuple(map(tuple, rows)) if accepted is not None else tuple(rows),
           None if fresh is None else tuple(fresh), None if accepted is None else tuple(accepted),
           None if tokens is None else tuple(tokens), width, columns, slots)
    part = _PARTS.get(key)
    if part is None:
        part = _build_part(lengths, rows, fresh, accepted, tokens, width=width, columns=columns, slots=slots)
        _PARTS[key] = part
        while len(_PARTS) > 64:
            _PARTS.popitem(last=False)
    else:
        _PARTS.move_to_end(key)
    return part


def _build_part(lengths, rows, fresh, accepted, tokens, *, width, columns, slots) -> Part:
    T = sum(lengths)
    state_indices = torch.tensor(rows, dtype=torch.int64)
    conv_rows = rows if accepted is None else state_indices[:, 0].tolist()
    if accepted is None:
        layout = dict(lengths=lengths, read_rows=conv_rows, write_rows=conv_rows, fresh=fresh)
    else:
        layout = dict(lengths=lengths, read_rows=conv_rows, write_rows=conv_rows, accepted=accepted)
    conv = plan_conv(**layout, width=width, columns=None if accepted is None else columns)
    plan = plan_batch(1, T, cu_seqlens=offsets(lengths), state_indices=state_indices, num_slots=slots,
                      num_accepted_tokens=accepted_of(layout))
    zero = [r for r, f in zip(conv_rows, fresh or ()) if f and r >= 0]
    zero_rows = torch.tensor(zero, dtype=torch.int64) if zero else None
    tokens = torch.tensor(tokens, dtype=torch.int64) if tokens is not None else None
    written = state_indices[torch.tensor(lengths, dtype=torch.int64) > 0]
    if written.dim() == 2:                    # speculative: the first L columns of each sequence
        live = torch.tensor([L for L in lengths if L > 0], dtype=torch.int64)
        written = written[torch.arange(written.shape[1]) < live[:, None]]
    written = written[written >= 0]
    return Part(tokens, T, conv, plan, zero_rows, written, layout, state_indices)


def offsets(lengths) -> torch.Tensor:
    """[N + 1] int64 ``cu_seqlens`` of the sequence lengths."""
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)


def accepted_of(layout: dict) -> torch.Tensor | None:
    """[N] int64 ``num_accepted_tokens`` of a speculative part's layout; None for the others."""
    accepted = layout.get("accepted")
    return None if accepted is None else torch.tensor(accepted, dtype=torch.int64)
