"""The `triton` backend: fused Triton kernels for CUDA tensors.

The fused recurrence for decode and sequences up to RECURRENT_MAX_LEN tokens;
longer sequences run the chunked kernels (every gate form: scalar / per-key
decay, beta / erase + write). Varlen (`cu_seqlens`), ragged (`seq_lens`) and
padded-slab batches run unpacked when their spans are disjoint: the kernels
address each sequence's span of the [B * T] token axis (chunk indices
computed once on the host), so a long sequence beside short ones costs no
padding. Both read the initial state where it lies (any
layout, strided) and, with `state_indices`, update the slab rows in place
(a negative index: the row is never touched, the output is zero). The
kernels take the operands as given and fuse the preprocessing: the raw-gate
arm, `beta_sigmoid` and `qk_l2norm`.
Compact transition capture (`capture`): the call runs the fused recurrence at
any length (the chunked form never forms the per-token deltas), which writes
each live sequence's first C transitions into its capture row as it goes. With
a slab it is a verify: the plan the backend gets stores nothing, so the rows
are only read.
Gradients: a call whose inputs require grad runs the preprocessing in torch
ops (`_grad.differentiable_operands`), then `_Recurrence`, whose forward keeps
the state every 64 tokens and whose backward is the token-serial, V-tiled
reverse kernel of `kernels/triton/backward.py` (not yet a chunked WY backward).
Runs on CPU tensors under `TRITON_INTERPRET=1` (for tests), which must be set
before the first call imports the kernel module.
"""

from __future__ import annotations

import os
from typing import Optional
from dataclasses import dataclass

import torch

from ..problem import Problem
from . import _grad, _prepare
from ._features import EVERYTHING

