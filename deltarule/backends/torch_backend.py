"""The `torch` backend: chunked prefill plus a recurrent path, in torch ops, on any device."""

from __future__ import annotations

import torch

from ..kernels.chunked import chunked
from ..kernels.recurrent import recurrent
from ..problem import Problem
from . import _prepare
from ._features import EVERYTHING

NAME = "torch"
DESCRIPTION = "chunked (WY/UT) prefill + recurrent decode in torch ops"
SUPPORTS = dict(EVERYTHING, devices="any torch device",
                note="speculative plans (per-token states) run token by token; the slab is gathered and "
                     "scattered (not in place)")
# Sequences up to this many tokens run token by token: below it the chunked
# form's intra-chunk work costs more than it saves (crossover between T = 16
# and 32 on the 16-head K = V = 128 layer on CPU, docs/performance.md). A
# speculative plan (per-token states) always runs token by token: it stores
# every token's state, which the chunked form never forms.
RECURRENT_MAX_LEN = 16


def available() -> bool:
    return True


def supports(p: Problem) -> str | None:
    """None: every valid call runs here, on any torch device."""
    return None


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    pk = _prepare.pack(p)
    x = _prepare.operands(p, pk)
    states = None
    if pk.L <= RECURRENT_MAX_LEN or p.plan.speculative:
        o, S, states = recurrent(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale, keep_states=p.plan.speculative)
    else:
        o, S = chunked(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale, p.chunk_size)
    return _prepare.finish(p, pk, o, S, states)
