"""Speculative verify with compact capture (`linear_attention(capture=)` + `deltarule.replay`),
timed beside the verify case's per-token rows (docs/design.md, "Compact capture").

A verify case (2-D `state_indices` [B, L], `num_accepted_tokens`) stores every token's state
into its own slab row. The compact form of the same step keeps one row per request: the
verify call reads it and captures the L transitions' factors, then `replay` applies the
accepted count. `calls` builds that step for each copy of a case's inputs; `check` compares
the row it leaves with the per-token row of the same token.
"""

from __future__ import annotations

import itertools

import torch

from ... import linear_attention, plan_batch, replay


def width(inputs: dict) -> int:
    """Floats one captured transition takes: Dw + Hk*K + Hv*V."""
    Hk, K = inputs["k"].shape[2:]
    Hv, V = inputs["v"].shape[2:]
    return (Hv * K if inputs.get("gk") is not None else Hv) + Hk * K + Hv * V


def _step(inputs: dict, backend: str):
    """The compact verify step on `inputs` (a verify case's), as a callable: each request's row
    is the one its per-token call reads (column accepted - 1)."""
    index = inputs["state_indices"].long()
    accepted = inputs["num_accepted_tokens"]
    rows = index.gather(1, (accepted.long() - 1)[:, None])[:, 0]
    B, L = index.shape
    plan = plan_batch(B, inputs["q"].shape[1], state_indices=rows, num_slots=inputs["initial_state"].shape[0])
    call = {n: x for n, x in inputs.items() if n not in ("state_indices", "num_accepted_tokens")}
    buffer = torch.empty(B, L * width(inputs))
    per_key = inputs.get("gk") is not None
    Hk = inputs["k"].shape[2]

    def run():
        linear_attention(**call, plan=plan, capture=buffer, backend=backend)
        replay(call["initial_state"], buffer, accepted, key_heads=Hk, per_key_decay=per_key, state_indices=rows)
    return run, rows


def calls(copies: list[dict], backend: str):
    """One callable cycling through `copies`, each call a whole compact verify step."""
    steps = itertools.cycle([_step(c, backend)[0] for c in copies])
    return lambda: next(steps)()


def check(inputs: dict, backend: str) -> float:
    """The largest relative difference, over requests, between the row the compact step leaves
    and the per-token row of the accepted token (both runs on copies of the slab)."""
    per_token = dict(inputs, initial_state=inputs["initial_state"].clone())
    _, slab = linear_attention(**per_token, backend=backend)
    compact = dict(inputs, initial_state=inputs["initial_state"].clone())
    run, rows = _step(compact, backend)
    run()
    index = inputs["state_indices"].long()
    want = slab[index.gather(1, (inputs["num_accepted_tokens"].long() - 1)[:, None])[:, 0]].float()
    got = compact["initial_state"][rows].float()
    return float(((got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)).max())


def state_bytes(case: dict, inputs: dict) -> tuple[int, int]:
    """(per-token rows, one row + capture buffer): state bytes a request keeps per layer."""
    element = inputs["initial_state"].element_size()
    row = case["Hv"] * case["K"] * case["V"] * element
    L = inputs["state_indices"].shape[1]
    return L * row, row + L * width(inputs) * 4