NAME = "triton"
DESCRIPTION = "fused Triton recurrence (decode, short sequences) + chunked prefill"
RECURRENT_MAX_LEN = 64
SUPPORTS = dict(
    EVERYTHING,
    devices="CUDA tensors (CPU under TRITON_INTERPRET=1)",
    note=(f"prefill longer than {RECURRENT_MAX_LEN} tokens runs chunked (64-token chunks, "
          "16-token sub-chunks for per-key decay); speculative plans (per-token states) and "
          "captures run the recurrence at any length; the slab is updated in place"),
    gradients=("token-serial V-tiled Triton reverse kernel (kernels/triton/backward.py, checkpoints "
               "every 64 tokens), every non-slab call; not yet the chunked (WY) backward"),
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable() -> str | None:
    """None when the backend runs here, else why not and what to do about it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: pip install triton"
    if not (torch.cuda.is_available() or _interpreting()):
        return ("no CUDA device and TRITON_INTERPRET=1 not set (the Triton interpreter runs the "
                "kernels on the CPU; set it before the process imports triton)")
    return None


def available() -> bool:
    return unavailable() is None


def supports(p: Problem) -> str | None:
    if p.device.type != "cuda" and not _interpreting():
        return f"CUDA tensors only (or TRITON_INTERPRET=1), got device {p.device}"
    return None              # the chunked prefill takes every gate form; gradients: `_Recurrence`


@dataclass(frozen=True)
class Layout:
    """How the kernels see a call's sequences (kept with its plan, per device).

    packing: the `_prepare.Packing` of the operands (identity: the caller's [B, T] rows);
    spans: None when the sequences are the rows of [B, T], else (first token, length) per
        sequence the kernels run, in their flat token axis;
    rows: the slab row each of those sequences reads (negative: padding), as a device
        tensor, None without a slab;
    token_rows: their per-token store rows [n, L] (speculative plans), else None;
    sequences: the plan's index of each of `spans` (its capture row), None when the
        kernels' sequence n is the plan's sequence n.
    """

    packing: _prepare.Packing
    spans: list | None
    rows: torch.Tensor | None
    token_rows: torch.Tensor | None
    sequences: list | None


def flat_spans(plan) -> list[tuple[int, int, int]] | None:
    """(first token in the flat [B * T] axis, length, sequence) of every live sequence, when
    they are disjoint (the kernels then read and write the caller's token layout directly);
    None when clamped `cu_seqlens` make spans overlap (then the later one must win: packed)."""
    if plan.overlapping():
        return None
    return [(s.row * plan.T + s.start, s.length, n) for n, s in enumerate(plan.spans) if s.live]


def token_layout(p: Problem, packed: bool = False) -> Layout:
    """The call's `Layout`, built once per plan, device and `packed`.

    Varlen / ragged / padded batches with disjoint spans run unpacked: the kernels address
    the spans of the [B * T] token axis (chunk indices computed once). Clamped cu_seqlens
    whose spans overlap (or `packed`) are packed into [N, L] rows, each run for its own
    length only: the kernels fuse the raw-gate arm, so a padded step would not be identity.
    """
    plan, device = p.plan, p.device

    def build():
        flat = None if plan.dense or packed else flat_spans(plan)
        if flat is not None:
            pk = _prepare.Packing(L=plan.T, identity=True)
            spans, run = [(a, n) for a, n, _ in flat], [m for *_, m in flat]
        else:
            pk = _prepare.Packing(L=plan.T, identity=True) if plan.dense and not packed else _prepare.pack(p)
            spans = None if pk.identity else [(n * pk.L, s.length) for n, s in enumerate(plan.spans)]
            run = list(range(plan.N))
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        rows = as_t([plan.spans[m].read for m in run]) if plan.in_place else None
        tok = None
        if plan.speculative:
            tok = torch.from_numpy(plan.token_rows[run]).to(device).reshape(len(run), plan.token_rows.shape[1])
        return Layout(pk, spans, rows, tok, run if flat is not None else None)
    return plan.cached(("triton", device, packed), build)


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.triton.recurrent import recurrent

    if p.requires_grad:
        x = _grad.differentiable_operands(p)
        o, S, _ = _Recurrence.apply(p, x.q, x.k, x.v, x.g, x.gk, x.b, x.w, x.S0)
        return o.view(p.B, p.T, p.Ho, p.V).to(p.v.dtype), _grad.differentiable_state(p, S)
    lay = token_layout(p)
    x = _prepare.raw_operands(p, lay.packing)
    args = (x.q, x.k, x.v, x.g, x.gk, x.b, x.w, p.initial_state, p.scale)
    flags = dict(A_log=p.A_log, dt_bias=p.dt_bias, beta_sigmoid=p.beta_sigmoid,
                 l2norm_eps=p.l2norm_eps if p.qk_l2norm else None,
                 state_indices=lay.rows, state_layout=p.state_layout, spans=lay.spans)
    # per-token states (speculative plans) and captured transitions are only formed by the
    # recurrence, whatever the length
    if p.max_len <= RECURRENT_MAX_LEN or p.token_serial:
        o, S = recurrent(*args, token_rows=lay.token_rows, capture=p.capture, capture_rows=lay.sequences, **flags)
    else:
        from ..kernels.triton.chunked import chunked

        o, S = chunked(*args, **flags)
    if p.in_place:
        return _prepare.finish(p, lay.packing, o, None)
    # a new state in the caller's layout; finish takes a K-major view
    return _prepare.finish(p, lay.packing, o, S if p.state_layout == "kv" else S.transpose(-1, -2))


def _backward_tables(p: Problem):
    """(seq [N, 3] int64 on the device: first flat token, length, first checkpoint row; first
    [N + 1] host `triton_backward.checkpoint_rows`), kept with the plan."""
    from ..kernels.triton import backward as triton_backward

    def build():
        first = triton_backward.checkpoint_rows([s.length for s in p.spans])
        seq = torch.tensor([(s.row * p.T + s.start, s.length, int(first[n])) for n, s in enumerate(p.spans)],
                           dtype=torch.int64).reshape(-1, 3).to(p.device)
        return seq, first
    return p.plan.cached(("triton backward", p.device), build)


class _Recurrence(torch.autograd.Function):
    """The recurrence on `_grad.Operands` (float32, API token layout) -> (o [B, T, Hv, G, V]
    float32, S [N, Hv, K, V] float32). The forward keeps the state at the start of every
    64-token chunk; the backward recomputes each chunk from it and walks it in reverse
    (`kernels/triton/backward.py`, token-serial). The checkpoints are an output too (not
    differentiable): torch.func's form, as `cpu_backend._Recurrence`."""

    @staticmethod
    def forward(p, q, k, v, g, gk, b, w, S0):
        from ..kernels.triton import backward as triton_backward

        seq, first = _backward_tables(p)
        zero = not p.plan.covered()
        o, ck, S = triton_backward.forward(q, k, v, g, gk, b, w, S0, p.scale, seq, first, zero)
        return o, S, ck

    @staticmethod
    def setup_context(ctx, inputs, output):
        p, q, k, v, g, gk, b, w, _ = inputs
        ctx.mark_non_differentiable(output[2])
        ctx.p = p
        ctx.save_for_backward(q, k, v, g, gk, b, w, output[2])

    @staticmethod
    def backward(ctx, do, dS, _dck):
        p = ctx.p
        q, k, v, g, gk, b, w, ck = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        seq, _ = _backward_tables(p)
        do = None if do is None else do.float().contiguous()
        dS = None if dS is None else dS.float().contiguous()
        dq, dk, dv, dlam, db, dw, dS0 = (
            None if absent else x for x, absent in zip(
                _kernel_backward(q, k, v, g, gk, b, w, ck, do, dS, p.scale, seq, p.max_len, not p.plan.covered(),
                                 need[7]),
                (False, False, False, g is None and gk is None, b is None, w is None, not need[7])))
        dq, dk = _grad.head_sums(p, dq, dk)
        dg = None if g is None else dlam.sum(-1)
        if b is not None and b.dim() == 3:
            db = db.sum(-1)
        if w is not None and w.dim() == 3:
            dw = dw.sum(-1)
        grads = (dq, dk, dv, dg, dlam if gk is not None else None, db, dw, dS0)
        return (None, *(x if n else None for x, n in zip(grads, need)))


@torch.library.custom_op("deltarule::triton_backward", mutates_args=())
def _kernel_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                     gk: Optional[torch.Tensor], b: Optional[torch.Tensor], w: Optional[torch.Tensor],
                     ck: torch.Tensor, do: Optional[torch.Tensor], dS: Optional[torch.Tensor], scale: float,
                     seq: torch.Tensor, max_len: int, zero_outputs: bool, need_dS0: bool) -> list[torch.Tensor]:
    """`triton_backward.backward` as an op: [dq, dk, dv, dlam, db, dw, dS0], an empty tensor for
    each absent one. An op for the reason `cpu_backend._native_backward` is one (the compiled
    backward runs `_Recurrence.backward` under torch.func, whose tensors have no storage)."""
    from ..kernels.triton import backward as triton_backward

    grads = triton_backward.backward(q, k, v, g, gk, b, w, ck, do, dS, scale, seq, max_len, zero_outputs,
                                     need_dS0=need_dS0)
    return [q.new_empty(0) if x is None else x for x in grads]
