"""The `torch` backend: chunked prefill plus a recurrent path, in torch ops, on any device."""

from __future__ import annotations

import torch

from ..kernels.torch import chunked_backward, recurrent_backward
from ..kernels.torch.chunked import chunked
from ..kernels.torch.recurrent import recurrent
from ..problem import Problem
from . import _prepare
from ._features import EVERYTHING

NAME = "torch"
DESCRIPTION = "chunked (WY/UT) prefill + recurrent decode in torch ops"
SUPPORTS = dict(EVERYTHING, devices="any torch device",
                note="speculative plans (per-token states) run token by token; the slab is gathered and "
                     "scattered (not in place)",
                gradients="chunked (WY) backward in torch ops for sequences over 16 tokens "
                          "(kernels/torch/chunked_backward.py), the token-serial reverse walk for shorter ones "
                          "(kernels/torch/recurrent_backward.py); every non-slab call, any device")
# Sequences up to this many tokens run token by token: below it the chunked
# form's intra-chunk work costs more than it saves (crossover between T = 16
# and 32 on the 16-head K = V = 128 layer on CPU, docs/performance.md). A
# speculative plan (per-token states) or a capture always runs token by token:
# it stores every token's state or delta, which the chunked form never forms.
RECURRENT_MAX_LEN = 16


def set_recurrent_max_len(tokens: int) -> int:
    """Set `RECURRENT_MAX_LEN` (e.g. 0: always chunked; a huge one: always recurrent) for the
    calls that follow; returns the previous value, to put back (benchmarks force either path)."""
    global RECURRENT_MAX_LEN
    previous, RECURRENT_MAX_LEN = RECURRENT_MAX_LEN, tokens
    return previous


def unavailable() -> str | None:
    return None             # torch ops only: runs wherever torch does


def available() -> bool:
    return True


def supports(p: Problem) -> str | None:
    """None: every valid call runs here, on any torch device."""
    return None


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    pk = _prepare.pack(p)
    x = _prepare.operands(p, pk)
    if p.requires_grad:
        o, S, _ = Recurrence.apply(p.scale, p.chunk_size, x.q, x.k, x.v, x.lam, x.b, x.w, x.S0)
        return _prepare.finish(p, pk, o, S)
    states = None
    if p.capture is not None:
        o, S, states, deltas = recurrent(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale,
                                         keep_states=p.plan.speculative, keep_deltas=p.capacity)
        _prepare.store_capture(p, x, deltas)
    elif pk.L <= RECURRENT_MAX_LEN or p.plan.speculative:
        o, S, states = recurrent(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale, keep_states=p.plan.speculative)
    else:
        o, S = chunked(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale, p.chunk_size)
    return _prepare.finish(p, pk, o, S, states)


class Recurrence(torch.autograd.Function):
    """`recurrent`'s contract with gradients: the forward keeps the chunk-start states
    (`recurrent_backward.checkpointed`); the backward runs chunk by chunk in matrix products
    (`chunked_backward.backward`) when the sequence is longer than RECURRENT_MAX_LEN, else
    walks the tokens in reverse (`recurrent_backward.backward`). Operands in float32, or all
    float64 (gradcheck). Returns (o, S, the chunk-start states): those are an output (not
    differentiable) so that the Function has torch.func's form (a forward without ctx,
    `setup_context`): the compiled backward op differentiates a call with `torch.func.vjp`."""

    @staticmethod
    def forward(scale, chunk_size, q, k, v, lam, b, w, S0):
        o, S, starts = recurrent_backward.checkpointed(q, k, v, lam, b, w, S0, scale, chunk_size,
                                                       recurrent_max_len=RECURRENT_MAX_LEN)
        return o, S.clone() if S is S0 else S, starts         # (no step ran: S is not S0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        scale, _, q, k, v, lam, b, w, _ = inputs
        starts = output[2]
        ctx.mark_non_differentiable(starts)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, lam, b, w, starts)

    @staticmethod
    def backward(ctx, do, dS, _dstarts):
        q, k, v, lam, b, w, starts = ctx.saved_tensors
        if do is None:
            N, L, H, G, V = *k.shape[:2], v.shape[2], q.shape[3], v.shape[3]
            do = starts.new_zeros(N, L, H, G, V)
        walk = chunked_backward if k.shape[1] > RECURRENT_MAX_LEN else recurrent_backward
        grads = walk.backward(q, k, v, lam, b, w, starts, ctx.scale, do, dS, needs=ctx.needs_input_grad[2:])
        return (None, None, *grads)
